// Server-sent events for streamed completions: `data: {json}\n\n` per chunk, `data: [DONE]\n\n` at the end (the
// Responses API: `event: <type>` lines, no [DONE]; SseStyle). Every
// chunk is written as soon as it exists (no buffering anywhere on the way: headers flushed at once, proxies told
// not to buffer, Nagle off on the socket), and a slow reader applies backpressure: send() waits for 'drain'.

import type { ServerResponse } from 'node:http';
import type { ErrorBody } from './errors.ts';
import type { WireUsage } from './openai-format.ts';

export const SSE_HEADERS: Readonly<Record<string, string>> = {
  'Content-Type': 'text/event-stream; charset=utf-8',
  'Cache-Control': 'no-cache',
  'X-Accel-Buffering': 'no',
};

/** Told of every event written: its bytes and the output tokens it shows the client for the first time. */
export type WriteListener = (bytes: number, tokens: number) => void;

/**
 * How a stream's events are framed: chat and completions send bare `data:` lines, an error as an `error` event, and
 * `data: [DONE]` at the end; the Responses API names every event by its type and sends no [DONE].
 */
export interface SseStyle {
  /** An `event: <type>` line before each event whose data has a string `type`. */
  readonly namedEvents: boolean;
  /** `data: [DONE]` after the last event. */
  readonly doneMarker: boolean;
  /**
   * The event that ends a stream failing after it began (default: an `error` event whose data is OpenAI's error
   * body itself); with named events, its `type` names it. usage: the tokens up to the failure, for a style whose
   * failure event carries the response so far.
   */
  errorEvent?(body: ErrorBody, usage?: WireUsage): object;
}

const CHAT_STYLE: SseStyle = { namedEvents: false, doneMarker: true };

export class SseWriter {
  private finished = false;

  /** gone: the client left (aborts when the connection closes, also for a response that never got its socket). */
  /**
   * stallTimeoutMs: how long a write may wait for a client that stopped reading before the connection is closed (the
   * client is then gone: its request is aborted and what it held given back); 0 waits for ever.
   */
  constructor(private readonly res: ServerResponse, private readonly onWrite?: WriteListener, private readonly gone?: AbortSignal,
    private readonly style: SseStyle = CHAT_STYLE, private readonly stallTimeoutMs = 0) {}

  /** Sends the status line and headers right away, so the client sees the stream open before the first token. */
  open(extraHeaders: Record<string, string> = {}): void {
    this.res.socket?.setNoDelay(true);
    this.res.writeHead(200, { ...SSE_HEADERS, ...extraHeaders });
    this.res.flushHeaders();
  }

  /** True once the client has gone or the stream has ended: nothing more can be written. */
  get closed(): boolean {
    return this.finished || this.res.destroyed || this.res.writableEnded || this.gone?.aborted === true;
  }

  /**
   * Writes one event; resolves when the socket can take more (at once unless the client reads slowly). `tokens`:
   * output tokens this event shows for the first time (for TTFT and time between tokens).
   */
  async send(data: object, tokens = 0): Promise<void> {
    const type = this.style.namedEvents ? (data as { type?: unknown }).type : undefined;
    await this.write(`${typeof type === 'string' ? `event: ${type}\n` : ''}data: ${JSON.stringify(data)}\n\n`, tokens);
  }

  /**
   * An error after the stream began: the style's failure event (the Responses API's response.failed), or an `error`
   * event with OpenAI's error shape; then the end. usage: the tokens up to the failure (the response.failed carries it).
   */
  async fail(body: ErrorBody, usage?: WireUsage): Promise<void> {
    const data = this.style.errorEvent?.(body, usage) ?? body;
    const type = this.style.namedEvents ? (data as { type?: unknown }).type : undefined;
    await this.write(`event: ${typeof type === 'string' ? type : 'error'}\ndata: ${JSON.stringify(data)}\n\n`, 0);
    this.end();
  }

  end(): void {
    if (this.closed) return;
    this.finished = true;
    const done = this.style.doneMarker ? 'data: [DONE]\n\n' : '';
    this.res.end(done);
    this.onWrite?.(done.length, 0);
  }

  private write(text: string, tokens: number): Promise<void> {
    if (this.closed) return Promise.resolve();
    const flowing = this.res.write(text);
    // Stamped when the bytes are handed to the socket, not when a slow reader lets the next write through.
    this.onWrite?.(Buffer.byteLength(text), tokens);
    if (flowing) return Promise.resolve();
    return new Promise((resolve) => {
      const timer = this.stallTimeoutMs > 0 ? setTimeout(() => this.res.destroy(), this.stallTimeoutMs) : undefined;
      const done = (): void => {
        clearTimeout(timer);
        this.res.off('drain', done);
        this.res.off('close', done);
        this.gone?.removeEventListener('abort', done);
        resolve();
      };
      this.res.on('drain', done);
      this.res.on('close', done);
      this.gone?.addEventListener('abort', done);
    });
  }
}
