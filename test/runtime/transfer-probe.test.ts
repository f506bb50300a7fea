// When the disaggregation policy tests a transfer-slower verdict with a transfer (TransferProbe): after a run of
// them, backing off while the verdict stands, starting over once the estimates favour moving the KV.

import { test } from 'node:test';
import assert from 'node:assert/strict';
import {
  decideDisaggregation, DEFAULT_TRANSFER_PROBE_INTERVAL, TRANSFER_PROBE_MAX_BACKOFF, TransferProbe, type DisaggregationInputs,
} from '../../src/runtime/disaggregation-policy.ts';

test('due after interval transfer-slower decisions; each probe doubles the wait up to the cap; a remote prefill resets it', () => {
  const probe = new TransferProbe(2);
  const slowerUntilDue = () => {
    let n = 0;
    while (!probe.due) {
      probe.record('transfer-slower');
      n++;
    }
    probe.record('transfer-probe');
    return n;
  };
  const waits = Array.from({ length: 8 }, slowerUntilDue);
  assert.deepEqual(waits, [2, 4, 8, 16, 32, 64, 64, 64]);
  assert.equal(64, 2 * TRANSFER_PROBE_MAX_BACKOFF);
  // Decisions for other reasons change nothing; a remote prefill starts over.
  for (const reason of ['short-prompt', 'prefill-queue-full', 'not-eligible', 'prefill-failed', 'transfer-failed'] as const) probe.record(reason);
  assert.deepEqual(probe.state, { streak: 0, wait: 64 });
  probe.record('transfer-slower');
  probe.record('remote-prefill');
  assert.deepEqual(probe.state, { streak: 0, wait: 2 });
  assert.equal(slowerUntilDue(), 2);
});

test('interval 0 is never due', () => {
  const probe = new TransferProbe(0);
  for (let i = 0; i < 100; i++) probe.record('transfer-slower');
  assert.equal(probe.due, false);
  assert.throws(() => new TransferProbe(-1), RangeError);
  assert.throws(() => new TransferProbe(1.5), RangeError);
});

test('the default interval is 8 transfer-slower decisions', () => {
  const probe = new TransferProbe(DEFAULT_TRANSFER_PROBE_INTERVAL);
  for (let i = 0; i < 7; i++) probe.record('transfer-slower');
  assert.equal(probe.due, false);
  probe.record('transfer-slower');
  assert.equal(probe.due, true);
});

test('a due probe turns only a transfer-slower verdict into a remote prefill (transfer-probe)', () => {
  const base: DisaggregationInputs = {
    numPromptTokens: 2048, blockSize: 16, decodeWorkerId: 'd0', decodeOverlapBlocks: 0,
    prefill: { workerId: 'p0', queuedPrefillTokens: 0 }, kvBytesPerToken: 131_072,
    transferBytesPerSec: 1e8, prefillTokensPerSec: 40_000, probeTransfer: true,
  };
  const probe = decideDisaggregation(base);
  assert.deepEqual([probe.mode, probe.reason, probe.prefillWorkerId], ['disaggregated', 'transfer-probe', 'p0']);
  assert.match(probe.detail, /^2048 uncached tokens on p0 to measure the link: 128 blocks estimated at ~2684\.555 ms to move >= ~51\.200 ms to prefill locally$/);
  assert.equal(decideDisaggregation({ ...base, probeTransfer: false }).reason, 'transfer-slower');
  // The estimates favour a transfer: an ordinary remote prefill, probe or not.
  assert.equal(decideDisaggregation({ ...base, transferBytesPerSec: 40e9 }).reason, 'remote-prefill');
  // Other reasons to stay local stand.
  assert.equal(decideDisaggregation({ ...base, numPromptTokens: 100 }).reason, 'short-prompt');
  assert.equal(decideDisaggregation({ ...base, prefill: null }).reason, 'prefill-queue-full');
  assert.equal(decideDisaggregation({ ...base, prefill: { workerId: 'p0', queuedPrefillTokens: 1e6 } }).reason, 'prefill-queue-full');
  assert.equal(decideDisaggregation({ ...base, ineligible: 'n = 2' }).reason, 'not-eligible');
});
