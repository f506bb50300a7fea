import assert from 'node:assert/strict';
import { describe, it } from 'node:test';
import { parseJsonBytes } from '../../src/api/body.ts';
import { ApiError } from '../../src/api/errors.ts';
import { modelIdFromName } from '../../src/api/gateway.ts';
import { MAX_MESSAGES, parseChatCompletionRequest } from '../../src/api/schemas/chat.ts';
import { completionPromptLogprobs, parseCompletionRequest } from '../../src/api/schemas/completion.ts';
import { toSamplingParams } from '../../src/api/schemas/generation.ts';
import { parseDetokenizeRequest, parseTokenizeRequest } from '../../src/api/schemas/tokenize.ts';

const context = { vocabSize: 1000 };
const user = [{ role: 'user', content: 'hi' }];

function chat(extra: Record<string, unknown>): unknown {
  return { model: 'm', messages: user, ...extra };
}

function rejects(parse: () => unknown, expected: { status?: number; param: string | null; code?: string; says?: RegExp }): void {
  let thrown: unknown;
  try {
    parse();
  } catch (err) {
    thrown = err;
  }
  assert.ok(thrown instanceof ApiError, `expected an ApiError, got ${String(thrown)}`);
  assert.equal(thrown.statusCode, expected.status ?? 400, thrown.message);
  assert.equal(thrown.param, expected.param, thrown.message);
  if (expected.code) assert.equal(thrown.code, expected.code, thrown.message);
  if (expected.says) assert.match(thrown.message, expected.says);
  const body = thrown.toBody();
  assert.deepEqual(Object.keys(body.error).sort(), ['code', 'message', 'param', 'type']);
}

describe('chat request validation', () => {
  const corpus: [string, unknown, string | null, string?][] = [
    ['body is an array', [], 'body', 'invalid_type'],
    ['body is a string', 'hello', 'body', 'invalid_type'],
    ['messages missing', { model: 'm' }, 'messages', 'missing_required_parameter'],
    ['messages null', { model: 'm', messages: null }, 'messages', 'missing_required_parameter'],
    ['messages not an array', { messages: 'hi' }, 'messages', 'invalid_type'],
    ['messages empty', { messages: [] }, 'messages', 'invalid_value'],
    ['message not an object', { messages: ['hi'] }, 'messages[0]', 'invalid_type'],
    ['role missing', { messages: [{ content: 'x' }] }, 'messages[0].role', 'missing_required_parameter'],
    ['role unknown', { messages: [{ role: 'wizard', content: 'x' }] }, 'messages[0].role', 'invalid_value'],
    ['role a number', { messages: [{ role: 7, content: 'x' }] }, 'messages[0].role', 'invalid_type'],
    ['function role', { messages: [{ role: 'function', content: 'x', name: 'f' }] }, 'messages[0].role', 'unsupported_parameter'],
    ['user content missing', { messages: [{ role: 'user' }] }, 'messages[0].content', 'missing_required_parameter'],
    ['content a number', { messages: [{ role: 'user', content: 5 }] }, 'messages[0].content', 'invalid_type'],
    ['content parts empty', { messages: [{ role: 'user', content: [] }] }, 'messages[0].content', 'invalid_value'],
    ['content part without text', { messages: [{ role: 'user', content: [{ type: 'text' }] }] },
      'messages[0].content[0].text', 'missing_required_parameter'],
    ['image part', { messages: [{ role: 'user', content: [{ type: 'image_url', image_url: { url: 'x' } }] }] },
      'messages[0].content[0].type', 'unsupported_parameter'],
    ['unknown part type', { messages: [{ role: 'user', content: [{ type: 'video', text: 'x' }] }] },
      'messages[0].content[0].type', 'invalid_value'],
    ['tool message without id', { messages: [{ role: 'tool', content: 'x' }] }, 'messages[0].tool_call_id', 'missing_required_parameter'],
    ['second message bad', { messages: [{ role: 'user', content: 'a' }, { role: 'user', content: {} }] },
      'messages[1].content', 'invalid_type'],
    ['temperature a string', chat({ temperature: '0.5' }), 'temperature', 'invalid_type'],
    ['temperature negative', chat({ temperature: -0.1 }), 'temperature', 'invalid_value'],
    ['temperature huge', chat({ temperature: 1e308 }), 'temperature', 'invalid_value'],
    ['top_p zero', chat({ top_p: 0 }), 'top_p', 'invalid_value'],
    ['top_p above one', chat({ top_p: 1.5 }), 'top_p', 'invalid_value'],
    ['top_k below -1', chat({ top_k: -2 }), 'top_k', 'invalid_value'],
    ['top_k fractional', chat({ top_k: 1.5 }), 'top_k', 'invalid_type'],
    ['min_p above one', chat({ min_p: 2 }), 'min_p', 'invalid_value'],
    ['repetition_penalty zero', chat({ repetition_penalty: 0 }), 'repetition_penalty', 'invalid_value'],
    ['presence_penalty out of range', chat({ presence_penalty: 3 }), 'presence_penalty', 'invalid_value'],
    ['frequency_penalty out of range', chat({ frequency_penalty: -2.5 }), 'frequency_penalty', 'invalid_value'],
    ['n zero', chat({ n: 0 }), 'n', 'invalid_value'],
    ['n huge', chat({ n: 1e9 }), 'n', 'invalid_value'],
    ['n fractional', chat({ n: 1.5 }), 'n', 'invalid_type'],
    ['max_tokens zero', chat({ max_tokens: 0 }), 'max_tokens', 'invalid_value'],
    ['max_tokens negative', chat({ max_tokens: -5 }), 'max_tokens', 'invalid_value'],
    ['max_tokens beyond safe integers', chat({ max_tokens: 2 ** 60 }), 'max_tokens', 'invalid_value'],
    ['max_completion_tokens a string', chat({ max_completion_tokens: '10' }), 'max_completion_tokens', 'invalid_type'],
    ['min_tokens above max_tokens', chat({ max_tokens: 5, min_tokens: 6 }), 'min_tokens', 'invalid_value'],
    ['stream a string', chat({ stream: 'yes' }), 'stream', 'invalid_type'],
    ['stream_options without stream', chat({ stream_options: { include_usage: true } }), 'stream_options', 'invalid_value'],
    ['include_usage a string', chat({ stream: true, stream_options: { include_usage: 'yes' } }),
      'stream_options.include_usage', 'invalid_type'],
    ['stop a number', chat({ stop: 5 }), 'stop', 'invalid_type'],
    ['stop empty string', chat({ stop: '' }), 'stop', 'invalid_value'],
    ['stop list with a number', chat({ stop: ['a', 3] }), 'stop[1]', 'invalid_type'],
    ['stop list too long', chat({ stop: Array.from({ length: 40 }, (_, i) => `s${i}`) }), 'stop', 'invalid_value'],
    ['seed fractional', chat({ seed: 1.5 }), 'seed', 'invalid_type'],
    ['logit_bias an array', chat({ logit_bias: [1] }), 'logit_bias', 'invalid_type'],
    ['logit_bias key not a token id', chat({ logit_bias: { abc: 1 } }), 'logit_bias.abc', 'invalid_value'],
    ['logit_bias key outside vocabulary', chat({ logit_bias: { 5000: 1 } }), 'logit_bias.5000', 'invalid_value'],
    ['logit_bias value too big', chat({ logit_bias: { 5: 101 } }), 'logit_bias.5', 'invalid_value'],
    ['logprobs a number', chat({ logprobs: 3 }), 'logprobs', 'invalid_type'],
    ['top_logprobs without logprobs', chat({ top_logprobs: 2 }), 'top_logprobs', 'invalid_value'],
    ['prompt_logprobs with stream', chat({ prompt_logprobs: 0, stream: true }), 'prompt_logprobs', 'invalid_value'],
    ['prompt_logprobs negative', chat({ prompt_logprobs: -2 }), 'prompt_logprobs', 'invalid_value'],
    ['top_logprobs too many', chat({ logprobs: true, top_logprobs: 21 }), 'top_logprobs', 'invalid_value'],
    ['stop_token_ids outside vocabulary', chat({ stop_token_ids: [1, 1000] }), 'stop_token_ids[1]', 'invalid_value'],
    ['ignore_eos a number', chat({ ignore_eos: 1 }), 'ignore_eos', 'invalid_type'],
    ['priority fractional', chat({ priority: 0.5 }), 'priority', 'invalid_type'],
    ['user a number', chat({ user: 42 }), 'user', 'invalid_type'],
    ['model a number', chat({ model: 3 }), 'model', 'invalid_type'],
    ['a tool without a function name', chat({ tools: [{ type: 'function', function: {} }] }), 'tools[0].function.name', 'missing_required_parameter'],
    ['tool_choice required without tools', chat({ tool_choice: 'required' }), 'tool_choice', 'invalid_value'],
    ['deadline_ms negative', chat({ deadline_ms: -1 }), 'deadline_ms', 'invalid_value'],
    ['tool_choice nonsense', chat({ tool_choice: 'sometimes' }), 'tool_choice', 'invalid_value'],
    ['json_schema response format without a name', chat({ response_format: { type: 'json_schema', json_schema: {} } }),
      'response_format.json_schema.name', 'missing_required_parameter'],
    ['json_schema with a keyword a grammar cannot enforce',
      chat({ response_format: { type: 'json_schema', json_schema: { name: 'x', schema: { type: 'number', multipleOf: 3 } } } }),
      'response_format.json_schema.schema.multipleOf', 'unsupported_parameter'],
    ['unknown response format', chat({ response_format: { type: 'yaml' } }), 'response_format.type', 'invalid_value'],
    ['audio output', chat({ audio: { voice: 'alloy', format: 'mp3' } }), 'audio', 'unsupported_parameter'],
    ['audio modality', chat({ modalities: ['text', 'audio'] }), 'modalities', 'unsupported_parameter'],
    ['functions', chat({ functions: [{ name: 'f' }] }), 'functions', 'unsupported_parameter'],
    ['guided_json with an outside reference', chat({ guided_json: { $ref: 'other.json' } }), 'guided_json.$ref', 'unsupported_parameter'],
    ['guided_choice not strings', chat({ guided_choice: ['a', 3] }), 'guided_choice[1]', 'invalid_type'],
    // Half of a surrogate pair is no character: XGrammar spelled it as bytes that decode as U+FFFD.
    ['guided_choice with a lone surrogate', chat({ guided_choice: ['a', 'b\ud800'] }), 'guided_choice[1]', 'invalid_value'],
    ['structured_outputs.choice with a lone surrogate', chat({ structured_outputs: { choice: ['\udc00'] } }), 'structured_outputs.choice[0]',
      'invalid_value'],
    // In a schema's enum or const, however deep: XGrammar's own "Failed to parse JSON" named neither value nor field.
    ['guided_json with a lone surrogate in an enum', chat({ guided_json: { enum: ['a', 'b\udbff'] } }), 'guided_json.enum[1]', 'invalid_value'],
    ['json_schema with a lone surrogate in a const',
      chat({ response_format: { type: 'json_schema', json_schema: { name: 'x', schema: { properties: { p: { const: [{ '\udc00k': 1 }] } } } } } }),
      'response_format.json_schema.schema.properties.p.const', 'invalid_value'],
    // A reference to nothing in the schema (one through a name holding '/' is followed: grammar-alternatives.test.ts).
    ['guided_json with a reference to nothing', chat({ guided_json: { $defs: { 'a/b': { type: 'null' } }, $ref: '#/$defs/a~1c' } }),
      'guided_json.$ref', 'invalid_value'],
    // A pattern that needs '"', '\' or a control character: XGrammar would write it raw inside the string (invalid JSON).
    ['guided_json with a pattern holding a quote', chat({ guided_json: { type: 'object', properties: { s: { type: 'string', pattern: 'a"b' } } } }),
      'guided_json.properties.s.pattern', 'unsupported_parameter'],
    ['guided_json with a pattern holding a newline', chat({ guided_json: { type: 'string', pattern: 'a\\nb' } }), 'guided_json.pattern',
      'unsupported_parameter'],
    ['guided_json with a pattern of control characters', chat({ guided_json: { type: 'string', pattern: '[\\x00-\\x1f]+' } }), 'guided_json.pattern',
      'unsupported_parameter'],
    // What XGrammar 0.1.27 would not enforce: allOf (any JSON value came out), bounds on non-integer numbers ({"x": 1F5}).
    ['guided_json with allOf', chat({ guided_json: { allOf: [{ type: 'object' }, { type: 'object' }] } }), 'guided_json.allOf', 'unsupported_parameter'],
    ['guided_json with a fractional bound on a number', chat({ guided_json: { type: 'object', properties: { x: { type: 'number', minimum: 0.5 } } } }),
      'guided_json.properties.x.minimum', 'unsupported_parameter'],
    ['guided_json with an exclusive bound on a number', chat({ guided_json: { type: 'number', exclusiveMaximum: 1 } }), 'guided_json.exclusiveMaximum', 'unsupported_parameter'],
    ['beam search', chat({ use_beam_search: true }), 'use_beam_search', 'unsupported_parameter'],
  ];
  for (const [what, body, param, code] of corpus) {
    it(`rejects ${what} naming '${param}'`, () => {
      rejects(() => parseChatCompletionRequest(body, context), { param, ...(code ? { code } : {}) });
    });
  }

  it('keeps patterns in guided_json that match other characters beside those JSON escapes (they are left out of the grammar)', () => {
    for (const pattern of ['.+', '\\S+', '[ -~]{3}', '[^,]*', '[^"\\\\\\x00-\\x1f]+', '\\d+\\.\\d{2}', '[\\w.-]+@[a-z]+\\.com', '\\W\\D\\s']) {
      parseChatCompletionRequest(chat({ guided_json: { type: 'string', pattern } }), context);
    }
  });

  it('keeps bounds on integers in guided_json (the grammar engine enforces those)', () => {
    parseChatCompletionRequest(chat({ guided_json: { type: 'integer', minimum: 0, exclusiveMaximum: 10 } }), context);
  });

  it('takes any positive repetition_penalty, as vLLM does', () => {
    for (const penalty of [0.5, 2.5, 10]) {
      assert.equal(parseChatCompletionRequest(chat({ repetition_penalty: penalty }), context).repetitionPenalty, penalty);
    }
  });

  it('accepts a full request and keeps every field', () => {
    const request = parseChatCompletionRequest(chat({
      messages: [
        { role: 'system', content: 'be brief' },
        { role: 'user', content: [{ type: 'text', text: 'a' }, { type: 'text', text: 'b' }], name: 'ann' },
        { role: 'assistant', content: null, tool_calls: [{ id: 'c1', type: 'function', function: { name: 'f', arguments: '{}' } }] },
        { role: 'tool', content: 'result', tool_call_id: 'c1' },
      ],
      stream: true, stream_options: { include_usage: true }, n: 3, max_completion_tokens: 7, max_tokens: 99,
      temperature: 0, top_p: 0.5, top_k: -1, min_p: 0.1, repetition_penalty: 1.1, presence_penalty: 1,
      frequency_penalty: -1, logit_bias: { 17: -100 }, seed: 42, stop: 'END', stop_token_ids: [2], min_tokens: 2,
      ignore_eos: true, include_stop_str_in_output: true, skip_special_tokens: false, priority: -3, user: 'u1',
      logprobs: true, top_logprobs: 4, tools: [], tool_choice: 'none', response_format: { type: 'text' },
      some_future_field: { anything: true },
    }), context);
    assert.equal(request.messages[1]!.content, 'a\nb');
    assert.equal(request.messages[1]!.name, 'ann');
    assert.equal(request.messages[2]!.content, null);
    assert.equal(request.messages[2]!.tool_calls![0]!.function.name, 'f');
    assert.equal(request.messages[3]!.tool_call_id, 'c1');
    assert.equal(request.maxTokens, 7, 'max_completion_tokens wins over max_tokens');
    assert.equal(request.topK, 0, 'top_k -1 means off');
    assert.deepEqual([...request.logitBias!], [[17, -100]]);
    assert.deepEqual(request.stop, ['END']);
    assert.equal(request.includeUsage, true);
    assert.equal(request.topLogprobs, 4);
    const sampling = toSamplingParams(request, 7, request.topLogprobs);
    assert.equal(sampling.n, 3);
    assert.equal(sampling.seed, 42);
    assert.equal(sampling.minTokens, 2);
    assert.equal(sampling.logprobs, 4);
    assert.deepEqual(sampling.stopTokenIds, [2]);
    assert.equal(sampling.ignoreEos, true);
    assert.equal(sampling.skipSpecialTokens, false);
  });

  it('uses OpenAI defaults when fields are absent or null', () => {
    const request = parseChatCompletionRequest({ messages: user, temperature: null, n: null, stop: null }, context);
    assert.equal(request.model, undefined);
    assert.equal(request.temperature, 1);
    assert.equal(request.n, 1);
    assert.equal(request.maxTokens, undefined);
    assert.deepEqual(request.stop, []);
    assert.equal(request.stream, false);
    assert.equal(request.addGenerationPrompt, true);
  });
});

describe('completion request validation', () => {
  const corpus: [string, unknown, string | null, string?][] = [
    ['prompt missing', { model: 'm' }, 'prompt', 'missing_required_parameter'],
    ['prompt a number', { prompt: 5 }, 'prompt', 'invalid_type'],
    ['prompt an empty list', { prompt: [] }, 'prompt', 'invalid_value'],
    ['prompt token outside vocabulary', { prompt: [1, 2, 1000] }, 'prompt[2]', 'invalid_value'],
    ['prompt token negative', { prompt: [1, -2] }, 'prompt[1]', 'invalid_value'],
    ['prompt token fractional', { prompt: [1, 2.5] }, 'prompt[1]', 'invalid_type'],
    ['mixed prompt list', { prompt: ['a', 5] }, 'prompt[1]', 'invalid_type'],
    ['empty token list in a batch', { prompt: [[1], []] }, 'prompt[1]', 'invalid_value'],
    ['logprobs a boolean', { prompt: 'a', logprobs: true }, 'logprobs', 'invalid_type'],
    ['logprobs too many', { prompt: 'a', logprobs: 50 }, 'logprobs', 'invalid_value'],
    ['max_tokens 0 without echo', { prompt: 'a', max_tokens: 0 }, 'max_tokens', 'invalid_value'],
    ['max_tokens 0 with echo beside max_completion_tokens', { prompt: 'a', max_tokens: 0, echo: true, max_completion_tokens: 4 }, 'max_tokens', 'invalid_value'],
    ['prompt_logprobs -1 (the whole vocabulary)', { prompt: 'a', prompt_logprobs: -1 }, 'prompt_logprobs', 'invalid_value'],
    ['prompt_logprobs too many', { prompt: 'a', prompt_logprobs: 21 }, 'prompt_logprobs', 'invalid_value'],
    ['prompt_logprobs fractional', { prompt: 'a', prompt_logprobs: 1.5 }, 'prompt_logprobs', 'invalid_type'],
    ['prompt_logprobs with stream', { prompt: 'a', prompt_logprobs: 1, stream: true }, 'prompt_logprobs', 'invalid_value'],
    ['suffix', { prompt: 'a', suffix: 'z' }, 'suffix', 'unsupported_parameter'],
    ['best_of above n', { prompt: 'a', best_of: 3 }, 'best_of', 'unsupported_parameter'],
    ['temperature a string', { prompt: 'a', temperature: 'hot' }, 'temperature', 'invalid_type'],
  ];
  for (const [what, body, param, code] of corpus) {
    it(`rejects ${what} naming '${param}'`, () => {
      rejects(() => parseCompletionRequest(body, context), { param, ...(code ? { code } : {}) });
    });
  }

  it('max_tokens 0 refused beside echo: true names what else it needs', () => {
    assert.throws(() => parseCompletionRequest({ prompt: 'a', max_tokens: 0, echo: true, max_completion_tokens: 4 }, context),
      (error: Error) => /only allowed with echo: true and no max_completion_tokens/.test(error.message));
  });

  it('reads every prompt form', () => {
    assert.deepEqual(parseCompletionRequest({ prompt: 'x' }, context).prompts, [{ text: 'x' }]);
    assert.deepEqual(parseCompletionRequest({ prompt: ['x', 'y'] }, context).prompts, [{ text: 'x' }, { text: 'y' }]);
    assert.deepEqual(parseCompletionRequest({ prompt: [3, 4] }, context).prompts, [{ tokenIds: [3, 4] }]);
    assert.deepEqual(parseCompletionRequest({ prompt: [[3], [4, 5]] }, context).prompts, [{ tokenIds: [3] }, { tokenIds: [4, 5] }]);
    assert.equal(parseCompletionRequest({ prompt: 'x', logprobs: 0 }, context).logprobs, 0);
  });

  it('takes echo with max_tokens 0 as the prompt alone: one token for the engine, none shown', () => {
    const request = parseCompletionRequest({ prompt: 'x', echo: true, max_tokens: 0, logprobs: 1 }, context);
    assert.equal(request.promptOnly, true);
    assert.equal(request.maxTokens, 1);
    assert.equal(parseCompletionRequest({ prompt: 'x', echo: true, max_tokens: 3 }, context).promptOnly, false);
    assert.equal(parseCompletionRequest({ prompt: 'x', echo: true }, context).promptOnly, false);
  });

  it('asks the engine for the prompt logprobs that echo with logprobs and prompt_logprobs show, the larger count', () => {
    const promptLogprobs = (body: object) => completionPromptLogprobs(parseCompletionRequest({ prompt: 'x', ...body }, context));
    assert.equal(promptLogprobs({}), undefined);
    assert.equal(promptLogprobs({ logprobs: 3 }), undefined, 'without echo the prompt is not shown');
    assert.equal(promptLogprobs({ echo: true }), undefined, 'echo without logprobs shows only text');
    assert.equal(promptLogprobs({ echo: true, logprobs: 0 }), 0);
    assert.equal(promptLogprobs({ prompt_logprobs: 2 }), 2);
    assert.equal(promptLogprobs({ echo: true, logprobs: 5, prompt_logprobs: 2 }), 5);
    assert.equal(promptLogprobs({ echo: true, logprobs: 1, prompt_logprobs: 4 }), 4);
  });
});

describe('tokenize and detokenize validation', () => {
  it('needs exactly one of prompt and messages', () => {
    rejects(() => parseTokenizeRequest({}, context), { param: 'prompt' });
    rejects(() => parseTokenizeRequest({ prompt: 'a', messages: user }, context), { param: 'messages' });
  });

  it('checks messages as chat completions do', () => {
    rejects(() => parseTokenizeRequest({ messages: [{ role: 'robot', content: 'x' }] }, context), { param: 'messages[0].role' });
    // At most MAX_MESSAGES: the template renders them on the event loop.
    const many = Array.from({ length: MAX_MESSAGES + 1 }, () => ({ role: 'user', content: '' }));
    rejects(() => parseTokenizeRequest({ messages: many }, context), { param: 'messages', says: /4097 items; the limit is 4096/ });
    rejects(() => parseChatCompletionRequest(chat({ messages: many }), context), { param: 'messages', says: /the limit is 4096/ });
    assert.equal(parseChatCompletionRequest(chat({ messages: many.slice(1) }), context).messages.length, MAX_MESSAGES);
    const request = parseTokenizeRequest({ messages: user, add_generation_prompt: false }, context);
    assert.equal(request.kind, 'messages');
    assert.equal(request.kind === 'messages' && request.addGenerationPrompt, false);
  });

  it('checks token ids against the vocabulary', () => {
    rejects(() => parseDetokenizeRequest({ tokens: [1, 'a'] }, context, 2048), { param: 'tokens[1]' });
    rejects(() => parseDetokenizeRequest({ tokens: [99999] }, context, 2048), { param: 'tokens[0]' });
    rejects(() => parseDetokenizeRequest({}, context, 2048), { param: 'tokens' });
    assert.deepEqual(parseDetokenizeRequest({ tokens: [1, 2] }, context, 2048).tokens, [1, 2]);
  });
});

describe('request body decoding', () => {
  it('rejects malformed JSON with the parser\'s reason', () => {
    rejects(() => parseJsonBytes(Buffer.from('{"messages": [')), { param: null, code: 'invalid_json', says: /not valid JSON/ });
    rejects(() => parseJsonBytes(Buffer.from("{'single': 'quotes'}")), { param: null, code: 'invalid_json' });
  });

  it('rejects an empty body', () => {
    rejects(() => parseJsonBytes(Buffer.alloc(0)), { param: null, code: 'invalid_json', says: /empty/ });
  });

  it('rejects invalid UTF-8 even inside a JSON string', () => {
    const bytes = Buffer.concat([Buffer.from('{"prompt": "a'), Buffer.from([0xc3, 0x28]), Buffer.from('"}')]);
    rejects(() => parseJsonBytes(bytes), { param: null, code: 'invalid_utf8' });
    rejects(() => parseJsonBytes(Buffer.from([0x7b, 0xff, 0x7d])), { param: null, code: 'invalid_utf8' });
  });

  it('accepts UTF-8 with a byte-order mark and multi-byte characters', () => {
    const value = parseJsonBytes(Buffer.from('\ufeff{"prompt": "héllo ✓ 🙂"}', 'utf8'));
    assert.deepEqual(value, { prompt: 'héllo ✓ 🙂' });
  });
});

describe('model ids from model names', () => {
  it('turns whitespace runs into one "-" and keeps everything else', () => {
    assert.equal(modelIdFromName('Llama 3.1 70B'), 'Llama-3.1-70B');
    assert.equal(modelIdFromName('  TinyLlama  1.1B\tChat '), 'TinyLlama-1.1B-Chat');
    assert.equal(modelIdFromName('conduit-synthetic-22m'), 'conduit-synthetic-22m');
    assert.equal(modelIdFromName('   '), 'model');
  });
});
