// Reading a JSON request body with a size cap. A body announced too large is refused before a byte of it is read;
// one that grows past the cap while streaming in is refused at that point, without reading the rest.

import { isUtf8 } from 'node:buffer';
import type { IncomingMessage } from 'node:http';
import { rememberBodyText } from '../model/template-values.ts';
import { BodyTooLargeError, ClientClosedRequestError, InvalidJsonError, InvalidUtf8Error, quoted } from './errors.ts';

/**
 * The body, at most `limitBytes` of it. `accepted` runs once the announced size is within the limit, before a byte is
 * read: where a client waiting on "Expect: 100-continue" is told to send it.
 */
export function readBody(req: IncomingMessage, limitBytes: number, accepted?: () => void): Promise<Buffer> {
  const announced = Number(req.headers['content-length']);
  if (Number.isFinite(announced) && announced > limitBytes) return Promise.reject(new BodyTooLargeError(limitBytes));
  accepted?.();
  return new Promise((resolve, reject) => {
    const chunks: Buffer[] = [];
    let received = 0;
    const cleanup = (): void => {
      req.off('data', onData);
      req.off('end', onEnd);
      req.off('error', onError);
      req.off('close', onClose);
    };
    const onData = (chunk: Buffer): void => {
      received += chunk.length;
      if (received > limitBytes) {
        cleanup();
        req.pause();
        reject(new BodyTooLargeError(limitBytes));
        return;
      }
      chunks.push(chunk);
    };
    const onEnd = (): void => {
      cleanup();
      resolve(Buffer.concat(chunks, received));
    };
    const onError = (): void => {
      cleanup();
      reject(new ClientClosedRequestError());
    };
    const onClose = (): void => {
      cleanup();
      reject(new ClientClosedRequestError());
    };
    req.on('data', onData);
    req.on('end', onEnd);
    req.on('error', onError);
    req.on('close', onClose);
  });
}

/**
 * Bytes to a JSON value: invalid UTF-8 and invalid JSON are both the client's 400. The body is read as JSON whatever
 * its Content-Type (curl's -d sends application/x-www-form-urlencoded, fetch with a string body text/plain); when it
 * is not JSON and was sent as another type (a form, most likely), the message says so and what the API takes.
 */
export function parseJsonBytes(bytes: Buffer, contentType?: string): unknown {
  if (!isUtf8(bytes)) throw new InvalidUtf8Error();
  let text = bytes.toString('utf8');
  if (text.charCodeAt(0) === 0xfeff) text = text.slice(1);
  if (text.trim() === '') throw new InvalidJsonError(`the body is empty.${sentAsHint(contentType)}`);
  let body: unknown;
  try {
    body = JSON.parse(text);
  } catch (err) {
    throw new InvalidJsonError(`${(err as Error).message}${sentAsHint(contentType)}`);
  }
  // The fields a chat template renders are read again from the text with their numbers exact, when they hold any.
  rememberBodyText(body, text);
  return body;
}

/** " (it was sent as <type>; ...)" for a Content-Type that is not JSON's; "" for JSON's or none. */
function sentAsHint(contentType: string | undefined): string {
  const mediaType = contentType?.split(';')[0]!.trim().toLowerCase();
  if (mediaType === undefined || mediaType === '' || mediaType === 'application/json' || mediaType.endsWith('+json')) return '';
  return ` (it was sent as ${quoted(mediaType, 100)}; the API takes a JSON body, as Content-Type: application/json)`;
}
