// Starting a TypeScript module in a worker thread, whether the process runs under `node --import tsx` (tests) or
// through bin/conduit.js (which registers tsx programmatically).
import { Worker, type WorkerOptions } from 'node:worker_threads';

const BOOTSTRAP = new URL('./ts-worker-bootstrap.mjs', import.meta.url);

/** Starts `entry` (a file URL of a .ts module) in a new thread; the module reads its input from `workerData.data`. */
export function startTsWorker(entry: URL, data: unknown, options: Omit<WorkerOptions, 'workerData'> = {}): Worker {
  return new Worker(BOOTSTRAP, { ...options, workerData: { entry: entry.href, data } });
}
