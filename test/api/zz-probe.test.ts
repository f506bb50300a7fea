import assert from 'node:assert/strict';
import { mkdtempSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { after, before, describe, it } from 'node:test';
import { ADMIN_KEY, startTestServer, waitFor, type TestServer } from './e2e-fixture.ts';
import { launchChromium, type BrowserSession } from '../helpers/chromium.ts';

const KEY = 'sk-acme-00000001';
describe('probe', () => {
  let server: TestServer; let browser: BrowserSession; const ids: string[] = [];
  before(async () => {
    server = await startTestServer({ keysFile: `${KEY} acme\n`, flags: ['--workers', '2'] });
    const H = { 'Content-Type': 'application/json', Authorization: `Bearer ${KEY}` };
    const bodies = [
      { model: 'nope', messages: [{ role: 'user', content: 'x' }] },
      { messages: 'bad' },
      { messages: [{ role: 'user', content: 'hi' }], max_tokens: 3 },
      { messages: [{ role: 'user', content: 'hi' }], max_tokens: 8, stream: true, n: 2 },
      { messages: [{ role: 'user', content: 'hi there' }], max_tokens: 8, stop: ['<b>'], logprobs: true, top_logprobs: 2 },
    ];
    for (const body of bodies) {
      const r = await fetch(`${server.url}/v1/chat/completions`, { method: 'POST', headers: H, body: JSON.stringify(body) });
      await r.text();
    }
    // aborted stream
    const ac = new AbortController();
    const r = await fetch(`${server.url}/v1/chat/completions`, { method: 'POST', headers: H, signal: ac.signal, body: JSON.stringify({ messages: [{ role: 'user', content: 'long' }], max_tokens: 200, stream: true, ignore_eos: true }) });
    const reader = r.body!.getReader(); await reader.read(); ac.abort();
    await new Promise((res) => setTimeout(res, 1500));
    const o = await (await fetch(`${server.url}/console/api/overview`, { headers: { Authorization: `Bearer ${ADMIN_KEY}` } })).json() as any;
    for (const q of o.requests) ids.push(q.id);
    browser = await launchChromium(mkdtempSync(join(tmpdir(), 'probe-')));
  });
  after(async () => { await browser?.close(); await server?.close(); });
  it('pages', { timeout: 120000 }, async () => {
    const page = await browser.newPage();
    await page.addInitScript(`sessionStorage.setItem('conduit-console-key', '${ADMIN_KEY}')`);
    await page.goto(`${server.url}/console`);
    await page.waitForSelector('#requests a');
    await page.waitForSelector('#slo .badge');
    console.log('OVERVIEW', (await page.textContent('#app'))!.replace(/\s+/g, ' ').slice(0, 3000));
    for (const id of ids) {
      await page.goto(`${server.url}/console/requests/${id}`);
      await page.waitForSelector('body[data-ready]');
      console.log('REQ', id, (await page.textContent('#app'))!.replace(/\s+/g, ' ').slice(0, 1500));
    }
    console.log('ERRORS', browser.errors);
  });
});
