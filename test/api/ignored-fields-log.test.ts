// A field a generation request sends that no endpoint reads is ignored, as vLLM ignores it, and, as vLLM does, the
// server says so in a warning naming the fields: a misspelt "max_token" would otherwise pass unnoticed, the request
// running with the default. Fields the endpoint reads, refused or not, are never named.
import assert from 'node:assert/strict';
import { it } from 'node:test';
import { parseServeConfig, startServer } from '../../src/cli/serve.ts';
import { createLogger } from '../../src/util/log.ts';

it('warns of the fields a request sent that were ignored, and of no others', { timeout: 60_000 }, async () => {
  const lines: string[] = [];
  const config = parseServeConfig(['--port', '0', '--engine', 'sim', '--sim-speed-up', 'inf'], {});
  assert.notEqual(config, 'help');
  const running = await startServer(config as Exclude<typeof config, 'help'>, createLogger('info', (line) => lines.push(line)));
  const post = async (path: string, body: object): Promise<string> => {
    const response = await fetch(`${running.url}${path}`, {
      method: 'POST', body: JSON.stringify(body), headers: { 'Content-Type': 'application/json' },
    });
    assert.equal(response.status, 200, await response.clone().text());
    return response.headers.get('x-request-id')!;
  };
  const warnings = (): string[] => lines.filter((line) => /ignored/.test(line));
  try {
    const misspelt = await post('/v1/completions', { prompt: 'Hello', max_token: 2, frobnicate: { a: 1 } });
    assert.equal(warnings().length, 1, lines.join(''));
    assert.match(warnings()[0]!, new RegExp(`request ${misspelt}: the request's fields max_token, frobnicate are not read by /v1/completions and were ignored`));
    lines.length = 0;
    await post('/v1/chat/completions', { messages: [{ role: 'user', content: 'Hi' }], max_tokens: 2, temprature: 0 });
    assert.match(warnings().join(''), /field temprature is not read by \/v1\/chat\/completions and was ignored/);
    lines.length = 0;
    await post('/v1/responses', { input: 'Hi', max_output_tokens: 2, max_output_token: 2 });
    assert.match(warnings().join(''), /field max_output_token is not read by \/v1\/responses/);

    // A name is the client's: the controls JSON leaves raw (a C1 escape-sequence start, a line separator, a bidi
    // override) are escaped too, so a name cannot colour, break or reorder the warning.
    lines.length = 0;
    await post('/v1/completions', { prompt: 'Hi', max_tokens: 2, ['x\x9b2J\u2028y\u202e']: 1 });
    assert.equal(warnings().length, 1, lines.join(''));
    assert.doesNotMatch(warnings()[0]!, /[\x7f-\x9f\u2028\u2029\u202a-\u202e]/);
    assert.match(warnings()[0]!, /field "x\\u009b2J\\u2028y\\u202e" is not read/);

    // Requests with many fields the endpoints read (null ones too): no warning.
    lines.length = 0;
    await post('/v1/completions', {
      model: running.api.gateway.servedModelName, prompt: ['Hello', [1, 2]], max_tokens: 2, temperature: 0.5, top_p: 0.9, top_k: 5,
      min_p: 0, n: 1, best_of: 1, echo: true, logprobs: 2, stop: ['x'], seed: 1, presence_penalty: 0, frequency_penalty: 0,
      repetition_penalty: 1, logit_bias: { 5: 1 }, user: 'u', stream: false, stream_options: null, suffix: null, min_tokens: 0,
      ignore_eos: false, stop_token_ids: [], skip_special_tokens: true, include_stop_str_in_output: false, priority: 0,
      add_special_tokens: true, truncate_prompt_tokens: 100, return_tokens_as_token_ids: false, cache_salt: 's',
      request_id: 'r1', spaces_between_special_tokens: true, prompt_logprobs: 1, return_token_ids: true,
      max_completion_tokens: null, use_beam_search: false, response_format: { type: 'text' },
    });
    // The prompt alone, scored (max_tokens 0 with echo): read as another request, whose fields count too.
    await post('/v1/completions', { prompt: 'Hello', max_tokens: 0, echo: true, logprobs: 1, use_beam_search: false });
    await post('/v1/chat/completions', {
      messages: [{ role: 'user', content: 'Hi' }], max_completion_tokens: 2, logprobs: true, top_logprobs: 1,
      chat_template_kwargs: {}, documents: [], continue_final_message: false, add_generation_prompt: true,
      parallel_tool_calls: true, stream: true, stream_options: { include_usage: true }, verbosity: 'medium',
    });
    await post('/v1/responses', { input: 'Hi', max_output_tokens: 2, instructions: 'Be brief.', store: false, metadata: { a: 'b' } });
    assert.deepEqual(warnings(), []);
  } finally {
    await running.api.shutdown(0);
  }
});
