// The KV transfer's binary control messages: each one comes back as it was written; one cut short anywhere, with
// bytes after its end, or of an unknown type is refused; a prefill worker refuses the JSON descriptors of the
// previous wire and a malformed one with kv-error; a decode side refuses a truncated kv-done or kv-link.
import { describe, test } from 'node:test';
import assert from 'node:assert/strict';
import net from 'node:net';
import { FrameError, FrameReader, FRAME_HEADER_BYTES, FRAME_JSON, encodeJsonFrame, parseJsonMessage } from '../../src/cluster/frames.ts';
import { FRAME_KV_RUN, KvTransferError, KvTransferServer, KV_TCP_VERSION, pullKvBlocks } from '../../src/cluster/kv-tcp.ts';
import { kvChecksum } from '../../src/cluster/kv-checksum.ts';
import {
  encodeCredit, encodeDescriptor, encodeDone, encodeShmLink, FRAME_KV_CONTROL, KV_CREDIT, KV_DONE, KV_LINK, KV_LINK_TCP_FRAME, KV_PULL,
  KV_STREAM, parseControl,
} from '../../src/cluster/kv-wire.ts';
import { kvBlockRunBytes, readKvBlocks, type KvPoolView } from '../../src/engine/handoff.ts';
import { kvPoolBytes, type KvPoolLayout } from '../../src/kernels/types.ts';

const TOKEN = 'kv-wire-token';

function payloadOf(frame: Buffer): Buffer {
  assert.equal(frame.readUInt32BE(0), frame.length - 4, 'the frame length counts the kind byte and the payload');
  assert.equal(frame[4], FRAME_KV_CONTROL);
  return frame.subarray(FRAME_HEADER_BYTES);
}

const pull = encodeDescriptor({
  type: KV_PULL, requestId: 'req-é-1', layers: [1, 7], hostId: 'abc123', sourceBlockIds: [3, 4, 0xffffffff], destinationBlockIds: [10, 11, 0], firstBlock: 0,
});
const stream = encodeDescriptor({
  type: KV_STREAM, requestId: 'r', layers: [0, 2], hostId: null, sourceBlockIds: null, destinationBlockIds: [5, 9], firstBlock: 3,
});
const done = encodeDone(48, 2 ** 40 + 5, 1.25, [7, 8, 9]);
const credit = encodeCredit(2 ** 33 + 17);
const shmLink = encodeShmLink('conduit-kv-12-0123456789abcdef', 4 << 20);

describe('KV transfer control messages (binary)', () => {
  test('each message reads back as written', () => {
    assert.deepEqual(parseControl(payloadOf(pull)), {
      type: KV_PULL, requestId: 'req-é-1', layers: [1, 7], hostId: 'abc123', sourceBlockIds: [3, 4, 0xffffffff], destinationBlockIds: [10, 11, 0], firstBlock: 0,
    });
    assert.deepEqual(parseControl(payloadOf(stream)), {
      type: KV_STREAM, requestId: 'r', layers: [0, 2], hostId: null, sourceBlockIds: null, destinationBlockIds: [5, 9], firstBlock: 3,
    });
    assert.deepEqual(parseControl(payloadOf(done)), { type: KV_DONE, runs: 48, bytes: 2 ** 40 + 5, overlapMs: 1.25, sourceBlockIds: [7, 8, 9] });
    assert.deepEqual(parseControl(payloadOf(credit)), { type: KV_CREDIT, upTo: 2 ** 33 + 17 });
    assert.deepEqual(parseControl(payloadOf(shmLink)), { type: KV_LINK, link: 'shm', region: 'conduit-kv-12-0123456789abcdef', regionBytes: 4 << 20 });
    assert.deepEqual(parseControl(payloadOf(KV_LINK_TCP_FRAME)), { type: KV_LINK, link: 'tcp', region: null, regionBytes: 0 });
  });

  test('a message cut short anywhere, or with a byte after its end, is refused', () => {
    for (const frame of [pull, stream, done, credit, shmLink, KV_LINK_TCP_FRAME]) {
      const payload = payloadOf(frame);
      for (let n = 0; n < payload.length; n++) {
        assert.throws(() => parseControl(payload.subarray(0, n)), FrameError, `type ${payload[0]} cut to ${n} of ${payload.length} bytes`);
      }
      assert.throws(() => parseControl(Buffer.concat([payload, Buffer.from([0])])), /after its end/, `type ${payload[0]} with a byte more`);
    }
  });

  test('an unknown type, an unknown link, a count past the bytes and a u64 over 2^53 are refused', () => {
    assert.throws(() => parseControl(Buffer.from([9])), /unknown control message 9/);
    assert.throws(() => parseControl(Buffer.from([KV_LINK, 2])), /link 2/);
    const huge = Buffer.from(payloadOf(done));
    huge.writeUInt32BE(0xffffffff, 1 + 4 + 8 + 8); // the count of source blocks
    assert.throws(() => parseControl(huge), /truncated/);
    const over = Buffer.from(payloadOf(credit));
    over.writeUInt32BE(0x00200000, 1); // high word: 2^53
    assert.throws(() => parseControl(over), /2\^53/);
    assert.throws(() => encodeCredit(2 ** 53), RangeError);
    assert.throws(() => encodeDone(1, 1, 0, [-1]), RangeError);
    assert.throws(() => encodeDescriptor({ type: KV_PULL, requestId: 'x', layers: [0, 1], hostId: null, sourceBlockIds: [1], destinationBlockIds: [1, 2], firstBlock: 0 }), RangeError);
  });

  const layout: KvPoolLayout = { numLayers: 2, numBlocks: 8, blockSize: 4, numKvHeads: 1, headDim: 8, dtype: 'f16' };
  const view = (): KvPoolView => ({ pool: new SharedArrayBuffer(kvPoolBytes(layout)), layout });

  /** Sends bytes to a KV port and collects what comes back until the prefill side closes the connection. */
  async function exchange(port: number, bytes: Buffer): Promise<Record<string, unknown>[]> {
    const socket = net.connect({ host: '127.0.0.1', port });
    const reader = new FrameReader(1 << 20, [FRAME_KV_CONTROL]);
    const messages: Record<string, unknown>[] = [];
    socket.on('data', (chunk: Buffer) => {
      for (const frame of reader.push(chunk)) if (frame.kind === FRAME_JSON) messages.push(parseJsonMessage(frame.payload));
    });
    socket.write(bytes);
    await new Promise<void>((resolve) => socket.on('close', () => resolve()));
    return messages;
  }

  test('a prefill worker refuses the previous wire\'s hello and JSON descriptors, and a malformed binary one, with kv-error', async () => {
    const server = new KvTransferServer({ clusterToken: TOKEN, pool: view() });
    const port = await server.listen(0, '127.0.0.1');
    try {
      const hello = encodeJsonFrame({ t: 'kv-hello', v: KV_TCP_VERSION, token: TOKEN });
      const older = await exchange(port, encodeJsonFrame({ t: 'kv-hello', v: KV_TCP_VERSION - 1, token: TOKEN }));
      assert.match(String(older[0]?.reason), /expected kv-hello, version/);
      const json = await exchange(port, Buffer.concat([hello, encodeJsonFrame({ t: 'kv-pull', requestId: 'a', sourceBlockIds: [1], destinationBlockIds: [1], layers: [0, 2] })]));
      assert.match(String(json[0]?.reason), /binary control frames only/);
      const cut = payloadOf(encodeDescriptor({ type: KV_PULL, requestId: 'a', layers: [0, 2], hostId: null, sourceBlockIds: [1], destinationBlockIds: [1], firstBlock: 0 }));
      const short = Buffer.alloc(5 + cut.length - 2);
      short.writeUInt32BE(1 + cut.length - 2, 0);
      short[4] = FRAME_KV_CONTROL;
      cut.copy(short, 5, 0, cut.length - 2);
      const truncated = await exchange(port, Buffer.concat([hello, short]));
      assert.match(String(truncated[0]?.reason), /truncated/);
      assert.equal(server.served, 0);
      assert.equal(server.refused, 3);
    } finally {
      await server.close();
    }
  });

  /** A fake prefill side: answers the hello and descriptor with the given bytes, then closes. */
  async function fakePrefill(answer: Buffer, run: (port: number) => Promise<void>): Promise<void> {
    const server = net.createServer((socket) => {
      socket.on('error', () => {});
      socket.once('data', () => socket.end(answer));
    });
    await new Promise<void>((resolve) => server.listen(0, '127.0.0.1', resolve));
    try {
      await run((server.address() as net.AddressInfo).port);
    } finally {
      await new Promise<void>((resolve) => server.close(() => resolve()));
    }
  }

  test('a decode side fails a transfer whose kv-link or kv-done is cut short, or names another block count', async () => {
    const cutShort = (frame: Buffer) => {
      const payload = payloadOf(frame);
      const out = Buffer.alloc(5 + payload.length - 1);
      out.writeUInt32BE(payload.length, 0);
      out[4] = FRAME_KV_CONTROL;
      payload.copy(out, 5, 0, payload.length - 1);
      return out;
    };
    const destination = view();
    const descriptor = { requestId: 'w', sourceBlockIds: [], destinationBlockIds: [], layers: [0, 2] as [number, number] };
    const cases: [string, Buffer, RegExp][] = [
      ['kv-link cut short', cutShort(KV_LINK_TCP_FRAME), /truncated/],
      ['kv-done cut short', Buffer.concat([KV_LINK_TCP_FRAME, cutShort(encodeDone(0, 0, 0, []))]), /truncated/],
      ['kv-done with a byte more', Buffer.concat([KV_LINK_TCP_FRAME, (() => {
        const payload = Buffer.concat([payloadOf(encodeDone(0, 0, 0, [])), Buffer.from([1])]);
        const frame = Buffer.alloc(5 + payload.length);
        frame.writeUInt32BE(payload.length + 1, 0);
        frame[4] = FRAME_KV_CONTROL;
        payload.copy(frame, 5);
        return frame;
      })()]), /after its end/],
      ['kv-done naming a source the descriptor lacks', Buffer.concat([KV_LINK_TCP_FRAME, encodeDone(0, 0, 0, [3])]), /source block per position/],
      ['a credit from the prefill side', Buffer.concat([KV_LINK_TCP_FRAME, encodeCredit(0)]), /unexpected control message/],
    ];
    for (const [what, answer, reason] of cases) {
      await fakePrefill(answer, async (port) => {
        await assert.rejects(pullKvBlocks(descriptor, { clusterToken: TOKEN, host: '127.0.0.1', port, destination, link: 'tcp' }),
          (error: unknown) => error instanceof KvTransferError && reason.test(error.message), what);
      });
    }
    // The same answer whole: an empty pull completes.
    await fakePrefill(Buffer.concat([KV_LINK_TCP_FRAME, encodeDone(0, 0, 0, [])]), async (port) => {
      const result = await pullKvBlocks(descriptor, { clusterToken: TOKEN, host: '127.0.0.1', port, destination, link: 'tcp' });
      assert.equal(result.runs, 0);
      assert.equal(result.link, 'tcp');
    });
  });

  test('a transfer whose bytes arrive one read at a time, every header and message split, lands whole; a flipped byte fails it', async () => {
    const small: KvPoolLayout = { numLayers: 2, numBlocks: 4, blockSize: 1, numKvHeads: 1, headDim: 8, dtype: 'f16' };
    const runBytes = kvBlockRunBytes(small);
    const source = { pool: new SharedArrayBuffer(kvPoolBytes(small)), layout: small };
    new Uint8Array(source.pool).forEach((_, i, a) => { a[i] = (i * 37 + 5) & 0xff; });
    const sourceBytes = new Uint8Array(source.pool);
    // Source block 1 -> destination block 2, both layers, K and V: four runs of one block.
    const runs: Buffer[] = [];
    for (let layer = 0; layer < 2; layer++) {
      for (let kv = 0; kv < 2; kv++) {
        const at = ((2 * layer + kv) * small.numBlocks + 1) * runBytes;
        const body = sourceBytes.subarray(at, at + runBytes);
        const header = Buffer.alloc(29);
        header.writeUInt32BE(25 + runBytes, 0);
        header[4] = FRAME_KV_RUN;
        header.writeUInt16BE(layer, 5);
        header[7] = kv;
        header.writeUInt32BE(2, 9);
        header.writeUInt32BE(1, 13);
        header.writeUInt32BE(runBytes, 17);
        header.writeUInt32BE(kvChecksum(body), 21);
        runs.push(header, Buffer.from(body));
      }
    }
    const answer = Buffer.concat([KV_LINK_TCP_FRAME, ...runs, encodeDone(4, 4 * runBytes, 0, [1])]);
    const byteByByte = async (bytes: Buffer, run: (port: number) => Promise<void>) => {
      const server = net.createServer((socket) => {
        socket.setNoDelay(true);
        socket.on('error', () => {});
        socket.once('data', async () => {
          for (let i = 0; i < bytes.length && !socket.destroyed; i++) {
            socket.write(bytes.subarray(i, i + 1));
            await new Promise((resolve) => setTimeout(resolve, 1));
          }
          socket.end();
        });
      });
      await new Promise<void>((resolve) => server.listen(0, '127.0.0.1', resolve));
      try {
        await run((server.address() as net.AddressInfo).port);
      } finally {
        await new Promise<void>((resolve) => server.close(() => resolve()));
      }
    };
    const descriptor = { requestId: 's', sourceBlockIds: [1], destinationBlockIds: [2], layers: [0, 2] as [number, number] };
    const destination = { pool: new SharedArrayBuffer(kvPoolBytes(small)), layout: small };
    await byteByByte(answer, async (port) => {
      const result = await pullKvBlocks(descriptor, { clusterToken: TOKEN, host: '127.0.0.1', port, destination, link: 'tcp' });
      assert.equal(result.runs, 4);
      assert.deepEqual(readKvBlocks(destination, [2]), readKvBlocks(source, [1]));
    });
    const corrupted = Buffer.from(answer);
    corrupted[KV_LINK_TCP_FRAME.length + 29 + 29 + runBytes + 3]! ^= 0x40; // the second run's bytes
    await byteByByte(corrupted, async (port) => {
      await assert.rejects(pullKvBlocks(descriptor, { clusterToken: TOKEN, host: '127.0.0.1', port, destination: { pool: new SharedArrayBuffer(kvPoolBytes(small)), layout: small }, link: 'tcp' }),
        (error: unknown) => error instanceof KvTransferError && error.reason === 'checksum' && /run 1 \(layer 0\)/.test(error.message));
    });
  });
});
