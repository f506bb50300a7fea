// conduit_memory_used_bytes, conduit_oom_events_total and conduit_kv_block_shortfalls_total on a live server (the built-in model on a CPU worker
// with a 1 MiB KV pool): the KV pool's bytes as computed from the model's config and --kv-cache-memory, the weights
// within the file's tensor bytes and their packed copy, the activations at least those of the largest step; a prompt
// that fills the pool exactly served, one token longer refused for the context length the pool sets (neither an OOM
// event of kind kv_capacity); requests preempted for KV blocks (conduit_kv_block_shortfalls_total, not an OOM event).
import assert from 'node:assert/strict';
import { randomUUID } from 'node:crypto';
import { after, before, describe, it } from 'node:test';
import { byteSize } from '../../src/model/ggml-types.ts';
import { readGguf } from '../../src/model/gguf.ts';
import { ensureBuiltinModel } from '../../src/model/synthetic.ts';
import { rawRequest } from '../api/http-client.ts';
import { total, value } from './exposition.ts';
import { scrape, startLiveServer, type LiveServer } from './integration-fixture.ts';

const LIVE = { timeout: 180_000 };
const KV_BYTES = 1024 * 1024;
const STEP_TOKENS = 64;

describe('memory by category and allocation failures on a live CPU worker', () => {
  let server: LiveServer;
  let model: string;
  before(async () => {
    server = await startLiveServer({ threads: 1, maxNumBatchedTokens: STEP_TOKENS, kvCacheMemoryBytes: KV_BYTES, maxNumSeqs: 4 });
    model = server.api.gateway.servedModelName!;
  });
  after(async () => {
    await server?.close();
  });

  it('reports the KV pool, the weights and the activations of the worker', LIVE, async () => {
    // A prompt longer than one step: the worker runs a full 64-token step.
    const res = await rawRequest(server.url, {
      path: '/v1/completions', body: { model, prompt: `${randomUUID()} ${'a lighthouse keeper counted ships '.repeat(12)}`, max_tokens: 2 },
    });
    assert.equal(res.status, 200, res.text);
    const { exposition } = await scrape(server.url);
    const worker = 'worker-0';
    const file = readGguf(await ensureBuiltinModel());
    const numLayers = Number(file.metadata.get('llama.block_count'));
    const dim = Number(file.metadata.get('llama.embedding_length'));
    const heads = Number(file.metadata.get('llama.attention.head_count'));
    const kvHeads = Number(file.metadata.get('llama.attention.head_count_kv'));
    const ffn = Number(file.metadata.get('llama.feed_forward_length'));
    const headDim = dim / heads;
    assert.equal(server.engine.info.kvDtype, 'f16', 'what --kv-cache-dtype auto stores');
    const blockBytes = 2 * numLayers * 16 * kvHeads * headDim * 2;  // K and V, 16-token blocks, f16
    assert.equal(value(exposition, 'conduit_memory_used_bytes', { worker, category: 'kv_cache' }), Math.floor(KV_BYTES / blockBytes) * blockBytes);

    const tensorBytes = file.tensorInfos.reduce((sum, t) => sum + byteSize(t.type, t.shape.reduce((a, b) => a * b, 1)), 0);
    const weights = value(exposition, 'conduit_memory_used_bytes', { worker, category: 'weights' })!;
    // The file's tensors, plus the packed copy of its matrices less the pages of theirs given back (at most all again).
    assert.ok(weights >= 0.9 * tensorBytes && weights <= 2 * tensorBytes, `weights ${weights} bytes, the file's tensors ${tensorBytes}`);

    const activations = value(exposition, 'conduit_memory_used_bytes', { worker, category: 'activations' })!;
    const vocab = Number(file.metadata.get('llama.vocab_size') ?? (file.metadata.get('tokenizer.ggml.tokens') as unknown[]).length);
    const logits = vocab * 4;
    if (server.engine.info.backend === 'native') {
      const rowBytes = 4 * (3 * dim + 2 * dim + 2 * kvHeads * headDim + 2 * ffn);
      assert.ok(activations >= STEP_TOKENS * rowBytes + logits, `activations ${activations} bytes`);
    } else {
      assert.ok(activations >= logits, `activations ${activations} bytes`);
    }
  });

  it('a prompt that fills the KV pool is served; one token more is beyond the context the pool sets, not an OOM event', LIVE, async () => {
    const capacity = server.engine.info.kvCapacityTokens;
    // The pool, not the model, limits a sequence here: its context is the pool and the one sampled token never computed.
    assert.equal(server.engine.info.maxModelLen, capacity + 1);
    const exposition = (await scrape(server.url)).exposition;
    // At 0 before the first event, for the worker and for refusals before any worker: an alert's increase() over a
    // series that appears at 1 would see nothing.
    assert.equal(value(exposition, 'conduit_oom_events_total', { kind: 'kv_capacity', worker: 'none' }), 0);
    assert.equal(value(exposition, 'conduit_oom_events_total', { kind: 'kv_capacity', worker: 'worker-0' }), 0);
    assert.equal(value(exposition, 'conduit_telemetry_dropped_records_total', { reason: 'expired' }), 0);
    const before = total(exposition, 'conduit_oom_events_total', { kind: 'kv_capacity' });
    const prompt = (length: number) => Array.from({ length }, (_, i) => 100 + (i % 500));
    const fits = await rawRequest(server.url, { path: '/v1/completions', body: { model, prompt: prompt(capacity), max_tokens: 1 } });
    assert.equal(fits.status, 200, fits.text);
    assert.equal(fits.json().usage.prompt_tokens, capacity);
    const longer = await rawRequest(server.url, { path: '/v1/completions', body: { model, prompt: prompt(capacity + 1), max_tokens: 1 } });
    assert.equal(longer.status, 400, longer.text);
    assert.equal(longer.json().error.code, 'context_length_exceeded');
    const after = (await scrape(server.url)).exposition;
    assert.equal(total(after, 'conduit_oom_events_total', { kind: 'kv_capacity' }), before);
  });

  it('requests preempted for KV blocks: the shortfalls are counted, no more than the preemptions, and are not OOM events', LIVE, async () => {
    const scrapeBoth = async () => {
      const { exposition } = await scrape(server.url);
      return {
        failures: total(exposition, 'conduit_kv_block_shortfalls_total'),
        oom: total(exposition, 'conduit_oom_events_total', { kind: 'scratch' }),
        preemptions: total(exposition, 'conduit_scheduler_preemptions_total'),
      };
    };
    const before = await scrapeBoth();
    // Each fits the pool alone (~160 tokens), four at once do not.
    const results = await Promise.all(Array.from({ length: 4 }, () => rawRequest(server.url, {
      path: '/v1/completions', body: { model, prompt: `${randomUUID()} ships`, max_tokens: 100, temperature: 0, ignore_eos: true },
    })));
    for (const r of results) assert.equal(r.status, 200, r.text);
    const after = await scrapeBoth();
    const failures = after.failures - before.failures;
    const preemptions = after.preemptions - before.preemptions;
    assert.ok(failures > 0, 'the pool ran out of blocks');
    assert.ok(failures <= preemptions, `${failures} shortfalls, ${preemptions} preemptions`);
    assert.equal(after.oom - before.oom, 0);
  });
});
