// `conduit sim`, `plan`, `trace` and `cluster` refuse a bad value that came from the environment under the variable's
// name, as `conduit serve` does (CONDUIT_SIM_PROMPT (--prompt) must be ...), and a message about two flags names each
// by where its value came from. `conduit serve` does so too for the errors raised once it starts (a --lora-modules
// base model it does not serve, a --max-model-len the model cannot take). A typed value is named by its flag alone.
import assert from 'node:assert/strict';
import net from 'node:net';
import { describe, it } from 'node:test';
import { nameStartupEnvironment, parseServeConfig } from '../../src/cli/serve.ts';
import { runCli } from '../helpers/cli-main.ts';

async function refused(argv: string[], env: Record<string, string>, message: RegExp): Promise<void> {
  const result = await runCli(argv, env);
  assert.equal(result.code, 2, result.err);
  assert.match(result.err, message);
}

const LIFECYCLE = ['sim', 'lifecycle', '--no-check'];
const SWEEP = ['sim', 'decode-sweep', '--no-check'];

describe('conduit sim: a refused value from the environment', () => {
  it('is named by its variable and its flag', async () => {
    const cases: [string[], Record<string, string>, RegExp][] = [
      [LIFECYCLE, { CONDUIT_SIM_PROMPT: '0' }, /^conduit sim: CONDUIT_SIM_PROMPT \(--prompt\) must be a whole number >= 1, got 0$/],
      [LIFECYCLE, { CONDUIT_SIM_KV_BYTES: '3' }, /^conduit sim: CONDUIT_SIM_KV_BYTES \(--kv-bytes\) must be 2 \(BF16\) or 1 \(FP8\), got 3$/],
      [LIFECYCLE, { CONDUIT_SIM_TP: '0' }, /^conduit sim: CONDUIT_SIM_TP \(--tp\) must be a whole number >= 1, got 0$/],
      [LIFECYCLE, { CONDUIT_SIM_PROMPT: '200000' }, /^conduit sim: CONDUIT_SIM_PROMPT \(--prompt\) \(200000 tokens, plus 1 of output\) does not fit/],
      [SWEEP, { CONDUIT_SIM_BATCHES: '0' }, /^conduit sim: CONDUIT_SIM_BATCHES \(--batches\) expects whole numbers >= 1, got "0"$/],
      [SWEEP, { CONDUIT_SIM_CONTEXT: '0' }, /^conduit sim: CONDUIT_SIM_CONTEXT \(--context\) must be a whole number >= 1, got 0$/],
      [LIFECYCLE, { CONDUIT_SIM_GPU: 'x' }, /^conduit sim: CONDUIT_SIM_GPU \(--gpu\): unknown GPU "x"; known: /],
      [LIFECYCLE, { CONDUIT_SIM_MODEL: 'x' }, /^conduit sim: CONDUIT_SIM_MODEL \(--model\): unknown model "x"; known: /],
      [LIFECYCLE, { CONDUIT_SIM_LINK: 'x' }, /^conduit sim: CONDUIT_SIM_LINK \(--link\): unknown link "x"; known: /],
      [['sim', 'kv-tiers'], { CONDUIT_SIM_DISK_TIER: 'x' }, /^conduit sim: CONDUIT_SIM_DISK_TIER \(--disk-tier\) must be one of .*, got "x"$/],
    ];
    for (const [argv, env, message] of cases) await refused(argv, env, message);
  });

  it('--cached with --prompt: each named by its own source', async () => {
    await refused(['sim', 'lifecycle', '--no-check', '--cached', '50'], { CONDUIT_SIM_PROMPT: '10' },
      /^conduit sim: --cached must be at most 9 with CONDUIT_SIM_PROMPT \(--prompt\) 10 \(the last prompt token is always computed\), got 50$/);
    await refused(['sim', 'lifecycle', '--no-check', '--prompt', '10'], { CONDUIT_SIM_CACHED: '50' },
      /^conduit sim: CONDUIT_SIM_CACHED \(--cached\) must be at most 9 with --prompt 10 /);
    await refused(['sim', 'lifecycle', '--no-check', '--prompt', '10', '--cached', '50'], {},
      /^conduit sim: --cached must be at most 9 with --prompt 10 /);
  });
});

describe('conduit plan: a refused value from the environment', () => {
  it('is named by its variable and its flag', async () => {
    const cases: [Record<string, string>, RegExp][] = [
      [{ CONDUIT_PLAN_RATE: '1', CONDUIT_PLAN_MODEL: 'x' }, /^conduit plan: CONDUIT_PLAN_MODEL \(--model\): unknown model "x"; known: /],
      [{ CONDUIT_PLAN_RATE: '-1' }, /^conduit plan: CONDUIT_PLAN_RATE \(--rate\) must be > 0, got -1$/],
      [{ CONDUIT_PLAN_RATE: '1', CONDUIT_PLAN_WARMUP: '1' }, /^conduit plan: CONDUIT_PLAN_WARMUP \(--warmup\) must be in \[0, 1\), got 1$/],
      [{ CONDUIT_PLAN_RATE: '1', CONDUIT_PLAN_MAX_NUM_SEQS: '100000' }, /^conduit plan: CONDUIT_PLAN_MAX_NUM_SEQS \(--max-num-seqs\) must be at most 16384/],
      [{ CONDUIT_PLAN_RATE: '1', CONDUIT_PLAN_GPU: 'h100', CONDUIT_PLAN_WEIGHT_BYTES: '3' }, /^conduit plan: CONDUIT_PLAN_WEIGHT_BYTES \(--weight-bytes\) must be /],
    ];
    for (const [env, message] of cases) await refused(['plan'], env, message);
  });

  it('--prefix-tokens exceeding --isl, and --isl with --osl: each named by its own source', async () => {
    await refused(['plan', '--rate', '1', '--prefix-tokens', '20'], { CONDUIT_PLAN_ISL: '10' },
      /^conduit plan: --prefix-tokens 20 exceeds CONDUIT_PLAN_ISL \(--isl\) 10$/);
    await refused(['plan', '--rate', '1', '--isl', '10'], { CONDUIT_PLAN_PREFIX_TOKENS: '20' },
      /^conduit plan: CONDUIT_PLAN_PREFIX_TOKENS \(--prefix-tokens\) 20 exceeds --isl 10$/);
    await refused(['plan', '--rate', '1', '--isl', '10', '--prefix-tokens', '20'], {}, /^conduit plan: --prefix-tokens 20 exceeds --isl 10$/);
    await refused(['plan', '--rate', '1'], { CONDUIT_PLAN_OSL: '200000' },
      /^conduit plan: --isl with CONDUIT_PLAN_OSL \(--osl\) \(1024 tokens, plus 200000 of output\) does not fit/);
    await refused(['plan', '--rate', '1', '--osl', '200000'], { CONDUIT_PLAN_ISL: '1024' },
      /^conduit plan: CONDUIT_PLAN_ISL \(--isl\) with --osl \(1024 tokens, plus 200000 of output\) does not fit/);
  });
});

describe('conduit trace: a refused value from the environment', () => {
  it('is named by its variable and its flag', async () => {
    await refused(['trace', 'cmpl-1'], { CONDUIT_TRACE_TIMEOUT: '0' }, /^conduit trace: CONDUIT_TRACE_TIMEOUT \(--timeout\) must be in \(0, /);
    await refused(['trace', 'cmpl-1'], { CONDUIT_URL: 'localhost:1' }, /^conduit trace: CONDUIT_URL \(--url\) must be a URL like/);
    await refused(['trace', 'cmpl-1', '--timeout', '0'], {}, /^conduit trace: --timeout must be in \(0, /);
  });

  it('a server that does not answer within the timeout: names the variable that set it', async () => {
    const sockets = new Set<net.Socket>();
    const server = net.createServer((socket) => { sockets.add(socket); socket.on('error', () => {}); });
    await new Promise<void>((resolve) => server.listen(0, '127.0.0.1', resolve));
    try {
      const url = `http://127.0.0.1:${(server.address() as net.AddressInfo).port}`;
      const result = await runCli(['trace', 'cmpl-1', '--url', url], { CONDUIT_TRACE_TIMEOUT: '0.2' });
      assert.equal(result.code, 1, result.err);
      assert.match(result.err, /no answer from .* within 0\.2 s \(CONDUIT_TRACE_TIMEOUT \(--timeout\)\)$/);
    } finally {
      for (const socket of sockets) socket.destroy();
      await new Promise((resolve) => server.close(resolve));
    }
  });
});

describe('conduit cluster: a refused value from the environment', () => {
  it('is named by its variable and its flag, before anything starts', async () => {
    const cases: [Record<string, string>, RegExp][] = [
      [{ CONDUIT_PORT: '70000' }, /^conduit cluster: CONDUIT_PORT \(--port\) must be 0\.\.65535, got 70000$/],
      [{ CONDUIT_ENGINE: 'gpu' }, /^conduit cluster: CONDUIT_ENGINE \(--engine\) must be cpu or sim, got "gpu"$/],
      [{ CONDUIT_WORKERS: '0' }, /^conduit cluster: CONDUIT_WORKERS \(--workers\) must be a whole number >= 1, got 0$/],
      [{ CONDUIT_ROUTING_POLICY: 'x' }, /^conduit cluster: CONDUIT_ROUTING_POLICY \(--routing-policy\) must be one of /],
    ];
    for (const [env, message] of cases) await refused(['cluster'], env, message);
    await refused(['cluster', '--port', '70000'], {}, /^conduit cluster: --port must be 0\.\.65535, got 70000$/);
  });
});

describe('conduit serve: an error at start-up about a value from the environment', () => {
  it('--lora-modules with a base model not served: names CONDUIT_LORA_MODULES', async () => {
    const argv = ['serve', '--host', '127.0.0.1', '--port', '0', '--engine', 'sim'];
    await refused(argv, { CONDUIT_LORA_MODULES: 'a=/nonexistent@nope' },
      /conduit serve: CONDUIT_LORA_MODULES \(--lora-modules\) a: base model "nope" is not served/);
    await refused([...argv, '--lora-modules', 'a=/nonexistent@nope'], {}, /conduit serve: --lora-modules a: base model "nope" is not served/);
  });

  it('--max-model-len above the model\'s context: names CONDUIT_MAX_MODEL_LEN', async () => {
    const result = await runCli(['serve', '--host', '127.0.0.1', '--port', '0'], { CONDUIT_MAX_MODEL_LEN: '99999999' });
    assert.equal(result.code, 1, result.err);
    assert.match(result.err, /conduit serve: CONDUIT_MAX_MODEL_LEN \(--max-model-len\) 99999999 is above the model's context length/);
  });

  it('names the variable after a worker process\'s "could not start", and leaves typed values alone', () => {
    const fromEnv = parseServeConfig([], { CONDUIT_MAX_MODEL_LEN: '99999999' });
    const typed = parseServeConfig(['--max-model-len', '99999999'], {});
    assert.ok(fromEnv !== 'help' && typed !== 'help');
    const message = 'worker process worker-0 could not start: --max-model-len 99999999 is above the model\'s context length (2048 tokens)';
    assert.equal(nameStartupEnvironment(message, fromEnv),
      'worker process worker-0 could not start: CONDUIT_MAX_MODEL_LEN (--max-model-len) 99999999 is above the model\'s context length (2048 tokens)');
    assert.equal(nameStartupEnvironment(message, typed), message);
    assert.equal(nameStartupEnvironment(message, {}), message);
  });
});
