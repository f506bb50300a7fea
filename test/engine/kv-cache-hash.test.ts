// The chained block hash (golden values from an independent implementation) and the KV event wire format.
import { describe, it } from 'node:test';
import assert from 'node:assert/strict';
import { encodeExtraKeys, extendBlockHashes, hashBlock, hashTokenBlocks } from '../../src/protocols/block-hash.ts';
import { parseBlockHash, parseKvEvent } from '../../src/protocols/kv-events.ts';

// Golden values from Python's hashlib over the byte layout documented in block-hash.ts:
//   def h(parent, tokens, salt=b'', adapter=b''):
//       b = struct.pack('<I', 0) + b'\0' * 16 if parent is None else struct.pack('<I', 1) + parent.encode('ascii')
//       b += struct.pack('<I', len(tokens)) + b''.join(struct.pack('<I', t) for t in tokens)
//       b += struct.pack('<I', len(salt)) + salt + struct.pack('<I', len(adapter)) + adapter
//       return hashlib.sha256(b).hexdigest()[:16]
const GOLDEN = {
  first: 'f995627f3b0d6b3b', // h(None, [1, 2, 3, 4])
  second: '13c1e82a4bfce6a1', // h(first, [5, 6, 7, 8])
  saltedFirst: 'fb47248f133b7652', // h(None, [1, 2, 3, 4], 'tenant-é'.encode())
  saltedAdaptedSecond: 'aadce937e5d73763', // h(saltedFirst, [5, 6, 7, 8], 'tenant-é'.encode(), b'lora-7')
  adaptedFirst: 'b15c19972d029d9c', // h(None, [1, 2, 3, 4], b'', b'lora-7')
};

describe('block hash', () => {
  it('matches the independent implementation, chained and with extra keys', () => {
    const plain = encodeExtraKeys();
    const first = hashBlock(null, [1, 2, 3, 4], 0, 4, plain);
    assert.equal(first, GOLDEN.first);
    assert.equal(hashBlock(first, [9, 5, 6, 7, 8], 1, 4, plain), GOLDEN.second);
    const salted = hashBlock(null, [1, 2, 3, 4], 0, 4, encodeExtraKeys({ cacheSalt: 'tenant-é' }));
    assert.equal(salted, GOLDEN.saltedFirst);
    assert.equal(hashBlock(salted, [5, 6, 7, 8], 0, 4, encodeExtraKeys({ cacheSalt: 'tenant-é', adapterId: 'lora-7' })),
      GOLDEN.saltedAdaptedSecond);
    assert.equal(hashBlock(null, [1, 2, 3, 4], 0, 4, encodeExtraKeys({ adapterId: 'lora-7' })), GOLDEN.adaptedFirst);
  });

  it('keeps salt and adapter apart (length-prefixed fields)', () => {
    const asSalt = hashBlock(null, [1, 2], 0, 2, encodeExtraKeys({ cacheSalt: 'x' }));
    const asAdapter = hashBlock(null, [1, 2], 0, 2, encodeExtraKeys({ adapterId: 'x' }));
    assert.notEqual(asSalt, asAdapter);
  });

  it('hashes only full blocks and extends an existing chain without recomputing it', () => {
    const tokens = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10];
    const all = hashTokenBlocks(tokens, 4);
    assert.deepEqual(all, [GOLDEN.first, GOLDEN.second]);
    const partial = extendBlockHashes([], tokens, 4, encodeExtraKeys(), 1);
    assert.deepEqual(partial, [GOLDEN.first]);
    assert.equal(extendBlockHashes(partial, tokens, 4, encodeExtraKeys()), partial);
    assert.deepEqual(partial, all);
    assert.throws(() => extendBlockHashes([], tokens, 4, encodeExtraKeys(), 3), /need 12 tokens/);
  });

  it('rejects token ids that have no 32-bit encoding', () => {
    assert.throws(() => hashTokenBlocks([1, -2], 2), /token id at index 1/);
    assert.throws(() => hashTokenBlocks([1.5, 2], 2), /token id at index 0/);
  });
});

describe('KV event wire format', () => {
  const h1 = GOLDEN.first;
  const h2 = GOLDEN.second;

  it('round-trips every event kind through JSON', () => {
    const events = [
      { type: 'stored', eventId: 1, blockHashes: [h1, h2], parentHash: null, tokenCount: 32, blockSize: 16 },
      { type: 'stored', eventId: 2, blockHashes: [h2], parentHash: h1, tokenCount: 16, blockSize: 16 },
      { type: 'removed', eventId: 3, blockHashes: [h1] },
      { type: 'cleared', eventId: 4 },
    ];
    for (const event of events) assert.deepEqual(parseKvEvent(JSON.parse(JSON.stringify(event))), event);
  });

  it('names what is wrong with a bad event', () => {
    assert.throws(() => parseKvEvent({ type: 'moved', eventId: 1 }), /unknown type "moved"/);
    assert.throws(() => parseKvEvent({ type: 'removed', eventId: 1, blockHashes: ['XYZ'] }), /blockHashes\[0\] must be 16 lowercase hex/);
    assert.throws(() => parseKvEvent({ type: 'cleared', eventId: -1 }), /eventId must be an integer >= 0/);
    assert.throws(() => parseKvEvent({ type: 'stored', eventId: 1, blockHashes: [h1], parentHash: null, tokenCount: 15, blockSize: 16 }),
      /tokenCount 15 is not 1 blocks x blockSize 16/);
    assert.throws(() => parseKvEvent({ type: 'stored', eventId: 1, blockHashes: [], parentHash: null, tokenCount: 16, blockSize: 16 }),
      /at least one block hash/);
    assert.throws(() => parseBlockHash(12345), /must be 16 lowercase hex digits, got 12345/);
  });
});
