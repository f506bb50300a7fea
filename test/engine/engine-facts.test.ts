// What an engine reports about each request beside its tokens, for the traces and metrics: the batch of every step
// the request was in (on each output, and summarised per request on its timestamps), the queue depth it met, the
// budget its first step granted, the traceparent it was given, and the KV evictions in its stats. The same checks
// run on the local engine (the built-in model in a worker thread) and on the simulated engine.
import { after, before, describe, it } from 'node:test';
import assert from 'node:assert/strict';
import { createLocalEngine, type LocalEngine } from '../../src/engine/local-engine.ts';
import type { KvEvent } from '../../src/protocols/kv-events.ts';
import { DEFAULT_SAMPLING, type Engine, type EngineOutput, type EngineRequest, type RequestTimestamps } from '../../src/engine/types.ts';
import { type EngineStats } from '../../src/protocols/worker.ts';
import { ensureBuiltinModel } from '../../src/model/synthetic.ts';
import { SimEngine } from '../../src/sim/sim-engine.ts';
import { toyWorker } from '../sim/sim-fixtures.ts';

/**
 * The built-in model's KV per block of 16 tokens as a worker at --kv-cache-dtype auto stores it (f16 on both CPU
 * backends): 2 (K, V) x 6 layers x 2 KV heads x 64 dims x 2 bytes x 16.
 */
const BUILTIN_BLOCK_BYTES = 2 * 6 * 2 * 64 * 2 * 16;
const TRACEPARENT = '00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01';

interface Started {
  engine: Engine;
  onKvEvents(listener: (events: KvEvent[]) => void): void;
  /** Stats taken after everything sent before the call was handled. */
  stats(): Promise<EngineStats>;
}

interface Subject {
  name: string;
  /** An engine with room for `maxNumSeqs` sequences and a pool of `kvBlocks` blocks, with KV events if asked. */
  start(options: { maxNumSeqs?: number; kvBlocks?: number; kvEvents?: boolean }): Promise<Started>;
  /** A prompt of `length` token ids, different for each variant. */
  prompt(length: number, variant: number): number[];
}

const subjects: Subject[] = [
  {
    name: 'local engine (built-in model, worker thread)',
    async start({ maxNumSeqs = 8, kvBlocks = 256, kvEvents = false }) {
      const { engine } = await createLocalEngine({
        modelPath: await ensureBuiltinModel(), backend: 'auto', threads: 1, maxNumSeqs,
        kvCacheMemoryBytes: kvBlocks * BUILTIN_BLOCK_BYTES, enableKvEvents: kvEvents,
      });
      assert.equal(engine.info.kvCapacityTokens, kvBlocks * 16, `a pool of ${kvBlocks} blocks (${engine.info.kvDtype} KV)`);
      return { engine, onKvEvents: (l) => engine.onKvEvents(l), stats: () => (engine as LocalEngine).sync() };
    },
    // Ordinary vocabulary ids (the first few are control tokens).
    prompt: (length, variant) => Array.from({ length }, (_, i) => 300 + ((variant * 97 + i * 31) % 20_000)),
  },
  {
    name: 'simulated engine',
    async start({ maxNumSeqs = 8, kvBlocks = 64, kvEvents = false }) {
      const engine = new SimEngine({ ...toyWorker, numKvBlocks: kvBlocks, maxNumSeqs, speedUp: Infinity, enableKvEvents: kvEvents });
      return { engine, onKvEvents: (l) => engine.onKvEvents(l), stats: async () => engine.stats() };
    },
    prompt: (length, variant) => Array.from({ length }, (_, i) => (variant * 97 + i * 13 + 1) % 997),
  },
];

function request(id: string, promptTokenIds: number[], maxTokens: number, traceparent?: string): EngineRequest {
  return {
    id, promptTokenIds, sampling: { ...DEFAULT_SAMPLING, temperature: 0, maxTokens, ignoreEos: true }, priority: 0,
    arrivalMs: 0, ...(traceparent ? { traceparent } : {}),
  };
}

async function collect(stream: AsyncIterable<EngineOutput>, onOutput?: (output: EngineOutput) => void): Promise<EngineOutput[]> {
  const outputs: EngineOutput[] = [];
  for await (const output of stream) {
    outputs.push(output);
    onOutput?.(output);
  }
  return outputs;
}

/** What the outputs' step facts say about the steps after the first token: what the per-request summary must say. */
function summaryFromOutputs(outputs: readonly EngineOutput[], timestamps: RequestTimestamps) {
  const steps = new Map<number, NonNullable<EngineOutput['step']>>();
  for (const o of outputs) if (o.step && o.step.end > timestamps.firstToken!) steps.set(o.step.id, o.step);
  const list = [...steps.values()];
  return {
    steps: list.length,
    lastStepId: Math.max(...list.map((s) => s.id)),
    batchSeqsSum: list.reduce((sum, s) => sum + s.batchSeqs, 0),
    batchSeqsMin: Math.min(...list.map((s) => s.batchSeqs)),
    batchSeqsMax: Math.max(...list.map((s) => s.batchSeqs)),
    batchTokensSum: list.reduce((sum, s) => sum + s.batchTokens, 0),
    batchTokensMin: Math.min(...list.map((s) => s.batchTokens)),
    batchTokensMax: Math.max(...list.map((s) => s.batchTokens)),
    forwardMs: list.reduce((sum, s) => sum + (s.end - s.start), 0),
  };
}

for (const subject of subjects) {
  describe(`engine facts: ${subject.name}`, () => {
    let engine: Engine;
    let stats: () => Promise<EngineStats>;

    before(async () => {
      ({ engine, stats } = await subject.start({ maxNumSeqs: 2 }));
    });

    after(async () => {
      await engine?.close();
    });

    it('reports each step\'s batch on its outputs and sums the decode steps per request', async () => {
      const maxTokens = 12;
      // Four at once on two seats: two run together, two wait for them.
      const ids = ['a', 'b', 'c', 'd'];
      const runs = ids.map((id, i) => collect(engine.generate(request(id, subject.prompt(20, i), maxTokens))));
      const results = await Promise.all(runs);

      // Every scheduled sequence samples (short prompts: one chunk each), so a step's batch is the requests with an
      // output from it.
      const perStep = new Map<number, { step: NonNullable<EngineOutput['step']>; requests: Set<string> }>();
      for (const outputs of results) {
        for (const o of outputs) {
          assert.ok(o.step, `output ${o.requestId}/${o.newTokenIds.length} has its step`);
          const entry = perStep.get(o.step.id) ?? { step: o.step, requests: new Set<string>() };
          entry.requests.add(o.requestId);
          perStep.set(o.step.id, entry);
          assert.deepEqual(o.step, entry.step, 'every output of a step reports the same step');
          assert.ok(o.step.end >= o.step.start);
          assert.equal(o.timestamps.lastToken, o.step.end, 'the token was sampled at the end of its step');
        }
      }
      for (const { step, requests } of perStep.values()) {
        assert.equal(step.batchSeqs, requests.size, `step ${step.id}: batch of ${step.batchSeqs}, outputs of ${[...requests]}`);
        assert.ok(step.batchSeqs <= 2, 'two seats');
      }
      assert.ok([...perStep.values()].some(({ step }) => step.batchSeqs === 2), 'requests shared steps');

      for (const outputs of results) {
        const final = outputs.at(-1)!;
        const ts = final.timestamps;
        assert.equal(final.usage.completionTokens, maxTokens);
        const summary = ts.decodeSteps!;
        assert.equal(summary.steps, maxTokens - 1, 'one decode step per token after the first');
        const fromOutputs = summaryFromOutputs(outputs, ts);
        assert.equal(summary.forwardMs.toFixed(6), fromOutputs.forwardMs.toFixed(6));
        assert.deepEqual({ ...summary, forwardMs: 0 }, { ...fromOutputs, forwardMs: 0 });
        // The prefill chunk is the step that sampled the first token.
        const firstStep = outputs[0]!.step!;
        assert.deepEqual(ts.prefillChunks, [{
          start: firstStep.start, end: firstStep.end, tokens: 20, batchSeqs: firstStep.batchSeqs, batchTokens: firstStep.batchTokens,
        }]);
        assert.deepEqual(ts.budget, { tokens: 20, forwardStart: firstStep.start }, 'the whole prompt was granted at once');
        assert.ok(ts.budget!.forwardStart >= ts.firstScheduled!, 'budget allocation ends when the forward begins');
      }

      // The two that waited found the queue busier than the first did.
      const depths = results.map((outputs) => outputs.at(-1)!.timestamps.queueDepthAtEntry!);
      assert.equal(depths[0], 0, 'the first request found nobody waiting');
      assert.ok(depths[3]! >= 1, `the last of four on two seats found the third waiting (depths ${depths})`);
      assert.ok(depths.every((d, i) => d <= i), `nobody found more waiting than were sent before it (${depths})`);
    });

    it('hands the traceparent back on every output, the closing one of an abort too', async () => {
      const outputs = await collect(engine.generate(request('traced', subject.prompt(24, 9), 4, TRACEPARENT)));
      assert.equal(outputs.length, 4);
      for (const o of outputs) assert.equal(o.traceparent, TRACEPARENT);

      const aborted: EngineOutput[] = [];
      const stream = engine.generate(request('cut', subject.prompt(24, 10), 2000, TRACEPARENT));
      for await (const o of stream) {
        aborted.push(o);
        if (aborted.length === 2) engine.abort('cut');
      }
      const closing = aborted.at(-1)!;
      assert.equal(closing.finishReason, 'abort');
      assert.equal(closing.traceparent, TRACEPARENT);
      assert.equal(closing.step, undefined, 'no step produced the closing output of an abort');

      const untraced = await collect(engine.generate(request('plain', subject.prompt(24, 11), 2)));
      assert.ok(untraced.every((o) => o.traceparent === undefined));
      const idle = await stats();
      assert.equal(idle.kvBlocksUsed, 0);
    });
  });

  describe(`KV evictions: ${subject.name}`, () => {
    it('counts every cached block reused for another prompt, in its stats', async () => {
      // 24 blocks of 16 tokens; each prompt of 96 tokens caches 6 full blocks and leaves them free when it ends.
      const started = await subject.start({ kvBlocks: 24, kvEvents: true });
      try {
        let removedHashes = 0;
        started.onKvEvents((events) => {
          for (const e of events) if (e.type === 'removed') removedHashes += e.blockHashes.length;
        });
        const initial = await started.stats();
        assert.equal(initial.kvEvictions, 0);
        for (let i = 0; i < 3; i++) await collect(started.engine.generate(request(`fill-${i}`, subject.prompt(96, 20 + i), 2)));
        const beforeFull = await started.stats();
        assert.equal(beforeFull.kvEvictions, 0, 'three prompts of 7 blocks fit beside each other');
        for (let i = 3; i < 6; i++) await collect(started.engine.generate(request(`fill-${i}`, subject.prompt(96, 20 + i), 2)));
        const after = await started.stats();
        assert.ok(after.kvEvictions! > 0, 'the later prompts reused blocks that held earlier ones');
        assert.equal(after.kvEvictions, removedHashes, 'as many as the KV events announced removed');
      } finally {
        await started.engine.close();
      }
    });
  });
}
