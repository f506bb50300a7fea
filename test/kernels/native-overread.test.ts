// Kernels never read past the end of their inputs. The weights and activations are placed in arrays whose last byte
// is followed by an inaccessible page (ops.guardedBytes), so an over-read faults instead of reading a neighbour's
// bytes; the matmuls run in a child process, where a fault is an exit signal here, and their results must equal
// the same call on ordinary memory. Found by the UBSan build: the avx512 int8 GEMM on ggml rows gathered the
// scales of 16 rows past the matrix when a tile's last pair of 16-row panels had 16 rows or fewer.
import assert from 'node:assert/strict';
import { spawnSync } from 'node:child_process';
import { describe, it } from 'node:test';

import { NATIVE_ADDON_PATH } from '../../src/kernels/native.ts';
import { GgmlType } from '../../src/model/ggml-types.ts';
import { skipNative, variants } from './native-harness.ts';

const script = `
const addon = require(process.env.ADDON);
const { variants, types } = JSON.parse(process.env.CASES);
let state = 12345;
const rand = () => ((state = (state * 1103515245 + 12345) >>> 0) / 2 ** 32) - 0.5;
const blockBytes = { 8: 34, 2: 18 };  // Q8_0, Q4_0: bytes per 32 values
let calls = 0;
for (const variant of variants) {
  for (const type of types) {
    for (const k of [32, 96]) {
      for (const n of [1, 15, 17, 33, 40, 47, 48, 70]) {
        const bytes = (k / 32) * blockBytes[type] * n;
        const w = addon.ops.guardedBytes(bytes);
        // Valid blocks: small f16 scales (0x2c00 = 2^-4) and random quants.
        for (let i = 0; i < bytes; i++) w[i] = Math.floor((rand() + 0.5) * 256);
        const step = blockBytes[type];
        for (let b = 0; b < bytes; b += step) { w[b] = 0x00; w[b + 1] = 0x2c; }
        const plain = Uint8Array.from(w);
        for (const m of [1, 3, 4, 8, 17]) {
          const xg = new Float32Array(addon.ops.guardedBytes(m * k * 4).buffer);
          for (let i = 0; i < xg.length; i++) xg[i] = rand();
          for (const threads of [1, 2, 3]) {
            const y = new Float32Array(m * n), expected = new Float32Array(m * n);
            addon.ops.matmul(variant, type, w, xg, m, k, n, y, threads);
            addon.ops.matmul(variant, type, plain, Float32Array.from(xg), m, k, n, expected, threads);
            for (let i = 0; i < y.length; i++) {
              if (!Object.is(y[i], expected[i])) {
                throw new Error(variant + ' type ' + type + ' ' + m + 'x' + k + 'x' + n + ': results differ');
              }
            }
            calls++;
          }
        }
      }
    }
  }
}
console.log('calls ' + calls);
`;

describe('native kernels stay inside their inputs', { skip: skipNative }, () => {
  it('int8 matmuls on ggml rows read no byte past the weights or the activations', () => {
    const r = spawnSync(process.execPath, ['-e', script], {
      env: {
        ...process.env, ADDON: NATIVE_ADDON_PATH,
        CASES: JSON.stringify({ variants, types: [GgmlType.Q8_0, GgmlType.Q4_0] }),
      },
      encoding: 'utf8', timeout: 120_000,
    });
    assert.equal(r.signal, null, `the matmuls died by ${r.signal} (an over-read hit the guard page): ${r.stderr}`);
    assert.equal(r.status, 0, r.stderr);
    assert.equal(r.stdout.trim(), `calls ${variants.length * 2 * 2 * 8 * 5 * 3}`);
  });
});
