// Length-prefixed frames on a byte stream (the request plane's TCP connections). A frame is a 4-byte big-endian
// length, one kind byte, and the payload:
//   kind 0: UTF-8 JSON (every request, output and control message);
//   kind 1: a Node structured-clone blob (v8.serialize), used for one thing only: the model card a worker sends the
//           frontend (the tokenizer's vocabulary holds typed arrays, Maps and Sets that JSON cannot carry). A worker
//           never deserializes one: what reaches the worker's port from the network is parsed as JSON only.
//   kinds 2-4: the KV transfer's runs and binary control messages (src/cluster/kv-tcp.ts, kv-wire.ts), on the KV
//           port only.
// The length counts the kind byte and the payload. A frame longer than the reader's limit is refused before any of
// its bytes are buffered, so a peer cannot make the reader allocate what the length claims; or, for a reader told to
// skip such frames (a worker's, once the peer authenticated), passed over: its first bytes are kept, so that the
// request it carries can be named and refused alone, and the rest is dropped as it arrives.

export const FRAME_HEADER_BYTES = 5;
export const FRAME_JSON = 0;
export const FRAME_BLOB = 1;

/** Default largest frame: a vocabulary of 150k tokens with its merges fits, a garbage length does not. */
export const DEFAULT_MAX_FRAME_BYTES = 64 * 1024 * 1024;

export class FrameError extends Error {
  override name = 'FrameError';
}

/** A frame longer than the reader's limit: its length, the limit, and its kind when its header came whole. */
export class OversizedFrameError extends FrameError {
  override name = 'OversizedFrameError';
  constructor(readonly length: number, readonly limit: number, readonly kind: number | undefined) {
    super(`frame of ${length} bytes is over the limit of ${limit} bytes`);
  }
}

export function encodeJsonFrame(message: unknown): Buffer {
  const body = Buffer.from(JSON.stringify(message), 'utf8');
  const frame = Buffer.allocUnsafe(FRAME_HEADER_BYTES + body.length);
  frame.writeUInt32BE(body.length + 1, 0);
  frame[4] = FRAME_JSON;
  body.copy(frame, FRAME_HEADER_BYTES);
  return frame;
}

export function encodeBlobFrame(blob: Buffer): Buffer {
  const header = Buffer.allocUnsafe(FRAME_HEADER_BYTES);
  header.writeUInt32BE(blob.length + 1, 0);
  header[4] = FRAME_BLOB;
  return Buffer.concat([header, blob]);
}

export interface Frame {
  kind: number;
  payload: Buffer;
  /**
   * A frame over the limit that the reader skips (FrameReader.skipOversized): its length (kind byte and payload);
   * `payload` then holds only its first bytes, and the rest never comes out of the reader.
   */
  oversizedBytes?: number;
}

/**
 * Cuts a byte stream into frames. next() throws FrameError on a frame over the limit, an empty frame or an unknown
 * kind (the caller logs and closes the connection).
 */
export class FrameReader {
  private chunks: Buffer[] = [];
  private buffered = 0;
  /** Bytes of a skipped oversized frame still to drop as they arrive. */
  private skipping = 0;
  /**
   * Undefined (the default): a frame over the limit is a FrameError. Set: such a frame comes out of next() with
   * `oversizedBytes` set and its first `headBytes` bytes (kind byte and payload) only; the rest is dropped, never
   * buffered, and the frames after it follow. While its head is still coming, `plausible` is asked about the bytes so
   * far (kind byte and payload): false makes it a FrameError at once, as without skipping.
   */
  skipOversized: { headBytes: number; plausible(partialHead: Buffer): boolean } | undefined;

  /** extraKinds: frame kinds a protocol adds (the KV port's binary control messages), passed through unread. */
  constructor(public maxFrameBytes: number = DEFAULT_MAX_FRAME_BYTES, private readonly extraKinds: readonly number[] = []) {}

  /** Bytes taken in that have not come out as frames yet (or are still to be dropped): 0 between frames. */
  get pending(): number {
    return this.buffered + this.skipping;
  }

  /** Takes in bytes; frames come out of next(). */
  write(chunk: Buffer): void {
    this.chunks.push(chunk);
    this.buffered += chunk.length;
  }

  /** The next complete frame, or undefined until more bytes arrive. Frames come out in order, each checked. */
  next(): Frame | undefined {
    if (this.skipping > 0) {
      const dropped = Math.min(this.skipping, this.buffered);
      if (dropped > 0) this.take(dropped);
      this.skipping -= dropped;
      if (this.skipping > 0) return undefined;
    }
    if (this.buffered < 4) return undefined;
    const length = this.peek(4).readUInt32BE(0);
    if (length === 0) throw new FrameError('empty frame (length 0)');
    if (length > this.maxFrameBytes) {
      if (this.skipOversized === undefined) {
        throw new OversizedFrameError(length, this.maxFrameBytes, this.buffered >= FRAME_HEADER_BYTES ? this.peek(FRAME_HEADER_BYTES)[4] : undefined);
      }
      const head = Math.max(1, Math.min(length, this.skipOversized.headBytes));
      if (this.buffered < 4 + head) {
        const partial = this.peek(this.buffered).subarray(4, this.buffered);
        if (!this.skipOversized.plausible(partial)) throw new OversizedFrameError(length, this.maxFrameBytes, partial[0]);
        return undefined;
      }
      const bytes = this.take(4 + head);
      this.skipping = length - head;
      const kind = this.checkKind(bytes[4]!);
      return { kind, payload: bytes.subarray(FRAME_HEADER_BYTES), oversizedBytes: length };
    }
    if (this.buffered < 4 + length) return undefined;
    const bytes = this.take(4 + length);
    const kind = this.checkKind(bytes[4]!);
    return { kind, payload: bytes.subarray(FRAME_HEADER_BYTES) };
  }

  private checkKind(kind: number): number {
    if (kind !== FRAME_JSON && kind !== FRAME_BLOB && !this.extraKinds.includes(kind)) throw new FrameError(`unknown frame kind ${kind}`);
    return kind;
  }

  /** write() then every complete frame; throws at the first bad one (frames before it are lost to the caller). */
  push(chunk: Buffer): Frame[] {
    this.write(chunk);
    const frames: Frame[] = [];
    for (let frame = this.next(); frame; frame = this.next()) frames.push(frame);
    return frames;
  }

  private peek(n: number): Buffer {
    if (this.chunks[0]!.length >= n) return this.chunks[0]!;
    this.chunks = [Buffer.concat(this.chunks)];
    return this.chunks[0]!;
  }

  private take(n: number): Buffer {
    const all = this.chunks.length === 1 ? this.chunks[0]! : Buffer.concat(this.chunks);
    const out = all.subarray(0, n);
    const rest = all.subarray(n);
    this.chunks = rest.length > 0 ? [rest] : [];
    this.buffered = rest.length;
    return out;
  }
}

/** A JSON frame's message: an object with a string `t` (its type), or a FrameError saying what it is not. */
export function parseJsonMessage(payload: Buffer): { t: string } & Record<string, unknown> {
  let value: unknown;
  try {
    value = JSON.parse(payload.toString('utf8'));
  } catch (error) {
    throw new FrameError(`frame is not JSON (${(error as Error).message})`);
  }
  if (typeof value !== 'object' || value === null || Array.isArray(value) || typeof (value as { t?: unknown }).t !== 'string') {
    throw new FrameError('frame is not a message (an object with a string "t")');
  }
  return value as { t: string } & Record<string, unknown>;
}
