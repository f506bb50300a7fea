// LoRA adapters on simulated workers: only an adapter's shape matters (its rank and the projections it adapts), for
// the cost its tokens add to a step (perf-model.ts StepLora). A path that exists is read for that shape: a GGUF
// adapter's lora_a tensors, or a PEFT folder's adapter_config.json (r, target_modules). A path that does not exist
// is a synthetic adapter of the default rank on every projection, so a simulated server can serve adapter names
// without files (`--lora-modules name=anything --engine sim`). Files are read as the CPU engine's model files are
// (files.ts): only regular ones (a device or FIFO, /dev/zero or a pipe, would be read forever), and
// adapter_config.json only within the longest string JavaScript holds, refused by its size before it is read.

import { stat } from 'node:fs/promises';
import { join } from 'node:path';
import { LoraLoadError } from '../engine/errors.ts';
import type { LoraLoadInfo } from '../engine/types.ts';
import { readModelFile, readModelText } from '../model/files.ts';
import { metaNumber, metaString, parseGguf, type GgufFile } from '../model/gguf.ts';
import { SIM_LORA_TARGETS, type SimLoraTarget } from './perf-model.ts';
import type { SimLoraAdapter } from './sim-worker.ts';

/** vLLM's default --max-lora-rank: the rank of a simulated adapter that has no file. */
export const DEFAULT_SIM_LORA_RANK = 16;

const GGUF_TARGETS: Record<string, SimLoraTarget> = {
  attn_q: 'wq', attn_k: 'wk', attn_v: 'wv', attn_output: 'wo', ffn_gate: 'wGate', ffn_up: 'wUp', ffn_down: 'wDown',
};
const PEFT_TARGETS: Record<string, SimLoraTarget> = {
  q_proj: 'wq', k_proj: 'wk', v_proj: 'wv', o_proj: 'wo', gate_proj: 'wGate', up_proj: 'wUp', down_proj: 'wDown',
};

type SimLoraShape = { adapter: SimLoraAdapter; info: LoraLoadInfo };

/** What files.ts refuses (not a regular file, too large, unreadable): the adapter is invalid, for that reason. */
async function read<T>(reading: Promise<T>): Promise<T> {
  try {
    return await reading;
  } catch (error) {
    throw new LoraLoadError('invalid_adapter', (error as Error).message);
  }
}

/** The shape of the adapter at `path` (see the file's header), and what loading it reports. */
export async function simLoraAdapter(path: string, defaultRank = DEFAULT_SIM_LORA_RANK): Promise<SimLoraShape> {
  const found = await stat(path).catch(() => undefined);
  if (!found) {
    return { adapter: { rank: defaultRank }, info: { format: 'synthetic', rank: defaultRank, alpha: 0, bytes: 0 } };
  }
  if (found.isDirectory()) return peftShape(path);
  const contents = await read(readModelFile(path));
  let file: GgufFile;
  try {
    file = parseGguf(contents, path);
  } catch (error) {
    throw new LoraLoadError('invalid_adapter', `${path} is neither a GGUF LoRA adapter nor a PEFT folder: ${(error as Error).message}`);
  }
  if (metaString(file, 'general.type') !== 'adapter' || metaString(file, 'adapter.type') !== 'lora') {
    throw new LoraLoadError('invalid_adapter', `${path} is not a GGUF LoRA adapter (general.type "adapter", adapter.type "lora")`);
  }
  let rank = 0;
  const targets = new Set<SimLoraTarget>();
  for (const info of file.tensorInfos) {
    const match = /^blk\.\d+\.([a-z_]+)\.weight\.lora_a$/.exec(info.name);
    const target = match ? GGUF_TARGETS[match[1]!] : undefined;
    if (target === undefined) continue;
    targets.add(target);
    rank = Math.max(rank, info.shape[1] ?? 0);
  }
  if (rank === 0) throw new LoraLoadError('invalid_adapter', `${path}: the adapter adapts no weight`);
  const bytes = file.tensorInfos.reduce((n, t) => n + t.shape.reduce((a, b) => a * b, 1) * 4, 0);
  return {
    adapter: { rank, targets: SIM_LORA_TARGETS.filter((t) => targets.has(t)) },
    info: { format: 'gguf', rank, alpha: metaNumber(file, 'adapter.lora.alpha') ?? 0, bytes },
  };
}

async function peftShape(dir: string): Promise<SimLoraShape> {
  const configPath = join(dir, 'adapter_config.json');
  const text = await read(readModelText(configPath));
  let config: { r?: unknown; lora_alpha?: unknown; target_modules?: unknown };
  try {
    config = JSON.parse(text) as typeof config;
  } catch (error) {
    throw new LoraLoadError('invalid_adapter', `${configPath}: ${(error as Error).message}`);
  }
  if (typeof config !== 'object' || config === null || Array.isArray(config)) {
    throw new LoraLoadError('invalid_adapter', `${configPath} is not a JSON object`);
  }
  const rank = config.r;
  if (typeof rank !== 'number' || !Number.isInteger(rank) || rank < 1) throw new LoraLoadError('invalid_adapter', `${configPath}: r must be a whole number >= 1`);
  const modules = typeof config.target_modules === 'string' ? [config.target_modules]
    : Array.isArray(config.target_modules) ? config.target_modules.filter((m): m is string => typeof m === 'string') : [];
  // "all-linear" (and a missing list) adapts every projection.
  const named = modules.map((m) => PEFT_TARGETS[m.split('.').pop()!]).filter((t): t is SimLoraTarget => t !== undefined);
  const targets = named.length > 0 ? SIM_LORA_TARGETS.filter((t) => named.includes(t)) : undefined;
  const alpha = typeof config.lora_alpha === 'number' ? config.lora_alpha : 0;
  return { adapter: { rank, ...(targets ? { targets } : {}) }, info: { format: 'peft', rank, alpha, bytes: 0 } };
}
