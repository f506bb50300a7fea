// A message that names two flags names each by where its value came from: `CONDUIT_TLS_KEY (--tls-key)` when the
// environment gave it, `--tls-cert` when it was typed or is unset. nameEnvironment rewrites only the flag a message
// starts with, so the second flag of a pair used to be named by its flag alone even when nobody typed it.
import assert from 'node:assert/strict';
import { execFileSync } from 'node:child_process';
import { mkdtempSync, rmSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { after, before, describe, it } from 'node:test';
import { parseServeConfig } from '../../src/cli/serve.ts';
import { UsageError } from '../../src/cli/flags.ts';
import { runCli } from '../helpers/cli-main.ts';

function refusedConfig(argv: string[], env: Record<string, string>, message: RegExp): void {
  assert.throws(() => parseServeConfig(argv, env), (err: unknown) => {
    assert.ok(err instanceof UsageError, String(err));
    assert.match(err.message, message);
    return true;
  });
}

describe('conduit serve: a message about two flags', () => {
  it('--tls-cert and --tls-key go together: names the variable of whichever the environment gave', () => {
    refusedConfig([], { CONDUIT_TLS_KEY: '/k.pem' }, /^--tls-cert and CONDUIT_TLS_KEY \(--tls-key\) go together$/);
    refusedConfig([], { CONDUIT_TLS_CERT: '/c.pem' }, /^CONDUIT_TLS_CERT \(--tls-cert\) and --tls-key go together$/);
    refusedConfig(['--tls-key', '/k.pem'], {}, /^--tls-cert and --tls-key go together$/);
  });

  it('--prefill-workers and --decode-workers go together: names the variable of whichever the environment gave', () => {
    refusedConfig([], { CONDUIT_DECODE_WORKERS: '1' }, /^--prefill-workers and CONDUIT_DECODE_WORKERS \(--decode-workers\) go together$/);
    refusedConfig([], { CONDUIT_PREFILL_WORKERS: '1' }, /^CONDUIT_PREFILL_WORKERS \(--prefill-workers\) and --decode-workers go together$/);
    refusedConfig(['--decode-workers', '1'], {}, /^--prefill-workers and --decode-workers go together$/);
  });

  it('--model NAME=PATH and --served-model-name: each named by its own source', () => {
    refusedConfig(['--model', 'a=/m.gguf'], { CONDUIT_SERVED_MODEL_NAME: 'b' },
      /^--model a=\/m\.gguf is named "a" and CONDUIT_SERVED_MODEL_NAME \(--served-model-name\) names it "b"$/);
    refusedConfig(['--served-model-name', 'b'], { CONDUIT_MODEL: 'a=/m.gguf' },
      /^CONDUIT_MODEL \(--model\) a=\/m\.gguf is named "a" and --served-model-name names it "b"$/);
    refusedConfig([], { CONDUIT_MODEL: 'a=/m.gguf', CONDUIT_SERVED_MODEL_NAME: 'b' },
      /^CONDUIT_MODEL \(--model\) a=\/m\.gguf is named "a" and CONDUIT_SERVED_MODEL_NAME \(--served-model-name\) names it "b"$/);
    refusedConfig(['--model', 'a=/m.gguf', '--served-model-name', 'b'], {},
      /^--model a=\/m\.gguf is named "a" and --served-model-name names it "b"$/);
  });

  it('more --served-model-name than --model: each named by its own source', () => {
    refusedConfig(['--served-model-name', 'a', '--served-model-name', 'b'], { CONDUIT_MODEL: '/m.gguf' },
      /^--served-model-name given 2 times for 1 CONDUIT_MODEL \(--model\)$/);
  });

  it('--worker-processes with --prefill-workers of simulated workers: each named by its own source', () => {
    refusedConfig(['--worker-processes', '--engine', 'sim', '--decode-workers', '1'], { CONDUIT_PREFILL_WORKERS: '1' },
      /^--worker-processes with CONDUIT_PREFILL_WORKERS \(--prefill-workers\) runs cpu workers/);
  });

  it('several --model with simulated workers: names the variable that set --engine sim', () => {
    refusedConfig(['--model', '/a.gguf', '--model', '/b.gguf'], { CONDUIT_ENGINE: 'sim' },
      /^--model: simulated workers \(CONDUIT_ENGINE \(--engine\) sim\) serve one profile; several models need --engine cpu$/);
    refusedConfig(['--model', '/a.gguf', '--model', '/b.gguf', '--engine', 'sim'], {},
      /^--model: simulated workers \(--engine sim\) serve one profile/);
  });

  describe('a --tls-key that is not the certificate\'s', () => {
    let dir = '';
    let hasOpenssl = true;
    before(() => {
      dir = mkdtempSync(join(tmpdir(), 'conduit-two-flag-tls-'));
      try {
        const curve = ['-pkeyopt', 'ec_paramgen_curve:prime256v1'];
        execFileSync('openssl', ['req', '-x509', '-newkey', 'ec', ...curve, '-nodes', '-keyout', join(dir, 'key.pem'),
          '-out', join(dir, 'cert.pem'), '-subj', '/CN=localhost', '-days', '1'], { stdio: 'ignore' });
        execFileSync('openssl', ['genpkey', '-algorithm', 'EC', ...curve, '-out', join(dir, 'other-key.pem')], { stdio: 'ignore' });
      } catch {
        hasOpenssl = false;
      }
    });
    after(() => rmSync(dir, { recursive: true, force: true }));

    it('names each of the two flags by its own source', (t) => {
      if (!hasOpenssl) {
        t.skip('needs openssl to make a certificate');
        return;
      }
      const cert = join(dir, 'cert.pem');
      const otherKey = join(dir, 'other-key.pem');
      refusedConfig(['--tls-key', otherKey], { CONDUIT_TLS_CERT: cert },
        /^--tls-key \S*other-key\.pem is not the private key of CONDUIT_TLS_CERT \(--tls-cert\) \S*cert\.pem/);
      refusedConfig(['--tls-cert', cert], { CONDUIT_TLS_KEY: otherKey },
        /^CONDUIT_TLS_KEY \(--tls-key\) \S*other-key\.pem is not the private key of --tls-cert \S*cert\.pem/);
      refusedConfig(['--tls-cert', cert, '--tls-key', otherKey], {},
        /^--tls-key \S*other-key\.pem is not the private key of --tls-cert \S*cert\.pem/);
    });
  });
});

describe('conduit worker: --model NAME=PATH and --served-model-name', () => {
  // Unreachable services: every case is refused before a connection is tried.
  const SERVICES = ['--cluster-token', 't', '--etcd-endpoints', 'http://127.0.0.1:1', '--nats-server', 'nats://127.0.0.1:1'];

  it('names each flag by its own source', async () => {
    const cases: [string[], Record<string, string>, RegExp][] = [
      [['--model', 'a=/m.gguf'], { CONDUIT_SERVED_MODEL_NAME: 'b' },
        /^conduit worker: --model a=\/m\.gguf is named "a" and CONDUIT_SERVED_MODEL_NAME \(--served-model-name\) names it "b"$/],
      [['--served-model-name', 'b'], { CONDUIT_MODEL: 'a=/m.gguf' },
        /^conduit worker: CONDUIT_MODEL \(--model\) a=\/m\.gguf is named "a" and --served-model-name names it "b"$/],
    ];
    for (const [argv, env, message] of cases) {
      const result = await runCli(['worker', ...SERVICES, ...argv], env);
      assert.equal(result.code, 2, result.err);
      assert.match(result.err, message);
    }
  });
});

describe('conduit generate: --seed out of range for --concurrency', () => {
  it('names --concurrency by its variable when the environment gave it', async () => {
    const result = await runCli(['generate', '--prompt', 'hi', '--seed', String(Number.MAX_SAFE_INTEGER)], { CONDUIT_CONCURRENCY: '2' });
    assert.equal(result.code, 2, result.err);
    assert.match(result.err, /^conduit generate: --seed must be a whole number .* \(with CONDUIT_CONCURRENCY \(--concurrency\) 2 the requests take seeds/);
  });
});
