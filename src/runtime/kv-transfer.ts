// The KV transfer channel: how a decode worker gets at the blocks a prefill worker computed. The bytes never pass
// through the router, the gateway or a message broker; only the handoff descriptor (block ids, hashes, sampler
// state: src/engine/handoff.ts) travels with the request.
//
// Implementations:
//   SharedMemoryKvChannel  workers are threads of one process. Each decode worker is handed each prefill worker's
//                          pool (a SharedArrayBuffer) once, at start-up; a transfer is then the decode worker
//                          copying block runs out of that pool with typed-array set(), no serialisation, while the
//                          prefill worker keeps the blocks pinned.
//   SimulatedKvChannel     simulated workers: no bytes; the decode worker charges the time the link would take.
//   TcpKvChannel           worker processes (src/cluster/kv-tcp.ts): nothing attached ahead; the decode worker
//                          pulls the handed-off runs from the prefill worker's KV port into a staging pool its
//                          engine adopts from, and the prefill worker unpins when told the decode worker has them.
//
// Every completed transfer is recorded in a KvTransferLog: bytes, blocks, ms, GB/s, for metrics, benchmarks and
// the disaggregation policy's estimate of what a transfer costs.

import type { KvPoolLayout, KvTransferStats } from '../engine/handoff.ts';

/** A prefill worker as a channel sees it. */
export interface KvSourceEndpoint {
  id: string;
  /** Its pool, when it lives in this process. */
  kvPool?: SharedArrayBuffer;
  kvLayout?: KvPoolLayout;
}

/** A decode worker as a channel sees it. */
export interface KvSinkEndpoint {
  id: string;
  attachKvSource?(sourceId: string, pool: SharedArrayBuffer, layout: KvPoolLayout): void;
}

export interface KvTransferChannel {
  /** 'shared-memory', 'simulated', later 'tcp'. */
  readonly kind: string;
  readonly log: KvTransferLog;
  /** Lets `decode` read blocks `prefill` hands off. Once per pair, at start-up; throws if this channel cannot. */
  connect(prefill: KvSourceEndpoint, decode: KvSinkEndpoint): void;
  /** The source id to name in the decode worker's adopt() for blocks of `prefillId`; null when not connected. */
  sourceFor(prefillId: string, decodeId: string): string | null;
  /** A worker is gone: no transfer from or to it any more. */
  disconnect(workerId: string): void;
}

/** Workers connected pairwise, the bookkeeping every channel needs. */
export abstract class PairedChannel implements KvTransferChannel {
  abstract readonly kind: string;
  readonly log = new KvTransferLog();
  private readonly pairs = new Set<string>();

  abstract connect(prefill: KvSourceEndpoint, decode: KvSinkEndpoint): void;

  protected addPair(prefillId: string, decodeId: string): void {
    this.pairs.add(pairKey(prefillId, decodeId));
  }

  sourceFor(prefillId: string, decodeId: string): string | null {
    return this.pairs.has(pairKey(prefillId, decodeId)) ? prefillId : null;
  }

  disconnect(workerId: string): void {
    for (const key of this.pairs) {
      const [prefillId, decodeId] = JSON.parse(key) as [string, string];
      if (prefillId === workerId || decodeId === workerId) this.pairs.delete(key);
    }
  }
}

function pairKey(prefillId: string, decodeId: string): string {
  return JSON.stringify([prefillId, decodeId]);
}

/** Worker threads of one process: the decode worker reads the prefill worker's pool directly. */
export class SharedMemoryKvChannel extends PairedChannel {
  readonly kind = 'shared-memory';

  connect(prefill: KvSourceEndpoint, decode: KvSinkEndpoint): void {
    if (!prefill.kvPool || !prefill.kvLayout) throw new Error(`prefill worker ${prefill.id} has no KV pool in this process to share`);
    if (!decode.attachKvSource) throw new Error(`decode worker ${decode.id} cannot read another worker's KV pool`);
    decode.attachKvSource(prefill.id, prefill.kvPool, prefill.kvLayout);
    this.addPair(prefill.id, decode.id);
  }
}

/** Simulated workers: nothing to connect; each decode worker models the link's time itself. */
export class SimulatedKvChannel extends PairedChannel {
  readonly kind = 'simulated';

  connect(prefill: KvSourceEndpoint, decode: KvSinkEndpoint): void {
    this.addPair(prefill.id, decode.id);
  }
}

// ---------------------------------------------------------------------------------------------------------------
// The log

export interface KvTransferSummary {
  transfers: number;
  blocks: number;
  reusedBlocks: number;
  bytes: number;
  totalMs: number;
  /** Total bytes over total time: the throughput the channel delivered. */
  gbPerSec: number;
  /** Per transfer, by nearest rank. */
  p50Ms: number;
  p99Ms: number;
}

/** Completed transfers, newest last, bounded so a long-running server does not grow it forever. */
export class KvTransferLog {
  private readonly entries: KvTransferStats[] = [];
  private totals = { transfers: 0, blocks: 0, reusedBlocks: 0, bytes: 0, totalMs: 0 };

  constructor(private readonly maxEntries = 10_000) {}

  record(stats: KvTransferStats): void {
    this.entries.push(stats);
    if (this.entries.length > this.maxEntries) this.entries.shift();
    this.totals.transfers++;
    this.totals.blocks += stats.blocks;
    this.totals.reusedBlocks += stats.reusedBlocks;
    this.totals.bytes += stats.bytes;
    this.totals.totalMs += stats.ms;
  }

  /** The most recent transfers (up to maxEntries). */
  recent(): readonly KvTransferStats[] {
    return this.entries;
  }

  summary(): KvTransferSummary {
    const times = this.entries.map((e) => e.ms).sort((a, b) => a - b);
    const rank = (q: number) => (times.length === 0 ? NaN : times[Math.min(times.length, Math.max(1, Math.ceil(q * times.length))) - 1]!);
    const { totalMs, bytes } = this.totals;
    return { ...this.totals, gbPerSec: totalMs > 0 ? bytes / totalMs / 1e6 : 0, p50Ms: rank(0.5), p99Ms: rank(0.99) };
  }
}
