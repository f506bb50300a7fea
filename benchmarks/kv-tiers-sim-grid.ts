// The KV tiers' cost model (src/engine/kv-cache/tiers.ts, step-time-curve.ts) over simulated deployments: for each
// model/GPU setup and prompt length, `conduit sim kv-tiers`' measurement (src/sim/kv-tier-ttft.ts: the prompt cold,
// then from host RAM and from NVMe after an evicting prompt), and how often a tier row came out slower than computing
// the whole prompt: the cost model read blocks it would have been faster to recompute.
//
//   node --import tsx benchmarks/kv-tiers-sim-grid.ts [--rows]
//
// --rows prints every tier row (setup, prompt, tier, TTFT, cold TTFT, blocks onboarded and recomputed); the summary
// line is always printed. The simulator is deterministic: one run is the figure.

import { resolveDeployment } from '../src/cli/sim.ts';
import { simulateKvTierTtft } from '../src/sim/kv-tier-ttft.ts';

/** [model, GPU, tensor-parallel degree]: dense and mixture-of-experts models, memory-bound and compute-bound GPUs. */
const SETUPS: [string, string, number][] = [
  ['llama-3.1-8b', 'h100', 1], ['llama-3.1-8b', 'a100', 1], ['llama-3.1-8b', 'h200', 1],
  ['llama-3.1-70b', 'h100', 4], ['llama-3.1-70b', 'a100', 4], ['llama-3.1-70b', 'h200', 2],
  ['qwen2.5-7b', 'h100', 1], ['mixtral-8x7b', 'h100', 2], ['qwen3-30b-a3b', 'h100', 1],
];
const PROMPTS = [17, 33, 50, 100, 200, 300, 500, 800, 1000, 1500, 2000, 4000, 8000, 16000];
const showRows = process.argv.includes('--rows');

let rows = 0;
let slower = 0;
let excessMs = 0;
let tierTtftMs = 0;
let worst = { share: 0, text: 'none' };
for (const [modelId, gpu, tp] of SETUPS) {
  const { model, hw, efficiency } = resolveDeployment({ model: modelId, gpu, tp });
  for (const promptTokens of PROMPTS) {
    const report = simulateKvTierTtft({ model, hw, tp, promptTokens, efficiency });
    const cold = report.rows.find((row) => row.source === 'cold')!.ttftMs;
    for (const row of report.rows.filter((r) => r.source === 'ram' || r.source === 'disk')) {
      rows++;
      tierTtftMs += row.ttftMs;
      const text = `${modelId} ${tp} x ${gpu}, ${promptTokens} tokens, ${row.source}: ${row.ttftMs.toFixed(2)} ms against `
        + `${cold.toFixed(2)} cold, ${row.onboardedBlocks} blocks onboarded, ${row.recomputedBlocks} recomputed`;
      if (showRows) console.log(text);
      const excess = row.ttftMs - cold;
      if (excess <= 1e-9) continue;
      slower++;
      excessMs += excess;
      if (excess / cold > worst.share) worst = { share: excess / cold, text };
    }
  }
}
console.log(`${SETUPS.length} setups x ${PROMPTS.length} prompt lengths: ${slower} of ${rows} tier rows slower than cold `
  + `(${excessMs.toFixed(2)} ms in all); tier rows' TTFT summed ${tierTtftMs.toFixed(1)} ms`);
console.log(`worst: ${worst.text}${worst.share > 0 ? ` (+${(worst.share * 100).toFixed(1)}%)` : ''}`);
