// An incremental server-sent-events parser for streamed completions. Bytes arrive in whatever pieces TCP makes of
// them: an event can be split across reads and one read can hold many events, so text is buffered until a blank
// line ends an event. Only the fields an OpenAI stream uses are kept (`event` and `data`; comments and `id` are
// skipped).

export interface SseEvent {
  /** The `event:` field; 'message' when absent (an OpenAI stream sends `event: error` for a failure). */
  event: string;
  /** The `data:` lines joined with newlines. */
  data: string;
}

export class SseParser {
  private buffer = '';

  /** Feeds decoded text; returns the events it completed, in order. */
  push(text: string): SseEvent[] {
    this.buffer += text;
    const events: SseEvent[] = [];
    for (;;) {
      const end = findEventEnd(this.buffer);
      if (end === null) break;
      const block = this.buffer.slice(0, end.at);
      this.buffer = this.buffer.slice(end.at + end.length);
      const event = parseBlock(block);
      if (event !== null) events.push(event);
    }
    return events;
  }

  /** Text received after the last complete event (a stream cut short leaves some). */
  get pending(): string {
    return this.buffer;
  }
}

/** The first blank line: "\n\n", "\r\n\r\n" or "\r\r" (the spec allows all three line endings). */
function findEventEnd(text: string): { at: number; length: number } | null {
  let best: { at: number; length: number } | null = null;
  for (const separator of ['\n\n', '\r\n\r\n', '\r\r']) {
    const at = text.indexOf(separator);
    if (at >= 0 && (best === null || at < best.at)) best = { at, length: separator.length };
  }
  return best;
}

function parseBlock(block: string): SseEvent | null {
  let event = 'message';
  const data: string[] = [];
  for (const line of block.split(/\r\n|\r|\n/)) {
    if (line === '' || line.startsWith(':')) continue;
    const colon = line.indexOf(':');
    const field = colon >= 0 ? line.slice(0, colon) : line;
    let value = colon >= 0 ? line.slice(colon + 1) : '';
    if (value.startsWith(' ')) value = value.slice(1);
    if (field === 'event') event = value;
    else if (field === 'data') data.push(value);
  }
  return data.length > 0 ? { event, data: data.join('\n') } : null;
}
