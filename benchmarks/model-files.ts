// The models the model-level benchmarks run: the synthetic 110M-class Llama (dim 768, 12 layers, 12 heads / 4 KV
// heads, FFN 2048, the Llama 2 vocabulary of 32000) in F32 and in Q8_0, written by the project's own GGUF writer
// and cached, so Conduit and llama.cpp read the very same file and nothing is downloaded.
//
//   node --import tsx benchmarks/model-files.ts [F32] [Q8_0]     prints the paths, generating what is missing
//
// Files live in <cache>/bench/ (cache: CONDUIT_CACHE_DIR, default ~/.cache/conduit). The first F32 generation
// writes ~400 MB; later calls only check the spec hash stored in the file.
//
// Why a directory of their own: llama.cpp insists on FLOAT32 for a few float hyperparameters, and the writer
// stores an integral number (a RoPE base of 10000) as UINT32, which llama.cpp refuses ("key llama.rope.freq_base
// has wrong type u32 but expected type f32"). The benchmark copy has those values retyped in place (same 4 bytes,
// same value, every offset unchanged), which Conduit's loader reads identically; the shared cache used by the
// rest of the project is left as the writer made it.
import { closeSync, copyFileSync, mkdirSync, openSync, readSync, renameSync, rmSync, statSync, writeSync } from 'node:fs';
import { join } from 'node:path';
import { fileURLToPath } from 'node:url';

import { GgufValueType } from '../src/model/gguf.ts';
import {
  defaultCacheDir, ensureSyntheticModel, storedSpecHash, syntheticSpecHash, SYNTHETIC_110M_F32, SYNTHETIC_110M_Q8_0,
} from '../src/model/synthetic.ts';
import type { SyntheticModelSpec } from '../src/model/synthetic.ts';

export type BenchModelDtype = 'F32' | 'Q8_0';

export const BENCH_MODEL_DTYPES: readonly BenchModelDtype[] = ['Q8_0', 'F32'];

export const BENCH_MODEL_SPECS: Readonly<Record<BenchModelDtype, SyntheticModelSpec>> = {
  F32: SYNTHETIC_110M_F32,
  Q8_0: SYNTHETIC_110M_Q8_0,
};

/** Hyperparameters llama.cpp reads only as FLOAT32. */
const FLOAT32_KEYS = ['llama.rope.freq_base', 'llama.attention.layer_norm_rms_epsilon', 'llama.rope.scale_linear'];
/** The metadata precedes the tensor data; the llama.* keys come before the large tokenizer arrays. */
const HEADER_SCAN_BYTES = 1 << 20;

export interface BenchModelFile {
  dtype: BenchModelDtype;
  /** e.g. "synthetic-110m Q8_0". */
  label: string;
  path: string;
  fileBytes: number;
}

export function parseBenchDtype(value: string): BenchModelDtype {
  const upper = value.toUpperCase();
  if (upper === 'F32' || upper === 'Q8_0') return upper;
  throw new RangeError(`unknown benchmark model dtype "${value}" (expected F32 or Q8_0)`);
}

export function benchModelDir(cacheDir = defaultCacheDir()): string {
  return join(cacheDir, 'bench');
}

/**
 * The benchmark GGUF for `dtype`: generated into the shared cache on first use, then copied into the benchmark
 * directory with its float hyperparameters typed as llama.cpp expects. Progress goes to stderr.
 */
export async function ensureBenchModel(dtype: BenchModelDtype, cacheDir = defaultCacheDir()): Promise<BenchModelFile> {
  const spec = BENCH_MODEL_SPECS[dtype];
  const label = `${spec.name} ${dtype}`;
  const path = join(benchModelDir(cacheDir), `${spec.name}-${dtype}.gguf`);
  if (storedSpecHash(path) !== syntheticSpecHash(spec)) {
    const started = performance.now();
    const source = await ensureSyntheticModel(spec, cacheDir);
    // Copy, retype, rename: a concurrent reader never sees a half-patched file.
    const temporary = `${path}.${process.pid}.${Date.now()}.tmp`;
    try {
      mkdirSync(benchModelDir(cacheDir), { recursive: true });
      copyFileSync(source, temporary);
      const retyped = retypeFloatKeys(temporary);
      renameSync(temporary, path);
      process.stderr.write(`prepared ${path} (${retyped.length ? `retyped ${retyped.join(', ')} to FLOAT32` : 'no retyping needed'}) ` +
        `in ${((performance.now() - started) / 1000).toFixed(1)} s\n`);
    } catch (error) {
      rmSync(temporary, { force: true });
      throw error;
    }
  }
  return { dtype, label, path, fileBytes: statSync(path).size };
}

/**
 * Rewrites integer-typed FLOAT32_KEYS values of the GGUF at `path` as FLOAT32 in place (the value and type fields
 * keep their sizes, so nothing moves). Returns the keys changed.
 */
export function retypeFloatKeys(path: string): string[] {
  const fd = openSync(path, 'r+');
  try {
    const header = Buffer.alloc(HEADER_SCAN_BYTES);
    const length = readSync(fd, header, 0, header.length, 0);
    const changed: string[] = [];
    for (const key of FLOAT32_KEYS) {
      const keyBytes = Buffer.from(key, 'utf8');
      const needle = Buffer.alloc(8 + keyBytes.length);
      needle.writeBigUInt64LE(BigInt(keyBytes.length), 0);
      keyBytes.copy(needle, 8);
      const at = header.subarray(0, length).indexOf(needle);
      if (at < 0) continue;
      const typeAt = at + needle.length;
      const type = header.readUInt32LE(typeAt);
      let value: number;
      if (type === GgufValueType.UINT32) value = header.readUInt32LE(typeAt + 4);
      else if (type === GgufValueType.INT32) value = header.readInt32LE(typeAt + 4);
      else continue; // already a float (or a type this patch cannot resize): leave it
      const patch = Buffer.alloc(8);
      patch.writeUInt32LE(GgufValueType.FLOAT32, 0);
      patch.writeFloatLE(value, 4);
      if (patch.readFloatLE(4) !== value) throw new Error(`${key} = ${value} is not exactly representable as FLOAT32`);
      writeSync(fd, patch, 0, 8, typeAt);
      changed.push(key);
    }
    return changed;
  } finally {
    closeSync(fd);
  }
}

if (process.argv[1] && fileURLToPath(import.meta.url) === process.argv[1]) {
  const wanted = process.argv.slice(2).map(parseBenchDtype);
  for (const dtype of wanted.length > 0 ? wanted : BENCH_MODEL_DTYPES) {
    const file = await ensureBenchModel(dtype);
    console.log(`${file.label.padEnd(22)} ${(file.fileBytes / 1e6).toFixed(1).padStart(7)} MB  ${file.path}`);
  }
}
