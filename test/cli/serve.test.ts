import assert from 'node:assert/strict';
import { mkdtempSync, rmSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { after, describe, it } from 'node:test';
import { UsageError } from '../../src/cli/flags.ts';
import { parseByteSize, parseServeConfig, type ServeConfig } from '../../src/cli/serve.ts';

function config(argv: string[], env: NodeJS.ProcessEnv = {}): ServeConfig {
  const parsed = parseServeConfig(argv, env);
  assert.notEqual(parsed, 'help');
  return parsed as ServeConfig;
}

describe('conduit serve flags', () => {
  const dir = mkdtempSync(join(tmpdir(), 'conduit-serve-flags-'));
  after(() => rmSync(dir, { recursive: true, force: true }));

  it('has the documented defaults', () => {
    const c = config([]);
    assert.equal(c.host, '127.0.0.1');
    assert.equal(c.port, 8000);
    assert.equal(c.modelPath, undefined, 'the built-in model');
    assert.equal(c.maxBodyBytes, 4 * 1024 * 1024);
    assert.equal(c.requestTimeoutMs, undefined);
    assert.equal(c.shutdownGraceMs, 30_000);
    assert.deepEqual(c.keys.keys, []);
    assert.equal(c.backend, 'auto');
  });

  it('reads every flag from its CONDUIT_* twin, the command line winning', () => {
    const c = config(['--port', '9001'], {
      CONDUIT_PORT: '7000', CONDUIT_HOST: '0.0.0.0', CONDUIT_KV_CACHE_MEMORY: '512MiB', CONDUIT_API_KEYS: 'k1:acme',
      CONDUIT_REQUEST_TIMEOUT: '2.5', CONDUIT_MAX_NUM_SEQS: '4', CONDUIT_TENANT_RPM: '30',
    });
    assert.equal(c.port, 9001);
    assert.equal(c.host, '0.0.0.0');
    assert.equal(c.kvCacheMemoryBytes, 512 * 1024 * 1024);
    assert.deepEqual(c.keys.keys, [{ key: 'k1', tenant: 'acme' }]);
    assert.equal(c.requestTimeoutMs, 2500);
    assert.equal(c.maxNumSeqs, 4);
    assert.deepEqual(c.tenantDefaults, { requestsPerMinute: 30 });
  });

  it('combines a keys file with the keys list', () => {
    const path = join(dir, 'keys.txt');
    writeFileSync(path, 'sk-file acme 60 1000 2\n');
    const c = config(['--api-keys-file', path, '--api-keys', 'sk-env:globex']);
    assert.deepEqual(c.keys.keys.map((k) => k.tenant), ['acme', 'globex']);
    assert.deepEqual(c.keys.tenants.get('acme')!.limits, { requestsPerMinute: 60, tokensPerMinute: 1000, maxConcurrent: 2 });
  });

  it('refuses bad values with a usage error naming the flag', () => {
    const bad: [string[], RegExp][] = [
      [['--port', '70000'], /--port/],
      [['--port', 'http'], /--port expects a number/],
      [['--kv-cache-memory', 'lots'], /--kv-cache-memory/],
      [['--max-body-bytes', '0'], /--max-body-bytes/],
      [['--backend', 'gpu'], /--backend/],
      [['--log-level', 'loud'], /--log-level/],
      [['--tls-cert', 'a.pem'], /--tls-cert and --tls-key/],
      [['--threads', '1.5'], /--threads/],
      [['--request-timeout', '-1'], /--request-timeout/],
      [['--api-keys-file', join(dir, 'missing.txt')], /does not exist/],
      [['--api-keys', 'no-tenant'], /key:tenant/],
      [['stray'], /unexpected argument/],
    ];
    for (const [argv, message] of bad) {
      assert.throws(() => parseServeConfig(argv, {}), (err: unknown) => err instanceof UsageError && message.test(err.message),
        argv.join(' '));
    }
  });

  it('asks for help', () => {
    assert.equal(parseServeConfig(['--help'], {}), 'help');
  });
});

describe('parseByteSize', () => {
  it('reads bytes and binary and decimal units', () => {
    assert.equal(parseByteSize('1024', 'x'), 1024);
    assert.equal(parseByteSize('512MiB', 'x'), 512 * 1024 ** 2);
    assert.equal(parseByteSize('2GiB', 'x'), 2 * 1024 ** 3);
    assert.equal(parseByteSize('2g', 'x'), 2 * 1024 ** 3);
    assert.equal(parseByteSize('1.5GB', 'x'), 1.5e9);
    assert.equal(parseByteSize(' 64 KiB ', 'x'), 65536);
  });

  it('refuses what it cannot read', () => {
    for (const text of ['', 'MiB', '-1MiB', '12 parsecs', '1e3']) {
      assert.throws(() => parseByteSize(text, 'kv-cache-memory'), /--kv-cache-memory expects bytes/, text);
    }
  });
});
