// One API request's engine work: an engine request per prompt (each with n completions), their outputs merged into
// one stream of events in arrival order, and the bookkeeping every ending needs (which requests are still running
// and must be aborted, how many tokens were really used: generated, and of each prompt what the engine computed).

import type { Engine, EngineOutput, EngineRequest, SamplingParams } from '../engine/types.ts';
import {
  EngineError, EngineRejectedError, NoWorkerAvailableError, OverloadedError, ShuttingDownError, WorkerLostApiError, type ApiError,
} from './errors.ts';

export interface PreparedPrompt {
  tokenIds: number[];
  /** Completion tokens allowed for each of the n completions. */
  maxTokens: number;
  /** The prompt as text, for completions' echo. */
  text?: string;
}

export interface RunEvent {
  promptIndex: number;
  output: EngineOutput;
}

export interface RunRequestTemplate {
  priority: number;
  arrivalMs: number;
  /** Engine-clock time by which the first token should be out (the deadline policy orders by it). */
  deadlineMs?: number;
  tenant?: string;
  cacheSalt?: string;
  traceparent?: string;
  sessionId?: string;
  /** The engine's key of the LoRA adapter the request runs with (EngineRequest.lora). */
  lora?: string;
}

export class GenerationRun {
  readonly engineRequests: EngineRequest[];
  /** Set when the server (not the client) ended the run early: a timeout or shutdown. */
  abortReason: ApiError | undefined;
  /** Sees every engine output as it arrives, before it is consumed (the request's trace reads the timestamps). */
  onOutput: ((output: EngineOutput) => void) | undefined;
  private readonly finishedCompletions: number[];
  private readonly generatedTokens: number[];
  private readonly cachedTokens: number[];
  /** Per prompt: its tokens the engine computed or found cached, as its latest output says (undefined: none seen). */
  private readonly promptWork: (number | undefined)[];
  private aborted = false;
  private readonly aborter = new AbortController();

  constructor(
    private readonly engine: Engine,
    readonly id: string,
    readonly prompts: readonly PreparedPrompt[],
    readonly n: number,
    template: RunRequestTemplate,
    samplingFor: (prompt: PreparedPrompt) => SamplingParams,
  ) {
    this.engineRequests = prompts.map((prompt, i) => ({
      ...template,
      id: prompts.length === 1 ? id : `${id}-${i}`,
      promptTokenIds: prompt.tokenIds,
      sampling: samplingFor(prompt),
    }));
    this.finishedCompletions = prompts.map(() => 0);
    this.generatedTokens = prompts.map(() => 0);
    this.cachedTokens = prompts.map(() => 0);
    this.promptWork = prompts.map(() => undefined);
  }

  /** Aborts when the run is aborted (the client left, a timeout, shutdown): ends waits before the engine takes it. */
  get signal(): AbortSignal {
    return this.aborter.signal;
  }

  /** The run's engine requests use the LoRA adapter the engine knows by `key`; before events(). */
  useLora(key: string): void {
    for (const request of this.engineRequests) request.lora = key;
  }

  /** Sequences this run generates: n per prompt. */
  get sequences(): number {
    return this.prompts.length * this.n;
  }

  get promptTokens(): number {
    return this.prompts.reduce((sum, prompt) => sum + prompt.tokenIds.length, 0);
  }

  /**
   * The output is generated only to compute the prompt (completions' echo with max_tokens 0: one token the client
   * never sees): none of it counts as completion tokens, in the usage, the metrics or the tenant's tokens.
   */
  outputHidden = false;

  get completionTokens(): number {
    return this.outputHidden ? 0 : this.generatedTokens.reduce((a, b) => a + b, 0);
  }

  /**
   * Prompt tokens the engine computed (or found in its prefix cache) for this run, what the tenant is charged for its
   * prompts: a prompt with a sampled token counts whole, one stopped during its prefill its cached tokens and the
   * chunks computed, one stopped before any step nothing. A prompt none of whose outputs arrived (its stream failed)
   * counts whole: what the engine did for it is not known.
   */
  get computedPromptTokens(): number {
    return this.prompts.reduce((sum, prompt, i) => sum + (this.promptWork[i] ?? prompt.tokenIds.length), 0);
  }

  get cachedPromptTokens(): number {
    return this.cachedTokens.reduce((a, b) => a + b, 0);
  }

  /** Prompt tokens of one prompt (of `prompts`) the engine found cached. */
  cachedTokensOf(promptIndex: number): number {
    return this.cachedTokens[promptIndex] ?? 0;
  }

  /** The most tokens the run can use: what the rate limiter reserves. */
  get reservedTokens(): number {
    return this.prompts.reduce((sum, prompt) => sum + prompt.tokenIds.length + this.n * prompt.maxTokens, 0);
  }

  get done(): boolean {
    return this.finishedCompletions.every((count) => count >= this.n);
  }

  /** Stops every engine request that has not finished; their streams end with finishReason 'abort'. */
  abort(reason?: ApiError): void {
    if (reason && !this.abortReason) this.abortReason = reason;
    if (this.aborted) return;
    this.aborted = true;
    this.aborter.abort(this.abortReason);
    this.engineRequests.forEach((request, i) => {
      if (this.finishedCompletions[i]! < this.n) this.engine.abort(request.id);
    });
  }

  /**
   * Outputs of every engine request as they arrive. Throws what an engine stream throws; leaving early (break,
   * throw) closes every engine stream.
   */
  async *events(): AsyncGenerator<RunEvent> {
    const iterators: AsyncIterator<EngineOutput>[] = [];
    try {
      for (const request of this.engineRequests) iterators.push(this.engine.generate(request)[Symbol.asyncIterator]());
    } catch (err) {
      this.abort();
      throw engineFailure(err);
    }
    type Step = { index: number; result: IteratorResult<EngineOutput> };
    const pending = new Map<number, Promise<Step>>();
    const pull = (index: number): void => {
      const step = iterators[index]!.next().then((result) => ({ index, result }));
      step.catch(() => {}); // observed through Promise.race; this keeps a late rejection from going unhandled
      pending.set(index, step);
    };
    iterators.forEach((_, index) => pull(index));
    try {
      while (pending.size > 0) {
        const { index, result } = await Promise.race(pending.values()).catch((err: unknown) => {
          throw engineFailure(err);
        });
        if (result.done) {
          pending.delete(index);
          continue;
        }
        this.account(index, result.value);
        pull(index);
        yield { promptIndex: index, output: result.value };
      }
    } finally {
      if (pending.size > 0) {
        this.abort();
        // The outputs already asked for (each stream's closing output, after the abort) still say what the engine
        // computed; returning the streams waits for them anyway.
        for (const settled of await Promise.allSettled(pending.values())) {
          if (settled.status === 'fulfilled' && !settled.value.result.done) this.notePromptWork(settled.value.index, settled.value.result.value);
        }
        await Promise.allSettled(iterators.map((iterator) => iterator.return?.()));
      }
    }
  }

  /** What an output says of the engine's work on its prompt: the most any of the prompt's outputs said. */
  private notePromptWork(promptIndex: number, output: EngineOutput): void {
    const length = this.prompts[promptIndex]!.tokenIds.length;
    let work: number;
    if (output.newTokenIds.length > 0 || output.usage.completionTokens > 0 || output.timestamps.firstToken !== undefined) {
      // A token was sampled: the whole prompt was computed (or cached).
      work = length;
    } else {
      const chunks = output.timestamps.prefillChunks ?? [];
      const computed = chunks.reduce((sum, chunk) => sum + (chunk.recompute === true ? 0 : chunk.tokens), 0);
      // No prefill chunk: the request never got a step, and nothing counts (not even cached tokens it was told of).
      work = chunks.length === 0 ? 0 : Math.min(length, computed + output.usage.cachedTokens);
    }
    this.promptWork[promptIndex] = Math.max(this.promptWork[promptIndex] ?? 0, work);
  }

  private account(promptIndex: number, output: EngineOutput): void {
    this.notePromptWork(promptIndex, output);
    this.generatedTokens[promptIndex]! += output.newTokenIds.length;
    this.cachedTokens[promptIndex] = Math.max(this.cachedTokens[promptIndex]!, output.usage.cachedTokens);
    if (output.finishReason) this.finishedCompletions[promptIndex]!++;
    this.onOutput?.(output);
  }
}

/**
 * An exception from an engine stream as an API error. Engine errors (src/engine/errors.ts) are told apart by name,
 * since they may have crossed a thread boundary: a refused request carries a code and is the client's 400; a closed
 * engine (any kind: local, simulated, routed) means the server is stopping, a full admission queue or a lost worker
 * are 503s; anything else is the engine's 500.
 */
export function engineFailure(err: unknown): ApiError {
  const { name, code, message, retryAfterMs } = (err ?? {}) as
    { name?: unknown; code?: unknown; message?: unknown; retryAfterMs?: unknown };
  const detail = typeof message === 'string' ? message : String(err);
  switch (name) {
    case 'InvalidRequestError':
      return typeof code === 'string' ? new EngineRejectedError(code, detail) : new EngineError(detail);
    case 'EngineOverloadedError':
      return new OverloadedError(detail, typeof retryAfterMs === 'number' ? retryAfterMs : undefined);
    case 'EngineUnavailableError': {
      const { final } = (err ?? {}) as { final?: unknown };
      return new NoWorkerAvailableError(detail, typeof retryAfterMs === 'number' ? retryAfterMs : undefined, final === true);
    }
    case 'WorkerLostError':
      return new WorkerLostApiError(detail);
    case 'EngineClosedError':
      return new ShuttingDownError();
    default:
      return new EngineError(detail);
  }
}
