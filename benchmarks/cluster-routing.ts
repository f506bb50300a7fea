// Routing quality across processes: the KV-aware router against random placement with simulated workers as threads
// of the server's process (createWorkerPool) and as child processes over the request plane (createProcessWorkerPool,
// `conduit serve --worker-processes`), on the same workload. The KV-vs-random ratio should not depend on where the
// workers run: the router sees the same KV events, only later (over a socket instead of in-process).
//
//   node --import tsx benchmarks/cluster-routing.ts [--workers 4] [--groups 80] [--system-tokens 6000]
//        [--requests 240] [--clients 16] [--speed-up 20]
//
// Workload: G tenants each with a long system prompt (together more than one worker's KV pool holds), each request
// one tenant's prompt plus a fresh question (64 tokens) and 32 output tokens, closed loop of C clients. Reported per
// configuration: the prompt tokens served from the prefix cache and the mean wall-clock time to first token.

import { loadavg } from 'node:os';
import { createProcessWorkerPool } from '../src/cluster/process-pool.ts';
import { engineNow } from '../src/engine/clock.ts';
import { DEFAULT_SAMPLING, type Engine } from '../src/engine/types.ts';
import type { PolicyName } from '../src/router/protocols.ts';
import { createWorkerPool } from '../src/runtime/worker-pool.ts';
import { seededRandom } from '../src/util/random.ts';

function argument(name: string, fallback: string): string {
  const at = process.argv.indexOf(`--${name}`);
  return at >= 0 ? process.argv[at + 1]! : fallback;
}
const WORKERS = Number(argument('workers', '4'));
const GROUPS = Number(argument('groups', '80'));
const SYSTEM_TOKENS = Number(argument('system-tokens', '6000'));
const REQUESTS = Number(argument('requests', '240'));
const CLIENTS = Number(argument('clients', '16'));
const SPEED_UP = Number(argument('speed-up', '20'));

const systemPrompts = Array.from({ length: GROUPS }, (_, g) => {
  const random = seededRandom(1000 + g);
  return Array.from({ length: SYSTEM_TOKENS }, () => 100 + Math.floor(random() * 30000));
});

async function run(engine: Engine): Promise<{ cachedFraction: number; meanTtftMs: number }> {
  const random = seededRandom(42);
  const plan = Array.from({ length: REQUESTS }, () => Math.floor(random() * GROUPS));
  let next = 0;
  let prompt = 0;
  let cached = 0;
  const ttfts: number[] = [];
  await Promise.all(Array.from({ length: CLIENTS }, async () => {
    while (next < plan.length) {
      const i = next++;
      const question = Array.from({ length: 64 }, (_, k) => 200 + ((i * 131 + k * 7) % 20000));
      const start = performance.now();
      let first = true;
      for await (const output of engine.generate({
        id: `q${i}`, promptTokenIds: [...systemPrompts[plan[i]!]!, ...question], priority: 0, arrivalMs: engineNow(),
        sampling: { ...DEFAULT_SAMPLING, maxTokens: 32, ignoreEos: true, temperature: 0 },
      })) {
        if (first) {
          ttfts.push(performance.now() - start);
          first = false;
        }
        if (output.finishReason !== undefined) {
          prompt += output.usage.promptTokens;
          cached += output.usage.cachedTokens;
        }
      }
    }
  }));
  return { cachedFraction: cached / prompt, meanTtftMs: ttfts.reduce((a, b) => a + b, 0) / ttfts.length };
}

const base = {
  engine: 'sim' as const, workers: WORKERS, sim: { model: 'llama-3.1-8b', gpu: 'h100', tp: 1, speedUp: SPEED_UP }, backend: 'auto' as const,
};
const results: Record<string, Record<string, { cachedFraction: number; meanTtftMs: number }>> = { threads: {}, processes: {} };
for (const policy of ['kv', 'random'] as PolicyName[]) {
  const threads = await createWorkerPool({ ...base, routingPolicy: policy, routerSeed: 1 });
  results.threads![policy] = await run(threads.engine);
  await threads.engine.close();
  const processes = await createProcessWorkerPool({ ...base, routingPolicy: policy, routerSeed: 1 });
  results.processes![policy] = await run(processes.engine);
  await processes.engine.close();
}
for (const [where, byPolicy] of Object.entries(results)) {
  const kv = byPolicy.kv!;
  const random = byPolicy.random!;
  console.log(`${where.padEnd(9)}: kv cached ${(kv.cachedFraction * 100).toFixed(1)}% TTFT ${kv.meanTtftMs.toFixed(1)} ms | `
    + `random cached ${(random.cachedFraction * 100).toFixed(1)}% TTFT ${random.meanTtftMs.toFixed(1)} ms | `
    + `kv/random: cached x${(kv.cachedFraction / random.cachedFraction).toFixed(2)}, TTFT x${(kv.meanTtftMs / random.meanTtftMs).toFixed(2)}`);
}
const ratio = (where: string): number => results[where]!.kv!.cachedFraction / results[where]!.random!.cachedFraction;
console.log(`cache-hit ratio processes / threads: ${(ratio('processes') / ratio('threads')).toFixed(3)}; load average ${loadavg().map((l) => l.toFixed(2)).join(' ')}`);
