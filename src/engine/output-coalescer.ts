// --stream-interval N (as vLLM's flag): a worker hands a completion's tokens to its parent N at a time instead of one
// per step. Every hand-over wakes the parent's event loop, and each output it carries becomes an SSE event and a socket
// write there; on a 2-vCPU machine that work per token comes out of the cores the model runs on. The first token of a
// completion goes out at once (its time to first token is unchanged), and so does the output that ends it; the tokens
// between are held and merged until N of them are waiting.

import type { EngineOutput, EngineStepFacts } from './types.ts';

export class OutputCoalescer {
  /** Each completion's outputs merged while held, by keyOf (request id and completion index). */
  private readonly held = new Map<string, EngineOutput>();
  /** Completions whose first output went out (their next ones may be held), by keyOf. */
  private readonly started = new Set<string>();

  constructor(readonly interval: number) {
    if (!Number.isInteger(interval) || interval < 1) throw new RangeError(`the stream interval must be an integer >= 1, got ${interval}`);
  }

  /** Whether any output is held. */
  get holding(): boolean {
    return this.held.size > 0;
  }

  /**
   * One step's outputs in, the outputs to hand over now out, in order. A completion held back that has no output in
   * this step (preempted, or left out of the step) is handed over too: its tokens must not wait for steps that may not
   * come soon.
   */
  take(outputs: readonly EngineOutput[]): EngineOutput[] {
    if (this.interval === 1) return outputs as EngineOutput[];
    const out: EngineOutput[] = [];
    const seen = this.held.size > 0 ? new Set<string>() : undefined;
    for (const output of outputs) {
      const key = keyOf(output);
      seen?.add(key);
      const merged = this.merge(key, output);
      if (this.mustSend(key, merged)) {
        this.held.delete(key);
        out.push(merged);
        this.noteSent(key, merged);
      } else {
        this.held.set(key, merged);
      }
    }
    if (seen !== undefined) {
      for (const [key, output] of this.held) {
        if (seen.has(key)) continue;
        this.held.delete(key);
        out.push(output);
      }
    }
    return out;
  }

  /** The held outputs of one request (all its completions), taken out: before an abort's closing outputs. */
  flushRequest(requestId: string): EngineOutput[] {
    const out: EngineOutput[] = [];
    for (const [key, output] of this.held) {
      if (output.requestId !== requestId) continue;
      this.held.delete(key);
      out.push(output);
    }
    for (const key of this.started) if (key.startsWith(`${requestId}\u0000`)) this.started.delete(key);
    return out;
  }

  /** Every held output, taken out: when no step is coming to hand them over. */
  flushAll(): EngineOutput[] {
    const out = [...this.held.values()];
    this.held.clear();
    return out;
  }

  private merge(key: string, output: EngineOutput): EngineOutput {
    const before = this.held.get(key);
    if (before === undefined) return output;
    const steps: EngineStepFacts[] = [...(before.heldSteps ?? []), ...(before.step !== undefined ? [before.step] : [])];
    return {
      ...output,
      newTokenIds: [...before.newTokenIds, ...output.newTokenIds],
      textDelta: before.textDelta + output.textDelta,
      ...(before.logprobs !== undefined || output.logprobs !== undefined
        ? { logprobs: [...(before.logprobs ?? []), ...(output.logprobs ?? [])] } : {}),
      ...(steps.length > 0 ? { heldSteps: steps } : {}),
    };
  }

  private mustSend(key: string, output: EngineOutput): boolean {
    return !this.started.has(key) || output.finishReason !== undefined || output.error !== undefined
      || output.promptLogprobs !== undefined || output.newTokenIds.length >= this.interval;
  }

  private noteSent(key: string, output: EngineOutput): void {
    if (output.finishReason !== undefined) this.started.delete(key);
    else this.started.add(key);
  }
}

function keyOf(output: EngineOutput): string {
  return `${output.requestId}\u0000${output.index}`;
}
