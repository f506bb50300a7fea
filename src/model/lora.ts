// LoRA adapters: low-rank corrections of a base model's projections, y = W x + scale * B (A x), read from llama.cpp's
// GGUF adapter format or a Hugging Face PEFT folder, checked against the base model they are loaded onto, and the
// reference math that applies them row by row (the native kernel, native/lora.cc, must give the same result).
//
// GGUF (llama.cpp's convert_lora_to_gguf): general.type = "adapter", adapter.type = "lora", adapter.lora.alpha, and
// per adapted weight `<weight>.lora_a` (ggml shape [in, rank]) and `<weight>.lora_b` ([rank, out]); the scale is
// alpha / rank (1 when alpha is 0), as llama.cpp applies it. PEFT: adapter_config.json (r, lora_alpha, use_rslora)
// and adapter_model.safetensors with `...layers.N.self_attn.q_proj.lora_A.weight` ([rank, in]) and `lora_B` ([out,
// rank]); scale lora_alpha / r (lora_alpha / sqrt(r) with rsLoRA). For a llama GGUF base, whose Q and K rows
// llama.cpp's converter permuted for interleaved RoPE, the rows of q/k lora_B are permuted the same way.

import { createHash } from 'node:crypto';
import { closeSync, existsSync, openSync, readFileSync, readSync, statSync } from 'node:fs';
import { open, readFile, stat } from 'node:fs/promises';
import { join } from 'node:path';
import type { ModelConfig } from './config.ts';
import { MAX_TEXT_FILE_BYTES } from './files.ts';
import { GgmlType } from './ggml-types.ts';
import { metaNumber, metaString, parseGguf, peekGgufMetadata, type GgufFile } from './gguf.ts';
import { interleavedRowOrder } from './hf.ts';
import { dequantizeTensor } from './quant.ts';
import { openSafetensors, readSafetensorsHeaderAsync, type SafetensorsReader } from './safetensors.ts';

/** The projections an adapter may correct (the names of LayerWeights). */
export const LORA_TARGETS = ['wq', 'wk', 'wv', 'wo', 'wGate', 'wUp', 'wDown'] as const;
export type LoraTarget = (typeof LORA_TARGETS)[number];

/**
 * How the native backend stores adapters' matrices for its batched kernel (native/lora.h): 'f32' exact, 'bf16', or
 * 'q8', int8 with one scale per row of A and of B transposed (each value within absmax(row) / 254 of its f32 value).
 * The reference backend always computes in f32.
 */
export type LoraDtype = 'f32' | 'bf16' | 'q8';
export const LORA_DTYPES: readonly LoraDtype[] = ['f32', 'bf16', 'q8'];
/** The native backend's storage when neither the load option nor CONDUIT_LORA_DTYPE says otherwise. */
export const DEFAULT_LORA_DTYPE: LoraDtype = 'q8';

/** The storage to use: the explicit choice, else CONDUIT_LORA_DTYPE, else DEFAULT_LORA_DTYPE. */
export function resolveLoraDtype(explicit?: LoraDtype, env: NodeJS.ProcessEnv = process.env): LoraDtype {
  const requested = explicit ?? env.CONDUIT_LORA_DTYPE?.trim().toLowerCase();
  if (requested === undefined || requested === '') return DEFAULT_LORA_DTYPE;
  if (!(LORA_DTYPES as readonly string[]).includes(requested)) {
    throw new RangeError(`CONDUIT_LORA_DTYPE must be one of ${LORA_DTYPES.join(', ')}, got "${requested}"`);
  }
  return requested as LoraDtype;
}

/** One adapted projection: A [rank x in] and B [out x rank], row-major f32. */
export interface LoraMatrix {
  rank: number;
  a: Float32Array;
  b: Float32Array;
}

/** An adapter as the backends take it: the scale and, per layer, the projections it corrects. */
export interface LoraWeights {
  /** Multiplies B (A x): alpha / rank. */
  scale: number;
  layers: Partial<Record<LoraTarget, LoraMatrix>>[];
}

export interface LoadedLoraAdapter {
  weights: LoraWeights;
  format: 'gguf' | 'peft';
  /** Largest rank of its matrices. */
  rank: number;
  alpha: number;
  /** Bytes of its f32 matrices. */
  bytes: number;
  /** adapterDigest of the bytes these weights were read from (what inspectLoraAdapter gives for the same files). */
  digest: string;
}

/** An adapter file that cannot be applied to this base (wrong format, shapes, architecture): the caller's 400. */
export class LoraAdapterError extends Error {
  override name = 'LoraAdapterError';
}

const GGUF_WEIGHTS: Record<string, LoraTarget> = {
  attn_q: 'wq', attn_k: 'wk', attn_v: 'wv', attn_output: 'wo', ffn_gate: 'wGate', ffn_up: 'wUp', ffn_down: 'wDown',
};
const PEFT_WEIGHTS: Record<string, LoraTarget> = {
  'self_attn.q_proj': 'wq', 'self_attn.k_proj': 'wk', 'self_attn.v_proj': 'wv', 'self_attn.o_proj': 'wo',
  'mlp.gate_proj': 'wGate', 'mlp.up_proj': 'wUp', 'mlp.down_proj': 'wDown',
};

/** [in, out] of a projection of this model. */
export function loraTargetShape(config: ModelConfig, target: LoraTarget): [number, number] {
  const qDim = config.numHeads * config.headDim;
  const kvDim = config.numKvHeads * config.headDim;
  switch (target) {
    case 'wq': return [config.dim, qDim];
    case 'wk': case 'wv': return [config.dim, kvDim];
    case 'wo': return [qDim, config.dim];
    case 'wGate': case 'wUp': return [config.dim, config.ffnDim];
    case 'wDown': return [config.ffnDim, config.dim];
  }
}

/**
 * SHA-256 (hex) of an adapter's bytes: a GGUF file's, or a PEFT folder's adapter_config.json then
 * adapter_model.safetensors. inspectLoraAdapter and loadLoraAdapter both give it, so a load can be checked against the
 * bytes an adapter was registered (and its KV blocks keyed) with.
 */
export function adapterDigest(parts: readonly Uint8Array[]): string {
  const hash = createHash('sha256');
  for (const part of parts) hash.update(part);
  return hash.digest('hex');
}

/** What can be known of an adapter without a base model: its rank, and a digest of its bytes. */
export interface LoraAdapterHeader {
  /** Largest rank of its matrices, from the tensors' shapes (as loading finds it). */
  rank: number;
  /** SHA-256 (hex) of the GGUF file, or of a PEFT folder's adapter_config.json and adapter_model.safetensors. */
  digest: string;
}

/**
 * Reads an adapter's rank and digest without loading it, off the JS thread's hot path (async reads): what the
 * --max-lora-rank check needs before an idle adapter is evicted to make room, and what a worker keys an adapter by.
 * Undefined when nothing is at `path` (a simulated worker's adapter named without a file); LoraAdapterError when
 * something is there and is not an adapter.
 */
export async function inspectLoraAdapter(path: string): Promise<LoraAdapterHeader | undefined> {
  let isDirectory: boolean;
  let size: number;
  try {
    const info = await stat(path);
    isDirectory = info.isDirectory();
    size = info.size;
    if (!isDirectory) requireRegularFile(path, info);
  } catch (error) {
    if (error instanceof LoraAdapterError) throw error;
    return undefined;
  }
  let rank = 0;
  let digest: string;
  try {
    if (isDirectory) {
      const configPath = join(path, 'adapter_config.json');
      const tensorsPath = join(path, 'adapter_model.safetensors');
      const configInfo = await stat(configPath);
      requireRegularFile(configPath, configInfo);
      requireRegularFile(tensorsPath, await stat(tensorsPath));
      requireTextSize(configPath, configInfo.size);
      const config = await readFile(configPath);
      const header = await readSafetensorsHeaderAsync(tensorsPath);
      digest = await fileDigestAsync(config, tensorsPath);
      // lora_A is [rank, in], outermost first.
      for (const entry of header.entries.values()) if (/\.lora_A(?:\.default)?\.weight$/.test(entry.name)) rank = Math.max(rank, entry.shape[0] ?? 0);
    } else {
      checkGgufAdapterHead(path, size, await readHead(path));
      const bytes = await readFile(path);
      digest = adapterDigest([bytes]);
      // lora_a is ggml [in, rank].
      for (const info of parseGguf(bytes, path).tensorInfos) if (info.name.endsWith('.lora_a')) rank = Math.max(rank, info.shape[1] ?? 0);
    }
  } catch (error) {
    if (error instanceof LoraAdapterError) throw error;
    throw new LoraAdapterError(`${path} is neither a GGUF LoRA adapter nor a PEFT folder: ${(error as Error).message}`);
  }
  if (rank === 0) throw new LoraAdapterError(`${path}: the adapter adapts no weight`);
  return { rank, digest };
}

/**
 * Reads a GGUF adapter file or a PEFT folder and checks it against the base model's config; the digest is of the
 * bytes read (each file is read once).
 */
export function loadLoraAdapter(path: string, base: ModelConfig): LoadedLoraAdapter {
  if (!existsSync(path)) throw new LoraAdapterError(`${path} does not exist`);
  const info = statSync(path);
  if (info.isDirectory()) return loadPeftAdapter(path, base);
  requireRegularFile(path, info);
  checkGgufAdapterHead(path, info.size, readHeadSync(path));
  let file: GgufFile;
  let bytes: Uint8Array;
  try {
    bytes = readFileSync(path);
    file = parseGguf(bytes, path);
  } catch (error) {
    throw new LoraAdapterError(`${path} is neither a GGUF LoRA adapter nor a PEFT folder: ${(error as Error).message}`);
  }
  return { ...ggufAdapter(file, path, base), digest: adapterDigest([bytes]) };
}

/**
 * adapterDigest of `config` then the file at `path`, read in chunks: a PEFT adapter's safetensors file is hashed
 * without holding it in memory, whatever its size.
 */
async function fileDigestAsync(config: Uint8Array, path: string): Promise<string> {
  const hash = createHash('sha256');
  hash.update(config);
  const handle = await open(path, 'r');
  try {
    const chunk = Buffer.alloc(DIGEST_CHUNK_BYTES);
    for (let position = 0; ;) {
      const { bytesRead } = await handle.read(chunk, 0, chunk.byteLength, position);
      if (bytesRead === 0) break;
      hash.update(chunk.subarray(0, bytesRead));
      position += bytesRead;
    }
  } finally {
    await handle.close();
  }
  return hash.digest('hex');
}
const DIGEST_CHUNK_BYTES = 4 * 1024 * 1024;

/** The most bytes Node reads from a file into one buffer: readFile refuses a larger file. */
const MAX_ADAPTER_FILE_BYTES = 2 ** 31 - 1;
/** The start of a GGUF file read to tell what it is; its general.* keys come first. */
const GGUF_HEAD_BYTES = 64 * 1024;

/**
 * Checks the start of a file given as a GGUF adapter before it is read whole: one that is no GGUF (a safetensors
 * file, a sparse file of zeros), or a GGUF that says it is something else (a base model passed by mistake, perhaps
 * gigabytes), is refused at once, and an adapter larger than Node reads into one buffer is refused saying so, instead
 * of Node's "File size ... is greater than 2 GiB" passed off as a file that is no adapter.
 */
function checkGgufAdapterHead(path: string, size: number, head: Uint8Array): void {
  let metadata: ReturnType<typeof peekGgufMetadata>;
  try {
    metadata = peekGgufMetadata(head, path);
  } catch (error) {
    throw new LoraAdapterError(`${path} is neither a GGUF LoRA adapter nor a PEFT folder: ${(error as Error).message}`);
  }
  const type = metadata.get('general.type');
  const architecture = metadata.get('general.architecture');
  // A model's file says so in general.type, or (older converters write no type) by its layer count, which an
  // adapter has no use for.
  if (type === 'model' || (type === undefined && metadata.has(`${String(architecture)}.block_count`))) {
    throw new LoraAdapterError(`${path} is a model (a GGUF with ${type === 'model' ? 'general.type "model"' : 'a block_count'}), ` +
      'not a LoRA adapter; pass the adapter\'s file or PEFT folder');
  }
  if (type !== undefined && type !== 'adapter') {
    throw new LoraAdapterError(`${path}: general.type is ${typeof type === 'string' ? `"${type}"` : 'not a string'}, a LoRA ` +
      'adapter says "adapter"');
  }
  if (size > MAX_ADAPTER_FILE_BYTES) {
    throw new LoraAdapterError(`${path} is a GGUF LoRA adapter of ${size} bytes, too large to read: an adapter file may ` +
      `have at most ${MAX_ADAPTER_FILE_BYTES} bytes (2 GiB)`);
  }
}

function readHeadSync(path: string): Uint8Array {
  const fd = openSync(path, 'r');
  try {
    const head = Buffer.alloc(GGUF_HEAD_BYTES);
    return head.subarray(0, readSync(fd, head, 0, GGUF_HEAD_BYTES, 0));
  } finally {
    closeSync(fd);
  }
}

async function readHead(path: string): Promise<Uint8Array> {
  const handle = await open(path, 'r');
  try {
    const head = Buffer.alloc(GGUF_HEAD_BYTES);
    const { bytesRead } = await handle.read(head, 0, GGUF_HEAD_BYTES, 0);
    return head.subarray(0, bytesRead);
  } finally {
    await handle.close();
  }
}

/**
 * An adapter's files are read whole, on the worker's thread: a device or FIFO there (/dev/zero, a pipe) would be read
 * forever and hold the worker, so only regular files are read.
 */
function requireRegularFile(path: string, info: { isFile(): boolean }): void {
  if (!info.isFile()) throw new LoraAdapterError(`${path} is not a regular file (a folder, device, FIFO or socket)`);
}

/**
 * adapter_config.json is decoded into one string, which V8 caps (MAX_TEXT_FILE_BYTES, as for a model's text files in
 * files.ts' readModelText): a larger one is refused before it is read, naming the file and the limit, instead of
 * failing in Buffer.toString with a plain "Cannot create a string longer than ..." after reading half a gigabyte.
 * Checked here by size, as readModelText checks it, since loadLoraAdapter reads synchronously on the worker's thread.
 */
function requireTextSize(path: string, size: number): void {
  if (size > MAX_TEXT_FILE_BYTES) {
    throw new LoraAdapterError(`${path} is ${size} bytes, more than the ${MAX_TEXT_FILE_BYTES} bytes a text file of an ` +
      'adapter may have (the longest string JavaScript holds)');
  }
}

function ggufAdapter(file: GgufFile, path: string, base: ModelConfig): Omit<LoadedLoraAdapter, 'digest'> {
  const type = metaString(file, 'general.type');
  if (type !== 'adapter') throw new LoraAdapterError(`${path}: general.type is ${type === undefined ? 'missing' : `"${type}"`}, a LoRA adapter says "adapter"`);
  const adapterType = metaString(file, 'adapter.type');
  if (adapterType !== 'lora') throw new LoraAdapterError(`${path}: adapter.type is ${adapterType === undefined ? 'missing' : `"${adapterType}"`}, not "lora"`);
  const arch = metaString(file, 'general.architecture');
  if (arch !== base.architecture) {
    throw new LoraAdapterError(`${path} is an adapter for ${arch === undefined ? 'an unnamed architecture' : `"${arch}"`}, the base model is "${base.architecture}"`);
  }
  // Absent means 0 (scale 1), as llama.cpp reads it; present but not a number (a string "16", an array) is the file's
  // mistake, which taken as absent applied the adapter at scale 1 instead of alpha / rank, silently.
  const alpha = file.metadata.has('adapter.lora.alpha') ? metaNumber(file, 'adapter.lora.alpha') : 0;
  if (alpha === undefined) {
    const value = file.metadata.get('adapter.lora.alpha');
    throw new LoraAdapterError(`${path}: adapter.lora.alpha is ${typeof value === 'string' ? JSON.stringify(value) : Array.isArray(value) || ArrayBuffer.isView(value) ? 'an array' : String(value)}, not a number`);
  }
  const pairs = new Map<string, { a?: string; b?: string }>();
  for (const info of file.tensorInfos) {
    const match = /^(.*)\.lora_(a|b)$/.exec(info.name);
    if (!match) throw new LoraAdapterError(`${path}: tensor ${info.name} is not a lora_a / lora_b tensor`);
    const entry = pairs.get(match[1]!) ?? {};
    entry[match[2] as 'a' | 'b'] = info.name;
    pairs.set(match[1]!, entry);
  }
  const layers = emptyLayers(base);
  const claimed = new Map<string, string>();
  let rank = 0;
  for (const [weight, { a, b }] of pairs) {
    if (a === undefined || b === undefined) throw new LoraAdapterError(`${path}: ${weight} has lora_${a ? 'a' : 'b'} without lora_${a ? 'b' : 'a'}`);
    const match = /^blk\.(\d+)\.([a-z_]+)\.weight$/.exec(weight);
    // Own keys only: blk.0.constructor.weight must be refused by name, not found on Object.prototype.
    const target = match && Object.hasOwn(GGUF_WEIGHTS, match[2]!) ? GGUF_WEIGHTS[match[2]!] : undefined;
    if (!match || target === undefined) throw new LoraAdapterError(`${path}: ${weight} is not a projection Conduit adapts (attn_q/k/v/output, ffn_gate/up/down of a layer)`);
    const layer = Number(match[1]);
    claimOnce(claimed, path, layer, target, weight);
    const ta = file.tensor(a);
    const tb = file.tensor(b);
    // lora_a: ggml [in, rank] = rank rows of `in`; lora_b: ggml [rank, out] = out rows of `rank`.
    const [inDim, outDim] = checkedShape(path, base, layer, weight, target, ta.shape, tb.shape);
    const matrix = { rank: ta.shape[1]!, a: toF32(ta), b: toF32(tb) };
    if (matrix.a.length !== matrix.rank * inDim || matrix.b.length !== outDim * matrix.rank) {
      throw new LoraAdapterError(`${path}: ${weight} has the wrong number of elements`);
    }
    layers[layer]![target] = matrix;
    rank = Math.max(rank, matrix.rank);
  }
  // llama.cpp scales each matrix by alpha / its own rank (lora_b's ne[0]); the backends take one scale per adapter,
  // alpha / the largest rank, so a matrix of a smaller rank has its B multiplied by the ratio. Without this, the
  // matrices of an adapter with mixed ranks were scaled by the wrong factor, silently.
  if (alpha !== 0) {
    for (const layer of layers) {
      for (const m of Object.values(layer)) {
        if (m.rank === rank) continue;
        const ratio = rank / m.rank;
        for (let i = 0; i < m.b.length; i++) m.b[i] = m.b[i]! * ratio;
      }
    }
  }
  return finish(layers, rank, alpha, alpha !== 0 ? alpha / rank : 1, 'gguf', path);
}

/**
 * Records that `weight` adapts `target` of `layer`, refusing a second name for the same projection: blk.0 and blk.00
 * (the layer is read as a number), or a PEFT module under two prefixes, would otherwise both be read and the one read
 * last would replace the other, silently. llama.cpp looks each name up in the base model as written, so it refuses
 * blk.00 outright; here a lone blk.00 is taken as layer 0, and two names for one projection are refused, naming both.
 */
function claimOnce(claimed: Map<string, string>, path: string, layer: number, target: LoraTarget, weight: string): void {
  const key = `${layer}.${target}`;
  const earlier = claimed.get(key);
  if (earlier !== undefined) {
    throw new LoraAdapterError(`${path}: ${earlier} and ${weight} both adapt the same projection (${target} of layer ${layer}); ` +
      'an adapter names each projection once');
  }
  claimed.set(key, weight);
}

function toF32(t: { type: GgmlType; data: Uint8Array; shape: number[]; name: string }): Float32Array {
  return Float32Array.from(dequantizeTensor(t));
}

function emptyLayers(base: ModelConfig): Partial<Record<LoraTarget, LoraMatrix>>[] {
  return Array.from({ length: base.numLayers }, () => ({}));
}

/**
 * Checks an adapted weight's A ([in, rank] in ggml order) and B ([rank, out]) against the base: the layer exists,
 * in and out are the projection's, the ranks agree. Returns [in, out].
 */
function checkedShape(path: string, base: ModelConfig, layer: number, weight: string, target: LoraTarget,
  aShape: readonly number[], bShape: readonly number[]): [number, number] {
  if (layer >= base.numLayers) throw new LoraAdapterError(`${path}: ${weight} is in layer ${layer}, the base model has ${base.numLayers} layers`);
  // A mixture-of-experts base has no single gate/up/down matrix for a low-rank product to join.
  if (base.moe && (target === 'wGate' || target === 'wUp' || target === 'wDown')) {
    throw new LoraAdapterError(`${path}: ${weight} adapts a feed-forward matrix, but the base model's feed-forward layers are experts (adapters of expert weights are not supported)`);
  }
  const [inDim, outDim] = loraTargetShape(base, target);
  const describe = (shape: readonly number[]) => `[${shape.join(', ')}]`;
  if (aShape.length !== 2 || bShape.length !== 2 || aShape[0] !== inDim || bShape[1] !== outDim || aShape[1] !== bShape[0] || !(aShape[1]! > 0)) {
    throw new LoraAdapterError(`${path}: ${weight} has lora_a ${describe(aShape)} and lora_b ${describe(bShape)} (ggml order); `
      + `the base model's ${weight} needs lora_a [${inDim}, r] and lora_b [r, ${outDim}]: the adapter was made for another base model`);
  }
  return [inDim, outDim];
}

function finish(layers: Partial<Record<LoraTarget, LoraMatrix>>[], rank: number, alpha: number, scale: number,
  format: 'gguf' | 'peft', path: string): Omit<LoadedLoraAdapter, 'digest'> {
  if (rank === 0) throw new LoraAdapterError(`${path}: the adapter adapts no weight`);
  if (!Number.isFinite(scale)) throw new LoraAdapterError(`${path}: alpha ${alpha} gives no finite scale`);
  let bytes = 0;
  for (const layer of layers) for (const m of Object.values(layer)) bytes += (m.a.length + m.b.length) * 4;
  return { weights: { scale, layers }, format, rank, alpha, bytes };
}

/** PEFT's LoraConfig.lora_alpha when adapter_config.json gives none. */
const PEFT_DEFAULT_LORA_ALPHA = 8;

function loadPeftAdapter(dir: string, base: ModelConfig): LoadedLoraAdapter {
  const configPath = join(dir, 'adapter_config.json');
  const tensorsPath = join(dir, 'adapter_model.safetensors');
  if (!existsSync(configPath)) throw new LoraAdapterError(`${dir} is a folder without adapter_config.json (a PEFT adapter has one)`);
  if (!existsSync(tensorsPath)) throw new LoraAdapterError(`${dir} has no adapter_model.safetensors`);
  const configInfo = statSync(configPath);
  requireRegularFile(configPath, configInfo);
  requireRegularFile(tensorsPath, statSync(tensorsPath));
  requireTextSize(configPath, configInfo.size);
  let json: Record<string, unknown>;
  let configBytes: Uint8Array;
  try {
    configBytes = readFileSync(configPath);
    json = JSON.parse(Buffer.from(configBytes).toString('utf8')) as Record<string, unknown>;
  } catch (error) {
    throw new LoraAdapterError(`${configPath}: ${(error as Error).message}`);
  }
  if (typeof json !== 'object' || json === null || Array.isArray(json)) {
    throw new LoraAdapterError(`${configPath} is not a JSON object`);
  }
  if (json.peft_type !== undefined && json.peft_type !== 'LORA') throw new LoraAdapterError(`${configPath}: peft_type is ${JSON.stringify(json.peft_type)}, not "LORA"`);
  // A flag of another type ("true", 1) read as false would apply the adapter at another scale, or transposed: silently.
  for (const key of ['fan_in_fan_out', 'use_rslora']) {
    const flag = json[key];
    if (flag !== undefined && flag !== null && typeof flag !== 'boolean') {
      throw new LoraAdapterError(`${configPath}: ${key} is ${JSON.stringify(flag)}, not true or false`);
    }
  }
  if (json.fan_in_fan_out === true) throw new LoraAdapterError(`${configPath}: fan_in_fan_out adapters are not supported`);
  const r = json.r;
  // Absent, lora_alpha is PEFT's default (LoraConfig's 8), not r: PEFT applies such an adapter at 8 / r.
  const alpha = json.lora_alpha ?? PEFT_DEFAULT_LORA_ALPHA;
  if (typeof r !== 'number' || !(r > 0) || typeof alpha !== 'number') throw new LoraAdapterError(`${configPath}: r and lora_alpha must be numbers, r > 0`);
  // PEFT scales the modules these name by their own rank or alpha; one scale for the adapter would be wrong for them.
  for (const key of ['rank_pattern', 'alpha_pattern']) {
    const pattern = json[key];
    if (pattern !== undefined && pattern !== null && !(typeof pattern === 'object' && Object.keys(pattern).length === 0)) {
      throw new LoraAdapterError(`${configPath}: ${key} (a rank or alpha of its own for some modules) is not supported`);
    }
  }
  const scale = json.use_rslora === true ? alpha / Math.sqrt(r) : alpha / r;
  const file = openSafetensors(tensorsPath);
  try {
    return peftAdapter(file, tensorsPath, configPath, configBytes, r, alpha, scale, base, dir);
  } finally {
    file.close();
  }
}

/**
 * The adapter in an open adapter_model.safetensors: its names are checked first, then its tensors are read one at a
 * time in the order of their bytes, each hashed and turned into f32 as it is read, so the file's bytes are hashed
 * whole (the header and the tensors tile the file) without a copy of the file in memory.
 */
function peftAdapter(file: SafetensorsReader, tensorsPath: string, configPath: string, configBytes: Uint8Array,
  r: number, alpha: number, scale: number, base: ModelConfig, dir: string): LoadedLoraAdapter {
  const layers = emptyLayers(base);
  const claimed = new Map<string, string>();
  let rank = 0;
  const pairs = new Map<string, { a?: string; b?: string }>();
  for (const name of file.entries.keys()) {
    const match = /^(.*)\.lora_(A|B)(?:\.default)?\.weight$/.exec(name);
    if (!match) throw new LoraAdapterError(`${tensorsPath}: tensor ${name} is not a lora_A / lora_B weight (embedding and bias adapters are not supported)`);
    const entry = pairs.get(match[1]!) ?? {};
    const side = match[2] === 'A' ? 'a' : 'b';
    // x.lora_A.weight and x.lora_A.default.weight are the same matrix twice: which one PEFT would use is unclear.
    if (entry[side] !== undefined) {
      throw new LoraAdapterError(`${tensorsPath}: ${entry[side]} and ${name} are both lora_${match[2]} of ${match[1]}; ` +
        'an adapter names each matrix once');
    }
    entry[side] = name;
    pairs.set(match[1]!, entry);
  }
  const checked: { weight: string; layer: number; target: LoraTarget; a: string; b: string; outDim: number; rank: number }[] = [];
  // Shapes are in ggml order: lora_A [rank, in] row-major is ggml [in, rank]; lora_B [out, rank] is [rank, out].
  const shapeOf = (name: string) => [...file.entries.get(name)!.shape].reverse();
  for (const [weight, { a, b }] of pairs) {
    if (a === undefined || b === undefined) throw new LoraAdapterError(`${tensorsPath}: ${weight} has only one of lora_A and lora_B`);
    const match = /(?:^|\.)layers\.(\d+)\.(self_attn\.[a-z]_proj|mlp\.[a-z]+_proj)$/.exec(weight);
    const target = match && Object.hasOwn(PEFT_WEIGHTS, match[2]!) ? PEFT_WEIGHTS[match[2]!] : undefined;
    if (!match || target === undefined) throw new LoraAdapterError(`${tensorsPath}: ${weight} is not a projection Conduit adapts (q/k/v/o_proj, gate/up/down_proj of a layer)`);
    const layer = Number(match[1]);
    claimOnce(claimed, tensorsPath, layer, target, weight);
    const [, outDim] = checkedShape(tensorsPath, base, layer, weight, target, shapeOf(a), shapeOf(b));
    const matrixRank = shapeOf(a)[1]!;
    // The scale is lora_alpha / r: a matrix of another rank would be scaled wrongly (PEFT refuses to load it).
    if (matrixRank !== r) {
      throw new LoraAdapterError(`${tensorsPath}: ${weight} has rank ${matrixRank}, but ${configPath} says r ${r}`);
    }
    checked.push({ weight, layer, target, a, b, outDim, rank: matrixRank });
  }
  const hash = createHash('sha256');
  hash.update(configBytes);
  hash.update(file.head);
  const values = new Map<string, Float32Array>();
  for (const entry of [...file.entries.values()].sort((x, y) => x.begin - y.begin)) {
    const tensor = file.tensor(entry.name);
    hash.update(tensor.data);
    values.set(entry.name, toF32(tensor));
  }
  for (const { layer, target, a, b, outDim, rank: matrixRank } of checked) {
    let bMatrix = values.get(b)!;
    if (base.ropeStyle === 'interleaved' && (target === 'wq' || target === 'wk')) {
      const heads = target === 'wq' ? base.numHeads : base.numKvHeads;
      const order = interleavedRowOrder(heads, base.headDim);
      const permuted = new Float32Array(bMatrix.length);
      for (let row = 0; row < outDim; row++) permuted.set(bMatrix.subarray(order[row]! * matrixRank, (order[row]! + 1) * matrixRank), row * matrixRank);
      bMatrix = permuted;
    }
    layers[layer]![target] = { rank: matrixRank, a: values.get(a)!, b: bMatrix };
    rank = Math.max(rank, matrixRank);
  }
  return { ...finish(layers, rank, alpha, scale, 'peft', dir), digest: hash.digest('hex') };
}

// ---------------------------------------------------------------------------------------------------------------
// Reference math

/**
 * out[r] += scale * B (A x[r]) for every row r whose adapter (rowAdapters[r]) adapts `target` in `layer`; rows
 * without an adapter are left as they are. Each row is computed on its own, in the same order whatever the batch.
 */
export function applyLoraRows(out: Float32Array, x: Float32Array, numRows: number, inDim: number, outDim: number,
  rowAdapters: readonly (LoraWeights | undefined)[], layer: number, target: LoraTarget): void {
  let u = new Float32Array(0);
  for (let r = 0; r < numRows; r++) {
    const adapter = rowAdapters[r];
    const m = adapter?.layers[layer]?.[target];
    if (!adapter || !m) continue;
    if (u.length < m.rank) u = new Float32Array(m.rank);
    const xBase = r * inDim;
    for (let k = 0; k < m.rank; k++) {
      let sum = 0;
      const aBase = k * inDim;
      for (let i = 0; i < inDim; i++) sum += m.a[aBase + i]! * x[xBase + i]!;
      u[k] = sum;
    }
    const outBase = r * outDim;
    for (let o = 0; o < outDim; o++) {
      let sum = 0;
      const bBase = o * m.rank;
      for (let k = 0; k < m.rank; k++) sum += m.b[bBase + k]! * u[k]!;
      out[outBase + o] = out[outBase + o]! + adapter.scale * sum;
    }
  }
}
