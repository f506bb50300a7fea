// `conduit worker` and `conduit bench` refuse a bad value that came from the environment under the variable's name,
// as `conduit serve` does (CONDUIT_PORT (--port) must be ...): the checks after flag parsing named only the flag,
// which nobody typed. A value typed on the command line is still named by its flag. Run through the CLI's main().
import assert from 'node:assert/strict';
import { mkdtempSync, rmSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { describe, it } from 'node:test';
import { runCli } from '../helpers/cli-main.ts';

// Unreachable services: every case is refused before a connection is tried.
const SERVICES = ['--cluster-token', 't', '--etcd-endpoints', 'http://127.0.0.1:1', '--nats-server', 'nats://127.0.0.1:1'];

async function refused(argv: string[], env: Record<string, string>, message: RegExp): Promise<void> {
  const result = await runCli(argv, env);
  assert.equal(result.code, 2, result.err);
  assert.match(result.err, message);
}

describe('conduit worker: a refused value from the environment', () => {
  it('is named by its variable and its flag', async () => {
    const cases: [Record<string, string>, RegExp][] = [
      [{ CONDUIT_PORT: '70000' }, /^conduit worker: CONDUIT_PORT \(--port\) must be 0\.\.65535, got 70000$/],
      [{ CONDUIT_ROLE: 'x' }, /^conduit worker: CONDUIT_ROLE \(--role\) must be both, prefill or decode/],
      [{ CONDUIT_LEASE_TTL: '1' }, /^conduit worker: CONDUIT_LEASE_TTL \(--lease-ttl\) must be a whole number of seconds >= 2/],
      // Past what a timer holds the etcd client kept the lease alive every millisecond, and could not revoke it at exit.
      [{ CONDUIT_LEASE_TTL: '3000000' }, /^conduit worker: CONDUIT_LEASE_TTL \(--lease-ttl\) must be at most 2147483 seconds \(about 24\.8 days\), got 3000000$/],
      [{ CONDUIT_NAMESPACE: 'a.b' }, /^conduit worker: CONDUIT_NAMESPACE \(--namespace\) must be 1-64 letters/],
      [{ CONDUIT_MAX_LORAS: '0' }, /^conduit worker: CONDUIT_MAX_LORAS \(--max-loras\) must be a whole number > 0/],
      [{ CONDUIT_KV_CACHE_DTYPE: 'q8' }, /^conduit worker: CONDUIT_KV_CACHE_DTYPE \(--kv-cache-dtype\) must be one of auto, f32, f16/],
      [{ CONDUIT_KV_PORT: '5' }, /^conduit worker: CONDUIT_KV_PORT \(--kv-port\) is a prefill worker's/],
    ];
    for (const [env, message] of cases) await refused(['worker', ...SERVICES], env, message);
  });

  it('names the variable of either flag of a pair that goes together', async () => {
    const dir = mkdtempSync(join(tmpdir(), 'conduit-env-names-'));
    try {
      const pem = join(dir, 'x.pem');
      writeFileSync(pem, '-----BEGIN CERTIFICATE-----\nAA==\n-----END CERTIFICATE-----\n');
      await refused(['worker', ...SERVICES], { CONDUIT_ETCD_KEY_FILE: pem },
        /^conduit worker: --etcd-cert-file and CONDUIT_ETCD_KEY_FILE \(--etcd-key-file\) go together/);
      await refused(['worker', ...SERVICES], { CONDUIT_ETCD_CERT_FILE: pem },
        /^conduit worker: CONDUIT_ETCD_CERT_FILE \(--etcd-cert-file\) and --etcd-key-file go together/);
    } finally {
      rmSync(dir, { recursive: true, force: true });
    }
  });

  it('typed on the command line, is named by its flag alone', async () => {
    await refused(['worker', ...SERVICES, '--port', '70000'], {}, /^conduit worker: --port must be 0\.\.65535, got 70000$/);
  });
});

describe('conduit bench: a refused value from the environment', () => {
  it('is named by its variable and its flag', async () => {
    const cases: [Record<string, string>, RegExp][] = [
      [{ CONDUIT_URL: 'ftp://x' }, /^conduit bench: CONDUIT_URL \(--url\) must be an http:\/\/ or https:\/\/ URL/],
      [{ CONDUIT_BENCH_ENDPOINT: 'x' }, /^conduit bench: CONDUIT_BENCH_ENDPOINT \(--endpoint\) must be one of chat, completions/],
      [{ CONDUIT_BENCH_TIMEOUT: '-1' }, /^conduit bench: CONDUIT_BENCH_TIMEOUT \(--timeout\) must be in \(0, /],
      [{ CONDUIT_BENCH_RATE: '-1' }, /^conduit bench: CONDUIT_BENCH_RATE \(--rate\) must be > 0, got -1$/],
      [{ CONDUIT_BENCH_BURSTINESS: '2' }, /^conduit bench: CONDUIT_BENCH_BURSTINESS \(--burstiness\) shapes the arrivals of --request-rate/],
      [{ CONDUIT_BENCH_PROMPT_TOKENS: '0' }, /^conduit bench: CONDUIT_BENCH_PROMPT_TOKENS \(--prompt-tokens\) must be a whole number from 1 to/],
      [{ CONDUIT_BENCH_GOODPUT: 'x:1' }, /^conduit bench: CONDUIT_BENCH_GOODPUT \(--goodput\): "x:1" is not one of/],
      [{ CONDUIT_BENCH_HTML: '/nonexistent-folder/r.html' }, /^conduit bench: CONDUIT_BENCH_HTML \(--html\) \/nonexistent-folder\/r\.html: cannot write/],
    ];
    for (const [env, message] of cases) await refused(['bench'], env, message);
  });

  it('typed on the command line, is named by its flag alone', async () => {
    await refused(['bench', '--timeout', '-1'], {}, /^conduit bench: --timeout must be in \(0, /);
  });
});
