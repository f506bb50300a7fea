// The web console in a real browser (Chromium through playwright-core): a live server with two CPU workers serving
// the built-in model, the overview and a request's waterfall loaded as a person would, with every request the page
// makes checked to stay on 127.0.0.1 and the browser's console watched for errors. Screenshots go to a fresh folder
// under the OS temp dir (its path is printed); CONDUIT_TEST_OUTPUT_DIR puts them elsewhere.

import assert from 'node:assert/strict';
import { existsSync, mkdirSync, mkdtempSync, rmSync, statSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { after, before, describe, it } from 'node:test';
import { startTestServer, waitFor, type TestServer } from './e2e-fixture.ts';
import { launchChromium, CHROMIUM_PATH, type BrowserSession } from '../helpers/chromium.ts';
import type { Page } from 'playwright-core';

const E2E = { timeout: 180_000 };

/** Where screenshots go: the test output folder. */
function outputDir(): string {
  const base = process.env.CONDUIT_TEST_OUTPUT_DIR;
  if (base) {
    mkdirSync(base, { recursive: true });
    return mkdtempSync(join(base, 'console-'));
  }
  return mkdtempSync(join(tmpdir(), 'conduit-console-screenshots-'));
}

async function stream(server: TestServer, content: string, maxTokens: number): Promise<string> {
  const res = await fetch(`${server.url}/v1/chat/completions`, {
    method: 'POST', headers: { 'Content-Type': 'application/json' },
    body: JSON.stringify({ messages: [{ role: 'user', content }], max_tokens: maxTokens, stream: true, ignore_eos: true }),
  });
  assert.equal(res.status, 200);
  await res.text();
  return res.headers.get('x-request-id')!;
}

/** What the layout check reads from the page. */
interface Layout {
  viewport: number;
  /** How far the page scrolls sideways. */
  pageScroll: number;
  panels: { id: string; clientWidth: number; scrollWidth: number; overflowing: string[]; content: number; chart: number | null }[];
  sloRight: number | null;
  badges: { right: number }[];
}

// Runs in the page (a string: this file's types do not describe the DOM). Every panel: its widths, the elements that
// reach past its box, its content width and the width of the uPlot chart in it.
const LAYOUT_PROBE = `(() => {
  const doc = document.documentElement;
  const name = (node) => node.tagName.toLowerCase() + (node.id ? '#' + node.id : '')
    + (typeof node.className === 'string' && node.className.trim() ? '.' + node.className.trim().split(/\\s+/).join('.') : '');
  const panels = [...document.querySelectorAll('.panel')].map((panel) => {
    const box = panel.getBoundingClientRect();
    const overflowing = [...panel.querySelectorAll('*')].filter((node) => {
      const r = node.getBoundingClientRect();
      return r.width > 0 && r.height > 0 && (r.left < box.left - 0.5 || r.right > box.right + 0.5);
    }).map(name);
    const style = getComputedStyle(panel);
    const chart = panel.querySelector('.uplot');
    return {
      id: panel.id, clientWidth: panel.clientWidth, scrollWidth: panel.scrollWidth, overflowing: overflowing.slice(0, 6),
      content: panel.clientWidth - parseFloat(style.paddingLeft) - parseFloat(style.paddingRight),
      chart: chart ? chart.getBoundingClientRect().width : null,
    };
  });
  const slo = document.getElementById('slo-box');
  return {
    viewport: doc.clientWidth, pageScroll: doc.scrollWidth - doc.clientWidth, panels,
    sloRight: slo ? slo.getBoundingClientRect().right : null,
    badges: [...document.querySelectorAll('#slo .badge')].map((b) => ({ right: b.getBoundingClientRect().right })),
  };
})()`;

/** The page's layout once every chart has its box's width (or, when they never get it, after 5 s). */
async function settledLayout(page: Page): Promise<Layout> {
  const deadline = Date.now() + 5000;
  for (;;) {
    const layout = await page.evaluate(LAYOUT_PROBE) as Layout;
    const charts = layout.panels.filter((p) => p.chart !== null);
    if (charts.every((p) => Math.abs(p.chart! - p.content) <= 1) || Date.now() > deadline) return layout;
    await new Promise((resolve) => setTimeout(resolve, 50));
  }
}

/** Nothing reaches past its panel, the page does not scroll sideways, each chart is as wide as its box. */
function assertFits(layout: Layout, what: string): void {
  assert.equal(layout.pageScroll, 0, `${what}: the page scrolls sideways by ${layout.pageScroll} px`);
  for (const p of layout.panels) {
    const panel = `${what}: panel ${p.id || '(unnamed)'}`;
    assert.ok(p.scrollWidth <= p.clientWidth, `${panel} scrolls: ${p.scrollWidth} px of content in ${p.clientWidth} px`);
    assert.deepEqual(p.overflowing, [], `${panel}: elements past its edge`);
    if (p.chart !== null) assert.ok(Math.abs(p.chart - p.content) <= 1, `${panel}: a ${p.chart} px chart in ${p.content} px`);
  }
  for (const badge of layout.badges) assert.ok(badge.right <= layout.sloRight!, `${what}: an SLO status badge is off its panel`);
}

const WIDTHS = [390, 1024, 1280, 1366, 1920];

describe('web console in Chromium (two CPU workers)', { skip: existsSync(CHROMIUM_PATH) ? false : `${CHROMIUM_PATH} is not installed` }, () => {
  let server: TestServer;
  let browser: BrowserSession;
  let shots: string;
  let ids: string[];

  before(async () => {
    server = await startTestServer({ flags: ['--workers', '2'] });
    // Several requests at once, so both workers serve and batch.
    ids = await Promise.all([
      stream(server, 'Once upon a time there was a lighthouse keeper', 24),
      stream(server, 'The ship sailed at dawn towards the islands of the north', 24),
      stream(server, 'Write a short poem about the sea', 16),
      stream(server, 'Tell me about the stars', 16),
    ]);
    const store = server.running.api.telemetry.traces;
    await waitFor(() => ids.every((id) => store.get(id) !== undefined), 'the traces');
    shots = outputDir();
    browser = await launchChromium(join(shots, 'profile'));
    console.log(`console screenshots: ${shots}`);
  });
  after(async () => {
    await browser?.close();
    if (shots) rmSync(join(shots, 'profile'), { recursive: true, force: true });
    await server?.close();
  });

  it('shows the workers, charts, SLO, finding and recent requests, with no console error and nothing off 127.0.0.1', E2E, async () => {
    const page = await browser.newPage();
    await page.goto(`${server.url}/console?refresh=500`);
    await page.waitForSelector('body[data-ready]');
    const engine = server.engine as unknown as { workerStats(): { workerId: string }[] };
    const workerIds = engine.workerStats().map((w) => w.workerId);
    assert.equal(workerIds.length, 2);
    // Page-side checks are strings: they run in the browser, which this file's types do not describe.
    await page.waitForFunction(`document.querySelectorAll('#workers tr[data-worker]').length === ${workerIds.length}`);
    const workersText = await page.textContent('#workers');
    for (const id of workerIds) assert.ok(workersText!.includes(id), `worker ${id} on the page`);
    // Each CPU worker's memory: tens of MiB (weights, KV pool, activations), by category in the cell's tooltip.
    const memoryTitle = await page.getAttribute(`#workers tr[data-worker="${workerIds[0]}"] td:nth-child(9)`, 'title');
    assert.match(memoryTitle ?? '', /^weights [\d.]+ MiB, lora_adapters 0 B, kv_cache [\d.]+ [MG]iB, activations [\d.]+ [KM]iB/);
    // Three uPlot charts, drawn on canvases, and the tables below them.
    await page.waitForFunction("document.querySelectorAll('#charts canvas').length >= 3");
    assert.equal(await page.locator('#charts .uplot').count(), 3);
    assert.match((await page.textContent('#slo'))!, /TTFT/);
    assert.match((await page.textContent('#analysis'))!, /requests in the last/);
    for (const id of ids) assert.ok(await page.locator(`#requests a[href="/console/requests/${id}"]`).count() === 1, `request ${id} listed`);
    // A refresh or two later the page is still whole.
    await page.waitForFunction("/updated/.test(document.getElementById('refresh-state').textContent)");
    await page.screenshot({ path: join(shots, 'overview.png'), fullPage: true });
    assert.ok(statSync(join(shots, 'overview.png')).size > 10_000);
    await page.close();
    browser.assertClean();
  });

  it('fits every panel at 390, 1024, 1280, 1366 and 1920 px, and its charts follow the window when it is resized', E2E, async () => {
    const page = await browser.newPage();
    for (const width of WIDTHS) {
      await page.setViewportSize({ width, height: 900 });
      await page.goto(`${server.url}/console?refresh=500`);
      await page.waitForSelector('body[data-ready]');
      await page.waitForSelector('#charts .uplot >> nth=2');
      await page.waitForSelector('#slo .badge');
      const layout = await settledLayout(page);
      assert.equal(layout.viewport, width);
      assert.equal(layout.panels.filter((p) => p.chart !== null).length, 3);
      assert.ok(layout.badges.length >= 3, `${layout.badges.length} SLO badges`);
      assertFits(layout, `overview at ${width} px`);
    }
    // Loaded wide, then narrowed and widened: the charts take their boxes' new widths.
    const chartWidths = (layout: Layout) => layout.panels.filter((p) => p.chart !== null).map((p) => Math.round(p.chart!));
    const wide = chartWidths(await settledLayout(page));
    await page.setViewportSize({ width: 390, height: 900 });
    const narrowed = await settledLayout(page);
    assertFits(narrowed, 'overview narrowed from 1920 to 390 px');
    assert.ok(chartWidths(narrowed).every((w, i) => w < wide[i]! - 50), `charts ${wide.join(', ')} px became ${chartWidths(narrowed).join(', ')} px`);
    await page.setViewportSize({ width: 1024, height: 900 });
    const widened = await settledLayout(page);
    assertFits(widened, 'overview widened from 390 to 1024 px');
    assert.ok(chartWidths(widened).every((w, i) => w > chartWidths(narrowed)[i]!), `charts became ${chartWidths(widened).join(', ')} px`);
    // A request's page too.
    for (const width of WIDTHS) {
      await page.setViewportSize({ width, height: 900 });
      await page.goto(`${server.url}/console/requests/${ids[1]}`);
      await page.waitForSelector('body[data-ready]');
      assert.equal(await page.locator('#phases').count(), 1);
      assertFits(await settledLayout(page), `request page at ${width} px`);
    }
    await page.close();
    browser.assertClean();
  });

  it('bounds ?refresh, ignores a stored key no header can carry, and says when a request id is malformed', E2E, async () => {
    const page = await browser.newPage();
    // A key with a non-ASCII dash (pasted from a document): fetch would throw on every poll with it.
    await page.addInitScript("sessionStorage.setItem('conduit-console-key', 'sk\u2011admin')");
    let polls = 0;
    page.on('request', (request) => {
      if (request.url().endsWith('/console/api/overview')) polls++;
    });
    // A browser fires a timeout beyond 2^31 - 1 ms at once: unbounded, this polled without pause.
    await page.goto(`${server.url}/console?refresh=Infinity`);
    await page.waitForSelector('body[data-ready]');
    await page.waitForFunction("document.querySelectorAll('#workers tr[data-worker]').length === 2");
    await new Promise((resolve) => setTimeout(resolve, 1500));
    assert.equal(polls, 1);
    assert.match((await page.textContent('#refresh-state'))!, /every 3600 s/);
    await page.goto(`${server.url}/console/requests/%E0%A4%A`);
    await page.waitForSelector('body[data-ready]');
    assert.match((await page.textContent('#app'))!, /not a request id.*back to the console/);
    await page.close();
    browser.assertClean();
  });

  it('marks the server unreachable when polls fail, and rebuilds the page when its scope becomes a tenant\'s', E2E, async () => {
    const page = await browser.newPage();
    await page.goto(`${server.url}/console?refresh=500`);
    await page.waitForSelector('#charts .uplot');
    // Polled from here: a string predicate that is not true at once is evaluated by the page, which its CSP refuses.
    const serverState = async (pattern: RegExp, what: string) => {
      const deadline = Date.now() + 30_000;
      while (!pattern.test((await page.textContent('#server-state')) ?? '')) {
        if (Date.now() > deadline) assert.fail(`timed out waiting until ${what}`);
        await new Promise((resolve) => setTimeout(resolve, 50));
      }
    };
    await serverState(/ready/, 'the overview loaded');
    await page.route('**/console/api/overview', (route) => route.abort());
    await serverState(/^server not reachable$/, 'the header says the server is not reachable');
    // The server comes back with keys, and the key given is a tenant's: only that tenant's requests remain.
    await page.unroute('**/console/api/overview');
    await page.route('**/console/api/overview', (route) => route.fulfill({ json: { scope: 'tenant', tenant: 'acme', requests: [] } }));
    await serverState(/tenant acme/, 'the page shows the tenant scope');
    assert.equal(await page.locator('#charts').count(), 0);
    assert.equal(await page.locator('#workers-box').count(), 0);
    assert.equal(await page.locator('#requests-box').count(), 1);
    await page.close();
    // The aborted polls are the only errors this page may have logged.
    const unexpected = browser.errors.filter((e) => !/Failed to load resource|ERR_FAILED/.test(e));
    assert.deepEqual(unexpected, []);
    browser.errors.length = 0;
    browser.assertClean();
  });

  it('draws a request\'s waterfall with every phase, numbers on hover and the diagnosis in words', E2E, async () => {
    const page = await browser.newPage();
    await page.goto(`${server.url}/console`);
    await page.waitForSelector('#requests a');
    // Follow the link, as a person would.
    await page.click(`#requests a[href="/console/requests/${ids[0]}"]`);
    await page.waitForURL(`**/console/requests/${ids[0]}`);
    await page.waitForSelector('body[data-ready]');
    const waterfall = page.locator('svg#waterfall');
    assert.equal(await waterfall.count(), 1);
    const box = await waterfall.boundingBox();
    assert.ok(box && box.width > 500 && box.height > 150, `waterfall drawn: ${JSON.stringify(box)}`);
    const bars = await page.locator('svg#waterfall rect.bar').count();
    assert.ok(bars >= 8, `${bars} bars`);
    const text = (await waterfall.textContent())!;
    for (const name of ['http_receive', 'tokenize', 'router_lookup', 'scheduler_queue', 'prefill_execution', 'decode_execution', 'streaming_response']) {
      assert.ok(text.includes(name), `phase ${name} in the waterfall`);
    }
    assert.ok(await page.locator('svg#waterfall path.tokens').count() === 1, 'token ticks');
    assert.ok(await page.locator('svg#waterfall .mark[data-kind="first_token"]').count() === 1);
    // Hovering a bar shows its numbers.
    await page.hover('svg#waterfall rect.bar[data-phase="prefill_execution"]');
    const tip = page.locator('#tooltip');
    await tip.waitFor({ state: 'visible' });
    assert.match((await tip.textContent())!, /prefill_execution\nstart .* ms, duration .* ms[\s\S]*batch: \d+ sequences/);
    assert.ok(((await page.textContent('#diagnosis')) ?? '').length > 40, 'the diagnosis in words');
    // The dominant phase's share says what it is a share of.
    assert.match((await page.textContent('#diagnosis .finding'))!,
      /^(balanced|[a-z_]+ - [a-z_]+ [\d.]+ ms \([\d.]+% of (TTFT|the request|the decode steps' time)\))$/);
    await page.mouse.move(0, 0);
    await page.screenshot({ path: join(shots, 'request.png'), fullPage: true });
    assert.ok(statSync(join(shots, 'request.png')).size > 10_000);
    await page.close();
    browser.assertClean();
  });
});
