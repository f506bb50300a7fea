// Where each bar of a request's waterfall goes: a pure function from the request's JSON (GET
// /console/api/requests/<id>, whose phases are the trace view's) to rows of bars on a time axis, in pixels. The
// console page draws the result as SVG; tests import it directly (waterfall-layout.d.ts gives its types).
//
// One row per phase name, in the order the phases first start. Intervals of one phase that overlap (the prompts of
// one request prefilled side by side) get extra rows of their own, so no two bars of a row ever overlap; intervals
// that follow one another (prefill chunks, queue waits between them) share their row. The time axis runs from the
// request's arrival (0) to its end (total_ms); a bar's x and width are its start and duration on that axis, exact
// (the page widens a bar thinner than a pixel when drawing it, the layout does not).

/** Phases grouped for colour and for the legend. */
const GROUPS = {
  http_receive: 'gateway', auth: 'gateway', rate_limit: 'gateway', validate: 'gateway', tokenize: 'gateway',
  router_lookup: 'routing', prefill_dispatch: 'dispatch', decode_dispatch: 'dispatch', scheduler_queue: 'queue',
  prefill_execution: 'prefill', kv_transfer: 'kv_transfer', decode_execution: 'decode',
  streaming_response: 'streaming',
};

/** The group of a phase name ('other' for one this file does not know). */
export function phaseGroup(phase) {
  return Object.hasOwn(GROUPS, phase) ? GROUPS[phase] : 'other';
}

/** "1.50 ms", "12.3 ms", "1234 ms". */
export function formatMs(ms) {
  if (ms === null || ms === undefined || Number.isNaN(ms)) return '-';
  if (Math.abs(ms) >= 1000) return `${ms.toFixed(0)} ms`;
  if (Math.abs(ms) >= 10) return `${ms.toFixed(1)} ms`;
  return `${ms.toFixed(2)} ms`;
}

/** "512 B", "3.0 KiB", "1.2 MiB". */
export function formatBytes(n) {
  if (n >= 1 << 30) return `${(n / (1 << 30)).toFixed(2)} GiB`;
  if (n >= 1 << 20) return `${(n / (1 << 20)).toFixed(1)} MiB`;
  if (n >= 1 << 10) return `${(n / (1 << 10)).toFixed(1)} KiB`;
  return `${n} B`;
}

/** Axis ticks at 1, 2 or 5 x 10^k ms, about `count` of them from 0 to totalMs. */
export function timeTicks(totalMs, count = 6) {
  if (!(totalMs > 0)) return [0];
  const raw = totalMs / count;
  const power = 10 ** Math.floor(Math.log10(raw));
  const step = [1, 2, 5, 10].map((m) => m * power).find((s) => s >= raw) ?? 10 * power;
  const ticks = [];
  for (let i = 0; i * step <= totalMs * (1 + 1e-9) && i <= 1000; i++) ticks.push(i * step);
  return ticks;
}

/** The hover lines of one phase interval: its name, times, worker and attributes, in words where we know them. */
function phaseDetail(phase, view) {
  const lines = [phase.phase, `start ${formatMs(phase.start_ms)}, duration ${formatMs(phase.duration_ms)}`];
  if (phase.worker !== undefined) lines.push(`worker ${phase.worker}`);
  const a = phase.attributes ?? {};
  if (phase.phase === 'router_lookup' && view.routing) {
    const r = view.routing;
    lines.push(`chose ${r.worker}${r.prefill_worker ? ` (prefill on ${r.prefill_worker})` : ''} by ${r.strategy}`
      + `${r.candidates !== null && r.candidates !== undefined ? ` among ${r.candidates} candidates` : ''}`);
    if (r.overlap_tokens !== null && r.overlap_tokens !== undefined) lines.push(`cached prefix on it: ${r.overlap_tokens} tokens`);
    if (r.reason) lines.push(`reason: ${r.reason}`);
  } else if (phase.phase === 'prefill_execution') {
    if (a.chunk !== undefined) lines.push(`chunk ${a.chunk}`);
    if (a.tokens !== undefined) lines.push(`${a.tokens} prompt tokens computed`);
    if (a.batch_size !== undefined) lines.push(`batch: ${a.batch_size} sequences${a.batch_tokens !== undefined ? `, ${a.batch_tokens} tokens` : ''}`);
  } else if (phase.phase === 'kv_transfer') {
    if (a.bytes !== undefined) {
      const rate = phase.duration_ms > 0 ? `, ${formatBytes(Number(a.bytes) / (phase.duration_ms / 1000))}/s` : '';
      lines.push(`${formatBytes(Number(a.bytes))}${a.blocks !== undefined ? ` in ${a.blocks} blocks` : ''}${rate}`);
    }
    if (a.from_worker !== undefined) lines.push(`${a.from_worker} -> ${a.to_worker ?? '?'}`);
  } else if (phase.phase === 'decode_execution') {
    const tokens = view.usage ? view.usage.completion_tokens : undefined;
    if (a.steps !== undefined) lines.push(`${a.steps} steps${tokens !== undefined ? `, ${tokens} output tokens` : ''}`);
    if (a.batch_size_mean !== undefined) lines.push(`batch: ${a.batch_size_mean} sequences on average, at most ${a.batch_size_max}`);
    if (view.decode && view.decode.step_p50_ms !== null) lines.push(`step p50 ${formatMs(view.decode.step_p50_ms)}, max ${formatMs(view.decode.step_max_ms)}`);
    if (view.tbt && view.tbt.p50_ms !== null) lines.push(`between tokens p50 ${formatMs(view.tbt.p50_ms)}, p99 ${formatMs(view.tbt.p99_ms)}`);
  } else {
    for (const [k, v] of Object.entries(a)) lines.push(`${k}: ${v}`);
  }
  if (phase.incomplete) lines.push('cut short: the request ended inside it');
  return lines;
}

/** The row title of a phase's first row. */
function rowLabel(phase, view, bars) {
  if (phase === 'router_lookup' && view.routing) return `router_lookup -> ${view.routing.worker}`;
  if (phase === 'prefill_execution' && bars > 1) return `prefill_execution x${bars}`;
  if (phase === 'kv_transfer') {
    const bytes = view.phases.filter((p) => p.phase === 'kv_transfer').reduce((s, p) => s + Number(p.attributes?.bytes ?? 0), 0);
    return `kv_transfer ${formatBytes(bytes)}`;
  }
  return phase;
}

/**
 * The waterfall of one request.
 *
 * @param {import('./waterfall-layout').WaterfallView} view the request's JSON
 * @param {import('./waterfall-layout').WaterfallGeometry} geometry pixel sizes
 * @returns {import('./waterfall-layout').WaterfallLayout}
 */
export function layoutWaterfall(view, geometry) {
  const { width, labelWidth, rowHeight, top = 24, rightPad = 12 } = geometry;
  const phases = [...view.phases].sort((a, b) => a.start_ms - b.start_ms || a.duration_ms - b.duration_ms);
  const ends = phases.map((p) => p.start_ms + p.duration_ms);
  const totalMs = Math.max(view.total_ms ?? 0, ...ends, 0);
  const plotX0 = labelWidth;
  const plotX1 = Math.max(plotX0 + 1, width - rightPad);
  const scale = totalMs > 0 ? (plotX1 - plotX0) / totalMs : 0;
  const xOf = (ms) => plotX0 + Math.min(Math.max(ms, 0), totalMs) * scale;

  // Rows: per phase name, lanes so that bars of a lane never overlap (touching is not overlapping).
  const byPhase = new Map();
  for (const p of phases) {
    let lanes = byPhase.get(p.phase);
    if (!lanes) {
      lanes = [];
      byPhase.set(p.phase, lanes);
    }
    const endMs = p.start_ms + p.duration_ms;
    let lane = lanes.find((l) => l.endMs <= p.start_ms);
    if (!lane) {
      lane = { endMs: -Infinity, phases: [] };
      lanes.push(lane);
    }
    lane.phases.push(p);
    lane.endMs = Math.max(lane.endMs, endMs);
  }

  const rows = [];
  for (const [phase, lanes] of byPhase) {
    const count = lanes.reduce((s, l) => s + l.phases.length, 0);
    lanes.forEach((lane, i) => {
      const y = top + rows.length * rowHeight;
      rows.push({
        key: i === 0 ? phase : `${phase}#${i}`,
        phase,
        group: phaseGroup(phase),
        label: i === 0 ? rowLabel(phase, view, count) : '',
        y,
        bars: lane.phases.map((p) => {
          const x = xOf(p.start_ms);
          return {
            phase: p.phase, group: phaseGroup(p.phase), startMs: p.start_ms, endMs: p.start_ms + p.duration_ms,
            x, w: xOf(p.start_ms + p.duration_ms) - x, incomplete: p.incomplete === true, worker: p.worker,
            detail: phaseDetail(p, view),
          };
        }),
      });
    });
  }

  // Tokens as ticks on the decode row (or the streaming row when decode was not traced).
  const tokenRow = rows.find((r) => r.phase === 'decode_execution') ?? rows.find((r) => r.phase === 'streaming_response');
  const tokens = (view.token_times_ms ?? []).map((ms) => ({ ms, x: xOf(ms), y: tokenRow ? tokenRow.y : top }));

  const marks = [];
  const ttft = view.timings ? view.timings.ttft_ms : null;
  if (ttft !== null && ttft !== undefined) marks.push({ kind: 'first_token', ms: ttft, x: xOf(ttft), label: `first token ${formatMs(ttft)}` });
  const stride = view.token_times_stride ?? 1;
  for (const m of view.migrations ?? []) {
    // A migration is known by the tokens streamed before it: it happened after the last of them.
    const index = Math.floor((m.after_tokens - 1) / stride);
    const ms = index >= 0 && index < (view.token_times_ms ?? []).length ? view.token_times_ms[index] : undefined;
    marks.push({
      kind: 'migration', ms: ms ?? null, x: ms !== undefined ? xOf(ms) : null,
      label: `migrated ${m.from_worker} -> ${m.to_worker ?? '(none)'} after ${m.after_tokens} tokens (${m.reason})`,
    });
  }

  const height = top + rows.length * rowHeight + 8;
  return {
    totalMs, width, height, plotX0, plotX1, rowHeight,
    ticks: timeTicks(totalMs).map((ms) => ({ ms, x: xOf(ms), label: formatMs(ms) })),
    rows, tokens, marks,
  };
}
