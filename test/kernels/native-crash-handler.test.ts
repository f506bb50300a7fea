// A fatal native error is never silent: the addon's signal handler reports the signal, the thread, the kernel
// variant and a backtrace on stderr, then the process dies by the same signal. Each crash runs in a child process
// (the addon's test-only crashForTesting entry, refused without CONDUIT_NATIVE_CRASH_TEST=1).
import assert from 'node:assert/strict';
import { spawnSync } from 'node:child_process';
import { createRequire } from 'node:module';
import { describe, it } from 'node:test';

import { NATIVE_ADDON_PATH } from '../../src/kernels/native.ts';
import { skipNative, variants } from './native-harness.ts';

interface CrashAddon {
  crashHandlerStatus(): string;
  crashForTesting(kind: string, variant?: string): void;
}

const crashAddon = skipNative ? undefined : (createRequire(import.meta.url)(NATIVE_ADDON_PATH) as CrashAddon);
// A sanitizer build (CONDUIT_NATIVE_ADDON) leaves the signals to the sanitizer: nothing to test then.
const skipHandler = skipNative || (crashAddon!.crashHandlerStatus() === 'installed'
  ? false : `crash handler ${crashAddon!.crashHandlerStatus()}`);

function runChild(body: string, crashTest = true): ReturnType<typeof spawnSync> & { stderr: string; stdout: string } {
  const script = `const addon = require(${JSON.stringify(NATIVE_ADDON_PATH)});\n${body}`;
  const env: NodeJS.ProcessEnv = { ...process.env };
  if (crashTest) env.CONDUIT_NATIVE_CRASH_TEST = '1';
  else delete env.CONDUIT_NATIVE_CRASH_TEST;
  return spawnSync(process.execPath, ['-e', script], { env, encoding: 'utf8', timeout: 60_000 });
}

const cases: Array<{ kind: string; signal: NodeJS.Signals; thread: RegExp; cause: RegExp }> = [
  { kind: 'segv', signal: 'SIGSEGV', thread: /"node"/, cause: /address 0x0\b/ },
  { kind: 'segv-pool', signal: 'SIGSEGV', thread: /"conduit-pool-1"/, cause: /address 0x0\b/ },
  // A stack overflow faults on the guard page; the report runs on the thread's alternate signal stack.
  { kind: 'stack-overflow', signal: 'SIGSEGV', thread: /"node"/, cause: /invalid memory reference/ },
  { kind: 'stack-overflow-pool', signal: 'SIGSEGV', thread: /"conduit-pool-1"/, cause: /invalid memory reference/ },
  { kind: 'fpe', signal: 'SIGFPE', thread: /"node"/, cause: /integer division by zero/ },
  { kind: 'ill', signal: 'SIGILL', thread: /"node"/, cause: /illegal instruction/ },
  { kind: 'bus', signal: 'SIGBUS', thread: /"node"/, cause: /sent by kill\/raise/ },
  { kind: 'abort', signal: 'SIGABRT', thread: /"node"/, cause: /sent by kill\/raise/ },
];

describe('native crash handler', { skip: skipHandler }, () => {
  for (const c of cases) {
    it(`reports ${c.kind} (${c.signal}) with its thread and kernel variant, then dies by the signal`, () => {
      const r = runChild(`addon.crashForTesting(${JSON.stringify(c.kind)}, 'generic'); console.log('still alive');`);
      assert.equal(r.signal, c.signal, `status ${r.status}, stderr: ${r.stderr}`);
      assert.doesNotMatch(r.stdout, /still alive/);
      assert.match(r.stderr, new RegExp(`conduit: FATAL native error: ${c.signal} \\(`));
      assert.match(r.stderr, c.cause);
      assert.match(r.stderr, c.thread);
      assert.match(r.stderr, /kernel variant generic \(the last one the addon ran\)/);
      // backtrace_symbols_fd lines name the addon's file (the crash is in it) and end with the frame's address.
      assert.match(r.stderr, /backtrace \(innermost first\):\n(.*\[0x[0-9a-f]+\]\n)+/);
      assert.match(r.stderr, /conduit_native\.node/);
      assert.match(r.stderr, new RegExp(`the process now dies by ${c.signal}`));
    });
  }

  const skipAvx2 = !variants.includes('avx2') && 'this CPU has no avx2';
  it('names the variant last run, not one only described', { skip: skipAvx2 }, () => {
    // kernelVariants only describes a variant; crashForTesting, like forward and ops.*, records the one it runs.
    const r = runChild("addon.ops.add('avx2', new Float32Array(3), new Float32Array(3)); " +
      "addon.kernelVariants('generic'); addon.crashForTesting('segv-pool');");
    assert.equal(r.signal, 'SIGSEGV', r.stderr);
    assert.match(r.stderr, /kernel variant avx2 \(the last one the addon ran\)/);
  });

  it('refuses to crash without CONDUIT_NATIVE_CRASH_TEST=1', () => {
    const r = runChild("try { addon.crashForTesting('segv') } catch (e) { console.log(e.message) }", false);
    assert.equal(r.signal, null, r.stderr);
    assert.equal(r.status, 0, r.stderr);
    assert.match(r.stdout, /needs CONDUIT_NATIVE_CRASH_TEST=1/);
  });

  it('leaves WebAssembly bounds checks to V8: an out-of-bounds load still throws, nothing is reported', () => {
    // (module (memory 1) (func (export "f") (result i32) (i32.load (i32.const 0x7fffffff))))
    const wasm = [
      0x00, 0x61, 0x73, 0x6d, 0x01, 0x00, 0x00, 0x00, 0x01, 0x05, 0x01, 0x60, 0x00, 0x01, 0x7f, 0x03, 0x02, 0x01,
      0x00, 0x05, 0x03, 0x01, 0x00, 0x01, 0x07, 0x05, 0x01, 0x01, 0x66, 0x00, 0x00, 0x0a, 0x0d, 0x01, 0x0b, 0x00,
      0x41, 0xff, 0xff, 0xff, 0xff, 0x07, 0x28, 0x02, 0x00, 0x0b,
    ];
    const r = runChild(`
      const { exports } = new WebAssembly.Instance(new WebAssembly.Module(new Uint8Array(${JSON.stringify(wasm)})));
      for (let i = 0; i < 3; i++) {
        try { exports.f(); console.log('no trap'); } catch (e) { console.log(e.constructor.name + ': ' + e.message); }
      }`);
    assert.equal(r.signal, null, r.stderr);
    assert.equal(r.status, 0, r.stderr);
    assert.doesNotMatch(r.stderr, /FATAL native error/);
    assert.equal(r.stdout.trim().split('\n').filter((l) => /^RuntimeError: memory access out of bounds/.test(l)).length,
      3, r.stdout);
  });
});
