// Stress program for the native addon, meant to run under the sanitizer builds (npm run build:native --
// --sanitize=address|thread). The driver (this file without --role) runs child processes with the sanitizer runtime
// preloaded, reads their stderr and exits non-zero when a sanitizer reported anything, a child failed, or a result
// check failed. Children:
//   --role=steps      random engine steps on several models: 1..8 sequences per batch, prefill chunks and decode
//                     rows mixed, shuffled pool blocks, 1-4 threads, kernel variants at random, packed weights or
//                     ggml rows, LoRA adapters on some instances (rows of up to two adapters and of the base model
//                     mixed), a new model (and thread pool) every few dozen steps, the old one disposed. Results are
//                     checked for batch invariance (a sequence's logits in the mixed batch equal, bit for bit, those
//                     of its whole history run alone as one prefill on another model instance with another thread
//                     count), and on the small models against the TypeScript reference forward; the sampler's
//                     prompt-logprob pass and batched random draws on each instance's threads against the
//                     TypeScript sampler, bit for bit.
//   --role=terminate  worker_threads running forward passes (and the ops pools) are terminated at random moments
//                     while a native call runs, each worker loading and disposing its own models; the survivors'
//                     logits must stay equal to the first run's.
//
//   node --import tsx benchmarks/native-stress.ts [--sanitize=address,thread|none] [--build] [--steps N] [--rounds N]
//       [--big-steps N|address=N,thread=M] [--terminations N] [--threads 1,2,3,4] [--models list] [--seed N]
//       [--addon PATH] [--cache-dir DIR]
// --build builds the sanitized addons first when stale; --addon runs another build (e.g. a scratch tree's).
// Models: odd (random, odd vocabulary, 3 heads, F32/F16/BF16/Q8_0/Q4_0 at random), kquant (random, rows of 256,
// each matrix Q4_K/Q5_K/Q6_K at random, as Q4_K_M mixes them), moe (a random mixture of experts: 3-6 experts, 1-3
// per token, expert sizes that cut the kernel tiles short, float or 32-block types, or K-quants on rows of 256),
// stories260K (../shared/models, skipped when absent), builtin (the built-in 22M synthetic model), 110m-like (the
// 110M synthetic model's shapes, 2 layers, written with the repository's GGUF writer).
import { spawn, spawnSync } from 'node:child_process';
import { existsSync, mkdirSync } from 'node:fs';
import { cpus, tmpdir } from 'node:os';
import { dirname, join, resolve } from 'node:path';
import { fileURLToPath } from 'node:url';
import { isMainThread, parentPort, Worker, workerData } from 'node:worker_threads';

const root = resolve(dirname(fileURLToPath(import.meta.url)), '..');
const DEFAULT_MODELS = 'odd,kquant,moe,stories260K,builtin,110m-like';

// ---------------------------------------------------------------------------------------------------------------
// Arguments

function argValue(name: string, fallback: string): string {
  const prefix = `--${name}=`;
  const i = process.argv.findIndex((a) => a === `--${name}` || a.startsWith(prefix));
  if (i < 0) return fallback;
  const a = process.argv[i]!;
  return a.startsWith(prefix) ? a.slice(prefix.length) : (process.argv[i + 1] ?? fallback);
}

// ---------------------------------------------------------------------------------------------------------------
// Driver

type Sanitizer = 'address' | 'thread' | 'none';

/** A runtime library's path as the compiler that built the addon links it. */
function runtimeLibrary(name: string): string {
  const r = spawnSync('gcc', [`-print-file-name=${name}`], { encoding: 'utf8' });
  const path = r.stdout?.trim();
  if (!path || !existsSync(path)) {
    throw new Error(`${name} not found (gcc -print-file-name); install GCC's sanitizer runtimes`);
  }
  return path;
}

// Sanitizer findings as they appear on stderr; each counts once per report.
const FINDING_PATTERNS: { name: string; pattern: RegExp }[] = [
  { name: 'AddressSanitizer', pattern: /^==\d+==ERROR: AddressSanitizer/gm },
  { name: 'LeakSanitizer', pattern: /^==\d+==ERROR: LeakSanitizer/gm },
  { name: 'UndefinedBehaviorSanitizer', pattern: /runtime error: /gm },
  { name: 'ThreadSanitizer', pattern: /^WARNING: ThreadSanitizer: /gm },
  { name: 'ThreadSanitizer (fatal)', pattern: /^(==\d+==)?FATAL: ThreadSanitizer/gm },
  { name: 'crash handler', pattern: /conduit: FATAL native error/gm },
];

/**
 * The environment of a sanitized child:
 * - LD_PRELOAD: the runtime must be loaded before everything else (node itself is not instrumented, so nothing
 *   else would load it first; ASan refuses to start otherwise, TSan would miss the allocations and threads made
 *   before the addon loads).
 * - ASAN_OPTIONS detect_leaks=0: node and V8 keep allocations alive until exit on purpose (isolates, the
 *   platform's worker threads, terminated workers' heaps), so LeakSanitizer reports hundreds of leaks that are not
 *   the addon's at every exit; the addon's own lifetimes are checked by ASan (use-after-free, double free) instead.
 * - UBSAN_OPTIONS print_stacktrace=1: where the undefined behaviour happened; halt_on_error=0 so every finding
 *   of a run is reported (the driver counts them and fails the run).
 * - TSAN_OPTIONS halt_on_error=0, report_signal_unsafe=0: node's own signal handling calls malloc in handlers
 *   (not the addon's concern); second_deadlock_stack=1 for full lock-order reports. No suppressions are needed:
 *   node is not instrumented, so TSan sees only the addon's accesses (and the intercepted libc calls).
 */
function sanitizerEnv(kind: Sanitizer): NodeJS.ProcessEnv {
  if (kind === 'address') {
    return {
      LD_PRELOAD: `${runtimeLibrary('libasan.so')} ${runtimeLibrary('libubsan.so')}`,
      ASAN_OPTIONS: 'detect_leaks=0:halt_on_error=1:abort_on_error=0:print_summary=1',
      UBSAN_OPTIONS: 'print_stacktrace=1:halt_on_error=0',
    };
  }
  if (kind === 'thread') {
    return {
      LD_PRELOAD: runtimeLibrary('libtsan.so'),
      TSAN_OPTIONS: 'halt_on_error=0:report_signal_unsafe=0:second_deadlock_stack=1:ignore_noninstrumented_modules=1',
    };
  }
  return {};
}

function addonPath(kind: Sanitizer): string {
  const explicit = argValue('addon', '');
  if (explicit) return resolve(explicit);
  return kind === 'none' ? join(root, 'build', 'Release', 'conduit_native.node')
    : join(root, 'build-sanitize', kind, 'build', 'Release', 'conduit_native.node');
}

interface ChildResult {
  label: string;
  seconds: number;
  code: number | null;
  signal: string | null;
  findings: Map<string, number>;
  summary: string[];
  stdout: string;
}

function runChild(label: string, args: string[], env: NodeJS.ProcessEnv): Promise<ChildResult> {
  const started = performance.now();
  return new Promise((resolvePromise) => {
    const child = spawn(process.execPath, ['--import', 'tsx', fileURLToPath(import.meta.url), ...args],
      { env: { ...process.env, ...env }, stdio: ['ignore', 'pipe', 'pipe'] });
    let stdout = '';
    let stderr = '';
    child.stdout.on('data', (d: Buffer) => {
      stdout += d.toString();
      process.stdout.write(`  [${label}] ${d.toString().replace(/\n(?=.)/g, `\n  [${label}] `)}`);
    });
    child.stderr.on('data', (d: Buffer) => { stderr += d.toString(); process.stderr.write(d); });
    child.on('close', (code, signal) => {
      const findings = new Map<string, number>();
      for (const { name, pattern } of FINDING_PATTERNS) {
        const n = stderr.match(pattern)?.length ?? 0;
        if (n > 0) findings.set(name, n);
      }
      const summary = stderr.split('\n').filter((l) => /^SUMMARY: \w+Sanitizer|runtime error: /.test(l));
      resolvePromise({ label, seconds: (performance.now() - started) / 1000, code, signal, findings, summary, stdout });
    });
  });
}

async function driver(): Promise<void> {
  const kinds = argValue('sanitize', 'none').split(',') as Sanitizer[];
  for (const kind of kinds) {
    if (!['address', 'thread', 'none'].includes(kind)) throw new Error(`--sanitize must list address, thread or none`);
  }
  const steps = argValue('steps', '2000');
  const rounds = argValue('rounds', '40');
  const terminations = argValue('terminations', '40');
  const threads = argValue('threads', '1,2,3,4');
  const models = argValue('models', DEFAULT_MODELS);
  const seed = argValue('seed', String(Date.now() % 1_000_000));
  const cacheDir = argValue('cache-dir', join(tmpdir(), 'conduit-stress-models'));
  // Steps of each big model (builtin, 110m-like): N, or per sanitizer as address=N,thread=M (default steps / 10).
  const bigStepsArg = argValue('big-steps', '');
  const bigStepsFor = (kind: Sanitizer): number => {
    const fallback = Math.ceil(Number(steps) / 10);
    if (!bigStepsArg.includes('=')) return bigStepsArg ? Number(bigStepsArg) : fallback;
    const entry = bigStepsArg.split(',').map((e) => e.split('=')).find(([k]) => k === kind);
    return entry ? Number(entry[1]) : fallback;
  };
  const common = [`--seed=${seed}`, `--threads=${threads}`, `--cache-dir=${cacheDir}`];
  console.log(`native stress: sanitizers ${kinds.join(', ')}; models ${models}: ${steps} steps over the small ones, ` +
    `${kinds.map((k) => `${k} ${bigStepsFor(k)}`).join(', ')} on each big one, a new model instance every ` +
    `${rounds} steps, ${terminations} rounds of worker terminations, threads ${threads}, seed ${seed} ` +
    `(--seed ${seed} repeats this run), ${cpus().length} CPUs`);

  // Model files are written by an uninstrumented child first (slow under a sanitizer and not what is under test).
  const prep = spawnSync(process.execPath, ['--import', 'tsx', fileURLToPath(import.meta.url), '--role=prepare',
    `--models=${models}`, `--cache-dir=${cacheDir}`], { stdio: 'inherit' });
  if (prep.status !== 0) throw new Error('preparing the model files failed');

  const results: (ChildResult & { kind: Sanitizer })[] = [];
  for (const kind of kinds) {
    if (process.argv.includes('--build') && kind !== 'none' && !argValue('addon', '')) {
      // Rebuilds only when a source is newer than the sanitized addon.
      const b = spawnSync(process.execPath, [join(root, 'scripts', 'build-native.js'), `--sanitize=${kind}`],
        { stdio: 'inherit' });
      if (b.status !== 0) throw new Error(`building the ${kind} sanitizer addon failed`);
    }
    const addon = addonPath(kind);
    if (!existsSync(addon)) {
      const how = kind === 'none' ? '' : ` -- --sanitize=${kind}`;
      throw new Error(`${addon} is missing: build it with npm run build:native${how} (or pass --build)`);
    }
    console.log(`\n== sanitizer ${kind}: ${addon}`);
    const env = { ...sanitizerEnv(kind), CONDUIT_NATIVE_ADDON: addon };
    const stepArgs = ['--role=steps', `--steps=${steps}`, `--rounds=${rounds}`, `--models=${models}`,
      `--big-steps=${bigStepsFor(kind)}`, ...common];
    results.push({ kind, ...await runChild(`${kind} steps`, stepArgs, env) });
    const terminateArgs = ['--role=terminate', `--terminations=${terminations}`, ...common];
    results.push({ kind, ...await runChild(`${kind} terminate`, terminateArgs, env) });
  }

  let failed = false;
  console.log(`\nnative stress summary (seed ${seed}):`);
  for (const r of results) {
    const findings = [...r.findings].map(([n, c]) => `${c} ${n}`).join(', ') || 'none';
    const ok = r.code === 0 && r.signal === null && r.findings.size === 0 && /^PASS/m.test(r.stdout);
    failed ||= !ok;
    console.log(`  ${r.label}: ${ok ? 'ok' : 'FAILED'} in ${r.seconds.toFixed(1)} s; exit ${r.signal ?? r.code}; ` +
      `sanitizer findings: ${findings}`);
    for (const line of [...new Set(r.summary)].slice(0, 20)) console.log(`    ${line}`);
  }
  console.log(failed ? 'native stress FAILED' : 'native stress passed: zero sanitizer findings, all checks held');
  process.exit(failed ? 1 : 0);
}

// ---------------------------------------------------------------------------------------------------------------
// Models

interface Loaded {
  name: string;
  config: import('../src/model/config.ts').ModelConfig;
  weights: import('../src/model/weights.ts').ModelWeights;
  /** Small enough for the TypeScript reference forward and many steps. */
  small: boolean;
}

const SPEC_110M_LIKE = async () => {
  const { synthetic110mSpec } = await import('../src/model/synthetic.ts');
  // The 110M model's shapes (dim 768, 12 heads over 4 KV heads, FFN 2048, the Llama vocabulary) with 2 layers.
  return { ...synthetic110mSpec('Q8_0'), name: 'stress-110m-like-2l', numLayers: 2 };
};

async function modelFile(name: string, cacheDir: string): Promise<string | undefined> {
  const synthetic = await import('../src/model/synthetic.ts');
  if (name === 'builtin') return synthetic.ensureBuiltinModel(cacheDir);
  if (name === '110m-like') return synthetic.ensureSyntheticModel(await SPEC_110M_LIKE(), cacheDir);
  if (name === 'stories260K') {
    const dir = process.env.CONDUIT_SHARED_MODELS ?? join(root, '..', 'shared', 'models');
    const path = join(dir, 'stories260K.gguf');
    return existsSync(path) ? path : undefined;
  }
  return undefined;
}

/** A random model with odd shapes: vocabulary 77, 3 query heads over 1 KV head, RoPE style and biases at random. */
async function oddModel(rand: () => number): Promise<Loaded> {
  const { GgmlType } = await import('../src/model/ggml-types.ts');
  const { quantize } = await import('../src/model/quant.ts');
  const types = [GgmlType.F32, GgmlType.F16, GgmlType.BF16, GgmlType.Q8_0, GgmlType.Q4_0];
  const type = types[Math.floor(rand() * types.length)]!;
  const numHeads = 3, numKvHeads = 1, headDim = 32, dim = numHeads * headDim, ffnDim = 160, vocab = 77;
  const qkvBias = rand() < 0.5;
  const config = {
    architecture: qkvBias ? 'qwen2' : 'llama', name: 'odd', vocabSize: vocab, dim, numLayers: 2, numHeads, numKvHeads,
    headDim, ffnDim, contextLength: 512, rmsNormEps: 1e-5, ropeTheta: 10000, ropeDim: headDim,
    ropeStyle: rand() < 0.5 ? 'neox' : 'interleaved', qkvBias, tiedEmbeddings: false,
  } as Loaded['config'];
  const values = (n: number, scale: number) => Float32Array.from({ length: n }, () => (rand() * 2 - 1) * scale);
  const tensor = (name: string, t: number, cols: number, rows: number, scale: number) => ({
    name, type: t, shape: rows === 1 ? [cols] : [cols, rows], data: quantize(t, values(cols * rows, scale)),
  });
  const norm = (name: string) => {
    const v = Float32Array.from({ length: dim }, () => 1 + (rand() - 0.5) * 0.2);
    return { name, type: GgmlType.F32, shape: [dim], data: new Uint8Array(v.buffer) };
  };
  const layers = Array.from({ length: config.numLayers }, (_, l) => ({
    attnNorm: norm(`blk.${l}.attn_norm`),
    wq: tensor('wq', type, dim, dim, Math.sqrt(3 / dim)),
    wk: tensor('wk', type, dim, numKvHeads * headDim, Math.sqrt(3 / dim)),
    wv: tensor('wv', type, dim, numKvHeads * headDim, Math.sqrt(3 / dim)),
    wo: tensor('wo', type, dim, dim, Math.sqrt(3 / dim)),
    ...(qkvBias ? {
      bq: tensor('bq', GgmlType.F32, dim, 1, 0.5), bk: tensor('bk', GgmlType.F32, headDim, 1, 0.5),
      bv: tensor('bv', GgmlType.F32, headDim, 1, 0.5),
    } : {}),
    ffnNorm: norm(`blk.${l}.ffn_norm`),
    wGate: tensor('wg', type, dim, ffnDim, Math.sqrt(3 / dim)),
    wUp: tensor('wu', type, dim, ffnDim, Math.sqrt(3 / dim)),
    wDown: tensor('wd', type, ffnDim, dim, Math.sqrt(3 / ffnDim)),
  }));
  const weights = {
    tokenEmbedding: tensor('token_embd', type, dim, vocab, 1), layers, outputNorm: norm('output_norm'),
    output: tensor('output', type, dim, vocab, Math.sqrt(3 / dim)),
  } as unknown as Loaded['weights'];
  const name = `odd(${GgmlType[type]}${qkvBias ? ', qkv bias' : ''}, ${config.ropeStyle})`;
  return { name, config, weights, small: true };
}

/** Random weights of a shape in a type, as a Tensor (ggml shape: columns first). */
async function randomTensor(rand: () => number, type: number, shape: number[], scale: number) {
  const { quantize } = await import('../src/model/quant.ts');
  const n = shape.reduce((a, b) => a * b, 1);
  return { name: 'w', type, shape, data: quantize(type, Float32Array.from({ length: n }, () => (rand() * 2 - 1) * scale)) };
}

function normTensor(rand: () => number, n: number) {
  const v = Float32Array.from({ length: n }, () => 1 + (rand() - 0.5) * 0.2);
  return { name: 'norm', type: 0, shape: [n], data: new Uint8Array(v.buffer) };
}

/**
 * A random Llama-layout model with rows of 256 in K-quants, each matrix Q4_K, Q5_K or Q6_K at random (the embedding
 * too): the K-quant kernels, packed and on ggml rows, beside each other in one forward.
 */
async function kquantModel(rand: () => number): Promise<Loaded> {
  const { GgmlType } = await import('../src/model/ggml-types.ts');
  const kinds = [GgmlType.Q4_K, GgmlType.Q5_K, GgmlType.Q6_K];
  const pick = () => kinds[Math.floor(rand() * kinds.length)]!;
  const numHeads = 4, numKvHeads = 2, headDim = 64, dim = 256, vocab = 77;
  const ffnDim = rand() < 0.5 ? 256 : 512;
  const config = {
    architecture: 'llama', name: 'kquant', vocabSize: vocab, dim, numLayers: 2, numHeads, numKvHeads, headDim, ffnDim,
    contextLength: 512, rmsNormEps: 1e-5, ropeTheta: 10000, ropeDim: headDim, ropeStyle: 'neox', qkvBias: false,
    tiedEmbeddings: false,
  } as Loaded['config'];
  const used = new Set<string>();
  const t = async (cols: number, rows: number, scale: number) => {
    const type = pick();
    used.add(GgmlType[type]!);
    return randomTensor(rand, type, [cols, rows], scale);
  };
  const layers = [];
  for (let l = 0; l < config.numLayers; l++) {
    layers.push({
      attnNorm: normTensor(rand, dim),
      wq: await t(dim, dim, Math.sqrt(3 / dim)), wk: await t(dim, numKvHeads * headDim, Math.sqrt(3 / dim)),
      wv: await t(dim, numKvHeads * headDim, Math.sqrt(3 / dim)), wo: await t(dim, dim, Math.sqrt(3 / dim)),
      ffnNorm: normTensor(rand, dim),
      wGate: await t(dim, ffnDim, Math.sqrt(3 / dim)), wUp: await t(dim, ffnDim, Math.sqrt(3 / dim)),
      wDown: await t(ffnDim, dim, Math.sqrt(3 / ffnDim)),
    });
  }
  const weights = {
    tokenEmbedding: await t(dim, vocab, 1), layers, outputNorm: normTensor(rand, dim),
    output: await t(dim, vocab, Math.sqrt(3 / dim)),
  } as unknown as Loaded['weights'];
  return { name: `kquant(${[...used].sort().join('/')}, ffn ${ffnDim})`, config, weights, small: true };
}

/**
 * A random mixture of experts: 3-6 experts, 1-3 per token, top-k renormalized or not, expert sizes that leave the
 * kernels' 64-row tiles short (32, 96, 160) over a hidden size of 96 in F32/F16/BF16/Q8_0/Q4_0, or rows of 256 in
 * K-quants. The router is scaled up so that the top-k is far from ties (the reference check compares logits).
 */
async function moeModel(rand: () => number): Promise<Loaded> {
  const { GgmlType } = await import('../src/model/ggml-types.ts');
  const kquant = rand() < 0.35;
  const kinds = kquant ? [GgmlType.Q4_K, GgmlType.Q5_K, GgmlType.Q6_K]
    : [GgmlType.F32, GgmlType.F16, GgmlType.BF16, GgmlType.Q8_0, GgmlType.Q4_0];
  const type = kinds[Math.floor(rand() * kinds.length)]!;
  const numHeads = kquant ? 4 : 3, numKvHeads = 1, headDim = kquant ? 64 : 32, dim = numHeads * headDim, vocab = 77;
  const numExperts = 3 + Math.floor(rand() * 4);
  const numExpertsUsed = 1 + Math.floor(rand() * Math.min(3, numExperts));
  const expertFfnDim = kquant ? 256 : [32, 96, 160][Math.floor(rand() * 3)]!;
  const normalizeTopK = rand() < 0.5;
  const config = {
    architecture: 'llama', name: 'moe', vocabSize: vocab, dim, numLayers: 2, numHeads, numKvHeads, headDim,
    ffnDim: expertFfnDim * numExpertsUsed, contextLength: 512, rmsNormEps: 1e-5, ropeTheta: 10000, ropeDim: headDim,
    ropeStyle: 'interleaved', qkvBias: false, tiedEmbeddings: false,
    moe: { numExperts, numExpertsUsed, expertFfnDim, normalizeTopK },
  } as Loaded['config'];
  const s = (n: number) => Math.sqrt(3 / n);
  const layers = [];
  for (let l = 0; l < config.numLayers; l++) {
    layers.push({
      attnNorm: normTensor(rand, dim),
      wq: await randomTensor(rand, type, [dim, dim], s(dim)),
      wk: await randomTensor(rand, type, [dim, numKvHeads * headDim], s(dim)),
      wv: await randomTensor(rand, type, [dim, numKvHeads * headDim], s(dim)),
      wo: await randomTensor(rand, type, [dim, dim], s(dim)),
      ffnNorm: normTensor(rand, dim),
      ffnGateInp: await randomTensor(rand, GgmlType.F32, [dim, numExperts], 8 * s(dim)),
      wGate: await randomTensor(rand, type, [dim, expertFfnDim, numExperts], s(dim)),
      wUp: await randomTensor(rand, type, [dim, expertFfnDim, numExperts], s(dim)),
      wDown: await randomTensor(rand, type, [expertFfnDim, dim, numExperts], s(expertFfnDim)),
    });
  }
  const weights = {
    tokenEmbedding: await randomTensor(rand, type, [dim, vocab], 1), layers, outputNorm: normTensor(rand, dim),
    output: await randomTensor(rand, type, [dim, vocab], s(dim)),
  } as unknown as Loaded['weights'];
  const name = `moe(${GgmlType[type]}, ${numExperts} experts x ${expertFfnDim}, ${numExpertsUsed} per token` +
    `${normalizeTopK ? ', renormalized' : ''})`;
  return { name, config, weights, small: true };
}

/**
 * A random LoRA adapter for some of the model's projections (attention only on a mixture of experts: adapters of
 * its experts are refused), rank 1-8.
 */
async function randomLora(config: Loaded['config'], rand: () => number) {
  const { LORA_TARGETS, loraTargetShape } = await import('../src/model/lora.ts');
  const targets = LORA_TARGETS.filter((t) => (!config.moe || ['wq', 'wk', 'wv', 'wo'].includes(t)) && rand() < 0.6);
  if (targets.length === 0) targets.push('wq');
  const values = (n: number, scale: number) => Float32Array.from({ length: n }, () => (rand() * 2 - 1) * scale);
  const layers = Array.from({ length: config.numLayers }, () => {
    const layer: Record<string, { rank: number; a: Float32Array; b: Float32Array }> = {};
    for (const target of targets) {
      if (rand() < 0.2) continue;
      const [inDim, outDim] = loraTargetShape(config, target);
      const rank = 1 + Math.floor(rand() * 8);
      layer[target] = { rank, a: values(rank * inDim, 1 / Math.sqrt(inDim)), b: values(outDim * rank, 0.5) };
    }
    return layer;
  });
  return { scale: 0.5 + rand(), layers } as import('../src/model/lora.ts').LoraWeights;
}

async function loadNamed(name: string, cacheDir: string, rand: () => number): Promise<Loaded | undefined> {
  if (name === 'odd') return oddModel(rand);
  if (name === 'kquant') return kquantModel(rand);
  if (name === 'moe') return moeModel(rand);
  const path = await modelFile(name, cacheDir);
  if (!path) return undefined;
  const { loadModel } = await import('../src/model/loader.ts');
  const m = await loadModel(path);
  return { name, config: m.config, weights: m.weights, small: name === 'stories260K' };
}

// ---------------------------------------------------------------------------------------------------------------
// Random engine steps

interface Seq { tokens: number[]; cached: number; promptLen: number; targetLen: number; blocks: number[]; lora: number }

function nmse(actual: Float32Array, expected: Float32Array): number {
  let err = 0, ref = 0;
  for (let i = 0; i < expected.length; i++) {
    const d = actual[i]! - expected[i]!;
    err += d * d;
    ref += expected[i]! * expected[i]!;
  }
  return Number.isFinite(err) ? (ref === 0 ? err : err / ref) : Infinity;
}

async function stepsRole(): Promise<void> {
  const { seededRandom } = await import('../src/util/random.ts');
  const { nativeModelSpec, loadNativeAddon, supportedVariants } = await import('../src/kernels/native.ts');
  const { referenceBackend } = await import('../src/kernels/reference-backend.ts');
  const { kvPoolBytes } = await import('../src/kernels/types.ts');
  const seed = Number(argValue('seed', '1'));
  const totalSteps = Number(argValue('steps', '2000'));
  const roundSteps = Number(argValue('rounds', '40'));
  const threadChoices = argValue('threads', '1,2,3,4').split(',').map(Number);
  const cacheDir = argValue('cache-dir', join(tmpdir(), 'conduit-stress-models'));
  const rand = seededRandom(seed);
  const pick = <T>(xs: readonly T[]): T => xs[Math.floor(rand() * xs.length)]!;
  const int = (lo: number, hi: number) => lo + Math.floor(rand() * (hi - lo + 1)); // inclusive
  const addon = loadNativeAddon();
  const variants = supportedVariants(addon.cpuInfo());

  const models: Loaded[] = [];
  for (const name of argValue('models', DEFAULT_MODELS).split(',')) {
    const m = await loadNamed(name, cacheDir, rand);
    if (m) models.push(m);
    else console.log(`skipping ${name}: not available (../shared/models absent?)`);
  }
  // Big models get fewer steps (their steps cost more), small ones more.
  // The small models share --steps; each big one (a step costs ~100x more, far more under TSan) runs --big-steps.
  const bigSteps = Number(argValue('big-steps', String(Math.ceil(totalSteps / 10))));
  const smallModels = models.filter((m) => m.small).length;
  let checks = 0, referenceChecks = 0, stepsRun = 0, rows = 0, instances = 0, loraInstances = 0, loraRows = 0;

  for (const model of models) {
    const modelSteps = model.small ? Math.ceil(totalSteps / smallModels) : bigSteps;
    const started = performance.now();
    const { config, weights } = model;
    // The K-quant models' steps cost several times the others' under a sanitizer: shorter sequences.
    const maxLen = !model.small ? 48 : /Q[456]_K/.test(model.name) ? 64 : 160;
    for (let done = 0; done < modelSteps;) {
      // A new model instance (and thread pool) per round; the previous one is disposed.
      const variant = pick(variants);
      const threads = pick(threadChoices);
      const shadowThreads = pick(threadChoices);
      const blockSize = pick([4, 8, 16]);
      const maxSeqs = int(1, model.small ? 8 : 4);
      const maxBlocksPerSeq = Math.ceil(maxLen / blockSize);
      const numBlocks = maxSeqs * maxBlocksPerSeq + int(0, 5);
      const dtype = pick(['f32', 'f16'] as const);
      const layout = {
        numLayers: config.numLayers, numBlocks, blockSize, numKvHeads: config.numKvHeads, headDim: config.headDim,
        dtype,
      };
      const make = (t: number, blocks: number) => {
        const l = { ...layout, numBlocks: blocks };
        const bytes = new Uint8Array(new SharedArrayBuffer(kvPoolBytes(l)));
        const spec = nativeModelSpec(config, weights, { layout: l, bytes }, variant, t);
        return new addon.NativeModel({ ...spec, packWeights: rand() < 0.7 });
      };
      const native = make(threads, numBlocks);
      const shadow = make(shadowThreads, maxBlocksPerSeq);
      instances += 2;
      // LoRA on some instances: adapters in slots 0 and 2 (slot 1 left empty), the same on the shadow instance.
      const adapters = new Map<number, import('../src/model/lora.ts').LoraWeights>();
      if (rand() < 0.35) {
        for (const slot of rand() < 0.5 ? [0] : [0, 2]) adapters.set(slot, await randomLora(config, rand));
        for (const [slot, adapter] of adapters) {
          native.setLora(slot, adapter);
          shadow.setLora(slot, adapter);
        }
        loraInstances++;
      }
      const slotChoices = [-1, ...adapters.keys()];
      const free = Array.from({ length: numBlocks }, (_, i) => i).sort(() => rand() - 0.5);
      const live: Seq[] = [];
      const steps = Math.min(roundSteps, modelSteps - done);
      for (let s = 0; s < steps; s++) {
        while (live.length < maxSeqs && rand() < 0.6) {
          const targetLen = int(2, maxLen);
          live.push({ tokens: [], cached: 0, promptLen: int(1, targetLen - 1), targetLen, blocks: [], lora: pick(slotChoices) });
        }
        if (live.length === 0) continue;
        // Scheduled sequences and their new tokens: the rest of a chunk of the prompt, or one decode token.
        const scheduled = live.filter(() => rand() < 0.8);
        if (scheduled.length === 0) scheduled.push(live[0]!);
        const tokenIds: number[] = [], positions: number[] = [], slots: number[] = [], seqLens: number[] = [];
        const loraSlots: number[] = [];
        const qsl = [0];
        const table = new Int32Array(scheduled.length * maxBlocksPerSeq).fill(-1);
        for (const [i, q] of scheduled.entries()) {
          const n = q.cached < q.promptLen ? int(1, q.promptLen - q.cached) : 1;
          for (let k = 0; k < n; k++) {
            const pos = q.cached + k;
            if (pos === q.tokens.length) q.tokens.push(int(0, config.vocabSize - 1));
            while (q.blocks.length * blockSize <= pos) q.blocks.push(free.pop()!);
            tokenIds.push(q.tokens[pos]!);
            loraSlots.push(q.lora);
            positions.push(pos);
            slots.push(q.blocks[Math.floor(pos / blockSize)]! * blockSize + (pos % blockSize));
          }
          q.cached += n;
          qsl.push(tokenIds.length);
          seqLens.push(q.cached);
          table.set(q.blocks, i * maxBlocksPerSeq);
        }
        const batch = {
          numTokens: tokenIds.length, tokenIds: Int32Array.from(tokenIds), positions: Int32Array.from(positions),
          slotMapping: Int32Array.from(slots), numSeqs: scheduled.length, queryStartLoc: Int32Array.from(qsl),
          seqLens: Int32Array.from(seqLens), blockTables: table, maxBlocksPerSeq,
          logitsIndices: Int32Array.from(qsl.slice(1), (e) => e - 1),
          ...(loraSlots.some((l) => l >= 0) ? { loraSlots: Int32Array.from(loraSlots) } : {}),
        };
        const logits = native.forward(batch);
        stepsRun++;
        rows += tokenIds.length;
        loraRows += loraSlots.filter((l) => l >= 0).length;
        // Batch invariance: some sequences' whole history, alone, in one prefill, on the shadow instance.
        for (const [i, q] of scheduled.entries()) {
          if (rand() >= (model.small ? 0.15 : 0.05)) continue;
          const len = q.cached;
          const pos = Int32Array.from({ length: len }, (_, p) => p);
          const solo = {
            numTokens: len, tokenIds: Int32Array.from(q.tokens.slice(0, len)), positions: pos,
            slotMapping: pos.map((p) => p), numSeqs: 1, queryStartLoc: Int32Array.of(0, len),
            seqLens: Int32Array.of(len),
            blockTables: Int32Array.from({ length: maxBlocksPerSeq }, (_, b) => b), maxBlocksPerSeq,
            logitsIndices: Int32Array.of(len - 1),
            ...(q.lora >= 0 ? { loraSlots: new Int32Array(len).fill(q.lora) } : {}),
          };
          const alone = shadow.forward(solo);
          const mixed = logits.subarray(i * config.vocabSize, (i + 1) * config.vocabSize);
          for (let v = 0; v < config.vocabSize; v++) {
            if (!Object.is(alone[v], mixed[v])) {
              throw new Error(`${model.name} ${variant}: batch invariance broken at step ${s}, sequence of ${len} ` +
                `tokens, logit ${v}: ${mixed[v]} in a batch of ${scheduled.length} on ${threads} threads, ${alone[v]} ` +
                `alone on ${shadowThreads}`);
            }
          }
          checks++;
          // An independent implementation on the small models, a few times per instance.
          // Not on a mixture of experts with rounded activations: a router score within the rounding of the top-k
          // boundary picks another expert, a different (not a wrong) result.
          const referenceComparable = !model.name.startsWith('moe(') || /^moe\((F32|F16),/.test(model.name);
          if (model.small && referenceComparable && referenceChecks < 40 && rand() < 0.3) {
            const ref = referenceBackend.load(config, weights, { numBlocks: maxBlocksPerSeq, blockSize, dtype });
            for (const [slot, adapter] of adapters) ref.setLora!(slot, adapter);
            const e = nmse(alone, ref.forward(solo));
            ref.dispose();
            // K-quants carry one activation scale per 256 values (as in the kernel tests' bounds).
            const quantized = /Q8_0|Q4_0|BF16|stories/.test(model.name);
            const bound = /Q[456]_K/.test(model.name) ? 2e-2 : quantized ? 5e-3 : 1e-6;
            if (!(e <= bound)) {
              throw new Error(`${model.name} ${variant}: NMSE ${e} against the reference forward exceeds ${bound}`);
            }
            referenceChecks++;
          }
        }
        for (let k = live.length - 1; k >= 0; k--) {
          const q = live[k]!;
          if (q.cached >= q.targetLen || q.cached >= maxLen) {
            free.push(...q.blocks);
            live.splice(k, 1);
          }
        }
      }
      // The sampler's prompt-logprob pass over many rows on this instance's threads, against the TypeScript passes
      // bit for bit (the rows' argmax, weighing total, count above the target, best ids; the ids of a buffer sized
      // exactly, so a write past a row's share lands in the next row's or outside the allocation). Half the time the
      // entries name their rows (rowIds, as for a step's sampled tokens: any order, some twice).
      if (rand() < 0.5) {
        const { argmax, weighCandidates, countAbove, Sampler } = await import('../src/engine/sampler.ts');
        const v = config.vocabSize, numRows = int(1, 40), numBest = pick([0, 1, 2, 5, 20, 64]);
        const rowIds = rand() < 0.5 ? Int32Array.from({ length: int(1, 40) }, () => int(0, numRows - 1)) : undefined;
        const numEntries = rowIds?.length ?? numRows;
        const rowsLogits = Float32Array.from({ length: numRows * v }, () => (rand() < 0.02 ? -Infinity : Math.round((rand() - 0.5) * 80) / 4));
        const targets = Int32Array.from({ length: numEntries }, () => int(0, v - 1));
        const out = new Float64Array(3 * numEntries);
        const bestIds = new Int32Array(numEntries * numBest);
        native.promptLogprobRows(rowsLogits, numEntries, targets, out, bestIds, numBest, rowIds);
        const plain = new Sampler(v);
        for (let r = 0; r < numEntries; r++) {
          const rowId = rowIds?.[r] ?? r;
          const row = rowsLogits.subarray(rowId * v, (rowId + 1) * v);
          const best = argmax(row);
          const total = weighCandidates(row, 1, row[best]!, -Infinity, new Float64Array(v), null, null, null, new Int32Array(1));
          const expected = [best, total, countAbove(row, row[targets[r]!]!), ...plain.promptLogprob(row, 0, numBest).top.map((t) => t.tokenId)];
          const got = [...out.subarray(3 * r, 3 * r + 3), ...bestIds.subarray(r * numBest, (r + 1) * numBest)];
          if (!expected.every((x, j) => Object.is(x, got[j]))) {
            throw new Error(`${model.name} ${variant}: promptLogprobRows entry ${r} of ${numEntries} (row ${rowId}) on ${threads} threads gave `
              + `${got}, the TypeScript passes ${expected}`);
          }
        }
      }
      // The sampler's batched draws (random, and greedy rows' argmax) on this instance's threads (rows in any order, some twice), against the
      // TypeScript draw of each row from the same uniform, token for token.
      if (rand() < 0.5) {
        const { createRequestSamplers, DRAW_SPEC_WORDS, Sampler } = await import('../src/engine/sampler.ts');
        const { DEFAULT_SAMPLING } = await import('../src/engine/types.ts');
        const v = config.vocabSize, numRows = int(1, 24), count = int(1, 40);
        const rowsLogits = Float32Array.from({ length: numRows * v }, () => (rand() < 0.02 ? -Infinity : Math.round((rand() - 0.5) * 80) / 4));
        const rowIds = Int32Array.from({ length: count }, () => int(0, numRows - 1));
        const params = Array.from({ length: count }, () => ({ ...DEFAULT_SAMPLING, temperature: pick([1, 0.6, 1.4, 0]),
          topP: pick([1, 0.95, 0.5]), minP: pick([0, 0.05]), topK: pick([0, 0, 1, 40]) }));
        const uniforms = Array.from({ length: count }, () => rand());
        const specs = Float64Array.from(params.flatMap((p, i) => p.temperature === 0 ? [0, -Infinity, 1, 0, 0] : [p.temperature !== 1 ? 1 / p.temperature : 1,
          p.minP > 0 ? Math.log(p.minP) : -Infinity, p.topP, uniforms[i]!, p.topK]));
        const out = new Int32Array(count);
        native.sampleRows(rowsLogits, rowIds, specs, out);
        const plain = new Sampler(v);
        for (let i = 0; i < count; i++) {
          const sequence = Object.assign(createRequestSamplers({ params: params[i]!, promptTokenIds: [], vocabSize: v, eosTokenIds: [] })[0]!,
            { nextUniform: () => uniforms[i]! });
          const expected = plain.sampleRow(rowsLogits.subarray(rowIds[i]! * v, (rowIds[i]! + 1) * v), sequence).tokenId;
          if (out[i] !== expected) {
            throw new Error(`${model.name} ${variant}: sampleRows entry ${i} of ${count} (row ${rowIds[i]}, spec `
              + `${[...specs.subarray(i * DRAW_SPEC_WORDS, (i + 1) * DRAW_SPEC_WORDS)]}) on ${threads} threads drew ${out[i]}, the TypeScript draw ${expected}`);
          }
        }
      }
      native.dispose();
      shadow.dispose();
      done += steps;
    }
    console.log(`${model.name}: ${modelSteps} steps in ${((performance.now() - started) / 1000).toFixed(1)} s`);
  }
  // The ops entry points share one pool per thread count across the process; run them on every count too.
  const { GgmlType } = await import('../src/model/ggml-types.ts');
  const { quantize } = await import('../src/model/quant.ts');
  for (let i = 0; i < 50; i++) {
    const type = pick([GgmlType.Q8_0, GgmlType.Q8_0, GgmlType.Q4_K, GgmlType.Q5_K, GgmlType.Q6_K]);
    const m = int(1, 40), k = type === GgmlType.Q8_0 ? 32 * int(1, 6) : 256 * int(1, 2), n = int(1, 70);
    const w = quantize(type, Float32Array.from({ length: n * k }, () => rand() - 0.5));
    const x = Float32Array.from({ length: m * k }, () => rand() - 0.5);
    const y1 = new Float32Array(m * n), y2 = new Float32Array(m * n);
    const variant = pick(variants);
    addon.ops.matmul(variant, type, w, x, m, k, n, y1, 1);
    addon.ops.matmul(variant, type, w, x, m, k, n, y2, pick(threadChoices));
    if (!y1.every((v, j) => Object.is(v, y2[j]))) {
      throw new Error(`ops.matmul ${variant} ${GgmlType[type]} ${m}x${k}x${n}: the thread count changed the result`);
    }
  }
  // The sampler's weighing pass and scaled copy on every variant against the TypeScript ones, bit for bit: row
  // lengths that leave the vector loops' tails, scales, floors, with and without the blocks' running totals and the
  // top_p bins.
  const { weighCandidates, scaleRow, MASS_BINS } = await import('../src/engine/sampler.ts');
  for (let i = 0; i < 200; i++) {
    const n = int(1, 33000);
    const row = Float32Array.from({ length: n }, () => (rand() - 0.5) * 40);
    if (rand() < 0.3) row[int(0, n - 1)] = -Infinity;
    const scale = pick([1, 1 / 0.7, 2]);
    let max = -Infinity;
    for (const value of row) max = Math.max(max, value);
    max = Math.fround(max * scale);
    const floor = rand() < 0.5 ? -Infinity : max - 4 * rand();
    const withTotals = rand() < 0.5, withBins = rand() < 0.5;
    const pass = (weigh: (...args: Parameters<typeof weighCandidates>) => number) => {
      const out = { weights: new Float64Array(n), blockTotals: new Float64Array(Math.ceil(n / 8)), binMass: new Float64Array(MASS_BINS),
        binCount: new Int32Array(MASS_BINS), last: new Int32Array(1) };
      const total = weigh(row, scale, max, floor, out.weights, withTotals ? out.blockTotals : null,
        withBins ? out.binMass : null, withBins ? out.binCount : null, out.last);
      return [total, out.last[0]!, ...out.weights, ...out.blockTotals, ...out.binMass, ...out.binCount];
    };
    const expected = pass(weighCandidates);
    const variant = pick(variants);
    const got = pass((...args) => addon.ops.sampleWeigh(variant, ...args));
    if (!got.every((v, j) => Object.is(v, expected[j]))) {
      throw new Error(`ops.sampleWeigh ${variant} n=${n} scale ${scale}: differs from the TypeScript pass`);
    }
    // The scaled copy of the same row, into another array and in place (its length exactly the row's, so a write
    // past it lands outside the allocation).
    const scaledExpected = new Float32Array(n);
    scaleRow(row, scaledExpected, scale);
    const scaledInto = new Float32Array(n);
    addon.ops.scaleRow(variant, row, scaledInto, scale);
    const scaledInPlace = Float32Array.from(row);
    addon.ops.scaleRow(variant, scaledInPlace, scaledInPlace, scale);
    if (!scaledExpected.every((v, j) => Object.is(v, scaledInto[j]) && Object.is(v, scaledInPlace[j]))) {
      throw new Error(`ops.scaleRow ${variant} n=${n} scale ${scale}: differs from the TypeScript copy`);
    }
  }
  console.log(`PASS steps: ${stepsRun} steps, ${rows} rows (${loraRows} with a LoRA adapter), ${instances} model ` +
    `instances (${loraInstances} pairs with adapters), ${checks} batch-invariance checks, ${referenceChecks} ` +
    `reference checks, ${models.map((m) => m.name).join('; ')}`);
}

// ---------------------------------------------------------------------------------------------------------------
// Worker termination in the middle of native calls

async function workerMain(): Promise<void> {
  const { seed, threads } = workerData as { seed: number; threads: number[] };
  const { seededRandom } = await import('../src/util/random.ts');
  const { nativeModelSpec, loadNativeAddon } = await import('../src/kernels/native.ts');
  const { kvPoolBytes } = await import('../src/kernels/types.ts');
  const addon = loadNativeAddon();
  const rand = seededRandom(seed);
  // The same model every time (fixed seed), on this worker's choice of threads: logits must not change.
  const model = await oddModel(seededRandom(7));
  const { config, weights } = model;
  const variant = addon.cpuInfo().bestVariant;
  const layout = {
    numLayers: config.numLayers, numBlocks: 16, blockSize: 16, numKvHeads: config.numKvHeads, headDim: config.headDim,
    dtype: 'f32' as const,
  };
  const len = 100;
  const pos = Int32Array.from({ length: len }, (_, p) => p);
  const batch = {
    numTokens: len, tokenIds: pos.map((p) => (p * 7) % config.vocabSize), positions: pos, slotMapping: pos,
    numSeqs: 1, queryStartLoc: Int32Array.of(0, len), seqLens: Int32Array.of(len),
    blockTables: Int32Array.from({ length: 16 }, (_, b) => b), maxBlocksPerSeq: 16,
    logitsIndices: Int32Array.of(len - 1),
  };
  let first = true;
  for (;;) {
    const t = threads[Math.floor(rand() * threads.length)]!;
    const bytes = new Uint8Array(new SharedArrayBuffer(kvPoolBytes(layout)));
    const m = new addon.NativeModel({ ...nativeModelSpec(config, weights, { layout, bytes }, variant, t) });
    for (let i = 0; i < 5; i++) {
      const logits = m.forward(batch);
      if (first) {
        parentPort!.postMessage({ logits: Array.from(logits) });
        first = false;
      }
      const x = new Float32Array(64 * 96), y = new Float32Array(64 * 96);
      const wq = weights.layers[0]!.wq;
      addon.ops.matmul(variant, wq.type, wq.data, x, 64, 96, 96, y, t);
    }
    m.dispose();
  }
}

// A worker does not inherit the tsx loader: it registers it, then runs this file (workerMain, as not the main thread).
const WORKER_BOOTSTRAP = `import(${JSON.stringify(import.meta.resolve('tsx/esm/api'))})
  .then(({ register }) => { register(); return import(${JSON.stringify(import.meta.url)}); })`;

async function terminateRole(): Promise<void> {
  const { seededRandom } = await import('../src/util/random.ts');
  const seed = Number(argValue('seed', '1'));
  const terminations = Number(argValue('terminations', '40'));
  const threads = argValue('threads', '1,2,3,4').split(',').map(Number);
  const rand = seededRandom(seed + 1);
  let expected: number[] | undefined;
  const started = performance.now();
  for (let i = 0; i < terminations; i++) {
    // Two workers at once, so termination also lands while another thread's pool is busy.
    const workers = [0, 1].map((j) => new Worker(WORKER_BOOTSTRAP, {
      eval: true, workerData: { seed: seed * 1000 + i * 2 + j, threads },
    }));
    const firsts = await Promise.all(workers.map((w) => new Promise<number[]>((res, rej) => {
      w.once('message', (m: { logits: number[] }) => res(m.logits));
      w.once('error', rej);
    })));
    for (const logits of firsts) {
      expected ??= logits;
      if (logits.length !== expected.length || logits.some((v, j) => !Object.is(v, expected![j]))) {
        throw new Error(`termination round ${i}: a worker's logits differ from the first worker's`);
      }
    }
    // Let them run for a random while (inside forward, matmul, load or dispose), then terminate both.
    await new Promise((r) => setTimeout(r, Math.floor(rand() * 30)));
    await Promise.all(workers.map((w) => w.terminate()));
  }
  console.log(`PASS terminate: ${terminations} rounds of 2 workers terminated mid-call in ` +
    `${((performance.now() - started) / 1000).toFixed(1)} s, logits identical across all ${terminations * 2} workers`);
}

// ---------------------------------------------------------------------------------------------------------------

async function prepareRole(): Promise<void> {
  const cacheDir = argValue('cache-dir', join(tmpdir(), 'conduit-stress-models'));
  mkdirSync(cacheDir, { recursive: true });
  for (const name of argValue('models', '').split(',')) {
    if (name === 'odd' || name === 'kquant' || name === 'moe') continue;  // made in memory by the steps role
    const path = await modelFile(name, cacheDir);
    console.log(path ? `model ${name}: ${path}` : `model ${name}: not available, skipped`);
  }
}

async function main(): Promise<void> {
  if (!isMainThread) return workerMain();
  const role = argValue('role', '');
  if (role === 'steps') return stepsRole();
  if (role === 'terminate') return terminateRole();
  if (role === 'prepare') return prepareRole();
  if (role !== '') throw new Error(`unknown role ${role}`);
  return driver();
}

main().catch((error: unknown) => {
  console.error(`native stress: ${(error as Error).stack ?? String(error)}`);
  process.exit(1);
});
