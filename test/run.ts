// Single entry for node:test. Node 20 neither expands globs nor discovers .ts files, and one process for all
// suites is several times faster than a process per file, so this file imports every *.test.ts under test/.
// Every test and hook gets a default timeout (test/helpers/node-test.ts), and assert.ok without a message fails fast
// (test/helpers/assert.ts): the hook below hands the test files those modules when they import node:test and
// node:assert/strict.
import { readdirSync, statSync } from 'node:fs';
import { register } from 'node:module';
import { join, relative } from 'node:path';
import { fileURLToPath, pathToFileURL } from 'node:url';

const root = fileURLToPath(new URL('.', import.meta.url));
const filter = process.env.CONDUIT_TEST_FILTER; // substring of the path, e.g. "model/gguf"

register('./helpers/node-test-hooks.mjs', import.meta.url, {
  data: {
    testRoot: pathToFileURL(root).href,
    wrappers: {
      'node:test': new URL('./helpers/node-test.ts', import.meta.url).href,
      'node:assert/strict': new URL('./helpers/assert.ts', import.meta.url).href,
    },
  },
});

function collect(dir: string): string[] {
  const out: string[] = [];
  for (const name of readdirSync(dir).sort()) {
    const path = join(dir, name);
    if (statSync(path).isDirectory()) out.push(...collect(path));
    else if (name.endsWith('.test.ts')) out.push(path);
  }
  return out;
}

for (const file of collect(root)) {
  if (filter && !relative(root, file).includes(filter)) continue;
  await import(pathToFileURL(file).href);
}
