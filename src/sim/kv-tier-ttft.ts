// TTFT of one prompt on a simulated GPU worker with lower KV tiers, by where its prefix comes from: cold (computed),
// the primary pool (HBM), host RAM (over PCIe) and local NVMe, each measured by running the simulated worker (the
// real scheduler, KV cache and tiers, the performance model's step times): the prompt runs once, an unrelated prompt
// of the same length evicts it from a pool sized for one, and the prompt runs again. `conduit sim kv-tiers`.

import { DEFAULT_SAMPLING, type EngineRequest } from '../engine/types.ts';
import { hostTierFor, NVME_GEN4, type HardwareProfile, type KvTierProfile } from './hardware.ts';
import { kvBytesPerToken, type ModelProfile } from './models.ts';
import type { Efficiency } from './perf-model.ts';
import { SimConfigError, SimWorker, simKvBlocks } from './sim-worker.ts';

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
}

export interface KvTierTtftRow {
  source: 'cold' | 'primary' | 'ram' | 'disk';
  ttftMs: number;
  cachedTokens: number;
  onboardedBlocks: number;
  onboardMs: number;
}

export interface KvTierTtftReport {
  rows: KvTierTtftRow[];
  blockBytes: number;
  ram: KvTierProfile;
  disk: KvTierProfile;
}

export function simulateKvTierTtft(options: KvTierTtftOptions): KvTierTtftReport {
  const { model, hw, tp, promptTokens } = options;
  const blockSize = options.blockSize ?? 16;
  const ram = options.ram ?? hostTierFor(hw);
  const disk = options.disk ?? NVME_GEN4;
  const blocks = Math.ceil((promptTokens + 32) / blockSize) + 2;
  // The worker gets a pool of just `blocks`, so that one unrelated prompt evicts the first. That pool must be one
  // the deployment has: its weights must leave HBM (simKvBlocks refuses otherwise), and at least `blocks` of it.
  const deploymentBlocks = simKvBlocks({ model, hw, tp, blockSize });
  if (blocks > deploymentBlocks) {
    throw new SimConfigError(`a ${promptTokens}-token prompt does not fit one worker of ${model.name} on ${tp} x ${hw.name}: `
      + `the measurement needs ${blocks} KV blocks of ${blockSize} tokens (the prompt, its output and an evicting prompt's `
      + `extra blocks), the pool holds ${deploymentBlocks}; use a larger tp or a shorter prompt`);
  }
  const blockBytes = blockSize * kvBytesPerToken(model);
  const make = (tiers: { ramBytes?: number; diskBytes?: number } | undefined) => new SimWorker({
    model, hw, tp, numKvBlocks: blocks, blockSize, maxModelLen: blocks * blockSize,
    maxNumBatchedTokens: options.maxNumBatchedTokens ?? 8192, ...(options.efficiency ? { efficiency: options.efficiency } : {}),
    ...(tiers !== undefined ? { kvTiers: { ...tiers, ram, disk } } : {}),
  });
  const prompt = Array.from({ length: promptTokens }, (_, i) => 100 + i);
  const evictor = Array.from({ length: promptTokens + 24 }, (_, i) => 50_000 + i);
  let clock = 0;
  let id = 0;
  const run = (worker: SimWorker, tokens: number[]): Omit<KvTierTtftRow, 'source'> => {
    const request: EngineRequest = {
      id: `t${id++}`, promptTokenIds: tokens, priority: 0, arrivalMs: clock,
      sampling: { ...DEFAULT_SAMPLING, maxTokens: 2, ignoreEos: true },
    };
    worker.add(request, clock);
    let first: Omit<KvTierTtftRow, 'source'> | undefined;
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
    return first!;
  };
  const plenty = 4 * blocks * blockBytes;
  const withRam = make({ ramBytes: plenty });
  const cold = run(withRam, prompt);
  const primary = run(withRam, prompt);
  run(withRam, evictor);
  const fromRam = run(withRam, prompt);
  const withDisk = make({ diskBytes: plenty });
  run(withDisk, prompt);
  run(withDisk, evictor);
  const fromDisk = run(withDisk, prompt);
  return {
    rows: [
      { source: 'cold', ...cold }, { source: 'primary', ...primary }, { source: 'ram', ...fromRam }, { source: 'disk', ...fromDisk },
    ],
    blockBytes, ram, disk,
  };
}

export function formatKvTierTtft(report: KvTierTtftReport): string {
  const names = { cold: 'cold (computed)', primary: 'primary pool (HBM)', ram: report.ram.name, disk: report.disk.name };
  const lines = [
    `| prefix from | TTFT ms | cached tokens | onboarded blocks | onboard ms |`,
    '|---|---:|---:|---:|---:|',
    ...report.rows.map((r) => `| ${names[r.source]} | ${r.ttftMs.toFixed(2)} | ${r.cachedTokens} | ${r.onboardedBlocks} | ${r.onboardMs.toFixed(2)} |`),
  ];
  return `${lines.join('\n')}\n(block ${(report.blockBytes / 2 ** 20).toFixed(2)} MiB of KV; ${report.ram.name} ${(report.ram.bytesPerSec / 1e9).toFixed(1)} GB/s per GPU, `
    + `${report.disk.name} ${(report.disk.bytesPerSec / 1e9).toFixed(1)} GB/s per worker)`;
}
