// The disaggregated cold path through the simulated engine: one prefill worker and one decode worker in a
// SimCluster, the same scheduler halves as the real engine (handOff, adoptRequest), the KV crossing a modelled
// link. What `conduit sim lifecycle --link ...` checks its disaggregated table against.

import { DEFAULT_SAMPLING } from '../engine/types.ts';
import { SimCluster } from './cluster.ts';
import { syntheticPrompt, type EngineCheckOptions } from './engine-check.ts';
import type { LinkProfile } from './hardware.ts';
import { simulateDisaggregatedPath } from './latency-model.ts';

export interface DisaggregatedPathCheck {
  /** First token minus arrival on the prefill worker, and the table's prefill_execution. */
  engineTtftMs: number;
  modelPrefillMs: number;
  /** Second token minus first on the decode worker, and the table's kv_transfer + decode_execution. */
  engineSecondTokenGapMs: number;
  modelSecondTokenGapMs: number;
  /** Blocks the engine moved, and the table's count. */
  engineTransferBlocks: number;
  modelTransferBlocks: number;
}

/** One cold request through a prefill worker and a decode worker on an otherwise idle simulated cluster. */
export function checkDisaggregatedPathWithEngine(opts: EngineCheckOptions & {
  promptTokens: number; link: LinkProfile; parallelLinks?: number; maxNumBatchedTokens?: number;
}): DisaggregatedPathCheck {
  const { model, hw, tp, promptTokens } = opts;
  const kvLink = { link: opts.link, parallelLinks: opts.parallelLinks ?? tp };
  const worker = {
    model, hw, tp, efficiency: opts.efficiency, blockSize: opts.blockSize, maxNumBatchedTokens: opts.maxNumBatchedTokens,
    maxModelLen: promptTokens + 8, kvLink,
  };
  const cluster = new SimCluster({
    workers: [{ ...worker, role: 'prefill' }, { ...worker, role: 'decode' }],
    route: () => ({ prefill: 0, decode: 1 }),
  });
  const { requests } = cluster.run([{
    id: 'cold', promptTokenIds: syntheticPrompt(promptTokens, model.vocabSize), priority: 0, arrivalMs: 0,
    sampling: { ...DEFAULT_SAMPLING, maxTokens: 2, ignoreEos: true },
  }]);
  const r = requests[0]!;
  if (r.firstTokenMs === undefined || r.finishMs === undefined) throw new Error(`the simulated request did not finish: ${r.error ?? r.finishReason}`);
  const table = simulateDisaggregatedPath({
    model, hw, tp, promptTokens, link: opts.link, parallelLinks: kvLink.parallelLinks, blockSize: opts.blockSize,
    maxNumBatchedTokens: opts.maxNumBatchedTokens, efficiency: opts.efficiency,
  });
  const ms = (phase: string) => table.disaggregated.phases.filter((p) => p.phase === phase).reduce((sum, p) => sum + p.ms, 0);
  return {
    engineTtftMs: r.firstTokenMs - r.arrivalMs, modelPrefillMs: ms('prefill_execution'),
    engineSecondTokenGapMs: r.finishMs - r.firstTokenMs, modelSecondTokenGapMs: ms('kv_transfer') + ms('decode_execution'),
    engineTransferBlocks: r.kvTransferBlocks ?? 0, modelTransferBlocks: table.transferBlocks,
  };
}
