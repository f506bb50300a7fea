// The console's request page in a real browser (Chromium through playwright-core): its waterfall is drawn at the width
// it is shown at, and drawn again when the window narrows or widens, so one unit of the SVG stays one pixel (bars,
// ticks and the text of its labels keep their size) instead of the load-time drawing being stretched or squeezed.

import assert from 'node:assert/strict';
import { existsSync, mkdtempSync, rmSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { after, before, describe, it } from 'node:test';
import type { Page } from 'playwright-core';
import { launchChromium, CHROMIUM_PATH, type BrowserSession } from '../helpers/chromium.ts';
import { rawRequest } from '../api/http-client.ts';
import { startLiveServer, type LiveServer } from './integration-fixture.ts';

const E2E = { timeout: 180_000 };

/** What the probe reads of the waterfall: its drawn (viewBox) and shown widths, and a label's and a bar's size on screen. */
interface Drawn {
  viewBox: number;
  shown: number;
  labelHeight: number;
  lastBarRight: number;
  svgRight: number;
}

// Runs in the page (a string: this file's types do not describe the DOM).
const PROBE = `(() => {
  const svg = document.getElementById('waterfall');
  if (!svg) return null;
  const label = svg.querySelector('g.row text');
  const bars = [...svg.querySelectorAll('rect.bar')].map((b) => b.getBoundingClientRect().right);
  return {
    viewBox: svg.viewBox.baseVal.width, shown: svg.clientWidth, labelHeight: label.getBoundingClientRect().height,
    lastBarRight: Math.max(...bars), svgRight: svg.getBoundingClientRect().right,
  };
})()`;

/** The waterfall once it is drawn at the width it is shown at (or, when it never is, after 5 s). */
async function settled(page: Page): Promise<Drawn> {
  const deadline = Date.now() + 5000;
  for (;;) {
    const drawn = await page.evaluate(PROBE) as Drawn | null;
    if (drawn && (Math.abs(drawn.viewBox - drawn.shown) <= 1 || Date.now() > deadline)) return drawn;
    await new Promise((resolve) => setTimeout(resolve, 50));
  }
}

function assertDrawnAsShown(drawn: Drawn, labelHeight: number, what: string): void {
  assert.ok(Math.abs(drawn.viewBox - drawn.shown) <= 1, `${what}: drawn at ${drawn.viewBox} px, shown at ${drawn.shown} px`);
  assert.ok(Math.abs(drawn.labelHeight - labelHeight) <= 0.5, `${what}: labels ${drawn.labelHeight} px high, ${labelHeight} px at load`);
  assert.ok(drawn.lastBarRight <= drawn.svgRight + 0.5, `${what}: a bar ends at ${drawn.lastBarRight}, past the waterfall's ${drawn.svgRight}`);
}

describe('the console\'s request waterfall follows the window (Chromium)', { skip: existsSync(CHROMIUM_PATH) ? false : `${CHROMIUM_PATH} is not installed` }, () => {
  let server: LiveServer;
  let browser: BrowserSession;
  let profile: string;
  let id: string;

  before(async () => {
    server = await startLiveServer({ sim: true });
    const model = server.api.gateway.servedModelName!;
    const res = await rawRequest(server.url, {
      path: '/v1/completions', body: { model, prompt: 'The lighthouse keeper climbed the stairs', max_tokens: 12, ignore_eos: true, stream: true },
    });
    assert.equal(res.status, 200, res.text);
    id = res.headers['x-request-id'] as string;
    const deadline = Date.now() + 30_000;
    while (server.telemetry.traces.get(id) === undefined) {
      if (Date.now() > deadline) throw new Error(`no trace of ${id}`);
      await new Promise((resolve) => setTimeout(resolve, 20));
    }
    profile = mkdtempSync(join(tmpdir(), 'conduit-waterfall-resize-'));
    browser = await launchChromium(profile);
  });
  after(async () => {
    await browser?.close();
    if (profile) rmSync(profile, { recursive: true, force: true });
    await server?.close();
  });

  it('draws the waterfall at its shown width, and again at the new width when the window is resized', E2E, async () => {
    const page = await browser.newPage();
    await page.setViewportSize({ width: 1024, height: 900 });
    await page.goto(`${server.url}/console/requests/${id}`);
    await page.waitForSelector('body[data-ready]');
    const loaded = await settled(page);
    assertDrawnAsShown(loaded, loaded.labelHeight, 'loaded at 1024 px');
    assert.ok(loaded.labelHeight > 8 && loaded.labelHeight < 30, `labels ${loaded.labelHeight} px high`);

    let previous = loaded;
    for (const width of [1366, 800, 1280]) {
      await page.setViewportSize({ width, height: 900 });
      const drawn = await settled(page);
      assertDrawnAsShown(drawn, loaded.labelHeight, `resized to ${width} px`);
      assert.notEqual(drawn.viewBox, previous.viewBox, `resized to ${width} px: drawn again at a new width`);
      previous = drawn;
    }
    // The drawing that replaced the first still shows each bar's numbers on hover.
    await page.hover('svg#waterfall rect.bar[data-phase="prefill_execution"]');
    const tip = page.locator('#tooltip');
    await tip.waitFor({ state: 'visible' });
    assert.match((await tip.textContent())!, /^prefill_execution\nstart .* ms, duration .* ms/);
    assert.equal(await page.locator('svg#waterfall').count(), 1, 'one waterfall');
    await page.close();
    browser.assertClean();
  });
});
