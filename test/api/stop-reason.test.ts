// stop_reason for the model's end-of-generation tokens, as vLLM reports it: ending on the EOS is null, ending on
// another end-of-generation id (Qwen's <|im_end|>, which vLLM adds to stop_token_ids) is that id, and ignore_eos
// goes past both. A synthetic model with Qwen 2's vocabulary (EOS <|endoftext|>, also <|im_end|>); logit_bias makes
// the token wanted the first one sampled. Then stop strings, which match code points as vLLM's (Python's) do; one
// holding half a surrogate pair could never match, and is refused.

import assert from 'node:assert/strict';
import { mkdtempSync, rmSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { after, before, describe, it } from 'node:test';
import { silentLogger } from '../../src/util/log.ts';
import { parseServeConfig, startServer, type RunningServer } from '../../src/cli/serve.ts';
import { skipUnlessShared, writeSharedVocabModel } from '../helpers/shared-models.ts';
import { rawRequest } from './http-client.ts';

const VOCAB = 'ggml-vocab-qwen2.gguf';
const ENDOFTEXT = 151643;
const IM_END = 151645;

describe('stop_reason of end-of-generation tokens', { skip: skipUnlessShared(VOCAB) }, () => {
  let dir: string;
  let server: RunningServer;

  before(async () => {
    dir = mkdtempSync(join(tmpdir(), 'conduit-stop-reason-'));
    const path = join(dir, 'qwen-vocab.gguf');
    writeSharedVocabModel(VOCAB, path, 'stop reason');
    const config = parseServeConfig(['--model', path, '--port', '0', '--log-level', 'silent', '--kv-cache-memory', '8MiB',
      '--threads', '1', '--worker-restart-limit', '0'], {});
    if (config === 'help') throw new Error('unexpected --help');
    server = await startServer(config, silentLogger);
  });
  after(async () => {
    await server?.api.shutdown(0);
    rmSync(dir, { recursive: true, force: true });
  });

  async function complete(body: object): Promise<{ finish: string; stop: unknown; tokens: number }> {
    const res = await rawRequest(server.url, {
      path: '/v1/completions', body: { prompt: 'Hello', max_tokens: 4, temperature: 0, ...body },
    });
    assert.equal(res.status, 200, res.text);
    const json = res.json();
    return { finish: json.choices[0].finish_reason, stop: json.choices[0].stop_reason, tokens: json.usage.completion_tokens };
  }

  it('ending on the EOS is stop_reason null; on <|im_end|> its id; a requested stop token id its id', async () => {
    assert.deepEqual(await complete({ logit_bias: { [ENDOFTEXT]: 100 } }), { finish: 'stop', stop: null, tokens: 1 });
    assert.deepEqual(await complete({ logit_bias: { [IM_END]: 100 } }), { finish: 'stop', stop: IM_END, tokens: 1 });
    assert.deepEqual(await complete({ logit_bias: { [IM_END]: 100 }, stop_token_ids: [IM_END] }),
      { finish: 'stop', stop: IM_END, tokens: 1 });
  });

  it('ignore_eos goes past both, to max_tokens', async () => {
    for (const id of [ENDOFTEXT, IM_END]) {
      assert.deepEqual(await complete({ logit_bias: { [id]: 100 }, ignore_eos: true }), { finish: 'length', stop: null, tokens: 4 });
    }
  });

  it('a stream reports the same stop_reason in its last choice', async () => {
    const res = await rawRequest(server.url, {
      path: '/v1/completions', body: { prompt: 'Hello', max_tokens: 4, temperature: 0, stream: true, logit_bias: { [IM_END]: 100 } },
    });
    const events = res.text.split('\n').filter((line) => line.startsWith('data: {')).map((line) => JSON.parse(line.slice(6)));
    const last = events.filter((event) => event.choices?.[0]?.finish_reason).at(-1);
    assert.deepEqual([last.choices[0].finish_reason, last.choices[0].stop_reason], ['stop', IM_END]);
  });

  it('a stop string with half of a surrogate pair is refused, streamed or not: it could never match', async () => {
    // "😀" is "\ud83d\ude00" in UTF-16; as code points (what vLLM matches) the output holds neither half alone, so such
    // a stop string would never match and the request would run as if it had none: it is a 400 naming stop instead.
    const body = { prompt: 'Hi', max_tokens: 8, temperature: 0, guided_regex: 'ab😀cd' };
    for (const stop of ['\ude00', '\ud83d', '\ude00c', 'b\ud83d']) {
      for (const stream of [false, true]) {
        const res = await rawRequest(server.url, { path: '/v1/completions', body: { ...body, stop: [stop], stream } });
        assert.equal(res.status, 400, `stop ${JSON.stringify(stop)}: ${res.text}`);
        assert.equal(res.json().error.param, 'stop');
      }
    }
    // A stop string of whole characters still matches at them.
    const whole = await rawRequest(server.url, { path: '/v1/completions', body: { ...body, stop: ['😀c'] } });
    assert.deepEqual([whole.json().choices[0].text, whole.json().choices[0].stop_reason], ['ab', '😀c']);
  });
});
