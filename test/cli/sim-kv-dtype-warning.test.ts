// `--kv-cache-dtype` given to simulated workers (`conduit serve` / `conduit worker --engine sim`) is ignored with a
// warning that states the KV element the simulated deployment does count: that of the profile --sim-model names, as
// the worker pool looks it up (resolveSimDeployment calls getModelProfile), not a size written into the message.
import assert from 'node:assert/strict';
import { describe, it } from 'node:test';
import { engineOptionWarnings, parseServeConfig, type ServeConfig } from '../../src/cli/serve.ts';
import { getModelProfile, KV_DTYPE_NAMES, MODEL_PROFILES } from '../../src/sim/models.ts';
import { SimConfigError } from '../../src/sim/sim-worker.ts';

function kvWarning(argv: string[], env: NodeJS.ProcessEnv = {}): string | undefined {
  const config = parseServeConfig(['--engine', 'sim', '--kv-cache-dtype', 'f32', ...argv], env) as ServeConfig;
  return config.warnings?.find((w) => w.startsWith('--kv-cache-dtype'));
}

/**
 * Options for a deployment of profile `id` that can exist, on the fewest B200s that hold it: one whose weights leave
 * no HBM for the KV cache is refused with the options (Llama 3.1 405B and DeepSeek V3 need eight).
 */
function deployable(id: string): string[] {
  for (const tp of [1, 2, 4, 8]) {
    const argv = ['--sim-model', id, '--sim-gpu', 'b200', '--sim-tp', String(tp)];
    try {
      parseServeConfig(['--engine', 'sim', ...argv], {});
      return argv;
    } catch (error) {
      if (!(error instanceof SimConfigError)) throw error;
    }
  }
  assert.fail(`${id}: no deployment on up to 8 B200s`);
}

describe('--kv-cache-dtype with simulated workers', () => {
  it('states the KV element of the --sim-model profile the workers run', () => {
    for (const id of Object.keys(MODEL_PROFILES)) {
      const bytes = getModelProfile(id).kvBytesPerElement;
      assert.equal(kvWarning(deployable(id)),
        `--kv-cache-dtype is for cpu workers: simulated workers count KV elements at their profile's size (${id}: ${bytes} bytes, ${KV_DTYPE_NAMES[bytes]})`);
    }
  });

  it('names the default profile, and one set in the environment', () => {
    assert.match(kvWarning([]) ?? '', /\(llama-3\.1-8b: 2 bytes, BF16\)$/);
    assert.match(kvWarning([], { CONDUIT_SIM_MODEL: 'qwen2.5-7b' }) ?? '', /\(qwen2\.5-7b: 2 bytes, BF16\)$/);
  });

  it('claims no size for a profile that does not exist (the start refuses it)', () => {
    const warnings = engineOptionWarnings('sim', {
      'kv-cache-idle-release': 0, 'kv-cache-memory': undefined, 'kv-cache-dtype': 'f16', 'guided-jump-forward': false, 'stream-interval': 1,
      threads: undefined, backend: undefined, 'lora-dtype': undefined, 'sim-model': 'no-such-model',
    }, {});
    assert.deepEqual(warnings, ['--kv-cache-dtype is for cpu workers: simulated workers count KV elements at their profile\'s size']);
  });
});
