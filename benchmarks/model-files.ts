// The models the model-level benchmarks run: the synthetic 110M-class Llama (dim 768, 12 layers, 12 heads / 4 KV
// heads, FFN 2048, the Llama 2 vocabulary of 32000) in F32 and in Q8_0, written by the project's own GGUF writer
// and cached, so Conduit and llama.cpp read the very same file and nothing is downloaded.
//
//   node --import tsx benchmarks/model-files.ts [F32] [Q8_0]     prints the paths, generating what is missing
//
// Files live in <cache>/bench/ (cache: CONDUIT_CACHE_DIR, default ~/.cache/conduit). The first F32 generation
// writes ~400 MB; later calls only check the spec hash stored in the file.

import { execFileSync } from 'node:child_process';
import { existsSync, renameSync, rmSync, statSync } from 'node:fs';
import { dirname, join } from 'node:path';
import { fileURLToPath } from 'node:url';

import {
  defaultCacheDir, ensureSyntheticModel, synthetic110mSpec, SYNTHETIC_110M_F32, SYNTHETIC_110M_Q8_0,
} from '../src/model/synthetic.ts';
import type { SyntheticModelSpec } from '../src/model/synthetic.ts';

export type BenchModelDtype = 'F32' | 'Q8_0';

export const BENCH_MODEL_DTYPES: readonly BenchModelDtype[] = ['Q8_0', 'F32'];

export const BENCH_MODEL_SPECS: Readonly<Record<BenchModelDtype, SyntheticModelSpec>> = {
  F32: SYNTHETIC_110M_F32,
  Q8_0: SYNTHETIC_110M_Q8_0,
};

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

/** The benchmark GGUF for `dtype`, generated into the benchmark directory on first use. Progress goes to stderr. */
export async function ensureBenchModel(dtype: BenchModelDtype, cacheDir = defaultCacheDir()): Promise<BenchModelFile> {
  const spec = BENCH_MODEL_SPECS[dtype];
  const started = performance.now();
  const path = await ensureSyntheticModel(spec, benchModelDir(cacheDir));
  const seconds = (performance.now() - started) / 1000;
  if (seconds > 1) process.stderr.write(`prepared ${path} in ${seconds.toFixed(1)} s\n`);
  return { dtype, label: `${spec.name} ${dtype}`, path, fileBytes: statSync(path).size };
}

// ---------------------------------------------------------------------------------------------------------------
// Files made by llama.cpp's llama-quantize (bench:peer, and tests that check Conduit on llama.cpp's own encodings)

/**
 * The 110M spec with room for the long-context rows: 32768 tokens, so a row at 16384 tokens of context plus the
 * tokens it decodes fits on both engines; the same weights as SYNTHETIC_110M_F32.
 */
export const LONG_CONTEXT_110M: SyntheticModelSpec = { ...synthetic110mSpec('F32'), name: 'synthetic-110m-32k', contextLength: 32768 };

const REPO = fileURLToPath(new URL('../', import.meta.url));

/** llama.cpp's binaries: CONDUIT_LLAMA_CPP_BIN, else where scripts/build-llama-cpp.sh builds them. */
export function llamaCppBinDir(): string {
  return process.env.CONDUIT_LLAMA_CPP_BIN ?? join(REPO, 'benchmarks/peer/llama.cpp/build/bin');
}

/** Why llama-quantize cannot run here, or undefined when it can. */
export function llamaQuantizeMissing(binDir = llamaCppBinDir()): string | undefined {
  const tool = join(binDir, 'llama-quantize');
  return existsSync(tool) ? undefined : `${tool} not found (build llama.cpp with scripts/build-llama-cpp.sh, or set CONDUIT_LLAMA_CPP_BIN)`;
}

/**
 * `type` (a llama-quantize type name: Q8_0, Q4_K_M, Q5_K_M, Q6_K, ...) made by llama-quantize from the F32 GGUF at
 * `f32Path`, cached beside it as <name>-<type>.llama-quantize.gguf and remade when the F32 file is newer.
 */
export function ensureLlamaQuantized(f32Path: string, type: string, binDir = llamaCppBinDir(), threads = 2): string {
  const path = join(dirname(f32Path), `${f32Path.replace(/^.*\//, '').replace(/-F32\.gguf$/, '')}-${type}.llama-quantize.gguf`);
  if (existsSync(path) && statSync(path).mtimeMs >= statSync(f32Path).mtimeMs) return path;
  const temporary = `${path}.${process.pid}.tmp`;
  try {
    execFileSync(join(binDir, 'llama-quantize'), [f32Path, temporary, type, String(threads)], { stdio: ['ignore', 'ignore', 'pipe'] });
    renameSync(temporary, path);
  } catch (error) {
    rmSync(temporary, { force: true });
    throw error;
  }
  return path;
}

if (process.argv[1] && fileURLToPath(import.meta.url) === process.argv[1]) {
  const wanted = process.argv.slice(2).map(parseBenchDtype);
  for (const dtype of wanted.length > 0 ? wanted : BENCH_MODEL_DTYPES) {
    const file = await ensureBenchModel(dtype);
    console.log(`${file.label.padEnd(22)} ${(file.fileBytes / 1e6).toFixed(1).padStart(7)} MB  ${file.path}`);
  }
}
