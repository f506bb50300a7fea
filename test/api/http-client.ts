// Raw HTTP for the API tests: exact status codes, headers and bytes, which the official client hides.

import { request as httpRequest, type IncomingHttpHeaders } from 'node:http';

export interface RawResponse {
  status: number;
  headers: IncomingHttpHeaders;
  text: string;
  json(): any;
}

export interface RawRequest {
  method?: string;
  path: string;
  headers?: Record<string, string>;
  /** A string or bytes sent as is; an object is sent as JSON. */
  body?: string | Buffer | object;
  /** Write the body in pieces of this many bytes (to exercise streaming uploads). */
  chunkBytes?: number;
}

export function rawRequest(baseUrl: string, options: RawRequest): Promise<RawResponse> {
  const url = new URL(options.path, baseUrl);
  const body = options.body === undefined ? undefined
    : typeof options.body === 'string' || Buffer.isBuffer(options.body) ? Buffer.from(options.body)
      : Buffer.from(JSON.stringify(options.body));
  return new Promise((resolve, reject) => {
    const req = httpRequest(url, {
      method: options.method ?? (body ? 'POST' : 'GET'),
      headers: { ...(body ? { 'Content-Type': 'application/json' } : {}), ...options.headers },
    }, (res) => {
      const chunks: Buffer[] = [];
      res.on('data', (chunk: Buffer) => chunks.push(chunk));
      res.on('end', () => {
        const text = Buffer.concat(chunks).toString('utf8');
        resolve({ status: res.statusCode!, headers: res.headers, text, json: () => JSON.parse(text) });
      });
      res.on('error', reject);
    });
    // The server may answer and close before a large body is fully sent: a write error then is expected, and the
    // answer is what the test checks. Without an answer the error stands.
    let answered = false;
    let failure: Error | undefined;
    req.on('response', () => { answered = true; });
    req.on('error', (err) => { failure = err; });
    req.on('close', () => { if (!answered && failure) reject(failure); });
    if (body && options.chunkBytes) {
      let offset = 0;
      const writeMore = (): void => {
        while (offset < body.length) {
          const piece = body.subarray(offset, offset + options.chunkBytes!);
          offset += piece.length;
          if (!req.write(piece)) {
            req.once('drain', writeMore);
            return;
          }
        }
        req.end();
      };
      writeMore();
    } else {
      req.end(body);
    }
  });
}

/** SSE events of a stream body: the data of each `data:` line, with the event name when one was given. */
export function parseSse(text: string): { event?: string; data: string }[] {
  assertFramed(text);
  return text.split('\n\n').filter((block) => block.length > 0).map((block) => {
    const lines = block.split('\n');
    const event = lines.find((line) => line.startsWith('event: '))?.slice('event: '.length);
    const data = lines.filter((line) => line.startsWith('data: ')).map((line) => line.slice('data: '.length)).join('\n');
    return event ? { event, data } : { data };
  });
}

function assertFramed(text: string): void {
  if (!text.endsWith('\n\n')) throw new Error(`SSE body does not end with a blank line: ${JSON.stringify(text.slice(-40))}`);
}
