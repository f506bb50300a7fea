// The router's own account of the requests it routed and that have not finished. Worker load reports arrive
// periodically and lag behind; within one report interval a burst can put dozens of requests on a worker that
// still reports itself idle. Counting what it sent itself lets the router see that load immediately.
//
// Blocks are counted per worker as distinct prompt blocks: two active requests sharing a prefix on one worker
// share its KV blocks (one copy, two references), so the second adds only the blocks past the shared part. This
// is also what keeps a burst of same-prefix requests together: joining the worker that already holds the prefix
// costs no new blocks.
//
// The same goes for prefill: while a request is computing its prompt, the blocks it computes are recorded, so a
// follower sharing them can be told that the prefill queued on that worker is partly its own prefix, computed once
// for both.

import type { BlockHash } from '../protocols/kv-events.ts';
import type { WorkerId } from './protocols.ts';

export interface OwnWorkerLoad {
  /** Routed here and not finished. */
  numRequests: number;
  /** Of those, not yet reported done with prefill: queued at the worker or computing their prompt. */
  numPrefilling: number;
  /** Prompt tokens those prefilling requests still compute (prompt minus the blocks they were expected to reuse). */
  prefillTokens: number;
  /** Distinct full prompt blocks of its active requests, plus each request's partial last block. */
  numBlocks: number;
}

interface ActiveRequest {
  workerId: WorkerId;
  blockHashes: readonly BlockHash[];
  /** Leading blocks it was expected to reuse; it computes the full blocks after them. */
  numReusedBlocks: number;
  newPrefillTokens: number;
  hasPartialBlock: boolean;
  prefillDone: boolean;
}

const EMPTY_LOAD: Readonly<OwnWorkerLoad> = Object.freeze({ numRequests: 0, numPrefilling: 0, prefillTokens: 0, numBlocks: 0 });

export class ActiveRequests {
  private readonly requests = new Map<string, ActiveRequest>();
  private readonly loads = new Map<WorkerId, OwnWorkerLoad>();
  /** hash -> worker -> active requests on that worker whose prompt holds the block. */
  private readonly holders = new Map<BlockHash, Map<WorkerId, number>>();
  /** hash -> worker -> requests on that worker still computing the block (prefill not done). */
  private readonly computing = new Map<BlockHash, Map<WorkerId, number>>();

  get size(): number {
    return this.requests.size;
  }

  has(requestId: string): boolean {
    return this.requests.has(requestId);
  }

  workerOf(requestId: string): WorkerId | undefined {
    return this.requests.get(requestId)?.workerId;
  }

  load(workerId: WorkerId): Readonly<OwnWorkerLoad> {
    return this.loads.get(workerId) ?? EMPTY_LOAD;
  }

  /**
   * blockHashes: the request's full prompt blocks; hasPartialBlock: its prompt ends inside a further block;
   * numReusedBlocks: leading blocks it is expected to reuse; newPrefillTokens: the prompt tokens it computes.
   */
  add(requestId: string, workerId: WorkerId, blockHashes: readonly BlockHash[], hasPartialBlock: boolean,
    numReusedBlocks: number, newPrefillTokens: number): void {
    if (this.requests.has(requestId)) throw new Error(`request ${requestId} is already routed and not finished`);
    this.requests.set(requestId, { workerId, blockHashes, numReusedBlocks, newPrefillTokens, hasPartialBlock, prefillDone: false });
    for (let i = numReusedBlocks; i < blockHashes.length; i++) addCount(this.computing, blockHashes[i]!, workerId);
    let load = this.loads.get(workerId);
    if (load === undefined) this.loads.set(workerId, load = { numRequests: 0, numPrefilling: 0, prefillTokens: 0, numBlocks: 0 });
    load.numRequests++;
    load.numPrefilling++;
    load.prefillTokens += newPrefillTokens;
    if (hasPartialBlock) load.numBlocks++;
    for (const hash of blockHashes) if (addCount(this.holders, hash, workerId)) load.numBlocks++;
  }

  /** The worker produced the request's first token: its prompt no longer waits for compute. */
  prefillDone(requestId: string): void {
    const request = this.requests.get(requestId);
    if (request === undefined || request.prefillDone) return;
    request.prefillDone = true;
    const { blockHashes, workerId } = request;
    for (let i = request.numReusedBlocks; i < blockHashes.length; i++) removeCount(this.computing, blockHashes[i]!, workerId);
    const load = this.loads.get(workerId)!;
    load.numPrefilling--;
    load.prefillTokens -= request.newPrefillTokens;
  }

  /** Returns the worker the request was on, or undefined for an unknown (or already finished) request. */
  finish(requestId: string): WorkerId | undefined {
    const request = this.requests.get(requestId);
    if (request === undefined) return undefined;
    this.prefillDone(requestId);
    this.requests.delete(requestId);
    const { workerId } = request;
    const load = this.loads.get(workerId)!;
    load.numRequests--;
    if (request.hasPartialBlock) load.numBlocks--;
    for (const hash of request.blockHashes) if (removeCount(this.holders, hash, workerId)) load.numBlocks--;
    if (load.numRequests === 0) this.loads.delete(workerId);
    return workerId;
  }

  /** Forgets every request on the worker; returns their ids so the caller can fail or retry them. */
  removeWorker(workerId: WorkerId): string[] {
    const ids: string[] = [];
    for (const [requestId, request] of this.requests) if (request.workerId === workerId) ids.push(requestId);
    for (const requestId of ids) this.finish(requestId);
    return ids;
  }

  /** Per worker, how many leading blocks of `hashes` its active requests already hold. */
  sharedBlocks(hashes: readonly BlockHash[]): Map<WorkerId, number> {
    const depths = new Map<WorkerId, number>();
    const first = hashes.length > 0 ? this.holders.get(hashes[0]!) : undefined;
    if (first === undefined) return depths;
    const active = [...first.keys()];
    let depth = 1;
    for (; depth < hashes.length && active.length > 0; depth++) {
      const workers = this.holders.get(hashes[depth]!);
      for (let i = active.length - 1; i >= 0; i--) {
        if (workers?.has(active[i]!)) continue;
        depths.set(active[i]!, depth);
        active.splice(i, 1);
      }
    }
    for (const workerId of active) depths.set(workerId, depth);
    return depths;
  }

  /** Per worker, how many of `hashes` its prefilling requests are computing right now. */
  computingBlocks(hashes: readonly BlockHash[]): Map<WorkerId, number> {
    const counts = new Map<WorkerId, number>();
    if (this.computing.size === 0) return counts;
    for (const hash of hashes) {
      const workers = this.computing.get(hash);
      if (workers === undefined) continue;
      for (const workerId of workers.keys()) counts.set(workerId, (counts.get(workerId) ?? 0) + 1);
    }
    return counts;
  }
}

/** One more reference of the worker to the hash; true if it is the first. */
function addCount(map: Map<BlockHash, Map<WorkerId, number>>, hash: BlockHash, workerId: WorkerId): boolean {
  let workers = map.get(hash);
  if (workers === undefined) map.set(hash, workers = new Map());
  const count = workers.get(workerId) ?? 0;
  workers.set(workerId, count + 1);
  return count === 0;
}

/** One reference fewer; true if it was the last. */
function removeCount(map: Map<BlockHash, Map<WorkerId, number>>, hash: BlockHash, workerId: WorkerId): boolean {
  const workers = map.get(hash)!;
  const count = workers.get(workerId)! - 1;
  if (count > 0) {
    workers.set(workerId, count);
    return false;
  }
  workers.delete(workerId);
  if (workers.size === 0) map.delete(hash);
  return true;
}
