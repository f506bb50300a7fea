import { before, describe, it } from 'node:test';
import assert from 'node:assert/strict';
import { IncrementalDetokenizer, Utf8StreamDecoder } from '../../src/engine/detokenizer.ts';
import type { DetokenizerOptions } from '../../src/engine/detokenizer.ts';
import { readGguf } from '../../src/model/gguf.ts';
import { tokenizerFromGguf } from '../../src/model/tokenizer/index.ts';
import type { Tokenizer } from '../../src/model/tokenizer/types.ts';
import { sharedModel, skipUnlessShared } from '../helpers/shared-models.ts';
import { StopStringMatcher } from '../../src/engine/stop-strings.ts';
import { Xoshiro128 } from '../../src/util/random.ts';

const encoder = new TextEncoder();

function randomInt(rng: Xoshiro128, below: number): number {
  return rng.nextUint32() % below;
}

/** Splits `whole` into consecutive pieces at random points (empty pieces included). */
function randomSplit<T extends { length: number; slice(start: number, end?: number): T }>(rng: Xoshiro128, whole: T): T[] {
  const pieces: T[] = [];
  let start = 0;
  while (start < whole.length) {
    const end = Math.min(whole.length, start + randomInt(rng, 6));
    pieces.push(whole.slice(start, end));
    start = end;
  }
  return pieces;
}

const SAMPLE_TEXT = ['a', 'é', 'ß', '中', '文', '😀', '👍🏽', '🇯🇵', ' ', '\n', 'z', 'Ω', '€'];

/** UTF-8 of random text, with a random byte flipped or dropped now and then to make invalid sequences. */
function randomBytes(rng: Xoshiro128, corrupt: boolean): Uint8Array {
  let text = '';
  for (let i = randomInt(rng, 20); i > 0; i--) text += SAMPLE_TEXT[randomInt(rng, SAMPLE_TEXT.length)];
  const bytes = [...encoder.encode(text)];
  if (corrupt) {
    for (let i = randomInt(rng, 4); i > 0 && bytes.length > 0; i--) {
      const at = randomInt(rng, bytes.length);
      if (rng.nextFloat() < 0.5) bytes.splice(at, 1);
      else bytes[at] = randomInt(rng, 256);
    }
  }
  return Uint8Array.from(bytes);
}

describe('Utf8StreamDecoder', () => {
  it('holds a 4-byte emoji until its last byte arrives', () => {
    const decoder = new Utf8StreamDecoder();
    const emoji = encoder.encode('😀');
    const deltas = [...emoji].map((byte) => decoder.decode(Uint8Array.of(byte)));
    assert.deepEqual(deltas, ['', '', '', '😀']);
    assert.equal(decoder.pendingByteCount, 0);
  });

  it('reports held bytes and turns an unfinished character into U+FFFD at the end', () => {
    const decoder = new Utf8StreamDecoder();
    assert.equal(decoder.decode(Uint8Array.of(0x41, 0xe4, 0xb8)), 'A');
    assert.equal(decoder.pendingByteCount, 2);
    assert.equal(decoder.end(), '\ufffd');
  });

  it('replaces an invalid sequence as soon as it cannot complete, and reprocesses the byte that broke it', () => {
    const decoder = new Utf8StreamDecoder();
    assert.equal(decoder.decode(Uint8Array.of(0xe2, 0x82)), '');
    assert.equal(decoder.decode(Uint8Array.of(0x41)), '\ufffdA');
    assert.equal(decoder.decode(Uint8Array.of(0xc0, 0xed, 0xa0, 0x80)), '\ufffd'.repeat(4), 'overlong lead and surrogate');
  });

  it('gives the same text as TextDecoder, chunk by chunk, on random valid and corrupted streams', () => {
    const rng = Xoshiro128.fromSeed(77);
    for (let trial = 0; trial < 500; trial++) {
      const bytes = randomBytes(rng, trial % 2 === 1);
      const ours = new Utf8StreamDecoder();
      const reference = new TextDecoder('utf-8');
      for (const chunk of randomSplit(rng, bytes)) {
        assert.equal(ours.decode(chunk), reference.decode(chunk, { stream: true }), `trial ${trial}`);
      }
      assert.equal(ours.end(), reference.decode());
    }
  });

  it('agrees with TextDecoder on streams of boundary bytes (overlongs, surrogates, above U+10FFFF)', () => {
    // Lead and continuation bytes at the edges of each range the decoder checks.
    const edges = [0x41, 0x7f, 0x80, 0x8f, 0x90, 0x9f, 0xa0, 0xbf, 0xc0, 0xc1, 0xc2, 0xdf, 0xe0, 0xed, 0xef, 0xf0, 0xf4, 0xf5, 0xff];
    const rng = Xoshiro128.fromSeed(78);
    for (let trial = 0; trial < 2000; trial++) {
      const bytes = Uint8Array.from({ length: randomInt(rng, 12) }, () => edges[randomInt(rng, edges.length)]!);
      const ours = new Utf8StreamDecoder();
      let text = '';
      for (const chunk of randomSplit(rng, bytes)) text += ours.decode(chunk);
      text += ours.end();
      assert.equal(text, new TextDecoder().decode(bytes), `bytes ${[...bytes].map((b) => b.toString(16))}`);
    }
  });
});

/** Output of a whole text under the stop rule: cut at the stop string that completes first (ties: longer). */
function expectedStop(text: string, stops: string[], include: boolean): { text: string; stopped?: string } {
  let best: { start: number; end: number; stop: string } | undefined;
  for (const stop of stops) {
    const start = text.indexOf(stop);
    if (start < 0) continue;
    const end = start + stop.length;
    if (!best || end < best.end || (end === best.end && start < best.start)) best = { start, end, stop };
  }
  if (!best) return { text };
  return { text: text.slice(0, best.start) + (include ? best.stop : ''), stopped: best.stop };
}

/** expectedStop over code points, as Python's str.find sees the text (a lone surrogate is a code point of its own). */
function expectedStopCodePoints(text: string, stops: string[], include: boolean): { text: string; stopped?: string } {
  const chars = [...text];
  let best: { start: number; end: number; stop: string } | undefined;
  for (const stop of stops) {
    const want = [...stop];
    let start = -1;
    for (let i = 0; i + want.length <= chars.length && start < 0; i++) {
      if (want.every((char, k) => chars[i + k] === char)) start = i;
    }
    if (start < 0) continue;
    const end = start + want.length;
    if (!best || end < best.end || (end === best.end && start < best.start)) best = { start, end, stop };
  }
  if (!best) return { text };
  return { text: chars.slice(0, best.start).join('') + (include ? best.stop : ''), stopped: best.stop };
}

describe('StopStringMatcher', () => {
  it('detects a stop string split across pushes and never releases any of it', () => {
    const matcher = new StopStringMatcher(['STOP']);
    assert.deepEqual(matcher.push('abcST'), { text: 'abc' });
    assert.equal(matcher.heldText, 'ST');
    assert.deepEqual(matcher.push('O'), { text: '' });
    assert.deepEqual(matcher.push('P and more'), { text: '', stopped: 'STOP' });
    assert.equal(matcher.stopped, 'STOP');
    assert.throws(() => matcher.push('x'), /already matched/);
  });

  it('checks stop strings only after min_tokens tokens, as vLLM does', () => {
    // min_tokens 2: the first two tokens' text is never searched; a stop straddling token 2 and token 3 ends it.
    const matcher = new StopStringMatcher(['STOP', 'end'], false, 2);
    assert.deepEqual(matcher.push('a STOP b'), { text: 'a STOP b' });
    assert.deepEqual(matcher.push(' e'), { text: ' ', }, 'a possible stop is still held back');
    assert.deepEqual(matcher.push('nd'), { text: '', stopped: 'end' });

    const whole = new StopStringMatcher(['STOP'], false, 2);
    assert.deepEqual(whole.push('x'), { text: 'x' });
    assert.deepEqual(whole.push('STOP'), { text: 'STOP' }, 'within the min_tokens-th token: not a stop');
    assert.deepEqual(whole.push('STOP'), { text: '', stopped: 'STOP' });
    // Text that is not a token (the bytes flushed at the end) does not count toward min_tokens.
    const flushed = new StopStringMatcher(['STOP'], false, 1);
    assert.deepEqual(flushed.push('a'), { text: 'a' });
    assert.deepEqual(flushed.push('STOP', false), { text: 'STOP' });
  });

  it('releases held text once it can no longer begin a stop string', () => {
    const matcher = new StopStringMatcher(['STOP']);
    assert.deepEqual(matcher.push('xST'), { text: 'x' });
    assert.deepEqual(matcher.push('OX'), { text: 'STOX' });
  });

  it('keeps the stop string when asked to include it', () => {
    const matcher = new StopStringMatcher(['</s>'], true);
    assert.deepEqual(matcher.push('done</'), { text: 'done' });
    assert.deepEqual(matcher.push('s>!'), { text: '</s>', stopped: '</s>' });
  });

  it('stops on the string that completes first, the longer one on a tie', () => {
    assert.deepEqual(new StopStringMatcher(['abc', 'b']).push('xabc'), { text: 'xa', stopped: 'b' });
    assert.deepEqual(new StopStringMatcher(['c', 'abc']).push('xabc'), { text: 'x', stopped: 'abc' });
  });

  it('flushes held text at the end of the output', () => {
    const matcher = new StopStringMatcher(['###']);
    assert.deepEqual(matcher.push('a##'), { text: 'a' });
    assert.equal(matcher.flush(), '##');
  });

  it('passes text straight through without stop strings and rejects empty ones', () => {
    assert.deepEqual(new StopStringMatcher([]).push('anything'), { text: 'anything' });
    assert.throws(() => new StopStringMatcher(['ok', '']), /stop strings must be non-empty strings, got ""/);
  });

  it('gives the whole-text result however the text is chunked, and never releases text it later cuts', () => {
    const rng = Xoshiro128.fromSeed(5);
    const alphabet = 'abc ';
    const word = (length: number) => Array.from({ length }, () => alphabet[randomInt(rng, alphabet.length)]).join('');
    for (let trial = 0; trial < 2000; trial++) {
      const text = word(randomInt(rng, 25));
      const stops = Array.from({ length: 1 + randomInt(rng, 3) }, () => word(1 + randomInt(rng, 4)));
      const include = rng.nextFloat() < 0.5;
      const expected = expectedStop(text, stops, include);
      const matcher = new StopStringMatcher(stops, include);
      let emitted = '';
      let stopped: string | undefined;
      for (const chunk of randomSplit(rng, text)) {
        const result = matcher.push(chunk);
        emitted += result.text;
        const context = `text ${JSON.stringify(text)} stops ${JSON.stringify(stops)} include ${include}`;
        assert.ok(expected.text.startsWith(emitted), `released text that is not in the final output: ${context}`);
        if (result.stopped !== undefined) {
          stopped = result.stopped;
          break;
        }
      }
      if (stopped === undefined) emitted += matcher.flush();
      assert.deepEqual({ text: emitted, stopped }, { text: expected.text, stopped: expected.stopped });
    }
  });

  it('matches code points, as vLLM does: a lone surrogate never matches half of a character', () => {
    // "😀" is "\ud83d\ude00" in UTF-16; as code points it holds neither half alone.
    for (const stop of ['\ude00', '\ud83d', 'b\ud83d', '\ude00c']) {
      const matcher = new StopStringMatcher([stop]);
      assert.deepEqual(matcher.push('ab😀cd'), { text: 'ab😀cd' }, `stop ${JSON.stringify(stop)}`);
      assert.equal(matcher.stopped, undefined);
    }
    // A match on whole characters still stops, before a pair or after one.
    assert.deepEqual(new StopStringMatcher(['😀']).push('ab😀cd'), { text: 'ab', stopped: '😀' });
    assert.deepEqual(new StopStringMatcher(['\ud83d\ude00c']).push('ab😀cd'), { text: 'ab', stopped: '😀c' });
    assert.deepEqual(new StopStringMatcher(['😀'], true).push('😁😀'), { text: '😁😀', stopped: '😀' });
    // A later match on a whole character is found past one that would split a pair.
    assert.deepEqual(new StopStringMatcher(['\ude00']).push('😀\ude00x'), { text: '😀', stopped: '\ude00' });
  });

  it('never holds back half of a character, so no released text ends in a lone high surrogate', () => {
    // "\ude00c" could begin at the low half of "😀" in UTF-16, not in code points: nothing is held.
    const lone = new StopStringMatcher(['\ude00c']);
    assert.deepEqual(lone.push('ab😀'), { text: 'ab😀' });
    assert.equal(lone.heldText, '');
    // A stop string that begins with a whole character holds that character whole.
    const whole = new StopStringMatcher(['😀c']);
    assert.deepEqual(whole.push('ab😀'), { text: 'ab' });
    assert.equal(whole.heldText, '😀');
    assert.deepEqual(whole.push('d'), { text: '😀d' });
    // A stop string whose prefix would end in half of its own pair is not begun by a lone high surrogate.
    const own = new StopStringMatcher(['x😀']);
    assert.deepEqual(own.push('ax\ud83d'), { text: 'ax\ud83d' });
  });

  it('gives the code-point result on text with surrogate pairs, however it is chunked into whole characters', () => {
    const rng = Xoshiro128.fromSeed(6);
    const textAlphabet = ['a', 'b', '😀', '😁'];
    // Stop strings may hold lone surrogates (a JSON string can); two adjacent halves make a whole character.
    const stopAlphabet = ['a', 'b', '😀', '\ud83d', '\ude00', '\ude01'];
    const pick = (alphabet: string[], length: number) => Array.from({ length }, () => alphabet[randomInt(rng, alphabet.length)]!);
    const loneSurrogate = /\p{Cs}/u;
    for (let trial = 0; trial < 2000; trial++) {
      const chars = pick(textAlphabet, randomInt(rng, 12));
      const text = chars.join('');
      const stops = Array.from({ length: 1 + randomInt(rng, 3) }, () => pick(stopAlphabet, 1 + randomInt(rng, 3)).join(''));
      const include = rng.nextFloat() < 0.5;
      const expected = expectedStopCodePoints(text, stops, include);
      const matcher = new StopStringMatcher(stops, include);
      const context = `text ${JSON.stringify(text)} stops ${JSON.stringify(stops)} include ${include}`;
      let emitted = '';
      let stopped: string | undefined;
      for (const chunk of randomSplit(rng, chars)) {
        const result = matcher.push(chunk.join(''));
        assert.ok(!loneSurrogate.test(result.text), `a released delta splits a character: ${context}`);
        emitted += result.text;
        assert.ok(expected.text.startsWith(emitted), `released text that is not in the final output: ${context}`);
        if (result.stopped !== undefined) {
          stopped = result.stopped;
          break;
        }
      }
      if (stopped === undefined) emitted += matcher.flush();
      assert.deepEqual({ text: emitted, stopped }, { text: expected.text, stopped: expected.stopped }, context);
    }
  });
});

interface Run {
  deltas: string[];
  text: string;
  stopped?: string;
  /** Text emitted after each pushed token (the finish flush not included). */
  emittedAfterStep: string[];
}

/** Feeds ids one at a time until a stop string matches, then finishes the output if it did not stop. */
function detokenize(tokenizer: Tokenizer, ids: readonly number[], options: DetokenizerOptions = {}): Run {
  const detokenizer = new IncrementalDetokenizer(tokenizer, options);
  const deltas: string[] = [];
  const emittedAfterStep: string[] = [];
  let text = '';
  for (const id of ids) {
    const { delta, stopped } = detokenizer.push(id);
    deltas.push(delta);
    text += delta;
    emittedAfterStep.push(text);
    if (stopped !== undefined) return { deltas, text, stopped, emittedAfterStep };
  }
  const last = detokenizer.finish();
  deltas.push(last.delta);
  return { deltas, text: text + last.delta, stopped: last.stopped, emittedAfterStep };
}

const TEXT_PIECES = ['Hello', ' world', '😀', ' 中文', '日本語のテキスト', ' 👍🏽', '🇯🇵', ' naïve', ' ß', '\n', '  ', 'Ω€'];

for (const vocabFile of ['ggml-vocab-llama-spm.gguf', 'ggml-vocab-llama-bpe.gguf']) {
  describe(`IncrementalDetokenizer over ${vocabFile}`, { skip: skipUnlessShared(vocabFile) }, () => {
    let tokenizer: Tokenizer;
    before(() => {
      tokenizer = tokenizerFromGguf(readGguf(sharedModel(vocabFile)!));
    });

    /** Random ids: anything in the vocabulary, with extra weight on the low ids (SentencePiece byte tokens) and EOS. */
    function randomIds(rng: Xoshiro128, length: number): number[] {
      return Array.from({ length }, () => {
        const pick = rng.nextFloat();
        if (pick < 0.3) return randomInt(rng, 300);
        if (pick < 0.35) return tokenizer.eosId!;
        return randomInt(rng, tokenizer.vocabSize);
      });
    }

    it('joins to tokenizer.decode for random id sequences, with or without special tokens', () => {
      const rng = Xoshiro128.fromSeed(31);
      for (let trial = 0; trial < 300; trial++) {
        const ids = randomIds(rng, randomInt(rng, 30));
        const skipSpecialTokens = trial % 2 === 0;
        const expected = tokenizer.decode(ids, { skipSpecialTokens });
        const run = detokenize(tokenizer, ids, { skipSpecialTokens, stripLeadingSpace: true });
        assert.equal(run.text, expected, `ids ${ids}`);
        if (!expected.includes('\ufffd')) for (const delta of run.deltas) assert.ok(!delta.includes('\ufffd'), `ids ${ids}`);
      }
    });

    it('ignores stop strings in the first min_tokens tokens and stops on the first one after', () => {
      const words = ['alpha', ' beta', ' gamma', ' beta', ' delta'];
      const ids = words.flatMap((word) => tokenizer.encode(word, { addSpecialTokens: false }));
      const firstBeta = words.slice(0, 2).flatMap((word) => tokenizer.encode(word, { addSpecialTokens: false })).length;
      const whole = detokenize(tokenizer, ids).text;
      const free = detokenize(tokenizer, ids, { stop: ['beta'] });
      assert.equal(free.stopped, 'beta');
      assert.equal(free.text, whole.slice(0, whole.indexOf('beta')));
      // With min_tokens covering the first "beta", the output goes on to the second.
      const held = detokenize(tokenizer, ids, { stop: ['beta'], minTokens: firstBeta });
      assert.equal(held.stopped, 'beta');
      assert.equal(held.text, whole.slice(0, whole.lastIndexOf('beta')));
      assert.match(held.text, /beta +gamma +$/);
    });

    it('continues a prompt: decode(prompt) + deltas = decode(prompt + output), leading space kept', () => {
      const rng = Xoshiro128.fromSeed(32);
      const prompt = tokenizer.encode('Hello');
      for (let trial = 0; trial < 200; trial++) {
        const output = randomIds(rng, randomInt(rng, 30));
        const run = detokenize(tokenizer, output);
        assert.equal(tokenizer.decode(prompt) + run.text, tokenizer.decode([...prompt, ...output]), `output ${output}`);
      }
    });

    it('drops the SentencePiece leading space only at the start of a whole text', () => {
      const ids = tokenizer.encode('Hello world', { addSpecialTokens: false });
      const continued = tokenizer.stripsLeadingSpace ? ' Hello world' : 'Hello world';
      assert.equal(detokenize(tokenizer, ids, { stripLeadingSpace: true }).text, 'Hello world');
      assert.equal(detokenize(tokenizer, ids).text, continued);
    });

    it('never emits a broken character while real text streams in, however its bytes are split', () => {
      const rng = Xoshiro128.fromSeed(33);
      let splitCharacters = 0;
      for (let trial = 0; trial < 100; trial++) {
        let text = '';
        for (let i = 1 + randomInt(rng, 8); i > 0; i--) text += TEXT_PIECES[randomInt(rng, TEXT_PIECES.length)];
        const ids = tokenizer.encode(text, { addSpecialTokens: false });
        const strict = new TextDecoder('utf-8', { fatal: true });
        for (const id of ids) {
          try {
            strict.decode(tokenizer.tokenBytes(id));
          } catch {
            splitCharacters++;
          }
        }
        const run = detokenize(tokenizer, ids, { stripLeadingSpace: true });
        assert.equal(run.text, text);
        for (const delta of run.deltas) assert.ok(!delta.includes('\ufffd'), `text ${JSON.stringify(text)}`);
      }
      assert.ok(splitCharacters > 0, 'some tokens hold part of a character, so the hold-back was exercised');
    });

    it('emits an emoji split over several tokens whole, once its last byte arrives', () => {
      const ids = tokenizer.encode('😀', { addSpecialTokens: false });
      assert.ok(ids.length > 1, `the emoji is split (${ids.map((id) => tokenizer.idToToken(id))})`);
      const { deltas } = detokenize(tokenizer, ids, { stripLeadingSpace: true });
      assert.deepEqual(deltas.slice(0, -1), [...new Array(ids.length - 1).fill(''), '😀']);
    });

    it('shows or skips special tokens as asked', () => {
      const ids = [tokenizer.bosId!, ...tokenizer.encode('Hi', { addSpecialTokens: false }), tokenizer.eosId!];
      assert.equal(detokenize(tokenizer, ids, { stripLeadingSpace: true }).text, 'Hi');
      const shown = detokenize(tokenizer, ids, { skipSpecialTokens: false, stripLeadingSpace: true }).text;
      assert.equal(shown, tokenizer.decode(ids, { skipSpecialTokens: false }));
      assert.ok(shown.endsWith(tokenizer.idToToken(tokenizer.eosId!)!), shown);
      // No prompt: the output starts the text.
      const fromParams = IncrementalDetokenizer.forRequest(tokenizer, { skipSpecialTokens: false, stop: [], includeStopStrInOutput: false, minTokens: 0 }, []);
      const streamed = ids.map((id) => fromParams.push(id).delta).join('') + fromParams.finish().delta;
      assert.equal(streamed, shown);
    });

    it('keeps the text of the special tokens it is told to keep, and only theirs', () => {
      const ids = [tokenizer.bosId!, ...tokenizer.encode('Hi', { addSpecialTokens: false }), tokenizer.eosId!];
      const eos = tokenizer.idToToken(tokenizer.eosId!)!;
      const kept = detokenize(tokenizer, ids, { keptSpecialTokenIds: [tokenizer.eosId!], stripLeadingSpace: true }).text;
      assert.equal(kept, `Hi${eos}`);
      // Kept tokens are only for a request that skips the others: with special tokens shown, all show.
      const shown = detokenize(tokenizer, ids, { skipSpecialTokens: false, keptSpecialTokenIds: [tokenizer.eosId!], stripLeadingSpace: true });
      assert.equal(shown.text, tokenizer.decode(ids, { skipSpecialTokens: false }));
    });

    it('after a prompt with no text (BOS alone, or nothing) the output starts the text; after a word it does not', () => {
      const params = { skipSpecialTokens: true, stop: [], includeStopStrInOutput: false, minTokens: 0 };
      const output = tokenizer.encode('world world', { addSpecialTokens: false });
      const stream = (prompt: number[], skipSpecialTokens = true) => {
        const d = IncrementalDetokenizer.forRequest(tokenizer, { ...params, skipSpecialTokens }, prompt);
        return output.map((id) => d.push(id).delta).join('') + d.finish().delta;
      };
      const bos = tokenizer.bosId!;
      const hello = tokenizer.encode('Hello', { addSpecialTokens: false });
      // decode(prompt) + deltas = decode(prompt + output), as the whole sequence decodes.
      for (const prompt of [[], [bos], [bos, ...hello]]) {
        assert.equal(tokenizer.decode(prompt) + stream(prompt), tokenizer.decode([...prompt, ...output]), `prompt ${prompt.join(',')}`);
      }
      assert.equal(stream([bos]), 'world world');
      if (tokenizer.stripsLeadingSpace) {
        // SentencePiece: the first word's marked space shows after text, and after BOS shown as text.
        assert.equal(stream([bos, ...hello]), ' world world');
        assert.equal(stream([bos], false), ' world world');
      }
    });

    const sentence = 'The quick brown fox jumps over the lazy dog';

    it('stops at a stop string that spans tokens and leaks none of it', () => {
      const ids = tokenizer.encode(sentence, { addSpecialTokens: false });
      const run = detokenize(tokenizer, ids, { stop: ['fox ju'], stripLeadingSpace: true });
      assert.equal(run.stopped, 'fox ju');
      assert.equal(run.text, 'The quick brown ');
      for (const emitted of run.emittedAfterStep) assert.ok('The quick brown '.startsWith(emitted), emitted);
      assert.ok(run.deltas.length < ids.length, 'decoding ended at the stop string');
    });

    it('includes the stop string when asked', () => {
      const ids = tokenizer.encode(sentence, { addSpecialTokens: false });
      const run = detokenize(tokenizer, ids, { stop: ['lazy', 'fox ju'], includeStopStrInOutput: true, stripLeadingSpace: true });
      assert.deepEqual({ text: run.text, stopped: run.stopped }, { text: 'The quick brown fox ju', stopped: 'fox ju' });
    });

    it('holds back text that may begin a stop string until the next token rules it out', () => {
      const ids = tokenizer.encode(sentence, { addSpecialTokens: false });
      const run = detokenize(tokenizer, ids, { stop: ['brown cow'], stripLeadingSpace: true });
      const step = ids.findIndex((_, i) => tokenizer.decode(ids.slice(0, i + 1)).endsWith('brown'));
      assert.ok(step >= 0);
      assert.equal(run.emittedAfterStep[step], 'The quick ');
      assert.equal(run.emittedAfterStep[step + 1], tokenizer.decode(ids.slice(0, step + 2)));
      assert.equal(run.stopped, undefined);
      assert.equal(run.text, sentence);
    });

    it('flushes held text at the end, where it can still complete a stop string', () => {
      const ids = tokenizer.encode('ends with ##', { addSpecialTokens: false });
      assert.equal(detokenize(tokenizer, ids, { stop: ['###'], stripLeadingSpace: true }).text, 'ends with ##');
      // An unfinished character becomes U+FFFD at the end, exactly as in decode, and may itself be a stop string.
      const cut = tokenizer.encode('a😀', { addSpecialTokens: false }).slice(0, -1);
      assert.equal(detokenize(tokenizer, cut, { stripLeadingSpace: true }).text, tokenizer.decode(cut));
      assert.equal(detokenize(tokenizer, cut, { stop: ['\ufffd'], stripLeadingSpace: true }).stopped, '\ufffd');
    });

    it('refuses tokens after the output ended', () => {
      const detokenizer = new IncrementalDetokenizer(tokenizer, { stop: ['a'] });
      assert.equal(detokenizer.push(tokenizer.encode('a', { addSpecialTokens: false }).at(-1)!).stopped, 'a');
      assert.ok(detokenizer.done);
      assert.throws(() => detokenizer.push(0), /already finished/);
      assert.deepEqual(detokenizer.finish(), { delta: '' });
    });
  });
}
