// TTFT of one prompt on a simulated GPU worker with lower KV tiers, by where its prefix comes from: cold (computed),
// the primary pool (HBM), host RAM (over PCIe) and local NVMe, each measured by running the simulated worker (the
// real scheduler, KV cache and tiers, the performance model's step times): the prompt runs once, an unrelated prompt
// that takes every block of the pool evicts all of it from HBM (the lower tier keeps it), and the prompt runs again.
// `conduit sim kv-tiers`.

import { DEFAULT_SAMPLING, type EngineRequest } from '../engine/types.ts';
import { hostTierFor, NVME_GEN4, type HardwareProfile, type KvTierProfile } from './hardware.ts';
import { counted } from './latency-model.ts';
import { kvBytesPerToken, type ModelProfile } from './models.ts';
import type { Efficiency } from './perf-model.ts';
import { SimConfigError, SimWorker, simKvBlocks, type SimRequestFlags } from './sim-worker.ts';

export interface KvTierTtftOptions {
  model: ModelProfile;
  hw: HardwareProfile;
  tp: number;
  promptTokens: number;
  blockSize?: number;
  maxNumBatchedTokens?: number;
  efficiency?: Efficiency;
  ram?: KvTierProfile;
  disk?: KvTierProfile;
  /** The options that set the deployment and the prompt, for refusals to name (`conduit sim kv-tiers`' --tp, --prompt). */
  flags?: SimRequestFlags;
}

export interface KvTierTtftRow {
  source: 'cold' | 'primary' | 'ram' | 'disk';
  ttftMs: number;
  /** Prompt tokens the run did not compute: HBM hits plus onboarded blocks. */
  cachedTokens: number;
  onboardedBlocks: number;
  onboardMs: number;
  /** Blocks the lower tier held that the cost model chose to recompute (slower to read than to compute with the rest). */
  recomputedBlocks: number;
}

export interface KvTierTtftReport {
  rows: KvTierTtftRow[];
  blockBytes: number;
  ram: KvTierProfile;
  disk: KvTierProfile;
}

/** KV blocks the kv-tiers measurement gives its worker: the prompt and its output with a few blocks to spare. */
function kvTierMeasurementBlocks(promptTokens: number, blockSize: number): number {
  return Math.ceil((promptTokens + 32) / blockSize) + 2;
}

/** The longest prompt whose kv-tiers measurement fits a pool of `poolBlocks` (the inverse of the above). */
function longestKvTierPrompt(poolBlocks: number, blockSize: number): number {
  return (poolBlocks - 2) * blockSize - 32;
}

export function simulateKvTierTtft(options: KvTierTtftOptions): KvTierTtftReport {
  const { model, hw, tp, promptTokens } = options;
  const blockSize = options.blockSize ?? 16;
  const ram = options.ram ?? hostTierFor(hw);
  const disk = options.disk ?? NVME_GEN4;
  // The lower tiers hold whole blocks, and never serve the block of the prompt's last token (that one is computed,
  // its logits give the first output token): a prompt of one block or less has nothing a lower tier could serve.
  const tierBlocks = Math.floor((promptTokens - 1) / blockSize);
  const request = options.flags ? `${options.flags.request}: ` : '';
  if (tierBlocks < 1) {
    throw new SimConfigError(`${request}a ${promptTokens}-token prompt has no whole KV block of ${blockSize} tokens before its last token, `
      + `so no part of it can come from host RAM or NVMe; use a prompt of more than ${blockSize} tokens`);
  }
  const blocks = kvTierMeasurementBlocks(promptTokens, blockSize);
  // The worker gets a pool of just `blocks` (the prompt and its output with a few blocks to spare, one of them for
  // the copy of a cached last block), which the evicting prompt then takes whole. That pool must be one the
  // deployment has: its weights must leave HBM (simKvBlocks refuses otherwise), and at least `blocks` of it.
  const deploymentBlocks = simKvBlocks({ model, hw, tp, blockSize }, options.flags);
  if (blocks > deploymentBlocks) {
    // The measurement's spare blocks make its limit lower than the deployment's own (sequences up to a whole pool):
    // name it, so the user need not search for the largest prompt that runs.
    const longest = longestKvTierPrompt(deploymentBlocks, blockSize);
    const fits = longest > blockSize ? `enough for a prompt of at most ${longest} tokens` : 'too few for any prompt';
    throw new SimConfigError(`${request}a ${promptTokens}-token prompt does not fit one worker of ${model.name} on ${tp} x ${hw.name}: `
      + `the measurement needs ${blocks} KV blocks of ${blockSize} tokens (the prompt, its output and a few spare blocks), `
      + `the pool holds ${deploymentBlocks}, ${fits}; use a larger ${options.flags?.tp ?? 'tp'} or a shorter prompt`);
  }
  const blockBytes = blockSize * kvBytesPerToken(model);
  const make = (tiers: { ramBytes?: number; diskBytes?: number } | undefined) => new SimWorker({
    model, hw, tp, numKvBlocks: blocks, blockSize, maxModelLen: blocks * blockSize,
    maxNumBatchedTokens: options.maxNumBatchedTokens ?? 8192, ...(options.efficiency ? { efficiency: options.efficiency } : {}),
    ...(tiers !== undefined ? { kvTiers: { ...tiers, ram, disk } } : {}),
  });
  const prompt = Array.from({ length: promptTokens }, (_, i) => 100 + i);
  // With its 2 output tokens the evictor is a sequence of blocks x blockSize tokens, all but the last of which take a
  // KV slot: one more than (blocks - 1) x blockSize, so it needs every block of the pool and leaves none of the
  // prompt's in HBM. Its tokens share nothing with the prompt's.
  const evictor = Array.from({ length: blocks * blockSize - 2 }, (_, i) => 50_000 + i);
  let clock = 0;
  let id = 0;
  const run = (worker: SimWorker, tokens: number[]): Omit<KvTierTtftRow, 'source'> => {
    const request: EngineRequest = {
      id: `t${id++}`, promptTokenIds: tokens, priority: 0, arrivalMs: clock,
      sampling: { ...DEFAULT_SAMPLING, maxTokens: 2, ignoreEos: true },
    };
    const recomputedBefore = worker.stats().kvTiers?.recomputedBlocks ?? 0;
    worker.add(request, clock);
    let first: Omit<KvTierTtftRow, 'source' | 'recomputedBlocks'> | undefined;
    for (let steps = 0; worker.hasWork; steps++) {
      const step = worker.beginStep(clock)!;
      clock = step.endMs;
      for (const output of worker.finishStep(step)) {
        if (first === undefined && output.newTokenIds.length > 0) {
          const onboard = output.timestamps.kvOnboard;
          first = {
            ttftMs: clock - request.arrivalMs, cachedTokens: output.usage.cachedTokens,
            onboardedBlocks: (onboard?.ram ?? 0) + (onboard?.disk ?? 0), onboardMs: onboard?.ms ?? 0,
          };
        }
      }
      if (steps > 10_000) throw new Error('simulated worker did not finish');
    }
    return { ...first!, recomputedBlocks: (worker.stats().kvTiers?.recomputedBlocks ?? 0) - recomputedBefore };
  };
  const plenty = 4 * blocks * blockBytes;
  const withRam = make({ ramBytes: plenty });
  const cold = run(withRam, prompt);
  const primary = run(withRam, prompt);
  run(withRam, evictor);
  const fromRam = checkLowerTierRow(run(withRam, prompt), promptTokens, blockSize, ram.name);
  // The same runs as the RAM worker's before its measured one, so both tiers' cost models price from the same steps.
  const withDisk = make({ diskBytes: plenty });
  run(withDisk, prompt);
  run(withDisk, prompt);
  run(withDisk, evictor);
  const fromDisk = checkLowerTierRow(run(withDisk, prompt), promptTokens, blockSize, disk.name);
  return {
    rows: [
      { source: 'cold', ...cold }, { source: 'primary', ...primary }, { source: 'ram', ...fromRam }, { source: 'disk', ...fromDisk },
    ],
    blockBytes, ram, disk,
  };
}

/**
 * A lower tier's row must have had every block that tier can serve (all whole blocks before the prompt's last token)
 * from that tier, onboarded or recomputed by the cost model's choice, and none from HBM: anything else would print
 * the HBM's (or a partly warm pool's) TTFT under the tier's name. Throws when it did not; returns the row.
 */
export function checkLowerTierRow<R extends Pick<KvTierTtftRow, 'cachedTokens' | 'onboardedBlocks' | 'recomputedBlocks'>>(
  row: R, promptTokens: number, blockSize: number, tierName: string): R {
  const tierBlocks = Math.floor((promptTokens - 1) / blockSize);
  if (row.onboardedBlocks + row.recomputedBlocks !== tierBlocks || row.cachedTokens !== row.onboardedBlocks * blockSize) {
    throw new Error(`kv-tiers: the ${promptTokens}-token prompt's run from ${tierName} onboarded ${row.onboardedBlocks} and recomputed `
      + `${row.recomputedBlocks} of the ${tierBlocks} blocks it should serve, with ${row.cachedTokens} prompt tokens cached: the row would not `
      + 'measure a prefix read from that tier alone');
  }
  return row;
}

export function formatKvTierTtft(report: KvTierTtftReport): string {
  const names = { cold: 'cold (computed)', primary: 'primary pool (HBM)', ram: report.ram.name, disk: report.disk.name };
  const lines = [
    `| prefix from | TTFT ms | cached tokens | onboarded blocks | onboard ms |`,
    '|---|---:|---:|---:|---:|',
    ...report.rows.map((r) => `| ${names[r.source]} | ${r.ttftMs.toFixed(2)} | ${r.cachedTokens} | ${r.onboardedBlocks} | ${r.onboardMs.toFixed(2)} |`),
  ];
  for (const r of report.rows) {
    if (r.recomputedBlocks > 0) {
      const one = r.recomputedBlocks === 1;
      lines.push(`(${names[r.source]}: ${counted(r.recomputedBlocks, 'block')} held there ${one ? 'was' : 'were'} recomputed instead, `
        + `the cost model finding ${one ? 'it' : 'them'} slower to read than to compute with the rest of the prompt)`);
    }
  }
  // Each tier's bandwidth as its profile counts it: per GPU (each moves its own shard) or for the whole worker.
  const rate = (tier: KvTierProfile) => `${tier.name} ${(tier.bytesPerSec / 1e9).toFixed(1)} GB/s per ${tier.perGpu ? 'GPU' : 'worker'}`;
  return `${lines.join('\n')}\n(block ${(report.blockBytes / 2 ** 20).toFixed(2)} MiB of KV; ${rate(report.ram)}, ${rate(report.disk)})`;
}
