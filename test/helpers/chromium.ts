// Chromium for page tests: Debian's /usr/bin/chromium driven by playwright-core, with a fresh profile, networking
// extras off, and every request checked: a request to any host but 127.0.0.1 is aborted and recorded, and so is every
// console error and uncaught page error, so a test can assert the page stayed local and clean.

import assert from 'node:assert/strict';
import { chromium, type BrowserContext, type Page } from 'playwright-core';

export const CHROMIUM_PATH = '/usr/bin/chromium';

const ARGS = [
  '--headless', '--no-sandbox', '--disable-gpu', '--disable-quic', '--no-first-run', '--disable-background-networking',
  '--disable-component-update', '--disable-sync',
];

export interface BrowserSession {
  newPage(): Promise<Page>;
  /** Console errors and page errors so far. */
  readonly errors: string[];
  /** Requests that tried to leave 127.0.0.1. */
  readonly offHost: string[];
  assertClean(): void;
  close(): Promise<void>;
}

export async function launchChromium(userDataDir: string): Promise<BrowserSession> {
  const context: BrowserContext = await chromium.launchPersistentContext(userDataDir, {
    executablePath: CHROMIUM_PATH, headless: true, args: ARGS, viewport: { width: 1280, height: 900 },
  });
  const errors: string[] = [];
  const offHost: string[] = [];
  await context.route('**/*', async (route) => {
    const url = new URL(route.request().url());
    // A local file (a saved report) and the server under test are local; anything else would leave the machine.
    if (url.protocol === 'file:' || url.hostname === '127.0.0.1') return route.continue();
    offHost.push(url.href);
    return route.abort();
  });
  const watch = (page: Page): void => {
    page.on('console', (message) => {
      if (message.type() === 'error') errors.push(`console: ${message.text()}`);
    });
    page.on('pageerror', (error) => errors.push(`page error: ${error.message}`));
  };
  context.on('page', watch);
  for (const page of context.pages()) watch(page);
  return {
    newPage: () => context.newPage(),
    errors,
    offHost,
    assertClean() {
      assert.deepEqual(errors, [], 'no console or page errors');
      assert.deepEqual(offHost, [], 'no request left 127.0.0.1');
    },
    close: () => context.close(),
  };
}
