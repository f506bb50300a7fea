// Routing quality: what KV-aware routing buys on a multi-tenant workload with long shared system prompts, against
// round-robin, random and least-loaded placement, on 8 simulated Llama 3.1 8B workers on H100s.
//
//   node --import tsx benchmarks/routing-quality.ts [--groups 150] [--system-tokens 6000] [--question-tokens 256]
//        [--output-tokens 128] [--workers 8] [--stages 20:10,40:10,...,160:10] [--seed 1] [--policies kv,round-robin,...]
//        [--skip-sim] [--skip-live] [--live-requests 1024] [--live-streams 256]
//
// Part 1, simulated cluster (deterministic; virtual time, as fast as the host computes it). SimCluster drives one
// SimWorker per GPU: the real scheduler and paged KV cache with prefix caching, step times from the performance
// model. Every policy is the real Router with that policy name, fed the way `conduit serve` feeds it: the workers'
// KV events (applyKvEvents), their load after each step (updateLoad), first tokens (onPrefillDone) and finishes
// (onFinished), with its admission queue drained as load drops. `kv` is the cost function over the KV index plus
// the router's speculative inserts; the others ignore the index. Same arrivals and prompts for every policy.
//
// The workload mirrors llm-d's "KV-cache wins you can see" benchmark: G tenants, each with its own long system
// prompt, each request a fresh question under a tenant drawn uniformly, Poisson arrivals whose rate steps up stage
// by stage until the cluster saturates. The G prompts together are more than one worker's KV pool holds, so a
// policy that scatters a tenant over all workers evicts and recomputes prompts; one that keeps it on the worker
// holding its prompt computes only the question.
//
// Part 2, live (wall clock): the router's decision time on the whole gateway -> router -> scheduler path with 256
// concurrent streams: `conduit serve`'s pieces (ApiServer over createWorkerPool with 8 simulated workers behind the
// kv router, virtual time infinitely fast so the engine costs only its CPU) driven by `conduit bench`'s load
// generator over HTTP from the same process. Each request's decision time comes from the router itself (hashing,
// index lookup, selection, timed with performance.now() in route()); decisions that overlapped a garbage-collection
// pause are counted apart, since wall time on a shared host has tails that are not the router's work.

import { loadavg } from 'node:os';
import { PerformanceObserver } from 'node:perf_hooks';
import { KeyStore } from '../src/api/auth.ts';
import { ApiServer } from '../src/api/server.ts';
import { runLoad } from '../src/bench/load-generator.ts';
import { formatTable } from '../src/bench/tables.ts';
import { distribution, type Distribution } from '../src/util/stats.ts';
import { sharedPrefixWorkload } from '../src/bench/prompt-workload.ts';
import { seededRandom, Xoshiro128 } from '../src/util/random.ts';
import { DEFAULT_SAMPLING, type Engine, type EngineOutput, type EngineRequest } from '../src/engine/types.ts';
import { POLICY_NAMES, type PolicyName } from '../src/router/protocols.ts';
import { workerLoadFromStats } from '../src/protocols/worker.ts';
import { Router } from '../src/router/router.ts';
import { createWorkerPool } from '../src/runtime/worker-pool.ts';
import { SimCluster, summarizeRequests, type SimRequestResult } from '../src/sim/cluster.ts';
import { getHardwareProfile } from '../src/sim/hardware.ts';
import { getModelProfile } from '../src/sim/models.ts';
import { simKvBlocks, type SimWorkerConfig } from '../src/sim/sim-worker.ts';

function argument(name: string, fallback: string): string {
  const at = process.argv.indexOf(`--${name}`);
  return at >= 0 ? process.argv[at + 1]! : fallback;
}

const NUM_GROUPS = Number(argument('groups', '150'));
const SYSTEM_TOKENS = Number(argument('system-tokens', '6000'));
const QUESTION_TOKENS = Number(argument('question-tokens', '256'));
const OUTPUT_TOKENS = Number(argument('output-tokens', '128'));
const NUM_WORKERS = Number(argument('workers', '8'));
const SEED = Number(argument('seed', '1'));
/** rate (req/s) : duration (s) per stage. */
const STAGES = argument('stages', '20:10,40:10,60:10,80:10,100:10,120:10,140:10,160:10').split(',').map((stage) => {
  const [rate, seconds] = stage.split(':').map(Number);
  if (!(rate! > 0) || !(seconds! > 0)) throw new RangeError(`--stages expects rate:seconds pairs, got "${stage}"`);
  return { rate: rate!, seconds: seconds! };
});
const POLICIES = argument('policies', 'kv,round-robin,random,least-loaded').split(',') as PolicyName[];
for (const policy of POLICIES) if (!POLICY_NAMES.includes(policy)) throw new RangeError(`unknown policy ${policy}`);
const SKIP_LIVE = process.argv.includes('--skip-live');
const SKIP_SIM = process.argv.includes('--skip-sim');
const LIVE_STREAMS = Number(argument('live-streams', '256'));
const LIVE_REQUESTS = Number(argument('live-requests', '1024'));

/** llm-d, precise prefix-cache-aware scheduling vs random scheduling, 8 vLLM pods on 16 H100s (their blog post). */
const LLM_D = { throughputRatio: 1.97, ttftP90Ratio: 170 };

const model = getModelProfile('llama-3.1-8b');
const hw = getHardwareProfile('h100');
const workerConfig: SimWorkerConfig = { model, hw, tp: 1, enableKvEvents: true };
const BLOCK_SIZE = 16;

// ---------------------------------------------------------------------------------------------------------------
// Workload: the same for every policy

interface Arrival {
  request: EngineRequest;
  group: number;
  stage: number;
}

function buildWorkload(): Arrival[] {
  const arrivalsRng = Xoshiro128.fromSeed(SEED, 0);
  const tokensRng = Xoshiro128.fromSeed(SEED, 1);
  // Token ids below the special-token range of the 128k vocabulary; the tenant's prompts differ from the first token.
  const draw = () => tokensRng.nextUint32() % 120_000;
  const systemPrompts = Array.from({ length: NUM_GROUPS }, () => Array.from({ length: SYSTEM_TOKENS }, draw));
  const arrivals: Arrival[] = [];
  let stageStartMs = 0;
  let timeMs = 0;
  for (const [stage, { rate, seconds }] of STAGES.entries()) {
    const stageEndMs = stageStartMs + seconds * 1000;
    timeMs = stageStartMs;
    for (;;) {
      timeMs += (-Math.log(1 - arrivalsRng.nextFloat()) / rate) * 1000;
      if (timeMs >= stageEndMs) break;
      const group = Math.floor(arrivalsRng.nextFloat() * NUM_GROUPS);
      const i = arrivals.length;
      arrivals.push({
        group, stage,
        request: {
          id: `r${i}`,
          promptTokenIds: [...systemPrompts[group]!, ...Array.from({ length: QUESTION_TOKENS }, draw)],
          sampling: { ...DEFAULT_SAMPLING, maxTokens: OUTPUT_TOKENS, seed: i },
          priority: 0,
          arrivalMs: timeMs,
        },
      });
    }
    stageStartMs = stageEndMs;
  }
  return arrivals;
}

// ---------------------------------------------------------------------------------------------------------------
// One policy on the simulated cluster

interface PolicyRun {
  policy: PolicyName;
  requests: SimRequestResult[];
  endMs: number;
  routeUs: number[];
  numQueued: number;
  numRejected: number;
  preemptions: number;
  wallSec: number;
}

function runPolicy(policy: PolicyName, arrivals: readonly Arrival[]): PolicyRun {
  const started = performance.now();
  const router = new Router({
    blockSize: BLOCK_SIZE, policy, random: seededRandom(SEED), clock: () => performance.now(),
    // Nothing is shed or timed out here: a policy that overloads its workers shows it as queueing delay in TTFT.
    maxQueued: 1_000_000, maxQueueWaitMs: Number.MAX_SAFE_INTEGER,
  });
  const workerIds = Array.from({ length: NUM_WORKERS }, (_, i) => `sim-${i}`);
  const indexOf = new Map(workerIds.map((id, i) => [id, i]));
  for (const id of workerIds) router.addWorker(id);
  const held = new Map<string, EngineRequest>();
  const routeUs: number[] = [];
  const prefilled = new Set<string>();
  /** Workers that ran a step since their load was last reported (reported once per instant, not per output). */
  const stale = new Set<number>();

  // The load view RoutedEngine gives the router in `conduit serve`: the engine's stats (KV blocks in use, running
  // and waiting requests), pending prefill left to the router's own accounting.
  const refreshLoads = () => {
    for (const index of stale) router.updateLoad(workerIds[index]!, workerLoadFromStats(cluster.workers[index]!.stats()));
    stale.clear();
  };
  const drain = (nowMs: number) => {
    if (held.size === 0) return;
    refreshLoads();
    const { routed } = router.drainQueue(nowMs);
    for (const { request, decision } of routed) {
      const engineRequest = held.get(request.requestId)!;
      held.delete(request.requestId);
      routeUs.push(decision.overhead.totalUs);
      cluster.dispatch(indexOf.get(decision.workerId)!, engineRequest);
    }
  };

  const cluster: SimCluster = new SimCluster({
    workers: workerIds.map(() => workerConfig),
    route: (request, { nowMs }) => {
      refreshLoads();
      const outcome = router.route({ requestId: request.id, tokenIds: request.promptTokenIds }, nowMs);
      if (outcome.kind === 'routed') {
        routeUs.push(outcome.decision.overhead.totalUs);
        return indexOf.get(outcome.decision.workerId)!;
      }
      if (outcome.kind === 'queued') held.set(request.id, request);
      return null;
    },
    onKvEvents: (workerIndex, events) => {
      router.applyKvEvents(workerIds[workerIndex]!, events);
    },
    onOutput: (workerIndex, output: EngineOutput, nowMs) => {
      stale.add(workerIndex);
      if (output.newTokenIds.length > 0 && !prefilled.has(output.requestId)) {
        prefilled.add(output.requestId);
        router.onPrefillDone(output.requestId);
      }
      if (output.finishReason !== undefined) {
        router.onFinished(output.requestId, nowMs);
        prefilled.delete(output.requestId);
        drain(nowMs);
      }
    },
  });
  const result = cluster.run(arrivals.map((a) => a.request));
  const stats = router.stats();
  return {
    policy, requests: result.requests, endMs: result.endMs, routeUs, numQueued: stats.numEnqueued, numRejected: stats.numRejected,
    preemptions: result.workers.reduce((sum, w) => sum + w.stats.preemptions, 0),
    wallSec: (performance.now() - started) / 1000,
  };
}

// ---------------------------------------------------------------------------------------------------------------
// Reports

const f = (value: number, decimals = 2) => (Number.isFinite(value) ? value.toFixed(decimals) : '-');
const seconds = (ms: number) => f(ms / 1000, 2);

function policyRow(run: PolicyRun): string[] {
  const s = summarizeRequests(run.requests);
  const unfinished = run.requests.length - s.numRequests;
  const route = distribution(run.routeUs);
  return [
    run.policy, String(s.numRequests), String(unfinished), seconds(run.endMs), f(s.outputTokensPerSec, 0), seconds(s.ttftMs.p50),
    seconds(s.ttftMs.p90), seconds(s.ttftMs.p99), f(s.itlMs.p50), seconds(s.e2eMs.p90), `${(s.prefixHitRate * 100).toFixed(1)}%`,
    String(run.preemptions), String(run.numQueued), f(route.p50, 1), f(run.wallSec, 1),
  ];
}

function stageTable(runs: readonly PolicyRun[], arrivals: readonly Arrival[]): string {
  const stageOf = new Map(arrivals.map((a) => [a.request.id, a.stage]));
  const rows = STAGES.map((stage, index) => {
    const cells = [`${stage.rate} req/s x ${stage.seconds} s`];
    for (const run of runs) {
      const inStage = run.requests.filter((r) => stageOf.get(r.id) === index);
      const s = summarizeRequests(inStage);
      cells.push(seconds(s.ttftMs.p90), `${(s.prefixHitRate * 100).toFixed(0)}%`);
    }
    return cells;
  });
  return formatTable(['stage', ...runs.flatMap((r) => [`${r.policy} TTFT p90 s`, 'hit'])], rows);
}

function ratioTable(runs: readonly PolicyRun[]): string {
  const kv = runs.find((r) => r.policy === 'kv');
  if (!kv) return '(no kv run: no ratios)';
  const kvSummary = summarizeRequests(kv.requests);
  const others = runs.filter((r) => r !== kv);
  const header = ['kv vs ...', 'llm-d (precise vs random)', ...others.map((r) => r.policy)];
  const throughput = ['throughput (output tok/s) ratio', `${LLM_D.throughputRatio.toFixed(2)}x`];
  const ttft = ['TTFT p90 ratio (other / kv)', `~${LLM_D.ttftP90Ratio}x`];
  const ttft50 = ['TTFT p50 ratio (other / kv)', '-'];
  for (const run of others) {
    const s = summarizeRequests(run.requests);
    throughput.push(`${f(kvSummary.outputTokensPerSec / s.outputTokensPerSec)}x`);
    ttft.push(`${f(s.ttftMs.p90 / kvSummary.ttftMs.p90, 1)}x`);
    ttft50.push(`${f(s.ttftMs.p50 / kvSummary.ttftMs.p50, 1)}x`);
  }
  return formatTable(header, [throughput, ttft, ttft50]);
}

function simulatedPart(): void {
  const arrivals = buildWorkload();
  const kvBlocks = simKvBlocks(workerConfig);
  const footprintBlocks = Math.ceil(SYSTEM_TOKENS / BLOCK_SIZE) * NUM_GROUPS;
  console.log(`Routing quality: ${NUM_WORKERS} x ${model.name} on 1 x ${hw.name} each (simulated), ${arrivals.length} requests `
    + `(${new Date().toISOString()}, load average ${loadavg().map((l) => l.toFixed(2)).join(' ')})`);
  console.log(`  workload  ${NUM_GROUPS} tenants, system prompts of ${SYSTEM_TOKENS} tokens, questions of ${QUESTION_TOKENS}, `
    + `${OUTPUT_TOKENS} output tokens; Poisson arrivals in stages ${STAGES.map((s) => `${s.rate}/s x ${s.seconds}s`).join(', ')}`);
  console.log(`  KV pool   ${kvBlocks} blocks of ${BLOCK_SIZE} per worker (${(kvBlocks * BLOCK_SIZE / 1000).toFixed(0)}k tokens); `
    + `all system prompts: ${footprintBlocks} blocks (${(footprintBlocks / kvBlocks).toFixed(2)} worker pools)`);
  const runs: PolicyRun[] = [];
  for (const policy of POLICIES) {
    const run = runPolicy(policy, arrivals);
    runs.push(run);
    console.error(`  ${policy}: simulated ${seconds(run.endMs)} s in ${f(run.wallSec, 1)} s`);
  }
  console.log('');
  console.log(formatTable(
    ['policy', 'done', 'unfinished', 'span s', 'output tok/s', 'TTFT p50 s', 'TTFT p90 s', 'TTFT p99 s', 'ITL p50 ms', 'e2e p90 s',
      'cache hit', 'preempted', 'queued', 'route p50 us', 'wall s'],
    runs.map(policyRow),
  ));
  console.log('(route p50: wall time of route() in this busy simulation process; its tail is garbage collection and the host, '
    + 'see the live measurement below)');
  console.log('\nTTFT p90 and cache hit rate by load stage (requests by arrival):');
  console.log(stageTable(runs, arrivals));
  console.log('\nRatios, kv routing against each other policy, next to llm-d\'s precise-vs-random figures:');
  console.log(ratioTable(runs));
}

// ---------------------------------------------------------------------------------------------------------------
// Part 2: decision time on the live path at 256 concurrent streams

type Overhead = { hashing: number; lookup: number; selection: number; total: number };

/** The engine as the gateway sees it, noting the router's decision carried on each request's first output. */
function recordingDecisions(inner: Engine, record: (overheadUs: Overhead, decidedAt: number) => void): Engine {
  return {
    get info() { return inner.info; },
    stats: () => inner.stats(),
    abort: (requestId) => inner.abort(requestId),
    resetPrefixCache: () => inner.resetPrefixCache(),
    close: () => inner.close(),
    generate(request) {
      const outputs = inner.generate(request);
      return (async function* () {
        let first = true;
        for await (const output of outputs) {
          if (first && output.routing) record(output.routing.overheadUs, output.routing.decidedAt);
          first = false;
          yield output;
        }
      })();
    },
  };
}

async function livePart(): Promise<void> {
  const pool = await createWorkerPool({
    engine: 'sim', workers: NUM_WORKERS, routingPolicy: 'kv', routerSeed: SEED,
    sim: { model: 'llama-3.1-8b', gpu: 'h100', tp: 1, speedUp: Infinity },
  });
  const decisions = { hashing: [] as number[], lookup: [] as number[], selection: [] as number[], total: [] as number[] };
  /** Each decision's interval on the performance.now() timeline, to set it against garbage-collection pauses. */
  const intervals: { startMs: number; endMs: number; totalUs: number }[] = [];
  const gcPauses: { startMs: number; endMs: number }[] = [];
  const gcObserver = new PerformanceObserver((list) => {
    for (const entry of list.getEntries()) gcPauses.push({ startMs: entry.startTime, endMs: entry.startTime + entry.duration });
  });
  gcObserver.observe({ entryTypes: ['gc'] });
  const router = pool.router!;
  const api = new ApiServer({ keyStore: new KeyStore({ keys: [], tenants: new Map() }, {}), maxPendingRequests: LIVE_STREAMS * 2 });
  api.attach({
    engine: recordingDecisions(pool.engine, (o, decidedAt) => {
      // decidedAt is the engine clock (timeOrigin + performance.now()) read just after route() returned.
      const endMs = decidedAt - performance.timeOrigin;
      intervals.push({ startMs: endMs - o.total / 1000, endMs, totalUs: o.total });
      decisions.hashing.push(o.hashing);
      decisions.lookup.push(o.lookup);
      decisions.selection.push(o.selection);
      decisions.total.push(o.total);
    }),
    tokenizer: pool.tokenizer, chatTemplate: pool.chatTemplate,
  });
  await api.listen(0, '127.0.0.1');
  try {
    const groups = 64;
    const systemTokens = 2048;
    const workload = sharedPrefixWorkload({ groups, systemPromptTokens: systemTokens, questionTokens: 64, seed: SEED });
    const result = await runLoad({
      url: api.url, endpoint: 'chat', workload, outputTokens: 16, stream: true, concurrency: LIVE_STREAMS,
      requests: LIVE_REQUESTS, durationSec: 120, timeoutSec: 60,
    });
    const s = result.summary;
    const stats = router.stats();
    console.log(`\nRouter decision time on the live path: ApiServer -> kv Router -> ${NUM_WORKERS} simulated workers (infinitely fast), `
      + `${LIVE_STREAMS} concurrent streams from conduit bench in the same process (load average ${loadavg().map((l) => l.toFixed(2)).join(' ')})`);
    console.log(`  workload  ${workload.description}, 16 output tokens, ${s.numOk}/${s.numRequests} ok in ${f(s.durationSec)} s `
      + `(${f(s.requestsPerSec, 0)} req/s), max in flight ${s.maxInFlight}, index ${stats.numIndexedBlocks} blocks`);
    const row = (name: string, d: Distribution) => [name, String(d.count), f(d.mean, 1), f(d.p50, 1), f(d.p90, 1), f(d.p99, 1), f(d.max, 1)];
    console.log(formatTable(['route() part, us', 'count', 'mean', 'p50', 'p90', 'p99', 'max'], [
      row('hashing', distribution(decisions.hashing)), row('index lookup', distribution(decisions.lookup)),
      row('selection', distribution(decisions.selection)), row('total', distribution(decisions.total)),
    ]));
    const total = distribution(decisions.total);
    const hitByGc = (i: { startMs: number; endMs: number }) => gcPauses.some((g) => g.startMs < i.endMs && g.endMs > i.startMs);
    const clean = distribution(intervals.filter((i) => !hitByGc(i)).map((i) => i.totalUs));
    console.log(`  target < 1 ms per decision: p99 ${f(total.p99 / 1000, 3)} ms (${total.p99 < 1000 ? 'met' : 'NOT met'}); `
      + `${decisions.total.length - clean.count} decisions overlapped one of ${gcPauses.length} garbage-collection pauses, `
      + `the other ${clean.count}: p50 ${f(clean.p50, 1)} us, p99 ${f(clean.p99, 1)} us, max ${f(clean.max, 1)} us`);
    console.log(formatTable(['client side, ms', 'count', 'mean', 'p50', 'p90', 'p99', 'max'], [
      row('TTFT', s.ttftMs), row('ITL', s.itlMs), row('end-to-end', s.e2eMs),
    ]));
    if (s.numErrors > 0) console.log(`  errors: ${JSON.stringify(s.errors)}`);
  } finally {
    gcObserver.disconnect();
    await api.shutdown(0);
  }
}

if (!SKIP_SIM) simulatedPart();
if (!SKIP_LIVE) await livePart();
