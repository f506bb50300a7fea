// The engine clock: milliseconds since the Unix epoch with sub-millisecond resolution. performance.now() alone
// counts from each thread's own start, so timestamps taken in a worker thread and in the gateway would not line
// up; adding timeOrigin puts every thread on the same scale.
export function engineNow(): number {
  return performance.timeOrigin + performance.now();
}
