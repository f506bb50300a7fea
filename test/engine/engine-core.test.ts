// End-to-end invariants of the engine (scheduler + KV cache + backend + sampler + detokenizer) on real models:
// the same seed gives the same tokens whatever the batch, chunk size, prefix-cache state or preemptions; greedy
// equals the reference forward pass; nothing leaks after a randomized stress with aborts.
import { describe, test } from 'node:test';
import assert from 'node:assert/strict';
import { EngineCore } from '../../src/engine/engine-core.ts';
import { DEFAULT_SAMPLING, type EngineOutput, type EngineRequest, type SamplingParams } from '../../src/engine/types.ts';
import type { BackendFactory, ModelRunnerBackend } from '../../src/kernels/types.ts';
import { ReferenceModel } from '../../src/model/reference-forward.ts';
import { Xoshiro128 } from '../../src/util/random.ts';
import { loadSharedModel, skipUnlessShared } from '../helpers/shared-models.ts';
import { engineBackends } from '../helpers/backends.ts';

const MODEL = 'stories260K.gguf';

const model = () => loadSharedModel(MODEL);

interface CoreOptions {
  numBlocks?: number;
  blockSize?: number;
  maxNumBatchedTokens?: number;
  maxNumSeqs?: number;
  enablePrefixCaching?: boolean;
  /** Replaces the loaded backend (to watch or change what the core calls). */
  wrap?: (runner: ModelRunnerBackend) => ModelRunnerBackend;
}

async function makeCore(backend: BackendFactory, options: CoreOptions = {}): Promise<EngineCore> {
  const { loaded, tokenizer } = await model();
  const loadedRunner = backend.load(loaded.config, loaded.weights,
    { numBlocks: options.numBlocks ?? 256, blockSize: options.blockSize ?? 16, dtype: 'f32' }, { threads: 1 });
  const runner = options.wrap?.(loadedRunner) ?? loadedRunner;
  let clock = 0;
  return new EngineCore({
    backend: runner, tokenizer, maxNumSeqs: options.maxNumSeqs ?? 64,
    maxNumBatchedTokens: options.maxNumBatchedTokens ?? 512, maxModelLen: loaded.config.contextLength,
    enablePrefixCaching: options.enablePrefixCaching, now: () => clock++,
  });
}

function request(id: string, prompt: number[], sampling: Partial<SamplingParams> = {}): EngineRequest {
  return { id, promptTokenIds: prompt, sampling: { ...DEFAULT_SAMPLING, maxTokens: 24, ...sampling }, priority: 0, arrivalMs: 0 };
}

interface Completion { tokens: number[]; text: string; finish?: string; cached: number }

/** Steps the core until idle (and at least minSteps); returns each request's completions (by index). */
function runToEnd(core: EngineCore, onStep?: (step: number) => void, minSteps = 0): Map<string, Completion[]> {
  const results = new Map<string, Completion[]>();
  const record = (o: EngineOutput) => {
    const list = results.get(o.requestId) ?? [];
    results.set(o.requestId, list);
    const c = (list[o.index] ??= { tokens: [], text: '', cached: 0 });
    c.tokens.push(...o.newTokenIds);
    c.text += o.textDelta;
    c.cached = o.usage.cachedTokens;
    if (o.finishReason) c.finish = o.finishReason;
  };
  for (let step = 0; core.hasWork || step < minSteps; step++) {
    onStep?.(step);
    for (const o of core.step()) record(o);
    assert.ok(step < 100_000, 'engine did not finish');
  }
  return results;
}

function assertNoLeak(core: EngineCore): void {
  const stats = core.stats();
  assert.equal(stats.kvBlocksUsed, 0, 'every KV block is back in the pool');
  assert.equal(stats.numRunning + stats.numWaiting, 0);
  core.scheduler.checkInvariants();
}

const PROMPTS = [
  'Once upon a time', 'The cat sat on the mat and looked at the big red ball.', 'Lily and Ben',
  'One day, a little boy named Tim went to the park with his mom. They saw a dog.', 'Sue',
];

/** The backend as it is (class or object), one member replaced (undefined: taken away). */
function withMember<T extends object>(runner: T, key: string, replacement: unknown): T {
  return new Proxy(runner, {
    get: (target, k) => {
      if (k === key) return replacement;
      const value: unknown = Reflect.get(target, k);
      return typeof value === 'function' ? value.bind(target) : value;
    },
  });
}

const backends = engineBackends();
for (const backend of backends) {
  // The stress exercises bookkeeping, which no backend changes: it runs once, on the fastest backend here.
  const runStress = backend === backends[backends.length - 1];
  describe(`engine core on ${backend.name}`, { skip: skipUnlessShared(MODEL) }, () => {
    test('greedy output equals the reference forward pass, token for token', async () => {
      const { loaded, tokenizer } = await model();
      const reference = new ReferenceModel(loaded.config, loaded.weights);
      const core = await makeCore(backend);
      const prompts = PROMPTS.map((p) => tokenizer.encode(p));
      prompts.forEach((ids, i) => core.add(request(`g${i}`, ids, { temperature: 0, ignoreEos: true })));
      const results = runToEnd(core);
      prompts.forEach((ids, i) => {
        reference.reset();
        let logits = reference.forward(ids, 0);
        const expected: number[] = [];
        for (let t = 0; t < 24; t++) {
          let best = 0;
          for (let v = 1; v < logits.length; v++) if (logits[v]! > logits[best]!) best = v;
          expected.push(best);
          logits = reference.forward([best], ids.length + t);
        }
        assert.deepEqual(results.get(`g${i}`)![0]!.tokens, expected, `prompt ${i}`);
      });
      assertNoLeak(core);
    });

    /** Each prompt's requests as `add` makes them, run to the end: every completion's tokens, by request id. */
    const runPrompts = async (add: (core: EngineCore, ids: number[], i: number) => void, wrap?: CoreOptions['wrap']) => {
      const { tokenizer } = await model();
      const core = await makeCore(backend, wrap !== undefined ? { wrap } : {});
      PROMPTS.forEach((p, i) => add(core, tokenizer.encode(p), i));
      const results = runToEnd(core);
      assertNoLeak(core);
      return [...results].sort(([a], [b]) => a.localeCompare(b)).map(([id, c]) => [id, c[0]!.tokens] as const);
    };

    test("greedy and truncated sampling take the backend's argmax, and the sampler's own for the rows it gives back", async () => {
      const add = (core: EngineCore, ids: number[], i: number) => {
        core.add(request(`g${i}`, ids, { temperature: 0, ignoreEos: true }));
        core.add(request(`p${i}`, ids, { temperature: 0.8, topP: 0.9, seed: 7 + i, ignoreEos: true }));
      };
      // Without the batched draws, so that the top_p rows are drawn here too (the next tests have those).
      const plain = await runPrompts(add, (runner) => withMember(runner, 'sampleRows', undefined));
      // Every other row answered -1 (as for a NaN row): the sampler's JavaScript argmax picks those.
      let calls = 0;
      let answered = 0;
      const halved = await runPrompts(add, (runner) => withMember(withMember(runner, 'sampleRows', undefined), 'argmax', (row: Float32Array) => {
        if (calls++ % 2 === 0) return -1;
        const id = runner.argmax?.(row) ?? -1;
        if (id >= 0) answered++;
        return id;
      }));
      assert.deepEqual(halved, plain);
      assert.ok(calls >= PROMPTS.length * 2 * 24, `the backend's argmax was asked for every row (${calls} calls)`);
      // The native backend has its own pass; the reference backend has none, so the sampler picked every row.
      assert.equal(answered > 0, backend.name === 'native', `rows the backend's argmax answered: ${answered}`);
    });

    test("temperature, min_p and top_p draws take the backend's weighing pass, and draw what the sampler's own gives", async () => {
      const add = (core: EngineCore, ids: number[], i: number) => {
        core.add(request(`t${i}`, ids, { temperature: 1, seed: 11 + i, ignoreEos: true }));
        core.add(request(`m${i}`, ids, { temperature: 0.7, minP: 0.05, seed: 21 + i, ignoreEos: true }));
        core.add(request(`p${i}`, ids, { temperature: 1.2, topP: 0.9, seed: 31 + i, ignoreEos: true }));
      };
      let calls = 0;
      // Rows drawn here, one by one (the batched draws are the next test's).
      const unbatched = (runner: ModelRunnerBackend) => withMember(runner, 'sampleRows', undefined);
      const counted = await runPrompts(add, (runner) => withMember(unbatched(runner), 'sampleWeigh', runner.sampleWeigh === undefined ? undefined
        : (...args: Parameters<NonNullable<typeof runner.sampleWeigh>>) => {
          calls++;
          return runner.sampleWeigh!(...args);
        }));
      // The same backend without the pass: the sampler weighs in JavaScript.
      const without = await runPrompts(add, (runner) => withMember(unbatched(runner), 'sampleWeigh', undefined));
      assert.deepEqual(counted, without);
      assert.ok(new Set(counted.flatMap(([, tokens]) => tokens)).size > 20, 'random draws, not one repeated token');
      // The native backend has the pass (every row of the three kinds went through it); the reference backend has none.
      assert.equal(calls >= PROMPTS.length * 3 * 24, backend.name === 'native', `rows the backend's pass weighed: ${calls}`);
    });

    test("top_p rows at a temperature other than 1 are copied scaled by the backend's loop, and draw what the sampler's own copy gives", async () => {
      const add = (core: EngineCore, ids: number[], i: number) => {
        core.add(request(`p${i}`, ids, { temperature: 0.8, topP: 0.9, seed: 41 + i, ignoreEos: true }));
        core.add(request(`r${i}`, ids, { temperature: 1.3, topP: 0.95, repetitionPenalty: 1.2, seed: 51 + i, ignoreEos: true }));
      };
      let calls = 0;
      const unbatched = (runner: ModelRunnerBackend) => withMember(runner, 'sampleRows', undefined);
      const counted = await runPrompts(add, (runner) => withMember(unbatched(runner), 'scaleRow', runner.scaleRow === undefined ? undefined
        : (...args: Parameters<NonNullable<typeof runner.scaleRow>>) => {
          calls++;
          runner.scaleRow!(...args);
        }));
      const without = await runPrompts(add, (runner) => withMember(unbatched(runner), 'scaleRow', undefined));
      assert.deepEqual(counted, without);
      assert.ok(new Set(counted.flatMap(([, tokens]) => tokens)).size > 20, 'random draws, not one repeated token');
      // The native backend has the loop (every row of both kinds was scaled with it); the reference backend has none.
      assert.equal(calls >= PROMPTS.length * 2 * 24, backend.name === 'native', `rows the backend's loop scaled: ${calls}`);
    });

    test("a step's random draws go to the backend's batched draw, and give what the sampler draws row by row", async () => {
      // Rows it draws (greedy, temperature, min_p, top_p, top_k; with logprobs too where the backend gives those in
      // its pass, as the native one does) beside rows it leaves to the sampler (logit processors), in the same steps.
      const add = (core: EngineCore, ids: number[], i: number) => {
        core.add(request(`t${i}`, ids, { temperature: 1, seed: 11 + i, ignoreEos: true }));
        core.add(request(`m${i}`, ids, { temperature: 0.7, minP: 0.05, seed: 21 + i, ignoreEos: true }));
        core.add(request(`p${i}`, ids, { temperature: 1.2, topP: 0.9, minP: 0.01, seed: 31 + i, ignoreEos: true }));
        core.add(request(`q${i}`, ids, { temperature: 1, topP: 0.5, seed: 41 + i, ignoreEos: true }));
        core.add(request(`g${i}`, ids, { temperature: 0, ignoreEos: true }));
        core.add(request(`k${i}`, ids, { temperature: 0.8, topK: 40, topP: 0.9, seed: 51 + i, ignoreEos: true }));
        core.add(request(`n${i}`, ids, { temperature: 1.1, topK: 20, minP: 0.02, seed: 81 + i, ignoreEos: true }));
        core.add(request(`r${i}`, ids, { temperature: 0.9, topP: 0.95, repetitionPenalty: 1.2, seed: 61 + i, ignoreEos: true }));
        core.add(request(`l${i}`, ids, { temperature: 0.9, topP: 0.95, logprobs: 2, seed: 71 + i, ignoreEos: true }));
      };
      let drawn = 0;
      let calls = 0;
      const counted = await runPrompts(add, (runner) => withMember(runner, 'sampleRows', runner.sampleRows === undefined ? undefined
        : (...args: Parameters<NonNullable<typeof runner.sampleRows>>) => {
          calls++;
          drawn += args[1].length;
          runner.sampleRows!(...args);
        }));
      const without = await runPrompts(add, (runner) => withMember(runner, 'sampleRows', undefined));
      assert.deepEqual(counted, without);
      assert.ok(new Set(counted.flatMap(([, tokens]) => tokens)).size > 20, 'random draws, not one repeated token');
      // The native backend draws the eight eligible kinds' rows (24 tokens each), several rows a call; the reference
      // backend has no batched draw.
      assert.equal(drawn, backend.name === 'native' ? PROMPTS.length * 8 * 24 : 0, `rows the backend drew: ${drawn}`);
      if (backend.name === 'native') assert.ok(calls < drawn, `rows drawn together (${drawn} rows in ${calls} calls)`);
    });

    test("a step's sampled-token logprobs come from the backend's pass over the rows at once, the same entries as row by row", async () => {
      // Logprobs of every kind of row: greedy, drawn in the batch (temperature, top_p, top_k), with logit processors
      // (chosen by the sampler, logprobs still of the raw row), beside rows without logprobs and a row asking for more
      // alternatives than the pass gives (its best ids found here).
      const add = (core: EngineCore, ids: number[], i: number) => {
        core.add(request(`a${i}`, ids, { temperature: 0, logprobs: 0, ignoreEos: true }));
        core.add(request(`b${i}`, ids, { temperature: 0, logprobs: 1, ignoreEos: true }));
        core.add(request(`c${i}`, ids, { temperature: 0, logprobs: 5, ignoreEos: true }));
        core.add(request(`d${i}`, ids, { temperature: 1, logprobs: 0, seed: 11 + i, ignoreEos: true }));
        core.add(request(`e${i}`, ids, { temperature: 0.8, topP: 0.9, logprobs: 3, seed: 21 + i, ignoreEos: true }));
        core.add(request(`f${i}`, ids, { temperature: 0.9, topK: 20, logprobs: 1, seed: 31 + i, ignoreEos: true }));
        core.add(request(`g${i}`, ids, { temperature: 0.9, topP: 0.95, repetitionPenalty: 1.3, logprobs: 2, seed: 41 + i, ignoreEos: true }));
        core.add(request(`h${i}`, ids, { temperature: 0, repetitionPenalty: 1.3, logprobs: 4, ignoreEos: true }));
        core.add(request(`i${i}`, ids, { temperature: 0.7, seed: 51 + i, ignoreEos: true }));
        core.add(request(`j${i}`, ids, { temperature: 0, ignoreEos: true }));
        core.add(request(`k${i}`, ids, { temperature: 0.7, logprobs: 70, seed: 61 + i, ignoreEos: true }));
      };
      const run = async (wrap: CoreOptions['wrap']) => {
        const { tokenizer } = await model();
        const core = await makeCore(backend, { wrap });
        PROMPTS.forEach((p, i) => add(core, tokenizer.encode(p), i));
        const outputs = new Map<string, { tokens: number[]; logprobs: unknown[] }>();
        for (let step = 0; core.hasWork; step++) {
          for (const o of core.step()) {
            const entry = outputs.get(o.requestId) ?? { tokens: [], logprobs: [] };
            outputs.set(o.requestId, entry);
            entry.tokens.push(...o.newTokenIds);
            entry.logprobs.push(...(o.logprobs ?? []));
          }
          assert.ok(step < 10_000, 'engine did not finish');
        }
        assertNoLeak(core);
        return [...outputs].sort(([a], [b]) => a.localeCompare(b));
      };
      let passRows = 0;
      let passCalls = 0;
      const counted = await run((runner) => withMember(runner, 'promptLogprobRows', runner.promptLogprobRows === undefined ? undefined
        : (...args: Parameters<NonNullable<typeof runner.promptLogprobRows>>) => {
          passCalls++;
          passRows += args[1];
          assert.ok(args[6] !== undefined, 'the rows are named');
          runner.promptLogprobRows!(...args);
        }));
      const without = await run((runner) => withMember(runner, 'promptLogprobRows', undefined));
      assert.deepEqual(counted, without);
      for (const [id, { tokens, logprobs }] of counted) {
        const asked = { a: 0, b: 1, c: 5, d: 0, e: 3, f: 1, g: 2, h: 4, k: 70 }[id[0]!];
        assert.equal(logprobs.length, asked === undefined ? 0 : tokens.length, `${id}: one logprobs entry per token`);
        for (const [t, entry] of (logprobs as { tokenId: number; logprob: number; top: unknown[] }[]).entries()) {
          assert.equal(entry.tokenId, tokens[t]);
          assert.ok(entry.logprob <= 0 && entry.top.length === asked, `${id}: a logprob and its ${asked} alternatives`);
        }
      }
      // The native backend has the pass: every row with logprobs (nine kinds, 24 tokens each) went through it, a step's
      // rows together; the reference backend has none.
      assert.equal(passRows, backend.name === 'native' ? PROMPTS.length * 9 * 24 : 0, `rows the pass gave logprobs for: ${passRows}`);
      if (backend.name === 'native') assert.ok(passCalls < passRows, `rows together (${passRows} rows in ${passCalls} calls)`);
    });

    test('the same seed gives the same tokens whatever the batch, chunk size and prefix-cache state', async () => {
      const { tokenizer } = await model();
      const prompts = PROMPTS.map((p) => tokenizer.encode(p));
      const sampling = (i: number): Partial<SamplingParams> => ({ temperature: 0.9, topP: 0.95, seed: 1000 + i });

      // Alone, one at a time, with a generous budget.
      const alone: Completion[] = [];
      for (const [i, ids] of prompts.entries()) {
        const core = await makeCore(backend);
        core.add(request(`s${i}`, ids, sampling(i)));
        alone.push(runToEnd(core).get(`s${i}`)![0]!);
      }
      // All together, with a tiny chunk budget (prompts split over several steps) and staggered arrivals.
      const core = await makeCore(backend, { maxNumBatchedTokens: 7, blockSize: 4 });
      const results = runToEnd(core, (step) => {
        if (step < prompts.length) core.add(request(`s${step}`, prompts[step]!, sampling(step)));
      }, prompts.length);
      prompts.forEach((_, i) => assert.deepEqual(results.get(`s${i}`)![0]!.tokens, alone[i]!.tokens, `prompt ${i}`));
      // Again on the same core: now every full prompt block is a prefix-cache hit.
      prompts.forEach((ids, i) => core.add(request(`again${i}`, ids, sampling(i))));
      const again = runToEnd(core);
      prompts.forEach((ids, i) => {
        const c = again.get(`again${i}`)![0]!;
        assert.deepEqual(c.tokens, alone[i]!.tokens, `prompt ${i} from the prefix cache`);
        // A prompt ending on a block boundary takes all but its last token (its last block is copied); any other
        // takes its full blocks.
        const cached = ids.length % 4 === 0 ? ids.length - 1 : Math.floor(ids.length / 4) * 4;
        assert.equal(c.cached, cached, 'every cached prompt token before the last is reused');
      });
      assertNoLeak(core);
    });

    test('preempted and resumed requests produce what uninterrupted ones do', async () => {
      const { tokenizer } = await model();
      const prompts = PROMPTS.map((p) => tokenizer.encode(p));
      const sampling = (i: number): Partial<SamplingParams> => ({ temperature: 0.7, seed: i, maxTokens: 40, ignoreEos: true });
      const roomy = await makeCore(backend);
      prompts.forEach((ids, i) => roomy.add(request(`p${i}`, ids, sampling(i))));
      const expected = runToEnd(roomy);
      // 20 blocks of 4 tokens hold any one of these sequences (at most 60 tokens) but not all five at once: the
      // scheduler must preempt.
      const tight = await makeCore(backend, { numBlocks: 20, blockSize: 4 });
      prompts.forEach((ids, i) => tight.add(request(`p${i}`, ids, sampling(i))));
      const got = runToEnd(tight);
      assert.ok(tight.stats().preemptions > 0, 'the small pool forced preemptions');
      prompts.forEach((_, i) => assert.deepEqual(got.get(`p${i}`)![0]!.tokens, expected.get(`p${i}`)![0]!.tokens));
      assertNoLeak(tight);
    });

    test('n > 1 completions share the prompt and each follows its own seeded stream', async () => {
      const { tokenizer } = await model();
      const ids = tokenizer.encode('Once upon a time there was a girl who liked to sing');
      const core = await makeCore(backend, { blockSize: 4 });
      core.add(request('multi', ids, { temperature: 1, seed: 7, n: 3 }));
      const [a, b, c] = runToEnd(core).get('multi')!;
      assert.ok(a && b && c);
      assert.ok(new Set([a.text, b.text, c.text]).size > 1, 'the completions differ');
      for (const completion of [a, b, c]) assert.ok(completion.finish, 'every completion ends with a finish reason');
      // Completion k equals a single-sample request replaying the same stream is checked by the sampler's tests;
      // here: the same request again reproduces all three.
      core.add(request('multi2', ids, { temperature: 1, seed: 7, n: 3 }));
      const again = runToEnd(core).get('multi2')!;
      assert.deepEqual(again.map((x) => x.tokens), [a.tokens, b.tokens, c.tokens]);
      assertNoLeak(core);
    });

    test('stop strings end the output without leaking them; the text equals the decoded tokens', async () => {
      const { tokenizer } = await model();
      const ids = tokenizer.encode('Once upon a time');
      const core = await makeCore(backend);
      core.add(request('free', ids, { temperature: 0, maxTokens: 32 }));
      const free = runToEnd(core).get('free')![0]!;
      assert.equal(free.text, tokenizer.decode([...ids, ...free.tokens]).slice(tokenizer.decode(ids).length));
      const stop = 'Lily';
      assert.ok(free.text.includes(stop), 'the greedy text contains the stop string');
      core.add(request('stopped', ids, { temperature: 0, maxTokens: 32, stop: [stop] }));
      const stopped = runToEnd(core).get('stopped')![0]!;
      assert.equal(stopped.finish, 'stop');
      assert.equal(stopped.text, free.text.slice(0, free.text.indexOf(stop)));
      assertNoLeak(core);
    });

    if (runStress) test('randomized stress: 1,000 mixed requests with aborts leave every block free', async () => {
      const { loaded } = await model();
      const core = await makeCore(backend, { numBlocks: 48, blockSize: 4, maxNumBatchedTokens: 64, maxNumSeqs: 16 });
      const rng = Xoshiro128.fromSeed(42, 0);
      const randInt = (n: number) => Math.floor(rng.nextFloat() * n);
      const live: string[] = [];
      let submitted = 0;
      let rejected = 0;
      const finishedIds = new Set<string>();
      for (let step = 0; submitted < 1000 || core.hasWork; step++) {
        for (let k = randInt(4); k > 0 && submitted < 1000; k--) {
          const id = `x${submitted++}`;
          // Mostly short prompts from a few shared prefixes; now and then one too long for the pool.
          const length = randInt(20) === 0 ? 400 : 1 + randInt(30);
          const prefix = randInt(3);
          const prompt = Array.from({ length }, (_, i) => (i < 8 ? 3 + prefix * 8 + i : 3 + randInt(loaded.config.vocabSize - 3)));
          try {
            core.add(request(id, prompt, { temperature: randInt(2), seed: submitted, maxTokens: 1 + randInt(12), n: 1 + (randInt(8) === 0 ? 1 : 0) }));
            live.push(id);
          } catch (error) {
            // Only the long prompts may be refused, and only as too long for the pool.
            assert.equal(length, 400, `a ${length}-token prompt was refused: ${(error as Error).message}`);
            assert.equal((error as { code?: string }).code, 'prompt_exceeds_kv_pool', (error as Error).message);
            rejected++;
          }
        }
        if (live.length > 0 && randInt(5) === 0) {
          const [victim] = live.splice(randInt(live.length), 1);
          for (const o of core.abort(victim!)) assert.equal(o.finishReason, 'abort');
        }
        for (const o of core.step()) if (o.finishReason) finishedIds.add(o.requestId);
        if (step % 50 === 0) core.scheduler.checkInvariants();
        assert.ok(step < 200_000, 'stress did not finish');
      }
      assert.ok(rejected > 0, 'some prompts were too long for the pool and were refused');
      assert.ok(finishedIds.size > 500, 'most requests ran to the end');
      assertNoLeak(core);
    });
  });
}
