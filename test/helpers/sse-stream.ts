// Reads a streamed completion's SSE body event by event, for tests that act in the middle of a stream (kill the
// worker running it, drain it). Parsing is the load generator's (src/bench/sse-parser.ts).
import { SseParser } from '../../src/bench/sse-parser.ts';

/** What a completion stream's events carry that tests read. */
export interface CompletionStreamEvent {
  error?: { code?: string; message?: string };
  choices?: { text?: string; finish_reason?: string | null }[];
}

/** Calls `onEvent` with each event's JSON, in order, awaiting it before reading on; `[DONE]` and empty data skipped. */
export async function forEachStreamEvent(res: Response, onEvent: (json: CompletionStreamEvent) => Promise<void> | void): Promise<void> {
  const reader = res.body!.getReader();
  const decoder = new TextDecoder();
  const parser = new SseParser();
  for (;;) {
    const { done, value } = await reader.read();
    if (done) break;
    for (const { data } of parser.push(decoder.decode(value, { stream: true }))) {
      if (data === '[DONE]' || data === '') continue;
      await onEvent(JSON.parse(data) as CompletionStreamEvent);
    }
  }
}
