// Guided requests on simulated workers: one that takes over a migrated request advances the grammar over the output
// the lost worker produced (priorOutputTokenIds), as a cpu worker does, so the whole output is one match (so does a
// decode worker that adopts such a request after its hand-over, and it refuses one whose tokens the grammar does not
// allow); and the step core shared with the cpu engine closes every grammar matcher it opened for a request it
// refuses or drops.
import { describe, test } from 'node:test';
import assert from 'node:assert/strict';
import { engineNow } from '../../src/engine/clock.ts';
import { DEFAULT_SAMPLING, type EngineOutput, type EngineRequest, type SamplingParams } from '../../src/engine/types.ts';
import { GrammarLoader, type GuidedSequence } from '../../src/engine/grammar/runtime.ts';
import type { KvHandoff } from '../../src/engine/handoff.ts';
import { readGguf } from '../../src/model/gguf.ts';
import { LLAMA_SPM_TOKENIZER_PATH } from '../../src/model/synthetic.ts';
import { createTokenizer } from '../../src/model/tokenizer/index.ts';
import { simPool } from '../../src/runtime/worker-pool.ts';
import { getHardwareProfile } from '../../src/sim/hardware.ts';
import { getModelProfile } from '../../src/sim/models.ts';
import { SimWorker, type SimWorkerConfig } from '../../src/sim/sim-worker.ts';
import { collect, text, tokens } from '../helpers/outputs.ts';

const GUIDED = { kind: 'regex', pattern: '[a-z]{60}\\.' } as const;
const PROMPT = Array.from({ length: 24 }, (_, i) => 300 + i * 37);

function request(id: string, sampling: Partial<SamplingParams>, extra: Partial<EngineRequest> = {}): EngineRequest {
  return {
    id, promptTokenIds: PROMPT, priority: 0, arrivalMs: engineNow(),
    sampling: { ...DEFAULT_SAMPLING, maxTokens: 200, seed: 7, guided: GUIDED, ...sampling }, ...extra,
  };
}

describe('a guided request migrated to a simulated worker', () => {
  test('the new worker goes on under the grammar from the output so far: prior output + its own is one match', async () => {
    const sim = simPool({ sim: { model: 'llama-3.1-8b', gpu: 'h100-sxm', tp: 1, speedUp: Infinity } });
    const engine = sim.make({ enableKvEvents: false });
    try {
      const whole = await collect(engine.generate(request('whole', {})));
      assert.match(text(whole), /^[a-z]{60}\.$/, 'an uninterrupted run is one match');
      const prior = tokens(whole).slice(0, 6);
      const priorText = sim.tokenizer.decode(prior);
      assert.ok(priorText.length >= 6 && priorText.length < 60, `the first worker's output so far: ${JSON.stringify(priorText)}`);

      // What RequestMigration sends the new worker: the output so far appended to the prompt and named as such.
      const rest = await collect(engine.generate(request('moved', { maxTokens: 200 - prior.length }, {
        promptTokenIds: [...PROMPT, ...prior], priorOutputTokenIds: prior,
      })));
      assert.equal(rest.at(-1)!.finishReason, 'stop', 'the grammar ended the output');
      const all = sim.tokenizer.decode([...prior, ...tokens(rest)]);
      assert.match(all, /^[a-z]{60}\.$/, `one match across the migration: ${JSON.stringify(all)}`);

      // An output so far that the grammar does not allow is refused, and the worker serves on.
      const digits = sim.tokenizer.encode('123', { addSpecialTokens: false });
      await assert.rejects(collect(engine.generate(request('bad', {}, {
        promptTokenIds: [...PROMPT, ...digits], priorOutputTokenIds: digits,
      }))), /does not follow the request's grammar/);
      assert.match(text(await collect(engine.generate(request('after', {})))), /^[a-z]{60}\.$/);
      assert.equal(engine.stats().kvBlocksUsed, 0, 'no block held');
    } finally {
      await engine.close();
    }
  });
});

describe('grammar matchers of requests a simulated worker refuses or drops', () => {
  /** A grammar loader whose matchers are counted while open (the WASM objects a leak would keep). */
  async function countedGrammar() {
    const tokenizer = createTokenizer({ kind: 'gguf', file: readGguf(LLAMA_SPM_TOKENIZER_PATH) });
    const grammar = new GrammarLoader(tokenizer);
    const runtime = await grammar.load();
    const open = new Set<GuidedSequence>();
    const openOf = runtime.open.bind(runtime);
    runtime.open = (spec) => {
      const sequence = openOf(spec);
      open.add(sequence);
      const dispose = sequence.dispose.bind(sequence);
      sequence.dispose = () => {
        open.delete(sequence);
        dispose();
      };
      return sequence;
    };
    return { tokenizer, grammar, open };
  }

  function worker(counted: Awaited<ReturnType<typeof countedGrammar>>, config: Partial<SimWorkerConfig>): SimWorker {
    return new SimWorker({
      model: getModelProfile('llama-3.1-8b'), hw: getHardwareProfile('h100'), tp: 1, numKvBlocks: 64, blockSize: 16,
      vocabSize: counted.tokenizer.vocabSize, eosTokenId: counted.tokenizer.eosId!, tokenizer: counted.tokenizer,
      grammar: counted.grammar, ...config,
    });
  }

  /** A guided request whose prompt shares no block with another id's. */
  function guided(id: string, promptLength: number, sampling: Partial<SamplingParams> = {}): EngineRequest {
    const base = 300 + 500 * id.charCodeAt(id.length - 1);
    return {
      id, promptTokenIds: Array.from({ length: promptLength }, (_, i) => base + i), priority: 0, arrivalMs: 0,
      sampling: { ...DEFAULT_SAMPLING, maxTokens: 40, seed: 3, guided: GUIDED, ...sampling },
    };
  }

  test('refused at add (more completions than sequences, a prompt the pool cannot hold): no matcher left open', async () => {
    const counted = await countedGrammar();
    const w = worker(counted, { maxNumSeqs: 2 });
    assert.throws(() => w.add(guided('many', 8, { n: 3 }), 0));
    assert.throws(() => w.add(guided('long', 64 * 16 + 1), 0));
    assert.equal(counted.open.size, 0);
    w.add(guided('fine', 8), 0);
    assert.equal(counted.open.size, 1, 'an accepted request keeps its matcher');
  });

  test('a handoff waiting for room, aborted; a handoff refused at adoption: no matcher left open, nothing held', async () => {
    const counted = await countedGrammar();
    // The prefill side: two guided requests run to their first token and handed off.
    const prefill = worker(counted, { role: 'prefill' });
    for (const id of ['h1', 'h2']) prefill.add(guided(id, 100), 0, { handoff: true });
    let now = 0;
    const handoffs: KvHandoff[] = [];
    for (let i = 0; handoffs.length < 2 && i < 50; i++) {
      const step = prefill.beginStep(now)!;
      now = step.endMs;
      prefill.finishStep(step);
      handoffs.push(...prefill.takeHandoffs());
    }
    assert.equal(handoffs.length, 2);
    // The decode side holds one prompt of 7 blocks in 10: the second waits for room, then is aborted.
    const decode = worker(counted, { role: 'decode', numKvBlocks: 10 });
    const before = counted.open.size;
    assert.notEqual(decode.adopt(handoffs[0]!, now), null);
    assert.equal(decode.adopt(handoffs[1]!, now), null, 'no room yet: the adoption waits');
    assert.equal(counted.open.size, before + 2);
    decode.abort('h2', now);
    assert.equal(counted.open.size, before + 1, 'the aborted adoption\'s matcher is closed');
    // A handoff this worker can never hold (its pool is smaller than the prompt) is refused with its matcher closed.
    // Blocks reserved for its import first (as a decode worker process does before pulling) are given back too.
    const tiny = worker(counted, { role: 'decode', numKvBlocks: 4 });
    const prepared = tiny.prepareKvImport('h2', handoffs[1]!.blockHashes, 3);
    assert.equal(prepared.blockIds?.length, 3);
    assert.throws(() => tiny.adopt(handoffs[1]!, now));
    assert.equal(counted.open.size, before + 1);
    assert.equal(tiny.numImportReservations, 0);
    assert.equal(tiny.stats().kvBlocksUsed, 0);
  });

  test('a handoff of a request prefilled again after output went out: the decode side goes on after that output; a token the grammar refuses fails the adoption', async () => {
    const counted = await countedGrammar();
    let now = 0;
    /** Runs the request on a new prefill worker to its handoff; that handoff and the outputs before it. */
    const prefilled = (request: EngineRequest) => {
      const prefill = worker(counted, { role: 'prefill' });
      prefill.add(request, now, { handoff: true });
      const out: EngineOutput[] = [];
      for (let i = 0; i < 50; i++) {
        const step = prefill.beginStep(now)!;
        now = step.endMs;
        out.push(...prefill.finishStep(step));
        const [handoff] = prefill.takeHandoffs();
        if (handoff !== undefined) return { handoff, outputs: out };
      }
      return assert.fail('no handoff');
    };
    const base = guided('m', 40);
    // The first prefill worker's output went out (then it was lost); what RequestMigration sends again: that output
    // appended to the prompt and named as such.
    const letters = prefilled(base).handoff.outputTokenIds;
    const again: EngineRequest = {
      ...base, promptTokenIds: [...base.promptTokenIds, ...letters], priorOutputTokenIds: letters,
      sampling: { ...base.sampling, maxTokens: 40 - letters.length },
    };
    const { handoff, outputs } = prefilled(again);
    const decode = worker(counted, { role: 'decode' });
    const open = counted.open.size;
    const digits = counted.tokenizer.encode('123', { addSpecialTokens: false });
    for (const bad of [{ ...handoff, outputTokenIds: digits }, { ...handoff, request: { ...handoff.request, priorOutputTokenIds: digits } }]) {
      assert.throws(() => decode.adopt(bad, now), /m: the request's grammar refuses token \d+ of its output so far; it cannot go on under its grammar/);
      assert.equal(counted.open.size, open, 'the refused handoff\'s matcher is closed');
      assert.equal(decode.stats().kvBlocksUsed, 0);
    }
    assert.notEqual(decode.adopt(handoff, now), null);
    for (let i = 0; decode.hasWork && i < 500; i++) {
      const step = decode.beginStep(now)!;
      now = step.endMs;
      outputs.push(...decode.finishStep(step));
    }
    assert.equal(outputs.at(-1)!.finishReason, 'stop', 'the grammar ended the output');
    const all = counted.tokenizer.decode([...letters, ...outputs.flatMap((o) => o.newTokenIds)]);
    assert.match(all, /^[a-z]{60}\.$/, `one match across the move: ${JSON.stringify(all)}`);
  });
});
