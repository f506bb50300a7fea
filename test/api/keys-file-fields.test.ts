// A JSON keys file (--api-keys-file) with a field Conduit does not know is refused, naming the field: a misspelt
// limit ("rmp" for "rpm") would otherwise leave its tenant unlimited without a word. A tenant configured that no key
// belongs to (a misspelt tenant name) is warned about, and the limits of the tenants that are named hold over real
// HTTP. The CLI runs as a child process.
import assert from 'node:assert/strict';
import { execFile, spawn } from 'node:child_process';
import { mkdtempSync, rmSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { fileURLToPath } from 'node:url';
import { after, describe, it } from 'node:test';

const CONDUIT = fileURLToPath(new URL('../../bin/conduit.js', import.meta.url));

function cleanEnv(): NodeJS.ProcessEnv {
  return Object.fromEntries(Object.entries(process.env).filter(([key]) => !key.startsWith('CONDUIT_')));
}

const SIM = ['serve', '--engine', 'sim', '--host', '127.0.0.1', '--port', '0'];

function conduit(args: string[]): Promise<{ code: number | null; stderr: string }> {
  return new Promise((resolve) => {
    execFile(process.execPath, [CONDUIT, ...args], { timeout: 60_000, env: cleanEnv() }, (err, _stdout, stderr) => {
      resolve({ code: err ? (typeof err.code === 'number' ? err.code : null) : 0, stderr });
    });
  });
}

describe('--api-keys-file: fields Conduit does not know', () => {
  const dir = mkdtempSync(join(tmpdir(), 'conduit-keys-fields-'));
  after(() => rmSync(dir, { recursive: true, force: true }));
  const file = (name: string, doc: unknown): string => {
    const path = join(dir, name);
    writeFileSync(path, JSON.stringify(doc));
    return path;
  };

  const cases: [string, unknown, RegExp][] = [
    ['a misspelt tenant limit', { keys: [{ key: 'sk-1', tenant: 't1' }], tenants: { t1: { rmp: 1 } } },
      /typo\.json tenants\.t1: unknown field "rmp" \(expected rpm, tpm, max_concurrent, cache_group, admin\)/],
    ['a field of a key entry', { keys: [{ key: 'sk-1', tenant: 't1', rpm: 5 }] }, /typo\.json keys\[0\]: unknown field "rpm" \(expected key, tenant\)/],
    ['a top-level field', { keys: [{ key: 'sk-1', tenant: 't1' }], tenant: { t1: { rpm: 1 } } }, /typo\.json: unknown field "tenant" \(expected keys, tenants\)/],
  ];
  for (const [what, doc, pattern] of cases) {
    it(`${what} is refused in one line naming it`, async () => {
      const run = await conduit([...SIM, '--api-keys-file', file('typo.json', doc)]);
      assert.equal(run.code, 2, run.stderr);
      assert.doesNotMatch(run.stderr, /\n\s+at /);
      assert.equal(run.stderr.trim().split('\n').length, 1, run.stderr);
      assert.match(run.stderr, pattern);
    });
  }

  it('a tenant no key belongs to is warned about; the named tenant\'s limit holds', async () => {
    const keys = file('ghost.json', {
      keys: [{ key: 'sk-acme-000001', tenant: 'acme' }],
      tenants: { acme: { rpm: 1 }, acmee: { rpm: 100 } },
    });
    const child = spawn(process.execPath, [CONDUIT, ...SIM, '--api-keys-file', keys], { env: cleanEnv(), stdio: ['ignore', 'pipe', 'pipe'] });
    const exited = new Promise<void>((resolve) => child.once('exit', () => resolve()));
    let stderr = '';
    try {
      const url = await new Promise<string>((resolve, reject) => {
        const timer = setTimeout(() => reject(new Error(`no banner:\n${stderr}`)), 30_000);
        child.stderr.on('data', (chunk: Buffer) => {
          stderr += chunk.toString();
          const match = /Conduit is serving .* at (http:\/\/\S+)/.exec(stderr);
          if (match) {
            clearTimeout(timer);
            resolve(match[1]!);
          }
        });
        child.once('exit', () => reject(new Error(`exited before serving:\n${stderr}`)));
      });
      assert.match(stderr, /WARN\s+.*ghost\.json: tenant acmee is configured but no key belongs to it/);
      assert.doesNotMatch(stderr, /tenant acme is configured/);
      const res = await fetch(`${url}/v1/completions`, {
        method: 'POST', headers: { Authorization: 'Bearer sk-acme-000001', 'Content-Type': 'application/json' },
        body: JSON.stringify({ prompt: 'hi', max_tokens: 1 }),
      });
      await res.arrayBuffer();
      const second = await fetch(`${url}/v1/completions`, {
        method: 'POST', headers: { Authorization: 'Bearer sk-acme-000001', 'Content-Type': 'application/json' },
        body: JSON.stringify({ prompt: 'hi', max_tokens: 1 }),
      });
      await second.arrayBuffer();
      assert.equal(res.status, 200);
      assert.equal(second.status, 429, 'rpm 1: the second request of the minute is refused');
    } finally {
      child.kill('SIGTERM');
      await exited;
    }
  });
});
