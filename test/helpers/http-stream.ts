// A streaming completion held open over raw HTTP, for tests that act while a request is in flight (abort it by
// hanging up, fill a concurrency slot, read its trace later).
import { request as httpRequest } from 'node:http';

export interface OpenStream {
  /** The x-request-id the server answered with. */
  id: string;
  /** Closes the connection: the server sees the client leave. */
  hangUp(): void;
}

/**
 * POSTs `body` to /v1/completions with stream: true and resolves once `events` SSE events (default 1) arrived.
 * `key` adds a bearer token.
 */
export function openCompletionStream(url: string, body: object, options: { key?: string; events?: number } = {}): Promise<OpenStream> {
  const events = options.events ?? 1;
  const headers: Record<string, string> = { 'Content-Type': 'application/json' };
  if (options.key !== undefined) headers.Authorization = `Bearer ${options.key}`;
  return new Promise((resolve, reject) => {
    const req = httpRequest(new URL('/v1/completions', url), { method: 'POST', headers }, (res) => {
      let seen = 0;
      res.on('data', (chunk: Buffer) => {
        seen += chunk.toString('utf8').split('\n\n').length - 1;
        if (seen >= events) resolve({ id: String(res.headers['x-request-id']), hangUp: () => req.destroy() });
      });
      res.on('error', () => {});
    });
    req.on('error', (err: NodeJS.ErrnoException) => { if (err.code !== 'ECONNRESET') reject(err); });
    req.end(JSON.stringify({ ...body, stream: true }));
  });
}
