// Writes a synthetic Llama GGUF from a named spec:
//   node --import tsx scripts/make-synthetic-model.ts <spec-name> <dtype> <out.gguf>
// spec-name: conduit-synthetic-22m | synthetic-110m; dtype: F32 F16 BF16 Q8_0 Q4_0 Q4_K Q5_K Q6_K.

import { renameSync, rmSync, statSync } from 'node:fs';
import { SYNTHETIC_DTYPES, syntheticSpec, writeSyntheticModel } from '../src/model/synthetic.ts';

const [specName, dtype, outPath] = process.argv.slice(2);
if (!specName || !dtype || !outPath) {
  console.error('usage: node --import tsx scripts/make-synthetic-model.ts <spec-name> <dtype> <out.gguf>\n' +
    `  spec-name: conduit-synthetic-22m | synthetic-110m\n  dtype: ${Object.keys(SYNTHETIC_DTYPES).join(' ')}`);
  process.exit(2);
}

try {
  const spec = syntheticSpec(specName, dtype);
  const started = performance.now();
  // Written beside the target and renamed, so a reader never sees half a file.
  const temporary = `${outPath}.${process.pid}.tmp`;
  try {
    writeSyntheticModel(spec, temporary);
    renameSync(temporary, outPath);
  } catch (error) {
    rmSync(temporary, { force: true });
    throw error;
  }
  const megabytes = (statSync(outPath).size / 2 ** 20).toFixed(1);
  console.log(`wrote ${outPath}: ${spec.name} ${spec.dtype}, ${megabytes} MiB in ${((performance.now() - started) / 1000).toFixed(1)} s`);
} catch (error) {
  console.error(`error: ${(error as Error).message}`);
  process.exit(1);
}
