// A second process that times the same matmuls and model steps as the kernel benchmark under another environment,
// so that a kernel can be printed beside the one it replaces in the same run. The addon builds its kernel table once
// per process from the environment (CONDUIT_BF16_DOT=0 keeps the f32 kernel for BF16 weights), hence a process and
// not a flag. The benchmark alternates its own runs with the baseline's, one at a time, so that bursts of load from
// other processes hit both alike; the idle process waits on its pipe and takes no CPU.
//
// kernels.ts starts it with startBaseline(); run directly it serves requests from its parent over IPC.
import { fork, type ChildProcess } from 'node:child_process';
import { fileURLToPath } from 'node:url';

import type { GgmlType } from '../src/model/ggml-types.ts';
import { loadModel } from '../src/model/loader.ts';
import { loadNativeAddon, nativeModelSpec, type KernelVariant, type NativeAddon, type NativeModel } from '../src/kernels/native.ts';
import { kvPoolBytes, type ForwardBatch, type KvPoolLayout } from '../src/kernels/types.ts';
import { randomFloats, randomWeights, timeCall, type Timing } from './kernel-inputs.ts';

// ---------------------------------------------------------------------------------------------------------------
// Matmul cases

export interface MatmulCase {
  variant: KernelVariant;
  type: GgmlType;
  m: number;
  k: number;
  n: number;
  /** Weights in the variant's load-time packed layout (as a model streams them), not ggml rows. */
  packed: boolean;
  threads: number;
}

/** The case's inputs (the same seeds in every process) and a function running it once. */
export function matmulRunner(addon: NativeAddon, c: MatmulCase): () => void {
  const rows = randomWeights(c.type, c.k, c.n, c.n + c.type);
  const w = c.packed ? addon.ops.pack(c.variant, c.type, rows, c.k, c.n) : rows;
  const x = randomFloats(c.m * c.k, 7);
  const y = new Float32Array(c.m * c.n);
  return () => addon.ops.matmul(c.variant, c.type, w, x, c.m, c.k, c.n, y, c.threads, c.packed);
}

// ---------------------------------------------------------------------------------------------------------------
// Model steps: the 110M-class synthetic model, one sequence's prompt, single-stream and 16-stream decode.

export type ModelRun = 'prefill 512' | 'decode 1 stream' | 'decode 16 streams';
export const MODEL_RUNS: readonly ModelRun[] = ['prefill 512', 'decode 1 stream', 'decode 16 streams'];

const BLOCK_SIZE = 16, MAX_BLOCKS = 64, NUM_SEQS = 16, DECODE_STEPS = 32;

export class ModelSteps {
  private readonly model: NativeModel;
  private readonly vocabSize: number;
  private readonly logits: Float32Array;
  private step = 0;

  private constructor(addon: NativeAddon, loaded: Awaited<ReturnType<typeof loadModel>>, variant: KernelVariant,
    threads: number) {
    const { config, weights } = loaded;
    const layout: KvPoolLayout = {
      numLayers: config.numLayers, numBlocks: NUM_SEQS * MAX_BLOCKS, blockSize: BLOCK_SIZE,
      numKvHeads: config.numKvHeads, headDim: config.headDim, dtype: 'f16',
    };
    this.model = new addon.NativeModel(nativeModelSpec(config, weights,
      { layout, bytes: new Uint8Array(new SharedArrayBuffer(kvPoolBytes(layout))) }, variant, threads));
    this.vocabSize = config.vocabSize;
    this.logits = new Float32Array(NUM_SEQS * config.vocabSize);
    // Every stream's context, so that any run may come first: sequence 0 has the 512-token prompt, the others 128.
    this.forward([{ id: 0, start: 0, count: 512 }]);
    for (let s = 1; s < NUM_SEQS; s++) this.forward([{ id: s, start: 0, count: 128 }]);
  }

  static async load(addon: NativeAddon, path: string, variant: KernelVariant, threads: number): Promise<ModelSteps> {
    return new ModelSteps(addon, await loadModel(path), variant, threads);
  }

  /** Tokens per second of one run. */
  run(which: ModelRun): number {
    const start = performance.now();
    let tokens = 0;
    if (which === 'prefill 512') {
      this.forward([{ id: 0, start: 0, count: 512 }]);
      tokens = 512;
    } else if (which === 'decode 1 stream') {
      for (let i = 0; i < DECODE_STEPS; i++) this.forward([{ id: 0, start: 512 + i, count: 1 }]);
      tokens = DECODE_STEPS;
    } else {
      for (let i = 0; i < DECODE_STEPS; i++, this.step++) {
        this.forward(Array.from({ length: NUM_SEQS }, (_, s) => ({
          id: s, start: (s === 0 ? 512 + DECODE_STEPS : 128) + (this.step % 128), count: 1,
        })));
      }
      tokens = DECODE_STEPS * NUM_SEQS;
    }
    return tokens / ((performance.now() - start) / 1000);
  }

  dispose(): void {
    this.model.dispose();
  }

  // Sequence s owns pool blocks [s * MAX_BLOCKS, (s + 1) * MAX_BLOCKS), in order.
  private forward(seqs: { id: number; start: number; count: number }[]): void {
    const flat = seqs.flatMap((s) => Array.from({ length: s.count }, (_, i) => ({ s, p: s.start + i })));
    const queryStartLoc = new Int32Array(seqs.length + 1);
    seqs.forEach((s, i) => { queryStartLoc[i + 1] = queryStartLoc[i]! + s.count; });
    const batch: ForwardBatch = {
      numTokens: flat.length,
      tokenIds: Int32Array.from(flat, (r) => (r.p * 31 + r.s.id * 7) % this.vocabSize),
      positions: Int32Array.from(flat, (r) => r.p),
      slotMapping: Int32Array.from(flat, (r) => r.s.id * MAX_BLOCKS * BLOCK_SIZE + r.p),
      numSeqs: seqs.length, queryStartLoc,
      seqLens: Int32Array.from(seqs, (s) => s.start + s.count),
      blockTables: Int32Array.from(seqs.flatMap((s) => Array.from({ length: MAX_BLOCKS }, (_, b) => s.id * MAX_BLOCKS + b))),
      maxBlocksPerSeq: MAX_BLOCKS, logitsIndices: Int32Array.from(seqs, (_, i) => queryStartLoc[i + 1]! - 1),
    };
    this.model.forward(batch, this.logits);
  }
}

// ---------------------------------------------------------------------------------------------------------------
// The process and its client

type Request =
  | { op: 'matmul'; c: MatmulCase; minReps: number; minSeconds: number }
  | { op: 'loadModel'; path: string; variant: KernelVariant; threads: number }
  | { op: 'runModel'; which: ModelRun }
  | { op: 'kernelVariants'; variant: KernelVariant };

export interface Baseline {
  matmul(c: MatmulCase, minReps: number, minSeconds: number): Promise<Timing>;
  loadModel(path: string, variant: KernelVariant, threads: number): Promise<void>;
  runModel(which: ModelRun): Promise<number>;
  kernelVariants(variant: KernelVariant): Promise<Record<string, string>>;
  close(): void;
}

/** Starts the baseline process with `env` added to this one's environment. */
export function startBaseline(env: Record<string, string>): Baseline {
  const child: ChildProcess = fork(fileURLToPath(import.meta.url), ['--serve'], {
    env: { ...process.env, ...env }, execArgv: process.execArgv, stdio: ['ignore', 'inherit', 'inherit', 'ipc'],
  });
  let next = 0;
  const pending = new Map<number, { resolve: (v: unknown) => void; reject: (e: Error) => void }>();
  child.on('message', (msg: { id: number; result?: unknown; error?: string }) => {
    const p = pending.get(msg.id);
    pending.delete(msg.id);
    if (msg.error !== undefined) p?.reject(new Error(`baseline process: ${msg.error}`));
    else p?.resolve(msg.result);
  });
  child.on('exit', (code) => {
    for (const p of pending.values()) p.reject(new Error(`baseline process exited (${code})`));
    pending.clear();
  });
  const request = <T>(r: Request): Promise<T> => new Promise((resolve, reject) => {
    const id = next++;
    pending.set(id, { resolve: resolve as (v: unknown) => void, reject });
    child.send({ id, ...r });
  });
  return {
    matmul: (c, minReps, minSeconds) => request({ op: 'matmul', c, minReps, minSeconds }),
    loadModel: (path, variant, threads) => request({ op: 'loadModel', path, variant, threads }),
    runModel: (which) => request({ op: 'runModel', which }),
    kernelVariants: (variant) => request({ op: 'kernelVariants', variant }),
    close: () => { child.disconnect(); },
  };
}

async function serve(): Promise<void> {
  const addon = loadNativeAddon();
  let model: ModelSteps | undefined;
  // The last case's inputs: the benchmark asks for each case several times in a row.
  let last: { key: string; run: () => void } | undefined;
  process.on('message', async (msg: { id: number } & Request) => {
    try {
      let result: unknown;
      if (msg.op === 'matmul') {
        const key = JSON.stringify(msg.c);
        if (last?.key !== key) last = { key, run: matmulRunner(addon, msg.c) };
        result = timeCall(last.run, msg.minReps, msg.minSeconds);
      } else if (msg.op === 'loadModel') {
        model?.dispose();
        model = await ModelSteps.load(addon, msg.path, msg.variant, msg.threads);
      } else if (msg.op === 'runModel') {
        if (!model) throw new Error('no model loaded');
        result = model.run(msg.which);
      } else {
        result = addon.kernelVariants(msg.variant);
      }
      process.send!({ id: msg.id, result });
    } catch (e) {
      process.send!({ id: msg.id, error: (e as Error).message });
    }
  });
  process.on('disconnect', () => {
    model?.dispose();
    process.exit(0);
  });
}

if (process.argv.includes('--serve') && process.send) await serve();
