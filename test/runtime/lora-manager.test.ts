// The LoRA adapter table of one served model with a stand-in engine: unregistering an adapter with requests in
// flight does not refuse (as vLLM does not): the name is gone at once (new requests get 404, it can be registered
// again under a new key), the workers keep the adapter until the last of its requests releases it, and it still
// counts against --max-loras until then. A request for an adapter that finds every slot busy waits its turn (first
// come, first served) instead of being refused, and a resident adapter kept busy yields its slot to it.
import assert from 'node:assert/strict';
import { describe, it } from 'node:test';
import type { Engine, LoraLoadInfo } from '../../src/engine/types.ts';
import { LoraLoadError } from '../../src/engine/errors.ts';
import { LoraCapacityError, LoraManager } from '../../src/runtime/lora-manager.ts';

/** A stand-in engine; an adapter's rank is the number after "r" in its path (/x-r32.gguf), 4 without one. */
function fakeEngine() {
  const calls: string[] = [];
  const resident = new Set<string>();
  const engine = {
    async loadLora(name: string, path: string): Promise<LoraLoadInfo> {
      calls.push(`load ${name} ${path}`);
      resident.add(name);
      return { format: 'gguf', rank: Number(/-r(\d+)\./.exec(path)?.[1] ?? 4), alpha: 8, bytes: 1 };
    },
    async unloadLora(name: string): Promise<void> {
      calls.push(`unload ${name}`);
      resident.delete(name);
    },
  } as unknown as Engine;
  return { engine, calls, resident };
}

describe('LoraManager', () => {
  it('unloads an unregistered adapter after its requests in flight release it', async () => {
    const { engine, calls, resident } = fakeEngine();
    const manager = new LoraManager(engine, 2);
    await manager.register('a', '/a.gguf');
    const first = await manager.acquire('a');
    const second = await manager.acquire('a');
    assert.deepEqual(await manager.unregister('a'), { inFlight: 2 });
    // Gone for new requests at once, still on the workers for the two running.
    assert.equal(manager.has('a'), false);
    await assert.rejects(manager.acquire('a'), { code: 'lora_not_loaded' });
    assert.deepEqual([...resident], [first]);
    assert.equal(manager.stats().resident, 1);
    // The name can be registered again: a new key, while the old one drains.
    await manager.register('a', '/a2.gguf');
    const again = await manager.acquire('a');
    assert.notEqual(again, first);
    // Both resident count against maxLoras 2: a third adapter finds no idle one to evict.
    await assert.rejects(manager.register('b', '/b.gguf'), LoraCapacityError);
    manager.release(first);
    assert.ok(resident.has(first), 'unloaded while a request still ran with it');
    manager.release(second);
    await new Promise((resolve) => setImmediate(resolve));
    assert.equal(resident.has(first), false, 'not unloaded after its last request');
    assert.ok(resident.has(again));
    assert.equal(calls.filter((c) => c === `unload ${first}`).length, 1);
    // Releasing again changes nothing; the new registration is untouched.
    manager.release(first);
    manager.release(again);
    assert.deepEqual(await manager.unregister('a'), { inFlight: 0 });
    assert.equal(resident.size, 0);
    await assert.rejects(manager.unregister('a'), { code: 'lora_not_loaded' });
  });

  it('refuses an adapter above --max-lora-rank, unloading it from the workers, and takes one at the limit', async () => {
    const { engine, calls, resident } = fakeEngine();
    const manager = new LoraManager(engine, 2, undefined, 16);
    await assert.rejects(manager.register('big', '/big-r32.gguf'), (error: Error & { code?: string }) =>
      error.name === 'LoraLoadError' && error.code === 'invalid_adapter' && /rank 32/.test(error.message) && /maximum LoRA rank 16/.test(error.message));
    assert.equal(manager.has('big'), false, 'the refused adapter stayed registered');
    assert.equal(resident.size, 0, 'the refused adapter stayed on the workers');
    assert.equal(manager.stats().loads, 0);
    assert.equal((await manager.register('edge', '/edge-r16.gguf')).rank, 16);
    assert.ok(manager.has('edge'));
    assert.deepEqual(calls.filter((c) => c.startsWith('unload')).length, 1);
    assert.throws(() => new LoraManager(engine, 2, undefined, 0), RangeError);
  });

  it('reads the rank from the header first: a refused adapter evicts nothing when --max-loras are resident', async () => {
    const { engine, calls, resident } = fakeEngine();
    const inspect = async (path: string) => ({ rank: Number(/-r(\d+)\./.exec(path)?.[1] ?? 4), digest: path });
    const manager = new LoraManager(engine, 1, undefined, 16, { inspect });
    const idle = await manager.register('idle', '/idle-r8.gguf');
    assert.equal(idle.rank, 8);
    await assert.rejects(manager.register('big', '/big-r32.gguf'), { code: 'invalid_adapter', message: /rank 32, greater than the maximum LoRA rank 16/ });
    assert.deepEqual(calls, ['load idle#/idle-r8.gguf /idle-r8.gguf'], 'the refused adapter was loaded or the idle one evicted');
    assert.equal(resident.size, 1);
    assert.deepEqual(manager.stats(), { registered: 1, resident: 1, loads: 1, evictions: 0, waiting: 0 });
  });

  it('keys by content: the same bytes under the same name give the same key (in another process too), other bytes another', async () => {
    const { engine } = fakeEngine();
    const digests: Record<string, string> = { '/a.gguf': 'aaaa', '/a-copy.gguf': 'aaaa', '/b.gguf': 'bbbb' };
    const inspect = async (path: string) => ({ rank: 4, digest: digests[path]! });
    const one = new LoraManager(engine, 2, undefined, 16, { inspect });
    const two = new LoraManager(engine, 2, undefined, 16, { inspect });
    await one.register('x', '/a.gguf');
    await two.register('x', '/a-copy.gguf');
    assert.equal(one.list()[0]!.key, two.list()[0]!.key);
    assert.equal(one.list()[0]!.key, 'x#aaaa');
    // A restart that gives a name other bytes (a disk KV tier keeps blocks across it): another key, whatever the
    // order of registration.
    const restarted = new LoraManager(engine, 2, undefined, 16, { inspect });
    await restarted.register('x', '/b.gguf');
    assert.notEqual(restarted.list()[0]!.key, one.list()[0]!.key);
    await one.unregister('x');
    await one.register('x', '/b.gguf');
    assert.equal(one.list()[0]!.key, 'x#bbbb');
    // A request carrying the key finds the adapter; an unknown key is lora_not_loaded.
    assert.equal(await one.acquireKey('x#bbbb'), 'x#bbbb');
    one.release('x#bbbb');
    await assert.rejects(one.acquireKey('x#aaaa'), { code: 'lora_not_loaded' });
  });

  it('queues a request for an adapter while every slot is busy and serves it when one frees, in arrival order', async () => {
    const { engine, resident } = fakeEngine();
    const manager = new LoraManager(engine, 1);
    await manager.register('a', '/a.gguf');
    await manager.register('b', '/b.gguf');  // 'a' evicted (idle)
    await manager.register('c', '/c.gguf');  // 'b' evicted
    const order: string[] = [];
    const c1 = await manager.acquire('c');
    const forA = manager.acquire('a').then((key) => { order.push('a'); return key; });
    const forB = manager.acquire('b').then((key) => { order.push('b'); return key; });
    await new Promise((resolve) => setImmediate(resolve));
    assert.equal(manager.stats().waiting, 2);
    assert.equal(order.length, 0);
    // 'c' yields its slot: a new request for it waits too, behind the others.
    const c2 = manager.acquire('c').then((key) => { order.push('c'); return key; });
    await new Promise((resolve) => setImmediate(resolve));
    assert.equal(manager.stats().waiting, 3);
    manager.release(c1);
    const a = await forA;
    assert.deepEqual([...resident], [a]);
    assert.deepEqual(order, ['a']);
    manager.release(a);
    const b = await forB;
    manager.release(b);
    const c = await c2;
    assert.deepEqual(order, ['a', 'b', 'c']);
    manager.release(c);
    assert.deepEqual(manager.stats(), { registered: 3, resident: 1, loads: 6, evictions: 5, waiting: 0 });
  });

  it('lets requests for other resident adapters through while one waits, and ends a wait on abort or unregister', async () => {
    const { engine } = fakeEngine();
    const manager = new LoraManager(engine, 2);
    await manager.register('x', '/x.gguf');
    await manager.register('y', '/y.gguf');
    await manager.register('z', '/z.gguf');  // 'x' evicted
    const y = await manager.acquire('y');
    const z = await manager.acquire('z');
    // 'x' waits; 'y', the least recently used busy one, yields; 'z' takes new requests.
    const aborter = new AbortController();
    const abortedWait = manager.acquire('x', aborter.signal);
    const unregisteredWait = manager.acquire('x');
    await new Promise((resolve) => setImmediate(resolve));
    assert.equal(await manager.acquire('z'), z);
    manager.release(z);
    let yAgain = false;
    const forY = manager.acquire('y').then((key) => { yAgain = true; return key; });
    await new Promise((resolve) => setImmediate(resolve));
    assert.equal(yAgain, false, "a new request joined the yielding adapter");
    assert.equal(manager.stats().waiting, 3);
    aborter.abort(new Error('client gone'));
    await assert.rejects(abortedWait, /client gone/);
    await assert.rejects(manager.acquire('x', aborter.signal), /client gone/);
    await manager.unregister('x');
    await assert.rejects(unregisteredWait, { code: 'lora_not_loaded' });
    // Nobody waits for a slot any more: 'y' takes requests again.
    assert.equal(await forY, y);
    assert.equal(manager.stats().waiting, 0);
    manager.release(y);
    manager.release(y);
    manager.release(z);
  });

  it('a load refused after its name was unloaded and registered again leaves the new registration alone', async () => {
    const { engine, resident } = fakeEngine();
    const loadLora = (engine as unknown as { loadLora: (name: string, path: string) => Promise<LoraLoadInfo> }).loadLora;
    let refuse: (() => void) | undefined;
    (engine as unknown as { loadLora: typeof loadLora }).loadLora = (name, path) => new Promise((resolve, reject) => {
      if (!path.startsWith('/slow')) return resolve(loadLora(name, path));
      refuse = () => reject(new LoraLoadError('invalid_adapter', `${path}: made for another base model`));
    });
    const manager = new LoraManager(engine, 2);
    const tick = () => new Promise((resolve) => setImmediate(resolve));
    // A slow load of a file the workers will refuse; meanwhile the name is unloaded and loaded again with another file.
    const refused = manager.register('a', '/slow-bad.gguf');
    while (refuse === undefined) await tick();
    const unloaded = manager.unregister('a');
    await manager.register('a', '/a.gguf');
    const key = manager.list()[0]!.key;
    refuse();
    await assert.rejects(refused, { code: 'invalid_adapter' });
    await unloaded;
    assert.deepEqual(manager.list().map((e) => [e.name, e.path, e.resident]), [['a', '/a.gguf', true]]);
    assert.equal(await manager.acquire('a'), key);
    assert.deepEqual([...resident], [key]);
  });

  describe('refusals evict nothing, whatever the occupancy', () => {
    /** The fake engine refusing what a worker would: a path with "bad" in it (no file, made for another base model). */
    function refusingEngine() {
      const fake = fakeEngine();
      const loadLora = (fake.engine as unknown as { loadLora: (name: string, path: string) => Promise<LoraLoadInfo> }).loadLora;
      (fake.engine as unknown as { loadLora: typeof loadLora }).loadLora = async (name, path) => {
        if (path.includes('bad')) {
          fake.calls.push(`refuse ${name}`);
          throw new LoraLoadError('invalid_adapter', `${path}: made for another base model`);
        }
        return loadLora(name, path);
      };
      return fake;
    }

    it('a load the workers refuse leaves an idle resident adapter, and is a 400 with every slot busy too', async () => {
      const { engine, calls, resident } = refusingEngine();
      const manager = new LoraManager(engine, 2);
      await manager.register('a', '/a.gguf');
      await manager.register('b', '/b.gguf');
      await assert.rejects(manager.register('bad', '/bad.gguf'), { code: 'invalid_adapter' });
      assert.equal(resident.size, 2, 'an idle adapter was evicted for a refused load');
      assert.equal(manager.stats().evictions, 0);
      const [a, b] = [await manager.acquire('a'), await manager.acquire('b')];
      await assert.rejects(manager.register('bad', '/bad.gguf'), (error: Error) => !(error instanceof LoraCapacityError)
        && (error as { code?: string }).code === 'invalid_adapter', 'every slot busy: still the refusal, not a retryable capacity error');
      // A good adapter with every slot busy: loaded (and checked), then refused for capacity, and unloaded again.
      await assert.rejects(manager.register('c', '/c.gguf'), LoraCapacityError);
      assert.deepEqual([...resident].sort(), [a, b].sort());
      assert.equal(calls.filter((c) => c.startsWith('unload')).length, 1, calls.join(', '));
      manager.release(a);
      manager.release(b);
      // An idle slot: the good one loads first, then the least recently used idle adapter goes.
      await manager.register('c', '/c.gguf');
      assert.deepEqual(calls.slice(-2), ['load c#' + manager.list().find((e) => e.name === 'c')!.key.slice(2) + ' /c.gguf', `unload ${a}`]);
      assert.equal(manager.stats().resident, 2);
    });

    it('the idle adapter a load will evict takes no new requests while it loads, and takes them again if it is refused', async () => {
      const { engine, calls } = fakeEngine();
      const loadLora = (engine as unknown as { loadLora: (name: string, path: string) => Promise<LoraLoadInfo> }).loadLora;
      let gate: { release: () => void; refuse: () => void } | undefined;
      (engine as unknown as { loadLora: typeof loadLora }).loadLora = (name, path) => new Promise((resolve, reject) => {
        if (!path.startsWith('/slow')) return resolve(loadLora(name, path));
        gate = {
          release: () => resolve(loadLora(name, path)),
          refuse: () => reject(new LoraLoadError('invalid_adapter', `${path}: made for another base model`)),
        };
      });
      const manager = new LoraManager(engine, 1);
      const tick = () => new Promise((resolve) => setImmediate(resolve));
      /** The slow load under way, once it started. */
      const started = () => gate;
      await manager.register('a', '/a.gguf');
      const aKey = manager.list()[0]!.key;
      // A load that will be refused: 'a' is held back meanwhile, then serves at once, never evicted.
      const refused = manager.register('bad', '/slow-bad.gguf');
      while (gate === undefined) await tick(); // the load is under way
      let gotA = false;
      const first = manager.acquire('a').then((key) => { gotA = true; return key; });
      await tick();
      assert.equal(gotA, false, 'a request took the adapter the load is to evict');
      gate!.refuse();
      gate = undefined;
      await assert.rejects(refused, { code: 'invalid_adapter' });
      manager.release(await first);
      assert.equal(calls.includes(`unload ${aKey}`), false);
      // A load that succeeds: 'a' is held back, then evicted; its request then waits for the slot, which the new
      // adapter, idle, gives up.
      const registering = manager.register('slow', '/slow-b.gguf');
      while (started() === undefined) await tick();
      gotA = false;
      const second = manager.acquire('a').then((key) => { gotA = true; return key; });
      await tick();
      assert.equal(gotA, false);
      started()!.release();
      await registering;
      const slowKey = manager.list().find((e) => e.name === 'slow')!.key;
      assert.deepEqual(calls.slice(calls.indexOf(`load ${slowKey} /slow-b.gguf`)).slice(0, 2), [`load ${slowKey} /slow-b.gguf`, `unload ${aKey}`]);
      manager.release(await second);
      assert.deepEqual(manager.list().map((e) => [e.name, e.resident]), [['a', true], ['slow', false]]);
      assert.equal(manager.stats().evictions, 2);
    });

    it('a registered adapter whose file changed or went is refused when it loads again; nothing is evicted for it', async () => {
      const { engine, calls, resident } = fakeEngine();
      const digests: Record<string, string | undefined> = { '/a.gguf': 'aaaa', '/b.gguf': 'bbbb', '/x.gguf': 'xxxx' };
      const inspect = async (path: string) => (digests[path] === undefined ? undefined : { rank: 4, digest: digests[path]! });
      const manager = new LoraManager(engine, 2, undefined, 16, { inspect });
      await manager.register('x', '/x.gguf');
      await manager.register('a', '/a.gguf');
      await manager.register('b', '/b.gguf'); // evicts x
      assert.equal(manager.list().find((e) => e.name === 'x')!.resident, false);
      digests['/x.gguf'] = 'yyyy'; // overwritten in place
      const before = calls.length;
      await assert.rejects(manager.acquire('x'), { code: 'invalid_adapter', message: /\/x\.gguf changed since the adapter was loaded/ });
      assert.deepEqual(calls.slice(before), [], 'nothing loaded or evicted');
      assert.equal(resident.size, 2);
      delete digests['/x.gguf'];
      await assert.rejects(manager.acquire('x'), { code: 'invalid_adapter', message: /no longer exists/ });
      assert.deepEqual(calls.slice(before), []);
      // Loaded again, the new bytes get a new key.
      digests['/x.gguf'] = 'yyyy';
      await manager.unregister('x');
      await manager.register('x', '/x.gguf');
      assert.equal(manager.list().find((e) => e.name === 'x')!.key, 'x#yyyy');
    });

    it('an engine that reports the digest of what it loaded: a changed file is caught there, and unloaded again', async () => {
      const { engine, calls, resident } = fakeEngine();
      const bytes: Record<string, string> = { '/a.gguf': 'aaaa', '/b.gguf': 'bbbb', '/x.gguf': 'xxxx' };
      const loadLora = (engine as unknown as { loadLora: (name: string, path: string) => Promise<LoraLoadInfo> }).loadLora;
      (engine as unknown as { loadLora: typeof loadLora }).loadLora = async (name, path) => ({ ...await loadLora(name, path), digest: bytes[path] } as LoraLoadInfo);
      const inspected: string[] = [];
      const inspect = async (path: string) => {
        inspected.push(path);
        return { rank: 4, digest: bytes[path]! };
      };
      const manager = new LoraManager(engine, 2, undefined, 16, { inspect });
      await manager.register('x', '/x.gguf');
      await manager.register('a', '/a.gguf');
      await manager.register('b', '/b.gguf'); // evicts x
      bytes['/x.gguf'] = 'yyyy';
      const before = calls.length;
      await assert.rejects(manager.acquire('x'), { code: 'invalid_adapter', message: /changed since the adapter was loaded/ });
      assert.deepEqual(calls.slice(before), ['load x#xxxx /x.gguf', 'unload x#xxxx'], 'loaded, found other bytes, unloaded; nothing evicted');
      assert.equal(resident.size, 2);
      assert.deepEqual(inspected, ['/x.gguf', '/a.gguf', '/b.gguf'], 'the workers check the bytes: the file is not read here again');
      // The same bytes again: it loads under its key.
      bytes['/x.gguf'] = 'xxxx';
      manager.release(await manager.acquire('x'));
      assert.equal(manager.list().find((e) => e.name === 'x')!.resident, true);
    });
  });
});
