// The disk tier across a change of KV dtype: files written by a worker storing f32 (the default before auto meant
// f16) are another KV layout to a worker at auto, which deletes them at start instead of reading f32 bytes as f16;
// a worker that asks for f32 again finds them.
import { afterEach, describe, test } from 'node:test';
import assert from 'node:assert/strict';
import { mkdtempSync, readdirSync, rmSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { DiskKvTier, modelFingerprint } from '../../src/engine/kv-cache/disk-tier.ts';
import { kvBlockBytes } from '../../src/engine/handoff.ts';
import { LocalEngine } from '../../src/engine/local-engine.ts';
import type { KvDtype } from '../../src/kernels/types.ts';
import { loadModel } from '../../src/model/loader.ts';
import { ensureBuiltinModel } from '../../src/model/synthetic.ts';
import { DEFAULT_BLOCK_SIZE } from '../../src/protocols/block-hash.ts';
import type { BlockHash } from '../../src/protocols/kv-events.ts';

const dirs: string[] = [];
afterEach(() => {
  while (dirs.length > 0) rmSync(dirs.pop()!, { recursive: true, force: true });
});

const hash = (n: number) => n.toString(16).padStart(16, '0') as BlockHash;

/** A folder holding `count` blocks as a worker of the built-in model storing `dtype` writes them. */
async function writtenTier(path: string, dtype: KvDtype, count: number): Promise<string> {
  const { config, weights } = await loadModel(path);
  const layout = { numLayers: config.numLayers, blockSize: DEFAULT_BLOCK_SIZE, numKvHeads: config.numKvHeads, headDim: config.headDim, dtype };
  const blockBytes = kvBlockBytes({ ...layout, numBlocks: 1 });
  const dir = mkdtempSync(join(tmpdir(), 'conduit-kv-disk-dtype-'));
  dirs.push(dir);
  const disk = new DiskKvTier({ dir, capacityBytes: 64 * (112 + blockBytes), blockBytes, fingerprint: modelFingerprint(config, weights, layout) });
  for (let n = 1; n <= count; n++) disk.put(hash(n), { bytes: new Uint8Array(blockBytes).fill(n), parentHash: n > 1 ? hash(n - 1) : null });
  await disk.flush();
  assert.equal(readdirSync(dir).filter((name) => name.endsWith('.kvb')).length, count);
  return dir;
}

async function startOn(path: string, dir: string, kvDtype?: KvDtype): Promise<LocalEngine> {
  return LocalEngine.start({
    modelPath: path, kvCacheMemoryBytes: 2 << 20, threads: 1, ...(kvDtype !== undefined ? { kvDtype } : {}),
    kvOffload: { memoryBytes: 0, diskDir: dir, diskBytes: 64 << 20 },
  });
}

describe('disk tier and the KV dtype', () => {
  test('blocks an f32 worker wrote are deleted by a worker at auto (f16), and found by one asking for f32', async () => {
    const path = await ensureBuiltinModel();
    const dir = await writtenTier(path, 'f32', 3);
    const auto = await startOn(path, dir);
    try {
      assert.equal(auto.info.kvDtype, 'f16');
      const notice = auto.notices.find((n) => n.message.startsWith('KV disk tier'));
      assert.equal(notice?.level, 'info', 'what the tier found is no warning');
      assert.match(notice?.message ?? '', /: 0 blocks of this model found .*, 3 of another model or KV layout \(block size, dtype\) deleted/);
      assert.deepEqual(readdirSync(dir).filter((name) => name.endsWith('.kvb')), [], 'the f32 files are gone, never read as f16');
    } finally {
      await auto.close();
    }

    const again = await writtenTier(path, 'f32', 2);
    const f32 = await startOn(path, again, 'f32');
    try {
      assert.equal(f32.info.kvDtype, 'f32');
      assert.match(f32.notices.find((n) => n.message.startsWith('KV disk tier'))?.message ?? '', /: 2 blocks of this model found \(room for \d+\)$/);
    } finally {
      await f32.close();
    }
  });
});
