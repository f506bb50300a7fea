// KV tiers under the primary pool (src/engine/kv-cache/tiers.ts, disk-tier.ts): what a prefix costs from each place.
//
//   node --import tsx benchmarks/kv-tiers.ts [--models builtin,110m] [--prompt 2048] [--repeat 3] [--requests 48]
//
// 1. TTFT of one prompt (default 2048 tokens) on an engine worker (EngineCore on the native backend, driven as
//    worker-main drives it: a step, then the offload between steps): cold (nothing cached), from the primary pool,
//    from the RAM tier (the prompt evicted from the pool by another prompt, then onboarded), from the disk tier (no
//    RAM tier; the page cache dropped first when /proc/sys/vm/drop_caches can be written), and after a restart (a new
//    worker: fresh pool and a disk tier reopened on the same folder, page cache dropped again). TTFT here is the
//    time from adding the request to its first token (no HTTP, no queue). Best and median of --repeat runs.
// 2. Throughput of a multi-tenant shared-prefix workload whose working set is 4x the primary pool: 8 tenants, each
//    with its own system prompt of pool/2 tokens (salted per tenant), requests round-robin over tenants, each its
//    tenant's prompt plus 32 unique tokens and 8 output tokens, 4 at a time; with and without a RAM tier.
//
// Numbers on a shared machine are noisy: the load average is printed with each table.

import { mkdtempSync, readFileSync, rmSync, writeFileSync } from 'node:fs';
import { loadavg, tmpdir } from 'node:os';
import { join } from 'node:path';
import { EngineCore } from '../src/engine/engine-core.ts';
import { kvBlockBytes } from '../src/engine/handoff.ts';
import { DiskKvTier, modelFingerprint } from '../src/engine/kv-cache/disk-tier.ts';
import { KvTiers } from '../src/engine/kv-cache/tiers.ts';
import { DEFAULT_SAMPLING, type EngineRequest } from '../src/engine/types.ts';
import { nativeBackend } from '../src/kernels/native.ts';
import { loadModel, type LoadedModel } from '../src/model/loader.ts';
import { ensureBuiltinModel } from '../src/model/synthetic.ts';
import { createTokenizer } from '../src/model/tokenizer/index.ts';
import { ensureBenchModel } from './model-files.ts';

const BLOCK_SIZE = 16;

function flag(name: string, fallback: string): string {
  const at = process.argv.indexOf(`--${name}`);
  return at >= 0 && process.argv[at + 1] !== undefined ? process.argv[at + 1]! : fallback;
}

const MODELS = flag('models', 'builtin,110m').split(',');
const PROMPT = Number(flag('prompt', '2048'));
const REPEAT = Number(flag('repeat', '3'));
const REQUESTS = Number(flag('requests', '48'));
const THREADS = Number(flag('threads', '2'));

interface Model {
  name: string;
  loaded: LoadedModel;
  fingerprint: string;
}

async function load(name: string): Promise<Model> {
  const path = name === 'builtin' ? await ensureBuiltinModel() : (await ensureBenchModel('Q8_0')).path;
  const loaded = await loadModel(path);
  const { config } = loaded;
  const fingerprint = modelFingerprint(config, loaded.weights, {
    numLayers: config.numLayers, blockSize: BLOCK_SIZE, numKvHeads: config.numKvHeads, headDim: config.headDim, dtype: 'f32',
  });
  return { name: name === 'builtin' ? 'conduit-synthetic-22m Q8_0' : 'synthetic-110m Q8_0', loaded, fingerprint };
}

function makeCore(model: Model, numBlocks: number, tiers?: (blockBytes: number) => KvTiers, maxNumSeqs = 4): EngineCore {
  const runner = nativeBackend.load(model.loaded.config, model.loaded.weights, { numBlocks, blockSize: BLOCK_SIZE, dtype: 'f32' }, { threads: THREADS });
  const kvTiers = tiers?.(kvBlockBytes(runner.kvLayout));
  return new EngineCore({
    backend: runner, tokenizer: createTokenizer(model.loaded.tokenizerSource), maxNumSeqs, maxNumBatchedTokens: Math.max(2048, PROMPT),
    maxModelLen: Math.min(model.loaded.config.contextLength, numBlocks * BLOCK_SIZE), now: () => performance.now(),
    ...(kvTiers !== undefined ? { kvTiers } : {}),
  });
}

let nextId = 0;
function request(promptTokenIds: number[], maxTokens: number, cacheSalt?: string): EngineRequest {
  return {
    id: `b${nextId++}`, promptTokenIds, priority: 0, arrivalMs: Date.now(), ...(cacheSalt ? { cacheSalt } : {}),
    sampling: { ...DEFAULT_SAMPLING, temperature: 0, maxTokens, ignoreEos: true },
  };
}

function ttft(core: EngineCore, prompt: number[]): { ms: number; cached: number; ram: number; disk: number } {
  const start = performance.now();
  core.add(request(prompt, 1));
  let first: number | undefined;
  let cached = 0;
  let ram = 0;
  let disk = 0;
  while (core.hasWork) {
    for (const output of core.step()) {
      if (first === undefined && output.newTokenIds.length > 0) {
        first = performance.now() - start;
        cached = output.usage.cachedTokens;
        ram = output.timestamps.kvOnboard?.ram ?? 0;
        disk = output.timestamps.kvOnboard?.disk ?? 0;
      }
    }
    core.offloadKv();
  }
  while (core.offloadKv(undefined, Infinity) > 0) { /* idle */ }
  return { ms: first!, cached, ram, disk };
}

function tokens(seed: number, length: number, vocab: number): number[] {
  return Array.from({ length }, (_, i) => 3 + ((seed * 7919 + i * 104729 + ((i * i) % 977)) % (vocab - 3)));
}

function cachedPages(): number {
  const match = /^Cached:\s+(\d+) kB/m.exec(readFileSync('/proc/meminfo', 'utf8'));
  return match ? Number(match[1]) * 1024 : NaN;
}

/** Drops the page cache when allowed; says what happened. */
function dropPageCache(): string {
  const before = cachedPages();
  try {
    writeFileSync('/proc/sys/vm/drop_caches', '1\n');
  } catch (error) {
    return `not permitted (${(error as NodeJS.ErrnoException).code})`;
  }
  const after = cachedPages();
  return `dropped (page cache ${(before / 2 ** 20).toFixed(0)} -> ${(after / 2 ** 20).toFixed(0)} MiB)`;
}

const median = (xs: number[]) => [...xs].sort((a, b) => a - b)[Math.floor(xs.length / 2)]!;
const best = (xs: number[]) => Math.min(...xs);

async function ttftTable(model: Model): Promise<void> {
  const vocab = model.loaded.config.vocabSize;
  // A prompt must leave room for one output token within the context (2048 for both models: 2047 tokens at most).
  const promptTokens = Math.min(PROMPT, model.loaded.config.contextLength - 1);
  // Room for one prompt and two blocks; two evictors of 60% of the pool each, one after the other, evict all of it.
  const numBlocks = Math.ceil(promptTokens / BLOCK_SIZE) + 2;
  const evictorTokens = Math.min(Math.ceil(0.6 * numBlocks * BLOCK_SIZE), promptTokens);
  const rows = new Map<string, { ms: number[]; note: string }>();
  const record = (name: string, run: { ms: number; cached: number; ram: number; disk: number }, note = '') => {
    const row = rows.get(name) ?? { ms: [], note: '' };
    row.ms.push(run.ms);
    row.note = `cached ${run.cached}, onboarded ram ${run.ram} / disk ${run.disk} blocks${note ? `, ${note}` : ''}`;
    rows.set(name, row);
  };
  for (let r = 0; r < REPEAT; r++) {
    const prompt = tokens(1000 + r, promptTokens, vocab);
    const evict = (core: EngineCore) => {
      ttft(core, tokens(2000 + 2 * r, evictorTokens, vocab));
      ttft(core, tokens(2001 + 2 * r, evictorTokens, vocab));
    };
    const ram = makeCore(model, numBlocks, (blockBytes) => new KvTiers({ blockBytes, ramBytes: 4 * numBlocks * blockBytes, windowBlocks: 2 * numBlocks }));
    record('cold', ttft(ram, prompt));
    record('primary pool', ttft(ram, prompt));
    evict(ram);
    record('RAM tier', ttft(ram, prompt));

    const dir = mkdtempSync(join(tmpdir(), 'conduit-kv-bench-'));
    try {
      const diskTiers = (blockBytes: number) => new KvTiers({
        blockBytes, windowBlocks: 2 * numBlocks,
        disk: new DiskKvTier({ dir, capacityBytes: 4 * numBlocks * (112 + blockBytes), blockBytes, fingerprint: model.fingerprint, maxPendingBytes: 1 << 30 }),
      });
      const disk = makeCore(model, numBlocks, diskTiers);
      ttft(disk, prompt);
      await disk.kv.tiers!.flush();
      evict(disk);
      await disk.kv.tiers!.flush();
      const dropped = dropPageCache();
      record('disk tier', ttft(disk, prompt), `page cache ${dropped}`);
      await disk.kv.tiers!.flush();
      const restarted = makeCore(model, numBlocks, diskTiers);
      const droppedAgain = dropPageCache();
      record('after restart (disk)', ttft(restarted, prompt), `page cache ${droppedAgain}`);
    } finally {
      rmSync(dir, { recursive: true, force: true });
    }
  }
  console.log(`\n## TTFT of a ${promptTokens}-token prompt, ${model.name} (${THREADS} threads, ${REPEAT} runs, load average ${loadavg()[0]!.toFixed(1)})\n`);
  console.log('| prefix from | best ms | median ms | |');
  console.log('|---|---:|---:|---|');
  for (const [name, row] of rows) console.log(`| ${name} | ${best(row.ms).toFixed(1)} | ${median(row.ms).toFixed(1)} | ${row.note} |`);
}

function throughput(model: Model, withTiers: boolean): { seconds: number; computed: number; cached: number; onboarded: number } {
  const vocab = model.loaded.config.vocabSize;
  const poolBlocks = 64;
  const tenants = 8;
  const prefixTokens = (poolBlocks * BLOCK_SIZE) / 2; // 8 tenants x pool/2 = 4x the pool
  const prefixes = Array.from({ length: tenants }, (_, t) => tokens(3000 + t, prefixTokens, vocab));
  const core = makeCore(model, poolBlocks, withTiers
    ? (blockBytes) => new KvTiers({ blockBytes, ramBytes: 6 * poolBlocks * blockBytes, windowBlocks: 2 * Math.ceil(2048 / BLOCK_SIZE) })
    : undefined, 4);
  let computed = 0;
  let cached = 0;
  let onboarded = 0;
  const start = performance.now();
  let added = 0;
  let running = 0;
  const finished = new Set<string>();
  while (added < REQUESTS || core.hasWork) {
    while (added < REQUESTS && running < 4) {
      const t = added % tenants;
      const prompt = [...prefixes[t]!, ...tokens(5000 + added, 32, vocab)];
      core.add(request(prompt, 8, `tenant-${t}`));
      added++;
      running++;
    }
    for (const output of core.step()) {
      if (output.finishReason !== undefined && !finished.has(output.requestId)) {
        finished.add(output.requestId);
        running--;
        cached += output.usage.cachedTokens;
        computed += output.usage.promptTokens - output.usage.cachedTokens;
        onboarded += (output.timestamps.kvOnboard?.ram ?? 0) + (output.timestamps.kvOnboard?.disk ?? 0);
      }
    }
    core.offloadKv();
  }
  return { seconds: (performance.now() - start) / 1000, computed, cached, onboarded };
}

function throughputTable(model: Model): void {
  console.log(`\n## Multi-tenant shared prefix, working set 4x the primary pool, ${model.name} (${REQUESTS} requests, load average ${loadavg()[0]!.toFixed(1)})\n`);
  console.log('| tiers | requests/s | s | prompt tokens computed | cached | blocks onboarded |');
  console.log('|---|---:|---:|---:|---:|---:|');
  const runs: [string, boolean][] = [['none', false], ['RAM tier', true], ['none (again)', false], ['RAM tier (again)', true]];
  for (const [name, withTiers] of runs) {
    const r = throughput(model, withTiers);
    console.log(`| ${name} | ${(REQUESTS / r.seconds).toFixed(2)} | ${r.seconds.toFixed(1)} | ${r.computed} | ${r.cached} | ${r.onboarded} |`);
  }
}

if (!nativeBackend.available()) {
  console.error('kv-tiers benchmark: needs the native addon (npm run build:native)');
  process.exit(1);
}
for (const name of MODELS) {
  const model = await load(name);
  await ttftTable(model);
  if (flag('throughput', 'builtin').split(',').includes(name)) throughputTable(model);
}
