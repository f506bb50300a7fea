// Times that cross between a frontend and a worker process. Each process stamps with its own engine clock
// (engine/clock.ts), and two machines' clocks differ by an unknown offset, so a worker's stamps cannot be put on the
// frontend's timeline as they are. The frontend sends its clock's reading with every request (`sentAt`); each such
// frame gives the worker a lower bound of the offset (frontend time = worker time + offset): sentAt minus the
// worker's clock at receipt, short of the true offset by the frame's one-way delay. The worker keeps, per
// connection, the largest bound so far (the frame that travelled fastest), and fixes a request's offset at its
// receipt. The receipt then never lands before the send, the remaining error (the fastest frame's delay) counts as
// queue time, where it belongs (the request was on its way to the worker's queue), and requests on one connection
// share one offset once the estimate has settled, so their times compare with each other too. Absolute times
// coming in (the request's arrival and deadline, a handoff's timestamps) are moved onto the worker's clock, and
// those going out (every output's timestamps and step, a handoff, an adoption's transfer) back onto the frontend's.
// What the worker measured keeps its durations, whatever the clocks, and a time that goes in and comes back out is
// unchanged.

import type { AdoptedResult, KvHandoff } from '../engine/handoff.ts';
import type { EngineOutput, EngineRequest, RequestTimestamps } from '../engine/types.ts';

/**
 * The offset estimate after a frame sent at `sentAt` (frontend clock) arrived at `receivedAt` (worker clock): the
 * larger of the estimate so far and this frame's bound. Unchanged when the frame carried no send time.
 */
export function tightenClockOffset(estimate: number | undefined, sentAt: unknown, receivedAt: number): number | undefined {
  if (typeof sentAt !== 'number' || !Number.isFinite(sentAt)) return estimate;
  const bound = sentAt - receivedAt;
  return estimate === undefined ? bound : Math.max(estimate, bound);
}

export function shiftTimestamps(ts: RequestTimestamps, delta: number): RequestTimestamps {
  if (delta === 0) return ts;
  const at = (t: number | undefined) => (t === undefined ? undefined : t + delta);
  const out: RequestTimestamps = { ...ts, arrival: ts.arrival + delta, prefillChunks: ts.prefillChunks.map((c) => ({ ...c, start: c.start + delta, end: c.end + delta })) };
  for (const key of ['queued', 'firstScheduled', 'firstToken', 'lastToken', 'finished'] as const) {
    if (ts[key] !== undefined) out[key] = at(ts[key]);
  }
  if (ts.kvTransfer) out.kvTransfer = { ...ts.kvTransfer, start: ts.kvTransfer.start + delta, end: ts.kvTransfer.end + delta };
  if (ts.budget) out.budget = { ...ts.budget, forwardStart: ts.budget.forwardStart + delta };
  return out;
}

export function shiftRequest(request: EngineRequest, delta: number): EngineRequest {
  if (delta === 0) return request;
  return {
    ...request, arrivalMs: request.arrivalMs + delta,
    ...(request.deadlineMs !== undefined ? { deadlineMs: request.deadlineMs + delta } : {}),
  };
}

export function shiftOutput(output: EngineOutput, delta: number): EngineOutput {
  if (delta === 0) return output;
  return {
    ...output, timestamps: shiftTimestamps(output.timestamps, delta),
    ...(output.step ? { step: { ...output.step, start: output.step.start + delta, end: output.step.end + delta } } : {}),
  };
}

export function shiftHandoff(handoff: KvHandoff, delta: number): KvHandoff {
  if (delta === 0) return handoff;
  return {
    ...handoff, request: shiftRequest(handoff.request, delta), timestamps: shiftTimestamps(handoff.timestamps, delta),
    createdMs: handoff.createdMs + delta,
  };
}

export function shiftAdopted(result: AdoptedResult, delta: number): AdoptedResult {
  if (delta === 0 || !result.transfer) return result;
  return { ...result, transfer: { ...result.transfer, startMs: result.transfer.startMs + delta, endMs: result.transfer.endMs + delta } };
}
