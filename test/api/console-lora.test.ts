// The web console in Chromium for a request that named a LoRA adapter as its model: the trace's model is then the
// adapter's base model, and the console must still say which adapter the request ran with, in the list of recent
// requests and on its own page, or a client's requests to the adapter look like requests to the base model.

import assert from 'node:assert/strict';
import { existsSync, mkdtempSync, rmSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { after, before, describe, it } from 'node:test';
import { startTestServer, waitFor, type TestServer } from './e2e-fixture.ts';
import { launchChromium, CHROMIUM_PATH, type BrowserSession } from '../helpers/chromium.ts';

const E2E = { timeout: 180_000 };

describe('web console with a LoRA adapter', { skip: existsSync(CHROMIUM_PATH) ? false : `${CHROMIUM_PATH} is not installed` }, () => {
  let server: TestServer;
  let browser: BrowserSession;
  let profile: string;
  let adapterId: string;
  let baseId: string;

  before(async () => {
    // Simulated workers: an adapter needs no file there (a synthetic one of --sim-lora-rank).
    server = await startTestServer({ flags: ['--engine', 'sim', '--sim-speed-up', 'inf', '--lora-modules', 'sql-lora=/adapters/sql-lora', '--sim-lora-rank', '8'] });
    const complete = async (model: string) => {
      const res = await fetch(`${server.url}/v1/completions`, {
        method: 'POST', headers: { 'Content-Type': 'application/json' }, body: JSON.stringify({ model, prompt: 'select', max_tokens: 4 }),
      });
      assert.equal(res.status, 200);
      return ((await res.json()) as { id: string }).id;
    };
    const models = ((await (await fetch(`${server.url}/v1/models`)).json()) as { data: { id: string; parent: string | null }[] }).data;
    adapterId = await complete('sql-lora');
    baseId = await complete(models.find((m) => m.parent === null)!.id);
    await waitFor(() => [adapterId, baseId].every((id) => server.running.api.telemetry.traces.get(id) !== undefined), 'the traces');
    profile = mkdtempSync(join(tmpdir(), 'conduit-console-lora-'));
    browser = await launchChromium(profile);
  });
  after(async () => {
    await browser?.close();
    if (profile) rmSync(profile, { recursive: true, force: true });
    await server?.close();
  });

  it('names the adapter beside its base model in the recent requests and on the request page', E2E, async () => {
    const page = await browser.newPage();
    await page.goto(`${server.url}/console`);
    await page.waitForSelector(`#requests a[href="/console/requests/${adapterId}"]`);
    const modelCell = async (id: string) => page.textContent(`#requests tr:has(a[href="/console/requests/${id}"]) td:nth-child(3)`);
    assert.equal(await modelCell(adapterId), 'sql-lora (LoRA on Llama-3.1-8B)');
    assert.equal(await modelCell(baseId), 'Llama-3.1-8B');
    await page.goto(`${server.url}/console/requests/${adapterId}`);
    await page.waitForSelector('#phases');
    const facts = await page.locator('dl.facts').first().textContent();
    assert.match(facts!, /modelLlama-3\.1-8BLoRA adaptersql-lora/);
    await page.close();
    browser.assertClean();
  });
});
