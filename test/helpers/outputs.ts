// Reading an engine's output stream in tests.
import type { EngineOutput } from '../../src/engine/types.ts';

/** Every output of a stream, in order. */
export async function collect(stream: AsyncIterable<EngineOutput>): Promise<EngineOutput[]> {
  const outputs: EngineOutput[] = [];
  for await (const output of stream) outputs.push(output);
  return outputs;
}

/** The token ids the outputs carried, in order. */
export const tokens = (outputs: EngineOutput[]): number[] => outputs.flatMap((o) => o.newTokenIds);

/** The text the outputs carried. */
export const text = (outputs: EngineOutput[]): string => outputs.map((o) => o.textDelta).join('');
