// Decode workers of different context lengths behind one disaggregated engine: its info follows the workers there
// (max_model_len the smallest decode worker's context, recomputed as workers join and leave; kv_capacity_tokens the
// summed capacity), the decode router sends a decode worker only requests its context holds, and a prompt no decode
// worker holds is refused before any work (prompt_too_long, as one worker refuses it), never prefilled, streamed a
// first token and only then refused by the decode worker it was handed to. Simulated workers, in this process.
import { describe, test } from 'node:test';
import assert from 'node:assert/strict';
import { DEFAULT_SAMPLING, type EngineOutput, type EngineRequest } from '../../src/engine/types.ts';
import { DisaggregatedEngine } from '../../src/runtime/disaggregated.ts';
import { SimulatedKvChannel } from '../../src/runtime/kv-transfer.ts';
import { makeRouter, simPool } from '../../src/runtime/worker-pool.ts';

const SIM = { model: 'llama-3.1-8b', gpu: 'h100', tp: 1, speedUp: Infinity };

let nextId = 0;
function request(promptTokens: number, maxTokens: number): EngineRequest {
  const seed = nextId;
  return {
    id: `disagg-hetero-${nextId++}`, promptTokenIds: Array.from({ length: promptTokens }, (_, i) => 100 + ((i * 7 + seed * 31) % 20_000)),
    priority: 0, arrivalMs: 0, sampling: { ...DEFAULT_SAMPLING, maxTokens, temperature: 0, ignoreEos: true },
  };
}

async function run(engine: DisaggregatedEngine, req: EngineRequest, outputs: EngineOutput[] = []): Promise<EngineOutput[]> {
  for await (const output of engine.generate(req)) outputs.push(output);
  return outputs;
}

describe('decode workers of different context lengths behind one disaggregated engine', () => {
  test('info follows the decode workers; long requests go only where they fit; too long for all: refused up front', async () => {
    const long = simPool({ sim: SIM, maxModelLen: 2048, prefillWorkers: 1, decodeWorkers: 1 });
    const short = simPool({ sim: SIM, maxModelLen: 512, prefillWorkers: 0, decodeWorkers: 1 });
    const p1 = long.make({ enableKvEvents: true, role: 'prefill' });
    const d1 = long.make({ enableKvEvents: true, role: 'decode' });
    const d2 = short.make({ enableKvEvents: true, role: 'decode' });
    assert.equal(d1.info.maxModelLen, 2048);
    assert.equal(d2.info.maxModelLen, 512);
    const blockSize = d1.info.blockSize;
    const engine = new DisaggregatedEngine({
      prefill: [{ id: 'p1', engine: p1 }], decode: [{ id: 'd1', engine: d1 }],
      prefillRouter: makeRouter({ routerSeed: 1 }, blockSize, 0), decodeRouter: makeRouter({ routerSeed: 1 }, blockSize, 1),
      channel: new SimulatedKvChannel(),
      // Every prompt that can goes to the prefill worker.
      policy: { minRemotePrefillTokens: 0 },
      now: () => Math.max(long.clock!(), short.clock!()),
    });
    try {
      assert.equal(engine.info.maxModelLen, 2048);
      assert.equal(engine.info.kvCapacityTokens, p1.info.kvCapacityTokens + d1.info.kvCapacityTokens);

      engine.addDecodeWorker('d2', d2);
      assert.equal(engine.info.maxModelLen, 512, 'every decode worker takes what the gateway accepts from now on');
      assert.equal(engine.info.kvCapacityTokens, p1.info.kvCapacityTokens + d1.info.kvCapacityTokens + d2.info.kvCapacityTokens);

      // Accepted against 2048 before d2 joined: each goes to d1, prefilled on p1, and runs to its end.
      for (let i = 0; i < 3; i++) {
        const pair = await Promise.all([run(engine, request(900, 8)), run(engine, request(900, 8))]);
        for (const outputs of pair) {
          const last = outputs.at(-1)!;
          assert.equal(last.finishReason, 'length');
          assert.equal(last.usage.completionTokens, 8);
          assert.equal(last.routing!.disaggregation!.decodeWorkerId, 'd1');
          assert.equal(last.routing!.disaggregation!.mode, 'disaggregated', last.routing!.disaggregation!.detail);
        }
      }

      // d1 leaves: the info follows the decode worker left.
      engine.removeWorker('d1');
      assert.equal(engine.info.maxModelLen, 512);
      assert.equal(engine.info.kvCapacityTokens, p1.info.kvCapacityTokens + d2.info.kvCapacityTokens);

      // A prompt no decode worker holds: refused before any output, as one worker refuses it, with nothing prefilled.
      const decided = engine.decisionCounts();
      const outputs: EngineOutput[] = [];
      await assert.rejects(run(engine, request(900, 8), outputs), (error: Error) => {
        assert.equal(error.name, 'InvalidRequestError');
        assert.equal((error as Error & { code: string }).code, 'prompt_too_long');
        assert.match(error.message, /prompt of 900 tokens leaves no room for output within the context length 512/);
        return true;
      });
      assert.equal(outputs.length, 0, 'no token streamed before the refusal');
      assert.deepEqual(engine.decisionCounts(), decided, 'never routed, so never prefilled');
      // One that fits still runs, on d2.
      const fits = (await run(engine, request(300, 8))).at(-1)!;
      assert.equal(fits.finishReason, 'length');
      assert.equal(fits.routing!.disaggregation!.decodeWorkerId, 'd2');

      // A decode worker with the longer context joins again: the info rises with it.
      const d3 = long.make({ enableKvEvents: true, role: 'decode' });
      engine.addDecodeWorker('d3', d3);
      assert.equal(engine.info.maxModelLen, 512);
      engine.removeWorker('d2');
      assert.equal(engine.info.maxModelLen, 2048);
      assert.equal((await run(engine, request(900, 8))).at(-1)!.routing!.disaggregation!.decodeWorkerId, 'd3');
    } finally {
      await engine.close();
    }
  });

  test('a prompt longer than every prefill worker\'s context is prefilled on its decode worker; it does not lower max_model_len', async () => {
    const long = simPool({ sim: SIM, maxModelLen: 2048, prefillWorkers: 0, decodeWorkers: 1 });
    const short = simPool({ sim: SIM, maxModelLen: 512, prefillWorkers: 1, decodeWorkers: 0 });
    const p1 = short.make({ enableKvEvents: true, role: 'prefill' });
    const d1 = long.make({ enableKvEvents: true, role: 'decode' });
    const blockSize = d1.info.blockSize;
    const engine = new DisaggregatedEngine({
      prefill: [{ id: 'p1', engine: p1 }], decode: [{ id: 'd1', engine: d1 }],
      prefillRouter: makeRouter({ routerSeed: 2 }, blockSize, 0), decodeRouter: makeRouter({ routerSeed: 2 }, blockSize, 1),
      channel: new SimulatedKvChannel(), policy: { minRemotePrefillTokens: 0 },
      now: () => Math.max(long.clock!(), short.clock!()),
    });
    try {
      assert.equal(engine.info.maxModelLen, 2048);
      const longPrompt = (await run(engine, request(900, 8))).at(-1)!;
      assert.equal(longPrompt.finishReason, 'length');
      assert.equal(longPrompt.usage.completionTokens, 8);
      assert.equal(longPrompt.routing!.disaggregation!.mode, 'local', longPrompt.routing!.disaggregation!.detail);
      // Not a busy prefill tier (p1 runs nothing): no prefill worker could ever take this prompt.
      assert.equal(longPrompt.routing!.disaggregation!.reason, 'not-eligible');
      assert.match(longPrompt.routing!.disaggregation!.detail, /no prefill worker's context holds a prompt of 900 tokens/);
      const shortPrompt = (await run(engine, request(300, 8))).at(-1)!;
      assert.equal(shortPrompt.routing!.disaggregation!.mode, 'disaggregated', shortPrompt.routing!.disaggregation!.detail);
      assert.equal(shortPrompt.routing!.disaggregation!.prefillWorkerId, 'p1');
    } finally {
      await engine.close();
    }
  });
});
