// The web console in Chromium with the longest names a user can give it: a tenant named in the API keys file and a
// served model name, each one unbroken run of characters. The tables must wrap them inside their panels rather than
// widen the panel past the window (a sideways scrollbar on every refresh). And a server that stops taking the page's
// key: the header must say the figures are no longer updated; and an SLO percentile that is not a whole number.

import assert from 'node:assert/strict';
import { existsSync, mkdtempSync, rmSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { after, before, describe, it } from 'node:test';
import { ADMIN_KEY, startTestServer, waitFor, type TestServer } from './e2e-fixture.ts';
import { launchChromium, CHROMIUM_PATH, type BrowserSession } from '../helpers/chromium.ts';

const E2E = { timeout: 180_000 };
const TENANT_KEY = 'sk-long-tenant-0001';
const TENANT = `tenant-${'x'.repeat(150)}`;
const MODEL = `org/model-${'m'.repeat(150)}`;

// Runs in the page: each panel whose content is wider than its box, with its widths.
const OVERFLOW_PROBE = `(() => [...document.querySelectorAll('.panel')]
  .filter((p) => p.scrollWidth > p.clientWidth)
  .map((p) => ({ id: p.id || '(unnamed)', scrollWidth: p.scrollWidth, clientWidth: p.clientWidth })))()`;

describe('web console with long tenant and model names', { skip: existsSync(CHROMIUM_PATH) ? false : `${CHROMIUM_PATH} is not installed` }, () => {
  let server: TestServer;
  let browser: BrowserSession;
  let profile: string;
  let id: string;

  before(async () => {
    server = await startTestServer({ keysFile: `${TENANT_KEY} ${TENANT}\n`, flags: ['--served-model-name', MODEL] });
    const res = await fetch(`${server.url}/v1/chat/completions`, {
      method: 'POST', headers: { 'Content-Type': 'application/json', Authorization: `Bearer ${TENANT_KEY}` },
      body: JSON.stringify({ model: MODEL, messages: [{ role: 'user', content: 'Tell me about the stars' }], max_tokens: 4 }),
    });
    assert.equal(res.status, 200);
    id = ((await res.json()) as { id: string }).id;
    await waitFor(() => server.running.api.telemetry.traces.get(id) !== undefined, 'the trace');
    profile = mkdtempSync(join(tmpdir(), 'conduit-console-long-'));
    browser = await launchChromium(profile);
  });
  after(async () => {
    await browser?.close();
    if (profile) rmSync(profile, { recursive: true, force: true });
    await server?.close();
  });

  it('keeps a refused request\'s page inside the window when its error quotes a long unbroken value', E2E, async () => {
    const res = await fetch(`${server.url}/v1/chat/completions`, {
      method: 'POST', headers: { 'Content-Type': 'application/json', Authorization: `Bearer ${TENANT_KEY}` },
      body: JSON.stringify({ model: `no-such-model-${'z'.repeat(200)}`, messages: [{ role: 'user', content: 'hi' }] }),
    });
    assert.equal(res.status, 404);
    await res.text();
    const overview = await fetch(`${server.url}/console/api/overview`, { headers: { Authorization: `Bearer ${ADMIN_KEY}` } });
    const refused = ((await overview.json()) as { requests: { id: string; status: number | null }[] }).requests.find((r) => r.status === 404)!;
    const page = await browser.newPage();
    await page.addInitScript(`sessionStorage.setItem('conduit-console-key', '${ADMIN_KEY}')`);
    await page.setViewportSize({ width: 1024, height: 900 });
    await page.goto(`${server.url}/console/requests/${refused.id}`);
    await page.waitForSelector('#phases');
    assert.match((await page.textContent('#diagnosis'))!, /zzzz/);
    assert.deepEqual(await page.evaluate(OVERFLOW_PROBE), [], 'request page panels wider than their box');
    await page.close();
    browser.assertClean();
  });

  for (const width of [1024, 1280]) {
    it(`keeps every panel of the overview and the request page inside the window at ${width} px`, E2E, async () => {
      const page = await browser.newPage();
      await page.addInitScript(`sessionStorage.setItem('conduit-console-key', '${ADMIN_KEY}')`);
      await page.setViewportSize({ width, height: 900 });
      await page.goto(`${server.url}/console`);
      await page.waitForSelector('body[data-ready]');
      await page.waitForSelector(`#requests a[href="/console/requests/${id}"]`);
      await page.waitForSelector('#slo .badge');
      assert.ok((await page.textContent('#requests'))!.includes(TENANT));
      assert.deepEqual(await page.evaluate(OVERFLOW_PROBE), [], 'overview panels wider than their box');
      await page.goto(`${server.url}/console/requests/${id}`);
      await page.waitForSelector('#phases');
      assert.deepEqual(await page.evaluate(OVERFLOW_PROBE), [], 'request page panels wider than their box');
      await page.close();
      browser.assertClean();
    });
  }
});

describe('web console when the server stops taking its key', { skip: existsSync(CHROMIUM_PATH) ? false : `${CHROMIUM_PATH} is not installed` }, () => {
  let server: TestServer;
  let browser: BrowserSession;
  let profile: string;

  before(async () => {
    server = await startTestServer({ keysFile: `${TENANT_KEY} acme\n` });
    profile = mkdtempSync(join(tmpdir(), 'conduit-console-key-'));
    browser = await launchChromium(profile);
  });
  after(async () => {
    await browser?.close();
    if (profile) rmSync(profile, { recursive: true, force: true });
    await server?.close();
  });

  it('says the overview is no longer updated while it waits for a key, and is ready again once given one', E2E, async () => {
    const page = await browser.newPage();
    await page.addInitScript(`sessionStorage.setItem('conduit-console-key', '${ADMIN_KEY}')`);
    await page.goto(`${server.url}/console?refresh=500`);
    await page.waitForSelector('#workers tr[data-worker]');
    // Polled from here: the page's CSP refuses a string predicate evaluated in it.
    const text = async (selector: string, pattern: RegExp, what: string) => {
      const deadline = Date.now() + 30_000;
      while (!pattern.test((await page.textContent(selector)) ?? '')) {
        if (Date.now() > deadline) assert.fail(`timed out waiting until ${what}: ${await page.textContent(selector)}`);
        await new Promise((resolve) => setTimeout(resolve, 50));
      }
    };
    await text('#server-state', /ready/, 'the overview loaded');
    // The server restarted with another keys file: the stored key is refused from now on.
    await page.route('**/console/api/overview', (route) => route.fulfill({
      status: 401, json: { error: { message: 'Incorrect API key provided.', type: 'invalid_request_error', param: null, code: 'invalid_api_key' } },
    }));
    await page.waitForSelector('#key-form:not([hidden])');
    await text('#server-state', /401/, 'the header says the server refused the key');
    assert.equal(await page.getAttribute('#server-state', 'class'), 'bad');
    assert.match((await page.textContent('#refresh-state'))!, /^not updated/);
    // A key the server takes: the page polls again.
    await page.unroute('**/console/api/overview');
    await page.fill('#key-input', ADMIN_KEY);
    await page.click('#key-form button');
    await text('#server-state', /ready/, 'the overview loaded again');
    await text('#refresh-state', /^updated/, 'the overview updated again');
    await page.close();
    browser.errors.length = 0;
  });

  it('names an SLO percentile that is not a whole number as it is (p99.9, not p100)', E2E, async () => {
    const page = await browser.newPage();
    await page.addInitScript(`sessionStorage.setItem('conduit-console-key', '${ADMIN_KEY}')`);
    // The objectives' percentile is the server's (TelemetryOptions.slo.percentile); this one serves p99.9.
    await page.route('**/console/api/overview', async (route) => {
      const body = await (await route.fetch()).json() as { slo: { percentile: number } };
      body.slo.percentile = 0.999;
      await route.fulfill({ json: body });
    });
    await page.goto(`${server.url}/console`);
    await page.waitForSelector('#slo');
    assert.equal(await page.textContent('#slo th:nth-child(5)'), 'p99.9 / rate');
    await page.close();
    browser.assertClean();
  });
});
