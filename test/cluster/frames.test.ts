// Frames of the request plane: cut correctly whatever the chunking, limits checked on the length before buffering,
// and the wire request round trip (logitBias as pairs) with its validation.
import { describe, test } from 'node:test';
import assert from 'node:assert/strict';
import { encodeBlobFrame, encodeJsonFrame, FrameError, FrameReader, FRAME_BLOB, FRAME_JSON, parseJsonMessage } from '../../src/cluster/frames.ts';
import { parseWireRequest, toWireRequest, tokenMatches } from '../../src/cluster/request-plane.ts';
import { DEFAULT_SAMPLING, type EngineRequest, type GuidedDecoding } from '../../src/engine/types.ts';

describe('request-plane frames', () => {
  test('frames come out whole and in order however the bytes are chunked', () => {
    const bytes = Buffer.concat([encodeJsonFrame({ t: 'a', n: 1 }), encodeBlobFrame(Buffer.from([1, 2, 3])), encodeJsonFrame({ t: 'b', s: 'é' })]);
    for (const size of [1, 2, 5, 7, bytes.length]) {
      const reader = new FrameReader();
      const out = [];
      for (let i = 0; i < bytes.length; i += size) out.push(...reader.push(bytes.subarray(i, i + size)));
      assert.deepEqual(out.map((f) => f.kind), [FRAME_JSON, FRAME_BLOB, FRAME_JSON]);
      assert.deepEqual(parseJsonMessage(out[2]!.payload), { t: 'b', s: 'é' });
      assert.deepEqual([...out[1]!.payload], [1, 2, 3]);
    }
  });

  test('an over-long length, an empty frame and an unknown kind are refused before buffering', () => {
    const reader = new FrameReader(100);
    const header = Buffer.alloc(4);
    header.writeUInt32BE(101, 0);
    assert.throws(() => reader.push(header), (e: Error) => e instanceof FrameError && /over the limit of 100/.test(e.message));
    assert.throws(() => new FrameReader().push(Buffer.alloc(4)), /empty frame/);
    assert.throws(() => new FrameReader().push(Buffer.from([0, 0, 0, 1, 9])), /unknown frame kind 9/);
    assert.throws(() => parseJsonMessage(Buffer.from('[1,2]')), /not a message/);
  });

  test('a request survives the wire (logit bias as pairs) and a bad one names its field', () => {
    const request: EngineRequest = {
      id: 'r1', promptTokenIds: [1, 2, 3], priority: 0, arrivalMs: 5, traceparent: '00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01',
      sampling: { ...DEFAULT_SAMPLING, logitBias: new Map([[7, -1.5]]), seed: 3, stop: ['x'] },
    };
    const back = parseWireRequest(JSON.parse(JSON.stringify(toWireRequest(request))));
    assert.deepEqual(back, request);
    const bad = JSON.parse(JSON.stringify(toWireRequest(request)));
    bad.promptTokenIds = [1, -2];
    assert.throws(() => parseWireRequest(bad), /promptTokenIds/);
    bad.promptTokenIds = [1];
    bad.sampling.temperature = 'hot';
    assert.throws(() => parseWireRequest(bad), /sampling.temperature/);
  });

  test('prompt logprobs cross the wire; a bad count is refused', () => {
    const request: EngineRequest = {
      id: 'p1', promptTokenIds: [1, 2, 3], priority: 0, arrivalMs: 5, sampling: { ...DEFAULT_SAMPLING, promptLogprobs: 4 },
    };
    assert.deepEqual(parseWireRequest(JSON.parse(JSON.stringify(toWireRequest(request)))), request);
    const bad = JSON.parse(JSON.stringify(toWireRequest(request)));
    bad.sampling.promptLogprobs = -1;
    assert.throws(() => parseWireRequest(bad), /sampling.promptLogprobs/);
    bad.sampling.promptLogprobs = '4';
    assert.throws(() => parseWireRequest(bad), /sampling.promptLogprobs/);
  });

  test('the special tokens a tool-call format keeps cross the wire; a bad list is refused', () => {
    const request: EngineRequest = {
      id: 'k1', promptTokenIds: [1, 2, 3], priority: 0, arrivalMs: 5, sampling: { ...DEFAULT_SAMPLING, keptSpecialTokenIds: [32001, 32002] },
    };
    assert.deepEqual(parseWireRequest(JSON.parse(JSON.stringify(toWireRequest(request)))), request);
    const bad = JSON.parse(JSON.stringify(toWireRequest(request)));
    bad.sampling.keptSpecialTokenIds = [1.5];
    assert.throws(() => parseWireRequest(bad), /sampling.keptSpecialTokenIds/);
    bad.sampling.keptSpecialTokenIds = '32001';
    assert.throws(() => parseWireRequest(bad), /sampling.keptSpecialTokenIds/);
  });

  test('the end-of-generation ids min_tokens holds under ignore_eos cross the wire; a bad list is refused', () => {
    const request: EngineRequest = {
      id: 'e1', promptTokenIds: [1, 2, 3], priority: 0, arrivalMs: 5,
      sampling: { ...DEFAULT_SAMPLING, minTokens: 4, ignoreEos: true, ignoredEosTokenIds: [128008] },
    };
    assert.deepEqual(parseWireRequest(JSON.parse(JSON.stringify(toWireRequest(request)))), request);
    const bad = JSON.parse(JSON.stringify(toWireRequest(request)));
    bad.sampling.ignoredEosTokenIds = [1.5];
    assert.throws(() => parseWireRequest(bad), /sampling.ignoredEosTokenIds/);
  });

  test('a guided request and a migrated one\'s prior output cross the wire whole; a bad grammar spec is refused', () => {
    const guided: GuidedDecoding[] = [
      { kind: 'json_object', compact: true }, { kind: 'json_schema', schema: '{"type":"object"}' },
      { kind: 'regex', pattern: '[a-z]+' }, { kind: 'choice', choices: ['yes', 'no'] }, { kind: 'grammar', ebnf: 'root ::= "a"' },
    ];
    for (const spec of guided) {
      const request: EngineRequest = {
        id: 'g1', promptTokenIds: [1, 2, 3, 9, 8], priority: 0, arrivalMs: 5, priorOutputTokenIds: [9, 8],
        sampling: { ...DEFAULT_SAMPLING, guided: spec },
      };
      assert.deepEqual(parseWireRequest(JSON.parse(JSON.stringify(toWireRequest(request)))), request);
    }
    const wire = (guidedSpec: unknown) => ({ ...JSON.parse(JSON.stringify(toWireRequest({
      id: 'g2', promptTokenIds: [1], priority: 0, arrivalMs: 5, sampling: { ...DEFAULT_SAMPLING },
    }))), sampling: { ...DEFAULT_SAMPLING, guided: guidedSpec } });
    assert.throws(() => parseWireRequest(wire({ kind: 'ebnf' })), /guided.kind must be one of/);
    assert.throws(() => parseWireRequest(wire({ kind: 'choice', choices: [] })), /guided.choices/);
    assert.throws(() => parseWireRequest(wire({ kind: 'regex' })), /guided.pattern/);
    assert.throws(() => parseWireRequest(wire({ kind: 'json_object', compact: 'yes' })), /guided.compact/);
  });

  test('the token check is exact', () => {
    assert.equal(tokenMatches('secret', 'secret'), true);
    assert.equal(tokenMatches('secret', 'secreT'), false);
    assert.equal(tokenMatches('secret', undefined), false);
  });
});
