// The phase a cancelled request is counted in (conduit_request_cancellations_total{phase}, the trace's endedInPhase)
// is the one running when the client left. An engine learns of an abort only once the step it is running is over,
// so a client that leaves during the prompt's last prefill step ends with that step's first token stamped after it
// left: that request was cancelled in prefill, not in decode. Through the real server, with an engine that holds
// its step until the test lets it end, on a clock the test moves, so each ordering is exact.

import assert from 'node:assert/strict';
import { connect, type Socket } from 'node:net';
import { after, before, describe, it } from 'node:test';
import { KeyStore } from '../../src/api/auth.ts';
import { silentLogger } from '../../src/api/log.ts';
import { ApiServer } from '../../src/api/server.ts';
import type { Engine, EngineInfo, EngineOutput, EngineRequest, RequestTimestamps } from '../../src/engine/types.ts';
import { readGguf } from '../../src/model/gguf.ts';
import { LLAMA_SPM_TOKENIZER_PATH } from '../../src/model/synthetic.ts';
import { tokenizerFromGguf } from '../../src/model/tokenizer/index.ts';
import type { EngineStats } from '../../src/protocols/worker.ts';
import { createTelemetry, isTerminal, type LifecycleEvent, type Telemetry } from '../../src/telemetry/index.ts';
import { waitFor } from '../api/e2e-fixture.ts';
import { rawRequest } from '../api/http-client.ts';
import { parseExposition, total } from './exposition.ts';
import { buildRequestTrace, type AbortedAt } from '../../src/telemetry/trace.ts';
import { abortedInQueueTimeline, T0 as FIXTURE_T0 } from './fixtures.ts';

const LIVE = { timeout: 60_000 };
const T0 = 1_000_000;

/** One request at a time: queued, then its single prefill step starts and runs until the test ends it. */
class SteppingEngine implements Engine {
  readonly info: EngineInfo = {
    modelName: 'stepping', maxModelLen: 4096, vocabSize: 32000, kvCapacityTokens: 65536, blockSize: 16,
    backend: 'reference', kernelVariants: {}, threads: 1,
  };
  private current: {
    request: EngineRequest; timestamps: RequestTimestamps; stepStart: number; sampled: boolean;
    push: (output: EngineOutput) => void; end: () => void;
  } | undefined;

  constructor(private readonly clock: { t: number }) {}

  get running(): boolean {
    return this.current !== undefined;
  }

  generate(request: EngineRequest): AsyncIterable<EngineOutput> {
    const outputs: EngineOutput[] = [];
    let done = false;
    let wake: (() => void) | undefined;
    const timestamps: RequestTimestamps = { arrival: request.arrivalMs, queued: this.clock.t, firstScheduled: this.clock.t, prefillChunks: [] };
    this.current = {
      request, timestamps, stepStart: this.clock.t, sampled: false,
      push: (output) => { outputs.push(output); wake?.(); },
      end: () => { done = true; wake?.(); },
    };
    return {
      async *[Symbol.asyncIterator]() {
        for (;;) {
          if (outputs.length > 0) { yield outputs.shift()!; continue; }
          if (done) return;
          await new Promise<void>((resolve) => { wake = resolve; });
          wake = undefined;
        }
      },
    };
  }

  /** The prefill step ends now: the prompt's last chunk is computed and the first token sampled. */
  endStep(): void {
    const c = this.current!;
    if (c.sampled) return;
    c.sampled = true;
    const now = this.clock.t;
    c.timestamps.prefillChunks.push({ start: c.stepStart, end: now, tokens: c.request.promptTokenIds.length });
    c.timestamps.firstToken = now;
    c.timestamps.lastToken = now;
    c.push(this.output([450], ' The'));
  }

  abort(requestId: string): void {
    const c = this.current;
    if (c?.request.id !== requestId) return;
    // The abort waits for the step that is running: the engine is busy until it ends.
    setTimeout(() => {
      this.clock.t += 5;
      this.endStep();
      c.timestamps.finished = this.clock.t;
      c.push({ ...this.output([], ''), finishReason: 'abort' });
      this.current = undefined;
      c.end();
    }, 20);
  }

  private output(tokenIds: number[], text: string): EngineOutput {
    const c = this.current!;
    return {
      requestId: c.request.id, index: 0, newTokenIds: tokenIds, textDelta: text,
      usage: { promptTokens: c.request.promptTokenIds.length, completionTokens: c.sampled ? 1 : 0, cachedTokens: 0 },
      timestamps: { ...c.timestamps, prefillChunks: [...c.timestamps.prefillChunks] },
    };
  }

  stats(): EngineStats {
    const busy = this.current !== undefined ? 1 : 0;
    return { numRunning: busy, numWaiting: 0, kvBlocksUsed: busy, kvBlocksTotal: 4096, prefixCacheQueries: 0, prefixCacheHits: 0, preemptions: 0 };
  }

  async resetPrefixCache(): Promise<boolean> {
    return true;
  }

  async close(): Promise<void> {}
}

describe('the phase a cancelled request is counted in', () => {
  const clock = { t: T0 };
  let telemetry: Telemetry;
  let api: ApiServer;
  let engine: SteppingEngine;
  const terminals: LifecycleEvent[] = [];

  before(async () => {
    telemetry = createTelemetry({ env: {}, now: () => clock.t });
    telemetry.lifecycle.subscribe((event) => { if (isTerminal(event)) terminals.push(event); });
    api = new ApiServer({ keyStore: new KeyStore({ keys: [], tenants: new Map() }), telemetry, logger: silentLogger });
    await api.listen(0);
    engine = new SteppingEngine(clock);
    api.attach({ engine, tokenizer: tokenizerFromGguf(readGguf(LLAMA_SPM_TOKENIZER_PATH)), clock: () => clock.t });
  });

  after(async () => {
    await api?.shutdown(0);
    await telemetry?.shutdown();
  });

  async function cancellations(): Promise<Record<string, number>> {
    const text = (await rawRequest(api.url, { path: '/metrics' })).text;
    const exposition = parseExposition(text);
    const out: Record<string, number> = {};
    for (const phase of ['scheduler_queue', 'prefill_execution', 'decode_execution']) {
      out[phase] = total(exposition, 'conduit_request_cancellations_total', { phase });
    }
    return out;
  }

  /** A streamed completion on its own connection, to be destroyed as the client leaving; `received` is what came back. */
  function stream(): { socket: Socket; received: () => string } {
    const text = JSON.stringify({ model: api.gateway.servedModelName, prompt: 'the lighthouse keeper counted the ships', max_tokens: 8, stream: true });
    const socket = connect(Number(new URL(api.url).port), '127.0.0.1');
    socket.on('error', () => {});
    let received = '';
    socket.on('data', (chunk: Buffer) => { received += chunk.toString('latin1'); });
    socket.write(`POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n`
      + `Content-Length: ${Buffer.byteLength(text)}\r\n\r\n${text}`);
    return { socket, received: () => received };
  }

  async function ended(count: number): Promise<LifecycleEvent> {
    await waitFor(() => terminals.length === count && !engine.running, 'the request over');
    return terminals[count - 1]!;
  }

  it('a client that leaves while the prompt\'s last prefill step runs is cancelled in prefill_execution', LIVE, async () => {
    const before = await cancellations();
    const { socket, received } = stream();
    await waitFor(() => engine.running, 'the prefill step running');
    clock.t += 3;
    socket.destroy();
    const terminal = await ended(terminals.length + 1);
    assert.equal(terminal.phase, 'abort');
    assert.equal(received(), '', 'nothing was sent: the client left before the first token');
    const trace = telemetry.trace(terminal.requestId);
    assert.ok(trace, 'the trace was kept');
    assert.ok(trace.engineFirstTokenMs !== undefined && trace.engineFirstTokenMs > T0 + 3,
      'the engine sampled the first token after the client left');
    assert.equal(trace.endedInPhase, 'prefill_execution');
    const after = await cancellations();
    assert.deepEqual(after, { ...before, prefill_execution: before.prefill_execution! + 1 });
  });

  it('one that leaves once the first token went out is cancelled in decode_execution', LIVE, async () => {
    const before = await cancellations();
    const count = terminals.length;
    const { socket, received } = stream();
    await waitFor(() => engine.running, 'the prefill step running');
    clock.t += 3;
    engine.endStep();
    await waitFor(() => received().includes(' The'), 'the first token streamed');
    clock.t += 3;
    socket.destroy();
    const terminal = await ended(count + 1);
    assert.equal(terminal.phase, 'abort');
    assert.equal(telemetry.trace(terminal.requestId)?.endedInPhase, 'decode_execution');
    const after = await cancellations();
    assert.deepEqual(after, { ...before, decode_execution: before.decode_execution! + 1 });
  });
});

describe('the phase of a cancelled request, from its events', () => {
  /** A request whose client left while it was queued, the step that picked it up already running. */
  function leftWhileQueued(abortedAt: number | undefined): LifecycleEvent[] {
    const events = abortedInQueueTimeline('q1');
    const terminal = events.at(-1)! as Extract<LifecycleEvent, { phase: 'abort' }>;
    const at = FIXTURE_T0;
    const engine = {
      worker: 'worker-1',
      timestamps: { arrival: at, queued: at + 2, firstScheduled: at + 30, prefillChunks: [{ start: at + 30, end: at + 38, tokens: 512 }], finished: at + 38 },
    };
    const cut: AbortedAt = abortedAt !== undefined ? { abortedAt } : {};
    return [...events.slice(0, -1), { ...terminal, ...cut, engine }];
  }

  it('is the queue when the client left before the engine picked the request up', () => {
    assert.equal(buildRequestTrace(leftWhileQueued(FIXTURE_T0 + 25)).endedInPhase, 'scheduler_queue');
  });

  it('is the prefill when the client left after that (or when the ending does not say)', () => {
    assert.equal(buildRequestTrace(leftWhileQueued(FIXTURE_T0 + 31)).endedInPhase, 'prefill_execution');
    assert.equal(buildRequestTrace(leftWhileQueued(undefined)).endedInPhase, 'prefill_execution');
  });
});
