// The load generator against a live `conduit serve` (the real start-up path, two simulated workers behind the kv
// router, virtual time running as fast as the host allows) and against small stub servers for the failure cases.
// Assertions are on counts and shapes, never on speed.

import assert from 'node:assert/strict';
import { mkdtempSync, readFileSync, rmSync } from 'node:fs';
import { createServer, type Server } from 'node:http';
import type { AddressInfo } from 'node:net';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { after, before, describe, it } from 'node:test';
import { silentLogger } from '../../src/util/log.ts';
import { runLoad, sleep, type LoadOptions } from '../../src/bench/load-generator.ts';
import { randomWorkload, sharedPrefixWorkload } from '../../src/bench/prompt-workload.ts';
import { BENCH_FLAGS, parseBenchConfig, runBench, type BenchConfig } from '../../src/cli/bench.ts';
import { envName, UsageError } from '../../src/cli/flags.ts';
import { parseServeConfig, startServer, type RunningServer } from '../../src/cli/serve.ts';

async function startSimServer(): Promise<RunningServer> {
  const config = parseServeConfig(['--port', '0', '--log-level', 'silent', '--engine', 'sim', '--workers', '2'], {});
  if (config === 'help') throw new Error('unexpected --help');
  // No flag spells an infinite speed-up; in-process it is one field. Steps then take no real time at all.
  config.sim.speedUp = Infinity;
  return startServer(config, silentLogger);
}

/** A server on 127.0.0.1 that answers every request with `handler`. */
async function stubServer(handler: Parameters<typeof createServer>[1]): Promise<{ url: string; server: Server }> {
  const server = createServer(handler);
  await new Promise<void>((resolve) => server.listen(0, '127.0.0.1', resolve));
  return { url: `http://127.0.0.1:${(server.address() as AddressInfo).port}`, server };
}

function closeServer(server: Server): Promise<void> {
  server.closeAllConnections();
  return new Promise((resolve) => server.close(() => resolve()));
}

describe('conduit bench against a live simulated server', () => {
  let running: RunningServer;
  const base = (): Omit<LoadOptions, 'workload'> => ({
    url: running.url, endpoint: 'chat', stream: true, outputTokens: 6, timeoutSec: 60,
  });

  before(async () => { running = await startSimServer(); });
  after(async () => { await running.api.shutdown(0); });

  it('closed loop: every request once, every token timed', async () => {
    const result = await runLoad({ ...base(), workload: randomWorkload({ promptTokens: 40, seed: 1 }), concurrency: 3, requests: 10 });
    const { summary } = result;
    assert.equal(result.model, 'Llama-3.1-8B', 'model discovered from /v1/models');
    assert.deepEqual(result.requests.map((r) => r.index), [...Array(10).keys()]);
    assert.deepEqual([summary.numRequests, summary.numOk, summary.numErrors], [10, 10, 0]);
    assert.ok(summary.maxInFlight <= 3 && summary.maxInFlight >= 1);
    for (const r of result.requests) {
      assert.equal(r.completionTokens, 6, 'the server generated max_tokens');
      assert.equal(r.itlMs.length, 5, 'one gap between each pair of streamed tokens');
      assert.ok(r.ttftMs !== undefined && r.ttftMs <= r.e2eMs);
      // ~40 words plus the chat template's own tokens.
      assert.ok(r.promptTokens! >= 40 && r.promptTokens! < 80, `prompt tokens ${r.promptTokens}`);
    }
    assert.equal(summary.totalCompletionTokens, 60);
    assert.deepEqual([summary.ttftMs.count, summary.itlMs.count, summary.e2eMs.count], [10, 50, 10]);
    assert.ok(summary.ttftMs.p50 <= summary.ttftMs.p90 && summary.ttftMs.p90 <= summary.ttftMs.p99);
  });

  it('open loop: Poisson arrivals up to the request count, completions endpoint, not streamed', async () => {
    const result = await runLoad({
      ...base(), endpoint: 'completions', stream: false, workload: randomWorkload({ promptTokens: 20, seed: 2 }),
      rate: 200, requests: 12, seed: 3,
    });
    assert.deepEqual(result.mode, { kind: 'open', rate: 200, burstiness: 1 });
    assert.equal(result.summary.numOk, 12);
    assert.equal(result.summary.ttftMs.count, 0, 'no TTFT without streaming');
    assert.equal(result.summary.e2eMs.count, 12);
    assert.ok(result.requests.every((r) => r.completionTokens === 6));
  });

  it('open loop with a cap never has more in flight than the cap', async () => {
    const result = await runLoad({ ...base(), workload: randomWorkload({ promptTokens: 20, seed: 2 }), rate: 1000, concurrency: 2, requests: 12 });
    assert.equal(result.summary.numOk, 12);
    assert.ok(result.summary.maxInFlight <= 2, `max in flight ${result.summary.maxInFlight}`);
  });

  it('a duration bound stops the run by itself, with every request finished', async () => {
    const result = await runLoad({ ...base(), workload: randomWorkload({ promptTokens: 20, seed: 4 }), concurrency: 2, durationSec: 0.3 });
    assert.ok(result.summary.numRequests >= 1);
    assert.equal(result.summary.numErrors, 0);
    assert.deepEqual(result.requests.map((r) => r.index), [...Array(result.summary.numRequests).keys()]);
  });

  it('shared-prefix: after its first request, a group is served from the prefix cache', async () => {
    const workload = sharedPrefixWorkload({ groups: 2, systemPromptTokens: 300, questionTokens: 8, seed: 5 });
    // One client: each request starts after the previous one ended, so its group's prefix is already cached.
    const result = await runLoad({ ...base(), workload, concurrency: 1, requests: 8 });
    assert.equal(result.summary.numOk, 8);
    const seen = new Set<number>();
    for (const r of result.requests) {
      assert.ok(r.group !== undefined);
      if (!seen.has(r.group)) {
        assert.equal(r.cachedTokens, 0, `request ${r.index} opens group ${r.group}: nothing of it is cached`);
        seen.add(r.group);
      } else {
        assert.ok(r.cachedTokens! >= 288, `request ${r.index} of group ${r.group} reuses its system prompt, cached ${r.cachedTokens}`);
      }
    }
    assert.equal(seen.size, 2);
    assert.ok(result.summary.cachedPromptFraction! > 0);
  });

  it('counts refused requests by error kind', async () => {
    const result = await runLoad({ ...base(), model: 'no-such-model', workload: randomWorkload({ promptTokens: 5, seed: 1 }), requests: 3 });
    assert.deepEqual([result.summary.numOk, result.summary.numErrors], [0, 3]);
    assert.deepEqual(result.summary.errors, { 'http 404 model_not_found': 3 });
  });

  it('the command prints JSON and writes every request to --output', async () => {
    const dir = mkdtempSync(join(tmpdir(), 'conduit-bench-'));
    try {
      const file = join(dir, 'report.json');
      const config = parseBenchConfig(['--url', running.url, '--json', '--stream', '-n', '4', '-c', '2', '--output-tokens', '3',
        '--workload', 'shared-prefix', '--groups', '2', '--system-prompt-tokens', '40', '--output', file], {}) as BenchConfig;
      let printed = '';
      const { code } = await runBench(config, (text) => { printed += text; });
      assert.equal(code, 0);
      const report = JSON.parse(printed) as { summary: { numOk: number; ttftMs: { count: number } }; requests?: unknown };
      assert.equal(report.summary.numOk, 4);
      assert.equal(report.summary.ttftMs.count, 4);
      assert.equal(report.requests, undefined);
      const saved = JSON.parse(readFileSync(file, 'utf8')) as { requests: { itlMs: number[] }[] };
      assert.equal(saved.requests.length, 4);
      assert.ok(saved.requests.every((r) => r.itlMs.length === 2));
    } finally {
      rmSync(dir, { recursive: true, force: true });
    }
  });
});

describe('conduit bench failure handling', () => {
  const workload = randomWorkload({ promptTokens: 5, seed: 1 });

  it('counts a refused connection as an error and still reports', async () => {
    const { url, server } = await stubServer(() => undefined);
    await closeServer(server);
    const result = await runLoad({ url, endpoint: 'chat', model: 'm', workload, outputTokens: 1, stream: false, requests: 2 });
    assert.deepEqual(result.summary.errors, { ECONNREFUSED: 2 });
  });

  it('sends temperature, top_p and logprobs when given, and nothing of them otherwise', async () => {
    const bodies: Record<string, unknown>[] = [];
    const { url, server } = await stubServer((req, res) => {
      let text = '';
      req.on('data', (chunk: Buffer) => { text += chunk.toString(); });
      req.on('end', () => {
        bodies.push(JSON.parse(text) as Record<string, unknown>);
        res.writeHead(503).end();
      });
    });
    try {
      await runLoad({ url, endpoint: 'completions', model: 'm', workload, outputTokens: 1, stream: false, requests: 1, sampling: { temperature: 0.7, topP: 0.9 } });
      await runLoad({ url, endpoint: 'chat', model: 'm', workload, outputTokens: 1, stream: false, requests: 1, sampling: { temperature: 0 } });
      await runLoad({ url, endpoint: 'chat', model: 'm', workload, outputTokens: 1, stream: false, requests: 1 });
      await runLoad({ url, endpoint: 'completions', model: 'm', workload, outputTokens: 1, stream: false, requests: 1, sampling: { logprobs: 3 } });
      await runLoad({ url, endpoint: 'chat', model: 'm', workload, outputTokens: 1, stream: false, requests: 1, sampling: { logprobs: 0 } });
      assert.deepEqual(bodies.map((b) => [b.temperature, b.top_p, b.logprobs, b.top_logprobs]), [[0.7, 0.9, undefined, undefined],
        [0, undefined, undefined, undefined], [undefined, undefined, undefined, undefined], [undefined, undefined, 3, undefined],
        [undefined, undefined, true, 0]]);
      assert.ok(!('temperature' in bodies[2]!) && !('top_p' in bodies[2]!) && !('logprobs' in bodies[2]!) && !('top_logprobs' in bodies[2]!));
    } finally {
      await closeServer(server);
    }
  });

  it('times out a server that never answers', async () => {
    const { url, server } = await stubServer(() => undefined);
    try {
      const result = await runLoad({ url, endpoint: 'chat', model: 'm', workload, outputTokens: 1, stream: true, requests: 2, concurrency: 2, timeoutSec: 0.2 });
      assert.deepEqual(result.summary.errors, { timeout: 2 });
    } finally {
      await closeServer(server);
    }
  });

  it('an arrival due after the duration bound is not counted as waiting for a free slot', async () => {
    const { url, server } = await stubServer(() => undefined);
    try {
      // Near-constant gaps of 100 ms (burstiness 1000): one arrival at 0.1 s fills the cap of one; the next would be
      // due at 0.2 s, after the run's 0.15 s, so it never arrives and nothing waited for a slot.
      const result = await runLoad({ url, endpoint: 'chat', model: 'm', workload, outputTokens: 1, stream: true,
        rate: 10, burstiness: 1000, concurrency: 1, durationSec: 0.15, timeoutSec: 0.4 });
      assert.equal(result.summary.numRequests, 1);
      assert.equal(result.summary.numDelayedArrivals, 0);
    } finally {
      await closeServer(server);
    }
  });

  it('an error event or a missing [DONE] fails a stream; a clean one passes', async () => {
    let call = 0;
    const chunk = (text: string) => `data: ${JSON.stringify({ choices: [{ index: 0, delta: { content: text } }] })}\n\n`;
    const { url, server } = await stubServer((req, res) => {
      req.resume();
      const which = call++;
      res.writeHead(200, { 'Content-Type': 'text/event-stream' });
      res.write(chunk('a'));
      if (which === 0) res.end(`event: error\ndata: ${JSON.stringify({ error: { code: 'engine_error', message: 'x' } })}\n\ndata: [DONE]\n\n`);
      else if (which === 1) res.end(chunk('b'));
      else res.end(`${chunk('b')}${chunk('c')}data: [DONE]\n\n`);
    });
    try {
      const result = await runLoad({ url, endpoint: 'chat', model: 'm', workload, outputTokens: 3, stream: true, requests: 3 });
      const byIndex = result.requests.map((r) => r.error ?? 'ok');
      assert.deepEqual(byIndex, ['stream error engine_error', 'stream ended without [DONE]', 'ok']);
      assert.equal(result.requests[2]!.completionTokens, 3, 'no usage sent: the content chunks are counted');
      assert.equal(result.requests[2]!.itlMs.length, 2);
    } finally {
      await closeServer(server);
    }
  });

  it('takes a base URL ending in /v1, as OpenAI clients\' do, and keeps any other path prefix', async () => {
    const paths: string[] = [];
    const { url, server } = await stubServer((req, res) => {
      req.resume();
      paths.push(req.url!);
      res.writeHead(200, { 'Content-Type': 'application/json' }).end(JSON.stringify({ data: [{ id: 'm' }], choices: [{ text: 'x' }] }));
    });
    try {
      for (const base of [`${url}/v1`, `${url}/v1/`, `${url}/proxy/v1`, `${url}/proxy`]) {
        const result = await runLoad({ url: base, endpoint: 'completions', workload, outputTokens: 1, stream: false, requests: 1 });
        assert.equal(result.summary.numOk, 1, base);
      }
      assert.deepEqual(paths, ['/v1/models', '/v1/completions', '/v1/models', '/v1/completions',
        '/proxy/v1/models', '/proxy/v1/completions', '/proxy/v1/models', '/proxy/v1/completions']);
    } finally {
      await closeServer(server);
    }
  });

  it('a rate whose gaps are longer than a Node timer holds (2^31 ms) waits them out rather than sending at once', async () => {
    let arrived = 0;
    const { url, server } = await stubServer((req, res) => {
      req.resume();
      arrived++;
      res.writeHead(200, { 'Content-Type': 'application/json' }).end(JSON.stringify({ choices: [{ message: { content: 'x' } }] }));
    });
    const stop = new AbortController();
    try {
      // One arrival in 10^9 s on average: Node cut each gap to 1 ms, and all three went out together.
      const timer = setTimeout(() => stop.abort(), 300);
      const result = await runLoad({ url, endpoint: 'chat', model: 'm', workload, outputTokens: 1, stream: false, requests: 3, rate: 1e-9,
        seed: 1, signal: stop.signal });
      clearTimeout(timer);
      assert.equal(arrived, 0, 'nothing due within 300 ms');
      assert.equal(result.summary.numRequests, 0);
    } finally {
      await closeServer(server);
    }
  });

  it('sleep: a wait beyond a timer\'s reach is taken in pieces, and ends with an abort', async () => {
    const start = performance.now();
    await sleep(5);
    assert.ok(performance.now() - start >= 5, 'a short wait as asked, not less');
    const stop = new AbortController();
    const long = sleep(3 * 2 ** 31, stop.signal);
    let over = false;
    void long.then(() => { over = true; });
    await new Promise((resolve) => setTimeout(resolve, 50));
    assert.equal(over, false, '2^32.6 ms is not 1 ms');
    stop.abort();
    await long;
  });

  it('an abort stops the run and cuts what is in flight', async () => {
    const stop = new AbortController();
    // Aborted once both clients' requests have reached the server, whenever that is.
    let arrived = 0;
    const { url, server } = await stubServer((req) => {
      req.resume();
      if (++arrived === 2) stop.abort();
    });
    try {
      const running = runLoad({ url, endpoint: 'chat', model: 'm', workload, outputTokens: 1, stream: false, requests: 50, concurrency: 2, signal: stop.signal });
      const result = await running;
      assert.equal(arrived, 2, 'nothing sent after the abort');
      assert.deepEqual(result.summary.errors, { aborted: 2 }, 'the two in flight; nothing new started');
    } finally {
      await closeServer(server);
    }
  });
});

describe('conduit bench flags', () => {
  it('bounds a run without bounds, and reads CONDUIT_* twins (the command line winning)', () => {
    const c = parseBenchConfig([], {}) as BenchConfig;
    assert.equal(c.load.url, 'http://127.0.0.1:8000');
    assert.equal(c.load.requests, 100);
    assert.equal(c.load.rate, undefined);
    assert.equal(c.load.stream, false);
    const e = parseBenchConfig(['--rate', '5'], {
      CONDUIT_BENCH_RATE: '2', CONDUIT_BENCH_DURATION: '30', CONDUIT_BENCH_STREAM: 'true', CONDUIT_BENCH_WORKLOAD: 'shared-prefix',
      CONDUIT_URL: 'http://127.0.0.1:9000',
    }) as BenchConfig;
    assert.equal(e.load.rate, 5);
    assert.equal(e.load.durationSec, 30);
    assert.equal(e.load.requests, undefined, 'a duration is bound enough');
    assert.equal(e.load.stream, true);
    assert.equal(e.load.workload.name, 'shared-prefix');
    assert.equal(e.load.url, 'http://127.0.0.1:9000');
    assert.equal(envName('api-key', BENCH_FLAGS['api-key']), 'CONDUIT_API_KEY');
    // `conduit serve --model` reads CONDUIT_MODEL (a model file): the load generator must not send that as "model".
    assert.equal((parseBenchConfig([], { CONDUIT_MODEL: '/models/llama.gguf', CONDUIT_SEED: '9' }) as BenchConfig).load.model, undefined);
    assert.equal(envName('model', BENCH_FLAGS.model), 'CONDUIT_BENCH_MODEL');
    // Sampling: none sent unless given; the twins as for every flag.
    assert.equal(c.load.sampling, undefined);
    const sampled = parseBenchConfig(['--temperature', '0'], { CONDUIT_BENCH_TOP_P: '0.95', CONDUIT_BENCH_TEMPERATURE: '0.8' }) as BenchConfig;
    assert.deepEqual(sampled.load.sampling, { temperature: 0, topP: 0.95 });
    assert.deepEqual((parseBenchConfig([], { CONDUIT_BENCH_LOGPROBS: '2' }) as BenchConfig).load.sampling, { logprobs: 2 });
    assert.deepEqual((parseBenchConfig(['--logprobs', '0'], { CONDUIT_BENCH_LOGPROBS: '2' }) as BenchConfig).load.sampling, { logprobs: 0 });
  });

  it('refuses bad values naming the flag', () => {
    const bad: [string[], RegExp][] = [
      [['--url', 'ftp://x'], /--url/], [['--endpoint', 'embeddings'], /--endpoint/], [['--workload', 'chaos'], /--workload/],
      [['--rate', '0'], /--rate/], [['--concurrency', '1.5'], /--concurrency/], [['--requests', '0'], /--requests/],
      [['--groups', '0', '--workload', 'shared-prefix'], /--groups/], [['--timeout', '-1'], /--timeout/], [['extra'], /unexpected/],
      [['--temperature', '-0.5'], /--temperature/], [['--top-p', '0'], /--top-p/], [['--top-p', '1.5'], /--top-p/],
      [['--logprobs', '-1'], /--logprobs/], [['--logprobs', '1.5'], /--logprobs/],
    ];
    for (const [argv, message] of bad) {
      assert.throws(() => parseBenchConfig(argv, {}), (err: unknown) => err instanceof UsageError && message.test(err.message), argv.join(' '));
    }
    assert.equal(parseBenchConfig(['--help'], {}), 'help');
  });

  it('refuses the other workload\'s prompt flags (--groups 0 with the random workload was taken silently)', () => {
    for (const [argv, message] of [
      [['--groups', '0'], '--groups: only for --workload shared-prefix (the random workload is --prompt-tokens)'],
      [['--groups', '4', '--question-tokens', '10'], '--groups, --question-tokens: only for --workload shared-prefix (the random workload is --prompt-tokens)'],
      [['--workload', 'shared-prefix', '--prompt-tokens', '64'],
        '--prompt-tokens: only for --workload random (shared-prefix prompts are --system-prompt-tokens plus --question-tokens)'],
    ] as const) {
      assert.throws(() => parseBenchConfig([...argv], {}), (err: unknown) => err instanceof UsageError && err.message === message, argv.join(' '));
    }
    // From the environment (shared by several runs) it is ignored, with a warning, as a variable that does not apply.
    const config = parseBenchConfig([], { CONDUIT_BENCH_GROUPS: '0' }) as BenchConfig;
    assert.equal(config.load.workload.name, 'random');
    assert.deepEqual(config.warnings,
      ['ignoring CONDUIT_BENCH_GROUPS=0: --groups is only for --workload shared-prefix (the random workload is --prompt-tokens)']);
  });
});
