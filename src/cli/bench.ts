// `conduit bench`: load against any OpenAI-compatible server (Conduit, vLLM, llama.cpp's server ...), measured from
// the client: TTFT, TPOT, inter-token latency, end-to-end latency, throughput, goodput and errors, as p50/p90/p99
// tables or JSON, a JSON result file and a self-contained HTML report with plots. Names follow `vllm bench serve`
// where it has one (--request-rate, --burstiness, --goodput, TPOT). Every run is bounded (requests, duration,
// per-request timeout); Ctrl-C stops it early and still reports. Each run draws fresh prompts unless --seed is given.

import { randomInt } from 'node:crypto';
import { accessSync, constants, statSync, writeFileSync } from 'node:fs';
import { dirname, resolve } from 'node:path';
import { renderHtmlReport } from '../bench/html-report.ts';
import { BenchProbeError, runLoad, type BenchResult, type Endpoint, type GoodputTargets, type LoadOptions, type LoadProgress } from '../bench/load-generator.ts';
import { formatReport, reportJson } from '../bench/report.ts';
import { MAX_PROMPT_WORDS, randomWorkload, sharedPrefixWorkload, type Workload } from '../bench/prompt-workload.ts';
import {
  envName, formatFlagHelp, nameEnvironment, parseFlags, UsageError, type FlagTable, type FlagValues, type Inapplicable, type ParsedFlags,
} from './flags.ts';
import type { Command } from './main.ts';

const FLAGS = {
  url: { type: 'string', help: 'server base URL', default: 'http://127.0.0.1:8000', short: 'u' },
  endpoint: { type: 'string', help: 'chat (/v1/chat/completions) or completions (/v1/completions)', default: 'chat' },
  model: { type: 'string', help: 'model name to send (default: the first one GET /v1/models lists)', short: 'm' },
  'api-key': { type: 'string', help: 'sent as "Authorization: Bearer <key>"' },
  'request-rate': { type: 'number', help: 'open loop: arrivals per second, Poisson unless --burstiness says otherwise (with --concurrency as the in-flight cap)', short: 'r' },
  rate: { type: 'number', help: 'the older name of --request-rate' },
  burstiness: { type: 'number', help: 'open loop: shape of the gamma distribution of the gaps between arrivals, as vLLM\'s (1 = Poisson, < 1 burstier, > 1 steadier; default 1)' },
  concurrency: { type: 'number', help: 'closed loop: clients sending back to back (default 1 without --rate; at most 65536)', short: 'c' },
  requests: { type: 'number', help: 'stop after this many requests (default 100 when --duration is not given)', short: 'n' },
  duration: { type: 'number', help: 'stop starting requests after this many seconds', short: 'd' },
  workload: { type: 'string', help: 'random (independent prompts) or shared-prefix (groups sharing long system prompts); the other workload\'s prompt flags are refused', default: 'random' },
  'prompt-tokens': { type: 'number', help: 'random workload: prompt length (words of one token each)', default: 256 },
  groups: { type: 'number', help: 'shared-prefix workload: number of groups (tenants)', default: 8 },
  'system-prompt-tokens': { type: 'number', help: 'shared-prefix workload: length of each group\'s system prompt', default: 2048 },
  'question-tokens': { type: 'number', help: 'shared-prefix workload: length of each question', default: 64 },
  'output-tokens': { type: 'number', help: 'max_tokens of every request', default: 128 },
  'ignore-eos': { type: 'boolean', help: 'send ignore_eos so every request generates exactly --output-tokens (vLLM, Conduit)' },
  temperature: { type: 'number', help: 'sampling temperature of every request, 0 for greedy (default: none sent, so the server\'s default: 1 in the OpenAI API and Conduit)' },
  'top-p': { type: 'number', help: 'top_p of every request, in (0, 1] (default: none sent)' },
  logprobs: { type: 'number', help: 'ask every request for each output token\'s logprob and this many alternatives (completions: logprobs N; chat: logprobs true and top_logprobs N) (default: none asked)' },
  stream: { type: 'boolean', help: 'stream responses (SSE): needed for TTFT and ITL', short: 's' },
  timeout: { type: 'number', help: 'seconds one request may take before it counts as an error', default: 120 },
  seed: { type: 'number', help: 'seed of the prompts and the arrival times (default: a new one each run, printed in the report, so a rerun does not just measure the prefix cache)' },
  goodput: { type: 'string', help: 'targets a request must all meet to count towards goodput, as vLLM\'s: "ttft:MS,tpot:MS,e2el:MS" (any of them)' },
  json: { type: 'boolean', help: 'print the report as JSON instead of tables' },
  'result-file': { type: 'string', help: 'also write the JSON report, with every request\'s timings, to this file', short: 'o' },
  output: { type: 'string', help: 'the older name of --result-file' },
  html: { type: 'string', help: 'also write a self-contained HTML report with plots (TTFT/ITL CDFs, throughput over time, phase breakdown) to this file' },
  progress: { type: 'boolean', help: 'a progress line on stderr while the run goes on (--no-progress: none)', default: true },
  probe: { type: 'boolean', help: 'send the first request once before the load, not counted, and stop with one line if it fails, as vllm bench serve does (--no-probe: start the load at once)', default: true },
  help: { type: 'boolean', help: 'show this help', short: 'h' },
} satisfies FlagTable;

/**
 * Environment twins. The server to talk to is CONDUIT_URL / CONDUIT_API_KEY, shared with `conduit trace`; the
 * load's own knobs are CONDUIT_BENCH_*, because several of their names (model, seed, rate, requests, concurrency)
 * mean something else to `conduit serve`, `generate` or `plan` and may be set in the same shell.
 */
export const BENCH_FLAGS = Object.fromEntries(Object.entries(FLAGS).map(([name, spec]) => [
  name, ['url', 'api-key', 'help'].includes(name) ? spec : { ...spec, env: `CONDUIT_BENCH_${name.replace(/-/g, '_').toUpperCase()}` },
])) as typeof FLAGS;

const ENDPOINTS: readonly Endpoint[] = ['chat', 'completions'];
const WORKLOADS = ['random', 'shared-prefix'] as const;

export interface BenchConfig {
  load: Omit<LoadOptions, 'signal' | 'progress'>;
  json: boolean;
  outputFile?: string;
  htmlFile?: string;
  progress: boolean;
  /** One line per environment variable ignored as not applying (a flag of the workload not run). */
  warnings: string[];
}

const GOODPUT_KEYS: Readonly<Record<string, keyof GoodputTargets>> = { ttft: 'ttftMs', tpot: 'tpotMs', e2el: 'e2elMs' };

/** "ttft:200,tpot:50" (or space-separated, as vLLM takes them) into targets in ms. */
export function parseGoodput(text: string): GoodputTargets {
  const targets: GoodputTargets = {};
  const items = text.split(/[\s,]+/).filter(Boolean);
  if (items.length === 0) throw new UsageError('--goodput needs at least one target, e.g. "ttft:200,tpot:50"');
  for (const item of items) {
    const m = /^([a-z0-9]+):(.+)$/i.exec(item);
    const key = m ? GOODPUT_KEYS[m[1]!.toLowerCase()] : undefined;
    const value = m ? Number(m[2]) : Number.NaN;
    if (!key) throw new UsageError(`--goodput: "${item}" is not one of ttft:MS, tpot:MS, e2el:MS`);
    if (!(value > 0) || !Number.isFinite(value)) throw new UsageError(`--goodput: ${m![1]} must be a number of ms > 0, got "${m![2]}"`);
    if (targets[key] !== undefined) throw new UsageError(`--goodput: ${m![1]} given twice`);
    targets[key] = value;
  }
  return targets;
}

/**
 * The most clients (connections) --concurrency may ask for: one address has no more ports to open them from. Every
 * client was started at once, so 10^7 took gigabytes and never sent a request, and 10^12 ended in a stack trace.
 */
const MAX_CONCURRENCY = 65_536;

/** Node's timers hold at most 2^31 - 1 ms: a longer timeout would fire at once. */
const MAX_TIMEOUT_SEC = Math.floor((2 ** 31 - 1) / 1000);

function timeoutSeconds(value: number): number {
  if (!(value > 0 && value <= MAX_TIMEOUT_SEC)) throw new UsageError(`--timeout must be in (0, ${MAX_TIMEOUT_SEC}] seconds, got ${value}`);
  return value;
}

function wholeNumber(flag: string, value: number | undefined, min: number): number | undefined {
  if (value === undefined) return undefined;
  if (!Number.isSafeInteger(value) || value < min) throw new UsageError(`--${flag} must be a whole number >= ${min}, got ${value}`);
  return value;
}

/** A prompt length in words (about tokens): the prompt is built in memory, so a length no context holds is refused. */
function promptLength(flag: string, value: number | undefined): number {
  if (!(Number.isSafeInteger(value) && value! >= 1 && value! <= MAX_PROMPT_WORDS)) {
    throw new UsageError(`--${flag} must be a whole number from 1 to ${MAX_PROMPT_WORDS}, got ${value}`);
  }
  return value!;
}

function positive(flag: string, value: number | undefined): number | undefined {
  if (value === undefined) return undefined;
  if (!(value > 0)) throw new UsageError(`--${flag} must be > 0, got ${value}`);
  return value;
}

/**
 * Which of a flag and its older name gives the value: the one typed on the command line, over the other's environment
 * twin (the command line wins over the environment). Both typed is an error; both set in the environment is one
 * too unless they agree, since nothing says which was meant. Neither set: the newer name (unset).
 */
function eitherName<N extends keyof typeof BENCH_FLAGS & string, O extends keyof typeof BENCH_FLAGS & string>(
  parsed: ParsedFlags<typeof BENCH_FLAGS>, newer: N, older: O): N | O {
  const { sources } = parsed;
  const values = parsed.values as Record<string, unknown>;
  if (sources[newer] === sources[older] && values[newer] !== undefined && values[older] !== undefined) {
    if (sources[newer] === 'command line') throw new UsageError(`give --${newer} or --${older} (its older name), not both`);
    if (values[newer] !== values[older]) {
      throw new UsageError(`${envName(newer, BENCH_FLAGS[newer])}=${parsed.environment[newer]} and ${envName(older, BENCH_FLAGS[older])}=`
        + `${parsed.environment[older]} (its older name) are both set: unset one, or give --${newer} on the command line`);
    }
  }
  if (sources[older] === 'command line') return older;
  if (sources[newer] === 'command line') return newer;
  return values[newer] === undefined && values[older] !== undefined ? older : newer;
}

/**
 * The prompt flags of the workload not run: typed, a usage error (`--groups 0` with the default random workload was
 * taken without a word, and did nothing); from the environment, ignored with a warning.
 */
function otherWorkloadFlags(values: FlagValues<typeof BENCH_FLAGS>): Inapplicable<typeof BENCH_FLAGS> | undefined {
  if (values.workload === 'random') {
    return { names: ['groups', 'system-prompt-tokens', 'question-tokens'], why: 'only for --workload shared-prefix (the random workload is --prompt-tokens)' };
  }
  if (values.workload === 'shared-prefix') {
    return { names: ['prompt-tokens'], why: 'only for --workload random (shared-prefix prompts are --system-prompt-tokens plus --question-tokens)' };
  }
  return undefined;
}

export function parseBenchConfig(argv: readonly string[], env: NodeJS.ProcessEnv = process.env): BenchConfig | 'help' {
  const parsed = parseFlags(BENCH_FLAGS, argv, env, { inapplicable: otherWorkloadFlags });
  try {
    return benchConfigOf(parsed);
  } catch (err) {
    // A value nobody typed is reported under the variable that gave it (CONDUIT_BENCH_TIMEOUT (--timeout) must be
    // ...), as `conduit serve` reports it.
    throw nameEnvironment(BENCH_FLAGS, parsed, err);
  }
}

function benchConfigOf(parsed: ParsedFlags<typeof BENCH_FLAGS>): BenchConfig | 'help' {
  const { values, positionals } = parsed;
  if (values.help) return 'help';
  if (positionals.length > 0) throw new UsageError(`unexpected argument "${positionals[0]}"`);
  const url = values.url!;
  try {
    const parsed = new URL(url);
    if (parsed.protocol !== 'http:' && parsed.protocol !== 'https:') throw new Error();
  } catch {
    throw new UsageError(`--url must be an http:// or https:// URL, got "${url}"`);
  }
  const endpoint = values.endpoint!;
  if (!(ENDPOINTS as readonly string[]).includes(endpoint)) throw new UsageError(`--endpoint must be one of ${ENDPOINTS.join(', ')}`);
  const workloadName = values.workload!;
  if (!(WORKLOADS as readonly string[]).includes(workloadName)) throw new UsageError(`--workload must be one of ${WORKLOADS.join(', ')}`);
  // A fresh seed per run unless one is given: the same prompts again would mostly measure the prefix cache.
  const seed = wholeNumber('seed', values.seed, 0) ?? randomInt(0, 2 ** 31);
  const workload: Workload = workloadName === 'random'
    ? randomWorkload({ promptTokens: promptLength('prompt-tokens', values['prompt-tokens']), seed })
    : sharedPrefixWorkload({
      groups: wholeNumber('groups', values.groups, 1)!,
      systemPromptTokens: promptLength('system-prompt-tokens', values['system-prompt-tokens']),
      questionTokens: promptLength('question-tokens', values['question-tokens']),
      seed,
    });
  const rateFlag = eitherName(parsed, 'request-rate', 'rate');
  const rate = positive(rateFlag, values[rateFlag]);
  const burstiness = positive('burstiness', values.burstiness);
  if (burstiness !== undefined && rate === undefined) throw new UsageError('--burstiness shapes the arrivals of --request-rate: give one');
  const goodput = values.goodput !== undefined ? parseGoodput(values.goodput) : undefined;
  const outputFlag = eitherName(parsed, 'result-file', 'output');
  const outputFile = values[outputFlag];
  const concurrency = wholeNumber('concurrency', values.concurrency, 1);
  if (concurrency !== undefined && concurrency > MAX_CONCURRENCY) {
    throw new UsageError(`--concurrency must be at most ${MAX_CONCURRENCY} (connections one client address can open to a server), got ${concurrency}`);
  }
  const temperature = values.temperature;
  if (temperature !== undefined && !(temperature >= 0 && Number.isFinite(temperature))) {
    throw new UsageError(`--temperature must be a number >= 0, got ${temperature}`);
  }
  const topP = values['top-p'];
  if (topP !== undefined && !(topP > 0 && topP <= 1)) throw new UsageError(`--top-p must be in (0, 1], got ${topP}`);
  const logprobs = wholeNumber('logprobs', values.logprobs, 0);
  const durationSec = positive('duration', values.duration);
  // Unbounded runs are not offered: without either bound, a fixed number of requests.
  const requests = wholeNumber('requests', values.requests, 1) ?? (durationSec === undefined ? 100 : undefined);
  const load: BenchConfig['load'] = {
    url, endpoint: endpoint as Endpoint, workload,
    outputTokens: wholeNumber('output-tokens', values['output-tokens'], 1)!,
    stream: values.stream, ignoreEos: values['ignore-eos'],
    timeoutSec: timeoutSeconds(values.timeout!), seed, probe: values.probe,
    ...(values.model !== undefined ? { model: values.model } : {}),
    ...(values['api-key'] !== undefined ? { apiKey: values['api-key'] } : {}),
    ...(rate !== undefined ? { rate } : {}),
    ...(burstiness !== undefined ? { burstiness } : {}),
    ...(goodput !== undefined ? { goodput } : {}),
    ...(temperature !== undefined || topP !== undefined || logprobs !== undefined ? { sampling: {
      ...(temperature !== undefined ? { temperature } : {}), ...(topP !== undefined ? { topP } : {}),
      ...(logprobs !== undefined ? { logprobs } : {}),
    } } : {}),
    ...(concurrency !== undefined ? { concurrency } : {}),
    ...(requests !== undefined ? { requests } : {}),
    ...(durationSec !== undefined ? { durationSec } : {}),
  };
  if (outputFile !== undefined) checkWritable(outputFlag, outputFile);
  if (values.html !== undefined) checkWritable('html', values.html);
  return {
    load, json: values.json, progress: values.progress, warnings: parsed.warnings,
    ...(outputFile !== undefined ? { outputFile } : {}),
    ...(values.html !== undefined ? { htmlFile: values.html } : {}),
  };
}

/** Refuses, before any load is sent, a report file that could not be written when the run ends (a missing folder, a
 *  read-only place, a directory), so a long run's results are not lost to a typo. */
function checkWritable(flag: string, file: string): void {
  const path = resolve(file);
  let reason: string | undefined;
  try {
    const existing = statSync(path, { throwIfNoEntry: false });
    if (existing?.isDirectory()) reason = 'it is a directory';
    else if (existing) accessSync(path, constants.W_OK);
    else if (!statSync(dirname(path), { throwIfNoEntry: false })?.isDirectory()) reason = `no directory ${dirname(path)}`;
    else accessSync(dirname(path), constants.W_OK);
  } catch (err) {
    reason = (err as NodeJS.ErrnoException).code === 'EACCES' ? 'permission denied' : (err as Error).message;
  }
  if (reason !== undefined) throw new UsageError(`--${flag} ${file}: cannot write the report there (${reason})`);
}

/** One progress line: time, requests done of the bound, errors, in flight, output tokens per second so far. */
export function progressLine(p: LoadProgress): string {
  const rate = p.elapsedSec > 0 ? p.outputTokens / p.elapsedSec : 0;
  return `conduit bench: ${p.elapsedSec.toFixed(1)} s  ${p.done}${p.total !== undefined ? `/${p.total}` : ''} done`
    + `${p.errors > 0 ? ` (${p.errors} failed)` : ''}  ${p.inFlight} in flight  ${rate.toFixed(1)} output tok/s`;
}

export interface BenchIo {
  write(text: string): void;
  /** Where the progress line goes (stderr); a terminal gets one line rewritten in place, anything else a line every 10 s. */
  progress?: { write(text: string): void; isTTY?: boolean };
}

/** Runs the load and writes the report and files; the exit code is 1 when no request succeeded. */
export async function runBench(config: BenchConfig, io: BenchIo | ((text: string) => void), signal?: AbortSignal): Promise<{ code: number; result: BenchResult }> {
  const { write, progress: out } = typeof io === 'function' ? { write: io, progress: undefined } : io;
  const tty = out?.isTTY === true;
  let wrote = false;
  const progress = config.progress && out ? {
    intervalMs: tty ? 500 : 10_000,
    report(p: LoadProgress) {
      out.write(tty ? `\r${progressLine(p)}\x1b[K` : `${progressLine(p)}\n`);
      wrote = true;
    },
  } : undefined;
  const result = await runLoad({ ...config.load, ...(signal ? { signal } : {}), ...(progress ? { progress } : {}) });
  if (tty && wrote) out!.write('\n');
  const text = formatReport(result);
  write(config.json ? reportJson(result) : text);
  // Checked writable before the run; should the place change meanwhile, the report above is out and one line says
  // which file is missing (exit 1), rather than a stack trace.
  let writeFailed = false;
  const save = (file: string, content: () => string): void => {
    try {
      writeFileSync(file, content());
    } catch (err) {
      writeFailed = true;
      (out ?? process.stderr).write(`conduit bench: could not write ${file}: ${(err as Error).message}\n`);
    }
  };
  if (config.outputFile !== undefined) save(config.outputFile, () => `${reportJson(result, { includeRequests: true })}\n`);
  if (config.htmlFile !== undefined) save(config.htmlFile, () => renderHtmlReport(result, text));
  return { code: result.summary.numOk > 0 && !writeFailed ? 0 : 1, result };
}

export const benchCommand: Command = {
  summary: 'load generator: TTFT, ITL, latency and throughput of an OpenAI-compatible server',
  async run(argv) {
    const config = parseBenchConfig(argv);
    if (config === 'help') {
      console.log(`Usage: conduit bench [options]\n\n${formatFlagHelp(BENCH_FLAGS)}`);
      return 0;
    }
    for (const warning of config.warnings) console.error(`conduit bench: ${warning}`);
    const stop = new AbortController();
    const onSignal = (): void => {
      process.stderr.write('conduit bench: stopping (requests in flight are cut and counted as aborted)\n');
      stop.abort();
    };
    process.once('SIGINT', onSignal);
    try {
      const { code } = await runBench(config, { write: (text) => console.log(text), progress: process.stderr }, stop.signal);
      return code;
    } catch (err) {
      if (!(err instanceof BenchProbeError)) throw err;
      console.error(`conduit bench: ${err.message}; no load was sent (--no-probe skips this check)`);
      return 1;
    } finally {
      process.off('SIGINT', onSignal);
    }
  },
};
