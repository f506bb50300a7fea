// Entry of every worker thread: installs the TypeScript loader in the thread (loader hooks registered on the main
// thread do not reach workers started from a JavaScript entry), then loads the real TypeScript entry module.
import { workerData } from 'node:worker_threads';
import { register } from 'tsx/esm/api';

register();
await import(workerData.entry);
