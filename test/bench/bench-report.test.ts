// `conduit bench`'s vLLM-style additions: TPOT, goodput, gamma arrivals (--burstiness), a fresh seed per run, the
// progress line, the JSON result file and the HTML report, which must open in Chromium without errors and draw its
// plots.

import assert from 'node:assert/strict';
import { existsSync, mkdtempSync, readFileSync, rmSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { pathToFileURL } from 'node:url';
import { after, before, describe, it } from 'node:test';
import { silentLogger } from '../../src/util/log.ts';
import type { RequestOutcome } from '../../src/bench/client.ts';
import { cdf, phaseBreakdown, throughputOverTime } from '../../src/bench/html-report.ts';
import { gammaSample, meetsGoodput, summarize, tpotOf } from '../../src/bench/load-generator.ts';
import { seededRandom } from '../../src/bench/prompt-workload.ts';
import { parseBenchConfig, parseGoodput, progressLine, runBench, type BenchConfig } from '../../src/cli/bench.ts';
import { UsageError } from '../../src/cli/flags.ts';
import { parseServeConfig, startServer, type RunningServer } from '../../src/cli/serve.ts';
import { CHROMIUM_PATH, launchChromium } from '../helpers/chromium.ts';

function outcome(o: Partial<RequestOutcome> & { index: number }): RequestOutcome {
  return { startMs: 0, endMs: 100, ok: true, status: 200, itlMs: [], e2eMs: 100, completionTokens: 1, ...o };
}

describe('bench metrics', () => {
  it('TPOT is (end-to-end - TTFT) / (tokens - 1), as vLLM defines it, and only where it means something', () => {
    assert.equal(tpotOf(outcome({ index: 0, ttftMs: 40, e2eMs: 140, completionTokens: 11 })), 10);
    assert.equal(tpotOf(outcome({ index: 0, ttftMs: 40, e2eMs: 140, completionTokens: 1 })), undefined);
    assert.equal(tpotOf(outcome({ index: 0, e2eMs: 140, completionTokens: 11 })), undefined, 'not streamed: no TTFT');
    assert.equal(tpotOf(outcome({ index: 0, ok: false, ttftMs: 40, e2eMs: 140, completionTokens: 11 })), undefined);
  });

  it('goodput counts the requests meeting every given target', () => {
    const requests = [
      outcome({ index: 0, ttftMs: 50, e2eMs: 150, completionTokens: 11 }), // tpot 10
      outcome({ index: 1, ttftMs: 250, e2eMs: 350, completionTokens: 11 }), // ttft too slow
      outcome({ index: 2, ttftMs: 50, e2eMs: 350, completionTokens: 11 }), // tpot 30
      outcome({ index: 3, ok: false, ttftMs: 10, e2eMs: 20, completionTokens: 2 }),
      outcome({ index: 4, e2eMs: 90, completionTokens: 11 }), // not streamed: no TTFT to meet a TTFT target
    ];
    const targets = { ttftMs: 200, tpotMs: 20 };
    assert.deepEqual(requests.map((r) => meetsGoodput(r, targets)), [true, false, false, false, false]);
    assert.equal(meetsGoodput(requests[4]!, { e2elMs: 100 }), true);
    const s = summarize(requests.map((r, i) => ({ ...r, startMs: i * 100, endMs: i * 100 + r.e2eMs })), 1, 0, targets);
    assert.equal(s.goodput!.numGood, 1);
    assert.ok(Math.abs(s.goodput!.requestsPerSec - 1 / s.durationSec) < 1e-12);
    assert.deepEqual([s.tpotMs.count, s.tpotMs.p50], [3, 10]);
    assert.equal(summarize(requests).goodput, undefined, 'no targets, no goodput');
  });

  it('draws gamma gaps with the mean of the rate and the spread of the burstiness (seeded)', () => {
    for (const shape of [0.5, 1, 4]) {
      const random = seededRandom(7);
      const scale = 1 / (10 * shape); // 10 arrivals per second
      const draws = Array.from({ length: 40_000 }, () => gammaSample(random, shape, scale));
      const mean = draws.reduce((s, x) => s + x, 0) / draws.length;
      const variance = draws.reduce((s, x) => s + (x - mean) ** 2, 0) / draws.length;
      assert.ok(Math.abs(mean - 0.1) < 0.003, `shape ${shape}: mean gap ${mean}`);
      // The squared coefficient of variation of a gamma is 1 / shape: bursty below 1, steady above.
      const cv2 = variance / (mean * mean);
      assert.ok(Math.abs(cv2 - 1 / shape) < 0.08 / shape, `shape ${shape}: CV^2 ${cv2}`);
      assert.ok(draws.every((x) => x > 0 && Number.isFinite(x)));
    }
  });

  it('builds the report\'s CDFs, throughput over time and phase means from outcomes', () => {
    const c = cdf([3, 1, 2, 4]);
    assert.deepEqual(c, { x: [1, 2, 3, 4], y: [0.25, 0.5, 0.75, 1] });
    const big = cdf(Array.from({ length: 1000 }, (_, i) => i), 100);
    assert.equal(big.x.length, 100);
    assert.equal(big.y[big.y.length - 1], 1);
    // Two streamed requests: tokens at 0.1 s and 1.1 s (one each), 2.5 s (two tokens in one chunk).
    const t = throughputOverTime([
      outcome({ index: 0, startMs: 0, endMs: 1200, e2eMs: 1200, ttftMs: 100, itlMs: [1000], completionTokens: 2 }),
      outcome({ index: 1, startMs: 2000, endMs: 2600, e2eMs: 600, ttftMs: 500, itlMs: [], completionTokens: 2 }),
    ]);
    assert.deepEqual(t.t, [0, 1, 2]);
    assert.deepEqual(t.tokensPerSec, [1, 1, 2]);
    assert.deepEqual(t.inFlight, [1, 0, 1]);
    const p = phaseBreakdown([
      outcome({ index: 0, serverTimings: { queue_ms: 10, prefill_ms: 20, decode_ms: 30 } }),
      outcome({ index: 1, serverTimings: { queue_ms: 30, prefill_ms: 40, decode_ms: 50 } }),
      outcome({ index: 2 }),
    ])!;
    assert.equal(p.requests, 2);
    assert.deepEqual([p.meanMs.queue_ms, p.meanMs.prefill_ms, p.meanMs.decode_ms, p.meanMs.gateway_ms], [20, 30, 40, 0]);
    assert.equal(phaseBreakdown([outcome({ index: 0 })]), undefined);
  });

  it('plots throughput over time of a run too long to spread its requests as arguments (300 000 requests)', () => {
    // A day-long run at a few requests per second: Math.min(...starts) would overflow the stack and lose the report.
    const requests = Array.from({ length: 300_000 }, (_, index) =>
      outcome({ index, startMs: index * 10, endMs: index * 10 + 5, e2eMs: 5, completionTokens: 1 }));
    const t = throughputOverTime(requests);
    assert.equal(t.t.length, 3000);
    assert.equal(t.tokensPerSec.reduce((sum, v) => sum + v, 0), 300_000);
  });
});

describe('conduit bench flags (vLLM names)', () => {
  it('reads --request-rate, --burstiness, --goodput, --result-file, --html and --no-progress, with CONDUIT_BENCH_* twins', () => {
    const c = parseBenchConfig(['--request-rate', '4', '--burstiness', '0.5', '--goodput', 'ttft:200,tpot:50', '--result-file', 'r.json',
      '--html', 'r.html', '--no-progress'], {}) as BenchConfig;
    assert.equal(c.load.rate, 4);
    assert.equal(c.load.burstiness, 0.5);
    assert.deepEqual(c.load.goodput, { ttftMs: 200, tpotMs: 50 });
    assert.equal(c.outputFile, 'r.json');
    assert.equal(c.htmlFile, 'r.html');
    assert.equal(c.progress, false);
    const e = parseBenchConfig([], {
      CONDUIT_BENCH_REQUEST_RATE: '2', CONDUIT_BENCH_BURSTINESS: '3', CONDUIT_BENCH_GOODPUT: 'e2el:900', CONDUIT_BENCH_HTML: 'x.html',
      CONDUIT_BENCH_RESULT_FILE: 'x.json', CONDUIT_BENCH_PROGRESS: 'false',
    }) as BenchConfig;
    assert.deepEqual([e.load.rate, e.load.burstiness, e.load.goodput, e.htmlFile, e.outputFile, e.progress], [2, 3, { e2elMs: 900 }, 'x.html', 'x.json', false]);
    assert.equal((parseBenchConfig([], {}) as BenchConfig).progress, true);
    assert.equal((parseBenchConfig(['--rate', '3'], {}) as BenchConfig).load.rate, 3, 'the older name still works');
    assert.equal((parseBenchConfig(['-o', 'old.json'], {}) as BenchConfig).outputFile, 'old.json');
    assert.deepEqual(parseGoodput('ttft:200 tpot:50 e2el:1000'), { ttftMs: 200, tpotMs: 50, e2elMs: 1000 });
  });

  it('refuses what cannot mean anything', () => {
    const bad: [string[], RegExp][] = [
      [['--burstiness', '2'], /--burstiness/], [['--request-rate', '1', '--burstiness', '0'], /--burstiness/],
      [['--request-rate', '1', '--rate', '2'], /not both/], [['--goodput', 'ttft'], /--goodput/], [['--goodput', 'itl:5'], /--goodput/],
      [['--goodput', 'ttft:-1'], /--goodput/], [['--goodput', 'ttft:1,ttft:2'], /twice/], [['--result-file', 'a', '--output', 'b'], /not both/],
      // Files the run could not write at its end are refused before any request is sent.
      [['--result-file', '/nonexistent-dir/r.json'], /--result-file .*no directory/], [['--html', tmpdir()], /--html .*directory/],
      [['--output', '/nonexistent-dir/r.json'], /--output .*no directory/],
    ];
    for (const [argv, message] of bad) {
      assert.throws(() => parseBenchConfig(argv, {}), (err: unknown) => err instanceof UsageError && message.test(err.message), argv.join(' '));
    }
  });

  it('a flag on the command line wins over its older (or newer) name\'s environment twin; both in the environment must agree', () => {
    const parse = (argv: string[], env: Record<string, string>) => parseBenchConfig(argv, env) as BenchConfig;
    assert.equal(parse(['--request-rate', '5'], { CONDUIT_BENCH_RATE: '3' }).load.rate, 5);
    assert.equal(parse(['--rate', '5'], { CONDUIT_BENCH_REQUEST_RATE: '3' }).load.rate, 5);
    assert.equal(parse(['--result-file', 'b.json'], { CONDUIT_BENCH_OUTPUT: 'a.json' }).outputFile, 'b.json');
    assert.equal(parse(['-o', 'b.json'], { CONDUIT_BENCH_RESULT_FILE: 'a.json' }).outputFile, 'b.json');
    assert.equal(parse([], { CONDUIT_BENCH_RATE: '3' }).load.rate, 3);
    assert.equal(parse([], { CONDUIT_BENCH_OUTPUT: 'a.json' }).outputFile, 'a.json');
    assert.equal(parse([], { CONDUIT_BENCH_RATE: '3', CONDUIT_BENCH_REQUEST_RATE: '3' }).load.rate, 3, 'both, agreeing');
    for (const [env, message] of [
      [{ CONDUIT_BENCH_RATE: '3', CONDUIT_BENCH_REQUEST_RATE: '4' },
        'CONDUIT_BENCH_REQUEST_RATE=4 and CONDUIT_BENCH_RATE=3 (its older name) are both set: unset one, or give --request-rate on the command line'],
      [{ CONDUIT_BENCH_OUTPUT: 'a.json', CONDUIT_BENCH_RESULT_FILE: 'b.json' },
        'CONDUIT_BENCH_RESULT_FILE=b.json and CONDUIT_BENCH_OUTPUT=a.json (its older name) are both set: unset one, or give --result-file on the command line'],
    ] as const) {
      assert.throws(() => parse([], env), (err: unknown) => err instanceof UsageError && err.message === message);
    }
    assert.equal(parse(['--request-rate', '5'], { CONDUIT_BENCH_RATE: '3', CONDUIT_BENCH_REQUEST_RATE: '4' }).load.rate, 5, 'the command line settles it');
  });

  it('draws a new seed each run unless --seed is given', () => {
    const seeds = new Set(Array.from({ length: 5 }, () => (parseBenchConfig([], {}) as BenchConfig).load.seed));
    assert.ok(seeds.size >= 4, `seeds ${[...seeds].join(', ')}`);
    assert.equal((parseBenchConfig(['--seed', '42'], {}) as BenchConfig).load.seed, 42);
    assert.equal((parseBenchConfig([], { CONDUIT_BENCH_SEED: '9' }) as BenchConfig).load.seed, 9);
    const a = parseBenchConfig(['--seed', '5'], {}) as BenchConfig;
    const b = parseBenchConfig([], {}) as BenchConfig;
    assert.notEqual(a.load.workload.prompt(0).user, b.load.workload.prompt(0).user);
  });

  it('writes a progress line that says where the run is', () => {
    assert.equal(progressLine({ elapsedSec: 12.34, started: 50, done: 45, ok: 43, errors: 2, inFlight: 5, outputTokens: 1234, total: 100 }),
      'conduit bench: 12.3 s  45/100 done (2 failed)  5 in flight  100.0 output tok/s');
  });
});

describe('conduit bench against a live simulated server: result file, HTML report, fresh prompts', () => {
  let running: RunningServer;
  let dir: string;

  before(async () => {
    const config = parseServeConfig(['--port', '0', '--log-level', 'silent', '--engine', 'sim', '--workers', '2'], {});
    if (config === 'help') throw new Error('unexpected --help');
    config.sim.speedUp = Infinity;
    running = await startServer(config, silentLogger);
    dir = mkdtempSync(join(tmpdir(), 'conduit-bench-report-'));
  });
  after(async () => {
    await running?.api.shutdown(0);
    if (dir) rmSync(dir, { recursive: true, force: true });
  });

  const config = (argv: string[]): BenchConfig => parseBenchConfig(['--url', running.url, '--stream', '--output-tokens', '8',
    '--prompt-tokens', '96', '--requests', '6', '--concurrency', '3', ...argv], {}) as BenchConfig;

  it('reruns with fresh prompts by default (little from the prefix cache), the same ones with --seed', { timeout: 60_000 }, async () => {
    const quiet = { write: () => {} };
    const first = (await runBench(config([]), quiet)).result;
    const second = (await runBench(config([]), quiet)).result;
    const replay = (await runBench(config(['--seed', String(first.seed)]), quiet)).result;
    assert.notEqual(first.seed, second.seed);
    assert.equal(replay.seed, first.seed);
    assert.ok((second.summary.cachedPromptFraction ?? 0) < 0.3, `fresh prompts: ${second.summary.cachedPromptFraction} cached`);
    assert.ok((replay.summary.cachedPromptFraction ?? 0) > 0.6, `same prompts: ${replay.summary.cachedPromptFraction} cached`);
  });

  it('writes progress, the JSON result file (TPOT, goodput) and an HTML report with its plots, that opens in Chromium cleanly', { timeout: 120_000 }, async (t) => {
    const resultFile = join(dir, 'result.json');
    const htmlFile = join(dir, 'report.html');
    const progress: string[] = [];
    let text = '';
    const { code } = await runBench(config(['--goodput', 'ttft:60000,tpot:60000', '--result-file', resultFile, '--html', htmlFile]),
      { write: (t) => { text = t; }, progress: { write: (t) => progress.push(t), isTTY: true } });
    assert.equal(code, 0);
    assert.match(text, /^TPOT /m);
    assert.match(text, /goodput .* 6 of 6 requests met TTFT <= 60000 ms, TPOT <= 60000 ms/);
    assert.ok(progress.some((line) => /^\rconduit bench: .* 6\/6 done {2}0 in flight/.test(line)), progress.join('|'));
    assert.equal(progress[progress.length - 1], '\n', 'the progress line is ended before the report');
    const saved = JSON.parse(readFileSync(resultFile, 'utf8')) as {
      summary: { tpotMs: { count: number }; goodput: { numGood: number } }; requests: { serverTimings?: Record<string, number> }[]; seed: number;
    };
    assert.equal(saved.summary.tpotMs.count, 6);
    assert.equal(saved.summary.goodput.numGood, 6);
    assert.equal(typeof saved.seed, 'number');
    assert.ok(saved.requests.every((r) => typeof r.serverTimings?.prefill_ms === 'number'), 'Conduit\'s timings captured');

    const html = readFileSync(htmlFile, 'utf8');
    assert.doesNotMatch(html, /<script[^>]+src=|<link[^>]+stylesheet|(?:src|href)=["']?https?:|url\(\s*["']?https?:|@import/, 'nothing loaded from elsewhere');
    if (!existsSync(CHROMIUM_PATH)) {
      // Reported as a skip (the checks above ran), not as a pass of the browser's half.
      t.skip(`the Chromium half: ${CHROMIUM_PATH} is not installed`);
      return;
    }
    const browser = await launchChromium(join(dir, 'profile'));
    try {
      const page = await browser.newPage();
      await page.goto(pathToFileURL(htmlFile).href);
      await page.waitForSelector('body[data-ready]');
      // TTFT, ITL and TPOT CDFs and throughput over time, as uPlot canvases; the phase breakdown as SVG.
      assert.equal(await page.locator('.uplot').count(), 4);
      assert.ok(await page.locator('canvas').count() >= 4);
      assert.equal(await page.locator('#phase-breakdown').count(), 1);
      assert.match((await page.textContent('#plot-phases'))!, /prefill: \d+\.\d+ ms/);
      assert.match((await page.textContent('#summary'))!, /TTFT/);
      await page.screenshot({ path: join(dir, 'report.png'), fullPage: true });
      browser.assertClean();
    } finally {
      await browser.close();
    }
  });
});
