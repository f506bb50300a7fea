// The model card's encoding (frames.ts, kind 1): Node's structured-clone serializer, which carries the typed arrays,
// Maps and Sets of a tokenizer's vocabulary. Only a frontend decodes it, from a worker it authenticated to.

import v8 from 'node:v8';

export function v8Serialize(value: unknown): Buffer {
  return v8.serialize(value);
}

export function v8Deserialize(blob: Buffer): unknown {
  return v8.deserialize(blob);
}
