// The KV transfer's control messages (src/cluster/kv-tcp.ts) in binary: one frame of kind FRAME_KV_CONTROL each
// (the request plane's frame: 4-byte big-endian length, kind byte, payload), instead of JSON, so a small transfer
// spends its time on its bytes rather than on building and parsing text. Every integer is big-endian; the payload's
// first byte says which message:
//
//   1 pull    decode -> prefill  requestId (u16 length + UTF-8), layer from u16, layer to u16, hostId (u8 length +
//                                ASCII, 0: none), count u32, count x source block u32, count x destination block u32
//   2 stream  decode -> prefill  requestId, layer from u16, layer to u16, hostId, firstBlock u32, count u32,
//                                count x destination block u32
//   3 link    prefill -> decode  link u8 (0 tcp, 1 shm); shm: region name (u8 length + ASCII), region bytes u32
//   4 done    prefill -> decode  runs u32, bytes u64, overlapMs f64, count u32, count x source block u32
//   5 credit  decode -> prefill  upTo u64 (the shared-memory ring is free up to this position)
//
// A u64 is two u32 (high, low) and must be a safe integer. A message shorter than its fields say, or with bytes after
// them, is a FrameError (the connection is refused, or the transfer fails as truncated). kv-hello and kv-error stay
// JSON (once per connection, and on the way out).

import { FrameError, FRAME_HEADER_BYTES } from './frames.ts';

/** Frame kind of a binary control message (0 and 1 are the request plane's; 2 and 3 the KV runs). */
export const FRAME_KV_CONTROL = 4;

export const KV_PULL = 1;
export const KV_STREAM = 2;
export const KV_LINK = 3;
export const KV_DONE = 4;
export const KV_CREDIT = 5;

export interface KvDescriptorMessage {
  type: typeof KV_PULL | typeof KV_STREAM;
  requestId: string;
  layers: [number, number];
  hostId: string | null;
  /** A pull's source blocks (a stream has none). */
  sourceBlockIds: number[] | null;
  destinationBlockIds: number[];
  /** A stream's first position (a pull's is 0). */
  firstBlock: number;
}

export interface KvLinkMessage {
  type: typeof KV_LINK;
  link: 'tcp' | 'shm';
  region: string | null;
  regionBytes: number;
}

export interface KvDoneMessage {
  type: typeof KV_DONE;
  runs: number;
  bytes: number;
  overlapMs: number;
  sourceBlockIds: number[];
}

export interface KvCreditMessage {
  type: typeof KV_CREDIT;
  upTo: number;
}

export type KvControlMessage = KvDescriptorMessage | KvLinkMessage | KvDoneMessage | KvCreditMessage;

/** Writes a control message's frame; `size` is its payload's length. */
class Writer {
  readonly frame: Buffer;
  at = FRAME_HEADER_BYTES;

  constructor(size: number) {
    this.frame = Buffer.allocUnsafe(FRAME_HEADER_BYTES + size);
    this.frame.writeUInt32BE(size + 1, 0);
    this.frame[4] = FRAME_KV_CONTROL;
  }

  u8(value: number): void {
    this.frame[this.at++] = value;
  }

  u16(value: number): void {
    this.frame.writeUInt16BE(value, this.at);
    this.at += 2;
  }

  u32(value: number): void {
    this.frame.writeUInt32BE(value, this.at);
    this.at += 4;
  }

  u64(value: number): void {
    if (!Number.isSafeInteger(value) || value < 0) throw new RangeError(`${value} is not a u64 the wire can carry`);
    this.u32(Math.floor(value / 2 ** 32));
    this.u32(value % 2 ** 32);
  }

  f64(value: number): void {
    this.frame.writeDoubleBE(value, this.at);
    this.at += 8;
  }

  /** A string with a length prefix of `lengthBytes` (1 or 2) bytes. */
  text(value: string, lengthBytes: 1 | 2): void {
    const length = this.frame.write(value, this.at + lengthBytes, 'utf8');
    if (lengthBytes === 1) this.frame[this.at] = length;
    else this.frame.writeUInt16BE(length, this.at);
    this.at += lengthBytes + length;
  }

  ids(list: readonly number[]): void {
    for (let i = 0; i < list.length; i++) this.u32(list[i]!);
  }

  done(): Buffer {
    if (this.at !== this.frame.length) throw new Error(`control message of ${this.at} bytes, sized ${this.frame.length}`);
    return this.frame;
  }
}

function checkIds(list: readonly number[], name: string): void {
  for (let i = 0; i < list.length; i++) {
    const id = list[i]!;
    if (!Number.isInteger(id) || id < 0 || id > 0xffffffff) throw new RangeError(`${name}[${i}] = ${id} is not a block id`);
  }
}

function textBytes(value: string, max: number, name: string): number {
  const length = Buffer.byteLength(value, 'utf8');
  if (length > max) throw new RangeError(`${name} of ${length} bytes is over ${max}`);
  return length;
}

/** A pull's or a stream's descriptor as a frame. */
export function encodeDescriptor(message: {
  type: KvDescriptorMessage['type']; requestId: string; layers: readonly [number, number]; hostId: string | null;
  sourceBlockIds: readonly number[] | null; destinationBlockIds: readonly number[]; firstBlock: number;
}): Buffer {
  const idBytes = textBytes(message.requestId, 0xffff, 'requestId');
  const hostBytes = message.hostId === null ? 0 : textBytes(message.hostId, 0xff, 'hostId');
  const { layers, destinationBlockIds: destinations } = message;
  if (!(layers[0] >= 0 && layers[1] <= 0xffff && layers[0] <= layers[1])) throw new RangeError(`layers ${layers.join('..')} out of range`);
  checkIds(destinations, 'destinationBlockIds');
  let size = 1 + 2 + idBytes + 4 + 1 + hostBytes + 4 + 4 * destinations.length;
  if (message.type === KV_PULL) {
    const sources = message.sourceBlockIds;
    if (!sources || sources.length !== destinations.length) throw new RangeError('a pull pairs a source with each destination');
    checkIds(sources, 'sourceBlockIds');
    size += 4 * sources.length;
  } else {
    if (!Number.isInteger(message.firstBlock) || message.firstBlock < 0 || message.firstBlock > 0xffffffff) {
      throw new RangeError(`firstBlock ${message.firstBlock} is not a block position`);
    }
    size += 4;
  }
  const w = new Writer(size);
  w.u8(message.type);
  w.text(message.requestId, 2);
  w.u16(layers[0]);
  w.u16(layers[1]);
  w.text(message.hostId ?? '', 1);
  if (message.type === KV_PULL) {
    w.u32(destinations.length);
    w.ids(message.sourceBlockIds!);
  } else {
    w.u32(message.firstBlock);
    w.u32(destinations.length);
  }
  w.ids(destinations);
  return w.done();
}

/** The tcp link's kv-link: the same bytes every time. */
export const KV_LINK_TCP_FRAME: Buffer = (() => {
  const w = new Writer(2);
  w.u8(KV_LINK);
  w.u8(0);
  return w.done();
})();

/** The shm link's kv-link: the ring's file name and size (the same for every transfer of its connection). */
export function encodeShmLink(region: string, regionBytes: number): Buffer {
  const w = new Writer(2 + 1 + textBytes(region, 0xff, 'region') + 4);
  w.u8(KV_LINK);
  w.u8(1);
  w.text(region, 1);
  w.u32(regionBytes);
  return w.done();
}

export function encodeDone(runs: number, bytes: number, overlapMs: number, sourceBlockIds: readonly number[]): Buffer {
  checkIds(sourceBlockIds, 'sourceBlockIds');
  const w = new Writer(1 + 4 + 8 + 8 + 4 + 4 * sourceBlockIds.length);
  w.u8(KV_DONE);
  w.u32(runs);
  w.u64(bytes);
  w.f64(overlapMs);
  w.u32(sourceBlockIds.length);
  w.ids(sourceBlockIds);
  return w.done();
}

export function encodeCredit(upTo: number): Buffer {
  const w = new Writer(1 + 8);
  w.u8(KV_CREDIT);
  w.u64(upTo);
  return w.done();
}

/** Reads a control message's payload, refusing one that ends early or goes on after its fields. */
class Reader {
  at = 0;

  constructor(private readonly payload: Uint8Array, private readonly view: DataView) {}

  private need(n: number): number {
    const at = this.at;
    if (at + n > this.payload.length) throw new FrameError(`control message truncated (${this.payload.length} bytes)`);
    this.at = at + n;
    return at;
  }

  u8(): number {
    return this.payload[this.need(1)]!;
  }

  u16(): number {
    return this.view.getUint16(this.need(2));
  }

  u32(): number {
    return this.view.getUint32(this.need(4));
  }

  u64(): number {
    const high = this.u32();
    const value = high * 2 ** 32 + this.u32();
    if (!Number.isSafeInteger(value)) throw new FrameError('a u64 of the control message is over 2^53');
    return value;
  }

  f64(): number {
    return this.view.getFloat64(this.need(8));
  }

  text(lengthBytes: 1 | 2): string {
    const length = lengthBytes === 1 ? this.u8() : this.u16();
    const at = this.need(length);
    return Buffer.from(this.payload.buffer, this.payload.byteOffset + at, length).toString('utf8');
  }

  ids(count: number): number[] {
    const at = this.need(4 * count);
    const out = new Array<number>(count);
    for (let i = 0; i < count; i++) out[i] = this.view.getUint32(at + 4 * i);
    return out;
  }

  end(): void {
    if (this.at !== this.payload.length) throw new FrameError(`control message has ${this.payload.length - this.at} bytes after its end`);
  }
}

/** The message in a FRAME_KV_CONTROL frame's payload; FrameError when it is not one. */
export function parseControl(payload: Uint8Array): KvControlMessage {
  const r = new Reader(payload, new DataView(payload.buffer, payload.byteOffset, payload.byteLength));
  const type = r.u8();
  let message: KvControlMessage;
  if (type === KV_PULL || type === KV_STREAM) {
    const requestId = r.text(2);
    const layers: [number, number] = [r.u16(), r.u16()];
    const host = r.text(1);
    const firstBlock = type === KV_STREAM ? r.u32() : 0;
    const count = r.u32();
    const sourceBlockIds = type === KV_PULL ? r.ids(count) : null;
    message = { type, requestId, layers, hostId: host.length > 0 ? host : null, sourceBlockIds, destinationBlockIds: r.ids(count), firstBlock };
  } else if (type === KV_LINK) {
    const link = r.u8();
    if (link === 0) message = { type, link: 'tcp', region: null, regionBytes: 0 };
    else if (link === 1) message = { type, link: 'shm', region: r.text(1), regionBytes: r.u32() };
    else throw new FrameError(`kv-link names link ${link}`);
  } else if (type === KV_DONE) {
    const runs = r.u32();
    const bytes = r.u64();
    const overlapMs = r.f64();
    message = { type, runs, bytes, overlapMs, sourceBlockIds: r.ids(r.u32()) };
  } else if (type === KV_CREDIT) {
    message = { type, upTo: r.u64() };
  } else {
    throw new FrameError(`unknown control message ${type}`);
  }
  r.end();
  return message;
}
