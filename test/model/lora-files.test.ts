// LoRA adapter files as a client names them (/v1/load_lora_adapter): what is at the path must be an adapter's
// regular files, never read forever (a device or FIFO would hold the worker's thread), and a malformed
// adapter_config.json is named as such, one too large to be a JavaScript string too (by its size, before it is read);
// a GGUF is checked by its start before it is read whole (a model, or an adapter past 2 GiB, refused at once);
// a tensor name is matched against the projections Conduit adapts, never against Object.prototype, and two names for
// one projection (blk.0 and blk.00) are refused, never one silently replacing the other.

import { describe, it, before, after } from 'node:test';
import assert from 'node:assert/strict';
import { execFileSync } from 'node:child_process';
import { existsSync, mkdirSync, mkdtempSync, readFileSync, rmSync, truncateSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import type { ModelConfig } from '../../src/model/config.ts';
import { MAX_TEXT_FILE_BYTES } from '../../src/model/files.ts';
import { GgmlType } from '../../src/model/ggml-types.ts';
import { writeGguf } from '../../src/model/gguf-writer.ts';
import { loadModel } from '../../src/model/loader.ts';
import { inspectLoraAdapter, loadLoraAdapter, LoraAdapterError } from '../../src/model/lora.ts';
import { writeGgufLoraAdapter, writePeftLoraAdapter } from '../../src/model/lora-writer.ts';
import { writeSafetensors } from '../../src/model/safetensors.ts';
import { makeTinyModel, writeTinyGguf } from './loader-fixtures.ts';

let dir: string;
let base: ModelConfig;
before(async () => {
  dir = mkdtempSync(join(tmpdir(), 'conduit-lora-files-'));
  const path = join(dir, 'base.gguf');
  writeTinyGguf(path, makeTinyModel());
  base = (await loadModel(path)).config;
});
after(() => rmSync(dir, { recursive: true, force: true }));

const notRegular = (path: string) => (e: unknown) =>
  e instanceof LoraAdapterError && e.message === `${path} is not a regular file (a folder, device, FIFO or socket)`;

describe('LoRA adapter paths that are not files', () => {
  it('a FIFO or /dev/zero: refused at once by inspect and load, not read forever', async (t) => {
    const paths = existsSync('/dev/zero') ? ['/dev/zero'] : [];
    const fifo = join(dir, 'adapter.gguf');
    try {
      execFileSync('mkfifo', [fifo]);
      paths.push(fifo);
    } catch {
      t.diagnostic('mkfifo is not available; the FIFO case is skipped');
    }
    for (const path of paths) {
      await assert.rejects(inspectLoraAdapter(path), notRegular(path));
      assert.throws(() => loadLoraAdapter(path, base), notRegular(path));
    }
  });

  it('a PEFT folder whose adapter_config.json or adapter_model.safetensors is a folder', async () => {
    for (const name of ['adapter_config.json', 'adapter_model.safetensors']) {
      const folder = join(dir, `peft-${name}`);
      mkdirSync(folder);
      writeFileSync(join(folder, 'adapter_config.json'), '{"r": 4, "lora_alpha": 8}');
      writeFileSync(join(folder, 'adapter_model.safetensors'), '');
      rmSync(join(folder, name));
      mkdirSync(join(folder, name));
      await assert.rejects(inspectLoraAdapter(folder), /is not a regular file/);
      assert.throws(() => loadLoraAdapter(folder, base), notRegular(join(folder, name)));
    }
  });

  it('an adapter_config.json that is JSON but not an object', () => {
    const folder = join(dir, 'peft-null');
    mkdirSync(folder);
    writeFileSync(join(folder, 'adapter_config.json'), 'null');
    writeFileSync(join(folder, 'adapter_model.safetensors'), '');
    assert.throws(() => loadLoraAdapter(folder, base),
      (e) => e instanceof LoraAdapterError && e.message === `${join(folder, 'adapter_config.json')} is not a JSON object`);
  });

  it('an adapter_config.json one byte past the longest string: refused by inspect and load, naming it and the limit', async () => {
    const folder = join(dir, 'peft-huge');
    mkdirSync(folder);
    const configPath = join(folder, 'adapter_config.json');
    writeFileSync(configPath, '{"r": 4, "lora_alpha": 8}');
    // Sparse: no disk, and (refused unread) no memory.
    truncateSync(configPath, MAX_TEXT_FILE_BYTES + 1);
    writeFileSync(join(folder, 'adapter_model.safetensors'), '');
    const tooLarge = (e: unknown) => e instanceof LoraAdapterError &&
      e.message === `${configPath} is ${MAX_TEXT_FILE_BYTES + 1} bytes, more than the ${MAX_TEXT_FILE_BYTES} bytes a text ` +
        'file of an adapter may have (the longest string JavaScript holds)';
    await assert.rejects(inspectLoraAdapter(folder), tooLarge);
    assert.throws(() => loadLoraAdapter(folder, base), tooLarge);
  });
});

describe('LoRA adapter files checked by their start before they are read whole', () => {
  it('a model (general.type "model") and an adapter past 2 GiB: refused by inspect and load, naming the problem', async () => {
    // Sparse: past what Node reads into one buffer without taking the disk space.
    const beyondReadLimit = 2 ** 31 + 4096;
    const zeros = new Uint8Array(base.dim * 2 * 4);
    const write = (path: string, type: string) => {
      writeGguf(path, {
        metadata: [['general.architecture', base.architecture], ['general.type', type], ['adapter.type', 'lora']],
        tensors: [
          { name: 'blk.0.attn_q.weight.lora_a', type: GgmlType.F32, shape: [base.dim, 2], data: zeros },
          { name: 'blk.0.attn_q.weight.lora_b', type: GgmlType.F32, shape: [2, base.dim], data: zeros },
        ],
      });
      truncateSync(path, beyondReadLimit);
    };
    const model = join(dir, 'typed-model.gguf');
    write(model, 'model');
    const huge = join(dir, 'huge-adapter.gguf');
    write(huge, 'adapter');
    for (const [path, message] of [
      [model, `${model} is a model (a GGUF with general.type "model"), not a LoRA adapter; pass the adapter's file or PEFT folder`],
      [huge, `${huge} is a GGUF LoRA adapter of ${beyondReadLimit} bytes, too large to read: an adapter file may have at `
        + `most ${2 ** 31 - 1} bytes (2 GiB)`],
    ]) {
      const named = (e: unknown) => e instanceof LoraAdapterError && e.message === message;
      assert.throws(() => loadLoraAdapter(path!, base), named);
      await assert.rejects(inspectLoraAdapter(path!), named);
      rmSync(path!);
    }
  });
});

describe('PEFT adapter_model.safetensors read by its header, then its tensors', () => {
  it('a file past 2 GiB: inspected (rank, digest) and refused on load by its shapes, not by its size', async () => {
    // Sparse: a lora_A whose rows are far too long for the base, so the file passes 2 GiB without taking disk space.
    const folder = join(dir, 'peft-huge-tensors');
    mkdirSync(folder);
    const configPath = join(folder, 'adapter_config.json');
    writeFileSync(configPath, '{"peft_type": "LORA", "r": 2, "lora_alpha": 4}');
    const prefix = 'base_model.model.model.layers.0.self_attn.o_proj';
    const wide = 2 ** 28;
    const aBytes = 2 * wide * 4;
    const bBytes = base.dim * 2 * 4;
    let json = JSON.stringify({
      [`${prefix}.lora_A.weight`]: { dtype: 'F32', shape: [2, wide], data_offsets: [0, aBytes] },
      [`${prefix}.lora_B.weight`]: { dtype: 'F32', shape: [base.dim, 2], data_offsets: [aBytes, aBytes + bBytes] },
    });
    json += ' '.repeat((8 - (json.length % 8)) % 8);
    const head = Buffer.alloc(8 + json.length);
    head.writeBigUInt64LE(BigInt(json.length));
    head.write(json, 8, 'latin1');
    const tensorsPath = join(folder, 'adapter_model.safetensors');
    writeFileSync(tensorsPath, head);
    truncateSync(tensorsPath, head.length + aBytes + bBytes);
    assert.ok(head.length + aBytes + bBytes > 2 ** 31);

    const header = await inspectLoraAdapter(folder);
    assert.equal(header?.rank, 2);
    assert.match(header?.digest ?? '', /^[0-9a-f]{64}$/);
    const qDim = base.numHeads * base.headDim;
    assert.throws(() => loadLoraAdapter(folder, base), (e) => e instanceof LoraAdapterError &&
      e.message === `${tensorsPath}: ${prefix} has lora_a [${wide}, 2] and lora_b [2, ${base.dim}] (ggml order); the base ` +
        `model's ${prefix} needs lora_a [${qDim}, r] and lora_b [r, ${base.dim}]: the adapter was made for another base model`);
  });
});

describe('LoRA adapter tensor names', () => {
  it('a GGUF adapter of a weight named like an Object.prototype property: refused by name, not a TypeError', () => {
    for (const weight of ['constructor', 'toString', '__proto__']) {
      const path = join(dir, `proto-${weight}.gguf`);
      const zeros = new Uint8Array(base.dim * 2 * 4);
      writeGguf(path, {
        metadata: [['general.architecture', base.architecture], ['general.type', 'adapter'], ['adapter.type', 'lora'],
          ['adapter.lora.alpha', 4]],
        tensors: [
          { name: `blk.0.${weight}.weight.lora_a`, type: GgmlType.F32, shape: [base.dim, 2], data: zeros },
          { name: `blk.0.${weight}.weight.lora_b`, type: GgmlType.F32, shape: [2, base.dim], data: zeros },
        ],
      });
      assert.throws(() => loadLoraAdapter(path, base), (e) => e instanceof LoraAdapterError &&
        e.message === `${path}: blk.0.${weight}.weight is not a projection Conduit adapts (attn_q/k/v/output, ` +
          'ffn_gate/up/down of a layer)');
    }
  });
});

describe('LoRA adapter tensors that name one projection twice', () => {
  it('GGUF blk.0 and blk.00 of attn_output: refused naming both, not one silently replacing the other', () => {
    const path = join(dir, 'leading-zero.gguf');
    const zeros = new Uint8Array(base.dim * 2 * 4);
    writeGguf(path, {
      metadata: [['general.architecture', base.architecture], ['general.type', 'adapter'], ['adapter.type', 'lora'],
        ['adapter.lora.alpha', 4]],
      tensors: ['blk.0', 'blk.00'].flatMap((layer) => [
        { name: `${layer}.attn_output.weight.lora_a`, type: GgmlType.F32, shape: [base.dim, 2], data: zeros },
        { name: `${layer}.attn_output.weight.lora_b`, type: GgmlType.F32, shape: [2, base.dim], data: zeros },
      ]),
    });
    assert.throws(() => loadLoraAdapter(path, base), (e) => e instanceof LoraAdapterError &&
      e.message === `${path}: blk.0.attn_output.weight and blk.00.attn_output.weight both adapt the same projection ` +
        '(wo of layer 0); an adapter names each projection once');
  });

  it('PEFT layers.0 and layers.00, or lora_A.weight and lora_A.default.weight: refused naming both', () => {
    const f32 = (n: number) => new Uint8Array(n * 4);
    const o = 'self_attn.o_proj';
    const qDim = base.numHeads * base.headDim;
    const pair = (prefix: string, a = 'lora_A.weight', b = 'lora_B.weight') => [
      { name: `${prefix}.${a}`, dtype: 'F32' as const, shape: [2, qDim], data: f32(2 * qDim) },
      { name: `${prefix}.${b}`, dtype: 'F32' as const, shape: [base.dim, 2], data: f32(base.dim * 2) },
    ];
    const cases = [
      ['peft-leading-zero', [...pair(`base_model.model.model.layers.0.${o}`), ...pair(`base_model.model.model.layers.00.${o}`)],
        `base_model.model.model.layers.0.${o} and base_model.model.model.layers.00.${o} both adapt the same projection ` +
          '(wo of layer 0); an adapter names each projection once'],
      ['peft-two-prefixes', [...pair(`base_model.model.model.layers.1.${o}`), ...pair(`model.layers.1.${o}`)],
        `base_model.model.model.layers.1.${o} and model.layers.1.${o} both adapt the same projection (wo of layer 1); ` +
          'an adapter names each projection once'],
      ['peft-default', [...pair(`model.layers.0.${o}`), pair(`model.layers.0.${o}`, 'lora_A.default.weight')[0]!],
        `model.layers.0.${o}.lora_A.weight and model.layers.0.${o}.lora_A.default.weight are both lora_A of ` +
          `model.layers.0.${o}; an adapter names each matrix once`],
    ] as const;
    for (const [name, tensors, message] of cases) {
      const folder = join(dir, name);
      mkdirSync(folder);
      writeFileSync(join(folder, 'adapter_config.json'), '{"peft_type": "LORA", "r": 2, "lora_alpha": 4}');
      writeSafetensors(join(folder, 'adapter_model.safetensors'), tensors);
      assert.throws(() => loadLoraAdapter(folder, base), (e) => e instanceof LoraAdapterError &&
        e.message === `${join(folder, 'adapter_model.safetensors')}: ${message}`);
    }
  });
});

describe('LoRA adapter alpha', () => {
  it('a GGUF adapter.lora.alpha that is not a number is refused, not taken as absent (scale 1)', () => {
    const zeros = new Uint8Array(base.dim * 2 * 4);
    for (const [alpha, shown] of [['16', '"16"'], [[16], 'an array']] as const) {
      const path = join(dir, `alpha-${typeof alpha}.gguf`);
      writeGguf(path, {
        metadata: [['general.architecture', base.architecture], ['general.type', 'adapter'], ['adapter.type', 'lora'],
          ['adapter.lora.alpha', alpha as string | string[]]],
        tensors: [
          { name: 'blk.0.attn_output.weight.lora_a', type: GgmlType.F32, shape: [base.dim, 2], data: zeros },
          { name: 'blk.0.attn_output.weight.lora_b', type: GgmlType.F32, shape: [2, base.dim], data: zeros },
        ],
      });
      assert.throws(() => loadLoraAdapter(path, base), (e) => e instanceof LoraAdapterError &&
        e.message === `${path}: adapter.lora.alpha is ${shown}, not a number`);
    }
  });
});

describe('PEFT adapter_config.json as PEFT reads it', () => {
  const rank4 = () => {
    const [vIn, vOut] = [base.dim, base.numKvHeads * base.headDim];
    return { alpha: 16, layers: [{ wv: { rank: 4, a: new Float32Array(4 * vIn).fill(0.5), b: new Float32Array(vOut * 4).fill(1) } }, {}] };
  };
  const rewrite = (folder: string, change: (config: Record<string, unknown>) => Record<string, unknown>) => {
    const configPath = join(folder, 'adapter_config.json');
    writeFileSync(configPath, JSON.stringify(change(JSON.parse(readFileSync(configPath, 'utf8')) as Record<string, unknown>)));
    return configPath;
  };

  it('no lora_alpha: PEFT\'s default 8, not r (scale 8 / r)', () => {
    const folder = join(dir, 'peft-no-alpha');
    writePeftLoraAdapter(folder, rank4());
    assert.equal(loadLoraAdapter(folder, base).weights.scale, 16 / 4);
    rewrite(folder, ({ lora_alpha: _alpha, ...rest }) => rest);
    const loaded = loadLoraAdapter(folder, base);
    assert.equal(loaded.alpha, 8);
    assert.equal(loaded.weights.scale, 8 / 4);
  });

  it('use_rslora or fan_in_fan_out that is not true or false: refused, not read as false (another scale, silently)', () => {
    const folder = join(dir, 'peft-flag-types');
    writePeftLoraAdapter(folder, rank4());
    for (const [key, value] of [['use_rslora', 'true'], ['fan_in_fan_out', 1]] as const) {
      const configPath = rewrite(folder, (config) => ({ ...config, use_rslora: false, fan_in_fan_out: false, [key]: value }));
      assert.throws(() => loadLoraAdapter(folder, base), (e) => e instanceof LoraAdapterError &&
        e.message === `${configPath}: ${key} is ${JSON.stringify(value)}, not true or false`);
    }
  });
});

describe('LoRA adapters whose matrices have different ranks', () => {
  // wv of rank 2 and wDown of rank 4 (neither is permuted for the llama base), B all ones.
  const mixed = () => {
    const [vIn, vOut] = [base.dim, base.numKvHeads * base.headDim];
    const [dIn, dOut] = [base.ffnDim, base.dim];
    return {
      alpha: 8,
      layers: [{
        wv: { rank: 2, a: new Float32Array(2 * vIn).fill(0.5), b: new Float32Array(vOut * 2).fill(1) },
        wDown: { rank: 4, a: new Float32Array(4 * dIn).fill(0.5), b: new Float32Array(dOut * 4).fill(1) },
      }, {}],
    };
  };

  it('GGUF: each matrix is scaled by alpha / its own rank, as llama.cpp does', () => {
    const path = join(dir, 'mixed-rank.gguf');
    writeGgufLoraAdapter(path, base, mixed());
    const { weights } = loadLoraAdapter(path, base);
    // What the backends apply: scale * B.
    assert.equal(weights.scale * weights.layers[0]!.wv!.b[0]!, 8 / 2);
    assert.equal(weights.scale * weights.layers[0]!.wDown!.b[0]!, 8 / 4);
  });

  it('PEFT: a matrix whose rank is not r, or a rank_pattern / alpha_pattern, is refused (one scale would be wrong)', () => {
    const folder = join(dir, 'mixed-rank-peft');
    writePeftLoraAdapter(folder, mixed());
    assert.throws(() => loadLoraAdapter(folder, base), (e) => e instanceof LoraAdapterError &&
      e.message === `${join(folder, 'adapter_model.safetensors')}: base_model.model.model.layers.0.self_attn.v_proj has ` +
        `rank 2, but ${join(folder, 'adapter_config.json')} says r 4`);
    const configPath = join(folder, 'adapter_config.json');
    const config = JSON.parse(readFileSync(configPath, 'utf8')) as Record<string, unknown>;
    writeFileSync(configPath, JSON.stringify({ ...config, rank_pattern: { v_proj: 2 }, alpha_pattern: {} }));
    assert.throws(() => loadLoraAdapter(folder, base), (e) => e instanceof LoraAdapterError &&
      e.message === `${configPath}: rank_pattern (a rank or alpha of its own for some modules) is not supported`);
  });
});
