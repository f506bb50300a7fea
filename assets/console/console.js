// The console's pages: /console (the cluster, refreshed by polling /console/api/overview) and
// /console/requests/<id> (one request's waterfall from /console/api/requests/<id>). Plain DOM and SVG; the time
// series are uPlot charts. Text from the server is always set as text, never parsed as HTML.

import { formatBytes, formatMs, layoutWaterfall, phaseGroup } from './waterfall-layout.js';

const KEY_STORAGE = 'conduit-console-key';
const app = document.getElementById('app');
const params = new URLSearchParams(location.search);
// ?refresh=<ms>: between half a second and an hour (a browser fires a longer timeout at once, so an unbounded value
// would poll without pause).
const REFRESH_MS = Math.min(3_600_000, Math.max(500, Number(params.get('refresh')) || 2000));

// ---- small helpers ----

function el(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) {
    if (v === undefined || v === null || v === false) continue;
    if (k === 'class') node.className = v;
    else if (k === 'text') node.textContent = v;
    else node.setAttribute(k, v === true ? '' : String(v));
  }
  for (const child of children.flat(Infinity)) {
    if (child === undefined || child === null || child === false) continue;
    node.append(child instanceof Node ? child : document.createTextNode(String(child)));
  }
  return node;
}

const SVG_NS = 'http://www.w3.org/2000/svg';
function svg(tag, attrs = {}, ...children) {
  const node = document.createElementNS(SVG_NS, tag);
  for (const [k, v] of Object.entries(attrs)) if (v !== undefined && v !== null) node.setAttribute(k, String(v));
  for (const child of children.flat(Infinity)) if (child) node.append(child instanceof Node ? child : document.createTextNode(String(child)));
  return node;
}

const num = (v, digits = 0) => (v === null || v === undefined || Number.isNaN(v) ? '-' : Number(v).toFixed(digits));
const pct = (v) => (v === null || v === undefined ? '-' : `${(v * 100).toFixed(1)}%`);
const td = (text, cls) => el('td', { class: cls, text: String(text) });
const tdNum = (text) => td(text, 'num');

/**
 * A data table: class "data" (console.css lets its text wrap to fit the panel), and each body cell labelled with its
 * column, which the narrow layout shows beside the value when rows become blocks.
 */
function dataTable(id, head, body) {
  const table = el('table', { id, class: 'data' }, head, body);
  const labels = [...table.tHead.rows[0].cells].map((cell) => cell.textContent);
  for (const row of table.tBodies[0].rows) {
    [...row.cells].forEach((cell, i) => {
      if (cell.colSpan === 1) cell.dataset.label = labels[i] ?? '';
    });
  }
  return table;
}

function setState(id, text, cls) {
  const node = document.getElementById(id);
  node.textContent = text;
  node.className = cls ?? 'muted';
}

// ---- API access ----

// A key travels in the Authorization header, which takes printable ASCII only (fetch throws on anything else).
const VALID_KEY = /^[\x21-\x7e]+$/;

function apiKey() {
  const key = sessionStorage.getItem(KEY_STORAGE) ?? '';
  return VALID_KEY.test(key) ? key : '';
}

class ApiError extends Error {
  constructor(status, body) {
    super(body?.error?.message ?? `HTTP ${status}`);
    this.status = status;
  }
}

async function getJson(path) {
  const key = apiKey();
  const response = await fetch(path, { headers: key ? { Authorization: `Bearer ${key}` } : {}, cache: 'no-store' });
  const body = await response.json().catch(() => null);
  if (!response.ok) throw new ApiError(response.status, body);
  return body;
}

/** Shows the key form after a 401/403; resolves when a key was entered. */
function askForKey(message) {
  const form = document.getElementById('key-form');
  form.hidden = false;
  document.getElementById('key-error').textContent = message;
  return new Promise((resolve) => {
    form.onsubmit = (event) => {
      event.preventDefault();
      const key = document.getElementById('key-input').value.trim();
      if (!VALID_KEY.test(key)) {
        document.getElementById('key-error').textContent = 'An API key is printable ASCII without spaces (check for pasted typographic dashes or quotes).';
        return;
      }
      sessionStorage.setItem(KEY_STORAGE, key);
      form.hidden = true;
      resolve();
    };
  });
}

async function load(path) {
  for (;;) {
    try {
      return await getJson(path);
    } catch (err) {
      if (err instanceof ApiError && (err.status === 401 || err.status === 403)) {
        // Until a key is given nothing is polled: the header must not go on showing the last answer as current.
        setState('server-state', `server answered ${err.status}: waiting for an API key`, 'bad');
        setState('refresh-state', `not updated: ${err.message}`, 'bad');
        await askForKey(err.message);
        setState('refresh-state', 'loading...');
        continue;
      }
      throw err;
    }
  }
}

// ---- tooltip ----

const tooltip = document.getElementById('tooltip');
function showTooltip(event, lines) {
  tooltip.textContent = lines.join('\n');
  tooltip.hidden = false;
  const x = Math.min(event.clientX + 14, window.innerWidth - tooltip.offsetWidth - 8);
  const y = Math.min(event.clientY + 14, window.innerHeight - tooltip.offsetHeight - 8);
  tooltip.style.left = `${Math.max(0, x)}px`;
  tooltip.style.top = `${Math.max(0, y)}px`;
}
function hideTooltip() {
  tooltip.hidden = true;
}

// ---- overview ----

const GROUP_COLORS = ['gateway', 'routing', 'dispatch', 'queue', 'prefill', 'kv_transfer', 'decode', 'streaming', 'other'];
const color = (group) => `var(--${GROUP_COLORS.includes(group) ? group : 'other'})`;

function sparkline(values) {
  const width = 90;
  const height = 18;
  if (values.length === 0) return el('span', { class: 'muted', text: '-' });
  const max = Math.max(1, ...values);
  const step = values.length > 1 ? width / (values.length - 1) : 0;
  const points = values.map((v, i) => `${(i * step).toFixed(1)},${(height - 1 - (v / max) * (height - 2)).toFixed(1)}`).join(' ');
  const line = svg('svg', { width, height, viewBox: `0 0 ${width} ${height}`, class: 'spark' },
    svg('polyline', { points, fill: 'none', stroke: 'var(--decode)', 'stroke-width': 1.5 }));
  return el('span', { title: `last ${values.length}: ${values.join(', ')}` }, line, ` ${num(values[values.length - 1], 1)}`);
}

function workersTable(workers) {
  const rows = workers.map((w) => {
    const used = w.kv_used_blocks;
    const total = w.kv_total_blocks;
    const share = total > 0 ? used / total : 0;
    const tokens = w.block_size ? ` (${used * w.block_size} / ${total * w.block_size} tokens)` : '';
    return el('tr', { 'data-worker': w.id },
      td(w.id, 'nowrap'), td(w.role), el('td', { class: w.state === 'idle' ? 'muted' : 'ok', text: w.state }),
      el('td', {}, el('span', { class: 'kvbar' }, el('span', { style: `width:${(share * 100).toFixed(1)}%` })), `${used} / ${total} blocks${tokens}`),
      tdNum(w.running), tdNum(w.waiting), tdNum(pct(w.prefix_cache_hit_rate)), tdNum(w.preemptions),
      memoryCell(w.memory_bytes), el('td', {}, sparkline(w.recent_batch_sizes)));
  });
  return dataTable('workers',
    el('thead', {}, el('tr', {}, ['worker', 'role', 'state', 'KV cache used', 'running', 'waiting', 'prefix hit rate', 'preemptions', 'memory', 'recent decode batch (seqs)']
      .map((h, i) => el('th', { class: i >= 4 && i <= 8 ? 'num' : undefined, text: h })))),
    el('tbody', {}, rows.length > 0 ? rows : [el('tr', {}, el('td', { colspan: 10, class: 'muted', text: 'no worker is serving' }))]));
}

/** A worker's memory (conduit_memory_used_bytes): the total, each category in the tooltip. */
function memoryCell(memory) {
  if (!memory) return tdNum('-');
  const parts = Object.entries(memory);
  const total = parts.reduce((sum, [, bytes]) => sum + bytes, 0);
  return el('td', { class: 'num', title: parts.map(([category, bytes]) => `${category} ${formatBytes(bytes)}`).join(', '), text: formatBytes(total) });
}

/** 0.99 as "99", 0.999 as "99.9": rounded to a whole number, p99.5 and p99.9 would both read p100. */
const percentileName = (q) => String(Number((q * 100).toFixed(2)));

function sloTable(slo) {
  const rows = slo.models.flatMap((m) => [
    ['TTFT', m.ttft], ['time between tokens', m.tbt],
  ].map(([name, r]) => el('tr', {},
    td(m.model, 'id'), td(name), tdNum(r.samples), tdNum(formatMs(r.p50_ms)), tdNum(formatMs(r.p99_ms)),
    tdNum(`${formatMs(r.target_ms)} / ${formatMs(r.warning_ms)}`), el('td', {}, el('span', { class: `badge ${r.status}`, text: r.status }))))
    .concat([el('tr', {}, td(m.model, 'id'), td('error rate'), tdNum(m.error_rate.requests), tdNum(''), tdNum(pct(m.error_rate.rate)),
      tdNum(`${pct(m.error_rate.target)} / ${pct(m.error_rate.warning)}`),
      el('td', {}, el('span', { class: `badge ${m.error_rate.status}`, text: m.error_rate.status })))]));
  return dataTable('slo',
    el('thead', {}, el('tr', {}, ['model', 'objective', 'samples', 'p50', `p${percentileName(slo.percentile)} / rate`, 'target / warning', 'status']
      .map((h, i) => el('th', { class: i >= 2 && i <= 5 ? 'num' : undefined, text: h })))),
    el('tbody', {}, rows.length > 0 ? rows : [el('tr', {}, el('td', { colspan: 7, class: 'muted', text: `no request in the last ${slo.window_ms / 1000} s` }))]));
}

function analysisPanel(analysis) {
  const shares = Object.entries(analysis.phase_share).filter(([, v]) => v > 0);
  // Widths relative to the parts' sum, so the bar stays whole whatever the shares add up to.
  const sum = shares.reduce((s, [, v]) => s + v, 0) || 1;
  const groupOf = { gateway: 'gateway', routing: 'routing', queue: 'queue', prefill: 'prefill', kv_transfer: 'kv_transfer', decode: 'decode', other: 'other' };
  return el('div', { id: 'analysis' },
    el('p', { class: 'finding' }, el('strong', { text: analysis.slow_requests > 0 ? analysis.primary_bottleneck : 'no slow requests' }),
      ` - ${analysis.slow_requests} slow of ${analysis.requests} requests in the last ${analysis.window_ms / 1000} s `
      + `(slow: TTFT >= ${analysis.slow_ttft_ms} ms or a token gap >= ${analysis.slow_tbt_ms} ms)`),
    el('p', { text: analysis.recommendation }),
    el('div', { class: 'sharebar', title: 'mean share of each request\'s time' },
      shares.map(([k, v]) => el('span', { style: `width:${((v / sum) * 100).toFixed(2)}%;background:${color(groupOf[k])}`, title: `${k} ${pct(v)}` }))),
    el('div', { class: 'legend' }, shares.map(([k, v]) => el('span', {}, el('i', { style: `background:${color(groupOf[k])}` }), `${k} ${pct(v)}`))));
}

function requestsTable(requests) {
  const rows = requests.map((r) => el('tr', {},
    el('td', { class: 'id' }, el('a', { href: `/console/requests/${encodeURIComponent(r.id)}`, text: r.id })),
    td(r.tenant ?? '-', 'id'), td(r.lora_adapter ? `${r.lora_adapter} (LoRA on ${r.model})` : r.model, 'id'), td(r.worker ?? '-', 'nowrap'), tdNum(r.prompt_tokens), tdNum(r.cached_tokens), tdNum(r.output_tokens),
    tdNum(formatMs(r.ttft_ms)), tdNum(formatMs(r.total_ms)),
    el('td', { class: r.outcome === 'ok' ? 'ok' : 'bad', text: r.outcome === 'ok' ? r.finish_reason : `${r.outcome}${r.status ? ` ${r.status}` : ''}` }),
    td(r.bottleneck ?? '-', 'id')));
  return dataTable('requests',
    el('thead', {}, el('tr', {}, ['request', 'tenant', 'model', 'worker', 'prompt', 'cached', 'output', 'TTFT', 'total', 'outcome', 'bottleneck']
      .map((h, i) => el('th', { class: i >= 4 && i <= 8 ? 'num' : undefined, text: h })))),
    el('tbody', {}, rows.length > 0 ? rows : [el('tr', {}, el('td', { colspan: 11, class: 'muted', text: 'no finished request yet' }))]));
}

const CHART_HEIGHT = 170;

/** The width a chart (or the waterfall) gets in its box: the box's content width (inside its padding). */
function contentWidth(box) {
  const style = getComputedStyle(box);
  return Math.max(1, Math.floor(box.clientWidth - parseFloat(style.paddingLeft) - parseFloat(style.paddingRight)));
}

/**
 * The three live charts; created once, their data replaced on each refresh. uPlot draws at the width it is given, so
 * each chart follows its box: a ResizeObserver sets its size whenever the box's width changes (the window resized,
 * the grid reflowed into more or fewer columns).
 */
class Charts {
  constructor(container) {
    this.container = container;
    this.plots = [];
    this.boxes = [];
    this.observer = typeof ResizeObserver === 'undefined' ? undefined : new ResizeObserver((entries) => {
      for (const entry of entries) {
        const plot = this.plots[this.boxes.indexOf(entry.target)];
        const width = contentWidth(entry.target);
        if (plot && plot.width !== width) plot.setSize({ width, height: CHART_HEIGHT });
      }
    });
  }

  /** Removes the plots (and the window listeners uPlot keeps for them). */
  destroy() {
    this.observer?.disconnect();
    for (const plot of this.plots) plot.destroy();
    this.plots = [];
    this.boxes = [];
  }

  update(series) {
    const t = series.t;
    const sets = [
      { id: 'chart-ttft', title: 'TTFT (ms)', data: [t, series.ttft_p50_ms, series.ttft_p99_ms], labels: ['p50', 'p99'], colors: ['#2f6feb', '#cf222e'] },
      { id: 'chart-itl', title: 'Time between tokens (ms)', data: [t, series.itl_p50_ms, series.itl_p99_ms], labels: ['p50', 'p99'], colors: ['#2da44e', '#cf222e'] },
      { id: 'chart-throughput', title: 'Throughput', data: [t, series.output_tokens_per_s, series.requests_per_s], labels: ['output tokens/s', 'requests/s'], colors: ['#8250df', '#e5883b'], twoScales: true },
    ];
    if (typeof uPlot === 'undefined') return;
    if (this.plots.length === 0) {
      // Every box first, so the grid has its columns when the charts measure their width.
      const boxes = sets.map((set) => {
        const box = el('div', { class: 'panel chart', id: set.id }, el('div', { class: 'muted', text: set.title }));
        this.container.append(box);
        return box;
      });
      sets.forEach((set, i) => {
        const box = boxes[i];
        const opts = {
          width: contentWidth(box), height: CHART_HEIGHT, legend: { live: true },
          scales: { x: { time: true }, ...(set.twoScales ? { r: { auto: true } } : {}) },
          series: [{}, ...set.labels.map((label, j) => ({
            label, stroke: set.colors[j], width: 1.5, spanGaps: false,
            // A lone bucket between empty ones has no line to draw: show its point.
            points: { show: true, size: 4, fill: set.colors[j] },
            ...(set.twoScales && j === 1 ? { scale: 'r' } : {}),
          }))],
          axes: [{}, { size: 50 }, ...(set.twoScales ? [{ scale: 'r', side: 1, grid: { show: false }, size: 40 }] : [])],
        };
        // eslint-disable-next-line no-undef
        this.plots.push(new uPlot(opts, set.data, box));
        this.boxes.push(box);
        this.observer?.observe(box);
      });
    } else {
      sets.forEach((set, i) => this.plots[i].setData(set.data));
    }
  }
}

async function overviewPage() {
  let charts;
  let timer;
  const render = (data) => {
    if (data.scope === 'all') {
      const h = data.health ?? {};
      setState('server-state', `${h.model ?? ''} - ${h.status ?? '?'} - ${data.in_flight} in flight`, h.ready ? 'ok' : 'bad');
      if (!charts) {
        app.textContent = '';
        const chartsBox = el('div', { class: 'grid', id: 'charts' });
        app.append(
          el('h2', { text: 'Workers' }), el('div', { class: 'panel', id: 'workers-box' }),
          el('h2', { text: 'Last minutes' }), chartsBox,
          // Full width each: the SLO table's seven columns do not fit half the page.
          el('h2', { text: 'SLO (per tier: target / warning)' }), el('div', { class: 'panel', id: 'slo-box' }),
          el('h2', { text: 'Analyzer' }), el('div', { class: 'panel', id: 'analysis-box' }),
          el('h2', { text: 'Recent requests' }), el('div', { class: 'panel', id: 'requests-box' }));
        charts = new Charts(chartsBox);
      }
      document.getElementById('workers-box').replaceChildren(workersTable(data.workers));
      document.getElementById('slo-box').replaceChildren(sloTable(data.slo));
      document.getElementById('analysis-box').replaceChildren(analysisPanel(data.analysis));
      charts.update(data.series);
    } else {
      setState('server-state', `tenant ${data.tenant}: your requests only`);
      // Built for the whole cluster before (another key, or the server restarted with keys): rebuilt for the tenant.
      if (charts || !document.getElementById('requests-box')) {
        charts?.destroy();
        charts = undefined;
        app.textContent = '';
        app.append(el('h2', { text: 'Your recent requests' }), el('div', { class: 'panel', id: 'requests-box' }));
      }
    }
    document.getElementById('requests-box').replaceChildren(requestsTable(data.requests));
  };
  const tick = async () => {
    if (!document.hidden) {
      try {
        render(await load('/console/api/overview'));
        setState('refresh-state', `updated ${new Date().toLocaleTimeString()} (every ${REFRESH_MS / 1000} s)`);
      } catch (err) {
        // The panels below show the last answer: the header must not go on saying the server is ready.
        setState('server-state', err instanceof ApiError ? `server answered ${err.status}` : 'server not reachable', 'bad');
        setState('refresh-state', `not updated: ${err.message}`, 'bad');
      }
    }
    timer = setTimeout(tick, REFRESH_MS);
  };
  await tick();
  return () => clearTimeout(timer);
}

// ---- one request ----

/**
 * The width the waterfall is laid out at: the page's content width (the SVG is as wide, so one unit of its viewBox is
 * one pixel and its text keeps its size), but at least 640 px, below which its rows would have no room for bars (a
 * narrower window scales that drawing down).
 */
function waterfallWidth() {
  return Math.max(640, contentWidth(app));
}

function drawWaterfall(view, width = waterfallWidth()) {
  const layout = layoutWaterfall(view, { width, labelWidth: 230, rowHeight: 24, top: 26 });
  const barHeight = layout.rowHeight - 8;
  const root = svg('svg', { id: 'waterfall', width: layout.width, height: layout.height, viewBox: `0 0 ${layout.width} ${layout.height}`, role: 'img', 'aria-label': `waterfall of ${view.request_id}` });
  const axis = svg('g', { class: 'axis' });
  for (const tick of layout.ticks) {
    axis.append(svg('line', { x1: tick.x, x2: tick.x, y1: 16, y2: layout.height - 4 }),
      svg('text', { x: tick.x, y: 12, 'text-anchor': 'middle' }, tick.label));
  }
  root.append(axis);
  for (const row of layout.rows) {
    const g = svg('g', { class: 'row', 'data-phase': row.phase });
    if (row.label) g.append(svg('text', { x: 6, y: row.y + barHeight - 3 }, row.label));
    for (const bar of row.bars) {
      const rect = svg('rect', {
        class: 'bar', 'data-phase': bar.phase, x: bar.x, y: row.y, width: Math.max(1, bar.w), height: barHeight, rx: 2,
        fill: color(bar.group), 'fill-opacity': bar.incomplete ? 0.45 : 0.9,
      }, svg('title', {}, bar.detail.join('\n')));
      rect.addEventListener('mousemove', (event) => showTooltip(event, bar.detail));
      rect.addEventListener('mouseleave', hideTooltip);
      g.append(rect);
    }
    root.append(g);
  }
  if (layout.tokens.length > 0) {
    const d = layout.tokens.map((t) => `M${t.x.toFixed(1)} ${t.y + barHeight + 1}v3`).join('');
    root.append(svg('path', { class: 'tokens', d }, svg('title', {}, `${view.usage.completion_tokens} tokens written (one tick per write)`)));
  }
  for (const mark of layout.marks) {
    if (mark.x === null) continue;
    root.append(svg('g', { class: 'mark', 'data-kind': mark.kind },
      svg('line', { x1: mark.x, x2: mark.x, y1: 16, y2: layout.height - 4 }),
      svg('text', { x: mark.x + 3, y: layout.height - 6 }, mark.label)));
  }
  return root;
}

/**
 * Draws the waterfall again whenever the width it would be laid out at changes (the window narrowed or widened):
 * its bars, ticks and labels are placed in pixels of the width it was drawn at, and the SVG only scaled to a new
 * width would squeeze or stretch them, text included. At most once per frame; stops when the page leaves it.
 */
function redrawOnResize(view) {
  if (typeof ResizeObserver === 'undefined') return;
  let drawnWidth = waterfallWidth();
  let frame = 0;
  const observer = new ResizeObserver(() => {
    cancelAnimationFrame(frame);
    frame = requestAnimationFrame(() => {
      const current = document.getElementById('waterfall');
      if (!current) {
        observer.disconnect();
        return;
      }
      const width = waterfallWidth();
      if (width === drawnWidth) return;
      drawnWidth = width;
      hideTooltip();
      current.replaceWith(drawWaterfall(view, width));
    });
  });
  observer.observe(app);
}

/** What a diagnosis' dominant_share is a share of. */
const SHARE_OF = { ttft: ' of TTFT', request: ' of the request', decode_steps: ' of the decode steps\' time' };

function facts(pairs) {
  return el('dl', { class: 'facts' }, pairs.filter(([, v]) => v !== undefined && v !== null && v !== '').map(([k, v]) => [el('dt', { text: k }), el('dd', { text: String(v) })]));
}

async function requestPage(id) {
  setState('server-state', `request ${id}`);
  let view;
  try {
    view = await load(`/console/api/requests/${encodeURIComponent(id)}`);
    setState('server-state', `request ${id}`);
  } catch (err) {
    app.replaceChildren(el('p', { class: 'bad', text: err.message }), el('p', {}, el('a', { href: '/console', text: 'back to the console' })));
    return;
  }
  const t = view.timings;
  const a = view.analysis;
  const r = view.routing;
  const outcome = view.outcome === 'ok' ? `ok (${view.finish_reason})` : `${view.outcome}${view.error_type ? ` ${view.error_type}` : ''}${view.status ? ` ${view.status}` : ''} in ${view.ended_in_phase ?? '?'}`;
  const groups = [...new Set(view.phases.map((p) => phaseGroup(p.phase)))];
  const phaseRows = view.phases.map((p) => el('tr', {}, td(p.phase, 'id'), tdNum(formatMs(p.start_ms)), tdNum(formatMs(p.duration_ms)), td(p.worker ?? ''),
    td(Object.entries(p.attributes ?? {}).map(([k, v]) => `${k}=${v}`).join(' '), 'id')));
  app.replaceChildren(
    el('p', {}, el('a', { href: '/console', text: '< console' })),
    el('h2', { text: `Request ${view.request_id}` }),
    el('div', { class: 'grid' },
      el('div', { class: 'panel' }, facts([
        ['model', view.model], ['LoRA adapter', view.lora_adapter], ['tenant', view.tenant], ['worker', view.worker], ['outcome', outcome],
        ['TTFT', formatMs(t.ttft_ms)], ['total', formatMs(t.total_ms)],
        ['tokens', `${view.usage.prompt_tokens} prompt (${view.usage.cached_tokens} cached), ${view.usage.completion_tokens} output`],
        ['time between tokens', view.tbt.count > 0 ? `p50 ${formatMs(view.tbt.p50_ms)}, p99 ${formatMs(view.tbt.p99_ms)}, max ${formatMs(view.tbt.max_ms)}` : undefined],
        ['routing', r ? `${r.strategy}: ${r.worker}${r.prefill_worker ? ` (prefill on ${r.prefill_worker})` : ''}${r.candidates !== null ? ` of ${r.candidates} candidates` : ''}${r.overlap_tokens !== null ? `, ${r.overlap_tokens} tokens cached there` : ''}` : undefined],
        ['migrations', view.migrations.length > 0 ? view.migrations.map((m) => `${m.from_worker} -> ${m.to_worker ?? '(none)'} after ${m.after_tokens} tokens`).join('; ') : undefined],
        ['trace id', view.trace_id],
      ])),
      el('div', { class: 'panel', id: 'diagnosis' },
        el('p', { class: 'finding' }, el('strong', { text: a.category }), a.dominant_phase !== 'none' ? ` - ${a.dominant_phase} ${formatMs(a.dominant_ms)} (${pct(a.dominant_share)}${SHARE_OF[a.dominant_share_of] ?? ''})` : ''),
        el('p', { text: a.recommendation }),
        facts(Object.entries(a.breakdown_ms).map(([k, v]) => [k, formatMs(v)])))),
    el('h2', { text: 'Waterfall' }),
    el('div', { class: 'legend' }, groups.map((g) => el('span', {}, el('i', { style: `background:${color(g)}` }), g))),
    drawWaterfall(view),
    el('h2', { text: 'Phases' }),
    el('div', { class: 'panel' }, dataTable('phases',
      el('thead', {}, el('tr', {}, ['phase', 'start', 'duration', 'worker', 'details'].map((h, i) => el('th', { class: i === 1 || i === 2 ? 'num' : undefined, text: h })))),
      el('tbody', {}, phaseRows))));
  redrawOnResize(view);
}

// ---- entry ----

const match = /^\/console\/requests\/([^/]+)$/.exec(location.pathname);
if (match) {
  let id;
  try {
    id = decodeURIComponent(match[1]);
  } catch {
    id = undefined;
  }
  if (id === undefined) {
    app.replaceChildren(el('p', { class: 'bad', text: `${match[1]} is not a request id (a malformed escape)` }),
      el('p', {}, el('a', { href: '/console', text: 'back to the console' })));
  } else {
    await requestPage(id);
  }
} else {
  await overviewPage();
}
document.body.dataset.ready = 'true';
