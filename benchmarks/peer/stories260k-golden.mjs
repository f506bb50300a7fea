// Records llama.cpp's greedy continuation of "Once upon a time" on stories260K.gguf, with and without BOS, as the
// JSON of ../shared/models/stories260K.expected.json. See stories260k-golden.md.
//
//   cd benchmarks/peer && npm install && node stories260k-golden.mjs [path/to/stories260K.gguf] > expected.json

import { fileURLToPath } from 'node:url';
import { getLlama } from 'node-llama-cpp';

const PROMPT = 'Once upon a time';
const NEW_TOKENS = 32;
const modelPath = process.argv[2]
  ?? fileURLToPath(new URL('../../../shared/models/stories260K.gguf', import.meta.url));

// CPU only and prebuilt binaries only, so the numbers come from the released llama.cpp build, not a local compile.
const llama = await getLlama({ gpu: false, build: 'never', logLevel: 'error' });
const model = await llama.loadModel({ modelPath, gpuLayers: 0 });

async function greedy(promptTokens) {
  // A fresh context per case, so nothing from the other case is cached.
  const context = await model.createContext({ contextSize: 256, sequences: 1 });
  const sequence = context.getSequence();
  const generated = [];
  // temperature 0 makes llama.cpp's sampler take the argmax; EOG tokens are yielded rather than ending the loop.
  for await (const token of sequence.evaluate(promptTokens, { temperature: 0, yieldEogToken: true })) {
    generated.push(token);
    if (generated.length === NEW_TOKENS) break;
  }
  await context.dispose();
  return generated;
}

// tokenize() adds no BOS and treats "<s>"-like text as plain text; llama.cpp's SentencePiece path still adds the
// leading space ("▁Once").
const textTokens = model.tokenize(PROMPT, false);
const cases = [];
for (const bos of [true, false]) {
  const promptTokens = bos ? [model.tokens.bos, ...textTokens] : [...textTokens];
  const greedyTokens = await greedy(promptTokens);
  cases.push({
    prompt: PROMPT,
    bos,
    prompt_tokens: promptTokens,
    greedy_tokens: greedyTokens,
    text: model.detokenize([...textTokens, ...greedyTokens]),
  });
}

console.log(JSON.stringify({
  model: 'stories260K.gguf',
  engine: `llama.cpp via node-llama-cpp 3.22.1 (prebuilt ${process.platform}-${process.arch} CPU build), ` +
    `greedy argmax (temperature 0), ${NEW_TOKENS} new tokens`,
  cases,
}, null, 2));

await model.dispose();
await llama.dispose();
