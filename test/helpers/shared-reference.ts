// Reference data from ../shared/reference (figures measured elsewhere, e.g. kernel times on real GPUs). Like
// ../shared/models it may be absent, so suites that read a file call `skipUnlessReference(path)` and skip with its
// message.
import { existsSync, readFileSync } from 'node:fs';
import { join } from 'node:path';
import { fileURLToPath } from 'node:url';

export const SHARED_REFERENCE_DIR = process.env.CONDUIT_SHARED_REFERENCE
  ?? fileURLToPath(new URL('../../../shared/reference', import.meta.url));

/** Absolute path of a file under the shared reference folder, or undefined when it is not there. */
export function sharedReference(path: string): string | undefined {
  const full = join(SHARED_REFERENCE_DIR, path);
  return existsSync(full) ? full : undefined;
}

/** The `skip` option for node:test: false when every file exists, else a message naming the first one missing. */
export function skipUnlessReference(...paths: string[]): string | false {
  const missing = paths.find((p) => !sharedReference(p));
  return missing === undefined ? false
    : `needs ${missing} from ${SHARED_REFERENCE_DIR} (../shared/reference), which is absent`;
}

/** A reference JSON file, parsed (call only when skipUnlessReference(path) is false). */
export function readReferenceJson<T>(path: string): T {
  const full = sharedReference(path);
  if (!full) throw new Error(skipUnlessReference(path) as string);
  return JSON.parse(readFileSync(full, 'utf8')) as T;
}
