// llama.cpp under test, through node-llama-cpp (pinned in ./package.json, installed only in this folder): the
// released llama.cpp build it bundles, CPU only, prebuilt binaries only.
//
// Two ways to drive it, because node-llama-cpp's default batching leaves llama.cpp's batched throughput on the
// table (see ../../docs/benchmarks.md):
//
// - 'shipped': a context with one sequence per concurrent request and node-llama-cpp's default batching (dispatch
//   on the next event-loop turn, "maximumParallelism" ordering). Whatever has been queued by then goes into the
//   batch, so a sequence whose sampled token came back a moment late misses the step and the batch splits
//   into two half-full ones. The same batch also lists sequences in queue order; llama.cpp (non-unified KV, as
//   node-llama-cpp configures it) splits a batch into separate micro-batches where sequence ids are not in order.
// - 'ordered': the same context and sequences, but a custom dispatch schedule holds the batch until every
//   sequence with a request in flight has queued its tokens, and a custom prioritization lists the items by
//   sequence id. This is llama.cpp's batched decode as its own server would drive it: the fair ceiling.
//
// Prompt reuse mirrors llama.cpp's server (cache_prompt): a sequence keeps its KV from the previous request, the
// common prefix with the new prompt is kept (all but the last prompt token, which is re-evaluated for its logits)
// and the rest erased.
import {
  getLlama, LlamaLogLevel, type BatchItem, type Llama, type LlamaContext, type LlamaContextSequence, type LlamaModel,
  type PrioritizedBatchItem, type Token,
} from 'node-llama-cpp';

import type { GenRequest, RequestTrace, Runner } from './harness.ts';

export type LlamaBatching = 'shipped' | 'ordered';

export const LLAMA_BATCHING_LABEL: Record<LlamaBatching, string> = {
  shipped: 'llama.cpp as shipped',
  ordered: 'llama.cpp ordered batches',
};

/** How long the ordered schedule waits for a straggler before dispatching anyway (a request may have ended). */
const ORDERED_MAX_HOLD_MS = 3;

export class LlamaCpp {
  private constructor(readonly llama: Llama, readonly model: LlamaModel, readonly threads: number) {}

  static async load(modelPath: string, threads: number): Promise<LlamaCpp> {
    // CPU only, the prebuilt binary only: the numbers come from the released llama.cpp build, not a local compile.
    // maxThreads 0 turns off node-llama-cpp's thread splitter, so each context computes with exactly `threads`
    // threads (its default asks for more threads than this VM has cores, and llama.cpp's spinning threads then
    // fight over them).
    const llama = await getLlama({ gpu: false, build: 'never', skipDownload: true, logLevel: LlamaLogLevel.error, maxThreads: 0 });
    const model = await llama.loadModel({ modelPath, gpuLayers: 0 });
    return new LlamaCpp(llama, model, threads);
  }

  describe(): string {
    const release = this.llama.llamaCppRelease;
    const features = this.llama.systemInfo.split('|').map((s) => s.trim()).filter((s) => s.endsWith('= 1'))
      .map((s) => s.replace(' = 1', '').replace(/^CPU : /, ''));
    return `node-llama-cpp 3.22.1, llama.cpp ${release.repo}@${release.release} (${this.llama.buildType} binary), ` +
      `${this.threads} threads, ggml CPU features: ${features.join(' ')}`;
  }

  /**
   * A context of `sequences` sequences of `contextSize` tokens each (node-llama-cpp sizes the KV as
   * sequences x contextSize, F16 K and V, flash attention as llama.cpp decides for the CPU).
   */
  async runner(batching: LlamaBatching, sequences: number, contextSize: number): Promise<LlamaRunner> {
    const state: OrderedState = { context: undefined, active: 0 };
    const context = await this.model.createContext({
      sequences, contextSize, threads: this.threads,
      ...(batching === 'ordered' ? {
        batching: {
          dispatchSchedule: (dispatch: () => void) => holdUntilAllQueued(state, dispatch),
          itemPrioritizationStrategy: (options: { items: readonly BatchItem[]; size: number }) => bySequenceId(state, options),
        },
      } : {}),
    });
    state.context = context;
    const seqs = Array.from({ length: sequences }, () => context.getSequence());
    return new LlamaRunner(LLAMA_BATCHING_LABEL[batching], context, seqs, state);
  }

  async close(): Promise<void> {
    await this.model.dispose();
    await this.llama.dispose();
  }
}

// ---------------------------------------------------------------------------------------------------------------
// Ordered batching. Both hooks read LlamaContext's queue (`_queuedDecodes`, `_queuedDecodeSequenceIds`), which the
// public BatchItem does not expose: it is the only way to know which sequence an item belongs to. Checked
// against node-llama-cpp 3.22.1, the version pinned here.

interface OrderedState {
  context: LlamaContext | undefined;
  /** Sequences with a request in flight: the batch waits for each of them. */
  active: number;
}

interface ContextQueue {
  _queuedDecodes: { sequenceId: number }[];
  _queuedDecodeSequenceIds: Set<number>;
}

function queueOf(state: OrderedState): ContextQueue {
  const queue = state.context as unknown as Partial<ContextQueue> | undefined;
  if (!queue || !Array.isArray(queue._queuedDecodes) || !(queue._queuedDecodeSequenceIds instanceof Set)) {
    throw new Error('node-llama-cpp internals changed: LlamaContext has no _queuedDecodes / _queuedDecodeSequenceIds');
  }
  return queue as ContextQueue;
}

function holdUntilAllQueued(state: OrderedState, dispatch: () => void): void {
  const started = performance.now();
  const poll = () => {
    if (queueOf(state)._queuedDecodeSequenceIds.size >= state.active || performance.now() - started > ORDERED_MAX_HOLD_MS) {
      dispatch();
    } else {
      setImmediate(poll);
    }
  };
  poll();
}

/** maximumParallelism's token split (an equal share each, the rest in order), with items in sequence-id order. */
function bySequenceId(state: OrderedState, { items, size }: { items: readonly BatchItem[]; size: number }): PrioritizedBatchItem[] {
  const queued = queueOf(state)._queuedDecodes;
  const ordered = items.map((item, i) => ({ item, sequenceId: queued[i]?.sequenceId ?? i }))
    .sort((a, b) => a.sequenceId - b.sequenceId);
  const share = Math.max(1, Math.floor(size / Math.max(1, ordered.length)));
  let left = size;
  const result: PrioritizedBatchItem[] = [];
  for (const { item } of ordered) {
    if (left <= 0) break;
    const processAmount = Math.min(item.tokens.length, share, left);
    result.push({ item, processAmount });
    left -= processAmount;
  }
  for (const entry of result) {
    if (left <= 0) break;
    const more = Math.min(entry.item.tokens.length - entry.processAmount, left);
    entry.processAmount += more;
    left -= more;
  }
  return result;
}

// ---------------------------------------------------------------------------------------------------------------

export class LlamaRunner implements Runner {
  constructor(
    readonly name: string,
    private readonly context: LlamaContext,
    private readonly sequences: LlamaContextSequence[],
    private readonly state: OrderedState,
  ) {}

  async run(requests: readonly GenRequest[], concurrency: number): Promise<RequestTrace[]> {
    if (concurrency > this.sequences.length) {
      throw new RangeError(`${this.name}: concurrency ${concurrency} exceeds the context's ${this.sequences.length} sequences`);
    }
    const traces: RequestTrace[] = requests.map(() => ({ submittedMs: 0, tokenMs: [] }));
    let next = 0;
    const slot = async (sequence: LlamaContextSequence) => {
      while (next < requests.length) {
        const i = next++;
        const request = requests[i]!;
        const trace = traces[i]!;
        trace.submittedMs = performance.now();
        this.state.active++;
        try {
          const { kept, rest } = await reusePrefix(sequence, request.prompt as Token[]);
          trace.cachedTokens = kept;
          // temperature 0: llama.cpp's sampler takes the argmax; EOG tokens are yielded and generation goes on.
          for await (const _token of sequence.evaluate(rest, { temperature: 0, yieldEogToken: true })) {
            trace.tokenMs.push(performance.now());
            if (trace.tokenMs.length === request.maxTokens) break;
          }
        } finally {
          this.state.active--;
        }
      }
    };
    await Promise.all(this.sequences.slice(0, Math.min(concurrency, requests.length)).map(slot));
    return traces;
  }

  async close(): Promise<void> {
    await this.context.dispose();
  }
}

/** Keeps the sequence's KV for the common prefix with `prompt` (never its last token); returns what to evaluate. */
async function reusePrefix(sequence: LlamaContextSequence, prompt: Token[]): Promise<{ kept: number; rest: Token[] }> {
  const cached = sequence.contextTokens;
  let kept = 0;
  while (kept < cached.length && kept < prompt.length - 1 && cached[kept] === prompt[kept]) kept++;
  if (kept === 0) {
    await sequence.clearHistory();
  } else if (kept < sequence.nextTokenIndex) {
    await sequence.eraseContextTokenRanges([{ start: kept, end: sequence.nextTokenIndex }]);
  }
  return { kept, rest: prompt.slice(kept) };
}
