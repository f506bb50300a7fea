// The phase a cancelled request is counted in (conduit_request_cancellations_total{phase}, the trace's endedInPhase)
// is the one running when the client left. An engine learns of an abort only once the step it is running is over,
// so a client that leaves during the prompt's last prefill step ends with that step's first token stamped after it
// left: that request was cancelled in prefill, not in decode. Through the real server and CPU engine, on a model
// whose one prefill step of a long prompt lasts seconds on one thread, so the client can leave inside it.

import assert from 'node:assert/strict';
import { mkdtempSync, rmSync } from 'node:fs';
import { connect, type Socket } from 'node:net';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { after, before, describe, it } from 'node:test';
import { engineNow } from '../../src/engine/clock.ts';
import { synthetic110mSpec, writeSyntheticModel } from '../../src/model/synthetic.ts';
import { isTerminal, type LifecycleEvent } from '../../src/telemetry/index.ts';
import { buildRequestTrace, type RequestTrace } from '../../src/telemetry/trace.ts';
import { startTestServer, waitFor, type TestServer } from '../api/e2e-fixture.ts';
import { rawRequest } from '../api/http-client.ts';
import { parseExposition, total } from './exposition.ts';
import { abortedInQueueTimeline, T0 as FIXTURE_T0 } from './fixtures.ts';

const LIVE = { timeout: 180_000 };
/** Prompts of about 3400 tokens: one prefill step of several seconds on one thread, by this model's size. */
const PROMPT_WORDS = 700;
/** Attempts at leaving inside the step (a loaded machine may not have started it yet when the client leaves). */
const ATTEMPTS = 4;

describe('the phase a cancelled request is counted in', () => {
  let dir: string;
  let server: TestServer;
  const terminals: LifecycleEvent[] = [];
  let prompts = 0;

  before(async () => {
    dir = mkdtempSync(join(tmpdir(), 'conduit-cancel-phase-'));
    const model = join(dir, 'slow-prefill.gguf');
    writeSyntheticModel({ ...synthetic110mSpec('Q8_0'), name: 'slow-prefill', numLayers: 8, contextLength: 4096 }, model);
    server = await startTestServer({ flags: ['--model', model, '--threads', '1', '--max-num-batched-tokens', '4096',
      '--kv-cache-memory', '256MiB', '--no-enable-prefix-caching'] });
    server.running.api.telemetry.lifecycle.subscribe((event) => { if (isTerminal(event)) terminals.push(event); });
  });

  after(async () => {
    await server?.close();
    if (dir) rmSync(dir, { recursive: true, force: true });
  });

  async function cancellations(): Promise<Record<string, number>> {
    const exposition = parseExposition((await rawRequest(server.url, { path: '/metrics' })).text);
    const out: Record<string, number> = {};
    for (const phase of ['scheduler_queue', 'prefill_execution', 'decode_execution']) {
      out[phase] = total(exposition, 'conduit_request_cancellations_total', { phase });
    }
    return out;
  }

  /** A streamed completion on its own connection, to be destroyed as the client leaving; `received` is what came back. */
  function stream(promptWords = PROMPT_WORDS, maxTokens = 8): { socket: Socket; received: () => string } {
    const words = Array.from({ length: promptWords }, (_, i) => `w${prompts}x${i % 89}`).join(' ');
    prompts++;
    const text = JSON.stringify({ model: server.running.api.gateway.servedModelName, prompt: words, max_tokens: maxTokens, stream: true });
    const socket = connect(Number(new URL(server.url).port), '127.0.0.1');
    socket.on('error', () => {});
    let received = '';
    socket.on('data', (chunk: Buffer) => { received += chunk.toString('latin1'); });
    socket.write(`POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n`
      + `Content-Length: ${Buffer.byteLength(text)}\r\n\r\n${text}`);
    return { socket, received: () => received };
  }

  async function ended(count: number): Promise<LifecycleEvent> {
    await waitFor(() => terminals.length >= count, 'the request over', 120_000);
    return terminals[count - 1]!;
  }

  it('a client that leaves while the prompt\'s last prefill step runs is cancelled in prefill_execution', LIVE, async () => {
    let leftAfterMs = 1000;
    for (let attempt = 1; ; attempt++) {
      const before = await cancellations();
      const count = terminals.length + 1;
      const { socket, received } = stream();
      await new Promise((resolve) => setTimeout(resolve, leftAfterMs));
      const leftMs = engineNow();
      socket.destroy();
      const terminal = await ended(count);
      await waitFor(() => server.engine.stats().numRunning === 0, 'the engine idle');
      const trace: RequestTrace | undefined = server.running.api.telemetry.trace(terminal.requestId);
      assert.ok(trace, 'the trace was kept');
      const prefill = trace.phases.find((p) => p.phase === 'prefill_execution');
      // What the test is about: the step began before the client left and sampled the first token after.
      const inside = prefill !== undefined && prefill.startMs < leftMs && (trace.engineFirstTokenMs ?? -Infinity) > leftMs;
      if (!inside) {
        assert.ok(attempt < ATTEMPTS, `the client never left inside the prefill step in ${ATTEMPTS} attempts`);
        // Not started yet: leave later; already over: leave sooner.
        leftAfterMs = prefill === undefined || prefill.startMs >= leftMs ? leftAfterMs * 2 : leftAfterMs / 2;
        continue;
      }
      assert.equal(terminal.phase, 'abort');
      assert.equal(received(), '', 'nothing was sent: the client left before the first token');
      assert.equal(trace.endedInPhase, 'prefill_execution');
      const after = await cancellations();
      assert.deepEqual(after, { ...before, prefill_execution: before.prefill_execution! + 1 });
      return;
    }
  });

  it('one that leaves once the first token went out is cancelled in decode_execution', LIVE, async () => {
    const before = await cancellations();
    const count = terminals.length + 1;
    // A short prompt, and more tokens than it can write before the client is gone.
    const { socket, received } = stream(20, 2000);
    await waitFor(() => received().includes('data: '), 'the first token streamed', 120_000);
    socket.destroy();
    const terminal = await ended(count);
    assert.equal(terminal.phase, 'abort');
    assert.equal(server.running.api.telemetry.trace(terminal.requestId)?.endedInPhase, 'decode_execution');
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
    const cut = abortedAt !== undefined ? { abortedAt } : {};
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
