// A request's timestamps cross from the worker thread to the engine side with every output, and most of them
// (arrival, queueing, the prefill chunks, the first token) no longer change once decode runs: each decode step
// moves the last token and the decode summary only. The worker posts an output's timestamps whole the first time,
// then only the top-level fields that changed since the request's previous output; the engine side rebuilds the
// whole object from the previous one. Both sides keep the previous timestamps of each request by the same rules, in
// the order of the messages: set by every output, dropped by an output that finishes a completion and by the
// request's handoff. The worker may also drop one at any time (a request added or adopted under the id): its next
// output then goes whole.

import { samePlainData } from '../util/plain-data.ts';
import type { EngineOutput, RequestTimestamps } from './types.ts';

/** Worker side: outputs as posted, with the indices of those whose timestamps are changes only. */
export class TimestampCompactor {
  private readonly posted = new Map<string, RequestTimestamps>();

  /** The outputs to post (the given array when none changed; outputs are copied, never changed in place). */
  compact(outputs: EngineOutput[]): { outputs: EngineOutput[]; changesAt?: number[] } {
    let posted: EngineOutput[] | undefined;
    let changesAt: number[] | undefined;
    for (let i = 0; i < outputs.length; i++) {
      const output = outputs[i]!;
      const previous = this.posted.get(output.requestId);
      if (output.finishReason !== undefined) this.posted.delete(output.requestId);
      else this.posted.set(output.requestId, output.timestamps);
      const changes = previous === undefined ? undefined : changedFields(previous, output.timestamps);
      if (changes === undefined) continue;
      posted ??= outputs.slice();
      posted[i] = { ...output, timestamps: changes as RequestTimestamps };
      (changesAt ??= []).push(i);
    }
    return posted === undefined ? { outputs } : { outputs: posted, changesAt: changesAt! };
  }

  /** The request's next output goes whole (it was handed off, or a new request took its id). */
  forget(requestId: string): void {
    this.posted.delete(requestId);
  }
}

/** Engine side: rebuilds the outputs' whole timestamps, in place, in the order the messages arrive. */
export class TimestampExpander {
  private readonly posted = new Map<string, RequestTimestamps>();

  expand(outputs: EngineOutput[], changesAt: readonly number[] | undefined): void {
    let next = 0;
    for (let i = 0; i < outputs.length; i++) {
      const output = outputs[i]!;
      if (changesAt !== undefined && changesAt[next] === i) {
        next++;
        output.timestamps = { ...this.posted.get(output.requestId)!, ...output.timestamps };
      }
      if (output.finishReason !== undefined) this.posted.delete(output.requestId);
      else this.posted.set(output.requestId, output.timestamps);
    }
  }

  forget(requestId: string): void {
    this.posted.delete(requestId);
  }

  clear(): void {
    this.posted.clear();
  }
}

/**
 * The top-level fields of `current` that differ from `previous`, or undefined when it must go whole: a field
 * `previous` had is gone (timestamps only gain fields, but a change that removed one must not be lost).
 */
function changedFields(previous: RequestTimestamps, current: RequestTimestamps): Partial<RequestTimestamps> | undefined {
  const before = previous as unknown as Record<string, unknown>;
  const now = current as unknown as Record<string, unknown>;
  for (const key in before) if (Object.hasOwn(before, key) && !Object.hasOwn(now, key)) return undefined;
  const changes: Record<string, unknown> = {};
  for (const key in now) {
    if (Object.hasOwn(now, key) && !samePlainData(before[key], now[key])) changes[key] = now[key];
  }
  return changes as Partial<RequestTimestamps>;
}
