// Every engine error (src/engine/errors.ts) as the gateway answers it: engineFailure maps them by name, so a class
// added or renamed there without its case here would surface as a 500.
import assert from 'node:assert/strict';
import { describe, test } from 'node:test';
import { engineFailure } from '../../src/api/generation-run.ts';
import {
  EngineClosedError, EngineOverloadedError, EngineUnavailableError, InvalidRequestError, WorkerLostError,
} from '../../src/engine/errors.ts';

describe('engineFailure', () => {
  const cases: [Error, number, string][] = [
    [new InvalidRequestError('prompt_exceeds_kv_pool', 'r1', 'too long'), 400, 'prompt_exceeds_kv_pool'],
    [InvalidRequestError.fromWorker('handoff_failed', 'r2', 'request "r2": no'), 400, 'handoff_failed'],
    // A worker thread or process refusing an adapter it lacks (it was unloaded meanwhile): the code survives the trip.
    [InvalidRequestError.fromWorker('lora_not_loaded', 'r4', 'request "r4": LoRA adapter \'sql\' is not loaded on this worker'), 400, 'lora_not_loaded'],
    [InvalidRequestError.fromWorker('no_such_code', 'r5', 'request "r5": no'), 400, 'invalid_request'],
    [new EngineClosedError('engine closed while request r3 was running'), 503, 'shutting_down'],
    [new EngineOverloadedError('queue full', 2000), 503, 'server_overloaded'],
    [new EngineUnavailableError('no worker is available (its one worker was lost, restarting)', 1000, false), 503, 'no_worker_available'],
    [new WorkerLostError('w0', 'worker w0 was lost'), 503, 'worker_lost'],
    [new Error('forward pass failed'), 500, 'engine_error'],
  ];
  for (const [error, status, code] of cases) {
    test(`${error.name} (${(error as { code?: string }).code ?? 'no code'}) -> ${status} ${code}`, () => {
      const answer = engineFailure(error);
      assert.equal(answer.statusCode, status);
      assert.equal(answer.code, code);
    });
  }

  test('no worker left: a retry is promised only while a restart runs, and ruled out when none will', () => {
    const restarting = engineFailure(new EngineUnavailableError('no worker is available (its one worker was lost, restarting)', 1500, false));
    assert.equal(restarting.headers['Retry-After'], '2');
    assert.equal(restarting.message, 'The server cannot run this request: no worker is available (its one worker was lost, restarting). Retry once the restart is done.');
    const gone = engineFailure(new EngineUnavailableError('no worker is available (its one worker was lost, and restarting it gave up)', undefined, true));
    assert.deepEqual(gone.headers, { 'x-should-retry': 'false' });
    assert.equal(gone.message, 'The server cannot run this request: no worker is available (its one worker was lost, and restarting it gave up). '
      + 'No worker will come back without an operator.');
    // A frontend's workers register by themselves: neither promised nor ruled out.
    const unregistered = engineFailure(new EngineUnavailableError('no worker is available (none is registered and reachable under /conduit/workers/)', undefined, false));
    assert.deepEqual(unregistered.headers, {});
    assert.doesNotMatch(unregistered.message, /retry/i);
  });

  test('every engine error has its own name and a code', () => {
    const errors = [new InvalidRequestError('invalid_request', 'r', 'x'), new EngineClosedError('x'), new EngineOverloadedError('x', 0),
      new EngineUnavailableError('x', undefined, true), new WorkerLostError('w', 'x')];
    assert.equal(new Set(errors.map((e) => e.name)).size, errors.length);
    for (const error of errors) assert.equal(typeof (error as { code?: unknown }).code, 'string');
  });
});
