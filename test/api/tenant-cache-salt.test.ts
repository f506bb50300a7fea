// The prefix-cache salt on workers that are child processes (`serve --worker-processes`): a tenant's cached prompt
// blocks serve its own later requests, whichever of its keys sends them, and never another tenant's, with or without
// a request's cache_salt; and a cache_salt or a cache group of any length works there as it does in one process (the
// request plane takes at most 1024 characters of a salt: the salt the workers get is a digest).
import assert from 'node:assert/strict';
import { mkdtempSync, rmSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { after, before, describe, it } from 'node:test';
import { ADMIN_KEY, startTestServer, type TestServer } from './e2e-fixture.ts';
import { rawRequest } from './http-client.ts';

describe('the prefix-cache salt on worker processes', () => {
  let server: TestServer;
  let dir: string;

  before(async () => {
    dir = mkdtempSync(join(tmpdir(), 'conduit-cache-salt-'));
    const keys = join(dir, 'keys.json');
    writeFileSync(keys, JSON.stringify({
      keys: [
        { key: 'sk-acme-00000001', tenant: 'acme' }, { key: 'sk-acme-00000002', tenant: 'acme' },
        { key: 'sk-glob-00000001', tenant: 'globex' },
        { key: 'sk-grpa-00000001', tenant: 'grouped-a' }, { key: 'sk-grpb-00000001', tenant: 'grouped-b' },
      ],
      tenants: { 'grouped-a': { cache_group: 'g'.repeat(1100) }, 'grouped-b': { cache_group: 'g'.repeat(1100) } },
    }));
    server = await startTestServer({ flags: ['--workers', '2', '--worker-processes', '--api-keys-file', keys, '--admin-key', ADMIN_KEY] });
  });
  after(async () => {
    await server?.close();
    rmSync(dir, { recursive: true, force: true });
  });

  /** Cached prompt tokens of a completion of `prompt` sent with `key`. */
  async function cached(key: string, prompt: number[], cacheSalt?: string): Promise<number> {
    const res = await rawRequest(server.url, {
      path: '/v1/completions', headers: { Authorization: `Bearer ${key}` },
      body: { prompt, max_tokens: 1, ...(cacheSalt !== undefined ? { cache_salt: cacheSalt } : {}) },
    });
    assert.equal(res.status, 200, res.text);
    return res.json().usage.prompt_tokens_details?.cached_tokens ?? 0;
  }

  it('a long cache_salt is served, and shared only within the tenant', { timeout: 120_000 }, async () => {
    const prompt = Array.from({ length: 120 }, (_, i) => 700 + i);
    const salt = 's'.repeat(2000);
    assert.equal(await cached('sk-acme-00000001', prompt, salt), 0, 'cold');
    assert.ok(await cached('sk-acme-00000002', prompt, salt) >= 96, 'the tenant\'s other key hits under the same salt');
    assert.equal(await cached('sk-glob-00000001', prompt, salt), 0, 'another tenant with the same salt does not');
    assert.equal(await cached('sk-acme-00000001', prompt, `${salt}!`), 0, 'nor another salt of the tenant');
    assert.equal(await cached('sk-acme-00000001', prompt), 0, 'nor no salt');
  });

  it('tenants sharing a long cache group are served, and share their blocks with no one else', { timeout: 120_000 }, async () => {
    const prompt = Array.from({ length: 120 }, (_, i) => 900 + i);
    assert.equal(await cached('sk-grpa-00000001', prompt), 0, 'cold');
    assert.ok(await cached('sk-grpb-00000001', prompt) >= 96, 'a tenant of the same cache group hits');
    assert.equal(await cached('sk-acme-00000001', prompt), 0, 'a tenant outside it does not');
    assert.equal(await cached('sk-glob-00000001', prompt), 0, 'another tenant does not');
  });
});
