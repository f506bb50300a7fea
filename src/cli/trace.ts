// `conduit trace <id>`: one finished request's phase waterfall and bottleneck diagnosis, fetched from a running
// server's GET /v1/requests/{id}/trace. The id is the one the response carried (its `id`, and the x-request-id
// header): chatcmpl-..., cmpl-... or resp_..., or the client's own id (its X-Request-Id header, else the body's
// request_id). The whole answer must come within --timeout (10 s by default).

import { apiRoot } from '../bench/client.ts';
import { flagLabel, formatFlagHelp, nameEnvironment, parseFlags, UsageError, type FlagTable, type ParsedFlags } from './flags.ts';
import type { Command } from './main.ts';

export const TRACE_FLAGS = {
  url: { type: 'string', help: 'base URL of the server (user:password@ in it is sent as Basic authentication unless --api-key is given, as `conduit bench` does; ports fetch blocks, such as 1 or 6000, cannot be reached)', default: 'http://127.0.0.1:8000' },
  'api-key': { type: 'string', help: 'API key, when the server has keys configured' },
  json: { type: 'boolean', help: 'print the trace as JSON (the endpoint\'s body) instead of the waterfall', env: 'CONDUIT_TRACE_JSON' },
  timeout: { type: 'number', help: 'seconds to wait for the server\'s whole answer', default: 10, env: 'CONDUIT_TRACE_TIMEOUT' },
  help: { type: 'boolean', help: 'show this help', short: 'h' },
} satisfies FlagTable;

const USAGE = 'Usage: conduit trace <request id> [options]';

/** The parts of the endpoint's body this command prints. */
interface TraceBody {
  waterfall?: string;
  analysis?: {
    category: string;
    dominant_phase: string;
    dominant_share: number;
    /** What the share is of: TTFT, the whole request, or the decode steps' time (a server before this field: absent). */
    dominant_share_of?: 'ttft' | 'request' | 'decode_steps' | null;
    dominant_ms: number;
    recommendation: string;
  };
  timings?: Record<string, unknown>;
}

const SHARE_OF = { ttft: ' of TTFT', request: ' of the request', decode_steps: ' of the decode steps\' time' } as const;

/** The analysis as lines under the waterfall. */
export function formatAnalysis(analysis: NonNullable<TraceBody['analysis']>): string {
  const lines = [`bottleneck: ${analysis.category}`];
  if (analysis.dominant_phase !== 'none') {
    const of = analysis.dominant_share_of ? SHARE_OF[analysis.dominant_share_of] ?? '' : '';
    lines[0] += ` (${analysis.dominant_phase}: ${(analysis.dominant_share * 100).toFixed(0)}%${of}, ${analysis.dominant_ms.toFixed(1)} ms)`;
  }
  lines.push(`  ${analysis.recommendation}`);
  return lines.join('\n');
}

/** A URL's user or password as typed, its %XX escapes decoded (a stray % left as it is: it decodes to nothing else). */
function decodedUserinfo(text: string): string {
  try {
    return decodeURIComponent(text);
  } catch {
    return text;
  }
}

/** Why a fetch of `url` failed, in words: connection refused, unknown host, ... */
function connectionProblem(err: unknown, url: URL): string {
  const cause = (err as { cause?: { code?: string; message?: string } }).cause;
  if (cause?.code === 'ECONNREFUSED') return 'connection refused (is `conduit serve` running there?)';
  if (cause?.code === 'ENOTFOUND') return 'host not found';
  // fetch refuses the ports browsers block (1, 9, 25, 6000, ...: other protocols' ports, by the Fetch standard)
  // before any connection, and said only "bad port".
  if (cause?.message === 'bad port') {
    return `port ${url.port} is blocked by the HTTP client (fetch refuses it, as browsers do, as another protocol's port); serve on another port`;
  }
  return cause?.message ?? (err instanceof Error ? err.message : String(err));
}

export const traceCommand: Command = {
  summary: 'print a finished request\'s phase waterfall and bottleneck',
  async run(argv) {
    const parsed = parseFlags(TRACE_FLAGS, argv);
    try {
      return await showTrace(parsed);
    } catch (err) {
      // A value nobody typed is reported under the variable that gave it (CONDUIT_TRACE_TIMEOUT (--timeout) must be ...).
      throw nameEnvironment(TRACE_FLAGS, parsed, err);
    }
  },
};

/** Fetches and prints the trace the parsed flags ask for. */
async function showTrace(parsed: ParsedFlags<typeof TRACE_FLAGS>): Promise<number> {
  const { values, positionals } = parsed;
  if (values.help) {
    console.log(`${USAGE}\n\n${formatFlagHelp(TRACE_FLAGS)}`);
    return 0;
  }
  if (positionals.length !== 1) throw new UsageError(positionals.length === 0 ? `a request id is needed\n${USAGE}` : `one request id at a time\n${USAGE}`);
  const id = positionals[0]!;
  if (id === '') throw new UsageError(`the request id is empty\n${USAGE}`);
  const timeoutSec = values.timeout!;
  // Node's timers hold at most 2^31 - 1 ms: a longer timeout would fire at once.
  if (!(timeoutSec > 0 && timeoutSec * 1000 <= 2 ** 31 - 1)) {
    throw new UsageError(`--timeout must be in (0, ${Math.floor((2 ** 31 - 1) / 1000)}] seconds, got ${timeoutSec}`);
  }
  let base: URL | undefined;
  try {
    base = new URL(values.url!);
  } catch {
    // Refused below.
  }
  // "localhost:8000" parses, as a URL of scheme "localhost:".
  if (base === undefined || (base.protocol !== 'http:' && base.protocol !== 'https:')) {
    throw new UsageError(`--url must be a URL like http://127.0.0.1:8000, got "${values.url}"`);
  }
  // Credentials in the URL (http://user:pw@host, for a proxy in front of the server) go as Basic authentication, as
  // `conduit bench` (node:http) sends them: fetch refuses a URL that holds any. An --api-key's Bearer takes their place, as there.
  const basicAuth = base.username !== '' || base.password !== ''
    ? `Basic ${Buffer.from(`${decodedUserinfo(base.username)}:${decodedUserinfo(base.password)}`).toString('base64')}` : undefined;
  base.username = '';
  base.password = '';
  // The server's root, or its /v1 as OpenAI clients' base URLs end (http://host:8000/v1): the endpoint is under /v1.
  const url = new URL(`${apiRoot(base.pathname)}/v1/requests/${encodeURIComponent(id)}/trace`, base);
  const headers: Record<string, string> = { Accept: 'application/json' };
  if (values['api-key']) headers.Authorization = `Bearer ${values['api-key']}`;
  else if (basicAuth !== undefined) headers.Authorization = basicAuth;

  // The whole answer, its body included, within the timeout: a server that accepts and never answers (or stops
  // half-way) is reported, where fetch alone waits minutes for the headers and for ever for the body.
  const signal = AbortSignal.timeout(timeoutSec * 1000);
  const timedOut = (err: unknown): boolean => (err as Error | undefined)?.name === 'TimeoutError';
  const noAnswer = `conduit trace: no answer from ${base.origin} within ${timeoutSec} s (${flagLabel(TRACE_FLAGS, parsed, 'timeout')})`;
  let res: Response;
  let text: string;
  try {
    res = await fetch(url, { headers, signal });
  } catch (err) {
    console.error(timedOut(err) ? noAnswer : `conduit trace: cannot reach ${base.origin}: ${connectionProblem(err, base)}`);
    return 1;
  }
  try {
    text = await res.text();
  } catch (err) {
    console.error(timedOut(err) ? noAnswer : `conduit trace: ${base.origin} broke off its answer: ${connectionProblem(err, base)}`);
    return 1;
  }
  let body: unknown;
  try {
    body = JSON.parse(text);
  } catch {
    console.error(`conduit trace: ${url.href} answered ${res.status} with something other than JSON: ${text.slice(0, 200)}`);
    return 1;
  }
  if (!res.ok) {
    const message = (body as { error?: { message?: string } }).error?.message ?? text.slice(0, 200);
    if (res.status === 404) console.error(`conduit trace: no trace for ${id} at ${base.origin}: ${message}`);
    else if (res.status === 401) console.error(`conduit trace: ${base.origin} wants an API key (--api-key or CONDUIT_API_KEY): ${message}`);
    else console.error(`conduit trace: ${base.origin} answered ${res.status}: ${message}`);
    return 1;
  }
  if (values.json) {
    console.log(JSON.stringify(body, null, 2));
    return 0;
  }
  const trace = body as TraceBody;
  const parts = [trace.waterfall?.trimEnd() ?? '(no waterfall in the answer)'];
  if (trace.analysis) parts.push('', formatAnalysis(trace.analysis));
  console.log(parts.join('\n'));
  return 0;
}
