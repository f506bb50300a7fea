// CPU time of a 16-row decode step of the 110M Q8_0 model with 16 distinct rank-8 q8 adapters (one per row) and
// without, driving the native model directly (no engine): per configuration, a 16-token prefill, 4 warm-up steps,
// then 24 timed steps, PAIRS times over (base then adapters, alternating); printed: the process's CPU time per step
// and the profile's sections (wall / caller's CPU ms per step). With THREADS=1 (the default) the caller runs
// everything, so the sections' CPU time is their own cost; CONDUIT_LORA_FUSE=0 runs the LoRA products in jobs of
// their own (their sections are then listed apart).
//
//   [CONDUIT_LORA_FUSE=0] [THREADS=1] [PAIRS=2] node --import tsx benchmarks/lora-step-cpu.ts

import { mkdtempSync, rmSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { loadNativeAddon, nativeModelSpec, supportedVariants } from '../src/kernels/native.ts';
import { kvPoolBytes, type ForwardBatch, type KvPoolLayout } from '../src/kernels/types.ts';
import { loadModel } from '../src/model/loader.ts';
import { loadLoraAdapter } from '../src/model/lora.ts';
import { randomLoraAdapter, writeGgufLoraAdapter } from '../src/model/lora-writer.ts';
import { ensureBenchModel } from './model-files.ts';

const dir = mkdtempSync(join(tmpdir(), 'conduit-lora-step-'));

const THREADS = Number(process.env.THREADS ?? 1);
const STEPS = 24;
const PAIRS = Number(process.env.PAIRS ?? 2);
const S = 16, BS = 16, BPS = 8;  // sequences (one adapter each), block size, blocks per sequence
const file = await ensureBenchModel('Q8_0');
const { config, weights } = await loadModel(file.path);
const addon = loadNativeAddon();
const layout: KvPoolLayout = { numLayers: config.numLayers, numBlocks: S * BPS, blockSize: BS, numKvHeads: config.numKvHeads, headDim: config.headDim, dtype: 'f16' };
const model = new addon.NativeModel({ ...nativeModelSpec(config, weights, { layout, bytes: new Uint8Array(new SharedArrayBuffer(kvPoolBytes(layout))) }, supportedVariants(addon.cpuInfo()).at(-1)!, THREADS), packWeights: true });
for (let i = 0; i < S; i++) {
  const path = join(dir, `a${i}.gguf`);
  writeGgufLoraAdapter(path, config, randomLoraAdapter(config, { rank: 8, seed: 100 + i, bScale: 0.05 }));
  model.setLora(i, { ...loadLoraAdapter(path, config).weights, dtype: 'q8' });
}

const tables = Int32Array.from({ length: S * BPS }, (_, i) => i);
function batch(pos: number, rows: number, lora: boolean): ForwardBatch {
  const n = S * rows;
  const b: ForwardBatch = {
    numTokens: n, tokenIds: new Int32Array(n), positions: new Int32Array(n), slotMapping: new Int32Array(n), numSeqs: S,
    queryStartLoc: new Int32Array(S + 1), seqLens: new Int32Array(S), blockTables: tables, maxBlocksPerSeq: BPS,
    logitsIndices: new Int32Array(S), ...(lora ? { loraSlots: new Int32Array(n) } : {}),
  };
  let r = 0;
  for (let s = 0; s < S; s++) {
    for (let k = 0; k < rows; k++, r++) {
      const p = pos + k;
      b.tokenIds[r] = 1 + ((s * 131 + p * 17) % 30000); b.positions[r] = p; b.slotMapping[r] = (s * BPS + Math.floor(p / BS)) * BS + (p % BS);
      if (b.loraSlots) b.loraSlots[r] = s;
    }
    b.queryStartLoc[s + 1] = r; b.seqLens[s] = pos + rows; b.logitsIndices[s] = r - 1;
  }
  return b;
}
for (const lora of Array.from({ length: 2 * PAIRS }, (_, i) => i % 2 === 1)) {
  model.forward(batch(0, 16, lora));
  for (let i = 0; i < 4; i++) model.forward(batch(16 + i, 1, lora));
  model.setProfiling(true); model.takeProfile();
  const t0 = process.cpuUsage();
  for (let i = 0; i < STEPS; i++) model.forward(batch(20 + i, 1, lora));
  const cpu = process.cpuUsage(t0);
  const prof = model.takeProfile();
  model.setProfiling(false);
  const rows = Object.entries(prof).sort((a, b) => b[1].seconds - a[1].seconds).slice(0, 12)
    .map(([k, v]) => `${k} ${(v.seconds / STEPS * 1000).toFixed(2)}w/${(v.cpuSeconds / STEPS * 1000).toFixed(2)}c`);
  console.log(`fuse=${process.env.CONDUIT_LORA_FUSE ?? '1'} lora=${lora} process CPU ${((cpu.user + cpu.system) / 1000 / STEPS).toFixed(2)} ms/step | ${rows.join(' | ')}`);
}
model.dispose();
rmSync(dir, { recursive: true, force: true });
