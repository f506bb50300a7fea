#!/usr/bin/env node
// Builds the native kernels (build/Release/conduit_native.node) with node-gyp. Run by `npm install`; `npm run
// build:native` passes --force to rebuild even when the addon is newer than its sources.
//
// A failed build must not fail the install: Conduit then runs on the TypeScript reference backend, so this prints
// one warning and exits 0. Set CONDUIT_REQUIRE_NATIVE=1 (CI) to exit 1 instead. Works offline: node-gyp is pointed
// at the headers of the running Node when they are installed next to it, so it never downloads them.
//
// `--sanitize=address` (ASan + UBSan) or `--sanitize=thread` (TSan) builds an instrumented copy into
// build-sanitize/<kind>/build/Release/conduit_native.node instead, leaving build/Release alone (node-gyp's rebuild
// deletes its whole build/ folder, so the copy is built from a folder of its own that links binding.gyp and
// native/). Such a build is for the sanitizer stress program (benchmarks/native-stress.ts): loading it into node
// needs the sanitizer runtime preloaded; see native/README.md. A failed sanitizer build always exits 1.
import { spawnSync } from 'node:child_process';
import { existsSync, mkdirSync, readdirSync, rmSync, statSync, symlinkSync } from 'node:fs';
import { createRequire } from 'node:module';
import { dirname, join, resolve } from 'node:path';
import { fileURLToPath } from 'node:url';

const root = resolve(dirname(fileURLToPath(import.meta.url)), '..');
const force = process.argv.includes('--force');
const sanitizeArg = process.argv.find((a) => a.startsWith('--sanitize='));
const sanitize = sanitizeArg?.slice('--sanitize='.length);
if (sanitize !== undefined && sanitize !== 'address' && sanitize !== 'thread') {
  console.error(`conduit: --sanitize must be address (ASan + UBSan) or thread (TSan), got "${sanitize}"`);
  process.exit(2);
}
// The folder node-gyp runs in: the repository, or for a sanitizer build one that links its binding.gyp and native/.
const projectDir = sanitize ? join(root, 'build-sanitize', sanitize) : root;
const addonPath = join(projectDir, 'build', 'Release', 'conduit_native.node');
const required = sanitize !== undefined || process.env.CONDUIT_REQUIRE_NATIVE === '1';

function newestSourceTime() {
  const files = [join(root, 'binding.gyp'), ...readdirSync(join(root, 'native')).map((f) => join(root, 'native', f))];
  return Math.max(...files.map((f) => statSync(f).mtimeMs));
}

/** node-gyp's entry script: a local install, npm's bundled copy, or the one beside the running node. */
function findNodeGyp() {
  const candidates = [];
  try {
    candidates.push(createRequire(join(root, 'package.json')).resolve('node-gyp/bin/node-gyp.js'));
  } catch {
    // not installed locally: fall through to npm's own copy
  }
  if (process.env.npm_execpath) {
    candidates.push(join(dirname(process.env.npm_execpath), '..', 'node_modules', 'node-gyp', 'bin', 'node-gyp.js'));
  }
  const prefix = resolve(dirname(process.execPath), '..');
  candidates.push(join(prefix, 'lib', 'node_modules', 'npm', 'node_modules', 'node-gyp', 'bin', 'node-gyp.js'));
  return candidates.find((c) => existsSync(c));
}

/** The running Node's own headers, when installed (Debian's nodejs, official tarballs): no download needed. */
function localNodeDir() {
  if (process.env.npm_config_nodedir) return undefined; // npm already tells node-gyp
  const prefix = resolve(dirname(process.execPath), '..');
  return existsSync(join(prefix, 'include', 'node', 'node_api.h')) ? prefix : undefined;
}

function fail(reason, log = '') {
  if (sanitize) {
    const tail = log.trim().split('\n').slice(-30).join('\n');
    console.error(`conduit: the ${sanitize} sanitizer build failed (${reason})\n${tail}`);
    process.exit(1);
  }
  const tail = log.trim().split('\n').slice(-15).join('\n');
  console.warn(
    `conduit: WARNING: the native kernels were not built (${reason}); Conduit will use the slower TypeScript ` +
      `reference backend. Rebuild with \`npm run build:native\` once fixed.${tail ? `\n${tail}` : ''}`,
  );
  process.exit(required ? 1 : 0);
}

if (!force && existsSync(addonPath) && statSync(addonPath).mtimeMs >= newestSourceTime()) {
  process.exit(0);
}
const nodeGyp = findNodeGyp();
if (!nodeGyp) fail('node-gyp was not found (it ships with npm)');
const nodeDir = localNodeDir();
if (sanitize) {
  mkdirSync(projectDir, { recursive: true });
  for (const name of ['binding.gyp', 'native']) {
    rmSync(join(projectDir, name), { force: true, recursive: false });
    symlinkSync(join(root, name), join(projectDir, name));
  }
}
const args = [nodeGyp, 'rebuild', '--jobs', 'max', ...(nodeDir ? [`--nodedir=${nodeDir}`] : []),
  ...(sanitize ? ['--', `-Dsanitize=${sanitize}`] : [])];
const started = Date.now();
const result = spawnSync(process.execPath, args, { cwd: projectDir, encoding: 'utf8', env: process.env });
const log = `${result.stdout ?? ''}${result.stderr ?? ''}`;
if (result.error) fail(`could not run node-gyp: ${result.error.message}`, log);
if (result.status !== 0) fail(`node-gyp exited with status ${result.status}`, log);
if (!existsSync(addonPath)) fail(`node-gyp succeeded but ${addonPath} is missing`, log);
const kind = sanitize ? ` (${sanitize} sanitizer)` : '';
console.log(`conduit: native kernels${kind} built in ${((Date.now() - started) / 1000).toFixed(1)} s (${addonPath})`);
