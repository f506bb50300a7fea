// The first workers a frontend finds decide what it serves: aggregated workers (role both) or prefill and decode
// workers, never both. Two first workers of different kinds that join at the same moment must end as they would one
// after the other: the one whose join completes first decides, the other is not routed to. Real etcd
// (/usr/bin/etcd) on a free loopback port, sim workers started as `conduit worker` starts them, each behind a TCP
// relay on 127.0.0.1 that can hold what the frontend sends after the worker's welcome: the model-card request a
// frontend makes before it joins its first worker. Both joins are held there (the test waits until both requests
// are held), then released one at a time: the joins overlap, and which completes first is fixed. The same pair joined
// one after the other, on another frontend, gives the outcome to compare with.
import { describe, test } from 'node:test';
import assert from 'node:assert/strict';
import { existsSync } from 'node:fs';
import type { ClusterFrontend } from '../../src/cluster/frontend.ts';
import { startClusterWorker } from '../../src/cluster/worker-process.ts';
import type { WorkerRole } from '../../src/engine/types.ts';
import { ETCD_BIN, freePort } from '../helpers/cluster-services.ts';
import { frontendBed } from '../helpers/frontend-bed.ts';
import { startTcpRelay, type TcpRelay } from '../helpers/tcp-relay.ts';
import { waitUntil } from '../helpers/wait-until.ts';

const skip = existsSync(ETCD_BIN) ? undefined : `needs ${ETCD_BIN} (Debian etcd-server)`;
const TOKEN = 'join-race-test-token';

/** What a frontend ended up serving, and which workers it routes to. */
interface Outcome {
  mode: 'aggregated' | 'disaggregated' | 'waiting for a decode worker' | 'none' | 'both engines';
  routed: string[];
  refused: string[];
}

describe('two first workers of different kinds joining at once', { skip }, () => {
  const bed = frontendBed('join-race', TOKEN);

  /** A worker behind a relay of its own (it advertises the relay's address), holding from the start when asked. */
  async function startWorker(namespace: string, workerId: string, role: WorkerRole, held: boolean): Promise<TcpRelay> {
    const port = await freePort();
    const relay = await startTcpRelay(port);
    bed.relays.push(relay);
    relay.hold(held);
    bed.workers.push(await startClusterWorker({
      workerId, role, namespace, clusterToken: TOKEN, host: '127.0.0.1', port, advertiseAddress: relay.address,
      etcd: { endpoints: [bed.etcdUrl] }, leaseTtlSeconds: 5,
      pool: { engine: 'sim', sim: { model: 'llama-3.1-8b', gpu: 'h100', tp: 1, speedUp: Infinity } },
      log: () => {},
    }));
    return relay;
  }

  /** The frontend took the worker (it joined, or waits for a decode worker) or refused it. */
  const decided = (logs: string[], id: string) => logs.some((l) => l.startsWith(`info worker ${id} joined`)
    || (l.startsWith(`warn worker ${id}: `) && l.endsWith('not routed to')));

  function outcome(frontend: ClusterFrontend, logs: string[], ids: string[]): Outcome {
    const aggregated = frontend.engine;
    const disaggregated = frontend.disaggregated;
    const routed = aggregated?.workerIds ?? [...disaggregated?.prefillWorkerIds ?? [], ...disaggregated?.decodeWorkerIds ?? []];
    const waiting = ids.filter((id) => logs.includes(`info prefill worker ${id} waits for a decode worker`));
    return {
      mode: aggregated && disaggregated ? 'both engines' : aggregated ? 'aggregated' : disaggregated ? 'disaggregated'
        : waiting.length > 0 ? 'waiting for a decode worker' : 'none',
      routed: [...routed, ...waiting].sort(),
      refused: ids.filter((id) => logs.some((l) => l.startsWith(`warn worker ${id}: `) && l.endsWith('not routed to'))),
    };
  }

  /** `first` joins, then `second`, each once the frontend has decided about the one before. */
  async function oneAfterTheOther(first: [string, WorkerRole], second: [string, WorkerRole]): Promise<Outcome> {
    const logs: string[] = [];
    const { frontend, namespace } = await bed.startFrontend(logs);
    for (const [id, role] of [first, second]) {
      await startWorker(namespace, id, role, false);
      await waitUntil(() => decided(logs, id), `the frontend decided about ${id}`, 20_000);
    }
    return outcome(frontend, logs, [first[0], second[0]]);
  }

  /** Both join at once: both model-card requests are held, then `first`'s is answered, then `second`'s. */
  async function atOnce(first: [string, WorkerRole], second: [string, WorkerRole]): Promise<Outcome> {
    const logs: string[] = [];
    const { frontend, namespace } = await bed.startFrontend(logs);
    const [firstRelay, secondRelay] = await Promise.all([first, second].map(([id, role]) => startWorker(namespace, id, role, true)));
    await waitUntil(() => firstRelay!.heldBytes > 0 && secondRelay!.heldBytes > 0, 'both joins wait for their model card', 20_000);
    firstRelay!.hold(false);
    await waitUntil(() => decided(logs, first[0]), `the frontend decided about ${first[0]}`, 20_000);
    secondRelay!.hold(false);
    await waitUntil(() => decided(logs, second[0]), `the frontend decided about ${second[0]}`, 20_000);
    return outcome(frontend, logs, [first[0], second[0]]);
  }

  test('aggregated first, decode second: aggregated, the decode worker not routed to', async () => {
    const sequential = await oneAfterTheOther(['a1', 'both'], ['d1', 'decode']);
    assert.deepEqual(sequential, { mode: 'aggregated', routed: ['a1'], refused: ['d1'] });
    assert.deepEqual(await atOnce(['a2', 'both'], ['d2', 'decode']), { mode: 'aggregated', routed: ['a2'], refused: ['d2'] });
  });

  test('decode first, aggregated second: disaggregated, the aggregated worker not routed to', async () => {
    const sequential = await oneAfterTheOther(['d3', 'decode'], ['a3', 'both']);
    assert.deepEqual(sequential, { mode: 'disaggregated', routed: ['d3'], refused: ['a3'] });
    assert.deepEqual(await atOnce(['d4', 'decode'], ['a4', 'both']), { mode: 'disaggregated', routed: ['d4'], refused: ['a4'] });
  });

  test('prefill first, aggregated second: the prefill worker waits for a decode worker, the aggregated one is not routed to', async () => {
    const sequential = await oneAfterTheOther(['p5', 'prefill'], ['a5', 'both']);
    assert.deepEqual(sequential, { mode: 'waiting for a decode worker', routed: ['p5'], refused: ['a5'] });
    assert.deepEqual(await atOnce(['p6', 'prefill'], ['a6', 'both']),
      { mode: 'waiting for a decode worker', routed: ['p6'], refused: ['a6'] });
  });
});
