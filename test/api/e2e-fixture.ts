// The real server for end-to-end tests: `conduit serve`'s own start-up path (flags, keys file, local engine with
// the built-in model) on an ephemeral port, with a rate-limit clock the test steps by hand.

import { mkdtempSync, rmSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { silentLogger } from '../../src/util/log.ts';
import { parseServeConfig, startServer, type RunningServer } from '../../src/cli/serve.ts';
import type { Engine } from '../../src/engine/types.ts';

export interface ManualClock {
  now: () => number;
  advance: (ms: number) => void;
}

export function manualClock(startMs = 1_000_000): ManualClock {
  let t = startMs;
  return { now: () => t, advance: (ms) => { t += ms; } };
}

export interface TestServer {
  url: string;
  running: RunningServer;
  engine: Engine;
  clock: ManualClock;
  close(): Promise<void>;
}

/** With a keys file, the fixture's server also takes this admin key (tenant "admin"): /metrics, /v1/slo ... */
export const ADMIN_KEY = 'sk-test-admin-0000';

export interface TestServerOptions {
  /** Keys file in the line format ("key tenant [rpm] [tpm] [max_concurrent]"); none = open mode. With one, ADMIN_KEY too. */
  keysFile?: string;
  /** More serve flags. */
  flags?: string[];
}

export async function startTestServer(options: TestServerOptions = {}): Promise<TestServer> {
  const dir = mkdtempSync(join(tmpdir(), 'conduit-api-test-'));
  const flags = ['--port', '0', '--log-level', 'silent', '--kv-cache-memory', '24MiB', '--max-num-seqs', '8',
    ...(options.flags ?? [])];
  if (options.keysFile !== undefined) {
    const path = join(dir, 'keys.txt');
    writeFileSync(path, options.keysFile);
    flags.push('--api-keys-file', path, '--admin-key', ADMIN_KEY);
  }
  // An empty environment: CONDUIT_* variables of whoever runs the tests must not change the server under test.
  const config = parseServeConfig(flags, {});
  if (config === 'help') throw new Error('unexpected --help');
  const clock = manualClock();
  const running = await startServer(config, silentLogger, clock.now);
  return {
    url: running.url,
    running,
    engine: running.api.gateway.engine!,
    clock,
    async close() {
      await running.api.shutdown(0);
      rmSync(dir, { recursive: true, force: true });
    },
  };
}

/** Polls until `check` holds; a guard against hangs, not a timing assertion. */
export async function waitFor(check: () => boolean, what: string, timeoutMs = 30_000): Promise<void> {
  const deadline = Date.now() + timeoutMs;
  while (!check()) {
    if (Date.now() > deadline) throw new Error(`timed out waiting for ${what}`);
    await new Promise((resolve) => setTimeout(resolve, 20));
  }
}

/** Every KV block back in the pool and nothing running or waiting. */
export function engineIdle(engine: Engine): boolean {
  const stats = engine.stats();
  return stats.kvBlocksUsed === 0 && stats.numRunning === 0 && stats.numWaiting === 0;
}
