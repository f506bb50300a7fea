// The tokenizer thread is shared by every request of a model: what one request may put on it is bounded before it
// is tokenized, whatever path the text comes by (a prompt to be truncated, /tokenize, chat messages before the
// template renders them), tenants take turns on it, and a job whose client left is dropped from its queue (or, when
// long, abandoned on the thread) rather than tokenized for nobody.

import assert from 'node:assert/strict';
import { connect } from 'node:net';
import { after, before, describe, it } from 'node:test';
import { PromptEncoder } from '../../src/api/prompt-encoder.ts';
import type { Tokenizer } from '../../src/model/tokenizer/types.ts';
import { startTestServer, waitFor, type TestServer } from './e2e-fixture.ts';
import { rawRequest } from './http-client.ts';

const E2E = { timeout: 180_000 };

interface Internals {
  backend: { tokenizer: Tokenizer; chatTemplate: { render: (...args: unknown[]) => string } };
  encoders: Map<unknown, PromptEncoder>;
}

function internals(server: TestServer): Internals {
  return server.running.api.gateway as unknown as Internals;
}

/** Text that takes the built-in tokenizer about a second per MB. */
function words(bytes: number): string {
  return 'lorem ipsum dolor sit amet '.repeat(Math.ceil(bytes / 27)).slice(0, bytes);
}

/** Sends a request on its own connection; returns the socket, to be destroyed as the client leaving. */
function sendAndKeep(server: TestServer, path: string, body: object): ReturnType<typeof connect> {
  const text = JSON.stringify(body);
  const socket = connect(Number(new URL(server.url).port), '127.0.0.1');
  socket.on('error', () => {});
  socket.write(`POST ${path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: ${Buffer.byteLength(text)}\r\n\r\n${text}`);
  return socket;
}

async function responses(server: TestServer, route: string, status: number): Promise<number> {
  const text = (await rawRequest(server.url, { path: '/metrics' })).text;
  const line = text.split('\n').find((l) => l.startsWith('conduit_http_responses_total{') && l.includes(`route="${route}"`) && l.includes(`status="${status}"`));
  return line === undefined ? 0 : Number(line.slice(line.lastIndexOf(' ') + 1));
}

describe('tokenizer thread', () => {
  let server: TestServer;
  let tokenizer: Tokenizer;
  let model: string;
  let maxModelLen: number;
  /** What a text tokenized whole may be: 64 bytes per token of the context (the built-in tokenizer's longest is less). */
  let wholeLimit: number;

  before(async () => {
    server = await startTestServer();
    tokenizer = internals(server).backend.tokenizer;
    model = server.running.api.gateway.servedModelName!;
    maxModelLen = server.engine.info.maxModelLen;
    assert.ok(tokenizer.maxBytesPerToken!()! < 64);
    wholeLimit = 64 * maxModelLen;
  });
  after(async () => {
    await server?.close();
  });

  describe('PromptEncoder', () => {
    it('takes owners in turn: one owner\'s pile does not hold up another\'s job', async () => {
      const encoder = new PromptEncoder(tokenizer, 1000);
      try {
        const done: string[] = [];
        const job = (name: string, owner: string, bytes: number): Promise<void> =>
          encoder.encode(words(bytes), {}, { owner }).then(() => { done.push(name); });
        // a1 goes to the thread at once; the rest wait, b1 and c1 after a's pile.
        await Promise.all([job('a1', 'a', 200_000), job('a2', 'a', 50_000), job('a3', 'a', 50_000), job('b1', 'b', 5000),
          job('a4', 'a', 5000), job('c1', 'c', 5000)]);
        assert.deepEqual(done, ['a1', 'b1', 'c1', 'a2', 'a3', 'a4']);
        assert.equal(encoder.offThreadCount, 6);
      } finally {
        await encoder.close();
      }
    });

    it('drops a waiting job whose caller gave up, without tokenizing it', async () => {
      const encoder = new PromptEncoder(tokenizer, 1000);
      try {
        const first = encoder.encode(words(300_000), {}, { owner: 'a' });
        const gone = new AbortController();
        const waiting = encoder.encode(words(10_000), {}, { owner: 'b', signal: gone.signal });
        assert.equal(encoder.queued, 1);
        gone.abort(new Error('client left'));
        await assert.rejects(waiting, /client left/);
        assert.equal(encoder.queued, 0);
        assert.equal((await first).length > 0, true);
        assert.equal(encoder.offThreadCount, 1, 'only the first job reached the thread');
        assert.equal(encoder.droppedCount, 1);
        // An already aborted signal tokenizes nothing.
        await assert.rejects(encoder.encode(words(10_000), {}, { signal: gone.signal }), /client left/);
        assert.equal(encoder.offThreadCount, 1);
      } finally {
        await encoder.close();
      }
    });

    it('abandons a long job on the thread whose caller gave up (a new thread takes the next); a short one is left to finish', async () => {
      const encoder = new PromptEncoder(tokenizer, 1000, 100_000);
      try {
        const gone = new AbortController();
        const long = encoder.encode(words(2_000_000), {}, { signal: gone.signal });
        const next = encoder.encode(words(20_000), {}, { owner: 'other' });
        assert.equal(encoder.busy, true);
        gone.abort(new Error('client left'));
        await assert.rejects(long, /client left/);
        assert.equal(encoder.abandonedThreads, 1);
        const text = words(20_000);
        assert.deepEqual(await next, tokenizer.encode(text, {}));

        const shortGone = new AbortController();
        const short = encoder.encode(words(50_000), {}, { signal: shortGone.signal });
        const after = encoder.encode(`${text} after`, {}, { owner: 'other' });
        shortGone.abort(new Error('client left'));
        await assert.rejects(short, /client left/);
        assert.deepEqual(await after, tokenizer.encode(`${text} after`, {}), 'the answer of the abandoned job is not taken for the next');
        assert.equal(encoder.abandonedThreads, 1, 'a short job is not worth a new thread');
      } finally {
        await encoder.close();
      }
    });

    it('a job left to finish on the thread keeps the thread: jobs whose callers leave meanwhile are dropped untokenized', async () => {
      // The next job used to go to the thread at once, behind the one left to finish, where it could no longer be
      // dropped: a burst of clients sending long prompts and leaving had every prompt tokenized all the same, and
      // the prompts of everyone else waited behind them.
      const encoder = new PromptEncoder(tokenizer, 1000);
      try {
        const gone = new AbortController();
        const left = Array.from({ length: 5 }, (_, i) => encoder.encode(words(100_000 + i), {}, { owner: `o${i}`, signal: gone.signal }));
        assert.equal(encoder.queued, 4);
        gone.abort(new Error('client left'));
        for (const job of left) await assert.rejects(job, /client left/);
        assert.equal(encoder.droppedCount, 5);
        assert.equal(encoder.abandonedThreads, 0, 'a job this short is left to finish');
        const text = `${words(20_000)} next`;
        assert.deepEqual(await encoder.encode(text, {}), tokenizer.encode(text, {}), 'the answer of the job left to finish is not taken for the next');
        assert.equal(encoder.offThreadCount, 2, 'only the first job and the last reached the thread');
      } finally {
        await encoder.close();
      }
    });
  });

  describe('HTTP', () => {
    it('a prompt to be truncated is refused, untokenized, beyond 64 bytes per context token; up to that it is truncated', E2E, async () => {
      const gateway = server.running.api.gateway;
      const before = gateway.offThreadTokenizations;
      const over = await rawRequest(server.url, { path: '/v1/completions', body: { model, prompt: words(wholeLimit + 1), max_tokens: 1, truncate_prompt_tokens: 8 } });
      assert.equal(over.status, 400, over.text);
      assert.equal(over.json().error.code, 'prompt_too_large');
      assert.equal(over.json().error.param, 'prompt');
      assert.match(over.json().error.message, new RegExp(`at most ${wholeLimit} bytes .*but the prompt is ${wholeLimit + 1} bytes`));
      const batch = await rawRequest(server.url, { path: '/v1/completions', body: { model, prompt: ['short', words(wholeLimit + 1)], max_tokens: 1, truncate_prompt_tokens: 8 } });
      assert.equal(batch.status, 400);
      assert.equal(batch.json().error.param, 'prompt[1]');
      const chat = await rawRequest(server.url, {
        path: '/v1/chat/completions', body: { model, messages: [{ role: 'user', content: words(wholeLimit + 1) }], max_tokens: 1, truncate_prompt_tokens: 8 },
      });
      assert.equal(chat.status, 400);
      assert.equal(chat.json().error.code, 'prompt_too_large');
      assert.equal(chat.json().error.param, 'messages');
      assert.equal(gateway.offThreadTokenizations, before, 'none was tokenized');

      const at = await rawRequest(server.url, { path: '/v1/completions', body: { model, prompt: words(wholeLimit), max_tokens: 1, truncate_prompt_tokens: 8 } });
      assert.equal(at.status, 200, at.text);
      assert.equal(at.json().usage.prompt_tokens, 8);
    });

    it('/tokenize counts a text longer than the context, up to the same bound; beyond it, refused untokenized', E2E, async () => {
      const gateway = server.running.api.gateway;
      const before = gateway.offThreadTokenizations;
      const over = await rawRequest(server.url, { path: '/tokenize', body: { model, prompt: words(wholeLimit + 1) } });
      assert.equal(over.status, 400, over.text);
      assert.equal(over.json().error.code, 'prompt_too_large');
      assert.equal(over.json().error.param, 'prompt');
      const messages = await rawRequest(server.url, { path: '/tokenize', body: { model, messages: [{ role: 'user', content: words(wholeLimit + 1) }] } });
      assert.equal(messages.status, 400, messages.text);
      assert.equal(messages.json().error.param, 'messages');
      assert.equal(gateway.offThreadTokenizations, before, 'none was tokenized');
      const at = await rawRequest(server.url, { path: '/tokenize', body: { model, prompt: words(wholeLimit) } });
      assert.equal(at.status, 200, at.text);
      assert.ok(at.json().count > maxModelLen, `${at.json().count} tokens: more than the context is counted`);
    });

    it('chat messages whose contents alone cannot fit are refused before the template renders them', E2E, async () => {
      const template = internals(server).backend.chatTemplate;
      const render = template.render;
      let renders = 0;
      template.render = (...args: unknown[]) => {
        renders++;
        return render.apply(template, args);
      };
      try {
        const limit = (maxModelLen - 1) * tokenizer.maxBytesPerToken!()!;
        // 4096 messages (the most a request may have) of 30 bytes: more than the context can hold.
        const many = Array.from({ length: 4096 }, (_, i) => ({ role: i % 2 === 0 ? 'user' : 'assistant', content: `message ${i} `.padEnd(30, 'x') }));
        assert.ok(4096 * 30 > limit);
        const refused = await rawRequest(server.url, { path: '/v1/chat/completions', body: { model, messages: many, max_tokens: 1 } });
        assert.equal(refused.status, 400, refused.text);
        assert.equal(refused.json().error.code, 'context_length_exceeded');
        assert.equal(refused.json().error.param, 'messages');
        assert.match(refused.json().error.message, /the messages' contents are \d+ bytes/);
        const responses = await rawRequest(server.url, { path: '/v1/responses', body: { model, input: many, max_output_tokens: 16 } });
        assert.equal(responses.status, 400, responses.text);
        assert.equal(responses.json().error.param, 'input');
        assert.equal(renders, 0, 'nothing was rendered');
        // Whitespace around a content is not counted (a template may trim it): rendered, then checked as rendered.
        const padded = await rawRequest(server.url, {
          path: '/v1/chat/completions', body: { model, messages: [{ role: 'user', content: `${' '.repeat(limit)}Hello` }], max_tokens: 1 },
        });
        assert.equal(renders, 1);
        if (padded.status !== 200) assert.match(padded.json().error.message, /but the prompt is \d+ bytes/);
      } finally {
        template.render = render;
      }
    });

    it('a request whose client left while it waited for the tokenizer thread is dropped, not tokenized, and counted as a 499', E2E, async () => {
      const encoder = [...internals(server).encoders.values()][0]!;
      const offThread = encoder.offThreadCount;
      const before = { tokenize: await responses(server, 'tokenize', 499), completions: await responses(server, 'completions', 499) };
      // Another tenant's long job holds the thread (seconds of work).
      const holder = encoder.encode(words(2_000_000), {}, { owner: 'holder' });
      await waitFor(() => encoder.busy, 'the holder on the thread');
      for (const [path, body] of [
        ['/tokenize', { model, prompt: words(20_000) }],
        ['/v1/completions', { model, prompt: words(20_000), max_tokens: 1, truncate_prompt_tokens: 8 }],
      ] as const) {
        const socket = sendAndKeep(server, path, body);
        await waitFor(() => encoder.queued === 1, `${path} queued for the thread`, 60_000);
        socket.destroy();
        await waitFor(() => encoder.queued === 0, `${path} dropped from the queue`, 60_000);
      }
      assert.equal(encoder.busy, true, 'the holder was still running: both were dropped while they waited');
      await holder;
      assert.equal(encoder.offThreadCount, offThread + 1, 'only the holder was tokenized');
      await waitFor(() => server.running.api.gateway.activeRunCount === 0, 'nothing running');
      assert.equal(await responses(server, 'tokenize', 499), before.tokenize + 1);
      assert.equal(await responses(server, 'completions', 499), before.completions + 1);
    });
  });
});
