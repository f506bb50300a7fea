// Disaggregated prefill/decode over worker processes: the in-process DisaggregatedEngine (policy, routing,
// fallbacks, migration) over RemoteEngines, its KV moving on the TcpKvChannel (src/cluster/kv-tcp.ts) directly
// between the workers. Each decode worker is told where each prefill worker's KV port is.

import { engineNow } from '../engine/clock.ts';
import { DisaggregatedEngine, type DisaggregatedEngineOptions } from '../runtime/disaggregated.ts';
import { makeRouter } from '../runtime/worker-pool.ts';
import type { PolicyName } from '../router/protocols.ts';
import { TcpKvChannel } from './kv-tcp.ts';
import { splitAddress, type RemoteEngine } from './remote-engine.ts';

export interface RemoteDisaggregatedOptions {
  prefill: readonly RemoteEngine[];
  decode: readonly RemoteEngine[];
  routingPolicy?: PolicyName;
  maxQueued?: number;
  routerSeed?: number;
  policy?: DisaggregatedEngineOptions['policy'];
  estimates?: DisaggregatedEngineOptions['estimates'];
  migration?: DisaggregatedEngineOptions['migration'];
  log?: DisaggregatedEngineOptions['log'];
  /** Why a lost worker is not replaced (these engines never restart workers themselves). */
  notRestarted?: DisaggregatedEngineOptions['notRestarted'];
  /** What /health lists (the frontend's view of the cluster). */
  workerList?: () => object[];
}

/** The disaggregated engine of a frontend: /health lists the workers the frontend knows. */
export class RemoteDisaggregatedEngine extends DisaggregatedEngine {
  constructor(options: DisaggregatedEngineOptions, private readonly list: () => object[]) {
    super(options);
  }

  workerList(): object[] {
    return this.list();
  }
}

export function remoteDisaggregatedEngine(options: RemoteDisaggregatedOptions): RemoteDisaggregatedEngine {
  const blockSize = options.decode[0]?.info.blockSize;
  if (blockSize === undefined) throw new Error('a disaggregated engine needs at least one decode worker');
  const prefillById = new Map(options.prefill.map((p) => [p.workerId, p]));
  const kvSourceAddress = (prefillId: string) => {
    const prefill = prefillById.get(prefillId);
    if (!prefill || prefill.kvPort === undefined || prefill.lost) return undefined;
    return { host: splitAddress(prefill.address).host, port: prefill.kvPort };
  };
  // A resolver already set (a frontend's, which knows workers that join later) is kept.
  for (const decode of options.decode) decode.kvSourceAddress ??= kvSourceAddress;
  const routerOptions = {
    routingPolicy: options.routingPolicy ?? 'kv',
    ...(options.maxQueued !== undefined ? { maxQueued: options.maxQueued } : {}),
    ...(options.routerSeed !== undefined ? { routerSeed: options.routerSeed } : {}),
  };
  return new RemoteDisaggregatedEngine({
    prefill: options.prefill.map((engine) => ({ id: engine.workerId, engine })),
    decode: options.decode.map((engine) => ({ id: engine.workerId, engine })),
    prefillRouter: makeRouter(routerOptions, blockSize, 0),
    decodeRouter: makeRouter(routerOptions, blockSize, 1),
    channel: new TcpKvChannel(),
    now: engineNow,
    ...(options.policy ? { policy: options.policy } : {}),
    ...(options.estimates ? { estimates: options.estimates } : {}),
    ...(options.migration ? { migration: options.migration } : {}),
    ...(options.log ? { log: options.log } : {}),
    ...(options.notRestarted ? { notRestarted: options.notRestarted } : {}),
  }, options.workerList ?? (() => [...options.prefill, ...options.decode].map((r) => ({ id: r.workerId, role: r.role }))));
}
