// What the web console's refresh costs the server under load: `conduit serve` (the built-in model by default) in
// this process, `conduit bench` streaming against it from a child process, and /console/api/overview polled the
// way an open console page polls it. Each poll's work on the server's event loop (building the overview, and
// serializing it to JSON) is timed inside the server, and the run is repeated without polling so the bench's own
// figures can be compared. Rounds alternate (off, on, off, on ...) because the machine may be shared.
//
//   node --import tsx benchmarks/console-refresh.ts --streams 256 --requests 512 --interval-ms 2000 --rounds 2
//   (any further arguments after -- go to `conduit serve`)

import { spawn } from 'node:child_process';
import { loadavg } from 'node:os';
import { performance } from 'node:perf_hooks';
import { parseArgs } from 'node:util';
import { silentLogger } from '../src/util/log.ts';
import { parseServeConfig, startServer } from '../src/cli/serve.ts';
import { distribution } from '../src/util/stats.ts';

const { values, positionals } = parseArgs({
  options: {
    streams: { type: 'string', default: '256' },
    requests: { type: 'string', default: '512' },
    'output-tokens': { type: 'string', default: '32' },
    'prompt-tokens': { type: 'string', default: '64' },
    'interval-ms': { type: 'string', default: '2000' },
    rounds: { type: 'string', default: '2' },
    port: { type: 'string', default: '8471' },
  },
  allowPositionals: true,
});

const config = parseServeConfig(['--port', values.port!, '--log-level', 'silent', '--no-request-log', '--max-pending-requests', '1024',
  ...positionals], process.env);
if (config === 'help') process.exit(0);
const running = await startServer(config, silentLogger);
const webConsole = running.api.webConsole;

// Time the overview's build and its serialization where they run: on the server's event loop.
const buildMs: number[] = [];
const jsonMs: number[] = [];
const bytes: number[] = [];
const original = webConsole.overview.bind(webConsole);
webConsole.overview = (caller, nowMs) => {
  const t0 = performance.now();
  const reply = original(caller, nowMs);
  const t1 = performance.now();
  const text = JSON.stringify(reply.body);
  const t2 = performance.now();
  buildMs.push(t1 - t0);
  jsonMs.push(t2 - t1);
  bytes.push(Buffer.byteLength(text));
  return reply;
};

interface BenchJson {
  summary: { numOk: number; outputTokensPerSec: number; ttftMs: { p50: number; p99: number }; itlMs: { p50: number; p99: number } };
}

function bench(): Promise<BenchJson> {
  const child = spawn(process.execPath, ['bin/conduit.js', 'bench', '--url', running.url, '--stream', '--ignore-eos', '--json', '--no-progress',
    '--concurrency', values.streams!, '--requests', values.requests!, '--output-tokens', values['output-tokens']!,
    '--prompt-tokens', values['prompt-tokens']!], { stdio: ['ignore', 'pipe', 'inherit'] });
  let out = '';
  child.stdout.on('data', (chunk: Buffer) => { out += chunk.toString(); });
  return new Promise((resolve, reject) => {
    child.on('exit', (code) => (code === 0 ? resolve(JSON.parse(out) as BenchJson) : reject(new Error(`bench exited ${code}`))));
  });
}

async function round(poll: boolean): Promise<{ bench: BenchJson; polls: number; pollHttpMs: number[] }> {
  const pollHttpMs: number[] = [];
  let stop = false;
  const poller = (async () => {
    while (poll && !stop) {
      const t0 = performance.now();
      const res = await fetch(`${running.url}/console/api/overview`);
      await res.arrayBuffer();
      pollHttpMs.push(performance.now() - t0);
      await new Promise((resolve) => setTimeout(resolve, Number(values['interval-ms'])));
    }
  })();
  const result = await bench();
  stop = true;
  await poller;
  return { bench: result, polls: pollHttpMs.length, pollHttpMs };
}

const fmt = (x: number) => x.toFixed(2);
console.log(`console refresh cost: ${values.streams} streams, ${values.requests} requests of ${values['output-tokens']} tokens, poll every ${values['interval-ms']} ms`);
console.log(`load average at start: ${loadavg().map((x) => x.toFixed(2)).join(' ')}`);
for (let r = 0; r < Number(values.rounds); r++) {
  for (const poll of [false, true]) {
    const before = buildMs.length;
    const { bench: b, polls, pollHttpMs } = await round(poll);
    const s = b.summary;
    let line = `round ${r + 1} polling ${poll ? 'on ' : 'off'}: ok ${s.numOk}, ${fmt(s.outputTokensPerSec)} output tok/s, TTFT p50 ${fmt(s.ttftMs.p50)} p99 ${fmt(s.ttftMs.p99)} ms, ITL p50 ${fmt(s.itlMs.p50)} p99 ${fmt(s.itlMs.p99)} ms`;
    if (poll) {
      const build = distribution(buildMs.slice(before));
      const json = distribution(jsonMs.slice(before));
      const http = distribution(pollHttpMs);
      line += `\n    ${polls} polls: overview build p50 ${fmt(build.p50)} max ${fmt(build.max)} ms, JSON p50 ${fmt(json.p50)} max ${fmt(json.max)} ms, `
        + `${bytes[bytes.length - 1]} bytes; poll round trip p50 ${fmt(http.p50)} max ${fmt(http.max)} ms`;
    }
    console.log(`${line}  (load ${loadavg()[0]!.toFixed(2)})`);
  }
}
await running.api.shutdown(0);
