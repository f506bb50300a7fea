// Imports test files into this process for node:test. Node 20 neither expands globs nor discovers .ts files, and
// one process for many suites is several times faster than a process per file, so an entry file (test/run.ts, or
// one of npm test's halves) imports every *.test.ts under test/ it is given.
// Every test and hook gets a default timeout (test/helpers/node-test.ts), and assert.ok without a message fails fast
// (test/helpers/assert.ts): the hook below hands the test files those modules when they import node:test and
// node:assert/strict.
import { readdirSync, statSync } from 'node:fs';
import { register } from 'node:module';
import { join, relative } from 'node:path';
import { fileURLToPath, pathToFileURL } from 'node:url';

const root = fileURLToPath(new URL('.', import.meta.url));

function collect(dir: string): string[] {
  const out: string[] = [];
  for (const name of readdirSync(dir).sort()) {
    const path = join(dir, name);
    if (statSync(path).isDirectory()) out.push(...collect(path));
    else if (name.endsWith('.test.ts')) out.push(path);
  }
  return out;
}

export interface TestSelection {
  /** A substring of the path under test/, e.g. "model/gguf" (CONDUIT_TEST_FILTER). */
  filter?: string | undefined;
  /** [k, n]: the k-th (from 1) of n parts, every n-th file in path order from the k-th. */
  part?: readonly [number, number];
}

export async function importTestFiles(selection: TestSelection): Promise<void> {
  register('./helpers/node-test-hooks.mjs', import.meta.url, {
    data: {
      testRoot: pathToFileURL(root).href,
      wrappers: {
        'node:test': new URL('./helpers/node-test.ts', import.meta.url).href,
        'node:assert/strict': new URL('./helpers/assert.ts', import.meta.url).href,
      },
    },
  });
  const files = collect(root).filter((file) => !selection.filter || relative(root, file).includes(selection.filter));
  for (const [index, file] of files.entries()) {
    if (selection.part && index % selection.part[1] !== selection.part[0] - 1) continue;
    await import(pathToFileURL(file).href);
  }
}
