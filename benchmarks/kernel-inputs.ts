// Inputs and timing shared by the kernel benchmark (kernels.ts) and the baseline process it starts
// (kernel-baseline.ts), so both time the very same cases.
import { GgmlType, byteSize } from '../src/model/ggml-types.ts';
import { f32ToF16Bits } from '../src/model/quant.ts';

export interface Timing {
  min: number;
  median: number;
}

/** Runs fn until `minSeconds` have passed (at least `minReps` times) and returns min / median seconds per call. */
export function timeCall(fn: () => void, minReps: number, minSeconds: number): Timing {
  fn(); // warm up (page faults, scratch growth)
  const samples: number[] = [];
  const start = performance.now();
  while (samples.length < minReps || performance.now() - start < minSeconds * 1000) {
    const t = performance.now();
    fn();
    samples.push((performance.now() - t) / 1000);
  }
  samples.sort((a, b) => a - b);
  return { min: samples[0]!, median: samples[Math.floor(samples.length / 2)]! };
}

// Weights are random bytes with sane scales: values do not change the timing of these kernels, and encoding tens of
// MB through the TypeScript quantizer would dominate the run.

export function seededBytes(n: number, seed: number): Uint8Array {
  const out = new Uint8Array(n);
  let s = seed >>> 0;
  for (let i = 0; i < n; i += 4) {
    s = (Math.imul(s, 1664525) + 1013904223) >>> 0;
    out[i] = s; out[i + 1] = s >>> 8; out[i + 2] = s >>> 16; out[i + 3] = s >>> 24;
  }
  return out;
}

export function randomFloats(n: number, seed: number, scale = 1): Float32Array {
  const bytes = seededBytes(n * 4, seed);
  const words = new Uint32Array(bytes.buffer);
  return Float32Array.from(words, (w) => ((w / 4294967296) * 2 - 1) * scale);
}

/** A [n x k] weight matrix in `type` with random quants and small positive scales. */
export function randomWeights(type: GgmlType, k: number, n: number, seed: number): Uint8Array {
  if (type === GgmlType.F32) return new Uint8Array(randomFloats(k * n, seed, 0.05).buffer);
  if (type === GgmlType.F16 || type === GgmlType.BF16) {
    const values = randomFloats(k * n, seed, 0.05);
    const out = new Uint16Array(k * n);
    const f32 = new Uint32Array(values.buffer);
    for (let i = 0; i < out.length; i++) out[i] = type === GgmlType.F16 ? f32ToF16Bits(values[i]!) : f32[i]! >>> 16;
    return new Uint8Array(out.buffer);
  }
  const out = seededBytes(byteSize(type, k * n), seed);
  const scale = f32ToF16Bits(0.01);
  const blockBytes = byteSize(type, type === GgmlType.Q8_0 || type === GgmlType.Q4_0 ? 32 : 256);
  // Offsets of the f16 scale fields in each block.
  const scaleOffsets = type === GgmlType.Q6_K ? [208] : type === GgmlType.Q4_K ? [0, 2] : [0];
  for (let b = 0; b < out.length; b += blockBytes) {
    for (const o of scaleOffsets) { out[b + o] = scale & 0xff; out[b + o + 1] = scale >>> 8; }
  }
  return out;
}
