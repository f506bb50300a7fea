// deploy/: the Prometheus alert rules pass `promtool check rules` and their unit tests, the Grafana dashboards are
// well-formed with valid PromQL, every metric name either one uses is one src/telemetry/metrics.ts registers, and
// every label they use is one of those metrics' labels.
import { describe, it } from 'node:test';
import assert from 'node:assert/strict';
import { mkdtempSync, readdirSync, readFileSync, rmSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { fileURLToPath } from 'node:url';
import { GatewayMetrics } from '../../src/api/gateway-metrics.ts';
import { ConduitMetrics } from '../../src/telemetry/metrics.ts';
import { SloTracker } from '../../src/telemetry/slo.ts';
import { PROMTOOL_MISSING, havePromtool, promtool } from './promtool.ts';

const deploy = fileURLToPath(new URL('../../deploy/', import.meta.url));
const rulesDir = join(deploy, 'prometheus');
const dashboardsDir = join(deploy, 'grafana');
const configFile = join(rulesDir, 'prometheus.yml');
const ruleFiles = readdirSync(rulesDir).filter((f) => f.endsWith('.yml') && !f.endsWith('.test.yml') && f !== 'prometheus.yml').map((f) => join(rulesDir, f));
const ruleTestFiles = readdirSync(rulesDir).filter((f) => f.endsWith('.test.yml')).map((f) => join(rulesDir, f));
const dashboardFiles = readdirSync(dashboardsDir).filter((f) => f.endsWith('.json')).map((f) => join(dashboardsDir, f));

// ---------------------------------------------------------------------------------------------------------------
// Reading the files

interface Dashboard {
  uid: string;
  title: string;
  panels: {
    id: number; type: string; title: string; gridPos: { h: number; w: number; x: number; y: number }; datasource?: unknown;
    targets?: { refId: string; expr: string; legendFormat?: string }[];
    fieldConfig?: { defaults?: { unit?: string }; overrides?: { matcher: { id: string; options: unknown }; properties: { id: string; value: unknown }[] }[] };
  }[];
  templating: { list: { name: string; type: string; query?: unknown; definition?: string }[] };
}

const dashboards = dashboardFiles.map((f) => ({ file: f, json: JSON.parse(readFileSync(f, 'utf8')) as Dashboard }));

/** PromQL of a dashboard: panel targets and template variable queries. */
function dashboardExpressions(d: Dashboard): string[] {
  const out: string[] = [];
  for (const p of d.panels) for (const t of p.targets ?? []) out.push(t.expr);
  for (const v of d.templating.list) if (v.definition) out.push(v.definition);
  return out;
}

/** The `expr:` values of a rules file, inline or as a block scalar (the only YAML shapes the rules use). */
function ruleExpressions(yaml: string): string[] {
  const lines = yaml.split('\n');
  const out: string[] = [];
  for (let i = 0; i < lines.length; i++) {
    const m = /^(\s*)(?:- )?expr:\s*(.*)$/.exec(lines[i]!);
    if (!m) continue;
    const indent = m[1]!.length;
    const rest = m[2]!.trim();
    if (/^[|>][-+]?$/.test(rest)) {
      const block: string[] = [];
      while (i + 1 < lines.length && (lines[i + 1]!.trim() === '' || lines[i + 1]!.search(/\S/) > indent)) block.push(lines[++i]!.trim());
      out.push(block.join(' ').trim());
    } else {
      out.push(rest.replace(/^['"]|['"]$/g, ''));
    }
  }
  return out;
}

/** Metric names of the input series of a rules test file. */
function testSeriesNames(yaml: string): string[] {
  return [...yaml.matchAll(/series:\s*'([a-zA-Z_:][a-zA-Z0-9_:]*)/g)].map((m) => m[1]!);
}

function conduitNames(expr: string): string[] {
  return [...expr.matchAll(/\bconduit_[a-zA-Z0-9_:]*/g)].map((m) => m[0]);
}

/** Every series name the registry exposes: histograms as _bucket, _sum and _count. */
function registeredSeries(): { families: Set<string>; series: Map<string, string> } {
  const slo = new SloTracker();
  const metrics = new ConduitMetrics({ sloReport: () => slo.report(0), spanExports: () => ({ succeeded: 0, failed: 0 }) });
  new GatewayMetrics(metrics.registry); // the gateway's families are on the same /metrics
  const families = new Set<string>();
  const series = new Map<string, string>();
  for (const { name, type } of metrics.families()) {
    families.add(name);
    if (type === 'histogram') for (const suffix of ['_bucket', '_sum', '_count']) series.set(name + suffix, name);
    else series.set(name, name);
  }
  return { families, series };
}

/**
 * The label names of every family /metrics exports (the telemetry's and the gateway's, one registry), by the series
 * names a query uses: a histogram's _bucket series has `le` too.
 */
function exportedLabels(): Map<string, Set<string>> {
  const slo = new SloTracker();
  const metrics = new ConduitMetrics({ sloReport: () => slo.report(0), spanExports: () => ({ succeeded: 0, failed: 0 }) });
  new GatewayMetrics(metrics.registry);
  const labels = new Map<string, Set<string>>();
  for (const metric of metrics.registry.getMetricsAsArray()) {
    const names = new Set((metric as unknown as { labelNames: readonly string[] }).labelNames);
    if (String(metric.type) === 'histogram') {
      labels.set(`${metric.name}_bucket`, new Set([...names, 'le']));
      labels.set(`${metric.name}_sum`, names);
      labels.set(`${metric.name}_count`, names);
    } else {
      labels.set(metric.name, names);
    }
  }
  return labels;
}

/** Label names a PromQL expression matches on or groups by. */
function labelsUsed(expr: string): string[] {
  const used: string[] = [];
  for (const [, selector] of expr.matchAll(/\{([^}]*)\}/g)) for (const [, name] of selector!.matchAll(/([a-zA-Z_]\w*)\s*(?:=~|!~|!=|=)/g)) used.push(name!);
  for (const [, list] of expr.matchAll(/\b(?:by|without)\s*\(([^)]*)\)/g)) used.push(...list!.split(',').map((l) => l.trim()).filter((l) => l !== ''));
  return used;
}

// ---------------------------------------------------------------------------------------------------------------

describe('Prometheus rules', () => {
  it('exist, with a unit test file', () => {
    assert.ok(ruleFiles.length >= 1);
    assert.ok(ruleTestFiles.length >= 1);
  });

  it('pass promtool check rules', (t) => {
    if (!havePromtool()) return t.skip(PROMTOOL_MISSING);
    const { status, output } = promtool(['check', 'rules', ...ruleFiles]);
    assert.equal(status, 0, output);
    assert.match(output, /SUCCESS/);
  });

  it('load from the example Prometheus configuration (promtool check config)', (t) => {
    if (!havePromtool()) return t.skip(PROMTOOL_MISSING);
    const { status, output } = promtool(['check', 'config', configFile]);
    assert.equal(status, 0, output);
    assert.match(output, /SUCCESS: 1 rule files found/);
  });

  it('pass their promtool unit tests, which fire every alert', (t) => {
    const alerts = ruleFiles.flatMap((f) => [...readFileSync(f, 'utf8').matchAll(/^\s*- alert:\s*(\S+)/gm)].map((m) => m[1]!));
    const tested = new Set(ruleTestFiles.flatMap((f) => [...readFileSync(f, 'utf8').matchAll(/alertname:\s*(\S+)\n\s*exp_alerts:\s*\n\s*- exp_labels/g)].map((m) => m[1]!)));
    assert.deepEqual(alerts.filter((a) => !tested.has(a)), [], 'alerts without a test that expects them to fire');
    if (!havePromtool()) return t.skip(PROMTOOL_MISSING);
    for (const file of ruleTestFiles) {
      const { status, output } = promtool(['test', 'rules', file]);
      assert.equal(status, 0, output);
    }
  });
});

describe('Grafana dashboards', () => {
  it('are the overview, worker and cache dashboards, well formed', () => {
    assert.deepEqual(dashboards.map((d) => d.json.uid).sort(), ['conduit-cache', 'conduit-overview', 'conduit-worker']);
    for (const { file, json } of dashboards) {
      assert.ok(json.title && json.panels.length > 0, file);
      const ids = json.panels.map((p) => p.id);
      assert.equal(new Set(ids).size, ids.length, `${file}: panel ids are unique`);
      for (const p of json.panels) {
        assert.ok(p.gridPos.x + p.gridPos.w <= 24, `${file}: ${p.title} fits the 24-column grid`);
        if (p.type === 'row') continue;
        assert.ok(p.datasource, `${file}: ${p.title} names a data source`);
        const refIds = (p.targets ?? []).map((t) => t.refId);
        assert.ok(refIds.length > 0, `${file}: ${p.title} has queries`);
        assert.equal(new Set(refIds).size, refIds.length, `${file}: ${p.title} refIds unique`);
      }
      const vars = new Set(json.templating.list.map((v) => v.name));
      for (const expr of dashboardExpressions(json)) {
        for (const [, name] of expr.matchAll(/\$([a-z_]+)/g)) {
          if (!name!.startsWith('__')) assert.ok(vars.has(name!), `${file}: $${name} is a template variable`);
        }
      }
    }
    const overview = dashboards.find((d) => d.json.uid === 'conduit-overview')!.json;
    const text = JSON.stringify(overview);
    for (const q of ['0.5', '0.95', '0.99']) assert.ok(text.includes(`histogram_quantile(${q}, sum by (le) (rate(conduit_time_to_first_token_milliseconds_bucket`));
    // Mean time per phase: auth and the rate-limit precheck run inside http_receive, so the gateway's time is
    // receive + validate + tokenize, never the sum over every gateway phase.
    const perPhase = overview.panels.find((p) => p.title === 'Mean time per phase')!;
    const gateway = perPhase.targets!.find((t) => t.legendFormat === 'gateway')!.expr;
    assert.match(gateway, /conduit_gateway_phase_duration_milliseconds_sum\{phase=~"http_receive\|validate\|tokenize"\}/);
  });

  it('show each query in the unit of what it computes: time for a rate of a milliseconds counter, not bytes', () => {
    type Panel = Dashboard['panels'][number];
    /** The unit Grafana shows a query's series in: an override for its refId, else the panel's. */
    const unitOf = (panel: Panel, refId: string): string | undefined => {
      for (const o of panel.fieldConfig?.overrides ?? []) {
        if (o.matcher.id !== 'byFrameRefID' || o.matcher.options !== refId) continue;
        const unit = o.properties.find((p) => p.id === 'unit');
        if (unit) return String(unit.value);
      }
      return panel.fieldConfig?.defaults?.unit;
    };
    const checked: string[] = [];
    for (const { file, json } of dashboards) {
      for (const panel of json.panels) {
        for (const target of panel.targets ?? []) {
          const names = conduitNames(target.expr);
          const where = `${file}: ${panel.title} ${target.refId} (${target.expr})`;
          // rate() of a counter of milliseconds: milliseconds spent per second.
          if (names.length > 0 && names.every((n) => n.endsWith('_milliseconds_total'))) {
            checked.push(where);
            assert.ok(['ms', 's'].includes(unitOf(panel, target.refId) ?? ''), `${where}: shown as ${unitOf(panel, target.refId)}`);
          }
          if (names.length > 0 && names.every((n) => n.endsWith('_bytes_total')) && /\brate\(/.test(target.expr)) {
            assert.equal(unitOf(panel, target.refId), 'Bps', where);
          }
        }
      }
    }
    assert.ok(checked.length >= 2, 'the offload and onboard time series are found');
  });

  it('hold valid PromQL (checked by promtool as recording rules)', (t) => {
    if (!havePromtool()) return t.skip(PROMTOOL_MISSING);
    const dir = mkdtempSync(join(tmpdir(), 'conduit-dash-'));
    try {
      const rules = dashboards.flatMap(({ json }) => dashboardExpressions(json).filter((e) => !e.startsWith('label_values(')))
        .map((expr, i) => {
          const concrete = expr.replace(/\$__rate_interval/g, '5m').replace(/\$[a-z_]+/g, '.*');
          return `      - record: dashboard:expr_${i}\n        expr: ${JSON.stringify(concrete)}`;
        });
      const file = join(dir, 'dashboards.rules.yml');
      writeFileSync(file, `groups:\n  - name: dashboards\n    rules:\n${rules.join('\n')}\n`);
      const { status, output } = promtool(['check', 'rules', file]);
      assert.equal(status, 0, output);
    } finally {
      rmSync(dir, { recursive: true, force: true });
    }
  });
});

describe('metric names in deploy/', () => {
  const { families, series } = registeredSeries();

  it('are all registered by the metrics module or the gateway (histograms by their _bucket/_sum/_count series)', () => {
    const used = new Map<string, string>();
    for (const { file, json } of dashboards) for (const e of dashboardExpressions(json)) for (const n of conduitNames(e)) used.set(n, file);
    for (const f of ruleFiles) for (const e of ruleExpressions(readFileSync(f, 'utf8'))) for (const n of conduitNames(e)) used.set(n, f);
    for (const f of ruleTestFiles) for (const n of testSeriesNames(readFileSync(f, 'utf8'))) used.set(n, f);
    assert.ok(used.size > 20, `found ${used.size} names`);
    const unknown = [...used].filter(([name]) => !series.has(name)).map(([name, file]) => `${name} (${file})`);
    assert.deepEqual(unknown, []);
  });

  it('cover every family the metrics module and the gateway register in some dashboard', () => {
    const inDashboards = new Set<string>();
    for (const { json } of dashboards) for (const e of dashboardExpressions(json)) for (const n of conduitNames(e)) if (series.has(n)) inDashboards.add(series.get(n)!);
    assert.deepEqual([...families].filter((f) => !inDashboards.has(f)), []);
  });

  it('match, group and name series only by labels those metrics have', () => {
    const labels = exportedLabels();
    const problems: string[] = [];
    const check = (where: string, expr: string, shown: string[]): void => {
      const names = conduitNames(expr);
      const known = new Set(names.flatMap((n) => [...(labels.get(n) ?? [])]));
      for (const label of [...labelsUsed(expr), ...shown]) if (!known.has(label)) problems.push(`${where}: ${label} (${expr})`);
    };
    for (const { file, json } of dashboards) {
      for (const panel of json.panels) {
        for (const target of panel.targets ?? []) {
          check(`${file}: ${panel.title}`, target.expr, [...(target.legendFormat ?? '').matchAll(/\{\{\s*(\w+)\s*\}\}/g)].map((m) => m[1]!));
        }
      }
      for (const v of json.templating.list) {
        const m = v.definition ? /^label_values\((.*),\s*(\w+)\)$/.exec(v.definition) : null;
        if (m) check(`${file}: $${v.name}`, m[1]!, [m[2]!]);
      }
    }
    // An alert's annotations name labels of its expression's result: `$labels.x` must be one its series have.
    for (const f of ruleFiles) {
      for (const alert of readFileSync(f, 'utf8').split(/^\s*- alert:/m).slice(1)) {
        const [expr] = ruleExpressions(alert);
        const shown = [...alert.matchAll(/\$labels\.(\w+)/g)].map((m) => m[1]!);
        check(`${f}: ${alert.split('\n')[0]!.trim()}`, expr ?? '', shown);
        const grouped = /\bby\s*\(([^)]*)\)/.exec(expr ?? '');
        if (grouped) {
          const kept = grouped[1]!.split(',').map((l) => l.trim());
          for (const label of shown) if (!kept.includes(label)) problems.push(`${f}: ${alert.split('\n')[0]!.trim()}: $labels.${label} is summed away`);
        }
      }
    }
    assert.deepEqual(problems, []);
  });

  it('are found by the expression reader in the rules (so the check above is not vacuous)', () => {
    const exprs = ruleFiles.flatMap((f) => ruleExpressions(readFileSync(f, 'utf8')));
    assert.equal(exprs.length, 11);
    assert.ok(exprs.some((e) => e.includes('histogram_quantile(0.99, sum by (model, le) (rate(conduit_time_to_first_token_milliseconds_bucket[5m])) ) > 500')));
  });
});
