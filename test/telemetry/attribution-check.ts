// The attribution invariant, checked on one trace as GET /v1/requests/{id}/trace returns it: gateway + routing +
// queue + prefill (+ the KV transfer's part before the first token) = TTFT and TTFT + decode = total, within
// max(1 ms, 2%), and the phases tile the request from arrival to its end with no gap over 1 ms.

import assert from 'node:assert/strict';

/** The largest unattributed gap allowed between phases, ms. */
const MAX_GAP_MS = 1;

export interface TraceBody {
  request_id: string;
  timings: Record<string, number | boolean | null>;
  phases: { phase: string; start_ms: number; duration_ms: number; attributes?: Record<string, string | number | boolean> }[];
}

const tolerance = (ms: number) => Math.max(1, 0.02 * ms);

/** Problems with one trace's attribution (empty when every millisecond is accounted for). */
export function attributionProblems(trace: TraceBody): string[] {
  const t = trace.timings as Record<string, number>;
  const problems: string[] = [];
  const ttft = t.ttft_ms!;
  // A KV transfer counts towards TTFT only when it came before the first token: Conduit's prefill worker streams the
  // first token, so its transfer is decode's (within decode_ms).
  const kv = trace.phases.find((p) => p.phase === 'kv_transfer');
  const kvBeforeFirstToken = kv && kv.start_ms + kv.duration_ms <= ttft ? kv.duration_ms : 0;
  const parts = t.gateway_ms! + t.routing_ms! + t.queue_ms! + t.prefill_ms! + kvBeforeFirstToken;
  if (Math.abs(parts - ttft) > tolerance(ttft)) {
    problems.push(`gateway ${t.gateway_ms} + routing ${t.routing_ms} + queue ${t.queue_ms} + prefill ${t.prefill_ms}`
      + ` + kv_transfer ${kvBeforeFirstToken} = ${parts.toFixed(3)}, TTFT ${ttft}`);
  }
  if (Math.abs(ttft + t.decode_ms! - t.total_ms!) > tolerance(t.total_ms!)) {
    problems.push(`TTFT ${ttft} + decode ${t.decode_ms} = ${(ttft + t.decode_ms!).toFixed(3)}, total ${t.total_ms}`);
  }
  // The phases' union from arrival (0) to the end: each gap is time no phase owns.
  // A queue phase's budget_ms is the planning after it, up to the first forward pass (the budget allocation).
  const intervals = trace.phases.map((p) => [p.start_ms, p.start_ms + p.duration_ms + (Number(p.attributes?.budget_ms) || 0)] as const)
    .sort((a, b) => a[0] - b[0]);
  let coveredTo = 0;
  for (const [start, end] of intervals) {
    if (start - coveredTo > MAX_GAP_MS) problems.push(`no phase from ${coveredTo.toFixed(3)} to ${start.toFixed(3)} ms`);
    coveredTo = Math.max(coveredTo, end);
  }
  if (t.total_ms! - coveredTo > MAX_GAP_MS) problems.push(`no phase from ${coveredTo.toFixed(3)} ms to the end at ${t.total_ms} ms`);
  return problems;
}


/** Asserts every trace is attributed, listing each failing request with its problems and its phases. */
export function assertAttributed(traces: readonly TraceBody[]): void {
  const bad = traces.map((tr) => ({ id: tr.request_id, problems: attributionProblems(tr), phases: tr.phases.map((p) => `${p.phase}@${p.start_ms}+${p.duration_ms}`).join(' ') }))
    .filter((x) => x.problems.length > 0);
  assert.deepEqual(bad, [], 'every request\'s time is attributed to its phases');
}
