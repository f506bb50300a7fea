// What a describe block of frontend tests shares: one etcd (started before its tests), and the frontends, workers and
// TCP relays its tests start, all stopped after them. Each test takes a frontend of its own in a namespace of its own
// (the first workers a frontend finds decide aggregated or disaggregated).
import { after, before } from 'node:test';
import { etcdClient } from '../../src/cluster/discovery.ts';
import { ClusterFrontend } from '../../src/cluster/frontend.ts';
import type { RunningWorker } from '../../src/cluster/worker-process.ts';
import { removeDir, startEtcd, stopAll, tempDir, type Etcd } from './cluster-services.ts';
import type { TcpRelay } from './tcp-relay.ts';

export interface FrontendBed {
  /** The etcd the frontends and workers use (valid once the block's tests run). */
  readonly etcdUrl: string;
  /** Workers and relays a test started: the bed stops them after the block. */
  readonly workers: RunningWorker[];
  readonly relays: TcpRelay[];
  /** A started frontend in a fresh namespace, logging into `logs`. */
  startFrontend(logs: string[]): Promise<{ frontend: ClusterFrontend; namespace: string }>;
}

/** Call inside a describe block: registers its before/after hooks. */
export function frontendBed(name: string, clusterToken: string): FrontendBed {
  let dir: string;
  let etcd: Etcd;
  const frontends: ClusterFrontend[] = [];
  const workers: RunningWorker[] = [];
  const relays: TcpRelay[] = [];
  let namespaces = 0;

  before(async () => {
    dir = tempDir(name);
    etcd = await startEtcd(dir);
  });

  after(async () => {
    for (const frontend of frontends) await frontend.close();
    for (const worker of workers) await worker.shutdown(0);
    for (const relay of relays) await relay.close();
    await stopAll();
    removeDir(dir);
  });

  return {
    get etcdUrl() {
      return etcd.url;
    },
    workers,
    relays,
    async startFrontend(logs) {
      const namespace = `${name}-${namespaces++}`;
      const frontend = new ClusterFrontend({
        namespace, clusterToken, etcd: etcdClient({ endpoints: [etcd.url] }),
        log: (level, message) => { logs.push(`${level} ${message}`); },
      });
      frontends.push(frontend);
      await frontend.start();
      return { frontend, namespace };
    },
  };
}
