// Chat templates: real public templates (Llama 3, Llama 2, ChatML/Qwen2, Phi-3, Gemma 3) rendered for short conversations,
// each expected prompt written out by hand from the template's rules.

import assert from 'node:assert/strict';
import { describe, it } from 'node:test';
import {
  ChatTemplate, chatTemplateFromConfig, chatTemplateFromGguf, ChatTemplateError, encodeChatPrompt,
  FALLBACK_CHAT_TEMPLATE,
} from '../../src/model/chat-template.ts';
import type { ChatMessage } from '../../src/model/chat-template.ts';
import { metaString } from '../../src/model/gguf.ts';
import { ggufTokenizer, skipUnlessVocab, vocabFile } from './tokenizer-fixtures.ts';
import { GEMMA3_CHAT_TEMPLATE } from './arch-models.ts';
import { TEMPLATE_STEP_BUDGET } from '../../src/model/template-values.ts';

// ---------------------------------------------------------------------------------------------------------------
// Public templates, as published in the models' tokenizer_config.json

/** Meta-Llama-3-8B-Instruct. */
const LLAMA3_TEMPLATE = "{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}";

/** Llama-2-7b-chat-hf. */
const LLAMA2_TEMPLATE = "{% if messages[0]['role'] == 'system' %}{% set loop_messages = messages[1:] %}{% set system_message = messages[0]['content'] %}{% else %}{% set loop_messages = messages %}{% set system_message = false %}{% endif %}{% for message in loop_messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}{% if loop.index0 == 0 and system_message != false %}{% set content = '<<SYS>>\\n' + system_message + '\\n<</SYS>>\\n\\n' + message['content'] %}{% else %}{% set content = message['content'] %}{% endif %}{% if message['role'] == 'user' %}{{ bos_token + '[INST] ' + content.strip() + ' [/INST]' }}{% elif message['role'] == 'assistant' %}{{ ' '  + content.strip() + ' ' + eos_token }}{% endif %}{% endfor %}";

/** Qwen2-7B-Instruct (ChatML with a default system prompt). */
const QWEN2_TEMPLATE = "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system\nYou are a helpful assistant<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}";

const llama3 = () => new ChatTemplate({ templates: LLAMA3_TEMPLATE, bosToken: '<|begin_of_text|>', eosToken: '<|end_of_text|>' });
const llama2 = () => new ChatTemplate({ templates: LLAMA2_TEMPLATE, bosToken: '<s>', eosToken: '</s>' });
const qwen2 = () => new ChatTemplate({ templates: QWEN2_TEMPLATE, bosToken: '', eosToken: '<|endoftext|>' });

const conversation: ChatMessage[] = [
  { role: 'system', content: 'You are terse.' },
  { role: 'user', content: 'Hi!' },
];

// ---------------------------------------------------------------------------------------------------------------

describe('chat templates: rendering real templates', () => {
  it('Llama 3: BOS, headers, trimmed content, end-of-turn, generation prompt', () => {
    assert.equal(llama3().render(conversation),
      '<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nYou are terse.<|eot_id|>' +
      '<|start_header_id|>user<|end_header_id|>\n\nHi!<|eot_id|>' +
      '<|start_header_id|>assistant<|end_header_id|>\n\n');
    assert.equal(llama3().render([{ role: 'user', content: '  padded  ' }], { addGenerationPrompt: false }),
      '<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\npadded<|eot_id|>');
  });

  it('Llama 2: system folded into the first [INST], assistant turns closed with EOS', () => {
    const messages: ChatMessage[] = [
      { role: 'system', content: 'Be brief.' },
      { role: 'user', content: 'Hi' },
      { role: 'assistant', content: 'Hello!' },
      { role: 'user', content: 'Bye' },
    ];
    assert.equal(llama2().render(messages),
      '<s>[INST] <<SYS>>\nBe brief.\n<</SYS>>\n\nHi [/INST] Hello! </s><s>[INST] Bye [/INST]');
  });

  it('ChatML (Qwen2): default system prompt when none is given', () => {
    assert.equal(qwen2().render([{ role: 'user', content: 'Hi' }]),
      '<|im_start|>system\nYou are a helpful assistant<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n' +
      '<|im_start|>assistant\n');
    assert.equal(qwen2().render(conversation, { addGenerationPrompt: false }),
      '<|im_start|>system\nYou are terse.<|im_end|>\n<|im_start|>user\nHi!<|im_end|>\n');
  });

  it('Gemma 3: system folded into the first user turn, assistant as "model", trimmed turns', () => {
    const gemma3 = new ChatTemplate({ templates: GEMMA3_CHAT_TEMPLATE, bosToken: '<bos>', eosToken: '<eos>' });
    assert.equal(gemma3.render([...conversation, { role: 'assistant', content: ' Hello. ' }, { role: 'user', content: 'Bye' }]),
      '<bos><start_of_turn>user\nYou are terse.\n\nHi!<end_of_turn>\n<start_of_turn>model\nHello.<end_of_turn>\n' +
      '<start_of_turn>user\nBye<end_of_turn>\n<start_of_turn>model\n');
    assert.equal(gemma3.render([{ role: 'user', content: [{ type: 'text', text: 'Hi' }] }], { addGenerationPrompt: false }),
      '<bos><start_of_turn>user\nHi<end_of_turn>\n');
    assert.throws(() => gemma3.render([{ role: 'user', content: 'a' }, { role: 'user', content: 'b' }]),
      (error: unknown) => error instanceof ChatTemplateError && error.status === 400);
  });

  it('joins text parts and renders tool results and null content', () => {
    const messages: ChatMessage[] = [
      { role: 'user', content: [{ type: 'text', text: 'Hello' }, { type: 'text', text: 'world' }] },
      { role: 'assistant', content: null },
      { role: 'tool', content: '42', tool_call_id: 'call_1' },
    ];
    assert.equal(qwen2().render(messages, { addGenerationPrompt: false }),
      '<|im_start|>system\nYou are a helpful assistant<|im_end|>\n<|im_start|>user\nHello\nworld<|im_end|>\n' +
      '<|im_start|>assistant\n<|im_end|>\n<|im_start|>tool\n42<|im_end|>\n');
  });
});

describe('chat templates: tools and named templates', () => {
  const toolTemplate = '{% if tools %}TOOLS:{% for tool in tools %}{{ tool.function.name }};{% endfor %}|{% endif %}' +
    '{% for message in messages %}{{ message.role }}={{ message.content }}' +
    '{% for call in message.tool_calls or [] %}[{{ call.function.name }}({{ call.function.arguments.city }})]{% endfor %}' +
    '|{% endfor %}';
  const tools = [{ type: 'function', function: { name: 'weather', parameters: {} } },
    { type: 'function', function: { name: 'time', parameters: {} } }];

  it('passes tools through and gives templates parsed tool-call arguments', () => {
    const template = new ChatTemplate({ templates: toolTemplate });
    const messages: ChatMessage[] = [
      { role: 'user', content: 'Weather?' },
      { role: 'assistant', content: '', tool_calls: [{ id: 'c1', type: 'function',
        function: { name: 'weather', arguments: '{"city":"Oslo"}' } }] },
    ];
    assert.equal(template.render(messages, { tools }), 'TOOLS:weather;time;|user=Weather?|assistant=[weather(Oslo)]|');
    assert.equal(template.render([{ role: 'user', content: 'x' }]), 'user=x|');
  });

  it('gives templates {} for arguments that are not JSON, as vLLM does', () => {
    // A call cut off at max_tokens, replayed by the client: Qwen3-Coder's template walks the arguments' items, which a
    // string has not, so every later turn of the conversation was refused.
    const template = new ChatTemplate({ templates: '{% for message in messages %}{% for call in message.tool_calls or [] %}' +
      '<{{ call.function.name }} {{ call.function.arguments | tojson }}>' +
      '{% for name, value in call.function.arguments | items %}<parameter={{ name }}>{{ value }}{% endfor %}' +
      '{% endfor %}{% endfor %}' });
    const call = (args: string): ChatMessage[] => [{ role: 'assistant', content: null, tool_calls: [{ id: 'c1',
      type: 'function', function: { name: 'write', arguments: args } }] }];
    // What transformers renders after vLLM's parsing (json.loads, {} when it fails).
    assert.equal(template.render(call('{"path": "a.txt", "text": "unfinished'), { addGenerationPrompt: false }), '<write {}>');
    assert.equal(template.render(call('not json'), { addGenerationPrompt: false }), '<write {}>');
    assert.equal(template.render(call('{"path": "a.txt"}'), { addGenerationPrompt: false }), '<write {"path": "a.txt"}><parameter=path>a.txt');
  });

  it('takes the list form of tokenizer_config and picks tool_use when tools are given', () => {
    const template = chatTemplateFromConfig({
      chat_template: [{ name: 'default', template: 'plain:{{ messages[0].content }}' },
        { name: 'tool_use', template: 'tools:{{ tools | length }}:{{ messages[0].content }}' }],
      bos_token: { content: '<s>' },
    });
    const messages: ChatMessage[] = [{ role: 'user', content: 'hi' }];
    assert.equal(template.render(messages), 'plain:hi');
    assert.equal(template.render(messages, { tools }), 'tools:2:hi');
    assert.equal(template.render(messages, { templateName: 'tool_use', tools }), 'tools:2:hi');
    assert.equal(template.bosToken, '<s>');
  });

  it('passes extra variables (chat_template_kwargs)', () => {
    const template = new ChatTemplate({ templates: '{{ "think" if enable_thinking else "no-think" }}' });
    assert.equal(template.render([], { variables: { enable_thinking: false } }), 'no-think');
    assert.equal(template.render([], { variables: { enable_thinking: true } }), 'think');
  });
});

describe('chat templates: errors', () => {
  const rejects = (code: string, status: number, pattern: RegExp) => (error: unknown) =>
    error instanceof ChatTemplateError && error.code === code && error.status === status && pattern.test(error.message);

  it("turns the template's raise_exception into a 400 with its message", () => {
    assert.throws(() => llama2().render([{ role: 'user', content: 'a' }, { role: 'user', content: 'b' }]),
      rejects('template_rejected_messages', 400, /Conversation roles must alternate/));
  });

  it('refuses unknown roles and non-text parts with a 400', () => {
    assert.throws(() => qwen2().render([{ role: 'robot' as 'user', content: 'x' }]),
      rejects('invalid_messages', 400, /messages\[0\] has role "robot"/));
    assert.throws(() => qwen2().render([{ role: 'user', content: [{ type: 'image_url', image_url: { url: 'x' } }] }]),
      rejects('invalid_messages', 400, /content\[0\] has type "image_url"/));
  });

  it('reports a template that does not parse as the server\'s problem (500)', () => {
    assert.throws(() => new ChatTemplate({ templates: '{% for message in messages %}' }),
      rejects('invalid_template', 500, /does not parse/));
    assert.throws(() => chatTemplateFromConfig({ chat_template: 42 }), rejects('invalid_template', 500, /string or a list/));
  });

  it("bounds the numbers a template's range() makes: range(10^9) is the template's fault (500), not a stall", () => {
    const huge = new ChatTemplate({ templates: '{% for i in range(1000000000) %}x{% endfor %}' });
    const start = performance.now();
    assert.throws(() => huge.render([{ role: 'user', content: 'x' }]),
      rejects('template_render_failed', 500, /asks range\(\) for 1000000000 numbers, more than the 100000 a rendering may produce/));
    assert.ok(performance.now() - start < 1000);
    // The budget is per rendering, over every call: two loops of 60000 exceed it, each alone does not.
    const twice = new ChatTemplate({ templates: '{% for i in range(60000) %}{% endfor %}{% for i in range(60000) %}{% endfor %}' });
    assert.throws(() => twice.render([{ role: 'user', content: 'x' }]), rejects('template_render_failed', 500, /asks range/));
    // What real templates do still works: start, stop and step, counting down, an attribute named range.
    const ranges = new ChatTemplate({ templates: '{{ range(3) | join(",") }};{{ range(2, 8, 3) | join(",") }};' +
      '{{ range(3, 0, -1) | join(",") }};{{ range(messages | length) | join(",") }};{{ messages[0].range }}' });
    assert.equal(ranges.render([{ role: 'user', content: 'a' }, { role: 'user', content: 'b' }], { addGenerationPrompt: false }),
      '0,1,2;2,5;3,2,1;0,1;');
    assert.equal(ranges.render([{ role: 'user', content: 'a' }]), '0,1,2;2,5;3,2,1;0;', 'a new budget for each rendering');
  });

  it('bounds the steps of a rendering: a template that loops over the messages for each message stops with a 400', () => {
    // 3000 messages took such a template 3000 x 3000 loop turns, over a minute on the server's thread.
    const quadratic = new ChatTemplate({ templates: '{% for m in messages %}{% for k in messages %}' +
      '{% if m.role == k.role %}{% endif %}{% endfor %}{% endfor %}done' });
    const messages = (count: number): ChatMessage[] => Array.from({ length: count }, (_, i) => ({ role: 'user', content: `m${i}` }));
    assert.throws(() => quadratic.render(messages(3000)),
      rejects('template_render_failed', 400, new RegExp(`more than ${TEMPLATE_STEP_BUDGET} steps.*send fewer or shorter messages`)));
    // A few messages still render, each rendering with a budget of its own.
    assert.equal(quadratic.render(messages(20)), 'done');
    assert.equal(quadratic.render(messages(20)), 'done');
  });

  it('reports a template that fails while rendering', () => {
    const template = new ChatTemplate({ templates: '{{ messages[0].content.no_such_method() }}' });
    assert.throws(() => template.render([{ role: 'user', content: 'x' }]), rejects('template_render_failed', 400, /./));
  });
});

describe('chat templates: fallback', () => {
  it('renders "role: content" paragraphs and an assistant prompt when the model has no template', () => {
    const template = chatTemplateFromConfig({});
    assert.equal(template.isFallback, true);
    assert.equal(template.render(conversation), 'system: You are terse.\n\nuser: Hi!\n\nassistant:');
    assert.equal(template.render(conversation, { addGenerationPrompt: false }), 'system: You are terse.\n\nuser: Hi!\n\n');
    assert.equal(new ChatTemplate({ templates: FALLBACK_CHAT_TEMPLATE }).render([{ role: 'user', content: 'x' }]),
      'user: x\n\nassistant:');
  });
});

describe('chat templates from GGUF vocabularies', { skip: skipUnlessVocab('qwen2') || skipUnlessVocab('phi-3') ||
  skipUnlessVocab('llama-bpe') }, () => {
  it("renders Qwen2's own embedded template", () => {
    const template = chatTemplateFromGguf(vocabFile('qwen2'), ggufTokenizer('qwen2'));
    assert.equal(template.isFallback, false);
    assert.equal(template.eosToken, '<|endoftext|>');
    assert.equal(template.render([{ role: 'user', content: 'Hi' }]),
      '<|im_start|>system\nYou are a helpful assistant<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n');
  });

  it("renders Phi-3's own embedded template", () => {
    const file = vocabFile('phi-3');
    assert.match(metaString(file, 'tokenizer.chat_template')!, /<\|user\|>/);
    const template = chatTemplateFromGguf(file, ggufTokenizer('phi-3'));
    assert.equal(template.bosToken, '<s>');
    assert.equal(template.render([{ role: 'user', content: 'Hi' }]), '<s><|user|>\nHi<|end|>\n<|assistant|>\n');
  });

  it('falls back when the GGUF has no template', () => {
    assert.equal(chatTemplateFromGguf(vocabFile('llama-bpe'), ggufTokenizer('llama-bpe')).isFallback, true);
  });

  it('encodes a Llama 3 prompt with one BOS although both the template and the tokenizer add it', () => {
    const tokenizer = ggufTokenizer('llama-bpe');
    const template = new ChatTemplate({ templates: LLAMA3_TEMPLATE, bosToken: '<|begin_of_text|>' });
    const { ids } = encodeChatPrompt(template, tokenizer, [{ role: 'user', content: 'Hi' }]);
    const id = (token: string) => tokenizer.tokenToId(token)!;
    assert.deepEqual(ids, [128000, 128006, id('user'), 128007, id('ĊĊ'), id('Hi'), 128009,
      128006, id('assistant'), 128007, id('ĊĊ')]);
  });
});

describe('chat templates: content format', () => {
  it('is "openai" for a template that loops over message content, as vLLM detects it', () => {
    assert.equal(new ChatTemplate({ templates: GEMMA3_CHAT_TEMPLATE }).contentFormat(), 'openai');
    for (const template of [LLAMA3_TEMPLATE, LLAMA2_TEMPLATE, QWEN2_TEMPLATE]) {
      assert.equal(new ChatTemplate({ templates: template }).contentFormat(), 'string');
    }
    const looping = new ChatTemplate({ templates:
      '{% set msgs = messages %}{% for m in msgs %}{% for part in m.content %}<{{ part.text }}>{% endfor %}{% endfor %}' });
    assert.equal(looping.contentFormat(), 'openai');
    assert.equal(looping.render([{ role: 'user', content: [{ type: 'text', text: 'a' }, { type: 'text', text: 'b' }] },
      { role: 'user', content: 'c' }, { role: 'assistant', content: null }]), '<a><b><c>');
  });
});
