// The worker thread of a local engine: loads the model into a compute backend and runs the step loop, so the
// gateway's event loop never waits on math. Between two steps it yields to its own event loop (setImmediate) so
// that new requests and aborts are taken in before the next step is planned.

import { parentPort, workerData } from 'node:worker_threads';
import { kvPoolBytes, resolveKvDtype, type KvPoolLayout } from '../kernels/types.ts';
import { selectBackend } from '../kernels/select.ts';
import { loadModel } from '../model/loader.ts';
import { createTokenizer } from '../model/tokenizer/index.ts';
import { engineNow } from './clock.ts';
import { EngineCore, type KvSourceView } from './engine-core.ts';
import { KV_IN_PLACE_SOURCE, kvBlockBytes, validateHandoff } from './handoff.ts';
import { KvTiers } from './kv-cache/tiers.ts';
import { describeOpenReport, DiskKvTier, modelFingerprint } from './kv-cache/disk-tier.ts';
import { InvalidRequestError, LoraLoadError } from './errors.ts';
import { OutputCoalescer } from './output-coalescer.ts';
import type { ModelConfig } from '../model/config.ts';
import { loadLoraAdapter, type LoraDtype } from '../model/lora.ts';
import { GrammarRuntime } from './grammar/runtime.ts';
import { infoNotice, warnNotice, type Notice } from '../util/log.ts';
import type { Tokenizer } from '../model/tokenizer/types.ts';
import type { EngineInfo } from './types.ts';
import type { FromWorker, ToWorker, WorkerInit } from './worker-protocol.ts';

const port = parentPort!;
const init = (workerData as { data: WorkerInit }).data;
const send = (message: FromWorker) => port.postMessage(message);

let baseConfig: ModelConfig | undefined;
/** The worker's grammars, loaded when the first guided request arrives (most workers never need them). */
let grammar: GrammarRuntime | undefined;

/** What the step loop needs of the loaded model: the core, the tokenizer, and how the backend stores adapters. */
interface Started {
  core: EngineCore;
  tokenizer: Tokenizer;
  vocabSize: number;
  loraDtype?: LoraDtype;
}

async function start(): Promise<Started> {
  const loaded = await loadModel(init.modelPath);
  const tokenizer = createTokenizer(loaded.tokenizerSource);
  const { factory, notices } = selectBackend(init.backend);
  const { config } = loaded;
  baseConfig = config;
  // --kv-cache-dtype auto is decided here, by the backend this worker runs: the pool, its capacity, the disk tier's
  // fingerprint and the layout a KV transfer checks all follow from this one dtype.
  const kvDtype = resolveKvDtype(factory, init.kvDtype);
  const bytesPerBlock = kvPoolBytes({
    numLayers: config.numLayers, numBlocks: 1, blockSize: init.blockSize, numKvHeads: config.numKvHeads,
    headDim: config.headDim, dtype: kvDtype,
  });
  // As vLLM: a longer context than the model was trained for is refused, not silently cut to it.
  if (init.maxModelLen !== undefined && init.maxModelLen > config.contextLength) {
    throw new Error(`--max-model-len ${init.maxModelLen} is above the model's context length (${config.contextLength} tokens)`);
  }
  const numBlocks = Math.floor(init.kvCacheMemoryBytes / bytesPerBlock);
  if (numBlocks < 1) {
    throw new Error(`--kv-cache-memory ${init.kvCacheMemoryBytes} bytes holds no block of ${bytesPerBlock} bytes`);
  }
  // Before the backend loads: it may give the weights' bytes back, and the disk tier's fingerprint samples them.
  const fingerprint = init.kvOffload?.diskDir !== undefined
    ? modelFingerprint(config, loaded.weights, { numLayers: config.numLayers, blockSize: init.blockSize, numKvHeads: config.numKvHeads, headDim: config.headDim, dtype: kvDtype })
    : undefined;
  const backend = factory.load(config, loaded.weights, { numBlocks, blockSize: init.blockSize, dtype: kvDtype },
    // This worker loaded the model for this backend alone: nothing here reads the packed matrices' bytes again.
    { threads: init.threads, releaseUnpackedWeights: true, ...(init.loraDtype !== undefined ? { loraDtype: init.loraDtype } : {}) });
  const maxModelLen = init.maxModelLen ?? config.contextLength;
  const tierNotices: Notice[] = [];
  const kvTiers = openKvTiers(backend.kvLayout, fingerprint, tierNotices);
  const core = new EngineCore({
    backend, tokenizer, maxNumSeqs: init.maxNumSeqs, maxNumBatchedTokens: init.maxNumBatchedTokens, maxModelLen,
    policy: init.policy, enablePrefixCaching: init.enablePrefixCaching, enableKvEvents: init.enableKvEvents,
    ...(kvTiers !== undefined ? { kvTiers } : {}),
    now: engineNow, grammar: () => grammar, jumpForward: init.guidedJumpForward,
  });
  const info: EngineInfo = {
    // What one sequence can reach: the context length, or less when one sequence of it would not fit the KV pool.
    modelName: init.servedModelName, maxModelLen: core.scheduler.maxModelLen, vocabSize: config.vocabSize,
    kvCapacityTokens: numBlocks * init.blockSize, blockSize: init.blockSize, kvDtype: backend.kvLayout.dtype,
    backend: backend.info.name, kernelVariants: backend.info.variants, threads: backend.info.threads,
    quantization: dominantType(loaded.metadata.parametersByType),
  };
  const pool = core.kvPoolView;
  send({
    type: 'ready', info, notices: [...notices, ...(backend.info.notices ?? [])].map(warnNotice).concat(tierNotices), stats: core.stats(), kvPool: pool.pool,
    kvLayout: pool.layout,
  });
  return { core, tokenizer, vocabSize: config.vocabSize, ...(backend.info.loraDtype ? { loraDtype: backend.info.loraDtype } : {}) };
}

/** The storage type that holds most of the model's parameters. */
function dominantType(parametersByType: Record<string, number>): string | undefined {
  let best: string | undefined;
  for (const [type, count] of Object.entries(parametersByType)) if (best === undefined || count > parametersByType[best]!) best = type;
  return best;
}

/**
 * The lower KV tiers of this worker, when configured. The offload window is twice the blocks one step can allocate,
 * so what the next step may evict has been copied down before it runs (tiers.ts).
 */
function openKvTiers(layout: KvPoolLayout, fingerprint: string | undefined, notices: Notice[]): KvTiers | undefined {
  const offload = init.kvOffload;
  if (offload === undefined || (offload.memoryBytes <= 0 && offload.diskDir === undefined)) return undefined;
  const windowBlocks = 2 * Math.ceil(init.maxNumBatchedTokens / init.blockSize);
  const blockBytes = kvBlockBytes(layout);
  let disk: DiskKvTier | undefined;
  if (offload.diskDir !== undefined && fingerprint !== undefined) {
    disk = new DiskKvTier({
      dir: offload.diskDir, capacityBytes: offload.diskBytes ?? 0, blockBytes, fingerprint,
      // This thread does not know --log-level: the parent's logger decides whether the warning shows.
      warn: (message) => send({ type: 'log', level: 'warn', message }),
    });
    const found = disk.openReport;
    const line = `KV disk tier ${offload.diskDir}: ${found.blocks} blocks of this model found (room for ${disk.capacityBlocks})${describeOpenReport(found)}`;
    // Files left in the way (taking room the size does not count) deserve a warning, not an info line.
    notices.push(found.notDeleted.length > 0 || found.unreadable.length > 0 ? warnNotice(line) : infoNotice(line));
  }
  return new KvTiers({ blockBytes, ramBytes: offload.memoryBytes, windowBlocks, ...(disk !== undefined ? { disk } : {}) });
}

function run({ core, tokenizer, vocabSize, loraDtype }: Started): void {
  let stepQueued = false;
  let closing = false;
  /** --stream-interval: what each step's outputs hand over now, and what they hold back. */
  const coalescer = new OutputCoalescer(init.streamInterval ?? 1);
  /** Prefill workers' pools this worker may read handed-off blocks from (decode role), by worker id. */
  const kvSources = new Map<string, KvSourceView>();

  /** Handoffs and adoptions go out after the outputs of the same step: the first token reaches the caller first. */
  const sendHandoffState = () => {
    const progress = core.takePrefillProgress();
    if (progress.length > 0) send({ type: 'prefill-progress', progress });
    const handoffs = core.takeHandoffs();
    if (handoffs.length > 0) send({ type: 'handoffs', handoffs });
    const adopted = core.takeAdopted();
    if (adopted.length > 0) send({ type: 'adopted', adopted, stats: core.stats() });
  };

  // Idle release: one check timer per worker (not per request); each check is O(1) unless it resets the cache.
  const idleReleaseMs = (init.kvCacheIdleReleaseSeconds ?? 0) * 1000;
  /** Engine-clock time work was last seen (the end of the last step), and whether a step ran since the last reset. */
  let lastBusyMs = engineNow();
  let touchedSinceReset = false;
  const releaseIfIdle = () => {
    if (closing) return;
    const nowMs = engineNow();
    if (core.hasWork) {
      lastBusyMs = nowMs;
      return;
    }
    // A refusal (a handoff's pinned blocks) is retried at the next check.
    if (!touchedSinceReset || nowMs - lastBusyMs < idleReleaseMs || !core.resetPrefixCache()) return;
    touchedSinceReset = false;
    const kvEvents = init.enableKvEvents ? core.takeKvEvents() : undefined;
    send({ type: 'outputs', outputs: [], stats: core.stats(), kvEvents });
  };
  const idleTimer = idleReleaseMs > 0 ? setInterval(releaseIfIdle, Math.max(10, Math.min(idleReleaseMs / 4, 1000))) : undefined;

  // Lower KV tiers: after each step (its outputs already sent) the next blocks the pool would evict are copied down,
  // a bounded number per gap; once idle, what each tier keeps of the cached blocks goes down chunk by chunk (one chunk
  // per turn of the event loop, so a new request never waits for more than one chunk). An idle sweep copies a block
  // into a tier at most once (kv-cache/tiers.ts), so it ends, and the worker sleeps until the next request.
  const tiers = core.kv.tiers;
  let offloadQueued = false;
  /** The tiers' KV events and figures to the parent (the router's index, /metrics), when anything changed. */
  const sendTierState = (changed: boolean) => {
    const kvEvents = init.enableKvEvents ? core.takeKvEvents() : undefined;
    if (changed || (kvEvents && kvEvents.length > 0)) send({ type: 'outputs', outputs: [], stats: core.stats(), kvEvents });
  };
  // What a disk tier found at start (a warm restart) goes out now: the router can send a returning prompt to the
  // worker whose disk holds it before this worker has run a step.
  sendTierState(false);
  const offloadIdle = () => {
    offloadQueued = false;
    if (closing || core.hasWork) return;
    const copied = core.offloadKv(undefined, Infinity);
    sendTierState(copied > 0);
    if (copied > 0) queueOffloadIdle();
    // A disk tier at its bound of writes in flight: try again once some have landed.
    else if (tiers!.diskBusy) queueOffloadIdle(10);
    // Done: the last disk writes land after the sweep, and their stored events and the tier's figures follow them.
    else void tiers!.flush().catch(() => {}).then(() => { if (!closing && !core.hasWork) sendTierState(tiers!.disk !== undefined); });
  };
  const queueOffloadIdle = (delayMs = 0) => {
    if (tiers === undefined || offloadQueued || closing) return;
    offloadQueued = true;
    if (delayMs > 0) setTimeout(offloadIdle, delayMs);
    else setImmediate(offloadIdle);
  };

  const step = () => {
    stepQueued = false;
    if (closing) return;
    touchedSinceReset = true;
    const outputs = coalescer.take(core.step());
    // Held tokens wait for a next step: with none coming (nothing running), they go now.
    if (!core.hasWork && coalescer.holding) outputs.push(...coalescer.flushAll());
    lastBusyMs = engineNow();
    let kvEvents = init.enableKvEvents ? core.takeKvEvents() : undefined;
    if (outputs.length > 0 || (kvEvents && kvEvents.length > 0)) {
      send({ type: 'outputs', outputs, stats: core.stats(), kvEvents });
    }
    sendHandoffState();
    if (tiers !== undefined && core.offloadKv() > 0 && init.enableKvEvents) {
      kvEvents = core.takeKvEvents();
      if (kvEvents.length > 0) send({ type: 'outputs', outputs: [], stats: core.stats(), kvEvents });
    }
    queueStep();
    if (!core.hasWork) queueOffloadIdle();
  };
  const queueStep = () => {
    if (!stepQueued && core.hasWork && !closing) {
      stepQueued = true;
      setImmediate(step);
    }
  };

  // A guided request needs the grammars: the first one loads them (tens to hundreds of ms, once), and every message
  // that arrives meanwhile waits behind it, so the order of adds and aborts is kept. A failed load leaves the
  // grammars undefined: guided requests are then refused with the reason, and the next one tries again.
  let held: ToWorker[] | null = null;
  let grammarFailure: string | undefined;
  const needsGrammar = (message: ToWorker): boolean => grammar === undefined
    && ((message.type === 'add' && message.request.sampling.guided !== undefined)
      || (message.type === 'adopt' && message.handoff.request.sampling.guided !== undefined));
  port.on('message', (message: ToWorker) => {
    if (held !== null) {
      held.push(message);
      return;
    }
    if (!needsGrammar(message)) {
      handle(message);
      return;
    }
    held = [message];
    GrammarRuntime.create(tokenizer, vocabSize).then((runtime) => { grammar = runtime; }, (error: unknown) => {
      grammarFailure = error instanceof Error ? error.message : String(error);
    }).finally(() => {
      const waiting = held ?? [];
      held = null;
      for (const next of waiting) handle(next);
    });
  });

  const handle = (message: ToWorker): void => {
    if (grammar === undefined && grammarFailure !== undefined && needsGrammar(message) && message.type === 'add') {
      send({ type: 'rejected', requestId: message.request.id, code: 'invalid_request', message: `guided decoding is unavailable: ${grammarFailure}` });
      return;
    }
    switch (message.type) {
      case 'add':
        try {
          core.add(message.request, { handoff: message.handoff, queuedMs: message.sentMs });
        } catch (error) {
          const code = error instanceof InvalidRequestError ? error.code : 'invalid_request';
          send({ type: 'rejected', requestId: message.request.id, code, message: (error as Error).message });
          return;
        }
        queueStep();
        return;
      case 'abort': {
        // The stats go out even without outputs: an abort may free blocks that no output reports (a handed-off
        // request's pin), and the router weighs the blocks in use.
        // Tokens held back for the stream interval go first: the abort's closing output follows them.
        const outputs = [...coalescer.flushRequest(message.requestId), ...core.abort(message.requestId)];
        send({ type: 'outputs', outputs, stats: core.stats() });
        return;
      }
      case 'release-handoff':
        if (core.releaseHandoff(message.requestId)) send({ type: 'outputs', outputs: [], stats: core.stats() });
        return;
      case 'attach-kv-source':
        kvSources.set(message.sourceId, { id: message.sourceId, channel: 'shared-memory', pool: message.pool, layout: message.layout });
        return;
      case 'adopt': {
        const source = message.sourceId === null ? null
          : message.sourceId === KV_IN_PLACE_SOURCE ? KV_IN_PLACE_SOURCE : kvSources.get(message.sourceId) ?? null;
        try {
          core.adopt(validateHandoff(message.handoff), source);
        } catch (error) {
          const code = error instanceof InvalidRequestError ? error.code : 'handoff_failed';
          send({ type: 'rejected', requestId: message.handoff.requestId, code, message: (error as Error).message });
          return;
        }
        sendHandoffState();
        queueStep();
        return;
      }
      case 'hold-prefix': {
        const blocks = core.holdCachedPrefix(message.requestId, message.blockHashes);
        send({ type: 'prefix-held', holdId: message.holdId, blocks, stats: core.stats() });
        return;
      }
      case 'prepare-import': {
        let preparation: ReturnType<typeof core.prepareKvImport> | null = null;
        let error: string | undefined;
        try {
          preparation = core.prepareKvImport(message.requestId, message.blockHashes, message.numBlocks, message.reserve);
        } catch (e) {
          error = (e as Error).message;
        }
        send({ type: 'import-prepared', holdId: message.holdId, preparation, ...(error !== undefined ? { error } : {}), stats: core.stats() });
        return;
      }
      case 'release-import':
        if (core.releaseKvImport(message.requestId, message.ticket)) send({ type: 'outputs', outputs: [], stats: core.stats() });
        return;
      case 'sync':
        send({ type: 'synced', syncId: message.syncId, stats: core.stats() });
        return;
      case 'reset-prefix-cache': {
        const reset = core.resetPrefixCache();
        if (reset) touchedSinceReset = false;
        const kvEvents = init.enableKvEvents ? core.takeKvEvents() : undefined;
        send({ type: 'prefix-cache-reset', resetId: message.resetId, reset, stats: core.stats(), kvEvents });
        return;
      }
      case 'load-lora':
      case 'unload-lora': {
        // The stats go with the reply: the adapters' memory changed, and an idle worker sends no other.
        try {
          if (message.type === 'unload-lora') {
            core.unloadLora(message.name);
            send({ type: 'lora-done', loraId: message.loraId, stats: core.stats() });
            return;
          }
          const adapter = loadLoraAdapter(message.path, baseConfig!);
          core.loadLora(message.name, adapter.weights);
          // The digest of the bytes loaded: the caller checks them against those the adapter's KV blocks are keyed by.
          const { format, rank, alpha, bytes, digest } = adapter;
          send({
            type: 'lora-done', loraId: message.loraId, info: { format, rank, alpha, bytes, digest, ...(loraDtype ? { dtype: loraDtype } : {}) },
            stats: core.stats(),
          });
        } catch (error) {
          const code = error instanceof LoraLoadError ? error.code : 'invalid_adapter';
          send({ type: 'lora-done', loraId: message.loraId, error: { code, message: (error as Error).message }, stats: core.stats() });
        }
        return;
      }
      case 'close':
        closing = true;
        clearInterval(idleTimer);
        // The disk tier's writes in flight finish first (bounded: at most its pending bytes), so a clean stop loses
        // nothing it had started to write.
        void (tiers?.flush() ?? Promise.resolve()).catch(() => {}).then(() => {
          send({ type: 'closed' });
          port.close();
        });
        return;
    }
  };
}

start().then(run, (error: unknown) => {
  send({ type: 'failed', message: error instanceof Error ? error.message : String(error) });
  port.close();
});
