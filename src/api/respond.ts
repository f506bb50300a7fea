// Driving a run to the client: collected into one JSON body, or streamed as SSE chunks. Errors that happen before
// the first chunk propagate (the caller answers with a proper status code); errors after it become an SSE error
// event followed by [DONE].

import type { EngineOutput } from '../engine/types.ts';
import { EngineError, toApiError } from './errors.ts';
import type { GenerationRun, RunEvent } from './generation-run.ts';
import { wireFinishReason, wireUsage, type WireUsage } from './openai-format.ts';
import type { ChoiceUpdate, ResponseShape } from './response-shapes.ts';
import type { SseWriter } from './sse.ts';

function usageOf(run: GenerationRun): WireUsage {
  return wireUsage(run.promptTokens, run.completionTokens, run.cachedPromptTokens);
}

/** An event as a choice update; an engine error or an abort the client did not cause becomes an exception. */
function toUpdate(run: GenerationRun, event: RunEvent): ChoiceUpdate {
  const output: EngineOutput = event.output;
  if (output.finishReason === 'error') throw new EngineError(output.error ?? 'unknown error');
  if (output.finishReason === 'abort' && run.abortReason) throw run.abortReason;
  return {
    index: event.promptIndex * run.n + output.index,
    textDelta: output.textDelta,
    logprobs: output.logprobs,
    finishReason: wireFinishReason(output.finishReason),
    stopReason: output.stopReason ?? null,
  };
}

export async function collectRun(run: GenerationRun, shape: ResponseShape): Promise<object> {
  for await (const event of run.events()) shape.collect(toUpdate(run, event));
  return shape.body(usageOf(run));
}

export interface StreamOptions {
  includeUsage: boolean;
  continuousUsage: boolean;
  headers: Record<string, string>;
}

export async function streamRun(
  run: GenerationRun, shape: ResponseShape, writer: SseWriter, options: StreamOptions,
): Promise<void> {
  // The stream opens with the first output, so a request the engine refuses still gets a real status code.
  const events = run.events();
  try {
    const first = await events.next();
    const firstUpdate = first.done ? undefined : toUpdate(run, first.value);
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
  // With include_usage every chunk carries "usage": null until the last; continuous usage fills it in each time.
  const chunkUsage = (): WireUsage | null | undefined =>
    options.includeUsage ? (options.continuousUsage ? usageOf(run) : null) : undefined;
  try {
    for (const chunk of shape.openingChunks(chunkUsage())) await writer.send(chunk);
    let update = firstUpdate;
    while (update) {
      for (const chunk of shape.updateChunks(update, chunkUsage())) await writer.send(chunk);
      if (writer.closed) return;
      const next = await events.next();
      update = next.done ? undefined : toUpdate(run, next.value);
    }
    if (options.includeUsage) await writer.send(shape.usageChunk(usageOf(run)));
    writer.end();
  } catch (err) {
    if (!writer.closed) await writer.fail(toApiError(err).toBody());
  }
}
