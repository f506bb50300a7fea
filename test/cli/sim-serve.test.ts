// `conduit serve --engine sim` and `conduit worker --engine sim` with a deployment that names no profile, a
// tensor-parallel degree the model cannot split over, or weights that leave no HBM for the KV cache: one line naming
// what is wrong and the option that set it (by its variable too when the environment gave the value), exit code 2,
// no stack trace (the profile lookups' RangeError used to escape as an uncaught exception). Nothing starts, so no
// port is held.
import assert from 'node:assert/strict';
import { describe, it } from 'node:test';
import { runCli } from '../helpers/cli-main.ts';

// Unreachable services: a worker is refused before it connects to them.
const SERVICES = ['--cluster-token', 't', '--etcd-endpoints', 'http://127.0.0.1:1', '--nats-server', 'nats://127.0.0.1:1'];

const MODELS = 'llama-3.1-8b, llama-3.1-70b, llama-3.1-405b, qwen2.5-7b, qwen2.5-72b, qwen3-30b-a3b, mixtral-8x7b, deepseek-v3';
const NO_HBM = 'Llama 3.1 70B on 1 x H100 SXM5 80GB: the weights leave no HBM for the KV cache';

const CASES: [string[], Record<string, string>, string][] = [
  [['--sim-model', 'nope'], {}, `--sim-model: unknown model "nope"; known: ${MODELS}`],
  [[], { CONDUIT_SIM_MODEL: 'nope' }, `CONDUIT_SIM_MODEL (--sim-model): unknown model "nope"; known: ${MODELS}`],
  [['--sim-gpu', 'nope'], {}, '--sim-gpu: unknown GPU "nope"; known: h100, h200, a100, b200'],
  [[], { CONDUIT_SIM_GPU: 'nope' }, 'CONDUIT_SIM_GPU (--sim-gpu): unknown GPU "nope"; known: h100, h200, a100, b200'],
  // Llama 3.1 8B has 32 attention heads: 3 does not divide them.
  [['--sim-tp', '3'], {}, '--sim-tp: Llama 3.1 8B: 32 attention heads do not divide over tp 3'],
  [[], { CONDUIT_SIM_TP: '3' }, 'CONDUIT_SIM_TP (--sim-tp): Llama 3.1 8B: 32 attention heads do not divide over tp 3'],
  // Llama 3.1 70B's 141 GB of BF16 weights on one 80 GB H100.
  [['--sim-model', 'llama-3.1-70b'], {}, `--sim-model: ${NO_HBM}; use a larger --sim-tp or a --sim-gpu with more memory`],
  [[], { CONDUIT_SIM_MODEL: 'llama-3.1-70b', CONDUIT_SIM_TP: '1' },
    `CONDUIT_SIM_MODEL (--sim-model): ${NO_HBM}; use a larger CONDUIT_SIM_TP (--sim-tp) or a --sim-gpu with more memory`],
];

function assertOneLine(command: string, result: { code: number; err: string }, message: string): void {
  assert.equal(result.code, 2, result.err);
  // The whole of stderr: one line, no stack trace.
  assert.equal(result.err, `conduit ${command}: ${message}`);
}

describe('simulated workers that cannot exist', () => {
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
