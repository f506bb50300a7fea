// The AMX-INT8 matmul kernels. This machine class may have no AMX, so the kernel source also runs over a software
// model of the tile instructions (variant amx-model, on any AVX-512 CPU); on a CPU with AMX the real `amx` variant
// runs the same checks. Checked here:
// - the model against the ISA's semantics on small cases whose results are worked out in this file;
// - the amx kernels against the avx512 kernels, bit for bit (they promise the same arithmetic per output), on odd
//   shapes, packed and ggml-row weights, 1 and 2 threads, with guard values around the outputs, and against the
//   generic variant by normalised error;
// - a whole Q8_0 / Q4_0 model's prefill and decode logits against avx512's, bit for bit.
import assert from 'node:assert/strict';
import { describe, it } from 'node:test';

import { GgmlType, ggmlTypeName } from '../../src/model/ggml-types.ts';
import type { ModelConfig } from '../../src/model/config.ts';
import { quantize } from '../../src/model/quant.ts';
import type { LayerWeights, ModelWeights, Tensor } from '../../src/model/weights.ts';
import { nativeModelSpec, type AmxModelInstruction, type KernelVariant } from '../../src/kernels/native.ts';
import { kvPoolBytes, type ForwardBatch, type KvPoolLayout } from '../../src/kernels/types.ts';
import { addon, assertClose, guarded, native, randomArray, seeded, skipNative, variants } from './native-harness.ts';

const cpu = addon?.cpuInfo();
const modelRuns = cpu?.verificationVariants.includes('amx-model') ?? false;
/** The AMX builds this CPU runs: the real one where the CPU has AMX and Linux granted it, and the model. */
const amxVariants: KernelVariant[] = [
  ...(variants.includes('amx') ? ['amx' as const] : []), ...(modelRuns ? ['amx-model' as const] : []),
];
const skipKernels: string | false = skipNative || (amxVariants.length === 0
  ? 'no AVX-512 (F+BW+VL+VNNI): neither the amx kernels nor their model can run here'
  : false);

/** The same bits, element by element (so -0 and +0, or two NaNs, are told apart by their encoding). */
function assertSameBits(actual: Float32Array, expected: Float32Array, what: string): void {
  assert.equal(actual.length, expected.length, `${what}: length`);
  const a = new Uint32Array(actual.buffer, actual.byteOffset, actual.length);
  const e = new Uint32Array(expected.buffer, expected.byteOffset, expected.length);
  let differing = 0;
  let first = -1;
  for (let i = 0; i < a.length; i++) {
    if (a[i] !== e[i]) {
      differing++;
      if (first < 0) first = i;
    }
  }
  assert.equal(differing, 0, `${what}: ${differing} of ${a.length} outputs differ, first at ${first}: ` +
    `${actual[first]} instead of ${expected[first]}`);
}

// ---------------------------------------------------------------------------------------------------------------
// The software model on its own

/** A 64-byte LDTILECFG operand: tile -> [rows, bytes per row]. */
function tileConfig(tiles: Record<number, [number, number]>, options: { palette?: number; startRow?: number } = {}):
  Uint8Array {
  const c = new Uint8Array(64);
  c[0] = options.palette ?? 1;
  c[1] = options.startRow ?? 0;
  for (const [key, [rows, colsb]] of Object.entries(tiles)) {
    const t = Number(key);
    c[16 + 2 * t] = colsb & 0xff;
    c[17 + 2 * t] = colsb >> 8;
    c[48 + t] = rows;
  }
  return c;
}

const int8 = (b: number): number => (b << 24) >> 24;

/** C[m][n] += sum over k, j of signed A[m][4k + j] x unsigned B[k][4n + j], wrapping at 32 bits. */
function referenceTdpbsud(c: Int32Array, a: Uint8Array, b: Uint8Array, m: number, k: number, n: number): Int32Array {
  const out = Int32Array.from(c);
  for (let row = 0; row < m; row++) {
    for (let col = 0; col < n; col++) {
      let acc = out[row * n + col]!;
      for (let kk = 0; kk < k; kk++) {
        for (let j = 0; j < 4; j++) acc = (acc + int8(a[row * 4 * k + 4 * kk + j]!) * b[kk * 4 * n + 4 * col + j]!) | 0;
      }
      out[row * n + col] = acc;
    }
  }
  return out;
}

describe('software AMX model', { skip: skipNative }, () => {
  const run = (program: AmxModelInstruction[]): void => native().ops.amxModel(program);
  const GUARD = 0xa5;

  it('TDPBSUD multiplies signed A bytes by unsigned B bytes into the accumulator, wrapping at 32 bits', () => {
    // A: 2 rows x 2 dwords; B: 2 rows (= A's dwords) x 3 dwords; C: 2 rows x 3 dwords, stored with stride 16.
    const a = Uint8Array.from([1, 2, 3, 4, 0xff, 0, 0, 0, /* row 1 */ 0x80, 0x80, 0x80, 0x80, 0x7f, 0x7f, 0x7f, 0x7f]);
    const b = Uint8Array.from([5, 6, 7, 8, 0xff, 0, 0, 0, 1, 1, 1, 1,
      /* row 1 */ 0, 0, 0, 0, 0xff, 0, 0, 0, 0xff, 0xff, 0xff, 0xff]);
    const c = Int32Array.from([10, -20, 0x7fffffff, 0, -(2 ** 31), 1]);
    const memoryC = new Uint8Array(2 * 16 + 16).fill(GUARD);
    const cBytes = new Uint8Array(c.buffer);
    for (let r = 0; r < 2; r++) memoryC.set(cBytes.subarray(12 * r, 12 * r + 12), 16 * r);
    run([
      { op: 'ldtilecfg', config: tileConfig({ 0: [2, 8], 1: [2, 12], 5: [2, 12] }) },
      { op: 'tileloadd', tile: 0, memory: a, offset: 0, stride: 8 },
      { op: 'tileloadd', tile: 1, memory: b, offset: 0, stride: 12 },
      { op: 'tileloadd', tile: 5, memory: memoryC, offset: 0, stride: 16 },
      { op: 'tdpbsud', dst: 5, src1: 0, src2: 1 },
      { op: 'tilestored', tile: 5, memory: memoryC, offset: 0, stride: 16 },
    ]);
    const result = new Int32Array(6);
    for (let r = 0; r < 2; r++) {
      result.set(new Int32Array(memoryC.slice(16 * r, 16 * r + 12).buffer), 3 * r);
      assert.deepEqual([...memoryC.subarray(16 * r + 12, 16 * r + 16)], [GUARD, GUARD, GUARD, GUARD], 'past colsb');
    }
    assert.ok(memoryC.subarray(32).every((x) => x === GUARD), 'past the configured rows');
    // By hand: row 0, column 0: 10 + (1*5 + 2*6 + 3*7 + 4*8) + (-1 * 0) = 80. Column 1: -20 + (1*255) + (-1 * 255)
    // = -20 (0xff is -1 in A, 255 in B). Column 2: 0x7fffffff + (1+2+3+4) + (-1 * 255) = 0x7fffffff - 245.
    assert.equal(result[0], 80);
    assert.equal(result[1], -20);
    assert.equal(result[2], 0x7fffffff - 245);
    // Row 1 (A = four -128s, then four 127s): 0 + -128 * 26 = -3328; -2^31 + -128 * 255 + 127 * 255 = -2^31 - 255,
    // which wraps to 2^31 - 255; 1 + -128 * 4 + 127 * 255 * 4 = 129029.
    assert.equal(result[3], -3328);
    assert.equal(result[4], 2 ** 31 - 255);
    assert.equal(result[5], 129029);
    assert.deepEqual(result, referenceTdpbsud(c, a, b, 2, 2, 3));
  });

  it('TDPBSUD on full-size random tiles matches the reference, including sums that overflow 32 bits', () => {
    const rand = seeded(7);
    const bytes = (n: number): Uint8Array => Uint8Array.from({ length: n }, () => Math.floor(rand() * 256));
    const a = bytes(16 * 64), b = bytes(16 * 64);
    const c = Int32Array.from({ length: 256 },
      (_, i) => (i % 3 === 0 ? 0x7fff0000 : Math.floor((rand() - 0.5) * 2 ** 31)));
    const memoryC = new Uint8Array(c.buffer.slice(0));
    run([
      { op: 'ldtilecfg', config: tileConfig({ 2: [16, 64], 3: [16, 64], 7: [16, 64] }) },
      { op: 'tileloadd', tile: 2, memory: a, offset: 0, stride: 64 },
      { op: 'tileloadd', tile: 3, memory: b, offset: 0, stride: 64 },
      { op: 'tileloadd', tile: 7, memory: memoryC, offset: 0, stride: 64 },
      { op: 'tdpbsud', dst: 7, src1: 2, src2: 3 },
      { op: 'tilestored', tile: 7, memory: memoryC, offset: 0, stride: 64 },
    ]);
    assert.deepEqual(new Int32Array(memoryC.buffer), referenceTdpbsud(c, a, b, 16, 16, 16));
  });

  it('loads and stores exactly the configured rows and bytes per row, at any stride', () => {
    const source = Uint8Array.from({ length: 5 * 10 }, (_, i) => i + 1);
    const out = new Uint8Array(64).fill(GUARD);
    run([
      { op: 'ldtilecfg', config: tileConfig({ 3: [3, 8] }) },
      { op: 'tileloadd', tile: 3, memory: source, offset: 10, stride: 10 },  // rows 1-3 of the source
      { op: 'tilestored', tile: 3, memory: out, offset: 4, stride: 12 },
    ]);
    const expected = new Uint8Array(64).fill(GUARD);
    for (let r = 0; r < 3; r++) expected.set(source.subarray(10 + 10 * r, 18 + 10 * r), 4 + 12 * r);
    assert.deepEqual(out, expected);
  });

  it('a load starts at the configuration\'s start_row and leaves the rows above it as they were', () => {
    const out = new Uint8Array(8).fill(GUARD);
    run([
      { op: 'ldtilecfg', config: tileConfig({ 0: [2, 4] }, { startRow: 1 }) },
      { op: 'tileloadd', tile: 0, memory: Uint8Array.from([1, 2, 3, 4, 5, 6, 7, 8]), offset: 0, stride: 4 },
      { op: 'tilestored', tile: 0, memory: out, offset: 0, stride: 4 },  // start_row is 0 again
    ]);
    assert.deepEqual([...out], [0, 0, 0, 0, 5, 6, 7, 8]);
  });

  it('LDTILECFG and TILEZERO clear tile data', () => {
    const ones = new Uint8Array(16).fill(1);
    const afterConfig = new Uint8Array(16).fill(GUARD);
    const afterZero = new Uint8Array(16).fill(GUARD);
    const config = tileConfig({ 1: [2, 8], 4: [2, 8] });
    run([
      { op: 'ldtilecfg', config },
      { op: 'tileloadd', tile: 1, memory: ones, offset: 0, stride: 8 },
      { op: 'tileloadd', tile: 4, memory: ones, offset: 0, stride: 8 },
      { op: 'ldtilecfg', config },
      { op: 'tilestored', tile: 1, memory: afterConfig, offset: 0, stride: 8 },
      { op: 'tileloadd', tile: 4, memory: ones, offset: 0, stride: 8 },
      { op: 'tilezero', tile: 4 },
      { op: 'tilestored', tile: 4, memory: afterZero, offset: 0, stride: 8 },
    ]);
    assert.ok(afterConfig.every((x) => x === 0));
    assert.ok(afterZero.every((x) => x === 0));
  });

  it('raises the faults the hardware raises', () => {
    const memory = new Uint8Array(1024);
    const load = (tile: number): AmxModelInstruction => ({ op: 'tileloadd', tile, memory, offset: 0, stride: 64 });
    const good = tileConfig({ 0: [4, 16], 1: [4, 16], 2: [4, 16] });
    const gp = (config: Uint8Array, why: RegExp): void =>
      assert.throws(() => run([{ op: 'ldtilecfg', config }]),
        (e: Error) => /^LDTILECFG: #GP/.test(e.message) && why.test(e.message));
    gp(tileConfig({ 0: [4, 16] }, { palette: 2 }), /palette 2/);
    gp(tileConfig({ 0: [17, 16] }), /17 rows/);
    gp(tileConfig({ 0: [4, 65] }), /65 bytes per row/);
    gp(tileConfig({ 0: [4, 0] }), /not both/);
    const reserved = tileConfig({ 0: [4, 16] });
    reserved[5] = 1;
    gp(reserved, /reserved bytes/);
    const ninthTile = tileConfig({ 0: [4, 16] });
    ninthTile[48 + 8] = 1;
    gp(ninthTile, /past the palette/);

    assert.throws(() => run([load(0)]), /^Error: TILELOADD: #UD \(tiles are not configured\)/);
    assert.throws(() => run([{ op: 'ldtilecfg', config: good }, load(3)]),
      /TILELOADD: #UD \(tile 3 is not configured\)/);
    assert.throws(() => run([{ op: 'ldtilecfg', config: good }, { op: 'tilezero', tile: 8 }]), /TILEZERO: #UD/);
    // C = m x n, A = m x k, B = k x n in dwords: A's 4 dwords per row need B to have 4 rows, here it has 2.
    assert.throws(() => run([{ op: 'ldtilecfg', config: tileConfig({ 0: [2, 16], 1: [2, 16], 2: [2, 16] }) },
      { op: 'tdpbsud', dst: 2, src1: 0, src2: 1 }]), /TDPBSUD: #UD \(src1's dwords per row differ from src2's rows\)/);
    assert.throws(() => run([{ op: 'ldtilecfg', config: tileConfig({ 0: [3, 16], 1: [4, 16], 2: [4, 16] }) },
      { op: 'tdpbsud', dst: 2, src1: 0, src2: 1 }]), /TDPBSUD: #UD \(src1 and dst differ in rows\)/);
    assert.throws(() => run([{ op: 'ldtilecfg', config: good }, { op: 'tdpbsud', dst: 2, src1: 0, src2: 0 }]),
      /TDPBSUD: #UD \(the three tiles must be distinct\)/);
    // Palette 0 and TILERELEASE return to the unconfigured state.
    assert.throws(() => run([{ op: 'ldtilecfg', config: good }, { op: 'tilerelease' }, load(0)]), /TILELOADD: #UD/);
    assert.throws(() => run([{ op: 'ldtilecfg', config: good }, { op: 'ldtilecfg', config: new Uint8Array(64) },
      { op: 'tdpbsud', dst: 2, src1: 0, src2: 1 }]), /TDPBSUD: #UD \(tiles are not configured\)/);
    // A valid program runs.
    run([{ op: 'ldtilecfg', config: good }, load(0), load(1), { op: 'tilezero', tile: 2 },
      { op: 'tdpbsud', dst: 2, src1: 0, src2: 1 }, { op: 'tilerelease' }]);
  });

  it('refuses tile rows outside the memory array instead of touching other memory', () => {
    assert.throws(() => run([{ op: 'ldtilecfg', config: tileConfig({ 0: [4, 16] }) },
      { op: 'tileloadd', tile: 0, memory: new Uint8Array(64), offset: 0, stride: 17 }]), /past the end of memory/);
  });
});

// ---------------------------------------------------------------------------------------------------------------
// The kernels: amx == avx512 bit for bit

const INT8_TYPES = [GgmlType.Q8_0, GgmlType.Q4_0];

// [m, k, n]: M below the AMX threshold (1, 7: the avx512 kernels), exactly one A tile (16), whole 32-row groups
// plus 1, 17 or 8 more rows (the second configuration, with one or two A tiles); K of one block, two, nine (a group
// of 8 blocks and one more) and 128; N not a multiple of the 16 columns of a C tile or the 32 of a slab.
const SHAPES: [number, number, number][] = [
  [1, 64, 33], [7, 288, 7], [16, 32, 7], [16, 288, 100], [17, 64, 33], [33, 288, 100], [40, 32, 64],
  [49, 4096, 7], [64, 96, 33], [70, 64, 100],
];

describe('AMX matmul kernels == avx512, bit for bit', { skip: skipKernels }, () => {
  it('report which kernels they serve, and are only offered where the CPU runs them', () => {
    for (const variant of amxVariants) {
      const names = native().kernelVariants(variant);
      assert.equal(names.matmul_q8_0, variant);
      assert.equal(names.matmul_q4_0, variant);
      assert.equal(names.matmul_f16, native().kernelVariants('avx512').matmul_f16,
        `${variant}: other kernels are avx512's`);
      assert.equal(names.attention, native().kernelVariants('avx512').attention);
    }
    const info = native().cpuInfo();
    const amxReady = info.amxTile && info.amxInt8 && info.amxPermitted && info.avx512vnni && info.avx512bw;
    assert.equal(info.bestVariant === 'amx', amxReady, 'amx is the best variant exactly when AMX-INT8 is granted');
    if (!variants.includes('amx')) {
      assert.throws(() => native().kernelVariants('amx'), /kernel variant amx is not supported by this CPU/);
    }
  });

  for (const variant of amxVariants) {
    for (const type of INT8_TYPES) {
      it(`${variant} ${ggmlTypeName(type)}: ggml rows and packed weights, 1 and 2 threads`, () => {
        const ops = native().ops;
        const rand = seeded(90 + type);
        for (const [m, k, n] of SHAPES) {
          const shape = `${variant} ${ggmlTypeName(type)} m=${m} k=${k} n=${n}`;
          const w = quantize(type, randomArray(n * k, rand));
          const x = randomArray(m * k, rand);
          const expected = new Float32Array(m * n);
          ops.matmul('avx512', type, w, x, m, k, n, expected, 1);
          const generic = new Float32Array(m * n);
          ops.matmul('generic', type, w, x, m, k, n, generic, 1);
          const packed = ops.pack(variant, type, w, k, n);
          assert.deepEqual(packed, ops.pack('avx512', type, w, k, n), `${shape}: the avx512 packed layout`);
          for (const threads of [1, 2]) {
            for (const fromPacked of [false, true]) {
              const what = `${shape} ${fromPacked ? 'packed' : 'ggml rows'}, ${threads} threads`;
              const y = guarded(m * n, NaN);
              ops.matmul(variant, type, fromPacked ? packed : w, x, m, k, n, y.view, threads, fromPacked);
              y.checkGuards(what);
              assertSameBits(y.view, expected, `${what} vs avx512`);
              assertClose(y.view, generic, 1e-9, `${what} vs generic`);
            }
          }
        }
      });
    }
  }
});

// ---------------------------------------------------------------------------------------------------------------
// A whole model

function makeModel(seed: number, type: GgmlType): { config: ModelConfig; weights: ModelWeights } {
  const rand = seeded(seed);
  const dim = 128, ffnDim = 256, numHeads = 4, numKvHeads = 2, headDim = dim / numHeads;
  const config: ModelConfig = {
    architecture: 'llama', name: 'amx-test', vocabSize: 300, dim, numLayers: 2, numHeads, numKvHeads, headDim, ffnDim,
    contextLength: 256, rmsNormEps: 1e-5, ropeTheta: 10000, ropeDim: headDim, ropeStyle: 'interleaved',
    qkvBias: false, tiedEmbeddings: false,
  };
  const matrix = (name: string, cols: number, rows: number, scale: number): Tensor => ({
    name, type, shape: [cols, rows], data: quantize(type, randomArray(cols * rows, rand, scale)),
  });
  const norm = (name: string): Tensor => {
    const values = Float32Array.from({ length: dim }, () => 1 + (rand() - 0.5) * 0.2);
    return { name, type: GgmlType.F32, shape: [dim], data: new Uint8Array(values.buffer) };
  };
  const layers: LayerWeights[] = Array.from({ length: config.numLayers }, (_, l) => ({
    attnNorm: norm(`blk.${l}.attn_norm`),
    wq: matrix(`blk.${l}.attn_q`, dim, dim, Math.sqrt(3 / dim)),
    wk: matrix(`blk.${l}.attn_k`, dim, numKvHeads * headDim, Math.sqrt(3 / dim)),
    wv: matrix(`blk.${l}.attn_v`, dim, numKvHeads * headDim, Math.sqrt(3 / dim)),
    wo: matrix(`blk.${l}.attn_output`, dim, dim, Math.sqrt(3 / dim)),
    ffnNorm: norm(`blk.${l}.ffn_norm`),
    wGate: matrix(`blk.${l}.ffn_gate`, dim, ffnDim, Math.sqrt(3 / dim)),
    wUp: matrix(`blk.${l}.ffn_up`, dim, ffnDim, Math.sqrt(3 / dim)),
    wDown: matrix(`blk.${l}.ffn_down`, ffnDim, dim, Math.sqrt(3 / ffnDim)),
  }));
  return {
    config,
    weights: {
      tokenEmbedding: matrix('token_embd', dim, config.vocabSize, 1), layers, outputNorm: norm('output_norm'),
      output: matrix('output', dim, config.vocabSize, Math.sqrt(3 / dim)),
    },
  };
}

const BLOCK_SIZE = 16;
const MAX_BLOCKS = 4;

/**
 * A 40-token prompt and a 9-token one prefilled in one step (49 rows: a 32-row group and 17 more), with every
 * prompt row's logits, then three decode steps of both sequences. Sequence s owns pool blocks 4s .. 4s + 3.
 */
function makeSteps(seed: number): ForwardBatch[] {
  const rand = seeded(seed);
  const prompts = [40, 9].map((length) => Array.from({ length }, () => Math.floor(rand() * 300)));
  const step = (rows: { seq: number; position: number; token: number }[], counts: number[], allLogits: boolean):
    ForwardBatch => {
    const queryStartLoc = Int32Array.from([0, counts[0]!, counts[0]! + counts[1]!]);
    return {
      numTokens: rows.length,
      tokenIds: Int32Array.from(rows, (r) => r.token),
      positions: Int32Array.from(rows, (r) => r.position),
      slotMapping: Int32Array.from(rows,
        (r) => (MAX_BLOCKS * r.seq + Math.floor(r.position / BLOCK_SIZE)) * BLOCK_SIZE + (r.position % BLOCK_SIZE)),
      numSeqs: 2,
      queryStartLoc,
      seqLens: Int32Array.from([0, 1], (s) => Math.max(...rows.filter((r) => r.seq === s).map((r) => r.position)) + 1),
      blockTables: Int32Array.from({ length: 2 * MAX_BLOCKS }, (_, i) => i),
      maxBlocksPerSeq: MAX_BLOCKS,
      logitsIndices: allLogits
        ? Int32Array.from(rows, (_, i) => i)
        : Int32Array.from([queryStartLoc[1]! - 1, rows.length - 1]),
    };
  };
  const prefill = prompts.flatMap((p, seq) => p.map((token, position) => ({ seq, position, token })));
  const steps = [step(prefill, [40, 9], true)];
  for (let d = 0; d < 3; d++) {
    steps.push(step([0, 1].map((seq) => ({ seq, position: prompts[seq]!.length + d, token: (seq * 31 + d * 7) % 300 })),
      [1, 1], false));
  }
  return steps;
}

function runModel(config: ModelConfig, weights: ModelWeights, variant: KernelVariant, packWeights: boolean,
  steps: ForwardBatch[]): Float32Array[] {
  const layout: KvPoolLayout = {
    numLayers: config.numLayers, numBlocks: 2 * MAX_BLOCKS, blockSize: BLOCK_SIZE, numKvHeads: config.numKvHeads,
    headDim: config.headDim, dtype: 'f16',
  };
  const pool = new Uint8Array(new SharedArrayBuffer(kvPoolBytes(layout)));
  const model = new (native().NativeModel)({
    ...nativeModelSpec(config, weights, { layout, bytes: pool }, variant, 2), packWeights,
  });
  try {
    assert.equal(model.info().variant, variant);
    return steps.map((b) => model.forward(b));
  } finally {
    model.dispose();
  }
}

describe('a whole model on the AMX kernels', { skip: skipKernels }, () => {
  const steps = makeSteps(5);
  for (const type of INT8_TYPES) {
    it(`${ggmlTypeName(type)}: prefill of 49 rows and decode give avx512's logits, bit for bit`, () => {
      const { config, weights } = makeModel(20 + type, type);
      const expected = runModel(config, weights, 'avx512', true, steps);
      for (const variant of amxVariants) {
        for (const packWeights of type === GgmlType.Q8_0 ? [true, false] : [true]) {
          runModel(config, weights, variant, packWeights, steps).forEach((logits, s) =>
            assertSameBits(logits, expected[s]!, `${variant} ${packWeights ? 'packed' : 'ggml rows'} step ${s}`));
        }
      }
    });
  }
});
