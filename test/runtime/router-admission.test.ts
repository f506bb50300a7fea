// The sending side of the router's admission queue: requests that waited for a free worker get it before requests
// that arrive after them.
import { describe, test } from 'node:test';
import assert from 'node:assert/strict';
import { Router } from '../../src/router/router.ts';
import { RouterAdmission, type Admitted } from '../../src/runtime/router-admission.ts';
import { seededRandom } from '../../src/util/random.ts';

describe('RouterAdmission', () => {
  test('a worker freed between two drains goes to the request queued for it, not to one that arrives first', async () => {
    const router = new Router({ blockSize: 4, random: seededRandom(1), busyNumWaiting: 1 });
    router.addWorker('a');
    const admission = new RouterAdmission(router, () => 0);
    const prompt = (seed: number) => ({ requestId: `q${seed}`, tokenIds: [seed, seed + 1, seed + 2, seed + 3, seed + 4] });
    try {
      // The first request's prompt is queued at the worker: busy until its first token.
      assert.equal((await admission.place(prompt(1))).decision.workerId, 'a');
      let queued: Admitted | undefined;
      const waiting = admission.place(prompt(2)).then((admitted) => (queued = admitted));
      waiting.catch(() => {});
      assert.equal(router.stats().numQueued, 1);
      router.onPrefillDone('q1');
      // A new request comes before the next drain: the one that waited is placed first, and the newcomer queues.
      let lateAdmitted: Admitted | undefined;
      admission.place(prompt(3)).then((admitted) => (lateAdmitted = admitted), () => {});
      await new Promise((resolve) => setImmediate(resolve));
      assert.equal(queued?.decision.workerId, 'a', 'the request that waited is placed');
      assert.equal(lateAdmitted, undefined, 'the newcomer waits in its turn');
      assert.equal(router.stats().numQueued, 1);
      assert.equal(router.stats().numActiveRequests, 2);
      await waiting;
    } finally {
      admission.close();
    }
  });
});
