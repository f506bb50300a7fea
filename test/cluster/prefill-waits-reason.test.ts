// A prefill/decode frontend that has found prefill workers but no decode worker yet serves nothing, and waiting
// alone does not change that: it says so (ClusterFrontend.notServingReason, which `conduit frontend` gives as
// /health's reason and in the 503 a request gets) instead of only "loading", the model being known by then. The
// reason goes once a decode worker joins, and does not count a prefill worker lost meanwhile. Prefill workers that
// all left decide nothing any more: an aggregated worker that comes next is served, with its own model card. Real
// etcd, simulated workers started as `conduit worker` starts them.
import { describe, test } from 'node:test';
import assert from 'node:assert/strict';
import { existsSync } from 'node:fs';
import { startClusterWorker, type RunningWorker } from '../../src/cluster/worker-process.ts';
import { ETCD_BIN, freePort } from '../helpers/cluster-services.ts';
import { frontendBed } from '../helpers/frontend-bed.ts';
import { waitUntil } from '../helpers/wait-until.ts';

const skip = existsSync(ETCD_BIN) ? undefined : `needs ${ETCD_BIN} (Debian etcd-server)`;
const TOKEN = 'prefill-waits-test-token';

describe('a frontend with prefill workers and no decode worker', { skip }, () => {
  const bed = frontendBed('prefill-waits', TOKEN);

  async function startWorker(workerId: string, role: 'prefill' | 'decode' | 'both', namespace: string): Promise<RunningWorker> {
    const worker = await startClusterWorker({
      workerId, role, namespace, clusterToken: TOKEN, host: '127.0.0.1', port: await freePort(),
      etcd: { endpoints: [bed.etcdUrl] }, leaseTtlSeconds: 5,
      pool: { engine: 'sim', sim: { model: 'llama-3.1-8b', gpu: 'h100', tp: 1, speedUp: Infinity } },
      log: () => {},
    });
    bed.workers.push(worker);
    return worker;
  }

  test('says it waits for a decode worker, until one joins', { timeout: 120_000 }, async () => {
    const logs: string[] = [];
    const { frontend, namespace } = await bed.startFrontend(logs);
    assert.equal(frontend.notServingReason(), undefined, 'nothing found yet: only loading');

    await startWorker('p1', 'prefill', namespace);
    await waitUntil(() => logs.some((line) => /prefill worker p1 waits for a decode worker/.test(line)), 'p1 joined', 20_000);
    assert.equal(frontend.notServingReason(), '1 prefill worker has joined, but no decode worker: prefill and decode workers are '
      + 'served from when the first decode worker (conduit worker --role decode) joins');
    const p2 = await startWorker('p2', 'prefill', namespace);
    await waitUntil(() => logs.some((line) => /prefill worker p2 waits for a decode worker/.test(line)), 'p2 joined', 20_000);
    assert.match(frontend.notServingReason() ?? '', /^2 prefill workers have joined, but no decode worker: /);

    // A prefill worker that goes is no longer counted.
    await p2.shutdown(0);
    await waitUntil(() => /^1 prefill worker has joined/.test(frontend.notServingReason() ?? ''), 'p2 not counted', 20_000);

    await startWorker('d1', 'decode', namespace);
    await frontend.ready();
    assert.equal(frontend.notServingReason(), undefined, 'serving: nothing to explain');
  });

  test('once the prefill workers that waited have all left, an aggregated worker is served', { timeout: 120_000 }, async () => {
    const logs: string[] = [];
    const { frontend, namespace } = await bed.startFrontend(logs);
    const prefill = await startWorker('p1', 'prefill', namespace);
    await waitUntil(() => logs.some((line) => /prefill worker p1 waits for a decode worker/.test(line)), 'p1 joined', 20_000);
    const prefillTokenizer = frontend.tokenizer;
    assert.ok(prefillTokenizer, 'p1\'s model card was read');
    await prefill.shutdown(0);
    await waitUntil(() => frontend.notServingReason() === undefined && frontend.workerViews().length === 0, 'p1 left', 20_000);

    // Nothing serves prefill and decode any more: the next worker decides again, as the first one did.
    await startWorker('a1', 'both', namespace);
    const engine = await frontend.ready();
    assert.equal(engine, frontend.engine, 'aggregated');
    await waitUntil(() => frontend.engine?.workerIds.includes('a1') === true, 'a1 routed to', 20_000);
    assert.ok(!logs.some((line) => /worker a1: .*not routed to/.test(line)), logs.join('\n'));
    // Its own model card, not the one of the worker that left (it may serve another model).
    assert.ok(frontend.tokenizer && frontend.tokenizer !== prefillTokenizer);
  });
});
