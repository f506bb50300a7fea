// A model that cannot be loaded, or a configuration its engine worker refuses, is a user's mistake, not a bug: `conduit
// serve` and `conduit generate` print one line naming the problem and exit 1 (2 for a flag value no model takes), with
// no stack trace. The CLI runs as a child process, as a user runs it.
import assert from 'node:assert/strict';
import { execFile } from 'node:child_process';
import { mkdtempSync, rmSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { fileURLToPath } from 'node:url';
import { after, describe, it } from 'node:test';
import { makeTinyModel, writeTinyGguf } from '../model/loader-fixtures.ts';
import { sharedModel, skipUnlessShared } from '../helpers/shared-models.ts';

const CONDUIT = fileURLToPath(new URL('../../bin/conduit.js', import.meta.url));

interface Run { code: number | null; stdout: string; stderr: string }

function conduit(args: string[]): Promise<Run> {
  return new Promise((resolve) => {
    execFile(process.execPath, [CONDUIT, ...args], {
      timeout: 60_000,
      // No keys from the environment of the test run; no warning about open mode either way matters here.
      env: { ...process.env, CONDUIT_LOG_LEVEL: 'error' },
    }, (err, stdout, stderr) => {
      resolve({ code: err ? (typeof err.code === 'number' ? err.code : null) : 0, stdout, stderr });
    });
  });
}

function assertOneLine(run: Run, command: string, pattern: RegExp, code = 1): void {
  assert.equal(run.code, code, `exit code; stderr:\n${run.stderr}`);
  const lines = run.stderr.trim().split('\n');
  assert.equal(lines.length, 1, `one line, got:\n${run.stderr}`);
  assert.match(lines[0]!, new RegExp(`^conduit ${command}: `));
  assert.match(lines[0]!, pattern);
  assert.doesNotMatch(run.stderr, /\n\s+at /, 'no stack trace');
}

describe('a model that cannot load', () => {
  const dir = mkdtempSync(join(tmpdir(), 'conduit-model-errors-'));
  after(() => rmSync(dir, { recursive: true, force: true }));

  const gpt2 = join(dir, 'gpt2.gguf');
  writeTinyGguf(gpt2, makeTinyModel(), { metadata: { 'general.architecture': 'gpt2' } });
  const notGguf = join(dir, 'notes.gguf');
  writeFileSync(notGguf, 'this is not a model\n');

  const cases: [string, string, RegExp][] = [
    ['a missing file', join(dir, 'missing.gguf'), /missing\.gguf: no such file or folder/],
    ['an unsupported architecture', gpt2, /architecture "gpt2" is not supported/],
    ['a file that is not GGUF', notGguf, /notes\.gguf/],
  ];
  for (const command of ['serve', 'generate']) {
    const extra = command === 'serve' ? ['--port', '0', '--host', '127.0.0.1'] : ['--prompt', 'hi'];
    for (const [what, path, pattern] of cases) {
      it(`conduit ${command}: ${what} is one line and exit 1`, async () => {
        assertOneLine(await conduit([command, '--model', path, ...extra]), command, pattern);
      });
    }
    it(`conduit ${command}: a vocabulary-only GGUF is one line and exit 1`, { skip: skipUnlessShared('ggml-vocab-llama-spm.gguf') }, async () => {
      const run = await conduit([command, '--model', sharedModel('ggml-vocab-llama-spm.gguf')!, ...extra]);
      assertOneLine(run, command, /has no tensors \(a vocabulary-only GGUF\?\)/);
    });
  }
});

describe('a configuration the engine worker refuses at start', () => {
  // The built-in model (2048 tokens of context), made once by ensureBuiltinModel in the cache folder.
  // A flag value no model could take is a usage error (exit 2), as the offload tiers' sizes are.
  const cases: [string, string[], RegExp, number][] = [
    ['--max-model-len above the model\'s context', ['--max-model-len', '100000'], /--max-model-len 100000 is above the model's context length \(2048 tokens\)/, 1],
    ['a KV cache smaller than one block', ['--kv-cache-memory', '1KiB'], /--kv-cache-memory 1024 bytes holds no block/, 2],
  ];
  for (const [what, flags, pattern, code] of cases) {
    it(`conduit serve: ${what} is one line and exit ${code}`, async () => {
      assertOneLine(await conduit(['serve', '--port', '0', '--host', '127.0.0.1', ...flags]), 'serve', pattern, code);
    });
  }
});
