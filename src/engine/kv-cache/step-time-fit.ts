// A step's time as a line in the tokens it computes: fixedMs + msPerToken * tokens. The fixed part is what every step
// pays whatever its size (on a GPU, and on a CPU too, streaming all the weights once: memory bound), the per-token part
// what each token adds on top. The lower KV tiers' cost model (tiers.ts) prices recomputing prompt tokens with it: a
// token computed in a step that runs anyway costs only msPerToken, not the step's average time per token, which for a
// short step is mostly the fixed part.
//
// Fitted by exponentially weighted least squares over the steps observed (decode steps too: they are what pins the
// fixed part down), so the line follows the recent load and hardware state. The weighted means and co-moments are
// updated incrementally (West's weighted Welford update), which stays accurate where the raw sums of squares would
// cancel.

/** A step-time line: a step of `tokens` tokens takes fixedMs + msPerToken * tokens. */
export interface StepTimeLine {
  fixedMs: number;
  msPerToken: number;
}

/** Each new step's weight relative to the previous one's: about the last 1 / (1 - 0.95) = 20 steps weigh most. */
export const STEP_FIT_DECAY = 0.95;
/**
 * The weighted standard deviation of the steps' token counts below which the fit says nothing: steps of (nearly) one
 * size cannot tell the fixed part from the per-token part, and a slope from a few tokens of spread is mostly timing noise.
 */
export const MIN_FIT_SPREAD_TOKENS = 4;

export class StepTimeFit {
  /** Sum of the weights (each observation's weight decays by `decay` per later one). */
  private weight = 0;
  private meanTokens = 0;
  private meanMs = 0;
  /** Weighted sums of (tokens - meanTokens)^2 and (tokens - meanTokens) * (ms - meanMs). */
  private tokensSquares = 0;
  private tokensMsProducts = 0;

  constructor(private readonly decay = STEP_FIT_DECAY, private readonly minSpreadTokens = MIN_FIT_SPREAD_TOKENS) {
    if (!(decay > 0 && decay <= 1)) throw new RangeError(`decay must be in (0, 1], got ${decay}`);
  }

  /** A step computed `tokens` tokens in `ms`. Steps of no tokens or no measurable time are ignored. */
  observe(tokens: number, ms: number): void {
    if (!(tokens > 0) || !(ms > 0) || !Number.isFinite(tokens) || !Number.isFinite(ms)) return;
    this.weight = this.decay * this.weight + 1;
    this.tokensSquares *= this.decay;
    this.tokensMsProducts *= this.decay;
    const tokensDelta = tokens - this.meanTokens;
    this.meanTokens += tokensDelta / this.weight;
    this.meanMs += (ms - this.meanMs) / this.weight;
    this.tokensSquares += tokensDelta * (tokens - this.meanTokens);
    this.tokensMsProducts += tokensDelta * (ms - this.meanMs);
  }

  /**
   * The fitted line, or undefined while the steps seen do not determine it: too little spread in their sizes, or a
   * line no step time can follow (a negative slope or fixed part, which only noise produces).
   */
  line(): StepTimeLine | undefined {
    if (this.weight === 0 || this.tokensSquares / this.weight < this.minSpreadTokens ** 2) return undefined;
    const msPerToken = this.tokensMsProducts / this.tokensSquares;
    const fixedMs = this.meanMs - msPerToken * this.meanTokens;
    if (!(msPerToken >= 0) || !(fixedMs >= 0)) return undefined;
    return { fixedMs, msPerToken };
  }
}
