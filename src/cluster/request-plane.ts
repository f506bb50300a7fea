// The request plane's messages: what a frontend and a worker say to each other over one TCP connection (frames.ts).
// JSON, measured against Node's structured-clone serializer on a typical streamed output (docs/distributed.md):
// about the same cost per message, and JSON is parsed into plain data only, which matters on a port reachable from
// the network. Everything received is validated here before it reaches an engine.
//
// A connection starts with the frontend's `hello` carrying the cluster token; the worker answers `welcome` (its id,
// engine info, role, the largest frame it takes) or `refused` and closes. Then:
//   frontend -> worker: gen (a request), abort, reset (prefix cache), card (the model card), snapshot (KV dump),
//                       ping (every welcome.pingMs, when the worker asked for it: see FRONTEND_SILENCE_TIMEOUT_MS),
//                       lora-load / lora-unload (answered by lora: what loading found, and from a worker that keeps
//                       its own adapters the key it gave the adapter, or how many requests an unload waits for);
//                       gen, prefill and adopt carry `sentAt`, the frontend's clock when sent (clock-offset.ts)
//   worker -> frontend: out (outputs + stats), end, err, reset, hb (stats, every heartbeat and after each stream's
//                       end), kv (KV events, only to a connection that asked for them), snapshot, draining, and the
//                       model card as a blob frame.

import type { KvPoolLayout } from '../engine/handoff.ts';
import { timingSafeEqual, createHash } from 'node:crypto';
import type { EngineInfo, EngineRequest, GuidedDecoding, SamplingParams, WorkerRole } from '../engine/types.ts';
import { KV_LOWER_TIERS, parseKvEvent, type BlockHash, type KvEvent, type KvLowerTier, parseBlockHash } from '../protocols/kv-events.ts';
import type { EngineStats, KvTiersStats } from '../protocols/worker.ts';
import { FrameError, FRAME_JSON } from './frames.ts';

/**
 * The protocol's version, checked at hello: a worker refuses a frontend of another version (and says which it
 * speaks) before any request is sent, rather than closing the connection on a message it does not know.
 *   1: requests, KV events, snapshots, the model card, disaggregation (prefill, expect, adopt, release);
 *   2: lora-load / lora-unload (LoRA adapters loaded and unloaded on a worker).
 * A field added to a message that a peer of the same version may lack (the welcome's maxFrameBytes) keeps the version:
 * the side that reads it does without it when it is absent.
 */
export const REQUEST_PLANE_VERSION = 2;
/** The largest frame a connection may send before it authenticated (its hello). */
export const MAX_HELLO_BYTES = 64 * 1024;
/** A worker sends its stats at least this often; a connection silent for HEARTBEAT_TIMEOUT_MS is lost. */
export const HEARTBEAT_MS = 500;
export const HEARTBEAT_TIMEOUT_MS = 5000;
/**
 * The other direction: a frontend whose hello says it pings (`ping: true`) is sent a welcome with `pingMs`, and pings
 * that often; a worker that hears nothing on such a connection for this long takes the frontend for gone (its host
 * vanished, a partition) and stops its requests, freeing their KV blocks. The worker's own heartbeats keep the
 * connection busy, so TCP keepalive never probes it and only the retransmission timeout (minutes) would end it. Both
 * fields are additions within the version: a worker of an earlier release sends no pingMs (nothing is pinged), and a
 * frontend of an earlier release says nothing of pings (its connections are not timed).
 */
// Longer than HEARTBEAT_TIMEOUT_MS: the worker cannot tell a frontend whose event loop stalled (a long render or
// garbage collection) from one that is gone, and closing every connection of a live frontend stops all its requests.
export const FRONTEND_SILENCE_TIMEOUT_MS = 15_000;

/** How often a frontend pings a worker whose silence timeout is `timeoutMs`: several pings fit in it. */
export function frontendPingMs(timeoutMs: number): number {
  return Math.max(1, Math.min(HEARTBEAT_MS, Math.floor(timeoutMs / 4)));
}

/** An EngineRequest as JSON carries it: logitBias as [tokenId, bias] pairs. */
export type WireRequest = Omit<EngineRequest, 'sampling'> & {
  sampling: Omit<SamplingParams, 'logitBias'> & { logitBias?: [number, number][] };
};

export function toWireRequest(request: EngineRequest): WireRequest {
  const { logitBias, ...sampling } = request.sampling;
  return { ...request, sampling: { ...sampling, ...(logitBias ? { logitBias: [...logitBias] } : {}) } };
}

export interface Welcome {
  t: 'welcome';
  v: number;
  workerId: string;
  role: WorkerRole;
  info: EngineInfo;
  stats: EngineStats;
  draining: boolean;
  /** A prefill worker's KV port (src/cluster/kv-tcp.ts), on the host of its request-plane address. */
  kvPort?: number;
  /** The worker's KV pool layout (prefill and decode workers). */
  kvLayout?: KvPoolLayout;
  /**
   * The largest frame the worker takes after the hello (its --max-frame-bytes): the frontend refuses a request whose
   * frame is larger before sending it. Absent from a worker of an earlier release (same version: an added field),
   * to which the frontend sends as before.
   */
  maxFrameBytes?: number;
  /**
   * How often the frontend is to send a `ping` (ms): given only to a frontend whose hello said it pings; the worker
   * then closes the connection after FRONTEND_SILENCE_TIMEOUT_MS (or its configured timeout) of silence.
   */
  pingMs?: number;
}

/**
 * The refusal of a request whose frame is over a worker's limit, as the client reads it (the frontend's engine error
 * gives the request's id in front of it).
 */
export function frameOverLimit(bytes: number, workerId: string, limit: number): string {
  return `the request is too large for the engine worker: its request-plane frame of ${bytes} bytes is over worker `
    + `${workerId}'s limit of ${limit} bytes (--max-frame-bytes)`;
}

/** How much of an oversized frame a worker reads to name the request it carries (see oversizedRequest). */
export const OVERSIZED_HEAD_BYTES = 16 * 1024;

/** How the frames oversizedRequest reads begin (after the kind byte). */
const OVERSIZED_REQUEST_STARTS = ['{"t":"gen","request":{', '{"t":"prefill","request":{'];

/**
 * Whether the first bytes of an oversized frame (its kind byte and the payload so far) may still be a request
 * oversizedRequest can name: a JSON frame beginning as a `gen` or `prefill` does. Anything else is refused without
 * waiting for the rest of its head.
 */
export function mayBeOversizedRequest(partialHead: Buffer): boolean {
  if (partialHead.length === 0) return true;
  if (partialHead[0] !== FRAME_JSON) return false;
  const text = partialHead.subarray(1).toString('latin1');
  return OVERSIZED_REQUEST_STARTS.some((start) => (text.length <= start.length ? start.startsWith(text) : text.startsWith(start)));
}

/**
 * The request an oversized `gen` or `prefill` frame carries, read from the first bytes of its payload (after the kind
 * byte): its type and request id, or undefined when they cannot be read there. Frontends write `{"t":"gen","request":{...` with the request's
 * fields in order; the id comes after a few scalar fields (priority, arrival, tenant, trace context, ...), so the
 * fields before it are read one by one, and anything else there (an object, an array) gives up.
 */
export function oversizedRequest(head: Buffer): { t: 'gen' | 'prefill'; id: string } | undefined {
  const text = head.toString('utf8');
  const start = /^\{"t":"(gen|prefill)","request":\{/.exec(text);
  if (!start) return undefined;
  const field = /"((?:[^"\\]|\\.)*)":("(?:[^"\\]|\\.)*"|-?\d[\d.eE+-]*|true|false|null)(,|\})/y;
  field.lastIndex = start[0].length;
  for (let match = field.exec(text); match; match = field.exec(text)) {
    if (match[1] === 'id') {
      let id: unknown;
      try {
        id = JSON.parse(match[2]!);
      } catch {
        return undefined;
      }
      return typeof id === 'string' && id.length > 0 && id.length <= 256 ? { t: start[1] as 'gen' | 'prefill', id } : undefined;
    }
    if (match[3] === '}') return undefined;
  }
  return undefined;
}

/** The chat template and tokenizer a frontend needs to serve the workers' model (blob frame). */
export interface ModelCard {
  tokenizer: unknown;
  chatTemplate: { templates: [string, string][]; bosToken: string; eosToken: string; isFallback: boolean };
}

/** Compares the token in constant time (by digest, so lengths need not match). */
export function tokenMatches(expected: string, given: unknown): boolean {
  if (typeof given !== 'string') return false;
  const a = createHash('sha256').update(expected).digest();
  const b = createHash('sha256').update(given).digest();
  return timingSafeEqual(a, b);
}

// ---------------------------------------------------------------------------------------------------------------
// Validation

function bad(what: string): never {
  throw new FrameError(what);
}

function num(record: Record<string, unknown>, field: string, where: string): number {
  const value = record[field];
  if (typeof value !== 'number' || !Number.isFinite(value)) bad(`${where}.${field} must be a finite number`);
  return value;
}

function int(record: Record<string, unknown>, field: string, where: string, min = 0): number {
  const value = num(record, field, where);
  if (!Number.isSafeInteger(value) || value < min) bad(`${where}.${field} must be an integer >= ${min}`);
  return value;
}

function bool(record: Record<string, unknown>, field: string, where: string): boolean {
  const value = record[field];
  if (typeof value !== 'boolean') bad(`${where}.${field} must be true or false`);
  return value;
}

function str(record: Record<string, unknown>, field: string, where: string, maxLength = 4096): string {
  const value = record[field];
  if (typeof value !== 'string' || value.length > maxLength) bad(`${where}.${field} must be a string of at most ${maxLength} characters`);
  return value;
}

function optional<T>(record: Record<string, unknown>, field: string, read: () => T): T | undefined {
  return record[field] === undefined || record[field] === null ? undefined : read();
}

function obj(value: unknown, where: string): Record<string, unknown> {
  if (typeof value !== 'object' || value === null || Array.isArray(value)) bad(`${where} must be an object`);
  return value as Record<string, unknown>;
}

function intArray(value: unknown, where: string): number[] {
  if (!Array.isArray(value)) bad(`${where} must be an array of token ids`);
  for (const item of value) if (!Number.isSafeInteger(item) || (item as number) < 0) bad(`${where} holds a value that is not a token id`);
  return value as number[];
}

/** A request from the wire as the engine takes it; FrameError names the first bad field. */
export function parseWireRequest(value: unknown): EngineRequest {
  const r = obj(value, 'request');
  const s = obj(r.sampling, 'request.sampling');
  const w = 'request.sampling';
  const logprobs = s.logprobs === null ? null : int(s, 'logprobs', w);
  let logitBias: Map<number, number> | undefined;
  if (s.logitBias !== undefined) {
    if (!Array.isArray(s.logitBias)) bad(`${w}.logitBias must be [tokenId, bias] pairs`);
    logitBias = new Map();
    for (const pair of s.logitBias) {
      if (!Array.isArray(pair) || pair.length !== 2 || !Number.isSafeInteger(pair[0]) || typeof pair[1] !== 'number' || !Number.isFinite(pair[1])) {
        bad(`${w}.logitBias must be [tokenId, bias] pairs`);
      }
      logitBias.set(pair[0] as number, pair[1] as number);
    }
  }
  if (!Array.isArray(s.stop) || !s.stop.every((x) => typeof x === 'string')) bad(`${w}.stop must be an array of strings`);
  const seed = optional(s, 'seed', () => num(s, 'seed', w));
  const sampling: SamplingParams = {
    temperature: num(s, 'temperature', w), topP: num(s, 'topP', w), topK: num(s, 'topK', w), minP: num(s, 'minP', w),
    repetitionPenalty: num(s, 'repetitionPenalty', w), presencePenalty: num(s, 'presencePenalty', w),
    frequencyPenalty: num(s, 'frequencyPenalty', w), n: int(s, 'n', w, 1), maxTokens: int(s, 'maxTokens', w),
    minTokens: int(s, 'minTokens', w), ignoreEos: bool(s, 'ignoreEos', w), stopTokenIds: intArray(s.stopTokenIds, `${w}.stopTokenIds`),
    stop: s.stop as string[], includeStopStrInOutput: bool(s, 'includeStopStrInOutput', w), logprobs,
    skipSpecialTokens: bool(s, 'skipSpecialTokens', w),
    ...(seed !== undefined ? { seed } : {}), ...(logitBias ? { logitBias } : {}),
  };
  const promptLogprobs = optional(s, 'promptLogprobs', () => int(s, 'promptLogprobs', w));
  if (promptLogprobs !== undefined) sampling.promptLogprobs = promptLogprobs;
  const ignoredEos = optional(s, 'ignoredEosTokenIds', () => intArray(s.ignoredEosTokenIds, `${w}.ignoredEosTokenIds`));
  if (ignoredEos !== undefined) sampling.ignoredEosTokenIds = ignoredEos;
  const kept = optional(s, 'keptSpecialTokenIds', () => intArray(s.keptSpecialTokenIds, `${w}.keptSpecialTokenIds`));
  if (kept !== undefined) sampling.keptSpecialTokenIds = kept;
  const guided = optional(s, 'guided', () => parseGuided(s.guided));
  if (guided !== undefined) sampling.guided = guided;
  const request: EngineRequest = {
    id: str(r, 'id', 'request', 256), promptTokenIds: intArray(r.promptTokenIds, 'request.promptTokenIds'), sampling,
    priority: num(r, 'priority', 'request'), arrivalMs: num(r, 'arrivalMs', 'request'),
  };
  const deadlineMs = optional(r, 'deadlineMs', () => num(r, 'deadlineMs', 'request'));
  if (deadlineMs !== undefined) request.deadlineMs = deadlineMs;
  for (const field of ['tenant', 'cacheSalt', 'traceparent', 'sessionId', 'lora'] as const) {
    const text = optional(r, field, () => str(r, field, 'request', 1024));
    if (text !== undefined) request[field] = text;
  }
  const prior = optional(r, 'priorOutputTokenIds', () => intArray(r.priorOutputTokenIds, 'request.priorOutputTokenIds'));
  if (prior !== undefined) request.priorOutputTokenIds = prior;
  return request;
}

/** The longest grammar text (a JSON schema, a regex, EBNF) a request may carry: the frame limit is the real bound. */
const MAX_GRAMMAR_CHARS = 1 << 20;

/** sampling.guided from the wire; the worker compiles it (and refuses what its grammar library cannot). */
function parseGuided(value: unknown): GuidedDecoding {
  const where = 'request.sampling.guided';
  const g = obj(value, where);
  const compact = optional(g, 'compact', () => bool(g, 'compact', where));
  const withCompact = compact !== undefined ? { compact } : {};
  switch (g.kind) {
    case 'json_object':
      return { kind: 'json_object', ...withCompact };
    case 'json_schema':
      return { kind: 'json_schema', schema: str(g, 'schema', where, MAX_GRAMMAR_CHARS), ...withCompact };
    case 'regex':
      return { kind: 'regex', pattern: str(g, 'pattern', where, MAX_GRAMMAR_CHARS) };
    case 'grammar':
      return { kind: 'grammar', ebnf: str(g, 'ebnf', where, MAX_GRAMMAR_CHARS) };
    case 'choice':
      if (!Array.isArray(g.choices) || g.choices.length === 0 || !g.choices.every((c) => typeof c === 'string')) {
        bad(`${where}.choices must be a non-empty array of strings`);
      }
      return { kind: 'choice', choices: g.choices as string[] };
    default:
      return bad(`${where}.kind must be one of json_object, json_schema, regex, grammar, choice`);
  }
}

/** KV events from the wire (JSON), each validated. */
export function parseKvEvents(value: unknown): KvEvent[] {
  if (!Array.isArray(value)) bad('events must be an array');
  try {
    return value.map((event) => parseKvEvent(event));
  } catch (error) {
    throw new FrameError((error as Error).message);
  }
}

/**
 * A worker's KV cache as a frontend resyncs its router's index from it: the primary pool's block hashes, the id of
 * the last KV event they reflect and, per lower tier (RAM, disk), the block hashes it holds. `tiers` is an addition
 * within the version: a worker of an earlier release sends none, and the index then keeps its lower tiers as their
 * events left them.
 */
export interface KvSnapshot {
  lastEventId: number;
  hashes: BlockHash[];
  tiers?: Partial<Record<KvLowerTier, BlockHash[]>>;
}

/** A snapshot's `tiers` from the wire: undefined when absent (a worker of an earlier release); else each validated. */
export function parseSnapshotTiers(value: unknown): KvSnapshot['tiers'] {
  if (value === undefined) return undefined;
  if (typeof value !== 'object' || value === null || Array.isArray(value)) bad('snapshot tiers must be an object');
  const tiers: NonNullable<KvSnapshot['tiers']> = {};
  for (const [name, hashes] of Object.entries(value as Record<string, unknown>)) {
    if (!(KV_LOWER_TIERS as readonly string[]).includes(name)) bad(`snapshot tiers.${name.slice(0, 40)} is not a KV tier (${KV_LOWER_TIERS.join(', ')})`);
    tiers[name as KvLowerTier] = parseHashes(hashes);
  }
  return tiers;
}

export function parseHashes(value: unknown): BlockHash[] {
  if (!Array.isArray(value)) bad('hashes must be an array');
  try {
    return value.map((hash, i) => parseBlockHash(hash, `hashes[${i}]`));
  } catch (error) {
    throw new FrameError((error as Error).message);
  }
}

/** Stats as a worker reports them; anything missing or not a count is refused. */
export function parseStats(value: unknown): EngineStats {
  const s = obj(value, 'stats');
  const stats: EngineStats = {
    numRunning: int(s, 'numRunning', 'stats'), numWaiting: int(s, 'numWaiting', 'stats'),
    kvBlocksUsed: int(s, 'kvBlocksUsed', 'stats'), kvBlocksTotal: int(s, 'kvBlocksTotal', 'stats'),
    prefixCacheQueries: int(s, 'prefixCacheQueries', 'stats'), prefixCacheHits: int(s, 'prefixCacheHits', 'stats'),
    preemptions: int(s, 'preemptions', 'stats'),
  };
  if (s.kvEvictions !== undefined) stats.kvEvictions = int(s, 'kvEvictions', 'stats');
  if (s.requestMigrations !== undefined) stats.requestMigrations = int(s, 'requestMigrations', 'stats');
  if (s.reportSeq !== undefined) stats.reportSeq = int(s, 'reportSeq', 'stats');
  if (s.kvTiers !== undefined) stats.kvTiers = parseKvTiers(s.kvTiers);
  if (s.kvTransferLinks !== undefined) {
    const links = obj(s.kvTransferLinks, 'stats.kvTransferLinks');
    stats.kvTransferLinks = Object.fromEntries(Object.entries(links).map(([link, value]) => {
      const l = obj(value, `stats.kvTransferLinks.${link}`);
      const failures = obj(l.failures, `stats.kvTransferLinks.${link}.failures`);
      return [link, {
        failures: Object.fromEntries(Object.keys(failures).map((reason) => [reason, int(failures, reason, `stats.kvTransferLinks.${link}.failures`)])),
        fallbacks: int(l, 'fallbacks', `stats.kvTransferLinks.${link}`),
      }];
    }));
  }
  if (s.memory !== undefined) {
    const m = obj(s.memory, 'stats.memory');
    stats.memory = { weightsBytes: int(m, 'weightsBytes', 'stats.memory'), kvCacheBytes: int(m, 'kvCacheBytes', 'stats.memory') };
    const activations = optional(m, 'activationsBytes', () => int(m, 'activationsBytes', 'stats.memory'));
    if (activations !== undefined) stats.memory.activationsBytes = activations;
    const lora = optional(m, 'loraAdaptersBytes', () => int(m, 'loraAdaptersBytes', 'stats.memory'));
    if (lora !== undefined) stats.memory.loraAdaptersBytes = lora;
  }
  if (s.allocationFailures !== undefined) {
    const f = obj(s.allocationFailures, 'stats.allocationFailures');
    stats.allocationFailures = { kvBlocks: int(f, 'kvBlocks', 'stats.allocationFailures') };
    const scratch = optional(f, 'scratch', () => int(f, 'scratch', 'stats.allocationFailures'));
    if (scratch !== undefined) stats.allocationFailures.scratch = scratch;
  }
  return stats;
}

const TIER_COUNTS = ['capacityBlocks', 'usedBlocks', 'blockBytes', 'offloadBlocks', 'offloadBytes', 'onboardBlocks', 'onboardBytes',
  'corruptBlocks', 'evictedBlocks', 'failedOffloadBlocks'] as const;

/** A worker's lower KV tiers (RAM, disk) as its stats carry them: counts, and the copies' times in ms. */
function parseKvTiers(value: unknown): KvTiersStats {
  const where = 'stats.kvTiers';
  const t = obj(value, where);
  const tiers = obj(t.tiers, `${where}.tiers`);
  const parsed: KvTiersStats = { tiers: {}, missedOffloads: int(t, 'missedOffloads', where), recomputedBlocks: int(t, 'recomputedBlocks', where) };
  for (const [name, tierValue] of Object.entries(tiers)) {
    if (!(KV_LOWER_TIERS as readonly string[]).includes(name)) bad(`${where}.tiers.${name.slice(0, 40)} is not a KV tier (${KV_LOWER_TIERS.join(', ')})`);
    const at = `${where}.tiers.${name}`;
    const tier = obj(tierValue, at);
    const counts = Object.fromEntries(TIER_COUNTS.map((field) => [field, int(tier, field, at)])) as Record<typeof TIER_COUNTS[number], number>;
    const ms = (field: string): number => {
      const v = num(tier, field, at);
      if (v < 0) bad(`${at}.${field} must be >= 0`);
      return v;
    };
    parsed.tiers[name as KvLowerTier] = { ...counts, offloadMs: ms('offloadMs'), onboardMs: ms('onboardMs') };
  }
  return parsed;
}

/** Engine info as a worker reports it. */
export function parseInfo(value: unknown): EngineInfo {
  const i = obj(value, 'info');
  const kernelVariants = obj(i.kernelVariants ?? {}, 'info.kernelVariants');
  return {
    modelName: str(i, 'modelName', 'info'), maxModelLen: int(i, 'maxModelLen', 'info', 1), vocabSize: int(i, 'vocabSize', 'info', 1),
    kvCapacityTokens: int(i, 'kvCapacityTokens', 'info'), blockSize: int(i, 'blockSize', 'info', 1), backend: str(i, 'backend', 'info'),
    kernelVariants: Object.fromEntries(Object.entries(kernelVariants).map(([k, v]) => [k, String(v)])), threads: int(i, 'threads', 'info'),
    // Absent from a worker of an older version; the KV transfer still checks the pools' layouts themselves.
    ...(i.kvDtype === 'f32' || i.kvDtype === 'f16' ? { kvDtype: i.kvDtype } : {}),
    // The frontend's prefill metrics label a model by it (EngineInfo.quantization); absent when the worker has none.
    ...(typeof i.quantization === 'string' ? { quantization: i.quantization } : {}),
  };
}

export function parseRole(value: unknown): WorkerRole {
  if (value === 'both' || value === 'prefill' || value === 'decode') return value;
  return bad(`role must be both, prefill or decode, got ${JSON.stringify(value)}`);
}
