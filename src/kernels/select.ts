// Which compute backend runs the model: the native addon when it is built and loads, else the TypeScript
// reference (correct, slow), with a notice saying so. `native` insists (an error if unavailable); `reference`
// forces the oracle.

import { nativeBackend } from './native.ts';
import { referenceBackend } from './reference-backend.ts';
import type { BackendFactory } from './types.ts';

export type BackendChoice = 'auto' | 'native' | 'reference';

export function selectBackend(choice: BackendChoice): { factory: BackendFactory; notices: string[] } {
  if (choice === 'reference') return { factory: referenceBackend, notices: [] };
  if (nativeBackend.available()) return { factory: nativeBackend, notices: [] };
  const reason = nativeBackend.unavailableReason() ?? 'unknown reason';
  if (choice === 'native') throw new Error(`native kernels unavailable: ${reason}`);
  return {
    factory: referenceBackend,
    notices: [`native kernels unavailable (${reason}): running on the TypeScript reference backend, which is slow`],
  };
}

/** Every backend that can run here, reference first. */
export function availableBackends(): BackendFactory[] {
  return nativeBackend.available() ? [referenceBackend, nativeBackend] : [referenceBackend];
}
