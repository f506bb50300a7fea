// docs/architecture.md's "Layout of src/" table is the rule for which folder of src/ may import which: this test reads
// every import of src/**/*.ts (static imports, re-exports, dynamic imports and worker entry URLs) and compares the
// folders they reach with the table, both ways, and checks that the folders form no cycle.
import assert from 'node:assert/strict';
import { readdirSync, readFileSync, statSync } from 'node:fs';
import { dirname, join, normalize, relative, sep } from 'node:path';
import { fileURLToPath } from 'node:url';
import { describe, test } from 'node:test';

const repo = fileURLToPath(new URL('..', import.meta.url));
const src = join(repo, 'src');

function sourceFiles(dir: string): string[] {
  return readdirSync(dir).sort().flatMap((name) => {
    const path = join(dir, name);
    if (statSync(path).isDirectory()) return sourceFiles(path);
    return name.endsWith('.ts') ? [path] : [];
  });
}

/** The src/ folder a path under src/ belongs to. */
function folderOf(path: string): string {
  const parts = relative(src, path).split(sep);
  return parts.length > 1 ? parts[0]! : '.';
}

const SPECIFIER = /\bfrom\s+'(\.[^']+)'|\bimport\(\s*'(\.[^']+)'\s*\)|\bnew URL\(\s*'(\.[^']+)'/g;

/** Folder -> folder -> the files behind the edge, from the code. */
export function importGraph(): Map<string, Map<string, string[]>> {
  const graph = new Map<string, Map<string, string[]>>();
  for (const file of sourceFiles(src)) {
    const from = folderOf(file);
    const edges = graph.get(from) ?? new Map<string, string[]>();
    graph.set(from, edges);
    for (const match of readFileSync(file, 'utf8').matchAll(SPECIFIER)) {
      const target = normalize(join(dirname(file), (match[1] ?? match[2] ?? match[3])!));
      if (relative(src, target).startsWith('..')) continue;
      const to = folderOf(target);
      if (to === from) continue;
      edges.set(to, [...(edges.get(to) ?? []), relative(repo, file)]);
    }
  }
  return graph;
}

/** Folder -> the folders its row allows ('everything' as null). */
export function tableRules(markdown: string): Map<string, Set<string> | null> {
  const section = markdown.slice(markdown.indexOf('## Layout of `src/`'));
  const rules = new Map<string, Set<string> | null>();
  for (const line of section.split('\n')) {
    const row = /^\| `([a-z-]+)\/` \|[^|]*\| ([^|]*) \|$/.exec(line);
    if (!row) {
      if (rules.size > 0 && !line.startsWith('|')) break;
      continue;
    }
    const allowed = row[2]!.trim();
    if (allowed === 'everything') rules.set(row[1]!, null);
    else if (allowed === '-') rules.set(row[1]!, new Set());
    else rules.set(row[1]!, new Set(allowed.replace(/\([^)]*\)/g, '').split(',').map((name) => name.trim())));
  }
  return rules;
}

describe('architecture: the import table in docs/architecture.md', () => {
  const rules = tableRules(readFileSync(join(repo, 'docs/architecture.md'), 'utf8'));
  const graph = importGraph();

  test('has a row for every folder of src/', () => {
    const folders = readdirSync(src).filter((name) => statSync(join(src, name)).isDirectory()).sort();
    assert.deepEqual([...rules.keys()].sort(), folders);
    assert.ok(!graph.has('.'), 'no source files directly in src/');
  });

  test('every folder imports only what its row names, and everything it names', () => {
    const problems: string[] = [];
    for (const [folder, allowed] of rules) {
      const edges = graph.get(folder) ?? new Map<string, string[]>();
      if (allowed === null) continue;
      for (const [to, files] of edges) {
        if (!allowed.has(to)) problems.push(`${folder}/ imports ${to}/ (${files[0]}), which its row does not allow`);
      }
      for (const to of allowed) if (!edges.has(to)) problems.push(`${folder}/'s row names ${to}/, which it never imports`);
    }
    assert.deepEqual(problems, []);
  });

  test('the folders import each other without a cycle', () => {
    const state = new Map<string, 'open' | 'done'>();
    const visit = (folder: string, path: string[]): void => {
      if (state.get(folder) === 'done') return;
      assert.notEqual(state.get(folder), 'open', `import cycle: ${[...path, folder].join(' -> ')}`);
      state.set(folder, 'open');
      for (const to of graph.get(folder)?.keys() ?? []) visit(to, [...path, folder]);
      state.set(folder, 'done');
    };
    for (const folder of graph.keys()) visit(folder, []);
  });
});
