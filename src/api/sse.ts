// Server-sent events for streamed completions: `data: {json}\n\n` per chunk, `data: [DONE]\n\n` at the end. Every
// chunk is written as soon as it exists (no buffering anywhere on the way: headers flushed at once, proxies told
// not to buffer, Nagle off on the socket), and a slow reader applies backpressure: send() waits for 'drain'.

import type { ServerResponse } from 'node:http';
import type { ErrorBody } from './errors.ts';

export const SSE_HEADERS: Readonly<Record<string, string>> = {
  'Content-Type': 'text/event-stream; charset=utf-8',
  'Cache-Control': 'no-cache',
  'X-Accel-Buffering': 'no',
};

/** Told of every event written: its bytes and the output tokens it shows the client for the first time. */
export type WriteListener = (bytes: number, tokens: number) => void;

export class SseWriter {
  private finished = false;

  /** gone: the client left (aborts when the connection closes, also for a response that never got its socket). */
  constructor(private readonly res: ServerResponse, private readonly onWrite?: WriteListener, private readonly gone?: AbortSignal) {}

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
    await this.write(`data: ${JSON.stringify(data)}\n\n`, tokens);
  }

  /** An error after the stream began: an `error` event (its data has OpenAI's error shape), then [DONE]. */
  async fail(body: ErrorBody): Promise<void> {
    await this.write(`event: error\ndata: ${JSON.stringify(body)}\n\n`, 0);
    this.end();
  }

  end(): void {
    if (this.closed) return;
    this.finished = true;
    const done = 'data: [DONE]\n\n';
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
      const done = (): void => {
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
