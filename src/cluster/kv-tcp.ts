// KV blocks between worker processes over a direct TCP connection: the byte channel for disaggregated prefill and
// decode when the two workers are separate processes (src/runtime/kv-transfer.ts has the in-process ones). Neither
// NATS nor the frontend carries a byte of KV.
//
// The shape is NIXL's: the decode side has allocated the destination blocks and sends the prefill side a
// descriptor (the request, which source blocks, which destination blocks, which layers); the prefill side writes
// the blocks into those destinations, layer by layer, K then V, consecutive blocks merged into one run. Only the
// blocks the decode worker lacks are named in the descriptor, so only they move.
//
// Wire (one connection per transfer, both directions in frames: 4-byte big-endian length, kind byte, payload):
//   decode -> prefill  JSON  {t: 'kv-hello', v, token}             the cluster token, compared in constant time
//   decode -> prefill  JSON  {t: 'kv-pull', requestId, sourceBlockIds, destinationBlockIds, layers: [from, to)}
//   prefill -> decode  RUN   header (24 bytes) + bytes, one per (layer, K|V, merged run), in layer order
//   prefill -> decode  JSON  {t: 'kv-done', runs, bytes} | {t: 'kv-error', reason}
// A RUN header: layer u16, kv u8 (0 K, 1 V), reserved u8, destination block u32, count u32, byte length u32, CRC-32
// of the bytes u32, reserved u32. The receiver checks each run against the descriptor (the run it expects next,
// its length) and its checksum before writing it, and at kv-done that every run came. A corrupted, truncated or
// out-of-order transfer rejects with KvTransferError; the caller then prefills on the decode worker instead.

import net from 'node:net';
import { crc32 } from 'node:zlib';
import { kvBlockRunBytes, validateHandoff, type KvHandoff, type KvPoolView } from '../engine/handoff.ts';
import { encodeJsonFrame, FrameError, FrameReader, FRAME_JSON, parseJsonMessage } from './frames.ts';
import { parseWireRequest, tokenMatches, toWireRequest } from './request-plane.ts';
import { PairedChannel, type KvSinkEndpoint, type KvSourceEndpoint } from '../runtime/kv-transfer.ts';

export const KV_TCP_VERSION = 1;
/** Frame kind of a KV run (the request plane's kinds are 0 and 1). */
export const FRAME_KV_RUN = 2;
const RUN_HEADER_BYTES = 24;
const MAX_CONTROL_BYTES = 16 * 1024 * 1024;

export type KvTransferFailure = 'checksum' | 'length' | 'truncated' | 'refused' | 'unexpected-run' | 'connect' | 'timeout' | 'aborted';

export class KvTransferError extends Error {
  override name = 'KvTransferError';
  constructor(readonly reason: KvTransferFailure, message: string) {
    super(message);
  }
}

/** What the decode side asks for. Source and destination ids pair up; layers is [from, to). */
export interface KvPullDescriptor {
  requestId: string;
  sourceBlockIds: number[];
  destinationBlockIds: number[];
  layers: [number, number];
}

export interface KvPullResult {
  bytes: number;
  blocks: number;
  runs: number;
  ms: number;
  link: 'tcp';
}

interface PlannedRun {
  layer: number;
  kv: number;
  source: number;
  destination: number;
  count: number;
}

/** The runs a descriptor means, in the order the prefill side sends them: layer, then K and V, then block order. */
export function planRuns(descriptor: KvPullDescriptor): PlannedRun[] {
  const merged: [number, number, number][] = [];
  const { sourceBlockIds: s, destinationBlockIds: d } = descriptor;
  for (let i = 0; i < s.length; i++) {
    const last = merged[merged.length - 1];
    if (last && s[i] === last[0] + last[2] && d[i] === last[1] + last[2]) last[2]++;
    else merged.push([s[i]!, d[i]!, 1]);
  }
  const runs: PlannedRun[] = [];
  for (let layer = descriptor.layers[0]; layer < descriptor.layers[1]; layer++) {
    for (let kv = 0; kv < 2; kv++) {
      for (const [source, destination, count] of merged) runs.push({ layer, kv, source, destination, count });
    }
  }
  return runs;
}

function checkDescriptor(value: Record<string, unknown>, view: KvPoolView, side: 'source' | 'destination'): KvPullDescriptor {
  const ids = (list: unknown, name: string): number[] => {
    if (!Array.isArray(list) || list.some((id) => !Number.isInteger(id) || id < 0)) throw new FrameError(`${name} must be block ids`);
    return list as number[];
  };
  const requestId = value.requestId;
  if (typeof requestId !== 'string' || requestId.length === 0) throw new FrameError('requestId must be a non-empty string');
  const sourceBlockIds = ids(value.sourceBlockIds, 'sourceBlockIds');
  const destinationBlockIds = ids(value.destinationBlockIds, 'destinationBlockIds');
  if (sourceBlockIds.length !== destinationBlockIds.length) throw new FrameError('sourceBlockIds and destinationBlockIds must pair up');
  const mine = side === 'source' ? sourceBlockIds : destinationBlockIds;
  if (mine.some((id) => id >= view.layout.numBlocks)) throw new FrameError(`a ${side} block id is outside the pool (${view.layout.numBlocks} blocks)`);
  const layers = value.layers;
  if (!Array.isArray(layers) || layers.length !== 2 || !Number.isInteger(layers[0]) || !Number.isInteger(layers[1])
    || layers[0] < 0 || layers[1] > view.layout.numLayers || layers[0] > layers[1]) {
    throw new FrameError(`layers must be [from, to) within ${view.layout.numLayers} layers`);
  }
  return { requestId, sourceBlockIds, destinationBlockIds, layers: [layers[0], layers[1]] };
}

function runOffset(view: KvPoolView, layer: number, kv: number, block: number): number {
  return ((2 * layer + kv) * view.layout.numBlocks + block) * kvBlockRunBytes(view.layout);
}

// ---------------------------------------------------------------------------------------------------------------
// Prefill side

export interface KvTransferServerOptions {
  clusterToken: string;
  /** The prefill worker's own pool (shared memory with its engine thread). */
  pool: KvPoolView;
  /** Whether the request's blocks are still pinned here; a pull for any other request is refused. */
  isPinned?: (requestId: string) => boolean;
  log?: (level: 'debug' | 'info' | 'warn' | 'error', message: string) => void;
  /**
   * Fault injection for tests: flip a byte of run `corruptRun`, close the connection after `truncateAfterRuns`, or
   * send nothing after `stallAfterRuns` runs and keep the connection open (a transfer in flight, as long as a test
   * needs it).
   */
  faults?: { corruptRun?: number; truncateAfterRuns?: number; stallAfterRuns?: number };
}

/** Serves pulls of pinned blocks from this worker's pool. */
export class KvTransferServer {
  private readonly server: net.Server;
  private readonly sockets = new Set<net.Socket>();
  /** Transfers served, refused; runs written. */
  served = 0;
  refused = 0;
  runsSent = 0;

  constructor(private readonly options: KvTransferServerOptions) {
    this.server = net.createServer((socket) => this.accept(socket));
  }

  listen(port: number, host: string): Promise<number> {
    return new Promise((resolve, reject) => {
      this.server.once('error', reject);
      this.server.listen(port, host, () => {
        this.server.off('error', reject);
        resolve((this.server.address() as net.AddressInfo).port);
      });
    });
  }

  async close(): Promise<void> {
    for (const socket of this.sockets) socket.destroy();
    await new Promise<void>((resolve) => this.server.close(() => resolve()));
  }

  private accept(socket: net.Socket): void {
    this.sockets.add(socket);
    socket.setNoDelay(true);
    socket.on('error', () => {});
    socket.on('close', () => this.sockets.delete(socket));
    const reader = new FrameReader(64 * 1024);
    let authenticated = false;
    const timer = setTimeout(() => this.refuse(socket, 'no hello within 10 s'), 10_000);
    socket.on('data', (chunk: Buffer) => {
      try {
        for (const frame of reader.push(chunk)) {
          if (frame.kind !== FRAME_JSON) throw new FrameError('the KV port accepts JSON frames only');
          const message = parseJsonMessage(frame.payload);
          if (!authenticated) {
            clearTimeout(timer);
            if (message.t !== 'kv-hello' || message.v !== KV_TCP_VERSION) throw new FrameError('expected kv-hello');
            if (!tokenMatches(this.options.clusterToken, message.token)) throw new FrameError('wrong cluster token');
            authenticated = true;
            reader.maxFrameBytes = MAX_CONTROL_BYTES;
            continue;
          }
          if (message.t !== 'kv-pull') throw new FrameError(`unknown message type ${JSON.stringify(message.t).slice(0, 40)}`);
          const descriptor = checkDescriptor(message, this.options.pool, 'source');
          if (this.options.isPinned && !this.options.isPinned(descriptor.requestId)) {
            throw new FrameError(`request ${descriptor.requestId} has no pinned blocks here`);
          }
          this.send(socket, descriptor);
        }
      } catch (error) {
        this.refuse(socket, (error as Error).message);
      }
    });
  }

  private refuse(socket: net.Socket, reason: string): void {
    if (socket.destroyed) return;
    this.refused++;
    this.options.log?.('warn', `KV transfer: refusing ${socket.remoteAddress}:${socket.remotePort}: ${reason}`);
    socket.end(encodeJsonFrame({ t: 'kv-error', reason }));
  }

  /** Writes the runs layer by layer; each run one frame, its header carrying length and CRC-32. */
  private send(socket: net.Socket, descriptor: KvPullDescriptor): void {
    const view = this.options.pool;
    const bytes = new Uint8Array(view.pool);
    const runBytes = kvBlockRunBytes(view.layout);
    const { faults } = this.options;
    let sent = 0;
    let total = 0;
    for (const run of planRuns(descriptor)) {
      if (faults?.truncateAfterRuns !== undefined && sent === faults.truncateAfterRuns) {
        socket.destroy();
        return;
      }
      if (faults?.stallAfterRuns !== undefined && sent === faults.stallAfterRuns) return;
      const at = runOffset(view, run.layer, run.kv, run.source);
      const length = run.count * runBytes;
      // A copy: the pool is shared memory, and the socket may send after this function returns.
      const body = Buffer.from(bytes.subarray(at, at + length));
      const header = Buffer.alloc(5 + RUN_HEADER_BYTES);
      header.writeUInt32BE(1 + RUN_HEADER_BYTES + length, 0);
      header[4] = FRAME_KV_RUN;
      header.writeUInt16BE(run.layer, 5);
      header[7] = run.kv;
      header.writeUInt32BE(run.destination, 9);
      header.writeUInt32BE(run.count, 13);
      header.writeUInt32BE(length, 17);
      header.writeUInt32BE(crc32(body), 21);
      if (faults?.corruptRun === sent) body[length >> 1] = body[length >> 1]! ^ 0xff;
      socket.write(header);
      socket.write(body);
      sent++;
      this.runsSent++;
      total += length;
    }
    this.served++;
    socket.end(encodeJsonFrame({ t: 'kv-done', runs: sent, bytes: total }));
  }
}

// ---------------------------------------------------------------------------------------------------------------
// Decode side

export interface KvPullOptions {
  clusterToken: string;
  /** host:port of the prefill worker's KV port. */
  host: string;
  port: number;
  /** Where the blocks go: the decode worker's pool (or a staging pool handed to its engine). */
  destination: KvPoolView;
  timeoutMs?: number;
  /** Stops the transfer (the connection is closed): rejects with reason 'aborted'. */
  signal?: AbortSignal;
}

/**
 * Pulls the descriptor's blocks into the destination pool. Resolves when every run came, checked; rejects with
 * KvTransferError otherwise (runs written before the failure are in the destination blocks, which the caller frees
 * or overwrites by prefilling).
 */
export function pullKvBlocks(descriptor: KvPullDescriptor, options: KvPullOptions): Promise<KvPullResult> {
  const view = options.destination;
  checkDescriptor(descriptor as unknown as Record<string, unknown>, view, 'destination');
  const expected = planRuns(descriptor);
  const runBytes = kvBlockRunBytes(view.layout);
  const pool = new Uint8Array(view.pool);
  const started = performance.now();
  return new Promise((resolve, reject) => {
    const socket = net.connect({ host: options.host, port: options.port });
    socket.setNoDelay(true);
    let next = 0;
    let bytes = 0;
    let settled = false;
    let chunks: Buffer[] = [];
    let buffered = 0;
    const finish = (error: KvTransferError | null) => {
      if (settled) return;
      settled = true;
      clearTimeout(timer);
      socket.destroy();
      if (error) reject(error);
      else resolve({ bytes, blocks: descriptor.sourceBlockIds.length, runs: next, ms: performance.now() - started, link: 'tcp' });
    };
    const timer = setTimeout(() => finish(new KvTransferError('timeout', `KV transfer of ${descriptor.requestId} took over ${options.timeoutMs ?? 30_000} ms`)),
      options.timeoutMs ?? 30_000);
    const onAbort = () => finish(new KvTransferError('aborted', `KV transfer of ${descriptor.requestId} aborted after ${next} of ${expected.length} runs`));
    if (options.signal?.aborted) onAbort();
    options.signal?.addEventListener('abort', onAbort, { once: true });
    socket.once('close', () => options.signal?.removeEventListener('abort', onAbort));
    socket.on('connect', () => {
      socket.write(encodeJsonFrame({ t: 'kv-hello', v: KV_TCP_VERSION, token: options.clusterToken }));
      socket.write(encodeJsonFrame({ t: 'kv-pull', ...descriptor }));
    });
    socket.on('error', (error) => finish(new KvTransferError(next === 0 && bytes === 0 ? 'connect' : 'truncated',
      `KV transfer of ${descriptor.requestId}: ${error.message}`)));
    socket.on('close', () => finish(new KvTransferError('truncated',
      `KV transfer of ${descriptor.requestId} ended after ${next} of ${expected.length} runs`)));
    socket.on('data', (chunk: Buffer) => {
      chunks.push(chunk);
      buffered += chunk.length;
      try {
        while (!settled && buffered >= 5) {
          // Only the header is looked at until the whole frame is in: no copying per chunk of a large run.
          if (chunks[0]!.length < 5) chunks = [Buffer.concat(chunks)];
          const length = chunks[0]!.readUInt32BE(0);
          const kind = chunks[0]![4]!;
          const run = expected[next];
          const limit = kind === FRAME_KV_RUN ? 1 + RUN_HEADER_BYTES + (run ? run.count * runBytes : 0) : MAX_CONTROL_BYTES;
          if (length < 1 || length > limit) {
            throw new KvTransferError(kind === FRAME_KV_RUN ? 'length' : 'unexpected-run', `frame of ${length} bytes (kind ${kind}) is not what the descriptor allows`);
          }
          if (buffered < 4 + length) return;
          const all = chunks.length === 1 ? chunks[0]! : Buffer.concat(chunks, buffered);
          const frame = all.subarray(5, 4 + length);
          const rest = all.subarray(4 + length);
          chunks = rest.length > 0 ? [rest] : [];
          buffered = rest.length;
          if (kind === FRAME_JSON) {
            const message = parseJsonMessage(frame);
            if (message.t === 'kv-error') throw new KvTransferError('refused', `KV transfer of ${descriptor.requestId} refused: ${String(message.reason)}`);
            if (message.t !== 'kv-done') throw new KvTransferError('unexpected-run', `unexpected message ${message.t}`);
            if (next !== expected.length || message.bytes !== bytes) {
              throw new KvTransferError('truncated', `KV transfer of ${descriptor.requestId}: done after ${next} of ${expected.length} runs`);
            }
            finish(null);
            return;
          }
          if (kind !== FRAME_KV_RUN || !run) throw new KvTransferError('unexpected-run', `unexpected frame of kind ${kind} after ${next} runs`);
          const layer = frame.readUInt16BE(0);
          const kv = frame[2]!;
          const destination = frame.readUInt32BE(4);
          const count = frame.readUInt32BE(8);
          const byteLength = frame.readUInt32BE(12);
          const checksum = frame.readUInt32BE(16);
          const body = frame.subarray(RUN_HEADER_BYTES);
          if (layer !== run.layer || kv !== run.kv || destination !== run.destination || count !== run.count) {
            throw new KvTransferError('unexpected-run', `run ${next} is layer ${layer}/${kv} block ${destination}x${count}, expected ${run.layer}/${run.kv} block ${run.destination}x${run.count}`);
          }
          if (byteLength !== count * runBytes || body.length !== byteLength) {
            throw new KvTransferError('length', `run ${next}: ${body.length} bytes, header says ${byteLength}, expected ${count * runBytes}`);
          }
          if (crc32(body) !== checksum) throw new KvTransferError('checksum', `run ${next} (layer ${layer}) of ${descriptor.requestId}: checksum mismatch`);
          pool.set(body, runOffset(view, layer, kv, destination));
          bytes += byteLength;
          next++;
        }
      } catch (error) {
        finish(error instanceof KvTransferError ? error : new KvTransferError('unexpected-run', (error as Error).message));
      }
    });
  });
}

// ---------------------------------------------------------------------------------------------------------------
// The handoff on the request plane

/** A handoff as JSON carries it (its request's logit bias as pairs). */
export function toWireHandoff(handoff: KvHandoff): unknown {
  return { ...handoff, request: toWireRequest(handoff.request) };
}

/** A handoff received from the network, checked before an engine sees it. */
export function parseWireHandoff(value: unknown): KvHandoff {
  if (typeof value !== 'object' || value === null) throw new TypeError('invalid KV handoff: not an object');
  const raw = value as Record<string, unknown>;
  return validateHandoff({ ...raw, request: parseWireRequest(raw.request) });
}

// ---------------------------------------------------------------------------------------------------------------
// The channel a frontend pairs remote workers with

/**
 * Prefill and decode worker processes: nothing is attached ahead of time. The decode worker pulls the blocks from
 * the prefill worker's KV port (its RemoteEngine's kvSourceAddress says where) when it adopts a request.
 */
export class TcpKvChannel extends PairedChannel {
  readonly kind = 'tcp';

  connect(prefill: KvSourceEndpoint, decode: KvSinkEndpoint): void {
    this.addPair(prefill.id, decode.id);
  }
}
