// KV index lookup time: findMatches p50 / p99 with many workers and a million indexed blocks, plus a whole routing
// decision (hashing, lookup, cost terms for every worker, selection) for comparison.
//
//   node --import tsx benchmarks/router.ts [--blocks 1000000] [--workers 8,64,256] [--samples 20000] [--passes 3]
//                                          [--index bitset|hashset|both]
//
// The index holds `blocks` distinct block hashes (real chained SHA-256 hashes, blocks of 16 tokens):
//   - 32 system prompts of 32 blocks, each held by a random half of the workers;
//   - conversations of 64 blocks continuing a system prompt, each held (with its system prompt) by one worker,
//     one in ten by two, as many as it takes to reach `blocks`.
// Queries:
//   typical  a system prompt + the first 0..64 blocks of a conversation + 32 blocks nobody holds (128 blocks at most,
//            2048 tokens): several workers match the system prompt, one goes deeper.
//   worst    a 256-block prefix every worker holds: every bitset word stays live for the whole walk.
// Each sample times one findMatches call with the monotonic clock. The table also gives the mean CPU time per call
// next to the mean wall time: when they differ, the process spent part of the run waiting for a core.

import { encodeExtraKeys, hashBlock } from '../src/protocols/block-hash.ts';
import type { BlockHash, KvEvent } from '../src/protocols/kv-events.ts';
import { BitsetKvIndex, HashSetKvIndex } from '../src/router/kv-index.ts';
import type { KvIndex } from '../src/router/kv-index.ts';
import { seededRandom, randomIndex } from '../src/util/random.ts';
import { Router } from '../src/router/router.ts';

function argument(name: string, fallback: string): string {
  const at = process.argv.indexOf(`--${name}`);
  return at >= 0 ? process.argv[at + 1]! : fallback;
}

const NUM_BLOCKS = Number(argument('blocks', '1000000'));
const WORKER_COUNTS = argument('workers', '8,64,256').split(',').map(Number);
const NUM_SAMPLES = Number(argument('samples', '20000'));
const INDEX_KINDS = argument('index', 'bitset') === 'both' ? ['bitset', 'hashset'] : [argument('index', 'bitset')];
const BLOCK_SIZE = 16;
const SYSTEM_PROMPTS = 32;
const SYSTEM_BLOCKS = 32;
const CONVERSATION_BLOCKS = 64;
const FRESH_BLOCKS = 32;
const HOT_BLOCKS = 256;
const WARMUP_SAMPLES = 2000;
const PASSES = Number(argument('passes', '3'));

const random = seededRandom(2024);
const extraKeys = encodeExtraKeys();
const blockTokens = new Array<number>(BLOCK_SIZE).fill(0);

/** A chain of real block hashes continuing `parent`, over pseudo-random tokens (appended to `keepTokens`). */
function chain(parent: BlockHash | null, numBlocks: number, keepTokens?: number[]): BlockHash[] {
  const out: BlockHash[] = [];
  for (let i = 0; i < numBlocks; i++) {
    for (let t = 0; t < BLOCK_SIZE; t++) blockTokens[t] = randomIndex(random, 32_000);
    keepTokens?.push(...blockTokens);
    parent = hashBlock(parent, blockTokens, 0, BLOCK_SIZE, extraKeys);
    out.push(parent);
  }
  return out;
}

// ---------------------------------------------------------------------------------------------------------------
// Data (the same hashes for every worker count)

const startedMs = performance.now();
const systemTokens = Array.from({ length: SYSTEM_PROMPTS }, (): number[] => []);
const systemPrompts = systemTokens.map((keep) => chain(null, SYSTEM_BLOCKS, keep));
/** Tokens of the first conversations, for whole routing decisions on prompts the index partly holds. */
const NUM_ROUTED_CONVERSATIONS = 64;
const conversationTokens = Array.from({ length: NUM_ROUTED_CONVERSATIONS }, (): number[] => []);
const numConversations = Math.max(1, Math.ceil((NUM_BLOCKS - SYSTEM_PROMPTS * SYSTEM_BLOCKS) / CONVERSATION_BLOCKS));
const conversations = Array.from({ length: numConversations }, (_, i) => {
  const system = i % SYSTEM_PROMPTS;
  return { system, blocks: chain(systemPrompts[system]!.at(-1)!, CONVERSATION_BLOCKS, conversationTokens[i]) };
});
const hot = chain(null, HOT_BLOCKS);
const freshTails = Array.from({ length: 256 }, () => chain(null, FRESH_BLOCKS));
const numDistinct = SYSTEM_PROMPTS * SYSTEM_BLOCKS + numConversations * CONVERSATION_BLOCKS;
console.log(`hashed ${numDistinct + HOT_BLOCKS + 256 * FRESH_BLOCKS} blocks in ${((performance.now() - startedMs) / 1000).toFixed(1)} s`);

/**
 * A request's hashes are computed from its own tokens, so they are other string objects than the ones the index
 * was fed (which came from events): copies, so that no lookup gets away with comparing pointers.
 */
function copyOf(hash: BlockHash): BlockHash {
  return Buffer.from(hash, 'latin1').toString('latin1') as BlockHash;
}

const typicalQueries = Array.from({ length: 4096 }, () => {
  const conversation = conversations[randomIndex(random, conversations.length)]!;
  const depth = randomIndex(random, CONVERSATION_BLOCKS + 1);
  return [...systemPrompts[conversation.system]!, ...conversation.blocks.slice(0, depth), ...freshTails[randomIndex(random, freshTails.length)]!]
    .map(copyOf);
});
const hotQuery = hot.map(copyOf);

function stored(eventId: number, blockHashes: BlockHash[]): KvEvent {
  return { type: 'stored', eventId, blockHashes, parentHash: null, tokenCount: blockHashes.length * BLOCK_SIZE, blockSize: BLOCK_SIZE };
}

function buildIndex(kind: string, numWorkers: number): { index: KvIndex; buildMs: number } {
  const index: KvIndex = kind === 'hashset' ? new HashSetKvIndex() : new BitsetKvIndex();
  const eventIds = new Array<number>(numWorkers).fill(0);
  const store = (worker: number, blockHashes: BlockHash[]) => {
    index.applyEvent(`worker-${worker}`, stored(++eventIds[worker]!, blockHashes));
  };
  const start = performance.now();
  for (const system of systemPrompts) {
    for (let w = 0; w < numWorkers; w++) if (random() < 0.5) store(w, system);
  }
  // A worker holding a conversation holds its system prompt too (it computed both).
  conversations.forEach((conversation, i) => {
    const primary = i % numWorkers;
    const blocks = [...systemPrompts[conversation.system]!, ...conversation.blocks];
    store(primary, blocks);
    if (i % 10 === 0 && numWorkers > 1) store((primary + 1 + randomIndex(random, numWorkers - 1)) % numWorkers, blocks);
  });
  for (let w = 0; w < numWorkers; w++) store(w, hot);
  return { index, buildMs: performance.now() - start };
}

// ---------------------------------------------------------------------------------------------------------------
// Timing

function percentiles(samplesNs: Float64Array): { p50: number; p99: number } {
  const sorted = samplesNs.slice().sort();
  return { p50: sorted[Math.floor(0.5 * sorted.length)]! / 1000, p99: sorted[Math.floor(0.99 * sorted.length)]! / 1000 };
}

interface Timing {
  p50: number;
  p99: number;
  /** Mean process CPU time per call: close to the mean wall time unless the process was waiting for a core. */
  cpuMean: number;
  wallMean: number;
}

/**
 * Times fn over the queries round-robin, in microseconds. PASSES passes of NUM_SAMPLES calls; each percentile is
 * the lowest over the passes, which filters the bursts of other processes on a shared machine without hiding
 * what the code itself does (a slow call that is slow every time stays in every pass).
 */
function time(queries: readonly BlockHash[][], fn: (query: BlockHash[]) => unknown): Timing {
  let sink = 0;
  for (let i = 0; i < WARMUP_SAMPLES; i++) sink += fn(queries[i % queries.length]!) === undefined ? 0 : 1;
  const best: Timing = { p50: Infinity, p99: Infinity, cpuMean: Infinity, wallMean: Infinity };
  const samples = new Float64Array(NUM_SAMPLES);
  for (let pass = 0; pass < PASSES; pass++) {
    const cpuStart = process.cpuUsage();
    const wallStart = process.hrtime.bigint();
    for (let i = 0; i < NUM_SAMPLES; i++) {
      const query = queries[i % queries.length]!;
      const start = process.hrtime.bigint();
      sink += fn(query) === undefined ? 0 : 1;
      samples[i] = Number(process.hrtime.bigint() - start);
    }
    const wallMean = Number(process.hrtime.bigint() - wallStart) / 1000 / NUM_SAMPLES;
    const cpu = process.cpuUsage(cpuStart);
    const { p50, p99 } = percentiles(samples);
    best.p50 = Math.min(best.p50, p50);
    best.p99 = Math.min(best.p99, p99);
    best.cpuMean = Math.min(best.cpuMean, (cpu.user + cpu.system) / NUM_SAMPLES);
    best.wallMean = Math.min(best.wallMean, wallMean);
  }
  if (sink < 0) console.log(sink);
  return best;
}

/** The cost of reading the clock twice, for scale. */
const clockOverhead = time([[]], () => 0);

interface Row {
  index: string;
  workers: number;
  blocks: number;
  entries: number;
  buildS: string;
  heapMb: number;
  typicalP50: string;
  typicalP99: string;
  typicalCpuWall: string;
  worstP50: string;
  worstP99: string;
  routeP50: string;
  routeP99: string;
}

const rows: Row[] = [];
const fmt = (us: number) => us.toFixed(2);
for (const kind of INDEX_KINDS) {
  for (const numWorkers of WORKER_COUNTS) {
    globalThis.gc?.();
    const { index, buildMs } = buildIndex(kind, numWorkers);
    globalThis.gc?.();
    const typical = time(typicalQueries, (query) => index.findMatches(query));
    const worst = time([hotQuery], (query) => index.findMatches(query));
    // A whole decision for a 2048-token prompt (a system prompt, a conversation, 512 new tokens), hashing included,
    // without committing it.
    const router = new Router({ blockSize: BLOCK_SIZE, random: seededRandom(1), index });
    for (let w = 0; w < numWorkers; w++) router.addWorker(`worker-${w}`);
    const prompts = conversationTokens.map((tokens, i) => [
      ...systemTokens[conversations[i]!.system]!, ...tokens, ...Array.from({ length: 512 }, (_, t) => (i * 7919 + t * 31) % 32_000),
    ]);
    const check = router.route({ requestId: 'check', tokenIds: prompts[0]! }, 0, { commit: false });
    if (check.kind !== 'routed' || check.decision.overlapBlocks !== SYSTEM_BLOCKS + CONVERSATION_BLOCKS) {
      throw new Error(`the routed prompts should match ${SYSTEM_BLOCKS + CONVERSATION_BLOCKS} blocks deep: ${JSON.stringify(check).slice(0, 200)}`);
    }
    let requestNo = 0;
    const route = time(prompts.map(() => []), () => {
      const tokenIds = prompts[requestNo % prompts.length]!;
      return router.route({ requestId: `bench-${requestNo++}`, tokenIds }, 0, { commit: false });
    });
    rows.push({
      index: kind, workers: numWorkers, blocks: index.numBlocks, entries: index.numEntries, buildS: (buildMs / 1000).toFixed(1),
      heapMb: Math.round(process.memoryUsage().heapUsed / 2 ** 20),
      typicalP50: fmt(typical.p50), typicalP99: fmt(typical.p99), typicalCpuWall: `${fmt(typical.cpuMean)} / ${fmt(typical.wallMean)}`, worstP50: fmt(worst.p50), worstP99: fmt(worst.p99),
      routeP50: fmt(route.p50), routeP99: fmt(route.p99),
    });
  }
}

console.log(`\nfindMatches, µs per call (lowest of ${PASSES} passes of ${NUM_SAMPLES} calls; clock read pair p50 ${fmt(clockOverhead.p50)} µs)`);
console.log('typical: <= 128-block query, one worker deep; worst: 256-block prefix held by every worker');
console.log('route: a whole decision for a 2048-token prompt: 128 blocks hashed, matched 96 deep, cost terms for every worker\n');
const header = ['index', 'workers', 'blocks', 'entries', 'build s', 'heap MB', 'typical p50', 'typical p99', 'typical cpu/wall mean',
  'worst p50', 'worst p99', 'route p50', 'route p99'];
const table = rows.map((row) => [row.index, row.workers, row.blocks, row.entries, row.buildS, row.heapMb, row.typicalP50,
  row.typicalP99, row.typicalCpuWall, row.worstP50, row.worstP99, row.routeP50, row.routeP99].map(String));
const widths = header.map((title, i) => Math.max(title.length, ...table.map((cells) => cells[i]!.length)));
const line = (cells: string[]) => cells.map((cell, i) => cell.padStart(widths[i]!)).join('  ');
console.log(line(header));
console.log(widths.map((width) => '-'.repeat(width)).join('  '));
for (const cells of table) console.log(line(cells));
