// `conduit trace <id>` run in-process through main() against a live `conduit serve` server: the waterfall and the
// bottleneck of a request it served, JSON on demand, and plain errors for an unknown id, a missing key, a server
// that is not there and a missing id.
import assert from 'node:assert/strict';
import { createServer as createHttpServer } from 'node:http';
import { createServer } from 'node:net';
import { after, before, describe, it } from 'node:test';
import { runCli as run } from '../helpers/cli-main.ts';
import { formatAnalysis } from '../../src/cli/trace.ts';
import { startTestServer, type TestServer } from '../api/e2e-fixture.ts';
import { rawRequest } from '../api/http-client.ts';

const KEY = 'sk-cli-trace-000001';

/** A port nothing listens on: bound, then released. */
async function closedPort(): Promise<number> {
  const probe = createServer();
  await new Promise<void>((resolve) => probe.listen(0, '127.0.0.1', resolve));
  const { port } = probe.address() as { port: number };
  await new Promise<void>((resolve) => probe.close(() => resolve()));
  return port;
}

describe('conduit trace', () => {
  let server: TestServer;
  let id: string;

  before(async () => {
    server = await startTestServer({ keysFile: `${KEY} cli\n` });
    const model = server.running.api.gateway.servedModelName!;
    const res = await rawRequest(server.url, {
      path: '/v1/completions', headers: { Authorization: `Bearer ${KEY}` },
      body: { model, prompt: 'The tide came in', max_tokens: 5, temperature: 0, ignore_eos: true, stream: true },
    });
    assert.equal(res.status, 200, res.text);
    id = String(res.headers['x-request-id']);
  });

  after(async () => {
    await server?.close();
  });

  it('is listed as an available command', async () => {
    const { out } = await run(['--help']);
    assert.match(out, /^ {2}trace$/m);
    assert.doesNotMatch(out, /trace .*not available/);
  });

  it('prints the request\'s waterfall and its bottleneck', { timeout: 60_000 }, async () => {
    const { code, out, err } = await run(['trace', id, '--url', server.url, '--api-key', KEY]);
    assert.equal(code, 0, err);
    const lines = out.split('\n');
    assert.match(lines[0]!, new RegExp(`^request ${id}  model \\S+  worker worker-0  ok \\(length\\)$`));
    assert.match(lines[1]!, /^total [\d.]+ ms {2}TTFT [\d.]+ ms {2}prompt \d+ tokens \(\d+ cached\) {2}output 5 tokens/);
    const rows = lines.filter((l) => /^[a-z_]+( \(.*\))? +[\d.]+ +[\d.]+ /.test(l)).map((l) => l.split(' ')[0]);
    assert.deepEqual(rows.slice(0, 5), ['http_receive', 'auth', 'rate_limit', 'validate', 'tokenize']);
    // Then the hand-off to the worker (when it took measurable time) and its queue.
    assert.ok(['prefill_dispatch,scheduler_queue', 'scheduler_queue,prefill_execution'].includes(rows.slice(5, 7).join(',')), rows.join(','));
    assert.ok(rows.includes('prefill_execution') && rows.includes('streaming_response'), rows.join(','));
    assert.match(out, /^time between tokens: p50 [\d.]+ ms/m);
    assert.match(out, /^bottleneck: [a-z_]+/m);
  });

  it('names a long output decode_output_length and a long prompt prefill-bound, on the real engine and in the console', { timeout: 120_000 }, async () => {
    const model = server.running.api.gateway.servedModelName!;
    const complete = async (prompt: string, maxTokens: number): Promise<string> => {
      const res = await rawRequest(server.url, {
        path: '/v1/completions', headers: { Authorization: `Bearer ${KEY}` },
        body: { model, prompt, max_tokens: maxTokens, temperature: 0, ignore_eos: true },
      });
      assert.equal(res.status, 200, res.text);
      return String(res.headers['x-request-id']);
    };
    // A 2-token prompt and 160 tokens out: decode is nearly all of it, at a healthy time per token.
    const long = await complete('Hi', 160);
    // A long prompt and one token out: prefill is nearly all of TTFT, and TTFT nearly all of the request.
    const words = Array.from({ length: 200 }, (_, i) => `w${(i * 7919 + 17) % 10007}`).join(' ');
    const prompted = await complete(words, 1);

    const decode = await run(['trace', long, '--url', server.url, '--api-key', KEY]);
    assert.equal(decode.code, 0, decode.err);
    assert.match(decode.out, /^bottleneck: decode_output_length \(decode_execution: (9\d|100)% of the request, [\d.]+ ms\)$/m);
    assert.match(decode.out, /^ {2}Decode took .*: 160 output tokens in 159 steps at [\d.]+ ms per token .*max_tokens \(160\)/m);
    assert.doesNotMatch(decode.out, /prefix cache|No single phase dominates/);
    const prefill = await run(['trace', prompted, '--url', server.url, '--api-key', KEY]);
    assert.equal(prefill.code, 0, prefill.err);
    assert.match(prefill.out, /^bottleneck: prefill_no_cache \(prefill_execution: \d+% of TTFT, [\d.]+ ms\)$/m);

    // The console's recent requests carry the same labels.
    const res = await fetch(`${server.url}/console/api/overview`, { headers: { Authorization: `Bearer ${KEY}` } });
    assert.equal(res.status, 200);
    const { requests } = await res.json() as { requests: { id: string; bottleneck: string | null }[] };
    assert.equal(requests.find((r) => r.id === long)?.bottleneck, 'decode_output_length');
    assert.equal(requests.find((r) => r.id === prompted)?.bottleneck, 'prefill_no_cache');
  });

  it('says how a refused request ended in one sentence, its error message\'s own full stop not doubled', async () => {
    const model = server.running.api.gateway.servedModelName!;
    const refused = await rawRequest(server.url, {
      path: '/v1/completions', headers: { Authorization: `Bearer ${KEY}` }, body: { model, prompt: 'x', max_tokens: 5, temperature: -3 },
    });
    assert.equal(refused.status, 400, refused.text);
    const message = (refused.json() as { error: { message: string } }).error.message;
    assert.match(message, /\.$/, 'the server\'s message is a sentence');
    const { code, out, err } = await run(['trace', String(refused.headers['x-request-id']), '--url', server.url, '--api-key', KEY]);
    assert.equal(code, 0, err);
    assert.match(out, /^bottleneck: failed$/m);
    const recommendation = out.split('\n').find((l) => l.startsWith('  failed: 400 invalid_value in validate after '));
    assert.ok(recommendation, out);
    assert.ok(recommendation.endsWith(`: ${message} A request that did not complete gets no bottleneck diagnosis.`), recommendation);
  });

  it('says what the share is of, and leaves it out for a server that does not say', () => {
    const analysis = { category: 'queue_saturation', dominant_phase: 'scheduler_queue', dominant_share: 0.81, dominant_ms: 868.46, recommendation: 'Queue wait.' };
    assert.equal(formatAnalysis({ ...analysis, dominant_share_of: 'ttft' }), 'bottleneck: queue_saturation (scheduler_queue: 81% of TTFT, 868.5 ms)\n  Queue wait.');
    assert.equal(formatAnalysis({ ...analysis, dominant_share_of: 'request' }).split('\n')[0], 'bottleneck: queue_saturation (scheduler_queue: 81% of the request, 868.5 ms)');
    assert.equal(formatAnalysis({ ...analysis, dominant_share_of: 'decode_steps' }).split('\n')[0], 'bottleneck: queue_saturation (scheduler_queue: 81% of the decode steps\' time, 868.5 ms)');
    assert.equal(formatAnalysis(analysis).split('\n')[0], 'bottleneck: queue_saturation (scheduler_queue: 81%, 868.5 ms)');
    assert.equal(formatAnalysis({ ...analysis, category: 'balanced', dominant_phase: 'none', dominant_share_of: null }), 'bottleneck: balanced\n  Queue wait.');
  });

  it('prints the endpoint\'s JSON with --json', async () => {
    const { code, out } = await run(['trace', id, '--url', `${server.url}/`, '--api-key', KEY, '--json']);
    assert.equal(code, 0);
    const body = JSON.parse(out);
    assert.equal(body.request_id, id);
    assert.equal(body.usage.completion_tokens, 5);
    assert.equal(typeof body.waterfall, 'string');
  });

  it('takes the server\'s /v1 as the URL, as OpenAI clients\' base URLs end (it asked for /v1/v1/...)', async () => {
    for (const url of [`${server.url}/v1`, `${server.url}/v1/`]) {
      const { code, out, err } = await run(['trace', id, '--url', url, '--api-key', KEY, '--json']);
      assert.equal(code, 0, `${url}: ${err}`);
      assert.equal(JSON.parse(out).request_id, id);
    }
  });

  it('says so, with exit code 1, for an unknown id, a missing key or no server', async () => {
    const unknown = await run(['trace', 'cmpl-unknown', '--url', server.url, '--api-key', KEY]);
    assert.equal(unknown.code, 1);
    assert.match(unknown.err, /^conduit trace: no trace for cmpl-unknown at http:\/\/127\.0\.0\.1:\d+: No finished request/);
    const noKey = await run(['trace', id, '--url', server.url]);
    assert.equal(noKey.code, 1);
    assert.match(noKey.err, /wants an API key \(--api-key or CONDUIT_API_KEY\)/);
    const nobody = await run(['trace', id, '--url', `http://127.0.0.1:${await closedPort()}`]);
    assert.equal(nobody.code, 1);
    assert.match(nobody.err, /cannot reach http:\/\/127\.0\.0\.1:\d+: connection refused/);
  });

  it('sends credentials in the URL as Basic authentication, as conduit bench does (fetch refused the URL)', async () => {
    // A proxy in front of the server that wants user "ops", password "p@ss w" (percent-encoded in the URL), and adds
    // the server's key itself.
    const seen: (string | undefined)[] = [];
    const proxy = createHttpServer((req, res) => {
      seen.push(req.headers.authorization);
      if (req.headers.authorization !== `Basic ${Buffer.from('ops:p@ss w').toString('base64')}`) {
        res.writeHead(401, { 'Content-Type': 'application/json' }).end(JSON.stringify({ error: { message: 'proxy wants its password' } }));
        return;
      }
      fetch(new URL(req.url!, server.url), { headers: { Authorization: `Bearer ${KEY}` } }).then(async (upstream) => {
        res.writeHead(upstream.status, { 'Content-Type': 'application/json' }).end(await upstream.text());
      }, (error: Error) => res.writeHead(502).end(error.message));
    });
    await new Promise<void>((resolve) => proxy.listen(0, '127.0.0.1', resolve));
    const { port } = proxy.address() as { port: number };
    try {
      const { code, out, err } = await run(['trace', id, '--url', `http://ops:p%40ss%20w@127.0.0.1:${port}`, '--json']);
      assert.equal(code, 0, err);
      assert.equal(JSON.parse(out).request_id, id);
      // An --api-key's Bearer takes the place of the URL's credentials, as in conduit bench.
      const keyed = await run(['trace', id, '--url', `http://ops:p%40ss%20w@127.0.0.1:${port}`, '--api-key', KEY]);
      assert.equal(keyed.code, 1);
      assert.match(keyed.err, /^conduit trace: http:\/\/127\.0\.0\.1:\d+ wants an API key .*: proxy wants its password$/m);
      assert.equal(seen.at(-1), `Bearer ${KEY}`);
    } finally {
      await new Promise<void>((resolve) => proxy.close(() => resolve()));
    }
  });

  it('says a port the HTTP client blocks is blocked, and which (it said "bad port")', async () => {
    for (const port of [1, 9, 6000]) {
      const blocked = await run(['trace', id, '--url', `http://127.0.0.1:${port}`]);
      assert.equal(blocked.code, 1);
      assert.match(blocked.err, new RegExp(`^conduit trace: cannot reach http://127\\.0\\.0\\.1:${port}: port ${port} is blocked by the HTTP client \\(fetch refuses it`));
    }
  });

  it('needs exactly one id and a usable URL (exit code 2)', async () => {
    assert.equal((await run(['trace'])).code, 2);
    assert.equal((await run(['trace', 'a', 'b'])).code, 2);
    for (const url of ['not a url', 'localhost:8000', 'ftp://127.0.0.1:8000']) {
      const badUrl = await run(['trace', id, '--url', url]);
      assert.equal(badUrl.code, 2, url);
      assert.match(badUrl.err, /--url must be a URL/);
    }
    const empty = await run(['trace', '', '--url', server.url]);
    assert.equal(empty.code, 2);
    assert.match(empty.err, /the request id is empty/);
  });
});
