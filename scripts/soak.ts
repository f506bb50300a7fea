// Soak test through the real HTTP server: starts `conduit serve` as its own process (default threads), then on
// each model
//   1. sequential long streams (1000 tokens asked for, EOS ignored), one at a time;
//   2. bursts of concurrent streams with mixed prompts and lengths;
// and checks that every stream ends with `data: [DONE]`, that its text equals the non-streamed greedy
// (temperature 0) completion of the same request, and that the server process is still alive at the end (its RSS is
// reported). Exits non-zero on the first stream that breaks or when the server dies, with the server's last output.
//
//   npm run soak -- [--sequential N] [--builtin-sequential N] [--burst N] [--bursts N] [--builtin-bursts N]
//                   [--max-tokens N] [--models stories,builtin] [--seed N]
//
// The defaults are CI's size (.ci/run): 2-3 minutes on a 2-core machine. Every flag has an environment twin
// (CONDUIT_SOAK_SEQUENTIAL, CONDUIT_SOAK_BURST, ...). The stories260K model is
// read from ../shared/models (or CONDUIT_SHARED_MODELS); when it is absent that model is skipped with a message.

import { spawn, type ChildProcess } from 'node:child_process';
import { existsSync, readFileSync } from 'node:fs';
import { createServer } from 'node:net';
import { join } from 'node:path';
import { fileURLToPath } from 'node:url';

const ROOT = fileURLToPath(new URL('..', import.meta.url));
const SHARED_MODELS_DIR = process.env.CONDUIT_SHARED_MODELS ?? join(ROOT, '..', 'shared', 'models');

interface SoakOptions {
  /** Per model: stories260K's counts, and the built-in model's (about 7x slower per token). */
  sequential: { stories: number; builtin: number };
  burst: number;
  bursts: { stories: number; builtin: number };
  maxTokens: number;
  models: string[];
  seed: number;
  /** Extra `conduit serve` arguments (space-separated), e.g. "--threads 3". */
  serveArgs: string[];
}

const FLAGS: Record<string, { env: string; default: string; help: string }> = {
  sequential: { env: 'CONDUIT_SOAK_SEQUENTIAL', default: '200', help: 'sequential streams on stories260K' },
  'builtin-sequential': { env: 'CONDUIT_SOAK_BUILTIN_SEQUENTIAL', default: '3', help: 'sequential streams on the built-in model' },
  burst: { env: 'CONDUIT_SOAK_BURST', default: '24', help: 'concurrent streams in one burst' },
  bursts: { env: 'CONDUIT_SOAK_BURSTS', default: '3', help: 'bursts on stories260K' },
  'builtin-bursts': { env: 'CONDUIT_SOAK_BUILTIN_BURSTS', default: '1', help: 'bursts on the built-in model' },
  'max-tokens': { env: 'CONDUIT_SOAK_MAX_TOKENS', default: '1000', help: 'max_tokens of the sequential streams (and the largest in a burst)' },
  models: { env: 'CONDUIT_SOAK_MODELS', default: 'stories,builtin', help: 'models to soak: stories (../shared/models/stories260K.gguf), builtin' },
  seed: { env: 'CONDUIT_SOAK_SEED', default: '1', help: 'seed of the burst mix' },
  'serve-args': { env: 'CONDUIT_SOAK_SERVE_ARGS', default: '', help: 'extra `conduit serve` arguments' },
};

function parseOptions(argv: string[]): SoakOptions {
  const values = new Map<string, string>();
  for (const [name, flag] of Object.entries(FLAGS)) {
    const fromEnv = process.env[flag.env];
    values.set(name, fromEnv !== undefined && fromEnv !== '' ? fromEnv : flag.default);
  }
  for (let i = 0; i < argv.length; i++) {
    const arg = argv[i]!;
    if (arg === '--help' || arg === '-h') {
      console.log('Usage: npm run soak -- [options]\n');
      for (const [name, flag] of Object.entries(FLAGS)) console.log(`  --${name.padEnd(12)} ${flag.help} (default ${flag.default || 'none'}; env ${flag.env})`);
      process.exit(0);
    }
    const match = /^--([a-z-]+)(?:=(.*))?$/.exec(arg);
    if (!match || !FLAGS[match[1]!]) throw new Error(`unknown argument ${arg} (see --help)`);
    const value = match[2] ?? argv[++i];
    if (value === undefined) throw new Error(`--${match[1]} needs a value`);
    values.set(match[1]!, value);
  }
  const count = (name: string, min: number): number => {
    const n = Number(values.get(name));
    if (!Number.isInteger(n) || n < min) throw new Error(`--${name} must be a whole number >= ${min}, got ${values.get(name)}`);
    return n;
  };
  const models = values.get('models')!.split(',').map((m) => m.trim()).filter((m) => m !== '');
  for (const model of models) if (model !== 'stories' && model !== 'builtin') throw new Error(`unknown model ${model} (stories, builtin)`);
  return {
    sequential: { stories: count('sequential', 0), builtin: count('builtin-sequential', 0) },
    burst: count('burst', 0), bursts: { stories: count('bursts', 0), builtin: count('builtin-bursts', 0) },
    maxTokens: count('max-tokens', 1), models, seed: count('seed', 0),
    serveArgs: values.get('serve-args')!.split(/\s+/).filter((a) => a !== ''),
  };
}

// ---------------------------------------------------------------------------------------------------------------
// The server process

class ServerProcess {
  private output = '';
  exited: { code: number | null; signal: NodeJS.Signals | null } | undefined;
  private readonly child: ChildProcess;

  constructor(readonly url: string, args: string[]) {
    this.child = spawn(process.execPath, [join(ROOT, 'bin', 'conduit.js'), 'serve', ...args], {
      cwd: ROOT, stdio: ['ignore', 'pipe', 'pipe'],
    });
    const keep = (chunk: Buffer) => { this.output = (this.output + chunk.toString('utf8')).slice(-20_000); };
    this.child.stdout!.on('data', keep);
    this.child.stderr!.on('data', keep);
    this.child.on('exit', (code, signal) => { this.exited = { code, signal }; });
  }

  get pid(): number {
    return this.child.pid!;
  }

  get alive(): boolean {
    return this.exited === undefined && this.child.exitCode === null && this.child.signalCode === null;
  }

  /** Resident set size from /proc (Linux), MiB; undefined elsewhere. */
  rssMiB(): number | undefined {
    try {
      const status = readFileSync(`/proc/${this.pid}/status`, 'utf8');
      const kb = /VmRSS:\s+(\d+) kB/.exec(status)?.[1];
      return kb === undefined ? undefined : Number(kb) / 1024;
    } catch {
      return undefined;
    }
  }

  /** Waits up to `ms` for the process to exit (a failing stream may be the first sign of a dying server). */
  async settle(ms: number): Promise<void> {
    if (!this.alive) return;
    await new Promise<void>((resolve) => {
      const timer = setTimeout(resolve, ms);
      this.child.once('exit', () => { clearTimeout(timer); resolve(); });
    });
  }

  tail(): string {
    return this.output.split('\n').slice(-40).join('\n');
  }

  describeExit(): string {
    const e = this.exited;
    return e ? `the server process exited (code ${e.code}, signal ${e.signal})` : 'the server process is alive';
  }

  async waitReady(timeoutMs: number): Promise<void> {
    const deadline = Date.now() + timeoutMs;
    while (Date.now() < deadline) {
      if (!this.alive) throw new Error(`${this.describeExit()} before it was ready`);
      try {
        const response = await fetch(`${this.url}/health`);
        const body = await response.json() as { ready?: boolean };
        if (body.ready === true) return;
      } catch {
        // Not listening yet.
      }
      await sleep(250);
    }
    throw new Error(`the server was not ready after ${timeoutMs / 1000} s`);
  }

  async stop(): Promise<void> {
    if (!this.alive) return;
    const exited = new Promise<void>((resolve) => this.child.once('exit', () => resolve()));
    this.child.kill('SIGINT');
    const timer = setTimeout(() => this.child.kill('SIGKILL'), 15_000);
    await exited;
    clearTimeout(timer);
  }
}

function sleep(ms: number): Promise<void> {
  return new Promise((resolve) => setTimeout(resolve, ms));
}

function freePort(): Promise<number> {
  return new Promise((resolve, reject) => {
    const server = createServer();
    server.once('error', reject);
    server.listen(0, '127.0.0.1', () => {
      const address = server.address();
      server.close(() => (typeof address === 'object' && address ? resolve(address.port) : reject(new Error('no port'))));
    });
  });
}

// ---------------------------------------------------------------------------------------------------------------
// Requests

interface Job {
  prompt: string;
  maxTokens: number;
}

interface StreamResult {
  text: string;
  done: boolean;
  completionTokens: number | undefined;
  finishReason: string | null;
}

function body(job: Job, stream: boolean): string {
  return JSON.stringify({
    prompt: job.prompt, max_tokens: job.maxTokens, temperature: 0, ignore_eos: true,
    ...(stream ? { stream: true, stream_options: { include_usage: true } } : {}),
  });
}

async function complete(url: string, job: Job): Promise<{ text: string; completionTokens: number }> {
  const response = await fetch(`${url}/v1/completions`, { method: 'POST', headers: { 'Content-Type': 'application/json' }, body: body(job, false) });
  const text = await response.text();
  if (response.status !== 200) throw new Error(`non-streamed request answered ${response.status}: ${text.slice(0, 500)}`);
  const parsed = JSON.parse(text) as { choices: { text: string }[]; usage: { completion_tokens: number } };
  return { text: parsed.choices[0]!.text, completionTokens: parsed.usage.completion_tokens };
}

async function stream(url: string, job: Job): Promise<StreamResult> {
  const response = await fetch(`${url}/v1/completions`, { method: 'POST', headers: { 'Content-Type': 'application/json' }, body: body(job, true) });
  if (response.status !== 200) throw new Error(`streamed request answered ${response.status}: ${(await response.text()).slice(0, 500)}`);
  const result: StreamResult = { text: '', done: false, completionTokens: undefined, finishReason: null };
  const decoder = new TextDecoder();
  let buffer = '';
  const handle = (event: string) => {
    for (const line of event.split('\n')) {
      if (!line.startsWith('data: ')) continue;
      const data = line.slice(6);
      if (data === '[DONE]') {
        result.done = true;
        continue;
      }
      if (result.done) throw new Error('data after [DONE]');
      const chunk = JSON.parse(data) as { choices: { text: string; finish_reason: string | null }[]; usage?: { completion_tokens: number } | null; error?: unknown };
      if (chunk.error) throw new Error(`error event in the stream: ${JSON.stringify(chunk.error)}`);
      if (chunk.usage) result.completionTokens = chunk.usage.completion_tokens;
      for (const choice of chunk.choices) {
        result.text += choice.text;
        result.finishReason = choice.finish_reason ?? result.finishReason;
      }
    }
  };
  for await (const bytes of response.body!) {
    buffer += decoder.decode(bytes as Uint8Array, { stream: true });
    let end: number;
    while ((end = buffer.indexOf('\n\n')) >= 0) {
      handle(buffer.slice(0, end));
      buffer = buffer.slice(end + 2);
    }
  }
  if (buffer.trim() !== '') handle(buffer);
  return result;
}

/** Streams `job` and checks it against the non-streamed reference; returns the completion tokens. */
async function checkedStream(server: ServerProcess, job: Job, expected: { text: string; completionTokens: number }, label: string): Promise<number> {
  let result: StreamResult;
  try {
    result = await stream(server.url, job);
  } catch (error) {
    await server.settle(2000);
    throw new Error(`${label}: ${(error as Error).message}; ${server.describeExit()}`);
  }
  if (!result.done) {
    await server.settle(2000);
    throw new Error(`${label}: the stream ended without [DONE]; ${server.describeExit()}`);
  }
  if (result.text !== expected.text) {
    let at = 0;
    while (at < result.text.length && result.text[at] === expected.text[at]) at++;
    throw new Error(`${label}: streamed text differs from the non-streamed text at character ${at} `
      + `(streamed ${JSON.stringify(result.text.slice(at, at + 40))}, non-streamed ${JSON.stringify(expected.text.slice(at, at + 40))})`);
  }
  if (result.completionTokens !== expected.completionTokens) {
    throw new Error(`${label}: streamed usage says ${result.completionTokens} completion tokens, non-streamed ${expected.completionTokens}`);
  }
  return expected.completionTokens;
}

const PROMPTS = [
  'Once upon a time',
  'One day, a little girl named Lily found a needle in her room.',
  'The sun was shining and',
  'Tom and his dog went to the park. They saw a big tree and',
  'Hello',
  'There was a small bird who could not fly. Every morning it watched the other birds and',
  'Mom said',
  'In a quiet town by the sea, an old man kept a boat that nobody had ever seen leave the harbour. One winter night,',
];

function seededRandom(seed: number): () => number {
  let s = (seed >>> 0) || 1;
  return () => {
    s ^= s << 13; s >>>= 0;
    s ^= s >>> 17;
    s ^= s << 5; s >>>= 0;
    return s / 2 ** 32;
  };
}

// ---------------------------------------------------------------------------------------------------------------
// One model

interface ModelFigures {
  model: string;
  sequentialStreams: number;
  sequentialTokens: number;
  sequentialSeconds: number;
  burstStreams: number;
  burstTokens: number;
  burstSeconds: number;
  referenceSeconds: number;
  totalSeconds: number;
  rssMiB: number | undefined;
}

async function soakModel(name: string, modelArgs: string[], options: SoakOptions, sequential: number, bursts: number): Promise<ModelFigures> {
  const port = await freePort();
  const url = `http://127.0.0.1:${port}`;
  const started = performance.now();
  const server = new ServerProcess(url, ['--port', String(port), '--log-level', 'warn', ...modelArgs, ...options.serveArgs]);
  try {
    await server.waitReady(180_000);
    const references = new Map<string, { text: string; completionTokens: number }>();
    let referenceMs = 0;
    const reference = async (job: Job) => {
      const key = `${job.maxTokens}\u0000${job.prompt}`;
      let expected = references.get(key);
      if (!expected) {
        const t0 = performance.now();
        try {
          expected = await complete(url, job);
        } catch (error) {
          throw new Error(`${name}: reference for ${JSON.stringify(job.prompt.slice(0, 30))}: ${(error as Error).message}; ${server.describeExit()}`);
        }
        referenceMs += performance.now() - t0;
        references.set(key, expected);
      }
      return expected;
    };

    // 1. Sequential long streams.
    const sequentialJob: Job = { prompt: PROMPTS[0]!, maxTokens: options.maxTokens };
    const sequentialExpected = sequential > 0 ? await reference(sequentialJob) : undefined;
    let sequentialTokens = 0;
    const t1 = performance.now();
    for (let i = 0; i < sequential; i++) {
      sequentialTokens += await checkedStream(server, sequentialJob, sequentialExpected!, `${name}: sequential stream ${i + 1}/${sequential}`);
    }
    const sequentialSeconds = (performance.now() - t1) / 1000;
    console.log(`  ${name}: ${sequential} sequential streams, ${sequentialTokens} tokens in ${sequentialSeconds.toFixed(1)} s`
      + (sequentialExpected ? ` (${sequentialExpected.completionTokens} tokens each)` : ''));

    // 2. Bursts of concurrent streams, mixed prompts and lengths; references first, one at a time.
    const random = seededRandom(options.seed);
    let burstTokens = 0;
    let burstSeconds = 0;
    for (let b = 0; b < bursts; b++) {
      const jobs: Job[] = Array.from({ length: options.burst }, () => ({
        prompt: PROMPTS[Math.floor(random() * PROMPTS.length)]!,
        maxTokens: 1 + Math.floor(random() ** 2 * options.maxTokens),
      }));
      const expected: { text: string; completionTokens: number }[] = [];
      for (const job of jobs) expected.push(await reference(job));
      const t2 = performance.now();
      const counts = await Promise.all(jobs.map((job, i) => checkedStream(server, job, expected[i]!,
        `${name}: burst ${b + 1}/${bursts}, stream ${i + 1}/${jobs.length} (max_tokens ${job.maxTokens})`)));
      burstSeconds += (performance.now() - t2) / 1000;
      burstTokens += counts.reduce((sum, n) => sum + n, 0);
    }
    console.log(`  ${name}: ${bursts} bursts of ${options.burst} concurrent streams, ${burstTokens} tokens in ${burstSeconds.toFixed(1)} s`);

    if (!server.alive) throw new Error(`${name}: ${server.describeExit()}`);
    const health = await fetch(`${url}/health`);
    if (health.status !== 200) throw new Error(`${name}: /health answered ${health.status} at the end: ${await health.text()}`);
    const rssMiB = server.rssMiB();
    console.log(`  ${name}: server alive (pid ${server.pid}), RSS ${rssMiB === undefined ? 'unknown' : `${rssMiB.toFixed(0)} MiB`}`);
    return {
      model: name, sequentialStreams: sequential, sequentialTokens, sequentialSeconds,
      burstStreams: options.burst * bursts, burstTokens, burstSeconds,
      referenceSeconds: referenceMs / 1000, totalSeconds: (performance.now() - started) / 1000, rssMiB,
    };
  } catch (error) {
    console.error(`soak failed: ${(error as Error).message}`);
    // Give a dying process a moment to finish writing its last words.
    await server.settle(2000);
    console.error(`-- ${server.describeExit()}; its last output:\n${server.tail()}`);
    throw error;
  } finally {
    await server.stop();
  }
}

async function main(): Promise<number> {
  let options: SoakOptions;
  try {
    options = parseOptions(process.argv.slice(2));
  } catch (error) {
    console.error(`error: ${(error as Error).message}`);
    return 2;
  }
  const { sequential, bursts } = options;
  console.log(`== soak: ${options.maxTokens}-token sequential streams (stories260K ${sequential.stories}, built-in `
    + `${sequential.builtin}), bursts of ${options.burst} concurrent streams (stories260K ${bursts.stories}, built-in ${bursts.builtin}), seed ${options.seed}`);
  const figures: ModelFigures[] = [];
  const started = performance.now();
  for (const model of options.models) {
    let args: string[];
    let name: string;
    const key = model as 'stories' | 'builtin';
    if (model === 'stories') {
      const path = join(SHARED_MODELS_DIR, 'stories260K.gguf');
      if (!existsSync(path)) {
        console.log(`  skipped stories260K: needs stories260K.gguf from ${SHARED_MODELS_DIR} (../shared/models), which is absent`);
        continue;
      }
      args = ['--model', path];
      name = 'stories260K';
    } else {
      args = [];
      name = 'built-in model';
    }
    try {
      figures.push(await soakModel(name, args, options, sequential[key], bursts[key]));
    } catch {
      return 1;
    }
  }
  for (const f of figures) {
    console.log(`  ${f.model}: ${f.totalSeconds.toFixed(1)} s in all (start, ${f.referenceSeconds.toFixed(1)} s of non-streamed `
      + `references, ${f.sequentialSeconds.toFixed(1)} s sequential at ${(f.sequentialTokens / Math.max(f.sequentialSeconds, 1e-9)).toFixed(0)} tok/s, `
      + `${f.burstSeconds.toFixed(1)} s of bursts at ${(f.burstTokens / Math.max(f.burstSeconds, 1e-9)).toFixed(0)} tok/s)`);
  }
  console.log(`== soak passed in ${((performance.now() - started) / 1000).toFixed(1)} s`);
  return 0;
}

process.exitCode = await main();
