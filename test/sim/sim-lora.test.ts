// LoRA on simulated workers: the performance model's cost of the adapters in a step (each adapter's weights read
// once per step, its tokens' low-rank FLOPs; S-LoRA / Punica batching), by hand on the toy deployment and on Llama
// 3.1 8B; the simulated engine holding adapters (synthetic without a file, or the shape read from a GGUF adapter or
// a PEFT folder), refusing requests for adapters it does not hold, and pricing their steps; `conduit sim
// decode-sweep`'s adapters agreeing with the engine; adapter files it refuses without reading them forever (a device
// or FIFO) or whole (an adapter_config.json past the longest string), as the CPU engine does.
import assert from 'node:assert/strict';
import { execFileSync } from 'node:child_process';
import { existsSync, mkdirSync, mkdtempSync, rmSync, truncateSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { describe, test } from 'node:test';
import { LoraLoadError } from '../../src/engine/errors.ts';
import type { EngineOutput } from '../../src/engine/types.ts';
import { MAX_TEXT_FILE_BYTES } from '../../src/model/files.ts';
import { loadModel } from '../../src/model/loader.ts';
import { randomLoraAdapter, writeGgufLoraAdapter, writePeftLoraAdapter } from '../../src/model/lora-writer.ts';
import { LLAMA_SPM_TOKENIZER_PATH, writeSyntheticModel } from '../../src/model/synthetic.ts';
import { checkDecodeSweepWithEngine } from '../../src/sim/engine-check.ts';
import { H100_SXM } from '../../src/sim/hardware.ts';
import { decodeSweep } from '../../src/sim/latency-model.ts';
import { LLAMA_3_1_8B } from '../../src/sim/models.ts';
import { loraParamCount, stepBreakdown, stepWork } from '../../src/sim/perf-model.ts';
import { SimEngine } from '../../src/sim/sim-engine.ts';
import { simLoraAdapter } from '../../src/sim/sim-lora.ts';
import { close, prompt, req, TOY_EFFICIENCY, TOY_MODEL, toyDecodeMs, toyWorker } from './sim-fixtures.ts';

async function all(stream: AsyncIterable<EngineOutput>): Promise<EngineOutput[]> {
  const outputs: EngineOutput[] = [];
  for await (const output of stream) outputs.push(output);
  return outputs;
}

describe('the performance model with LoRA adapters', () => {
  test('an adapter\'s weights are read once per step, its FLOPs grow with its tokens', () => {
    // Llama 3.1 8B, rank 16 on all seven projections: per layer q, o 4096 + 4096, k, v 4096 + 1024, gate, up,
    // down 4096 + 14336 = 81,920 x 16 x 32 layers.
    const params = loraParamCount(LLAMA_3_1_8B, 16);
    assert.equal(params, 81_920 * 16 * 32);
    const decodes = (n: number) => Array.from({ length: n }, () => ({ contextLen: 512 }));
    const one = stepWork({ prefillTokens: [], decodeSeqs: decodes(8), loras: [{ tokens: 8, rank: 16 }] }, LLAMA_3_1_8B, 1);
    assert.equal(one.loraBytes, params * 2);
    assert.equal(one.loraFlops, 2 * params * 8);
    const spread = stepWork({ prefillTokens: [], decodeSeqs: decodes(8), loras: Array.from({ length: 8 }, () => ({ tokens: 1, rank: 16 })) }, LLAMA_3_1_8B, 2);
    assert.equal(spread.loraBytes, (8 * params * 2) / 2, 'eight adapters read eight times the bytes, split over tp');
    assert.equal(spread.loraFlops, (2 * params * 8) / 2);
    const attentionOnly = stepWork({ prefillTokens: [], decodeSeqs: decodes(1), loras: [{ tokens: 1, rank: 8, targets: ['wq', 'wv'] }] }, LLAMA_3_1_8B, 1);
    assert.equal(attentionOnly.loraBytes, 8 * (8192 + 5120) * 32 * 2);

    const base = stepBreakdown({ prefillTokens: [], decodeSeqs: decodes(16) }, LLAMA_3_1_8B, H100_SXM, 1);
    assert.equal(base.lora.bound, 'idle');
    const with16 = stepBreakdown({ prefillTokens: [], decodeSeqs: decodes(16), loras: Array.from({ length: 16 }, () => ({ tokens: 1, rank: 16 })) }, LLAMA_3_1_8B, H100_SXM, 1);
    const with1 = stepBreakdown({ prefillTokens: [], decodeSeqs: decodes(16), loras: [{ tokens: 16, rank: 16 }] }, LLAMA_3_1_8B, H100_SXM, 1);
    assert.equal(with16.lora.bound, 'memory');
    close(with16.totalMs - base.totalMs, with16.lora.timeMs);
    assert.ok(with16.lora.timeMs > 10 * with1.lora.timeMs, 'sixteen adapters cost about sixteen reads of one');
    assert.throws(() => stepWork({ prefillTokens: [], decodeSeqs: decodes(1), loras: [{ tokens: 1, rank: 0 }] }, LLAMA_3_1_8B, 1), RangeError);
  });

  test('decode-sweep with adapters: sequence i on adapter i mod N, and the simulated engine agrees', async () => {
    const lora = { adapters: 4, rank: 16 };
    const plain = decodeSweep({ model: LLAMA_3_1_8B, hw: H100_SXM, tp: 1, contextLen: 256, batchSizes: [1, 4, 16] });
    const adapted = decodeSweep({ model: LLAMA_3_1_8B, hw: H100_SXM, tp: 1, contextLen: 256, batchSizes: [1, 4, 16], lora });
    for (let i = 0; i < 3; i++) {
      assert.ok(adapted.rows[i]!.itlMs > plain.rows[i]!.itlMs);
      close(adapted.rows[i]!.itlMs - plain.rows[i]!.itlMs, adapted.rows[i]!.breakdown.lora.timeMs);
    }
    // One adapter for the single sequence; four (each read once) for 4 and for 16 sequences.
    close(adapted.rows[1]!.breakdown.work.loraBytes, 4 * adapted.rows[0]!.breakdown.work.loraBytes);
    close(adapted.rows[2]!.breakdown.work.loraBytes, adapted.rows[1]!.breakdown.work.loraBytes);
    const rows = await checkDecodeSweepWithEngine({ model: LLAMA_3_1_8B, hw: H100_SXM, tp: 1, contextLen: 256, batchSizes: [1, 4, 16], lora });
    for (const row of rows) close(row.engineItlMs, row.modelItlMs, 1e-6);
  });
});

describe('simulated workers with LoRA adapters', () => {
  test('a synthetic adapter costs its rank-r FLOPs per token on the toy deployment; unknown adapters are refused', async () => {
    const engine = new SimEngine({ ...toyWorker, speedUp: Infinity, loraRank: 4 });
    try {
      const info = await engine.loadLora('a', '/no/such/adapter');
      assert.deepEqual(info, { format: 'synthetic', rank: 4, alpha: 0, bytes: 0 });
      await assert.rejects(all(engine.generate({ ...req('x', prompt(16)), lora: 'b' })), /LoRA adapter 'b' is not loaded/);
      const base = await all(engine.generate(req('base', prompt(16), 0, { maxTokens: 3 })));
      const adapted = await all(engine.generate({ ...req('lora', prompt(16, 1), 0, { maxTokens: 3 }), lora: 'a' }));
      // Toy layer: q, k, v, o 128 + 128 each, gate, up, down 128 + 256 each = 2,176 per layer, 2 layers, rank 4:
      // 2 x 17,408 FLOPs per token at 1e6 FLOP/ms (bandwidth is free on the toy GPU).
      assert.equal(loraParamCount(TOY_MODEL, 4), 17_408);
      const step = (outs: EngineOutput[]) => outs[2]!.timestamps.lastToken! - outs[1]!.timestamps.lastToken!;
      close(step(base), toyDecodeMs(17));
      close(step(adapted), toyDecodeMs(17) + (2 * 17_408) / 1e6);
      assert.equal(TOY_EFFICIENCY.bandwidthUtilization, 1);
      await assert.rejects(engine.loadLora('a', '/x').then(() => engine.unloadLora('zzz')), /no LoRA adapter 'zzz'/);
      await engine.unloadLora('a');
      await assert.rejects(all(engine.generate({ ...req('y', prompt(16)), lora: 'a' })), /not loaded/);
    } finally {
      await engine.close();
    }
  });

  test('reads the rank and the adapted projections of a GGUF adapter and of a PEFT folder', async () => {
    const dir = mkdtempSync(join(tmpdir(), 'conduit-sim-lora-'));
    try {
      const modelPath = join(dir, 'base.gguf');
      writeSyntheticModel({ name: 's', dim: 64, numLayers: 2, numHeads: 4, numKvHeads: 2, ffnDim: 96, contextLength: 128,
        dtype: 'F32', seed: 5, tokenizer: LLAMA_SPM_TOKENIZER_PATH }, modelPath);
      const { config } = await loadModel(modelPath);
      const spec = randomLoraAdapter(config, { rank: 6, seed: 1, targets: ['wq', 'wv', 'wDown'] });
      writeGgufLoraAdapter(join(dir, 'a.gguf'), config, spec);
      writePeftLoraAdapter(join(dir, 'peft'), spec);
      const gguf = await simLoraAdapter(join(dir, 'a.gguf'));
      assert.deepEqual(gguf.adapter, { rank: 6, targets: ['wq', 'wv', 'wDown'] });
      assert.equal(gguf.info.format, 'gguf');
      const peft = await simLoraAdapter(join(dir, 'peft'));
      assert.deepEqual(peft.adapter, { rank: 6, targets: ['wq', 'wv', 'wDown'] });
      assert.equal(peft.info.format, 'peft');
      await assert.rejects(simLoraAdapter(modelPath), /not a GGUF LoRA adapter/);
    } finally {
      rmSync(dir, { recursive: true, force: true });
    }
  });

  test('adapter files it cannot read whole are refused at once, naming the file: too large, a FIFO, a device', async (t) => {
    const dir = mkdtempSync(join(tmpdir(), 'conduit-sim-lora-files-'));
    const engine = new SimEngine({ ...toyWorker, speedUp: Infinity });
    const refused = (message: string) => (e: unknown) => {
      assert.ok(e instanceof LoraLoadError, `a LoraLoadError, not ${String((e as Error)?.stack ?? e)}`);
      assert.equal(e.code, 'invalid_adapter');
      assert.equal(e.message, message);
      return true;
    };
    try {
      // One byte past the longest string: sparse, so no disk, and (refused by its size, unread) no memory.
      const huge = join(dir, 'huge');
      mkdirSync(huge);
      const hugeConfig = join(huge, 'adapter_config.json');
      writeFileSync(hugeConfig, '{"r": 4, "lora_alpha": 8}');
      truncateSync(hugeConfig, MAX_TEXT_FILE_BYTES + 1);
      await assert.rejects(engine.loadLora('huge', huge), refused(`${hugeConfig} is ${MAX_TEXT_FILE_BYTES + 1} bytes, more than the `
        + `${MAX_TEXT_FILE_BYTES} bytes a text file of a model may have (the longest string JavaScript holds)`));

      const notObject = join(dir, 'null');
      mkdirSync(notObject);
      writeFileSync(join(notObject, 'adapter_config.json'), 'null');
      await assert.rejects(engine.loadLora('null', notObject), refused(`${join(notObject, 'adapter_config.json')} is not a JSON object`));

      // A FIFO nobody writes to, as a PEFT folder's adapter_config.json and as a GGUF adapter; then /dev/zero as both.
      const notRegular: string[] = [];
      try {
        const fifoFolder = join(dir, 'fifo');
        mkdirSync(fifoFolder);
        execFileSync('mkfifo', [join(fifoFolder, 'adapter_config.json'), join(dir, 'fifo.gguf')]);
        notRegular.push(join(fifoFolder, 'adapter_config.json'), join(dir, 'fifo.gguf'));
      } catch {
        t.diagnostic('mkfifo is not available; the FIFO cases are skipped');
      }
      if (existsSync('/dev/zero')) notRegular.push('/dev/zero');
      for (const path of notRegular) {
        const message = `${path} is not a regular file (a device, FIFO or socket)`;
        if (path.endsWith('adapter_config.json')) {
          await assert.rejects(engine.loadLora('fifo', join(path, '..')), refused(message));
        } else {
          await assert.rejects(engine.loadLora('file', path), refused(message));
        }
      }
      if (existsSync('/dev/zero')) {
        const zero = join(dir, 'zero');
        mkdirSync(zero);
        execFileSync('ln', ['-s', '/dev/zero', join(zero, 'adapter_config.json')]);
        await assert.rejects(engine.loadLora('zero', zero), refused(`${join(zero, 'adapter_config.json')} is not a regular file (a device, FIFO or socket)`));
      }
      // Nothing was loaded: a request for any of them is refused.
      await assert.rejects(all(engine.generate({ ...req('x', prompt(16)), lora: 'huge' })), /LoRA adapter 'huge' is not loaded/);
    } finally {
      await engine.close();
      rmSync(dir, { recursive: true, force: true });
    }
  });
});
