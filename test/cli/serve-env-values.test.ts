// Environment twins of `conduit serve` as a user meets them: a variable set to "" where "" means something
// (CONDUIT_ALLOWED_ORIGINS: no origin) does what the flag does, a bad value nobody typed is reported under the
// variable's name, --help works whatever the environment holds, and a variable with no effect is ignored with a
// warning rather than dropped in silence. The CLI runs as a child process; the CORS answer is read over real HTTP.
import assert from 'node:assert/strict';
import { execFile, spawn, type ChildProcess } from 'node:child_process';
import { fileURLToPath } from 'node:url';
import { describe, it } from 'node:test';

const CONDUIT = fileURLToPath(new URL('../../bin/conduit.js', import.meta.url));

function cleanEnv(env: Record<string, string>): NodeJS.ProcessEnv {
  const base = Object.fromEntries(Object.entries(process.env).filter(([key]) => !key.startsWith('CONDUIT_')));
  return { ...base, ...env };
}

interface Run { code: number | null; stdout: string; stderr: string }

function conduit(args: string[], env: Record<string, string> = {}): Promise<Run> {
  return new Promise((resolve) => {
    execFile(process.execPath, [CONDUIT, ...args], { timeout: 60_000, env: cleanEnv(env) }, (err, stdout, stderr) => {
      resolve({ code: err ? (typeof err.code === 'number' ? err.code : null) : 0, stdout, stderr });
    });
  });
}

/** Starts `conduit serve` with `args`, resolves with its URL and what it printed up to its banner; `stop()` ends it. */
async function startServe(args: string[], env: Record<string, string> = {}): Promise<{ url: string; stderr: () => string; stop: () => Promise<void> }> {
  const child: ChildProcess = spawn(process.execPath, [CONDUIT, 'serve', '--host', '127.0.0.1', '--port', '0', ...args], {
    env: cleanEnv(env), stdio: ['ignore', 'pipe', 'pipe'],
  });
  let stderr = '';
  const exited = new Promise<void>((resolve) => child.once('exit', () => resolve()));
  const url = await new Promise<string>((resolve, reject) => {
    const timer = setTimeout(() => reject(new Error(`no banner within 30 s:\n${stderr}`)), 30_000);
    child.stderr!.on('data', (chunk: Buffer) => {
      stderr += chunk.toString();
      const match = /Conduit is serving .* at (https?:\/\/\S+)/.exec(stderr);
      if (match) {
        clearTimeout(timer);
        resolve(match[1]!);
      }
    });
    child.once('exit', (code) => {
      clearTimeout(timer);
      reject(new Error(`conduit serve exited (${code}) before serving:\n${stderr}`));
    });
  });
  return {
    url, stderr: () => stderr,
    stop: async () => {
      child.kill('SIGTERM');
      await exited;
    },
  };
}

async function corsHeader(url: string): Promise<string | null> {
  const res = await fetch(`${url}/v1/models`, { headers: { Origin: 'http://elsewhere.example' } });
  await res.arrayBuffer();
  return res.headers.get('access-control-allow-origin');
}

describe('conduit serve: CONDUIT_ALLOWED_ORIGINS=""', () => {
  it('allows no origin, as --allowed-origins "" does (not the default *)', async () => {
    const server = await startServe(['--engine', 'sim'], { CONDUIT_ALLOWED_ORIGINS: '' });
    try {
      assert.equal(await corsHeader(server.url), null, 'no CORS headers for any origin');
    } finally {
      await server.stop();
    }
    const typed = await startServe(['--engine', 'sim', '--allowed-origins', '']);
    try {
      assert.equal(await corsHeader(typed.url), null);
    } finally {
      await typed.stop();
    }
  });

  it('--help says so', async () => {
    const run = await conduit(['serve', '--help']);
    assert.equal(run.code, 0);
    assert.match(run.stdout, /--allowed-origins .*"" for none.*\[env CONDUIT_ALLOWED_ORIGINS, set to "" it is "" as typed, not unset\]/);
  });
});

describe('conduit serve: a bad value from the environment', () => {
  const cases: [Record<string, string>, RegExp][] = [
    [{ CONDUIT_PORT: '-3' }, /^conduit serve: CONDUIT_PORT \(--port\) must be 0\.\.65535, got -3$/],
    [{ CONDUIT_ENGINE: 'tpu' }, /^conduit serve: CONDUIT_ENGINE \(--engine\) must be one of cpu, sim, got "tpu"$/],
    [{ CONDUIT_MAX_NUM_SEQS: '0' }, /^conduit serve: CONDUIT_MAX_NUM_SEQS \(--max-num-seqs\) must be a whole number > 0, got 0$/],
    [{ CONDUIT_HOST: ' ' }, /^conduit serve: CONDUIT_HOST \(--host\) needs an address/],
  ];
  for (const [env, pattern] of cases) {
    it(`${Object.keys(env)[0]}=${Object.values(env)[0]} is reported under the variable's name`, async () => {
      const run = await conduit(['serve'], env);
      assert.equal(run.code, 2, run.stderr);
      assert.match(run.stderr.trim(), pattern);
    });
  }

  it('the same value is reported under the flag when typed, under the variable when not', async () => {
    const typed = await conduit(['serve', '--port', '-3'], { CONDUIT_PORT: '-3' });
    assert.equal(typed.code, 2, typed.stderr);
    assert.match(typed.stderr.trim(), /^conduit serve: --port must be 0\.\.65535, got -3$/);
    const fromEnv = await conduit(['serve', '--engine', 'sim'], { CONDUIT_PORT: '-3' });
    assert.match(fromEnv.stderr.trim(), /^conduit serve: CONDUIT_PORT \(--port\) must be 0\.\.65535, got -3$/);
  });

  it('conduit generate names the variable too', async () => {
    const run = await conduit(['generate', '--prompt', 'hi'], { CONDUIT_MAX_TOKENS: '0' });
    assert.equal(run.code, 2, run.stderr);
    assert.match(run.stderr.trim(), /^conduit generate: CONDUIT_MAX_TOKENS \(--max-tokens\) must be a whole number >= 1$/);
  });

  for (const command of ['serve', 'generate']) {
    it(`does not stop conduit ${command} --help`, async () => {
      const envs: Record<string, string>[] = [{ CONDUIT_REQUEST_LOG: 'maybe', CONDUIT_PORT: 'x', CONDUIT_MAX_TOKENS: 'x' }, { CONDUIT_PORT: '-3', CONDUIT_MAX_TOKENS: '0' }];
      for (const env of envs) {
        const run = await conduit([command, '--help'], env);
        assert.equal(run.code, 0, run.stderr);
        assert.match(run.stdout, new RegExp(`^Usage: conduit ${command}`));
      }
    });
  }
});

describe('conduit serve: CONDUIT_WORKERS beside --prefill-workers and --decode-workers', () => {
  it('is ignored with a warning naming it (it does not apply), where --workers typed is refused', async () => {
    const server = await startServe(['--engine', 'sim', '--prefill-workers', '1', '--decode-workers', '1'], { CONDUIT_WORKERS: '3' });
    try {
      assert.match(server.stderr(), /WARN\s+ignoring CONDUIT_WORKERS=3: --workers is an alternative to --prefill-workers with --decode-workers/);
      assert.match(server.stderr(), /workers\s+1 prefill \+ 1 decode \(disaggregated\)/);
    } finally {
      await server.stop();
    }
  });
});
