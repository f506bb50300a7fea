// The worker thread of a local engine: loads the model into a compute backend and runs the step loop, so the
// gateway's event loop never waits on math. Between two steps it yields to its own event loop (setImmediate) so
// that new requests and aborts are taken in before the next step is planned.

import { parentPort, workerData } from 'node:worker_threads';
import { kvPoolBytes } from '../kernels/types.ts';
import { selectBackend } from '../kernels/select.ts';
import { loadModel } from '../model/loader.ts';
import { createTokenizer } from '../model/tokenizer/index.ts';
import { engineNow } from './clock.ts';
import { EngineCore, type KvSourceView } from './engine-core.ts';
import { validateHandoff } from './handoff.ts';
import { InvalidRequestError } from './errors.ts';
import { GrammarRuntime } from './grammar/runtime.ts';
import type { Tokenizer } from '../model/tokenizer/types.ts';
import type { EngineInfo } from './types.ts';
import type { FromWorker, ToWorker, WorkerInit } from './worker-protocol.ts';

const port = parentPort!;
const init = (workerData as { data: WorkerInit }).data;
const send = (message: FromWorker) => port.postMessage(message);

/** The worker's grammars, loaded when the first guided request arrives (most workers never need them). */
let grammar: GrammarRuntime | undefined;

async function start(): Promise<{ core: EngineCore; tokenizer: Tokenizer; vocabSize: number }> {
  const loaded = await loadModel(init.modelPath);
  const tokenizer = createTokenizer(loaded.tokenizerSource);
  const { factory, notices } = selectBackend(init.backend);
  const { config } = loaded;
  const bytesPerBlock = kvPoolBytes({
    numLayers: config.numLayers, numBlocks: 1, blockSize: init.blockSize, numKvHeads: config.numKvHeads,
    headDim: config.headDim, dtype: init.kvDtype,
  });
  const numBlocks = Math.floor(init.kvCacheMemoryBytes / bytesPerBlock);
  if (numBlocks < 1) {
    throw new Error(`--kv-cache-memory ${init.kvCacheMemoryBytes} bytes holds no block of ${bytesPerBlock} bytes`);
  }
  const backend = factory.load(config, loaded.weights, { numBlocks, blockSize: init.blockSize, dtype: init.kvDtype },
    // This worker loaded the model for this backend alone: nothing here reads the packed matrices' bytes again.
    { threads: init.threads, releaseUnpackedWeights: true });
  const maxModelLen = Math.min(init.maxModelLen ?? config.contextLength, config.contextLength);
  const core = new EngineCore({
    backend, tokenizer, maxNumSeqs: init.maxNumSeqs, maxNumBatchedTokens: init.maxNumBatchedTokens, maxModelLen,
    policy: init.policy, enablePrefixCaching: init.enablePrefixCaching, enableKvEvents: init.enableKvEvents,
    now: engineNow, grammar: () => grammar,
  });
  const info: EngineInfo = {
    // What one sequence can reach: the context length, or less when one sequence of it would not fit the KV pool.
    modelName: init.servedModelName, maxModelLen: core.scheduler.maxModelLen, vocabSize: config.vocabSize,
    kvCapacityTokens: numBlocks * init.blockSize, blockSize: init.blockSize,
    backend: backend.info.name, kernelVariants: backend.info.variants, threads: backend.info.threads,
  };
  const pool = core.kvPoolView;
  send({ type: 'ready', info, notices: [...notices, ...(backend.info.notices ?? [])], kvPool: pool.pool, kvLayout: pool.layout });
  return { core, tokenizer, vocabSize: config.vocabSize };
}

function run({ core, tokenizer, vocabSize }: { core: EngineCore; tokenizer: Tokenizer; vocabSize: number }): void {
  let stepQueued = false;
  let closing = false;
  /** Prefill workers' pools this worker may read handed-off blocks from (decode role), by worker id. */
  const kvSources = new Map<string, KvSourceView>();

  /** Handoffs and adoptions go out after the outputs of the same step: the first token reaches the caller first. */
  const sendHandoffState = () => {
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

  const step = () => {
    stepQueued = false;
    if (closing) return;
    touchedSinceReset = true;
    const outputs = core.step();
    lastBusyMs = engineNow();
    const kvEvents = init.enableKvEvents ? core.takeKvEvents() : undefined;
    if (outputs.length > 0 || (kvEvents && kvEvents.length > 0)) {
      send({ type: 'outputs', outputs, stats: core.stats(), kvEvents });
    }
    sendHandoffState();
    queueStep();
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
        const outputs = core.abort(message.requestId);
        if (outputs.length > 0) send({ type: 'outputs', outputs, stats: core.stats() });
        return;
      }
      case 'release-handoff':
        if (core.releaseHandoff(message.requestId)) send({ type: 'outputs', outputs: [], stats: core.stats() });
        return;
      case 'attach-kv-source':
        kvSources.set(message.sourceId, { id: message.sourceId, channel: 'shared-memory', pool: message.pool, layout: message.layout });
        return;
      case 'adopt': {
        const source = message.sourceId === null ? null : kvSources.get(message.sourceId) ?? null;
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
      case 'close':
        closing = true;
        clearInterval(idleTimer);
        send({ type: 'closed' });
        port.close();
        return;
    }
  };
}

start().then(run, (error: unknown) => {
  send({ type: 'failed', message: error instanceof Error ? error.message : String(error) });
  port.close();
});
