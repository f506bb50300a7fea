// The thread that tokenizes large prompts for the gateway (src/api/prompt-encoder.ts): the same tokenizer, rebuilt
// from its worker source, answering { id, text, options } with the ids (as an Int32Array, transferred) or an error.

import { parentPort, workerData } from 'node:worker_threads';
import type { EncodeOptions, TokenizerWorkerSource } from '../model/tokenizer/types.ts';
import { tokenizerFromWorkerSource } from '../model/tokenizer/worker-source.ts';

export interface EncodeJob {
  id: number;
  text: string;
  options: EncodeOptions;
}

export type EncodeAnswer =
  | { id: number; ids: Int32Array }
  | { id: number; error: { name: string; message: string } };

const port = parentPort!;
const tokenizer = tokenizerFromWorkerSource((workerData as { data: TokenizerWorkerSource }).data);

port.on('message', (job: EncodeJob) => {
  let answer: EncodeAnswer;
  try {
    answer = { id: job.id, ids: Int32Array.from(tokenizer.encode(job.text, job.options)) };
  } catch (err) {
    const error = err instanceof Error ? err : new Error(String(err));
    answer = { id: job.id, error: { name: error.name, message: error.message } };
  }
  port.postMessage(answer, 'ids' in answer ? [answer.ids.buffer as ArrayBuffer] : []);
});
