// The TypeScript side of the native backend: variant selection (CONDUIT_KERNEL_VARIANT may only lower it),
// the reason reported when the addon is missing, and that a forced variant is the one the kernels report.
import assert from 'node:assert/strict';
import { spawnSync } from 'node:child_process';
import { describe, it } from 'node:test';
import { fileURLToPath } from 'node:url';

import { GgmlType } from '../../src/model/ggml-types.ts';
import type { ModelConfig } from '../../src/model/config.ts';
import type { ModelWeights, Tensor } from '../../src/model/weights.ts';
import { nativeBackend, resolveKernelVariant, supportedVariants, type CpuInfo } from '../../src/kernels/native.ts';
import { native, skipNative } from './native-harness.ts';

function cpuWith(bestVariant: CpuInfo['bestVariant']): CpuInfo {
  return {
    avx2: true, fma: true, f16c: true, avx512f: false, avx512bw: false, avx512vl: false, avx512dq: false,
    avx512vnni: false, avx512bf16: false, amxTile: false, amxInt8: false, amxBf16: false, bestVariant,
    defaultThreads: 2,
  };
}

describe('kernel variant selection', () => {
  it('defaults to the best variant and accepts a lower one', () => {
    assert.equal(resolveKernelVariant(undefined, cpuWith('avx2')), 'avx2');
    assert.equal(resolveKernelVariant('', cpuWith('avx2')), 'avx2');
    assert.equal(resolveKernelVariant('generic', cpuWith('avx2')), 'generic');
    assert.deepEqual(supportedVariants(cpuWith('avx2')), ['generic', 'avx2']);
  });

  it('refuses a variant the CPU cannot run, and unknown names', () => {
    assert.throws(() => resolveKernelVariant('avx512', cpuWith('avx2')), /supports at most avx2/);
    assert.throws(() => resolveKernelVariant('neon', cpuWith('avx2')), /expected one of generic, avx2, avx512/);
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
    const best = native().cpuInfo().bestVariant;
    const backend = nativeBackend.load(config, weights, { numBlocks: 1, blockSize: 16, dtype: 'f32' });
    assert.ok(backend.info.variants.matmul_f32?.startsWith(saved || best));
    backend.dispose();
  });
});
