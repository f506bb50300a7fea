// A step's time as a function of the tokens it computes. The lower KV tiers' cost model (tiers.ts) prices recomputing
// prompt tokens with it: a token computed in a step that runs anyway costs only what it adds to that step, not the
// step's average time per token, which for a short step is mostly the part every step pays whatever its size (on a
// GPU, and on a CPU too, streaming all the weights once: memory bound).

/** A step-time line: a step of `tokens` tokens takes fixedMs + msPerToken * tokens (a fixed price, for tests). */
export interface StepTimeLine {
  fixedMs: number;
  msPerToken: number;
}

/** Each new step's weight relative to the previous one's of its range: about the last 1 / (1 - 0.95) = 20 weigh most. */
export const STEP_CURVE_DECAY = 0.95;

/**
 * How many tokens apart the smallest and largest steps observed must be before the curve prices anything: over a
 * narrower range (decode steps alone, say) its slope would be mostly timing noise.
 */
export const MIN_CURVE_RANGE_TOKENS = 8;

/**
 * A step's time as a piecewise-linear curve in its tokens, through one point per power-of-two range of step sizes
 * (each the exponentially weighted mean tokens and ms of the steps of that range seen: each range follows its own
 * recent steps, and a range no step has fallen in lately keeps its last figures).
 *
 * One line cannot follow the real shape: a GPU step stays memory bound (nearly flat) up to a few hundred tokens and
 * turns compute bound (steep) after, and a mixture-of-experts step climbs fast while more experts are touched and
 * flattens once all are. A line fitted across decode steps and long prefills (this cost model's price
 * before) prices the tokens a short prefill
 * adds at the long prefills' slope, many times their real cost, and the tiers read blocks it would have been faster to
 * compute. The curve prices a recompute as the difference of its own points around the step sizes in question.
 */
export class StepTimeCurve {
  private readonly points = new Map<number, { weight: number; tokens: number; ms: number }>();

  constructor(private readonly decay = STEP_CURVE_DECAY, private readonly minRangeTokens = MIN_CURVE_RANGE_TOKENS) {
    if (!(decay > 0 && decay <= 1)) throw new RangeError(`decay must be in (0, 1], got ${decay}`);
  }

  /** A step computed `tokens` tokens in `ms`. Steps of no tokens or no measurable time are ignored. */
  observe(tokens: number, ms: number): void {
    if (!(tokens >= 1) || !(ms > 0) || !Number.isFinite(tokens) || !Number.isFinite(ms)) return;
    const range = Math.floor(Math.log2(tokens));
    const point = this.points.get(range);
    if (point === undefined) {
      this.points.set(range, { weight: 1, tokens, ms });
      return;
    }
    point.weight = this.decay * point.weight + 1;
    point.tokens += (tokens - point.tokens) / point.weight;
    point.ms += (ms - point.ms) / point.weight;
  }

  /**
   * The curve's points, fewest tokens first; undefined while the steps seen span fewer than minRangeTokens. A step
   * never gets cheaper with more tokens, so where timing noise put a point below the one before it, the run of points
   * out of order is replaced by its weighted mean time (pool-adjacent-violators: the closest non-decreasing curve in
   * the points' weights, so one noisy long prefill cannot lift the well-observed decode point, nor the reverse).
   */
  knots(): { tokens: number; ms: number }[] | undefined {
    const sorted = [...this.points.entries()].sort(([a], [b]) => a - b).map(([, p]) => p);
    if (sorted.length < 2 || sorted.at(-1)!.tokens - sorted[0]!.tokens < this.minRangeTokens) return undefined;
    // Blocks of consecutive points sharing one time: [first index, weight, mean ms].
    const blocks: { first: number; weight: number; ms: number }[] = [];
    sorted.forEach((point, i) => {
      let block = { first: i, weight: point.weight, ms: point.ms };
      while (blocks.length > 0 && blocks.at(-1)!.ms > block.ms) {
        const before = blocks.pop()!;
        const weight = before.weight + block.weight;
        block = { first: before.first, weight, ms: (before.ms * before.weight + block.ms * block.weight) / weight };
      }
      blocks.push(block);
    });
    const knots = sorted.map((point) => ({ tokens: point.tokens, ms: point.ms }));
    blocks.forEach((block, b) => {
      const end = b + 1 < blocks.length ? blocks[b + 1]!.first : knots.length;
      for (let i = block.first; i < end; i++) knots[i]!.ms = block.ms;
    });
    return knots;
  }

  /**
   * A function giving the time of a step of so many tokens, or undefined while the curve is not determined. Between
   * two points it interpolates; past the last it goes on at the last segment's slope, before the first at the first
   * segment's (not below zero).
   */
  stepMs(): ((tokens: number) => number) | undefined {
    const knots = this.knots();
    if (knots === undefined) return undefined;
    const slope = (i: number) => {
      const a = knots[i]!;
      const b = knots[i + 1]!;
      return b.tokens > a.tokens ? (b.ms - a.ms) / (b.tokens - a.tokens) : 0;
    };
    const last = knots.length - 1;
    return (tokens) => {
      if (tokens <= knots[0]!.tokens) return Math.max(0, knots[0]!.ms - slope(0) * (knots[0]!.tokens - tokens));
      if (tokens >= knots[last]!.tokens) return knots[last]!.ms + slope(last - 1) * (tokens - knots[last]!.tokens);
      let i = 0;
      while (knots[i + 1]!.tokens < tokens) i++;
      return knots[i]!.ms + slope(i) * (tokens - knots[i]!.tokens);
    };
  }
}
