// The simulated engine through the Engine interface: step times from the performance model on the toy deployment
// (see sim-fixtures.ts for the hand arithmetic), real prefix hits, aborts that free blocks, deterministic timings,
// KV events the router can index; and the pool sizing and cross-checks on real profiles.
import { describe, test } from 'node:test';
import assert from 'node:assert/strict';
import { hashTokenBlocks } from '../../src/protocols/block-hash.ts';
import type { KvEvent } from '../../src/protocols/kv-events.ts';
import type { EngineOutput, EngineRequest } from '../../src/engine/types.ts';
import { H100_SXM } from '../../src/sim/hardware.ts';
import { LLAMA_3_1_70B, LLAMA_3_1_8B, withDtypes } from '../../src/sim/models.ts';
import { checkDecodeSweepWithEngine, checkLifecycleWithEngine } from '../../src/sim/engine-check.ts';
import { SimEngine, type SimEngineOptions } from '../../src/sim/sim-engine.ts';
import { SimWorker, planToStepShape } from '../../src/sim/sim-worker.ts';
import { syntheticToken, syntheticWord } from '../../src/sim/synthetic-tokens.ts';
import { close, prompt, req, toyDecodeMs, toyPrefillMs, toyWorker } from './sim-fixtures.ts';

function engine(options: Partial<SimEngineOptions> = {}): SimEngine {
  return new SimEngine({ ...toyWorker, speedUp: Infinity, ...options });
}

async function all(stream: AsyncIterable<EngineOutput>): Promise<EngineOutput[]> {
  const outputs: EngineOutput[] = [];
  for await (const output of stream) outputs.push(output);
  return outputs;
}

const last = (outputs: EngineOutput[]) => outputs[outputs.length - 1]!;
const ttftOf = (out: EngineOutput) => out.timestamps.firstToken! - out.timestamps.arrival;

describe('SimEngine timings', () => {
  test('a cold request: TTFT is its prefill step, then one decode step per token', async () => {
    const e = engine();
    const outs = await all(e.generate(req('a', prompt(64), 0, { maxTokens: 3 })));
    await e.close();
    assert.equal(outs.length, 3);
    assert.deepEqual(outs.map((o) => o.finishReason), [undefined, undefined, 'length']);
    // 64 tokens at context 0: 655,360 x 64 + 256,000 + 1,024 x 2,080 FLOPs = 44.32896 ms, + 0.5 ms overhead.
    close(ttftOf(outs[0]!), 44.82896);
    close(toyPrefillMs(64, 0), 44.82896);
    // Decodes at contexts 64 and 65: 911,360 + 1,024 x 65 (then 66) FLOPs + 0.5 ms.
    const t = outs.map((o) => o.timestamps.lastToken!);
    close(t[1]! - t[0]!, 1.47792);
    close(t[2]! - t[1]!, 1.478944);
    close(toyDecodeMs(64), 1.47792);
    const final = last(outs);
    assert.deepEqual(final.usage, { promptTokens: 64, completionTokens: 3, cachedTokens: 0 });
    close(final.timestamps.finished!, 44.82896 + 1.47792 + 1.478944);
    assert.deepEqual(final.timestamps.prefillChunks.map((c) => c.tokens), [64]);
  });

  test('an identical prompt hits the prefix cache: cachedTokens and a TTFT of the uncached part only', async () => {
    const e = engine();
    await all(e.generate(req('first', prompt(64), 0, { maxTokens: 1 })));
    const arrival = e.now();
    const outs = await all(e.generate(req('second', prompt(64), arrival, { maxTokens: 1 })));
    const stats = e.stats();
    await e.close();
    // Never the last prompt token: 3 shared blocks, and the 4th copied (copy-on-write) for its first 15 tokens.
    assert.equal(last(outs).usage.cachedTokens, 63);
    // 1 token after 63: 655,360 + 256,000 + 1,024 x 64 FLOPs = 0.976896 ms, + 0.5 ms; the copy reads and writes one
    // block, 2 x 16 tokens x 1,024 B (2 layers x K, V x 2 heads x 64 x 2 B) at 1 PB/s = 3.2768e-8 ms.
    close(ttftOf(outs[0]!), 1.476896 + 3.2768e-8);
    close(toyPrefillMs(1, 63), 1.476896);
    assert.equal(stats.prefixCacheQueries, 128);
    assert.equal(stats.prefixCacheHits, 63);
  });

  test('prompt logprobs: the prompt computed whole despite the cache, an LM-head row per position, entries at logprob 0', async () => {
    const e = engine();
    await all(e.generate(req('first', prompt(64), 0, { maxTokens: 1 })));
    const arrival = e.now();
    const outs = await all(e.generate(req('scored', prompt(64), arrival, { maxTokens: 1, promptLogprobs: 2 })));
    const stats = e.stats();
    await e.close();
    assert.equal(last(outs).usage.cachedTokens, 0);
    // Not looked up, so not counted as queried: the hit rate stays that of the lookups made.
    assert.deepEqual([stats.prefixCacheQueries, stats.prefixCacheHits], [64, 0]);
    // The sampled row's LM head, and 63 more: one per prompt position before the last.
    const lmHeadMs = toyPrefillMs(64, 0) - toyPrefillMs(64, 0, false);
    close(ttftOf(outs[0]!), toyPrefillMs(64, 0) + 63 * lmHeadMs);
    const entries = outs[0]!.promptLogprobs!;
    assert.equal(entries.length, 64);
    assert.equal(entries[0], null);
    assert.deepEqual(entries.slice(1), prompt(64).slice(1).map((tokenId) => ({ tokenId, logprob: 0, top: [], rank: 1 })));
  });

  test('chunked prefill: a prompt over the step budget takes one step per chunk', async () => {
    const e = engine({ maxNumBatchedTokens: 40 });
    const outs = await all(e.generate(req('a', prompt(64), 0, { maxTokens: 1 })));
    await e.close();
    // 40 tokens (no logits), then 24 after 40 (sampled).
    close(ttftOf(outs[0]!), toyPrefillMs(40, 0, false) + toyPrefillMs(24, 40));
    close(toyPrefillMs(40, 0, false) + toyPrefillMs(24, 40), (26_214_400 + 839_680) / 1e6 + 0.5 + (15_728_640 + 256_000 + 1_290_240) / 1e6 + 0.5);
    assert.deepEqual(last(outs).timestamps.prefillChunks.map((c) => c.tokens), [40, 24]);
  });

  test('continuous batching: a request arriving mid-decode joins the next step', async () => {
    const e = engine();
    const a = all(e.generate(req('a', prompt(64, 1), 0, { maxTokens: 5 })));
    // Arrives during a's first decode step (which runs from 44.82896 to 46.30688 ms).
    const b = all(e.generate(req('b', prompt(32, 2), 45, { maxTokens: 1 })));
    const [outsA, outsB] = await Promise.all([a, b]);
    await e.close();
    const bFirst = outsB[0]!;
    assert.equal(bFirst.timestamps.arrival, 45);
    // b's step: a's second decode (context 65) and b's 32-token prefill together, 2 rows sampled.
    const mixedMs = (655_360 * 33 + 2 * 256_000 + 1_024 * (66 + 528)) / 1e6 + 0.5;
    close(bFirst.timestamps.firstToken!, 44.82896 + 1.47792 + mixedMs);
    close(outsA[2]!.timestamps.lastToken! - outsA[1]!.timestamps.lastToken!, mixedMs);
  });

  test('the same arrivals give the same tokens and timings', async () => {
    const run = async () => {
      const e = engine({ maxNumBatchedTokens: 48 });
      const requests: EngineRequest[] = [
        req('x', prompt(40, 1), 0, { maxTokens: 6, seed: 3 }), req('y', prompt(20, 2), 3, { maxTokens: 4 }),
        req('z', prompt(40, 1), 10, { maxTokens: 5, n: 2, seed: 9 }), req('w', prompt(70, 4), 10, { maxTokens: 3 }),
      ];
      const outs = await Promise.all(requests.map((r) => all(e.generate(r))));
      await e.close();
      return outs;
    };
    const first = await run();
    assert.deepEqual(await run(), first);
    // n = 2: two completions, each max_tokens long, with different tokens.
    const z = first[2]!;
    const zTokens = [0, 1].map((i) => z.filter((o) => o.index === i).flatMap((o) => o.newTokenIds));
    assert.equal(zTokens[0]!.length, 5);
    assert.equal(zTokens[1]!.length, 5);
    assert.notDeepEqual(zTokens[0], zTokens[1]);
    for (const index of [0, 1]) assert.equal(z.filter((o) => o.index === index && o.finishReason === 'length').length, 1);
  });

  test('n = 3 completions that end in the same step each get their closing output', async () => {
    const e = engine();
    const outs = await all(e.generate(req('n3', prompt(40, 5), 0, { maxTokens: 4, n: 3, seed: 1 })));
    await e.close();
    for (const index of [0, 1, 2]) {
      const mine = outs.filter((o) => o.index === index);
      assert.equal(mine.flatMap((o) => o.newTokenIds).length, 4, `completion ${index}`);
      assert.equal(mine.at(-1)!.finishReason, 'length', `completion ${index}`);
    }
  });
});

describe('SimEngine requests', () => {
  test('abort frees the blocks and ends the stream with abort', async () => {
    const e = engine();
    const outs: EngineOutput[] = [];
    for await (const output of e.generate(req('long', prompt(64), 0, { maxTokens: 500 }))) {
      outs.push(output);
      if (outs.length === 3) {
        // 64 prompt tokens + 2 output tokens computed so far occupy 5 blocks of 16.
        assert.equal(e.stats().kvBlocksUsed, 5);
        e.abort('long');
      }
    }
    assert.equal(last(outs).finishReason, 'abort');
    assert.equal(outs.length, 4);
    assert.deepEqual(e.stats().kvBlocksUsed, 0);
    assert.equal(e.stats().numRunning, 0);
    await e.close();
  });

  test('abort of a request that has not arrived yet, and of one whose consumer left', async () => {
    const e = engine();
    const later = all(e.generate(req('later', prompt(16), 1_000_000)));
    e.abort('later');
    const outs = await later;
    assert.deepEqual(outs.map((o) => o.finishReason), ['abort']);
    for await (const output of e.generate(req('left', prompt(64), e.now(), { maxTokens: 100 }))) {
      assert.equal(output.newTokenIds.length, 1);
      break; // the consumer stops: the request must be aborted and its blocks freed
    }
    await e.idle();
    assert.equal(e.stats().kvBlocksUsed, 0);
    await e.close();
  });

  test('max_tokens governs length; EOS only when asked; stop strings end a completion', async () => {
    const e = engine({ eosProbability: 1 });
    const eos = await all(e.generate(req('eos', prompt(16), 0, { maxTokens: 10 })));
    assert.deepEqual(eos.map((o) => o.finishReason), ['stop']);
    assert.equal(eos[0]!.stopReason, TOY_VOCAB - 1); // default EOS: the last token id
    const ignored = await all(e.generate(req('ignored', prompt(16, 3), e.now(), { maxTokens: 4, ignoreEos: true })));
    assert.equal(ignored.length, 4);
    assert.equal(last(ignored).finishReason, 'length');
    await e.close();

    const plain = engine();
    const words = await all(plain.generate(req('words', prompt(16), 0, { maxTokens: 6, seed: 5 })));
    const text = words.map((o) => o.textDelta).join('');
    assert.equal(text, words.map((o) => syntheticWord(o.newTokenIds[0]!)).join(''));
    const third = syntheticWord(words[2]!.newTokenIds[0]!);
    const stopped = await all(plain.generate(req('stopped', prompt(16), plain.now(), { maxTokens: 6, seed: 5, stop: [third] })));
    await plain.close();
    assert.equal(last(stopped).finishReason, 'stop');
    assert.equal(last(stopped).stopReason, third);
    const stoppedText = stopped.map((o) => o.textDelta).join('');
    assert.equal(stoppedText, text.slice(0, text.indexOf(third)));
  });

  test('tokens depend only on seed, completion and position, never on EOS or stop token ids', () => {
    const opts = { vocabSize: 50, eosTokenId: 7, eosProbability: 0, avoid: [3] };
    const seen = new Set<number>();
    for (let position = 0; position < 2000; position++) {
      const token = syntheticToken(42, 0, position, opts);
      assert.equal(token, syntheticToken(42, 0, position, opts));
      seen.add(token);
    }
    assert.ok(!seen.has(7) && !seen.has(3));
    assert.equal(seen.size, 48); // every other id of the 50 turns up in 2000 draws
    const stream = (index: number) => Array.from({ length: 100 }, (_, position) => syntheticToken(42, index, position, opts));
    assert.notDeepEqual(stream(0), stream(1));
  });

  test('greedy requests with one prompt get the same tokens whatever their ids and seeds; sampled ones draw their own', async () => {
    const e = engine({ loraRank: 4 });
    await e.loadLora('a', '/synthetic');
    const tokensOf = async (id: string, promptTokenIds: number[], sampling: Partial<EngineRequest['sampling']>, extra: Partial<EngineRequest> = {}) =>
      (await all(e.generate({ ...req(id, promptTokenIds, e.now(), { maxTokens: 8, ...sampling }), ...extra }))).flatMap((o) => o.newTokenIds);
    const greedy = await tokensOf('g1', prompt(16), { temperature: 0 });
    assert.equal(greedy.length, 8);
    assert.deepEqual(await tokensOf('g2', prompt(16), { temperature: 0, seed: 9 }), greedy);
    const sorted = (ids: number[]) => [...ids].sort((a, b) => a - b);
    assert.deepEqual(sorted(await tokensOf('g3', prompt(16), { temperature: 0, n: 2 })), sorted([...greedy, ...greedy]));
    assert.notDeepEqual(await tokensOf('other-prompt', prompt(16, 1), { temperature: 0 }), greedy);
    assert.notDeepEqual(await tokensOf('adapter', prompt(16), { temperature: 0 }, { lora: 'a' }), greedy);
    // A request continued after its worker was lost carries its earlier output at the end of its prompt: it goes on
    // with the tokens it would have had.
    const continued = await tokensOf('g1-migrated', [...prompt(16), ...greedy.slice(0, 3)], { temperature: 0, maxTokens: 5 },
      { priorOutputTokenIds: greedy.slice(0, 3) });
    assert.deepEqual(continued, greedy.slice(3));
    // Sampled without a seed: each request its own draws.
    assert.notDeepEqual(await tokensOf('s1', prompt(16), { temperature: 1 }), await tokensOf('s2', prompt(16), { temperature: 1 }));
    await e.close();
  });

  test('a duplicate id or a prompt longer than the pool is refused with a coded error', async () => {
    const e = engine();
    const stream = e.generate(req('dup', prompt(16), 0, { maxTokens: 2 }));
    assert.throws(() => e.generate(req('dup', prompt(16))), { name: 'InvalidRequestError', code: 'duplicate_request_id' });
    await all(stream);
    // The pool holds 64 blocks x 16 = 1,024 tokens.
    await assert.rejects(all(e.generate(req('huge', prompt(1025)))), { name: 'InvalidRequestError', code: 'prompt_exceeds_kv_pool' });
    await e.close();
  });

  test('KV events carry the same block hashes the router computes from the prompt', async () => {
    const e = engine({ enableKvEvents: true });
    const events: KvEvent[] = [];
    e.onKvEvents((batch) => events.push(...batch));
    const tokens = prompt(64);
    await all(e.generate(req('a', tokens, 0, { maxTokens: 1 })));
    await e.close();
    const stored = events.filter((ev) => ev.type === 'stored').flatMap((ev) => (ev.type === 'stored' ? ev.blockHashes : []));
    assert.deepEqual(stored, hashTokenBlocks(tokens, 16));
  });

  test('a finite speed-up paces steps but gives the same tokens, and never shorter than simulated', async () => {
    const fast = engine();
    const reference = await all(fast.generate(req('a', prompt(64), 0, { maxTokens: 3 })));
    await fast.close();
    const paced = new SimEngine({ ...toyWorker, speedUp: 1000 });
    const outs = await all(paced.generate(req('a', prompt(64), paced.now(), { maxTokens: 3 })));
    await paced.close();
    assert.deepEqual(outs.map((o) => o.newTokenIds), reference.map((o) => o.newTokenIds));
    assert.ok(ttftOf(outs[0]!) >= 44.82896 - 1e-9);
    assert.ok(outs[1]!.timestamps.lastToken! - outs[0]!.timestamps.lastToken! >= 1.47792 - 1e-9);
  });
});

const TOY_VOCAB = 1000;

test('two hundred simulated engines in one process, each on its own virtual clock', async () => {
  const engines = Array.from({ length: 200 }, () => engine());
  const outs = await Promise.all(engines.map((e, i) => all(e.generate(req(`r${i}`, prompt(64, i), 0, { maxTokens: 2 })))));
  await Promise.all(engines.map((e) => e.close()));
  for (const o of outs) {
    close(ttftOf(o[0]!), 44.82896);
    close(o[1]!.timestamps.lastToken! - o[0]!.timestamps.lastToken!, 1.47792);
  }
});

describe('SimWorker on real profiles', () => {
  test('KV pool from HBM minus weights: Llama 3.1 8B on one H100', () => {
    const worker = new SimWorker({ model: LLAMA_3_1_8B, hw: H100_SXM, tp: 1 });
    // 0.9 x 80 GiB = 77,309,411,328 B; weights 8,030,261,248 params x 2 B = 16,060,522,496 B;
    // KV per token 2 x 32 layers x 8 heads x 128 x 2 B = 131,072 B: 467,292 tokens = 29,205 blocks of 16.
    assert.equal(worker.kv.numBlocks, 29_205);
    assert.equal(worker.info.kvCapacityTokens, 29_205 * 16);
    assert.equal(worker.info.backend, 'sim');
    assert.deepEqual(worker.info.kernelVariants, { gpu: 'h100 x1' });
    assert.equal(worker.info.kvDtype, 'f16', 'BF16 KV is reported as 2-byte KV');
    assert.equal(new SimWorker({ model: withDtypes(LLAMA_3_1_8B, { kvBytesPerElement: 1 }), hw: H100_SXM, tp: 1 }).info.kvDtype, undefined);
    assert.throws(() => new SimWorker({ model: LLAMA_3_1_70B, hw: H100_SXM, tp: 1 }), /no HBM for the KV cache/);
    assert.deepEqual(new SimWorker({ model: LLAMA_3_1_70B, hw: H100_SXM, tp: 4 }).info.kernelVariants, { gpu: 'h100 x4' });
  });

  test('a plan becomes prefill chunks (context = start position) and decodes', () => {
    const worker = new SimWorker({ ...toyWorker, maxNumBatchedTokens: 50 });
    worker.add(req('a', prompt(30, 1), 0, { maxTokens: 3 }), 0);
    const first = worker.beginStep(0)!;
    worker.finishStep(first);
    worker.add(req('b', prompt(40, 2), 1, { maxTokens: 3 }), first.endMs);
    const second = worker.beginStep(first.endMs)!;
    // a decodes after its 30 prompt tokens; b's whole 40-token prompt fits the 49 tokens of budget left, and samples.
    assert.deepEqual(planToStepShape(second.plan), {
      prefillTokens: [{ newTokens: 40, contextLen: 0, sampled: true }], decodeSeqs: [{ contextLen: 30 }],
    });
    close(second.durationMs, (655_360 * 41 + 2 * 256_000 + 1_024 * (820 + 31)) / 1e6 + 0.5);
  });

  test('its load counts a prefix block shared by running requests once, as the pool holds it', () => {
    const worker = new SimWorker(toyWorker);
    worker.add(req('a', prompt(64), 0, { maxTokens: 8 }), 0);
    const first = worker.beginStep(0)!;
    worker.finishStep(first);
    // b reuses a's 4 cached blocks of 16 and adds one of its own.
    worker.add(req('b', [...prompt(64), 5, 6, 7], first.endMs, { maxTokens: 8 }), first.endMs);
    worker.finishStep(worker.beginStep(first.endMs)!);
    const load = worker.load();
    assert.equal(load.numRunning, 2);
    assert.equal(worker.kv.pool.numUsedBlocks, 6, 'a: 4 prompt blocks and 1 for its output; b: 1 past the shared 4');
    assert.equal(load.activeDecodeBlocks, 6);
  });

  test('lifecycle and decode-sweep tables agree with the engine on Llama 3.1 70B, 4 x H100', async () => {
    const lifecycle = await checkLifecycleWithEngine({ model: LLAMA_3_1_70B, hw: H100_SXM, tp: 4, promptTokens: 1024 });
    assert.equal(lifecycle.cold.cachedTokens, 0);
    close(lifecycle.cold.engineMs, lifecycle.cold.modelMs);
    assert.equal(lifecycle.warm.cachedTokens, 1008);
    close(lifecycle.warm.engineMs, lifecycle.warm.modelMs);
    assert.ok(lifecycle.warm.engineMs < lifecycle.cold.engineMs / 3);
    const budgeted = await checkLifecycleWithEngine({ model: LLAMA_3_1_70B, hw: H100_SXM, tp: 4, promptTokens: 1000, maxNumBatchedTokens: 256, cachedTokens: 500 });
    assert.equal(budgeted.warm.cachedTokens, 496);
    close(budgeted.cold.engineMs, budgeted.cold.modelMs);
    close(budgeted.warm.engineMs, budgeted.warm.modelMs);
    const rows = await checkDecodeSweepWithEngine({ model: LLAMA_3_1_70B, hw: H100_SXM, tp: 4, contextLen: 256, batchSizes: [1, 16] });
    for (const row of rows) close(row.engineItlMs, row.modelItlMs);
  });

  test('the lifecycle check refuses, before running, a prompt the worker\'s KV pool can never hold', async () => {
    // 2 x H100 at 90% of 80 GiB less half of 70,553,706,496 BF16 params leaves 6,755,704,832 B per GPU: 41,233 tokens
    // of 163,840 B, 2,577 blocks of 16 (41,232 tokens). A 41,233-token prompt fits no more (the engine refused it midway).
    await assert.rejects(checkLifecycleWithEngine({ model: LLAMA_3_1_70B, hw: H100_SXM, tp: 2, promptTokens: 41_233 }),
      (error: Error) => error.name === 'SimConfigError' && /at most 41233 tokens \(KV pool 2577 blocks x 16 tokens/.test(error.message));
  });
});
