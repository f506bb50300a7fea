// Conduit under test, two ways:
//
// - CoreRunner: EngineCore with the native backend on this thread, stepped in a loop. This is the kernel level
//   plus the control plane (scheduler, batch builder, sampler, detokenizer) and nothing else. Each step is timed
//   phase by phase by wrapping the scheduler's and the backend's entry points (no engine code changes), so a
//   figure can be split into forward / scheduling / sampling / output time.
// - ServedRunner: createLocalEngine, the engine as the gateway sees it: its step loop in a worker thread, requests
//   and outputs crossing as messages, each request an async stream on the main thread. The gap between the two
//   runners is what the thread and the messaging cost; each output's delivery lag (worker's token timestamp to
//   the moment this thread reads it, on the shared engine clock) measures the messaging part directly.
import { engineNow } from '../../src/engine/clock.ts';
import { EngineCore } from '../../src/engine/engine-core.ts';
import { createLocalEngine, type LocalEngineBundle } from '../../src/engine/local-engine.ts';
import type { Scheduler } from '../../src/engine/scheduler.ts';
import { DEFAULT_SAMPLING, type EngineOutput, type EngineRequest } from '../../src/engine/types.ts';
import { nativeBackend } from '../../src/kernels/native.ts';
import { kvPoolBytes, type KvDtype, type ModelRunnerBackend } from '../../src/kernels/types.ts';
import type { ModelConfig } from '../../src/model/config.ts';
import { allTensors, type LoadedModel } from '../../src/model/loader.ts';
import { createTokenizer } from '../../src/model/tokenizer/index.ts';
import type { GenRequest, RequestTrace, Runner } from './harness.ts';

export interface ConduitOptions {
  threads: number;
  kvDtype: KvDtype;
  /** KV pool capacity in tokens (rounded down to whole blocks). */
  kvTokens: number;
  blockSize?: number;
  maxNumSeqs?: number;
  maxNumBatchedTokens?: number;
}

const DEFAULTS = { blockSize: 16, maxNumSeqs: 256, maxNumBatchedTokens: 2048 };

/** Greedy, fixed length: the same work for every engine whatever tokens the random model picks. */
function engineRequest(id: string, request: GenRequest): EngineRequest {
  return {
    id, promptTokenIds: request.prompt, priority: 0, arrivalMs: engineNow(),
    sampling: { ...DEFAULT_SAMPLING, temperature: 0, maxTokens: request.maxTokens, ignoreEos: true },
  };
}

function checkFinish(runner: string, output: EngineOutput): void {
  if (output.finishReason !== undefined && output.finishReason !== 'length') {
    throw new Error(`${runner}: request ${output.requestId} ended with ${output.finishReason}: ${output.error ?? output.stopReason ?? ''}`);
  }
}

/**
 * Weight bytes a decode step reads: every tensor except the embedding table, of which one row per token is read,
 * unless the table doubles as the output projection (tied embeddings, as in the synthetic models).
 */
export function decodeWeightBytes(model: LoadedModel): number {
  const { weights } = model;
  const tied = weights.output === weights.tokenEmbedding;
  return allTensors(weights).filter((t) => tied || t !== weights.tokenEmbedding).reduce((n, t) => n + t.data.byteLength, 0);
}

export function kvBytesForTokens(config: ModelConfig, tokens: number, dtype: KvDtype, blockSize: number): number {
  return kvPoolBytes({
    numLayers: config.numLayers, numBlocks: Math.floor(tokens / blockSize), blockSize,
    numKvHeads: config.numKvHeads, headDim: config.headDim, dtype,
  });
}

// ---------------------------------------------------------------------------------------------------------------
// EngineCore on this thread

/** Milliseconds spent in each part of one engine step that ran a forward pass. */
export interface StepRecord {
  /** Tokens and sequences in the forward batch (a decode-only step has as many tokens as sequences). */
  numTokens: number;
  numSeqs: number;
  /** Scheduler.schedule: admission, block allocation, prefix-cache lookup. */
  schedule: number;
  /** BatchBuilder.build: the flat arrays of the forward call. */
  build: number;
  /** The native forward pass (all layers, logits). */
  forward: number;
  /** Sampling every logits row. */
  sample: number;
  /** Scheduler.updateFromOutput: appending tokens, finishing, registering full blocks in the prefix cache. */
  update: number;
  /** Detokenizing, stop strings and shaping the outputs. */
  emit: number;
}

export const STEP_PHASES = ['schedule', 'build', 'forward', 'sample', 'update', 'emit'] as const;

interface Marks {
  scheduled: number;
  forwardStart: number;
  forwardEnd: number;
  updateStart: number;
  updateEnd: number;
  numTokens: number;
  numSeqs: number;
}

export class CoreRunner implements Runner {
  readonly name = 'conduit core';
  private steps: StepRecord[] = [];
  private nextId = 0;

  private constructor(
    readonly core: EngineCore,
    private readonly backend: ModelRunnerBackend,
    private readonly marks: Marks,
  ) {}

  static async create(model: LoadedModel, options: ConduitOptions): Promise<CoreRunner> {
    const blockSize = options.blockSize ?? DEFAULTS.blockSize;
    const backend = nativeBackend.load(model.config, model.weights,
      { numBlocks: Math.floor(options.kvTokens / blockSize), blockSize, dtype: options.kvDtype },
      { threads: options.threads });
    const marks: Marks = { scheduled: 0, forwardStart: 0, forwardEnd: 0, updateStart: 0, updateEnd: 0, numTokens: 0, numSeqs: 0 };
    const timedBackend: ModelRunnerBackend = {
      ...backend,
      forward(batch, out) {
        marks.numTokens = batch.numTokens;
        marks.numSeqs = batch.numSeqs;
        marks.forwardStart = performance.now();
        const logits = backend.forward(batch, out);
        marks.forwardEnd = performance.now();
        return logits;
      },
    };
    const core = new EngineCore({
      backend: timedBackend, tokenizer: createTokenizer(model.tokenizerSource),
      maxNumSeqs: options.maxNumSeqs ?? DEFAULTS.maxNumSeqs,
      maxNumBatchedTokens: options.maxNumBatchedTokens ?? DEFAULTS.maxNumBatchedTokens,
      maxModelLen: model.config.contextLength, enablePrefixCaching: true, now: engineNow,
    });
    instrumentScheduler(core.scheduler, marks);
    return new CoreRunner(core, backend, marks);
  }

  /** The step records since the last call. */
  takeSteps(): StepRecord[] {
    const steps = this.steps;
    this.steps = [];
    return steps;
  }

  async run(requests: readonly GenRequest[], concurrency: number): Promise<RequestTrace[]> {
    const traces: RequestTrace[] = requests.map(() => ({ submittedMs: 0, tokenMs: [] }));
    const indexOf = new Map<string, number>();
    let next = 0;
    let inFlight = 0;
    const submit = () => {
      const i = next++;
      const id = `core-${this.nextId++}`;
      indexOf.set(id, i);
      traces[i]!.submittedMs = performance.now();
      this.core.add(engineRequest(id, requests[i]!));
      inFlight++;
    };
    while (inFlight < concurrency && next < requests.length) submit();
    while (inFlight > 0) {
      const outputs = this.step();
      const now = performance.now();
      for (const output of outputs) {
        checkFinish(this.name, output);
        const trace = traces[indexOf.get(output.requestId)!]!;
        for (let k = 0; k < output.newTokenIds.length; k++) trace.tokenMs.push(now);
        if (output.finishReason !== undefined) {
          trace.cachedTokens = output.usage.cachedTokens;
          inFlight--;
        }
      }
      while (inFlight < concurrency && next < requests.length) submit();
    }
    return traces;
  }

  /** One engine step, recorded phase by phase. */
  private step(): EngineOutput[] {
    const m = this.marks;
    m.forwardStart = 0;
    const start = performance.now();
    const outputs = this.core.step();
    const end = performance.now();
    if (m.forwardStart === 0) return outputs; // nothing was scheduled
    this.steps.push({
      numTokens: m.numTokens, numSeqs: m.numSeqs,
      schedule: m.scheduled - start, build: m.forwardStart - m.scheduled, forward: m.forwardEnd - m.forwardStart,
      sample: m.updateStart - m.forwardEnd, update: m.updateEnd - m.updateStart, emit: end - m.updateEnd,
    });
    return outputs;
  }

  async close(): Promise<void> {
    this.backend.dispose();
  }
}

/** Wraps the scheduler's two entry points on this instance to stamp when they return and start. */
function instrumentScheduler(scheduler: Scheduler, marks: Marks): void {
  const schedule = scheduler.schedule.bind(scheduler);
  const update = scheduler.updateFromOutput.bind(scheduler);
  scheduler.schedule = (...args: Parameters<Scheduler['schedule']>) => {
    const plan = schedule(...args);
    marks.scheduled = performance.now();
    return plan;
  };
  scheduler.updateFromOutput = (...args: Parameters<Scheduler['updateFromOutput']>) => {
    marks.updateStart = performance.now();
    const result = update(...args);
    marks.updateEnd = performance.now();
    return result;
  };
}

// ---------------------------------------------------------------------------------------------------------------
// The local engine, as served

export class ServedRunner implements Runner {
  readonly name = 'conduit served';
  /** Per output: ms from the worker stamping the token to this thread reading it. */
  private deliveryLagMs: number[] = [];
  private nextId = 0;

  private constructor(readonly bundle: LocalEngineBundle) {}

  static async create(model: LoadedModel, options: ConduitOptions): Promise<ServedRunner> {
    const blockSize = options.blockSize ?? DEFAULTS.blockSize;
    const bundle = await createLocalEngine({
      modelPath: model.path, backend: 'native', threads: options.threads, kvDtype: options.kvDtype, blockSize,
      kvCacheMemoryBytes: kvBytesForTokens(model.config, options.kvTokens, options.kvDtype, blockSize),
      maxNumSeqs: options.maxNumSeqs ?? DEFAULTS.maxNumSeqs,
      maxNumBatchedTokens: options.maxNumBatchedTokens ?? DEFAULTS.maxNumBatchedTokens,
      enablePrefixCaching: true,
    });
    return new ServedRunner(bundle);
  }

  /** The delivery lags since the last call. */
  takeDeliveryLags(): number[] {
    const lags = this.deliveryLagMs;
    this.deliveryLagMs = [];
    return lags;
  }

  async run(requests: readonly GenRequest[], concurrency: number): Promise<RequestTrace[]> {
    const traces: RequestTrace[] = requests.map(() => ({ submittedMs: 0, tokenMs: [] }));
    let next = 0;
    const client = async () => {
      while (next < requests.length) {
        const i = next++;
        const trace = traces[i]!;
        trace.submittedMs = performance.now();
        for await (const output of this.bundle.engine.generate(engineRequest(`served-${this.nextId++}`, requests[i]!))) {
          const now = performance.now();
          this.deliveryLagMs.push(engineNow() - output.timestamps.lastToken!);
          checkFinish(this.name, output);
          for (let k = 0; k < output.newTokenIds.length; k++) trace.tokenMs.push(now);
          if (output.finishReason !== undefined) trace.cachedTokens = output.usage.cachedTokens;
        }
      }
    };
    await Promise.all(Array.from({ length: Math.min(concurrency, requests.length) }, client));
    return traces;
  }

  async close(): Promise<void> {
    await this.bundle.engine.close();
  }
}

export type StepPhase = (typeof STEP_PHASES)[number];

export interface PhaseMeans {
  steps: number;
  /** Mean tokens per step. */
  tokens: number;
  /** Mean ms per step of each phase, and of the whole step. */
  ms: Record<StepPhase | 'total', number>;
}

export function phaseMeans(steps: readonly StepRecord[]): PhaseMeans {
  const ms = { schedule: 0, build: 0, forward: 0, sample: 0, update: 0, emit: 0, total: 0 };
  for (const step of steps) {
    for (const phase of STEP_PHASES) {
      ms[phase] += step[phase];
      ms.total += step[phase];
    }
  }
  const n = Math.max(1, steps.length);
  for (const key of Object.keys(ms) as (keyof typeof ms)[]) ms[key] /= n;
  return { steps: steps.length, tokens: steps.reduce((t, s) => t + s.numTokens, 0) / n, ms };
}

/** Steps that only decode (one new token per sequence). */
export function decodeSteps(steps: readonly StepRecord[]): StepRecord[] {
  return steps.filter((s) => s.numTokens === s.numSeqs);
}
