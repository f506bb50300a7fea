// Cross-checks between the performance model's tables (lifecycle.ts) and the simulated engine: the same shapes run
// through the real scheduler and KV cache must take exactly the time the tables say. A difference means the
// engine planned something other than the table assumes (different chunking, a missed prefix hit, an extra step).

import { DEFAULT_SAMPLING, type EngineOutput, type EngineRequest } from '../engine/types.ts';
import type { HardwareProfile } from './hardware.ts';
import { decodeSweep, DEFAULT_BATCH_SIZES, simulateLifecycle, type SweepLora } from './latency-model.ts';
import type { ModelProfile } from './models.ts';
import type { Efficiency } from './perf-model.ts';
import { SimEngine } from './sim-engine.ts';
import { checkSimSequenceFits, SIM_DEFAULTS, simKvBlocks } from './sim-worker.ts';

export interface EngineCheckOptions {
  model: ModelProfile;
  hw: HardwareProfile;
  tp: number;
  efficiency?: Efficiency;
  blockSize?: number;
}

export interface TtftCheck {
  /** Prompt tokens the engine found in its prefix cache. */
  cachedTokens: number;
  /** First token minus arrival, on the engine's virtual clock. */
  engineMs: number;
  /** The lifecycle table's prefill_execution for the same hit: what the engine must have spent. */
  modelMs: number;
}

export interface LifecycleCheck {
  cold: TtftCheck;
  warm: TtftCheck;
}

/** Token ids of a synthetic prompt; `variant` changes its first token, so different variants share no block. */
export function syntheticPrompt(length: number, vocabSize: number, variant = 0): number[] {
  return Array.from({ length }, (_, i) => (i === 0 ? variant : (i * 2_654_435_761 + 12_345)) % vocabSize);
}

function request(id: string, promptTokenIds: number[], maxTokens: number, arrivalMs: number): EngineRequest {
  return { id, promptTokenIds, sampling: { ...DEFAULT_SAMPLING, maxTokens }, priority: 0, arrivalMs };
}

async function collect(stream: AsyncIterable<EngineOutput>): Promise<EngineOutput> {
  let last: EngineOutput | undefined;
  for await (const output of stream) last = output;
  if (!last) throw new Error('the engine produced no output');
  return last;
}

const ttft = (out: EngineOutput) => out.timestamps.firstToken! - out.timestamps.arrival;

/**
 * One request on an idle simulated worker, cold; then, after a request that leaves `cachedTokens` of the prompt in
 * the prefix cache (default: all whole blocks but the last token's), the same prompt warm.
 */
export async function checkLifecycleWithEngine(opts: EngineCheckOptions & {
  promptTokens: number; cachedTokens?: number; maxNumBatchedTokens?: number;
}): Promise<LifecycleCheck> {
  const { model, promptTokens } = opts;
  const blockSize = opts.blockSize ?? SIM_DEFAULTS.blockSize;
  const maxNumBatchedTokens = opts.maxNumBatchedTokens ?? SIM_DEFAULTS.maxNumBatchedTokens;
  // A prompt the pool can never hold would be refused by the engine midway (InvalidRequestError): say so first.
  checkSimSequenceFits({ model, hw: opts.hw, tp: opts.tp, blockSize }, promptTokens, 1);
  const prompt = syntheticPrompt(promptTokens, model.vocabSize);
  const engine = new SimEngine({
    model, hw: opts.hw, tp: opts.tp, efficiency: opts.efficiency, blockSize, maxNumBatchedTokens, speedUp: Infinity,
  });
  try {
    const cold = await collect(engine.generate(request('cold', prompt, 1, engine.now())));
    // Leave only the first `cached` prompt tokens behind: a request with them and then a different token.
    const cached = Math.min(opts.cachedTokens ?? promptTokens, promptTokens - 1);
    const primer = [...prompt.slice(0, cached), (prompt[cached]! + 1) % model.vocabSize];
    const fresh = new SimEngine({
      model, hw: opts.hw, tp: opts.tp, efficiency: opts.efficiency, blockSize, maxNumBatchedTokens, speedUp: Infinity,
    });
    let warm: EngineOutput;
    try {
      await collect(fresh.generate(request('primer', primer, 1, fresh.now())));
      warm = await collect(fresh.generate(request('warm', prompt, 1, fresh.now())));
    } finally {
      await fresh.close();
    }
    const base = { model, hw: opts.hw, tp: opts.tp, promptTokens, blockSize, maxNumBatchedTokens, efficiency: opts.efficiency };
    const prefillMs = (cachedTokens: number, scenario: 'cold' | 'warm') => {
      const report = simulateLifecycle({ ...base, cachedTokens });
      return report[scenario].phases.find((p) => p.phase === 'prefill_execution')!.ms;
    };
    return {
      cold: { cachedTokens: cold.usage.cachedTokens, engineMs: ttft(cold), modelMs: prefillMs(0, 'cold') },
      warm: { cachedTokens: warm.usage.cachedTokens, engineMs: ttft(warm), modelMs: prefillMs(warm.usage.cachedTokens, 'warm') },
    };
  } finally {
    await engine.close();
  }
}

export interface DecodeCheckRow {
  batch: number;
  /** Gap between each request's first and second token: one decode step of the whole batch. NaN when skipped. */
  engineItlMs: number;
  modelItlMs: number;
  /** Why the engine was not run for this batch (its KV does not fit the pool). */
  skipped?: string;
}

/**
 * For each batch size B: B distinct prompts of contextLen tokens arrive together on an idle worker whose step budget
 * takes them all in one prefill step, so the next step decodes exactly B sequences at contextLen, as the sweep does.
 */
export async function checkDecodeSweepWithEngine(opts: EngineCheckOptions & {
  contextLen: number; batchSizes?: readonly number[]; lora?: SweepLora;
}): Promise<DecodeCheckRow[]> {
  const { model, contextLen } = opts;
  if (!Number.isSafeInteger(contextLen) || contextLen < 1) throw new RangeError(`contextLen must be an integer >= 1, got ${contextLen}`);
  const blockSize = opts.blockSize ?? SIM_DEFAULTS.blockSize;
  const batchSizes = opts.batchSizes ?? DEFAULT_BATCH_SIZES;
  const sweep = decodeSweep({ model, hw: opts.hw, tp: opts.tp, contextLen, batchSizes, efficiency: opts.efficiency, blockSize,
    ...(opts.lora ? { lora: opts.lora } : {}) });
  const adapters = opts.lora?.adapters ?? 0;
  const numBlocks = simKvBlocks({ model, hw: opts.hw, tp: opts.tp, blockSize });
  const rows: DecodeCheckRow[] = [];
  for (const row of sweep.rows) {
    const batch = row.batch;
    if (!row.kvFits) {
      rows.push({ batch, engineItlMs: NaN, modelItlMs: row.itlMs, skipped: 'KV does not fit' });
      continue;
    }
    const engine = new SimEngine({
      model, hw: opts.hw, tp: opts.tp, efficiency: opts.efficiency, blockSize, maxNumSeqs: batch,
      maxNumBatchedTokens: batch * contextLen, speedUp: Infinity, numKvBlocks: numBlocks,
      ...(opts.lora ? { loraRank: opts.lora.rank } : {}),
    });
    try {
      // Adapters without files: synthetic ones of the sweep's rank (sim-lora.ts), sequence i on adapter i mod N.
      for (let a = 0; a < Math.min(adapters, batch); a++) {
        await engine.loadLora(`lora-${a}`, `synthetic adapter ${a} (no file)`);
      }
      const outs = await Promise.all(Array.from({ length: batch }, (_, i) =>
        collect(engine.generate({
          ...request(`b${batch}-${i}`, syntheticPrompt(contextLen, model.vocabSize, i), 2, 0),
          ...(adapters > 0 ? { lora: `lora-${i % adapters}` } : {}),
        }))));
      const gaps = outs.map((o) => o.timestamps.lastToken! - o.timestamps.firstToken!);
      // Every request must have seen the same decode step; report the slowest if not.
      rows.push({ batch, engineItlMs: Math.max(...gaps), modelItlMs: row.itlMs });
    } finally {
      await engine.close();
    }
  }
  return rows;
}
