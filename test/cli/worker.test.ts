// `conduit worker`'s LoRA and model options are checked before anything starts: --lora-modules (or
// CONDUIT_LORA_MODULES) on a `conduit serve --worker-processes` child is refused by name, as are bad --max-loras /
// --max-lora-rank values; --model NAME=PATH names the worker's one model as serve's flag does; etcd's client
// certificate and key go together; --kv-port is a prefill worker's.
// (Workers of every role take --lora-modules: test/cluster/lora-disagg.test.ts.)
import assert from 'node:assert/strict';
import { mkdtempSync, rmSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { describe, it } from 'node:test';
import { UsageError } from '../../src/cli/flags.ts';
import { workerCommand } from '../../src/cli/worker.ts';

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

  it('takes them from the environment too (CONDUIT_LORA_MODULES)', async () => {
    process.env.CONDUIT_LORA_MODULES = 'a=/adapters/a.gguf';
    try {
      await refused(['--parent-ipc'], /parent's option/);
    } finally {
      delete process.env.CONDUIT_LORA_MODULES;
    }
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
