// A live server for the telemetry integration tests: the real ApiServer on an ephemeral port, the real engine
// (the worker pool `conduit serve` uses, with the built-in model), and a telemetry instance the test owns, with an
// in-memory span exporter, so spans, the bus and the metrics can all be read. Also: scraping /metrics into samples,
// and a bus listener that counts each request's terminal events.

import { InMemorySpanExporter } from '@opentelemetry/sdk-trace-node';
import { combineKeyConfig, KeyStore, parseKeysFile } from '../../src/api/auth.ts';
import { silentLogger } from '../../src/util/log.ts';
import { ApiServer } from '../../src/api/server.ts';
import type { Engine } from '../../src/engine/types.ts';
import { ensureBuiltinModel } from '../../src/model/synthetic.ts';
import { createWorkerPool } from '../../src/runtime/worker-pool.ts';
import { createTelemetry, isTerminal, type Telemetry, type TelemetryOptions } from '../../src/telemetry/index.ts';
import { ADMIN_KEY } from '../api/e2e-fixture.ts';
import { rawRequest } from '../api/http-client.ts';
import { parseExposition, total, type Exposition } from './exposition.ts';

export interface LiveServer {
  url: string;
  api: ApiServer;
  engine: Engine;
  telemetry: Telemetry;
  exporter: InMemorySpanExporter;
  /** Terminal events (finish, error, abort) seen per request id. */
  terminals: Map<string, string[]>;
  close(): Promise<void>;
}

export interface LiveServerOptions {
  /** Keys file in the line format ("key tenant [rpm] [tpm] [max_concurrent]"); none = open mode. */
  keysFile?: string;
  requestTimeoutMs?: number;
  workers?: number;
  /** Disaggregated serving, every prompt prefilled on a prefill worker and its KV moved to a decode worker. */
  disaggregated?: { prefillWorkers: number; decodeWorkers: number };
  /** The simulated engine (`--engine sim`) instead of the CPU workers with the built-in model. */
  sim?: boolean;
  /** The simulated engine's speed-up (default 100; 1 keeps its clock with the gateway's). */
  simSpeedUp?: number;
  /** Bytes of KV pool per CPU worker (default 24 MiB). */
  kvCacheMemoryBytes?: number;
  maxNumSeqs?: number;
  /** Compute threads per CPU worker (default: the cores shared out). */
  threads?: number;
  /** Tokens one step may compute (small: long prompts are prefilled in chunks). */
  maxNumBatchedTokens?: number;
  /** Jump-forward decoding for guided requests on the CPU workers (`--guided-jump-forward`; off by default). */
  guidedJumpForward?: boolean;
  /** Tokens a CPU worker hands over together after a completion's first (`--stream-interval`; default 1). */
  streamInterval?: number;
  /** Telemetry settings over the fixture's (sampling, per-token spans...). */
  telemetry?: Partial<TelemetryOptions>;
}

export async function startLiveServer(options: LiveServerOptions = {}): Promise<LiveServer> {
  const exporter = new InMemorySpanExporter();
  // No OTEL_* from whoever runs the tests; spans exported as they end, for every request the head sampler keeps.
  // The engine clock, or the simulated workers' at a speed-up other than 1 (the pool's clock, once it exists).
  let clock = () => performance.timeOrigin + performance.now();
  const telemetry = createTelemetry({ env: {}, exporters: [exporter], processor: 'simple', now: () => clock(), ...options.telemetry });
  const terminals = new Map<string, string[]>();
  telemetry.lifecycle.subscribe((event) => {
    if (!isTerminal(event)) return;
    terminals.set(event.requestId, [...(terminals.get(event.requestId) ?? []), event.phase]);
  });
  // With keys, ADMIN_KEY too: scrape() and the server-wide reports need it.
  const keyStore = new KeyStore(options.keysFile ? combineKeyConfig(parseKeysFile(options.keysFile, 'keys.txt'), [], ADMIN_KEY)
    : { keys: [], tenants: new Map() });
  const api = new ApiServer({
    keyStore, telemetry, logger: silentLogger,
    ...(options.requestTimeoutMs !== undefined ? { requestTimeoutMs: options.requestTimeoutMs } : {}),
  });
  await api.listen(0);
  try {
    const pool = await createWorkerPool({
      ...(options.sim
        ? { engine: 'sim', sim: { model: 'llama-3.1-8b', gpu: 'h100', tp: 1, speedUp: options.simSpeedUp ?? 100 } }
        : { engine: 'cpu', modelPath: await ensureBuiltinModel() }),
      workers: options.workers ?? 1, backend: 'auto',
      kvCacheMemoryBytes: options.kvCacheMemoryBytes ?? 24 * 1024 * 1024, maxNumSeqs: options.maxNumSeqs ?? 8,
      ...(options.threads !== undefined ? { threads: options.threads } : {}),
      ...(options.maxNumBatchedTokens !== undefined ? { maxNumBatchedTokens: options.maxNumBatchedTokens } : {}),
      ...(options.guidedJumpForward !== undefined ? { guidedJumpForward: options.guidedJumpForward } : {}),
      ...(options.streamInterval !== undefined ? { streamInterval: options.streamInterval } : {}),
      ...(options.disaggregated ? {
        ...options.disaggregated,
        // Remote prefill whatever the prompt: estimates that make moving KV always cheaper than computing it.
        disaggregationPolicy: { minRemotePrefillTokens: 1 },
        disaggregationEstimates: { transferBytesPerSec: 1e15, prefillTokensPerSec: 1, fixed: true },
      } : {}),
    });
    if (pool.clock) clock = pool.clock;
    api.attach({
      engine: pool.engine, tokenizer: pool.tokenizer, chatTemplate: pool.chatTemplate, ...(pool.clock ? { clock: pool.clock } : {}),
      ...(pool.holdClock ? { holdClock: pool.holdClock } : {}),
    });
    return {
      url: api.url, api, engine: pool.engine, telemetry, exporter, terminals,
      async close() {
        await api.shutdown(0);
        await telemetry.shutdown();
      },
    };
  } catch (err) {
    await api.shutdown(0);
    await telemetry.shutdown();
    throw err;
  }
}

export async function scrape(url: string): Promise<{ text: string; exposition: Exposition }> {
  // The admin key: with keys configured /metrics is for admins (in open mode the header is ignored).
  const res = await rawRequest(url, { path: '/metrics', headers: { Authorization: `Bearer ${ADMIN_KEY}` } });
  if (res.status !== 200) throw new Error(`/metrics answered ${res.status}`);
  return { text: res.text, exposition: parseExposition(res.text) };
}

/** How much a sum of samples moved between two scrapes. */
export function moved(before: Exposition, after: Exposition, name: string, labels: Record<string, string> = {}): number {
  return total(after, name, labels) - total(before, name, labels);
}
