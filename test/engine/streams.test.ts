import { test } from 'node:test';
import assert from 'node:assert/strict';
import { AsyncQueue, followQueue } from '../../src/engine/streams.ts';

test('a reader gets the items in order, then the end; items pushed while it waits settle its next()', async () => {
  const queue = new AsyncQueue<number>();
  queue.push(1);
  const reader = queue.drain();
  assert.deepEqual(await reader.next(), { value: 1, done: false });
  const waiting = reader.next();
  queue.push(2);
  queue.push(3);
  queue.end();
  assert.deepEqual(await waiting, { value: 2, done: false });
  assert.deepEqual(await reader.next(), { value: 3, done: false });
  assert.deepEqual(await reader.next(), { value: undefined, done: true });
  assert.deepEqual(await reader.next(), { value: undefined, done: true });
});

test('a failure reaches the reader after the items pushed before it, once', async () => {
  const queue = new AsyncQueue<string>();
  const seen: string[] = [];
  queue.push('a');
  setTimeout(() => {
    queue.push('b');
    queue.fail(new Error('lost'));
  }, 1);
  await assert.rejects(async () => {
    for await (const item of queue.drain()) seen.push(item);
  }, /lost/);
  assert.deepEqual(seen, ['a', 'b']);
  const reader = queue.drain();
  await assert.rejects(reader.next(), /lost/);
  assert.deepEqual(await reader.next(), { value: undefined, done: true });
});

test('next() calls made before the items arrive are settled in the order they were made', async () => {
  const queue = new AsyncQueue<number>();
  const reader = queue.drain();
  const first = reader.next(), second = reader.next(), third = reader.next();
  queue.push(1);
  queue.push(2);
  queue.end();
  assert.deepEqual(await Promise.all([first, second, third]),
    [{ value: 1, done: false }, { value: 2, done: false }, { value: undefined, done: true }]);
});

test('followQueue: leaving early aborts the request and ends a next() that waits; the queue leaves the registry', async () => {
  const registry = new Map<string, AsyncQueue<number>>();
  const queue = new AsyncQueue<number>();
  registry.set('r', queue);
  const aborted: string[] = [];
  const stream = followQueue(registry, 'r', queue, (id) => aborted.push(id));
  queue.push(1);
  assert.deepEqual(await stream.next(), { value: 1, done: false });
  const waiting = stream.next();
  await stream.return!();
  assert.deepEqual(await waiting, { value: undefined, done: true });
  assert.deepEqual(aborted, ['r']);
  assert.equal(registry.has('r'), false);
  queue.push(2);
  assert.deepEqual(await stream.next(), { value: undefined, done: true });
  await stream.return!();
  assert.deepEqual(aborted, ['r']);
});

test('followQueue: a stream read to its end leaves the registry without an abort', async () => {
  const registry = new Map<string, AsyncQueue<number>>();
  const queue = new AsyncQueue<number>();
  registry.set('r', queue);
  const aborted: string[] = [];
  const items: number[] = [];
  setTimeout(() => {
    queue.push(7);
    queue.end();
  }, 1);
  for await (const item of followQueue(registry, 'r', queue, (id) => aborted.push(id))) items.push(item);
  assert.deepEqual(items, [7]);
  assert.deepEqual(aborted, []);
  assert.equal(registry.has('r'), false);
});

test('followQueue: a failure the owner also unregisters (a refused request) is not aborted; a newer queue under the id stays', async () => {
  const registry = new Map<string, AsyncQueue<number>>();
  const queue = new AsyncQueue<number>();
  registry.set('r', queue);
  const aborted: string[] = [];
  const stream = followQueue(registry, 'r', queue, (id) => aborted.push(id));
  const waiting = stream.next();
  // As LocalEngine takes a rejection in: the queue fails, then leaves the registry, in one turn.
  queue.fail(new Error('refused'));
  registry.delete('r');
  const newer = new AsyncQueue<number>();
  registry.set('r', newer);
  await assert.rejects(waiting, /refused/);
  assert.deepEqual(aborted, []);
  assert.equal(registry.get('r'), newer);
});

test('followQueue: a failure of a queue still registered aborts the request (its end was not seen) and unregisters it', async () => {
  const registry = new Map<string, AsyncQueue<number>>();
  const queue = new AsyncQueue<number>();
  registry.set('r', queue);
  const aborted: string[] = [];
  const stream = followQueue(registry, 'r', queue, (id) => aborted.push(id));
  queue.fail(new Error('lost'));
  await assert.rejects(stream.next(), /lost/);
  assert.deepEqual(aborted, ['r']);
  assert.equal(registry.has('r'), false);
});
