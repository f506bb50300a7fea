// A restarted worker loads the LoRA adapters its group has before it takes requests: with every worker killed and
// restarted, a request naming an adapter is served again with the text it had before; a restarted worker that cannot
// load them is closed before the next attempt.
import assert from 'node:assert/strict';
import { rmSync, writeFileSync } from 'node:fs';
import { join } from 'node:path';
import { test } from 'node:test';
import { silentLogger } from '../../src/util/log.ts';
import { parseServeConfig, startServer } from '../../src/cli/serve.ts';
import { LocalEngine } from '../../src/engine/local-engine.ts';
import { loadModel } from '../../src/model/loader.ts';
import { randomLoraAdapter, writeGgufLoraAdapter } from '../../src/model/lora-writer.ts';
import { RoutedEngine } from '../../src/runtime/routed-engine.ts';
import { waitUntil } from '../helpers/wait-until.ts';
import { writeWorkerLossFixture } from '../helpers/worker-loss.ts';

/** A server of two cpu workers restarted 10 ms after a loss, with adapter 'a' (a GGUF file in the fixture's folder). */
async function serveWithAdapter(name: string, seed: number, flags: string[] = []) {
  const fixture = writeWorkerLossFixture(name);
  const adapterPath = join(fixture.dir, 'a.gguf');
  const { config } = await loadModel(fixture.modelPath);
  writeGgufLoraAdapter(adapterPath, config, randomLoraAdapter(config, { rank: 4, seed, bScale: 1 }));
  const parsed = parseServeConfig(['--port', '0', '--model', `base=${fixture.modelPath}`, '--threads', '1', '--backend', 'reference',
    '--kv-cache-memory', '16MiB', '--workers', '2', '--worker-restart-delay', '10', '--lora-modules', `a=${adapterPath}`, ...flags], {});
  assert.notEqual(parsed, 'help');
  const running = await startServer(parsed as Exclude<typeof parsed, 'help'>, silentLogger);
  return { fixture, adapterPath, running };
}

/** The real engines the restarts start from now on, and which of them were closed; restore() stops watching. */
function trackEngines() {
  const started: LocalEngine[] = [];
  const closed = new Set<LocalEngine>();
  const start = LocalEngine.start;
  const close = LocalEngine.prototype.close;
  LocalEngine.start = async function (...args: Parameters<typeof LocalEngine.start>) {
    const engine = await start.apply(this, args);
    started.push(engine);
    return engine;
  };
  LocalEngine.prototype.close = function (this: LocalEngine) {
    closed.add(this);
    return close.call(this);
  };
  const restore = () => {
    LocalEngine.start = start;
    LocalEngine.prototype.close = close;
  };
  return { started, closed, restore };
}

test('restarted workers serve the adapters loaded before they were lost', { timeout: 120_000 }, async () => {
  const { fixture, running } = await serveWithAdapter('lora-restart', 12);
  const complete = async (model: string) => {
    const res = await fetch(`${running.url}/v1/completions`, {
      method: 'POST', headers: { 'Content-Type': 'application/json' },
      body: JSON.stringify({ model, prompt: 'Once upon a time', max_tokens: 10, temperature: 0, ignore_eos: true }),
    });
    const body = await res.text();
    return { status: res.status, body, text: res.status === 200 ? (JSON.parse(body) as { choices: { text: string }[] }).choices[0]!.text : '' };
  };
  try {
    const routed = running.api.gateway.engine;
    assert.ok(routed instanceof RoutedEngine);
    const before = await complete('a');
    assert.equal(before.status, 200, before.body);
    assert.notEqual(before.text, (await complete('base')).text, 'the adapter changed nothing');
    const killed = routed.workerIds;
    await Promise.all(killed.map((id) => (routed.workerEngine(id) as LocalEngine).kill()));
    await waitUntil(() => routed.workerIds.length === 2 && routed.workerIds.every((id) => id.endsWith('-r1')), 'both workers restarted', 60_000);
    for (let i = 0; i < 4; i++) {
      const after = await complete('a');
      assert.equal(after.status, 200, after.body);
      assert.equal(after.text, before.text);
    }
  } finally {
    await running.api.shutdown(0);
    rmSync(fixture.dir, { recursive: true, force: true });
  }
});

test('a restarted worker that cannot load the group\'s adapters is closed, not left running beside the next attempt', { timeout: 120_000 }, async () => {
  const { fixture, adapterPath, running } = await serveWithAdapter('lora-restart-fail', 13, ['--worker-restart-limit', '2']);
  const { started, closed, restore } = trackEngines();
  try {
    const routed = running.api.gateway.engine;
    assert.ok(routed instanceof RoutedEngine);
    // The adapter file is damaged after the start: a restarted worker cannot load it.
    writeFileSync(adapterPath, 'not a GGUF file');
    await (routed.workerEngine(routed.workerIds[0]!) as LocalEngine).kill();
    await waitUntil(() => started.length === 2 && started.every((engine) => closed.has(engine)),
      'both restart attempts started an engine and closed it', 60_000);
    assert.equal(routed.workerIds.length, 1, 'the lost worker given up after the limit; the other serves on');
  } finally {
    restore();
    await running.api.shutdown(0);
    rmSync(fixture.dir, { recursive: true, force: true });
  }
});

test('a restarted worker that reads other bytes at the adapter\'s path is closed: its cached prefixes would be the old weights\'', { timeout: 120_000 }, async () => {
  const { fixture, adapterPath, running } = await serveWithAdapter('lora-restart-changed', 14, ['--worker-restart-limit', '2']);
  const { started, closed, restore } = trackEngines();
  const complete = async (model: string) => {
    const res = await fetch(`${running.url}/v1/completions`, {
      method: 'POST', headers: { 'Content-Type': 'application/json' },
      body: JSON.stringify({ model, prompt: 'Once upon a time', max_tokens: 10, temperature: 0, ignore_eos: true }),
    });
    assert.equal(res.status, 200);
    return (await res.json() as { choices: { text: string }[] }).choices[0]!.text;
  };
  try {
    const routed = running.api.gateway.engine;
    assert.ok(routed instanceof RoutedEngine);
    const before = await complete('a');
    // A valid adapter of the same shape, other weights, written over the loaded one's file.
    const { config } = await loadModel(fixture.modelPath);
    writeGgufLoraAdapter(adapterPath, config, randomLoraAdapter(config, { rank: 4, seed: 99, bScale: 1 }));
    const lost = routed.workerIds[0]!;
    await (routed.workerEngine(lost) as LocalEngine).kill();
    await waitUntil(() => started.length === 2 && started.every((engine) => closed.has(engine)),
      'both restart attempts loaded the changed file and were closed', 60_000);
    assert.deepEqual(routed.workerIds.filter((id) => id !== lost).length, 1, 'the other worker serves on');
    assert.equal(routed.workerIds.length, 1, 'no restarted worker joined with the changed adapter');
    assert.equal(await complete('a'), before, 'the adapter is still the bytes it was loaded with');
  } finally {
    restore();
    await running.api.shutdown(0);
    rmSync(fixture.dir, { recursive: true, force: true });
  }
});

test('workers that read different bytes for one load refuse it: the file changed while they loaded it', { timeout: 120_000 }, async () => {
  const { fixture, running } = await serveWithAdapter('lora-load-changed', 15);
  const load = LocalEngine.prototype.loadLora;
  const routed = running.api.gateway.engine;
  assert.ok(routed instanceof RoutedEngine);
  const [first, second] = routed.workerIds.map((id) => routed.workerEngine(id) as LocalEngine);
  const { config } = await loadModel(fixture.modelPath);
  const bPath = join(fixture.dir, 'b.gguf');
  writeGgufLoraAdapter(bPath, config, randomLoraAdapter(config, { rank: 4, seed: 21, bScale: 1 }));
  // The second worker reads the file only after the first has loaded it, and after it was rewritten.
  let firstLoaded: Promise<unknown> = Promise.resolve();
  LocalEngine.prototype.loadLora = function (this: LocalEngine, name: string, path: string) {
    if (this === first) {
      const loaded = load.call(this, name, path);
      firstLoaded = loaded.catch(() => {});
      return loaded;
    }
    if (this === second) {
      return firstLoaded.then(() => {
        writeGgufLoraAdapter(bPath, config, randomLoraAdapter(config, { rank: 4, seed: 22, bScale: 1 }));
        return load.call(this, name, path);
      });
    }
    return load.call(this, name, path);
  };
  try {
    const res = await fetch(`${running.url}/v1/load_lora_adapter`, {
      method: 'POST', headers: { 'Content-Type': 'application/json' }, body: JSON.stringify({ lora_name: 'b', lora_path: bPath }),
    });
    const body = await res.text();
    assert.equal(res.status, 400, body);
    assert.match(body, /changed while the workers loaded it/);
    LocalEngine.prototype.loadLora = load;
    // Nothing of it stayed on either worker: loaded again (the file now stable), it serves.
    const again = await fetch(`${running.url}/v1/load_lora_adapter`, {
      method: 'POST', headers: { 'Content-Type': 'application/json' }, body: JSON.stringify({ lora_name: 'b', lora_path: bPath }),
    });
    assert.equal(again.status, 200, await again.text());
  } finally {
    LocalEngine.prototype.loadLora = load;
    await running.api.shutdown(0);
    rmSync(fixture.dir, { recursive: true, force: true });
  }
});
