// Shared factories for the scheduler tests: a scheduler over a tiny pool, requests with distinct prompts, and a
// step driver that plays the model by handing back chosen tokens.
import { KvCacheManager } from '../../src/engine/kv-cache/manager.ts';
import { Scheduler } from '../../src/engine/scheduler.ts';
import type { SampleTarget, SchedulerConfig, StepPlan, StepResult } from '../../src/engine/scheduler.ts';
import { DEFAULT_SAMPLING } from '../../src/engine/types.ts';
import type { EngineRequest, SamplingParams } from '../../src/engine/types.ts';

export const EOS = 2;
/** What the fake model samples unless told otherwise: never a stop token. */
export const FILLER = 7;

export interface TestSchedulerOptions extends Partial<SchedulerConfig> {
  numBlocks?: number;
  blockSize?: number;
  enablePrefixCaching?: boolean;
  enableEvents?: boolean;
}

export function makeScheduler(options: TestSchedulerOptions = {}): Scheduler {
  const { numBlocks = 64, blockSize = 4, enablePrefixCaching, enableEvents, ...config } = options;
  const kv = new KvCacheManager({ numBlocks, blockSize, enablePrefixCaching, enableEvents });
  return new Scheduler({ maxNumBatchedTokens: 64, maxNumSeqs: 8, maxModelLen: 256, eosTokenIds: [EOS], ...config }, kv);
}

export interface RequestOverrides extends Partial<Omit<EngineRequest, 'sampling'>> {
  sampling?: Partial<SamplingParams>;
}

export function makeRequest(id: string, promptTokenIds: number[], overrides: RequestOverrides = {}): EngineRequest {
  const { sampling, ...rest } = overrides;
  return {
    id, promptTokenIds, priority: 0, arrivalMs: 0, ...rest,
    sampling: { ...DEFAULT_SAMPLING, maxTokens: 1000, ...sampling },
  };
}

/** Distinct tokens per seed, clear of EOS and FILLER, so unrelated prompts never share a block. */
export function prompt(seed: number, length: number): number[] {
  return Array.from({ length }, (_, i) => 1000 * (seed + 1) + i);
}

/** Requests r0..r{count-1} with distinct prompts of one length, arriving 1 ms apart. */
export function makeRequests(count: number, promptLength: number, overrides: RequestOverrides = {}): EngineRequest[] {
  return Array.from({ length: count }, (_, i) => makeRequest(`r${i}`, prompt(i, promptLength), { arrivalMs: i, ...overrides }));
}

export function addAll(scheduler: Scheduler, requests: EngineRequest[], nowMs = 0): void {
  for (const request of requests) scheduler.addRequest(request, nowMs);
}

export interface StepOutcome {
  plan: StepPlan;
  result: StepResult;
}

/** One engine step: schedule, "sample" with pick (FILLER by default), apply. */
export function step(scheduler: Scheduler, nowMs = 0, pick: (target: SampleTarget) => number = () => FILLER): StepOutcome {
  const plan = scheduler.schedule(nowMs);
  if (plan.scheduled.length === 0) return { plan, result: { outputs: [], finishedRequests: [] } };
  const result = scheduler.updateFromOutput(plan, plan.sampleTargets.map(pick), nowMs + 1);
  return { plan, result };
}

/** The plan as "request/index+newTokens" strings, with "*k" when it samples k rows: short and exact to assert. */
export function summary(plan: StepPlan): string[] {
  return plan.scheduled.map(({ sequence, numNewTokens, numSamples }) =>
    `${sequence.request.id}/${sequence.index}+${numNewTokens}${numSamples > 0 ? `*${numSamples}` : ''}`);
}

export function blockIds(scheduler: Scheduler, requestId: string, index = 0): number[] {
  const request = scheduler.getRequest(requestId);
  if (request === undefined) throw new Error(`no request ${requestId}`);
  return request.sequences[index]!.blockTable.blockIds;
}
