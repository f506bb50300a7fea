// The TypeScript side of the native backend: variant selection (CONDUIT_KERNEL_VARIANT may only lower it),
// the reason reported when the addon is missing, and that a forced variant is the one the kernels report.
import assert from 'node:assert/strict';
import { spawnSync } from 'node:child_process';
import { describe, it } from 'node:test';
import { fileURLToPath } from 'node:url';

import { GgmlType } from '../../src/model/ggml-types.ts';
import type { ModelConfig } from '../../src/model/config.ts';
import type { ModelWeights, Tensor } from '../../src/model/weights.ts';
import {
  amxNotice, decidePacking, nativeBackend, packedWeightBytes, resolveKernelVariant, supportedVariants, type CpuInfo,
} from '../../src/kernels/native.ts';
import { native, skipNative } from './native-harness.ts';

function cpuWith(bestVariant: CpuInfo['bestVariant']): CpuInfo {
  return {
    avx2: true, fma: true, f16c: true, avx512f: false, avx512bw: false, avx512vl: false, avx512dq: false,
    avx512vnni: false, avx512bf16: false, amxTile: false, amxInt8: false, amxBf16: false, amxPermitted: false,
    amxStatus: 'no AMX on this CPU', bestVariant, verificationVariants: [],
    defaultThreads: 2,
  };
}

describe('kernel variant selection', () => {
  it('defaults to the best variant and accepts a lower one', () => {
    // An empty value is unset ('' rather than undefined, which would read CONDUIT_KERNEL_VARIANT: the suite may run
    // with it set to check one variant).
    assert.equal(resolveKernelVariant('', cpuWith('avx2')), 'avx2');
    assert.equal(resolveKernelVariant('generic', cpuWith('avx2')), 'generic');
    assert.deepEqual(supportedVariants(cpuWith('avx2')), ['generic', 'avx2']);
  });

  it('refuses a variant the CPU cannot run, and unknown names', () => {
    assert.throws(() => resolveKernelVariant('avx512', cpuWith('avx2')), /supports at most avx2/);
    assert.throws(() => resolveKernelVariant('neon', cpuWith('avx2')), /expected one of generic, avx2, avx512/);
  });
});

describe('packed weights decision', () => {
  const GiB = 1024 ** 3;
  const plenty = (): number => 64 * GiB;
  const scarce = (): number => 2 * GiB;

  it('packs by default when the copy and the headroom fit in available memory, and says why not when they do not', () => {
    assert.deepEqual(decidePacking(4 * GiB, undefined, {}, plenty), { pack: true });
    const refused = decidePacking(4 * GiB, undefined, {}, scarce);
    assert.equal(refused.pack, false);
    assert.match(refused.notice!, /needs 4\.00 GiB and 2\.00 GiB is available/);
    assert.match(refused.notice!, /CONDUIT_PACK_WEIGHTS=1/);
    // Just below the headroom's edge.
    assert.equal(decidePacking(GiB, undefined, {}, () => 2 * GiB - 1).pack, false);
    assert.equal(decidePacking(GiB, undefined, {}, () => 2 * GiB).pack, true);
  });

  it('obeys an explicit choice, then CONDUIT_PACK_WEIGHTS, without consulting memory', () => {
    const unasked = (): number => assert.fail('memory should not be consulted');
    assert.deepEqual(decidePacking(4 * GiB, true, {}, unasked), { pack: true });
    assert.deepEqual(decidePacking(4 * GiB, false, { CONDUIT_PACK_WEIGHTS: '1' }, unasked), { pack: false });
    assert.deepEqual(decidePacking(4 * GiB, undefined, { CONDUIT_PACK_WEIGHTS: '1' }, unasked), { pack: true });
    assert.deepEqual(decidePacking(4 * GiB, undefined, { CONDUIT_PACK_WEIGHTS: 'off' }, unasked), { pack: false });
    assert.throws(() => decidePacking(4 * GiB, undefined, { CONDUIT_PACK_WEIGHTS: 'maybe' }, unasked), /must be 0 or 1/);
  });

  it('has nothing to decide when the kernels pack nothing', () => {
    assert.deepEqual(decidePacking(0, undefined, {}, scarce), { pack: false });
  });
});

describe('AMX', () => {
  it('asks Linux for tile data exactly when the CPU has AMX, and reports the answer', { skip: skipNative }, () => {
    const cpu = native().cpuInfo();
    assert.ok(cpu.amxStatus.length > 0);
    if (!cpu.amxTile) {
      assert.equal(cpu.amxPermitted, false);
      assert.equal(cpu.amxStatus, 'no AMX on this CPU');
      return;
    }
    // Linux 5.16+ grants AMX to any process that asks; older kernels cannot run AMX code at all.
    assert.equal(cpu.amxPermitted, cpu.amxStatus === 'granted', cpu.amxStatus);
  });

  it('tells the operator of an AMX machine what the kernels do about it', () => {
    assert.equal(amxNotice(cpuWith('avx512'), 'avx512'), undefined);
    const amx = { ...cpuWith('amx'), amxTile: true, amxInt8: true, amxPermitted: true, amxStatus: 'granted' };
    assert.match(amxNotice(amx, 'amx')!, /AMX detected \(tile data permission: granted\); Q8_0 and Q4_0 .*prefill.*AMX-INT8/);
    assert.match(amxNotice(amx, 'avx512')!, /not used because CONDUIT_KERNEL_VARIANT chose avx512.*the avx512 kernels/);
    const refused = { ...amx, amxPermitted: false, amxStatus: 'the kernel does not offer AMX tile data to processes' };
    assert.match(amxNotice(refused, 'avx2')!, /does not offer AMX tile data.*the avx2 kernels/);
  });
});

describe('native addon availability', () => {
  it('reports why the addon is unavailable instead of throwing', () => {
    const nativeModule = fileURLToPath(new URL('../../src/kernels/native.ts', import.meta.url));
    const script = `const m = await import(${JSON.stringify(nativeModule)});` +
      'console.log(JSON.stringify({ available: m.nativeBackend.available(), reason: m.nativeBackend.unavailableReason() }));';
    const result = spawnSync(process.execPath, ['--import', 'tsx', '--input-type=module', '-e', script], {
      env: { ...process.env, CONDUIT_NATIVE_ADDON: '/nonexistent/conduit_native.node' }, encoding: 'utf8',
    });
    assert.equal(result.status, 0, result.stderr);
    const report = JSON.parse(result.stdout.trim()) as { available: boolean; reason: string };
    assert.equal(report.available, false);
    assert.match(report.reason, /\/nonexistent\/conduit_native\.node is missing/);
    assert.match(report.reason, /npm run build:native/);
  });
});

describe('packed weight bytes', { skip: skipNative }, () => {
  it('counts every quantized matrix the avx512 kernels repack (tied output included), none for float weights', () => {
    const dim = 64, ffn = 96, vocab = 40;
    const q8 = (cols: number, rows: number): Tensor => ({
      name: 'w', type: GgmlType.Q8_0, shape: [cols, rows], data: new Uint8Array((cols / 32) * 34 * rows),
    });
    const layer = { wq: q8(dim, dim), wk: q8(dim, 32), wv: q8(dim, 32), wo: q8(dim, dim), wGate: q8(dim, ffn), wUp: q8(dim, ffn), wDown: q8(ffn, dim) };
    const weights = { output: q8(dim, vocab), layers: [layer, layer] } as unknown as ModelWeights;
    // The packed layout holds whole groups of 32 rows (the last padded), otherwise exactly the ggml blocks.
    const padded = (t: Tensor): number => Math.ceil(t.shape[1]! / 32) * 32 * (t.shape[0]! / 32) * 34;
    const ggmlBytes = padded(weights.output) + 2 * Object.values(layer).reduce((n, t) => n + padded(t), 0);
    const ops = native().ops;
    if (supportedVariants(native().cpuInfo()).includes('avx512')) {
      assert.equal(packedWeightBytes(ops, 'avx512', weights), ggmlBytes, 'the packed copy is as large as the matrices, rows padded to 32');
    }
    assert.equal(packedWeightBytes(ops, 'generic', weights), 0);
  });
});

describe('native backend variant override', { skip: skipNative }, () => {
  it('CONDUIT_KERNEL_VARIANT=generic makes every kernel generic', () => {
    const dim = 32;
    const f32 = (name: string, cols: number, rows: number): Tensor => ({
      name, type: GgmlType.F32, shape: rows === 1 ? [cols] : [cols, rows],
      data: new Uint8Array(new Float32Array(cols * rows).fill(0.01).buffer),
    });
    const config: ModelConfig = {
      architecture: 'llama', name: 'tiny', vocabSize: 8, dim, numLayers: 1, numHeads: 2, numKvHeads: 1, headDim: 16,
      ffnDim: 32, contextLength: 16, rmsNormEps: 1e-5, ropeTheta: 10000, ropeDim: 16, ropeStyle: 'interleaved',
      qkvBias: false, tiedEmbeddings: true,
    };
    const embedding = f32('token_embd', dim, 8);
    const weights: ModelWeights = {
      tokenEmbedding: embedding, output: embedding, outputNorm: f32('output_norm', dim, 1),
      layers: [{
        attnNorm: f32('attn_norm', dim, 1), wq: f32('q', dim, 32), wk: f32('k', dim, 16), wv: f32('v', dim, 16),
        wo: f32('o', 32, dim), ffnNorm: f32('ffn_norm', dim, 1), wGate: f32('gate', dim, 32), wUp: f32('up', dim, 32),
        wDown: f32('down', 32, dim),
      }],
    };
    const saved = process.env.CONDUIT_KERNEL_VARIANT;
    process.env.CONDUIT_KERNEL_VARIANT = 'generic';
    try {
      const backend = nativeBackend.load(config, weights, { numBlocks: 1, blockSize: 16, dtype: 'f32' });
      assert.ok(Object.values(backend.info.variants).every((v) => v === 'generic'), JSON.stringify(backend.info.variants));
      backend.dispose();
    } finally {
      if (saved === undefined) delete process.env.CONDUIT_KERNEL_VARIANT;
      else process.env.CONDUIT_KERNEL_VARIANT = saved;
    }
    // Without the override, the best variant serves the matmul.
    const backend = nativeBackend.load(config, weights, { numBlocks: 1, blockSize: 16, dtype: 'f32' });
    assert.equal(backend.info.variants.matmul_f32, native().kernelVariants(resolveKernelVariant(saved)).matmul_f32);
    backend.dispose();
  });
});
