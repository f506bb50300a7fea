// Request migration: when the worker running a request dies mid-stream, the routed and disaggregated engines send
// the request again to a surviving worker, with the tokens generated so far appended to the prompt, and the
// caller's stream carries on as if nothing happened (same request id, same completion index, usage counted from
// the original prompt). Up to `limit` times per request; past that, or with no worker left, the stream fails
// with the WorkerLostError it fails with when migration is off.
//
// What the new worker cannot know, this side supplies:
// - Text. The lost worker's detokenizer may have held bytes of an unfinished UTF-8 character or a tail that could
//   begin a stop string; neither reached the caller. So after a migration the text is detokenized here: a fresh
//   detokenizer replays the tokens already streamed (reaching the exact state the lost worker's had: same code,
//   same tokens) and then takes the new worker's tokens, while the new worker runs without stop strings. A stop
//   string spanning the migration point is found, and no text is repeated or dropped.
// - Budgets: max_tokens and min_tokens shrink by what was already generated.
// - The output so far (priorOutputTokenIds): the new worker counts it for the presence and frequency penalties and
//   advances a guided request's grammar over it, so neither starts again at the migration point.
// - Usage and timestamps: the prompt stays the caller's prompt, completion tokens continue, arrival, queueing and
//   the first token keep the first worker's stamps.
//
// Not reproduced: a seeded sampler's position (the new worker starts its random stream afresh, so seeded sampling
// draws different tokens after the migration; greedy decoding is unaffected).
//
// n > 1 is not migrated: its completions share the prompt's blocks and run as one request; continuing them would
// take n different prompts, i.e. n new requests, on a path nothing else uses. It fails as without migration.
//
// The disaggregated engine also moves a request whose prefill worker is lost before the hand-over (back to be
// prefilled again, see disaggregated.ts). Such a move is recorded here like any other, but it does not count against
// the limit: it happens whatever the limit, as the local prefill after a failed prefill always has.

import { IncrementalDetokenizer } from '../engine/detokenizer.ts';
import type { EngineOutput, EngineRequest, MigrationRecord, RoutingSummary } from '../engine/types.ts';
import type { Tokenizer } from '../model/tokenizer/types.ts';

/** Dynamo's default migration_limit is 0: a request is migrated only where the operator asked for it. */
export const DEFAULT_MIGRATION_LIMIT = 0;

export interface MigrationOptions {
  /** Migrations allowed per request (0 = off). */
  limit: number;
  /**
   * The workers' tokenizer, to carry the text across a migration exactly (see the file comment). Without it the
   * new worker's text deltas pass through, which is exact unless the lost worker was holding text back.
   */
  tokenizer?: Pick<Tokenizer, 'tokenBytes' | 'stripsLeadingSpace'>;
}

export function checkMigrationLimit(limit: number): number {
  if (!Number.isInteger(limit) || limit < 0) throw new RangeError(`migration limit must be a whole number >= 0, got ${limit}`);
  return limit;
}

/** One request followed across the workers that run it. */
export class RequestMigration {
  /** Tokens already sent to the caller (completion 0). */
  readonly generated: number[] = [];
  readonly migrations: MigrationRecord[] = [];
  aborted = false;
  /** Moves that count against the limit (not those back to a prefill: see the file comment). */
  private limitedMoves = 0;
  private finished = false;
  /** Set once the text is detokenized here (after the first migration, with a tokenizer). */
  private detokenizer: IncrementalDetokenizer | undefined;
  /** The first worker's facts the caller already saw. */
  private firstOutput: EngineOutput | undefined;

  constructor(readonly request: EngineRequest, private readonly options: MigrationOptions) {}

  /** The request to send now: the original, or after a migration the continuation. */
  attempt(): EngineRequest {
    if (this.migrations.length === 0) return this.request;
    const { sampling } = this.request;
    const done = this.generated.length;
    return {
      ...this.request,
      promptTokenIds: [...this.request.promptTokenIds, ...this.generated],
      priorOutputTokenIds: [...this.generated],
      sampling: {
        ...sampling,
        maxTokens: sampling.maxTokens - done,
        minTokens: Math.max(0, sampling.minTokens - done),
        // The caller has the prompt's logprobs once it had a token (they came with the first); before, it still needs them.
        ...(done > 0 ? { promptLogprobs: undefined } : {}),
        // Stop strings are matched here once the text is (the worker would hold back and cut text on its own).
        ...(this.detokenizer ? { stop: [] } : {}),
      },
    };
  }

  /** Whether `error` from the worker's stream lets the request move on to another worker. */
  canMigrate(error: unknown): boolean {
    return isWorkerLost(error) && !this.aborted && !this.finished && this.request.sampling.n === 1
      && this.limitedMoves < this.options.limit && this.generated.length < this.request.sampling.maxTokens;
  }

  /**
   * A worker lost after the caller aborted: with migration on, the stream ends as an aborted one would (the caller
   * asked for the end) instead of failing. With migration off it fails as it always has.
   */
  abortedWhenLost(error: unknown): boolean {
    return isWorkerLost(error) && this.aborted && !this.finished && this.options.limit > 0;
  }

  /**
   * Notes a migration away from `fromWorkerId`; the destination follows with `placed`. `againstLimit: false` for a
   * move the limit does not govern.
   */
  migrateFrom(fromWorkerId: string, reason: string, options: { againstLimit?: boolean } = {}): void {
    this.migrations.push({ fromWorkerId, afterTokens: this.generated.length, reason });
    if (options.againstLimit ?? true) this.limitedMoves++;
    // Before the first token the new worker's text is the whole text, its stop strings included: nothing to carry.
    if (this.detokenizer === undefined && this.options.tokenizer && this.generated.length > 0) {
      const detokenizer = IncrementalDetokenizer.forRequest(this.options.tokenizer, this.request.sampling, this.request.promptTokenIds);
      // The caller already has this text: replaying only rebuilds the held bytes and held stop-string prefix.
      for (const tokenId of this.generated) detokenizer.push(tokenId);
      this.detokenizer = detokenizer;
    }
  }

  /** The worker the latest migration landed on. */
  placed(toWorkerId: string): void {
    const last = this.migrations.at(-1);
    if (last) last.toWorkerId = toWorkerId;
  }

  /** The routing summary with the migrations so far. */
  summarize(summary: RoutingSummary | undefined): RoutingSummary | undefined {
    if (!summary || this.migrations.length === 0) return summary;
    return { ...summary, migrations: this.migrations.map((m) => ({ ...m })) };
  }

  /**
   * A worker's output as the caller sees it. `stopped` tells the engine to abort the worker: a stop string
   * matched here ended the output, which the worker does not know.
   */
  adapt(output: EngineOutput): { output: EngineOutput; stopped: boolean } {
    if (output.finishReason !== undefined) this.finished = true;
    // The first output the caller gets: from the first worker, or from the next one when the first was lost
    // before it sent anything.
    this.firstOutput ??= output;
    if (this.migrations.length === 0) {
      this.generated.push(...output.newTokenIds);
      return { output, stopped: false };
    }
    let { textDelta, finishReason, stopReason, newTokenIds } = output;
    let stopped = false;
    /** Tokens of the output after the one a stop string ended on (appended unsampled): not output, not counted. */
    let dropped = 0;
    const detokenizer = this.detokenizer;
    if (detokenizer) {
      textDelta = '';
      const endsOnStopToken = finishReason === 'stop' && typeof stopReason === 'number';
      for (const [i, tokenId] of output.newTokenIds.entries()) {
        // The worker left a stop token's text out (unless asked for); so does this, as engine-core does.
        const isStopToken = endsOnStopToken && i === output.newTokenIds.length - 1 && tokenId === stopReason;
        if (isStopToken && !this.request.sampling.includeStopStrInOutput) break;
        const piece = detokenizer.push(tokenId);
        textDelta += piece.delta;
        if (piece.stopped !== undefined) {
          finishReason = 'stop';
          stopReason = piece.stopped;
          stopped = output.finishReason === undefined;
          dropped = output.newTokenIds.length - (i + 1);
          if (dropped > 0) newTokenIds = output.newTokenIds.slice(0, i + 1);
          break;
        }
      }
      if (finishReason !== undefined && !detokenizer.done) {
        const tail = detokenizer.finish();
        textDelta += tail.delta;
        if (tail.stopped !== undefined) {
          finishReason = 'stop';
          stopReason = tail.stopped;
        }
      }
    }
    this.generated.push(...newTokenIds);
    if (finishReason !== undefined) this.finished = true;
    const first = this.firstOutput;
    const promptTokens = this.request.promptTokenIds.length;
    return {
      stopped,
      output: {
        ...output, newTokenIds, textDelta, finishReason, stopReason,
        usage: {
          promptTokens,
          completionTokens: this.migrations.at(-1)!.afterTokens + output.usage.completionTokens - dropped,
          cachedTokens: first ? first.usage.cachedTokens : Math.min(promptTokens, output.usage.cachedTokens),
        },
        timestamps: first
          ? {
            ...output.timestamps, arrival: this.request.arrivalMs, queued: first.timestamps.queued,
            firstScheduled: first.timestamps.firstScheduled, prefillChunks: first.timestamps.prefillChunks,
            firstToken: first.timestamps.firstToken, budget: first.timestamps.budget,
            queueDepthAtEntry: first.timestamps.queueDepthAtEntry,
          }
          : { ...output.timestamps, arrival: this.request.arrivalMs },
        routing: this.summarize(output.routing),
      },
    };
  }

  /** The closing output of a request aborted between two workers. */
  closingOutput(nowMs: number): EngineOutput {
    this.finished = true;
    const request = this.request;
    return {
      requestId: request.id, index: 0, newTokenIds: [], textDelta: '', finishReason: 'abort',
      usage: {
        promptTokens: request.promptTokenIds.length, completionTokens: this.generated.length,
        cachedTokens: this.firstOutput?.usage.cachedTokens ?? 0,
      },
      timestamps: { ...(this.firstOutput?.timestamps ?? { prefillChunks: [] }), arrival: request.arrivalMs, finished: nowMs },
      ...(request.traceparent !== undefined ? { traceparent: request.traceparent } : {}),
    };
  }
}

/** WorkerLostError by name: it may have crossed a thread boundary, where only name and message survive. */
export function isWorkerLost(error: unknown): boolean {
  return error instanceof Error && error.name === 'WorkerLostError';
}
