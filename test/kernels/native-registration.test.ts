// The kernel tables are built once, for every variant, on whatever CPU loads the addon (kernel_table in cpu.cc), so
// the code that fills them in must run anywhere x86-64 does: registration functions and the *_kernel<Type>() helpers
// they call stay outside the files' `#pragma GCC target` regions. The compiler gives no error when one slips inside:
// it just fills the struct with AVX-512 stores, and an AVX2-only CPU dies with SIGILL at start. This reads the
// built addon's machine code and checks that none of those functions holds a VEX or EVEX instruction.
import assert from 'node:assert/strict';
import { spawnSync } from 'node:child_process';
import { existsSync } from 'node:fs';
import { describe, it } from 'node:test';
import { fileURLToPath } from 'node:url';
import { skipNative } from './native-harness.ts';

const ADDON = fileURLToPath(new URL('../../build/Release/conduit_native.node', import.meta.url));
const onX86 = process.arch === 'x64';

/** The registration path: register_*(KernelTable&), kernel_table(Variant), and the *_kernel<...>() table helpers. */
const REGISTRATION = /conduit::(register_\w+\(conduit::KernelTable&\)|kernel_table\(conduit::Variant\)|(\(anonymous namespace\)::)?\w+_kernel<[^>]*>\(\))$/;

/** Instructions that need more than baseline x86-64: VEX/EVEX (v...), AVX-512 mask registers, AMX tiles. */
const BEYOND_BASELINE = /^\s*[0-9a-f]+:\s+(v\w+|k\w+\s+%k|\w*tile\w*)\b|%[yz]mm\d/;

function registrationCode(): Map<string, string[]> {
  const dump = spawnSync('objdump', ['-d', '--no-show-raw-insn', '-C', ADDON], { encoding: 'utf8', maxBuffer: 1 << 30 });
  assert.equal(dump.status, 0, `objdump failed: ${dump.stderr}`);
  const functions = new Map<string, string[]>();
  let current: string[] | undefined;
  for (const line of dump.stdout.split('\n')) {
    const header = /^[0-9a-f]+ <(.*)>:$/.exec(line);
    if (header) {
      const name = header[1]!;
      current = REGISTRATION.test(name) ? [] : undefined;
      if (current) functions.set(name, current);
    } else if (current && line.trim() !== '') {
      current.push(line);
    }
  }
  return functions;
}

describe('native kernel registration runs on any x86-64 CPU', () => {
  const skip = skipNative || (!onX86 && 'the registration check reads x86-64 code')
    || (!existsSync(ADDON) && `no addon at ${ADDON}`);
  it('no registration function or table helper uses VEX, EVEX, mask or tile instructions', { skip }, () => {
    const functions = registrationCode();
    // The registrations must be among them, or the check reads nothing. (Table helpers the compiler inlined into
    // them are checked as part of them.)
    const names = [...functions.keys()];
    for (const expected of ['register_matmul_avx512', 'register_matmul_avx2', 'register_matmul_amx', 'register_attention_avx512', 'kernel_table']) {
      assert.ok(names.some((n) => n.includes(expected)), `${expected} is in the addon's code`);
    }
    const offending = [...functions].flatMap(([name, lines]) =>
      lines.filter((l) => BEYOND_BASELINE.test(l)).slice(0, 2).map((l) => `${name}: ${l.trim()}`));
    assert.deepEqual(offending, []);
  });
});
