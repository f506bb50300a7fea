// `conduit worker`'s LoRA and model options are checked before anything starts: --lora-modules on a `conduit serve
// --worker-processes` child is refused by name, as are bad --max-loras / --max-lora-rank values; --model NAME=PATH
// names the worker's one model as serve's flag does; etcd's client certificate and key go together; --kv-port is a
// prefill worker's. Values serve refuses are refused here too, and start-up failures (the model, the engine's
// options, the port) are one line, as `conduit serve` gives them. A `--parent-ipc` child reads none of the worker's
// options from its environment, ignores the usual signals, stops when its IPC channel closes, and sends the reason it
// could not start over that channel.
// (Workers of every role take --lora-modules: test/cluster/lora-disagg.test.ts.)
import assert from 'node:assert/strict';
import { mkdtempSync, rmSync, writeFileSync } from 'node:fs';
import net from 'node:net';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { after, describe, it } from 'node:test';
import { UsageError } from '../../src/cli/flags.ts';
import { workerCommand } from '../../src/cli/worker.ts';
import { freePort, startConduit, stopAll, type Proc } from '../helpers/cluster-services.ts';

// Unreachable services: every case is refused before a connection is tried.
const SERVICES = ['--cluster-token', 't', '--etcd-endpoints', 'http://127.0.0.1:1', '--nats-server', 'nats://127.0.0.1:1'];

describe('conduit worker: LoRA options', () => {
  const refused = (args: string[], pattern: RegExp) =>
    assert.rejects(workerCommand.run([...SERVICES, ...args]), (error: unknown) => error instanceof UsageError && pattern.test(error.message));

  it('refuses --lora-modules on a serve child, and bad caps', async () => {
    await refused(['--parent-ipc', '--lora-modules', 'a=/adapters/a.gguf'], /parent's option/);
    await refused(['--lora-modules', 'a=/x.gguf,a=/y.gguf'], /names "a" twice/);
    await refused(['--max-loras', '0'], /--max-loras must be a whole number > 0/);
    await refused(['--max-lora-rank', '-1'], /--max-lora-rank must be a whole number > 0/);
    await refused(['--served-model-name', 'llama', '--lora-modules', 'a=/x.gguf@qwen'], /base model "qwen" is not this worker's \(llama\)/);
  });

});

describe('conduit worker: its one model', () => {
  const refused = (args: string[], pattern: RegExp) =>
    assert.rejects(workerCommand.run([...SERVICES, ...args]), (error: unknown) => error instanceof UsageError && pattern.test(error.message));

  it('names it with --model NAME=PATH as serve does, or with --served-model-name, not both differently', async () => {
    // The name from NAME=PATH is the one an adapter's @BASE must match.
    await refused(['--model', 'llama=/models/m.gguf', '--lora-modules', 'a=/x.gguf@qwen'], /base model "qwen" is not this worker's \(llama\)/);
    await refused(['--model', 'llama=/models/m.gguf', '--served-model-name', 'other'], /is named "llama" and --served-model-name names it "other"/);
    await refused(['--model', 'llama='], /no path after "="/);
  });
});

describe('conduit worker: etcd TLS files', () => {
  it('refuses a client certificate without its key (or the key alone) instead of dropping them', async () => {
    const dir = mkdtempSync(join(tmpdir(), 'conduit-etcd-tls-'));
    try {
      const pem = join(dir, 'x.pem');
      writeFileSync(pem, '-----BEGIN CERTIFICATE-----\nAA==\n-----END CERTIFICATE-----\n');
      for (const flag of ['--etcd-cert-file', '--etcd-key-file']) {
        await assert.rejects(workerCommand.run([...SERVICES, flag, pem]),
          (error: unknown) => error instanceof UsageError && /--etcd-cert-file and --etcd-key-file go together/.test(error.message));
      }
    } finally {
      rmSync(dir, { recursive: true, force: true });
    }
  });
});

describe('conduit worker: --kv-port', () => {
  it('is a prefill worker\'s, within 0..65535', async () => {
    const refused = (args: string[], pattern: RegExp) =>
      assert.rejects(workerCommand.run([...SERVICES, ...args]), (error: unknown) => error instanceof UsageError && pattern.test(error.message));
    await refused(['--kv-port', '7100'], /--kv-port is a prefill worker's/);
    await refused(['--role', 'decode', '--kv-port', '7100'], /--kv-port is a prefill worker's/);
    await refused(['--role', 'prefill', '--kv-port', '70000'], /--kv-port must be 0..65535/);
  });
});

/** The exit code of a `conduit` process, or 'timeout' (then it is killed) after maxMs. */
async function exitOf(proc: Proc, maxMs = 90_000): Promise<number | string> {
  const code = await Promise.race([proc.exited, new Promise<string>((resolve) => setTimeout(() => resolve('timeout'), maxMs))]);
  if (code === 'timeout') proc.kill();
  return code;
}

describe('conduit worker: bad values and start-up failures', () => {
  after(stopAll);

  it('are one line each, no stack trace: exit 2 for a value refused before anything starts, 1 for a failed start', { timeout: 240_000 }, async () => {
    const busy = net.createServer();
    const busyPort = await freePort();
    const tierRoot = mkdtempSync(join(tmpdir(), 'conduit-worker-tier-'));
    await new Promise<void>((resolve) => busy.listen(busyPort, '127.0.0.1', resolve));
    try {
      const cases: { args: string[]; line: RegExp; code: number }[] = [
        { args: ['--engine', 'sim', '--threads', '0'], line: /^conduit worker: --threads must be a whole number > 0, got 0$/m, code: 2 },
        { args: ['--threads', '100000'], line: /^conduit worker: --threads must be at most 1024, got 100000$/m, code: 2 },
        { args: ['--engine', 'sim', '--max-num-seqs', '1e9'], line: /^conduit worker: --max-num-seqs must be at most 16384, got 1000000000$/m, code: 2 },
        { args: ['--engine', 'sim', '--max-num-batched-tokens', '1e12'], line: /^conduit worker: --max-num-batched-tokens must be at most 1048576, got 1000000000000$/m, code: 2 },
        { args: ['--engine', 'sim', '--shutdown-grace', '-5'], line: /^conduit worker: --shutdown-grace must be >= 0, got -5$/m, code: 2 },
        { args: ['--engine', 'sim', '--shutdown-grace', '99999999'], line: /^conduit worker: --shutdown-grace must be at most 2147483 seconds \(about 24\.8 days\), got 99999999$/m, code: 2 },
        { args: ['--engine', 'sim', '--kv-cache-idle-release', '-1'], line: /^conduit worker: --kv-cache-idle-release must be >= 0 seconds, got -1$/m, code: 2 },
        { args: ['--engine', 'sim', '--stream-interval', '0'], line: /^conduit worker: --stream-interval must be a whole number > 0, got 0$/m, code: 2 },
        { args: ['--engine', 'sim', '--sim-lora-rank', '4097'], line: /^conduit worker: --sim-lora-rank must be at most 4096 \(the hidden size of Llama 3\.1 8B\), got 4097$/m, code: 2 },
        { args: ['--engine', 'sim', '--lease-ttl', '1e9'], line: /^conduit worker: --lease-ttl must be at most 2147483 seconds \(about 24\.8 days\), got 1000000000$/m, code: 2 },
        // A frontend could not connect to either.
        { args: ['--engine', 'sim', '--advertise-address', '127.0.0.1'], line: /^conduit worker: --advertise-address must be host:port, .* got "127\.0\.0\.1"$/m, code: 2 },
        { args: ['--engine', 'sim', '--advertise-address', '10.0.0.2:0'], line: /^conduit worker: --advertise-address must be host:port, .* got "10\.0\.0\.2:0"$/m, code: 2 },
        { args: ['--engine', 'cpu', '--model', '/nonexistent/model.gguf'], line: /^conduit worker: cannot load model \/nonexistent\/model\.gguf: no such file or folder$/m, code: 1 },
        { args: ['--kv-cache-memory', '32MiB', '--max-model-len', '99999'], line: /^conduit worker: --max-model-len 99999 is above the model's context length \(\d+ tokens\)$/m, code: 1 },
        { args: ['--engine', 'sim', '--port', String(busyPort)], line: new RegExp(`^conduit worker: cannot listen on 127\\.0\\.0\\.1:${busyPort}: listen EADDRINUSE`, 'm'), code: 1 },
        // A bad value known only once the model loaded (the size of one block file), as for `conduit serve`.
        { args: ['--kv-cache-memory', '32MiB', '--kv-offload-disk', join(tierRoot, 'tier'), '--kv-offload-disk-size', '100'],
          line: /^conduit worker: --kv-offload-disk-size 100 bytes holds no KV block file of \d+ bytes$/m, code: 2 },
      ];
      const runs = cases.map(({ args }) => startConduit(['worker', ...SERVICES, '--namespace', 'startup-errors', ...args]));
      const codes = await Promise.all(runs.map((proc) => exitOf(proc)));
      for (const [i, { args, line, code }] of cases.entries()) {
        const output = runs[i]!.output();
        assert.equal(codes[i], code, `${args.join(' ')}: ${output}`);
        assert.match(output, line, args.join(' '));
        assert.doesNotMatch(output, /^\s+at |^Node\.js v/m, `${args.join(' ')}: no stack trace`);
      }
    } finally {
      await new Promise((resolve) => busy.close(resolve));
      rmSync(tierRoot, { recursive: true, force: true });
    }
  });
});

describe('conduit worker: options its engine ignores', () => {
  after(stopAll);

  it('are said as `conduit serve` says them, before the start; a --parent-ipc child leaves them to its server', { timeout: 240_000 }, async () => {
    // A port in use ends each start once the options are read.
    const busy = net.createServer();
    const busyPort = await freePort();
    await new Promise<void>((resolve) => busy.listen(busyPort, '127.0.0.1', resolve));
    try {
      const port = ['--port', String(busyPort)];
      const cases: { args: string[]; env?: NodeJS.ProcessEnv; warned: string[] }[] = [
        { args: ['--engine', 'sim', '--kv-cache-dtype', 'f32', '--kv-cache-memory', '1GiB', '--kv-cache-idle-release', '30', '--guided-jump-forward',
          '--stream-interval', '4'], warned: [
          '--kv-cache-idle-release is for cpu workers (their KV pools are host memory): simulated workers ignore it',
          '--kv-cache-memory is for cpu workers: a simulated worker\'s KV pool is its GPUs\' memory left after the weights',
          '--kv-cache-dtype is for cpu workers: simulated workers count KV elements at their profile\'s size (llama-3.1-8b: 2 bytes, BF16)',
          '--guided-jump-forward is for cpu workers: simulated workers draw every token of a guided request among those its grammar allows',
          '--stream-interval is for cpu workers: simulated workers hand over each token as its step ends',
        ] },
        // From the environment too, as serve takes them.
        { args: ['--engine', 'sim'], env: { CONDUIT_KV_CACHE_DTYPE: 'f32' }, warned: [
          '--kv-cache-dtype is for cpu workers: simulated workers count KV elements at their profile\'s size (llama-3.1-8b: 2 bytes, BF16)',
        ] },
        { args: ['--engine', 'sim'], warned: [] },
        { args: ['--engine', 'sim', '--threads', '4', '--backend', 'reference', '--model', 'llama=/models/m.gguf'], warned: [
          '--threads is for cpu workers (their kernels\' compute threads): simulated workers ignore it',
          '--backend is for cpu workers (the kernels a model file runs on): simulated workers ignore it',
          '--model llama=/models/m.gguf: simulated workers load no model file (they run the --sim-model profile)',
        ] },
        // --sim-* typed for a cpu worker; from the environment they may be another deployment's.
        { args: ['--engine', 'cpu', '--sim-gpu', 'h200'], env: { CONDUIT_SIM_TP: '2' }, warned: [
          '--sim-gpu is for simulated workers (--engine sim): cpu workers ignore it',
        ] },
        // A child's server passes every setting it resolved and has said what it ignores.
        { args: ['--parent-ipc', '--worker-id', 'child-w', '--engine', 'sim', '--kv-cache-dtype', 'f32', '--threads', '2'], warned: [] },
      ];
      const runs = cases.map(({ args, env }) => startConduit(['worker', ...SERVICES, '--namespace', 'ignored-options', ...port, ...args], env ?? {}));
      const codes = await Promise.all(runs.map((proc) => exitOf(proc)));
      for (const [i, { args, warned }] of cases.entries()) {
        const output = runs[i]!.output();
        assert.equal(codes[i], 1, `${args.join(' ')}: ${output}`);
        assert.match(output, /cannot listen on 127\.0\.0\.1/, args.join(' '));
        const lines = output.split('\n').filter((line) => / WARN  --/.test(line)).map((line) => line.replace(/^\S+ WARN  /, ''));
        assert.deepEqual(lines, warned, `${args.join(' ')}: ${output}`);
      }
    } finally {
      await new Promise((resolve) => busy.close(resolve));
    }
  });
});

describe('conduit worker: CONDUIT_PARENT_IPC', () => {
  after(stopAll);

  it('does not make a cluster worker a serve child: it still needs etcd and NATS to register', { timeout: 60_000 }, async () => {
    const proc = startConduit(['worker', '--engine', 'sim', '--cluster-token', 't', '--port', '0'], { CONDUIT_PARENT_IPC: '1' });
    const code = await exitOf(proc, 30_000);
    assert.equal(code, 2, proc.output());
    assert.match(proc.output(), /^conduit worker: --etcd-endpoints \(or CONDUIT_ETCD_ENDPOINTS\) is required$/m);
  });
});

describe('conduit worker --parent-ipc: a child of `conduit serve --worker-processes`', () => {
  after(stopAll);

  it('reads no worker option from the environment, ignores SIGINT, SIGTERM and SIGHUP, and stops when its channel closes', { timeout: 120_000 }, async () => {
    // An environment set up for a cluster's workers; a child must report its own loopback address and start.
    const child = startConduit(['worker', '--parent-ipc', '--worker-id', 'child-0', '--engine', 'sim', '--sim-speed-up', 'inf'], {
      CONDUIT_CLUSTER_TOKEN: 't', CONDUIT_ADVERTISE_ADDRESS: '10.9.9.9:7000', CONDUIT_HOST: '256.1.1.1', CONDUIT_NAMESPACE: 'not a namespace',
      CONDUIT_LEASE_TTL: '1', CONDUIT_LORA_MODULES: 'a=/adapters/a.gguf', CONDUIT_MAX_LORAS: '0',
    }, { ipc: true, detached: true });
    const ready = await Promise.race([
      new Promise<{ type: string; address: string }>((resolve) => child.child.on('message', (message: { type: string; address: string }) => {
        if (message.type === 'ready') resolve(message);
      })),
      child.exited.then((code) => { throw new Error(`the child exited (${code}) before it was ready: ${child.output()}`); }),
    ]);
    assert.match(ready.address, /^127\.0\.0\.1:\d+$/);
    const port = Number(ready.address.split(':')[1]);
    for (const signal of ['SIGINT', 'SIGTERM', 'SIGHUP'] as const) child.child.kill(signal);
    await new Promise((resolve) => setTimeout(resolve, 1000));
    assert.equal(child.child.exitCode, null, `the signals did not stop it: ${child.output()}`);
    const accepts = await new Promise<boolean>((resolve) => {
      const socket = net.connect({ host: '127.0.0.1', port });
      socket.once('connect', () => { socket.destroy(); resolve(true); });
      socket.once('error', () => resolve(false));
    });
    assert.ok(accepts, 'it still serves its port');
    child.child.disconnect();
    assert.equal(await exitOf(child, 20_000), 0, child.output());
  });

  it('sends the server the reason it could not start, then exits', { timeout: 120_000 }, async () => {
    const cases = [
      { args: ['--engine', 'cpu', '--model', '/nonexistent/model.gguf'], message: 'cannot load model /nonexistent/model.gguf: no such file or folder', code: 1 },
      { args: ['--engine', 'sim', '--threads', '0'], message: '--threads must be a whole number > 0, got 0', code: 2 },
    ];
    const results = await Promise.all(cases.map(async ({ args }) => {
      const proc = startConduit(['worker', '--parent-ipc', '--worker-id', 'child-1', ...args], { CONDUIT_CLUSTER_TOKEN: 't' }, { ipc: true });
      const messages: unknown[] = [];
      proc.child.on('message', (message) => messages.push(message));
      // Every message is read by 'close'.
      const closed = new Promise<void>((resolve) => proc.child.once('close', () => resolve()));
      const code = await exitOf(proc);
      await closed;
      return { code, messages, output: proc.output() };
    }));
    for (const [i, { message, code }] of cases.entries()) {
      assert.equal(results[i]!.code, code, results[i]!.output);
      assert.deepEqual(results[i]!.messages, [{ type: 'failed', message }]);
    }
  });
});
