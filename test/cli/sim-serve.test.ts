// `conduit serve --engine sim` and `conduit worker --engine sim` with a deployment that names no profile, or a
// tensor-parallel degree the model cannot split over: one line naming what is wrong, exit code 2, no stack trace
// (the profile lookups' RangeError used to escape as an uncaught exception). Nothing starts, so no port is held.
import assert from 'node:assert/strict';
import { describe, it } from 'node:test';
import { runCli } from '../helpers/cli-main.ts';

// Unreachable services: a worker is refused before it connects to them.
const SERVICES = ['--cluster-token', 't', '--etcd-endpoints', 'http://127.0.0.1:1', '--nats-server', 'nats://127.0.0.1:1'];

const CASES: [string[], Record<string, string>, RegExp][] = [
  [['--sim-model', 'nope'], {}, /unknown model "nope"; known: llama-3\.1-8b/],
  [['--sim-gpu', 'nope'], {}, /unknown GPU "nope"; known: h100/],
  // Llama 3.1 8B has 32 attention heads: 3 does not divide them.
  [['--sim-tp', '3'], {}, /Llama 3\.1 8B: 32 attention heads do not divide over tp 3/],
  [[], { CONDUIT_SIM_MODEL: 'nope' }, /unknown model "nope"/],
];

function assertOneLine(command: string, result: { code: number; err: string }, message: RegExp): void {
  assert.equal(result.code, 2, result.err);
  assert.match(result.err, new RegExp(`^conduit ${command}: ${message.source}`));
  assert.doesNotMatch(result.err, /\n\s+at /, 'no stack trace');
}

describe('simulated workers naming no profile', () => {
  it('conduit serve says so in one line, exit code 2', async () => {
    for (const [argv, env, message] of CASES) {
      assertOneLine('serve', await runCli(['serve', '--engine', 'sim', ...argv, '--port', '0', '--log-level', 'silent'], env), message);
    }
  });

  it('conduit worker says so in one line, exit code 2', async () => {
    for (const [argv, env, message] of CASES) {
      assertOneLine('worker', await runCli(['worker', ...SERVICES, '--engine', 'sim', ...argv], env), message);
    }
  });
});
