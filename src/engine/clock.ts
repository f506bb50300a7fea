// The engine clock: milliseconds since the Unix epoch with sub-millisecond resolution. performance.now() alone
// counts from each thread's own start, so timestamps taken in a worker thread and in the gateway would not line
// up; adding timeOrigin puts every thread on the same scale.
//
// CONDUIT_CLOCK_SKEW_MS (a number of ms, default 0) moves this process's engine clock, as if it ran on a machine
// whose clock is that far ahead: for tests of times crossing processes (src/cluster/clock-offset.ts). Read once.
const SKEW_MS = clockSkew(process.env.CONDUIT_CLOCK_SKEW_MS);

export function engineNow(): number {
  return performance.timeOrigin + performance.now() + SKEW_MS;
}

function clockSkew(value: string | undefined): number {
  if (value === undefined || value.trim() === '') return 0;
  const ms = Number(value);
  if (!Number.isFinite(ms)) throw new RangeError(`CONDUIT_CLOCK_SKEW_MS must be a number of milliseconds, got "${value}"`);
  return ms;
}
