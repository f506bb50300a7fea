// llama.cpp through its C API (llama-c-bench.cpp in a child process): the same prebuilt libraries that
// node-llama-cpp loads, driven as llama.cpp's own server drives them, with no JavaScript between steps. This is
// the fair ceiling for llama.cpp on this machine; the node-llama-cpp figures show what its JS layer costs.
//
// The binary is built on first use (and again when its source changes) from the headers of the llama.cpp
// source node-llama-cpp ships (llama/gitRelease.bundle) and linked to its bins/: it needs `npm install` in this
// folder, git and g++. Times come from the child's steady clock, from the moment it reads a run command: the
// pipe in front of it (well under a millisecond) is not counted.
import { execFileSync, spawn, type ChildProcessWithoutNullStreams } from 'node:child_process';
import { existsSync, mkdirSync, readdirSync, rmSync, statSync, writeFileSync } from 'node:fs';
import { dirname, join } from 'node:path';
import { createInterface, type Interface } from 'node:readline';
import { fileURLToPath } from 'node:url';

import { trackChildCpu, type GenRequest, type RequestTrace, type Runner } from './harness.ts';

const HERE = dirname(fileURLToPath(import.meta.url));
const BUILD_DIR = join(HERE, 'build');
const BINARY = join(BUILD_DIR, 'llama-c-bench');
const SOURCE = join(HERE, 'llama-c-bench.cpp');
const PLATFORM = `${process.platform}-${process.arch}`;
const BINS_DIR = join(HERE, 'node_modules', '@node-llama-cpp', PLATFORM, 'bins', PLATFORM);
const BUNDLE = join(HERE, 'node_modules', 'node-llama-cpp', 'llama', 'gitRelease.bundle');

/** Why the C API runner cannot run here, or undefined when it can. */
export function capiUnavailableReason(): string | undefined {
  if (!existsSync(BINS_DIR)) return `${BINS_DIR} is missing (npm install in benchmarks/peer installs it)`;
  if (!existsSync(BUNDLE)) return `${BUNDLE} is missing (npm install in benchmarks/peer installs it)`;
  return undefined;
}

/** Builds the driver unless an up-to-date one exists; returns its path. */
export function buildCApiDriver(force = false): string {
  if (!force && existsSync(BINARY) && statSync(BINARY).mtimeMs > statSync(SOURCE).mtimeMs) return BINARY;
  const reason = capiUnavailableReason();
  if (reason) throw new Error(reason);
  const include = join(BUILD_DIR, 'include');
  const repo = join(BUILD_DIR, 'llama.cpp.git');
  rmSync(include, { recursive: true, force: true });
  mkdirSync(include, { recursive: true });
  if (!existsSync(repo)) execFileSync('git', ['init', '-q', '--bare', repo]);
  execFileSync('git', ['--git-dir', repo, 'fetch', '-q', BUNDLE, 'HEAD']);
  const headers = execFileSync('git', ['--git-dir', repo, 'ls-tree', '--name-only', 'FETCH_HEAD', 'include/', 'ggml/include/'],
    { encoding: 'utf8' }).split('\n').filter((path) => path.endsWith('.h'));
  for (const path of headers) {
    writeFileSync(join(include, path.split('/').at(-1)!),
      execFileSync('git', ['--git-dir', repo, 'show', `FETCH_HEAD:${path}`], { maxBuffer: 64 << 20 }));
  }
  const libraries = readdirSync(BINS_DIR).filter((f) => /^lib(llama\.v|ggml\.v|ggml-base\.)/.test(f)).map((f) => join(BINS_DIR, f));
  execFileSync('g++', ['-O2', '-std=c++17', '-I', include, SOURCE, '-o', BINARY, ...libraries, `-Wl,-rpath,${BINS_DIR}`],
    { stdio: 'inherit' });
  return BINARY;
}

export class LlamaCApiRunner implements Runner {
  readonly name = 'llama.cpp C API';
  private readonly lines: AsyncIterator<string>;

  private constructor(private readonly child: ChildProcessWithoutNullStreams, private readonly reader: Interface,
    readonly description: string, lines: AsyncIterator<string>) {
    this.lines = lines;
  }

  /** Starts a driver holding `sequences` sequences of `contextSize` tokens each (one per request in flight). */
  static async start(modelPath: string, threads: number, sequences: number, contextSize: number): Promise<LlamaCApiRunner> {
    const child = spawn(buildCApiDriver(), [modelPath, BINS_DIR, String(threads), String(sequences), String(contextSize), '0']);
    trackChildCpu(child.pid!);
    let stderr = '';
    child.stderr.on('data', (chunk: Buffer) => { stderr += chunk.toString(); });
    const reader = createInterface({ input: child.stdout });
    const lines = reader[Symbol.asyncIterator]();
    const first = await lines.next();
    if (first.done || !first.value.startsWith('ready ')) {
      child.kill();
      throw new Error(`llama-c-bench did not start: ${first.done ? stderr.trim() : first.value}`);
    }
    return new LlamaCApiRunner(child, reader, first.value.slice('ready '.length), lines);
  }

  async run(requests: readonly GenRequest[], concurrency: number): Promise<RequestTrace[]> {
    const body = requests.map((r) => `${r.maxTokens} ${r.prompt.length} ${r.prompt.join(' ')}`).join('\n');
    this.child.stdin.write(`run ${concurrency} ${requests.length}\n${body}\n`);
    const traces: RequestTrace[] = requests.map(() => ({ submittedMs: 0, tokenMs: [] }));
    for (;;) {
      const next = await this.lines.next();
      if (next.done) throw new Error('llama-c-bench exited during a run');
      const [kind, ...fields] = next.value.split(' ');
      if (kind === 'done') return traces;
      if (kind !== 'trace') throw new Error(`llama-c-bench: ${next.value}`);
      const [index, submitted, cached, ...times] = fields.map(Number);
      traces[index!] = { submittedMs: submitted!, cachedTokens: cached!, tokenMs: times };
    }
  }

  async close(): Promise<void> {
    const exited = new Promise<void>((resolve) => this.child.once('exit', () => resolve()));
    this.child.stdin.end('quit\n');
    await exited;
    this.reader.close();
  }
}
