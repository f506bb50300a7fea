// Driving a run to the client: collected into one JSON body, or streamed as SSE chunks. Errors that happen before
// the first chunk propagate (the caller answers with a proper status code); errors after it become an SSE error
// event followed by [DONE]. The final body, or the stream's last chunk, carries the request's `timings`.

import type { EngineOutput } from '../engine/types.ts';
import { EngineError, OutOfMemoryError, toApiError, type ApiError } from './errors.ts';
import type { GenerationRun, RunEvent } from './generation-run.ts';
import { wireFinishReason, wireUsage, type WireUsage } from './openai-format.ts';
import type { ChoiceUpdate, ResponseShape } from './response-shapes.ts';
import type { SseWriter } from './sse.ts';

function usageOf(run: GenerationRun): WireUsage {
  return wireUsage(run.promptTokens, run.completionTokens, run.cachedPromptTokens);
}

/** An event as a choice update; an engine error or an abort the client did not cause becomes an exception. */
function toUpdate(run: GenerationRun, event: RunEvent, eosTokenId: number | undefined): ChoiceUpdate {
  const output: EngineOutput = event.output;
  if (output.finishReason === 'error') {
    const detail = output.error ?? 'unknown error';
    throw output.errorCode === 'out_of_memory' ? new OutOfMemoryError(detail) : new EngineError(detail);
  }
  if (output.finishReason === 'abort' && run.abortReason) throw run.abortReason;
  return {
    index: event.promptIndex * run.n + output.index,
    textDelta: output.textDelta,
    logprobs: output.logprobs,
    promptLogprobs: output.promptLogprobs,
    finishReason: wireFinishReason(output.finishReason),
    stopReason: wireStopReason(run, event.promptIndex, output.stopReason, eosTokenId),
    tokens: output.newTokenIds.length,
    tokenIds: output.newTokenIds,
  };
}

/**
 * vLLM's stop_reason: the stop string or the request's own stop token id that ended the choice; null for anything
 * else, the model's end-of-sequence token included (the engine names that token too, to leave its text out), even
 * when stop_token_ids lists it: vLLM's check_stop tests the EOS (unless ignore_eos) before stop_token_ids, and only the
 * latter sets stop_reason. With ignore_eos, an EOS listed there ends the output as a stop token id and is reported.
 */
function wireStopReason(run: GenerationRun, promptIndex: number, stopReason: string | number | undefined,
  eosTokenId: number | undefined): string | number | null {
  if (stopReason === undefined) return null;
  if (typeof stopReason === 'string') return stopReason;
  const sampling = run.engineRequests[promptIndex]?.sampling;
  if (sampling === undefined || !sampling.stopTokenIds.includes(stopReason)) return null;
  return stopReason === eosTokenId && !sampling.ignoreEos ? null : stopReason;
}

/**
 * The per-phase timings of the request so far, for the response that ends it (undefined without telemetry);
 * `pendingWriteTokens`: output tokens the chunk carrying them shows for the first time.
 */
export type TimingsSource = (pendingWriteTokens?: number) => object | undefined;

function withTimings(body: object, timings: TimingsSource | undefined, pendingWriteTokens = 0): object {
  const value = timings?.(pendingWriteTokens);
  return value === undefined ? body : { ...body, timings: value };
}

/**
 * The run collected into one body. eosTokenId: the model's end-of-sequence token (its tokenizer's), whose ending
 * reports stop_reason null (wireStopReason).
 */
export async function collectRun(run: GenerationRun, shape: ResponseShape, timings?: TimingsSource, eosTokenId?: number): Promise<object> {
  for await (const event of run.events()) shape.collect(toUpdate(run, event, eosTokenId));
  return withTimings(shape.body(usageOf(run)), timings);
}

export interface StreamOptions {
  includeUsage: boolean;
  continuousUsage: boolean;
  headers: Record<string, string>;
  timings?: TimingsSource;
  /** Told of an error that ended the stream after it began (it went to the client as an SSE error event). */
  onFailure?: (error: ApiError) => void;
  /** The model's end-of-sequence token (its tokenizer's): an ending on it reports stop_reason null (wireStopReason). */
  eosTokenId?: number;
}

export async function streamRun(
  run: GenerationRun, shape: ResponseShape, writer: SseWriter, options: StreamOptions,
): Promise<void> {
  // The stream opens with the first output, so a request the engine refuses still gets a real status code.
  const events = run.events();
  try {
    const first = await events.next();
    const firstUpdate = first.done ? undefined : toUpdate(run, first.value, options.eosTokenId);
    // The client left before the stream opened (its leaving aborted the run, whose first output is then the abort):
    // no status line goes out, so the request is recorded as the client's leaving (499), not as a 200 stream. The
    // run's engine requests are aborted already and their streams are closed below, as for any other cancellation.
    if (writer.closed) return;
    writer.open(options.headers);
    await streamFrom(run, shape, writer, options, events, firstUpdate);
  } finally {
    await events.return(undefined);
  }
}

async function streamFrom(
  run: GenerationRun, shape: ResponseShape, writer: SseWriter, options: StreamOptions,
  events: AsyncGenerator<RunEvent>, firstUpdate: ChoiceUpdate | undefined,
): Promise<void> {
  // With include_usage every chunk carries "usage": null until the last. Continuous usage (vLLM's) fills it in each
  // time with its choice's own: that choice's prompt and the tokens it has generated so far (none in the opening
  // chunks, which say only the role or echo the choice's prompt).
  const choiceTokens = new Array<number>(run.sequences).fill(0);
  const choiceUsage = (index: number): WireUsage => {
    const promptIndex = Math.floor(index / run.n);
    return wireUsage(run.prompts[promptIndex]!.tokenIds.length, choiceTokens[index]!, run.cachedTokensOf(promptIndex));
  };
  const chunkUsage = (usage: () => WireUsage): WireUsage | null | undefined =>
    options.includeUsage ? (options.continuousUsage ? usage() : null) : undefined;
  // Tokens that produced no visible chunk yet (held back for a stop string, or half a character) count for the
  // chunk that first shows them: that write is when the client sees them.
  let unshownTokens = 0;
  try {
    for (const chunk of shape.openingChunks((index) => chunkUsage(() => choiceUsage(index)))) await writer.send(chunk);
    let update = firstUpdate;
    while (update) {
      unshownTokens += update.tokens;
      const index = update.index;
      choiceTokens[index]! += update.tokens;
      const chunks = shape.updateChunks(update, chunkUsage(() => choiceUsage(index)));
      const shows = update.textDelta !== '' || (update.logprobs?.length ?? 0) > 0;
      // The run's last update: without a usage chunk to follow, its last chunk ends the stream and carries timings.
      const lastChunk = run.done && !options.includeUsage ? chunks.length - 1 : -1;
      for (let i = 0; i < chunks.length; i++) {
        const tokens = i === 0 && shows ? unshownTokens : 0;
        if (tokens > 0) unshownTokens = 0;
        // The last chunk's timings count the tokens it shows as written with it: it may carry the first (a one-token
        // stream), and the client's TTFT is that write, as the finished trace and the metrics record it.
        await writer.send(i === lastChunk ? withTimings(chunks[i]!, options.timings, tokens) : chunks[i]!, tokens);
      }
      if (writer.closed) return;
      const next = await events.next();
      update = next.done ? undefined : toUpdate(run, next.value, options.eosTokenId);
    }
    if (options.includeUsage) await writer.send(withTimings(shape.usageChunk(usageOf(run)), options.timings));
    writer.end();
  } catch (err) {
    const error = toApiError(err);
    options.onFailure?.(error);
    // The usage of what was streamed: the output tokens of the updates the stream took, not any the failure cut off.
    const streamedTokens = choiceTokens.reduce((a, b) => a + b, 0);
    const usage = wireUsage(run.promptTokens, run.outputHidden ? 0 : streamedTokens, run.cachedPromptTokens);
    if (!writer.closed) await writer.fail(error.toBody(), usage);
  }
}
