// A simulated worker's memory by category (EngineStats.memory, the conduit_memory_used_bytes gauge): the modelled
// GPU memory of its tp GPUs. The weights and the KV pool fill the HBM the memory utilisation allows (to within a
// block per GPU), adapters held count as lora_adapters, and there is no activations figure (the perf model keeps
// none).
import assert from 'node:assert/strict';
import { describe, it } from 'node:test';
import { getHardwareProfile } from '../../src/sim/hardware.ts';
import { getModelProfile, kvBytesPerToken, paramCount } from '../../src/sim/models.ts';
import { kvBytesPerTokenPerGpu, loraParamCount } from '../../src/sim/perf-model.ts';
import { SimWorker } from '../../src/sim/sim-worker.ts';
import { ConduitMetrics } from '../../src/telemetry/metrics.ts';
import { parseExposition } from '../telemetry/exposition.ts';

describe('simulated worker memory by category', () => {
  const model = getModelProfile('llama-3.1-8b');
  const hw = getHardwareProfile('h100');

  for (const tp of [1, 2]) {
    it(`Llama 3.1 8B on ${tp} x H100: weights and KV fill the HBM at 90%`, () => {
      const worker = new SimWorker({ model, hw, tp, memoryUtilization: 0.9 });
      const memory = worker.stats().memory!;
      assert.equal(memory.weightsBytes, paramCount(model) * 2);
      const blockSize = worker.info.blockSize;
      const blocks = worker.info.kvCapacityTokens / blockSize;
      assert.equal(memory.kvCacheBytes, blocks * blockSize * kvBytesPerTokenPerGpu(model, tp) * tp);
      if (tp === 1) assert.equal(memory.kvCacheBytes, worker.info.kvCapacityTokens * kvBytesPerToken(model));
      const budget = 0.9 * hw.hbmBytes * tp;
      const total = memory.weightsBytes + memory.kvCacheBytes;
      const blockBytes = blockSize * kvBytesPerTokenPerGpu(model, tp);
      assert.ok(total <= budget && total > budget - tp * blockBytes, `${total} bytes of ${budget}`);
      assert.equal(memory.activationsBytes, undefined, 'the perf model keeps no activation memory');
      assert.equal(memory.loraAdaptersBytes, 0);
    });
  }

  it('adapters held count as lora_adapters (BF16 parameters), and reach the gauge', async () => {
    const worker = new SimWorker({ model, hw, tp: 1 });
    worker.loadLora('a', { rank: 16 });
    worker.loadLora('b', { rank: 8, targets: ['wq', 'wv'] });
    const expected = 2 * (loraParamCount(model, 16) + loraParamCount(model, 8, ['wq', 'wv']));
    assert.equal(worker.stats().memory!.loraAdaptersBytes, expected);
    const metrics = new ConduitMetrics();
    metrics.updateFromEngineStats({ worker: 'sim-0', stats: worker.stats() });
    const { samples } = parseExposition(await metrics.render());
    const gauge = (category: string) => samples.find((s) => s.name === 'conduit_memory_used_bytes' && s.labels.worker === 'sim-0' && s.labels.category === category)?.value;
    assert.equal(gauge('lora_adapters'), expected);
    assert.equal(gauge('weights'), paramCount(model) * 2);
    assert.equal(gauge('activations'), undefined);
    worker.unloadLora('a');
    assert.equal(worker.stats().memory!.loraAdaptersBytes, 2 * loraParamCount(model, 8, ['wq', 'wv']));
  });
});
