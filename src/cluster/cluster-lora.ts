// The LoRA adapters of a frontend's workers, as the gateway uses adapters (AdapterHost). The workers own them: each
// `conduit worker` keeps its adapters in a LoRA manager of its own (--lora-modules, --max-loras, --max-lora-rank;
// evictions and loads on demand happen there) and publishes the ones it holds in its etcd record, each under a key
// made of the name and a digest of its bytes, the same on every worker that holds the same adapter. This frontend
// lists the adapters its workers hold, sends a request naming one with that key (the router routes it only to
// workers that hold it: Router.setWorkerModels), and turns vLLM's load/unload API into lora-load/lora-unload on
// the workers:
//   load:   on every worker this frontend routes to (all of them serve the base model), all or none: when one
//           refuses, those that took the adapter unregister it again and the refusal is the answer.
//   unload: on every worker that holds the adapter; each lets its requests in flight finish with it (as vLLM).
// The adapters themselves are the workers' (several frontends over the same workers see the same ones), but each
// frontend remembers what its own load and unload calls did (name -> path, or unloaded) and repeats it on a worker
// that joins later (syncWorker, before the router learns the worker holds the adapter, so no request for it goes
// there first): a runtime load reaches it too, and an adapter unloaded here is unloaded from it when its own
// --lora-modules brought it. That memory is this frontend's, kept in no shared store: a restarted frontend, or
// another one, does not have it.

import { LoraLoadError } from '../engine/errors.ts';
import type { LoraLoadInfo } from '../engine/types.ts';
import type { WorkerLora } from './discovery.ts';
import type { RemoteEngine } from './remote-engine.ts';

/** A worker this frontend routes to, with the adapters it holds. */
export interface AdapterWorker {
  id: string;
  loras: readonly WorkerLora[];
  remote: RemoteEngine;
}

/** The gateway's AdapterHost (api/gateway.ts) for a frontend's model, by shape: cluster/ does not import api/. */
export class ClusterAdapters {
  private loads = 0;
  /** What this frontend's load (the path) and unload (null) calls did, by name, in the order of the last call. */
  private readonly runtime = new Map<string, string | null>();

  /**
   * `workers`: those this frontend routes to now. `changed(id, loras)`: a load or unload changed what a worker
   * holds (known from its reply before its etcd record says so).
   */
  constructor(private readonly workers: () => AdapterWorker[], private readonly changed: (id: string, loras: WorkerLora[]) => void,
    private readonly log?: (level: 'info' | 'warn', message: string) => void) {}

  /** Every adapter some worker holds, once per name (the first worker's path), by name: the same whichever worker joined first. */
  list(): { name: string; path: string; resident: boolean; key: string }[] {
    const seen = new Map<string, { name: string; path: string; resident: boolean; key: string }>();
    for (const worker of this.workers()) {
      for (const { name, path, key } of worker.loras) if (!seen.has(name)) seen.set(name, { name, path, resident: true, key });
    }
    return [...seen.values()].sort((x, y) => (x.name < y.name ? -1 : x.name > y.name ? 1 : 0));
  }

  has(name: string): boolean {
    return this.workers().some((w) => w.loras.some((l) => l.name === name));
  }

  /** The key requests for the adapter carry: the one most of its workers hold it under (ties: the first's). */
  async acquire(name: string): Promise<string> {
    const counts = new Map<string, number>();
    for (const worker of this.workers()) {
      const key = worker.loras.find((l) => l.name === name)?.key;
      if (key !== undefined) counts.set(key, (counts.get(key) ?? 0) + 1);
    }
    let best: string | undefined;
    for (const [key, count] of counts) if (best === undefined || count > counts.get(best)!) best = key;
    if (best === undefined) throw new LoraLoadError('lora_not_loaded', `The lora adapter '${name}' cannot be found.`);
    return best;
  }

  /** Workers count their own requests per adapter: nothing to give back here. */
  release(): void {}

  async register(name: string, path: string): Promise<LoraLoadInfo> {
    if (this.has(name)) throw new LoraLoadError('invalid_adapter', `The lora adapter '${name}' has already been loaded.`);
    const targets = this.workers();
    if (targets.length === 0) throw new LoraLoadError('invalid_adapter', `no worker is up to load LoRA adapter '${name}'`);
    const results = await Promise.allSettled(targets.map((w) => w.remote.registerLora(name, path)));
    const refused = results.find((r): r is PromiseRejectedResult => r.status === 'rejected');
    if (refused) {
      await Promise.allSettled(targets.map((w, i) => results[i]!.status === 'fulfilled' ? w.remote.unregisterLora(name) : undefined));
      throw refused.reason;
    }
    let info: LoraLoadInfo | undefined;
    for (const [i, worker] of targets.entries()) {
      const loaded = (results[i] as PromiseFulfilledResult<{ info: LoraLoadInfo; key?: string }>).value;
      info ??= loaded.info;
      if (loaded.key === undefined) continue;
      this.changed(worker.id, [...worker.loras.filter((l) => l.name !== name), { name, key: loaded.key, path, rank: loaded.info.rank }]);
    }
    this.loads++;
    this.remember(name, path);
    // Workers that joined while the load ran were not among the targets.
    const loadedOn = new Set(targets.map((w) => w.id));
    for (const worker of this.workers()) if (!loadedOn.has(worker.id)) void this.syncWorker(worker.id);
    return info!;
  }

  async unregister(name: string): Promise<{ inFlight: number }> {
    const holders = this.workers().filter((w) => w.loras.some((l) => l.name === name));
    if (holders.length === 0) throw new LoraLoadError('lora_not_loaded', `The lora adapter '${name}' cannot be found.`);
    const results = await Promise.allSettled(holders.map((w) => w.remote.unregisterLora(name)));
    let inFlight = 0;
    let refusal: unknown;
    for (const [i, worker] of holders.entries()) {
      const result = results[i]!;
      if (result.status === 'fulfilled') inFlight += result.value.inFlight;
      else if (!(result.reason instanceof LoraLoadError && result.reason.code === 'lora_not_loaded')) {
        refusal ??= result.reason;
        continue;
      }
      this.changed(worker.id, worker.loras.filter((l) => l.name !== name));
    }
    if (refusal !== undefined) throw refusal;
    this.remember(name, null);
    return { inFlight };
  }

  private remember(name: string, path: string | null): void {
    this.runtime.delete(name);
    this.runtime.set(name, path);
  }

  /**
   * Repeats this frontend's load and unload calls on a worker (one that joined after them): loads each adapter
   * loaded here that it does not hold by name, unloads each unloaded here that it holds. A refusal is logged and
   * leaves the worker as it is (its requests for that adapter then go to other workers).
   */
  async syncWorker(workerId: string): Promise<void> {
    for (const [name, path] of [...this.runtime]) {
      const worker = this.workers().find((w) => w.id === workerId);
      if (!worker) return;
      const held = worker.loras.find((l) => l.name === name);
      try {
        if (path !== null && !held) {
          const loaded = await worker.remote.registerLora(name, path);
          this.log?.('info', `LoRA adapter '${name}' (loaded through this frontend) loaded on worker ${workerId}, which joined after it`);
          if (loaded.key !== undefined) {
            const now = this.workers().find((w) => w.id === workerId)?.loras ?? worker.loras;
            this.changed(workerId, [...now.filter((l) => l.name !== name), { name, key: loaded.key, path, rank: loaded.info.rank }]);
          }
        } else if (path === null && held) {
          await worker.remote.unregisterLora(name);
          this.log?.('info', `LoRA adapter '${name}' (unloaded through this frontend) unloaded from worker ${workerId}, which joined after it`);
          const now = this.workers().find((w) => w.id === workerId)?.loras ?? worker.loras;
          this.changed(workerId, now.filter((l) => l.name !== name));
        }
      } catch (error) {
        // Loaded or unloaded meanwhile by another call: nothing to repeat.
        if (error instanceof LoraLoadError && (error.code === 'lora_not_loaded' || /already been loaded/.test(error.message))) continue;
        this.log?.('warn', `LoRA adapter '${name}': could not ${path !== null ? 'load it on' : 'unload it from'} worker ${workerId}, which joined after it was ${path !== null ? 'loaded' : 'unloaded'} through this frontend: ${(error as Error).message}`);
      }
    }
  }

  /** Adapters the workers hold count as registered and resident; loads are this frontend's; evictions the workers'. */
  stats(): { registered: number; resident: number; loads: number; evictions: number } {
    const held = this.list().length;
    return { registered: held, resident: held, loads: this.loads, evictions: 0 };
  }
}
