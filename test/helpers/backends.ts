// The compute backends every engine-level suite runs over: the TypeScript reference always, and the native addon
// when it is built (CI builds it; a machine without a compiler still runs the reference suites).
import type { BackendFactory } from '../../src/kernels/types.ts';
import { availableBackends } from '../../src/kernels/select.ts';

/** Reference first, fastest last. */
export function engineBackends(): BackendFactory[] {
  return availableBackends();
}
