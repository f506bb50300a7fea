// String formats under guided decoding: random walks through the grammar each enforced format compiles to (the
// schema the gateway hands the engine, grammarSchema) end in valid JSON holding a valid value of the format. XGrammar
// 0.1.27's own grammars for some of them did not (a minute of 60, the 31st of November, an IPv4 part "01", hostname
// labels past 63 characters, raw '"' in JSON pointers: output that did not parse).

import assert from 'node:assert/strict';
import { before, describe, it } from 'node:test';
import { grammarSchema, GUIDED_FORMATS } from '../../src/api/guided.ts';
import { GrammarRuntime } from '../../src/engine/grammar/runtime.ts';
import { readGguf } from '../../src/model/gguf.ts';
import { LLAMA_SPM_TOKENIZER_PATH } from '../../src/model/synthetic.ts';
import { createTokenizer, type Tokenizer } from '../../src/model/tokenizer/index.ts';
import { FORMAT_CHECKS } from '../api/guided-fixtures.ts';

const WALKS = 40;

describe('guided string formats', () => {
  let tokenizer: Tokenizer;
  let runtime: GrammarRuntime;
  /** Tokens of one character, and the token of a lone '"' (which ends a string). */
  let oneCharacter: Set<number>;
  let quote: number;

  before(async () => {
    tokenizer = createTokenizer({ kind: 'gguf', file: readGguf(LLAMA_SPM_TOKENIZER_PATH) });
    runtime = await GrammarRuntime.create(tokenizer);
    oneCharacter = new Set();
    for (let id = 0; id < tokenizer.vocabSize; id++) if (tokenizer.tokenBytes(id, false).length === 1) oneCharacter.add(id);
    quote = [...oneCharacter].find((id) => tokenizer.tokenBytes(id, false)[0] === 0x22)!;
  });

  /**
   * Texts of walks that ended: at each step a random allowed token (often the end, or the string's closing quote, or
   * a one-character token, so that walks stay short).
   */
  function walks(schema: unknown, seed: number): string[] {
    let state = seed >>> 0;
    const random = () => {
      state = (Math.imul(state, 1103515245) + 12345) >>> 0;
      return state / 2 ** 32;
    };
    const out = new Int32Array(runtime.vocabSize);
    const texts: string[] = [];
    for (let walk = 0; walk < WALKS; walk++) {
      const guided = runtime.open({ kind: 'json_schema', schema: JSON.stringify(schema), compact: true });
      const ids: number[] = [];
      for (let step = 0; step < 300 && !guided.isTerminated; step++) {
        const allowed = Array.from(out.subarray(0, guided.allowedTokens(out)));
        const ends = allowed.filter((id) => tokenizer.stopTokenIds.includes(id));
        const short = allowed.filter((id) => oneCharacter.has(id));
        const pool = short.length > 0 && random() < 0.5 ? short : allowed;
        const id = ends.length > 0 && random() < 0.5 ? ends[0]!
          : random() < 0.15 && allowed.includes(quote) ? quote : pool[Math.floor(random() * pool.length)]!;
        assert.ok(guided.accept(id));
        if (!ends.includes(id)) ids.push(id);
      }
      if (guided.isTerminated) texts.push(tokenizer.decode(ids));
      guided.dispose();
    }
    return texts;
  }

  it('every format the gateway accepts gives parseable strings; each checked one only valid values', () => {
    for (const format of GUIDED_FORMATS) {
      const texts = walks(grammarSchema({ type: 'string', format }), format.length * 7919);
      assert.ok(texts.length >= WALKS / 4, `${format}: only ${texts.length} walks ended`);
      const check = FORMAT_CHECKS[format];
      for (const text of texts) {
        let value: unknown;
        assert.doesNotThrow(() => { value = JSON.parse(text); }, `${format}: ${text}`);
        assert.equal(typeof value, 'string', `${format}: ${text}`);
        if (check) assert.ok(check(value as string), `${format}: ${text} is not one`);
      }
    }
  });
});
