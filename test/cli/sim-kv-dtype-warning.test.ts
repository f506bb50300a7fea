// `--kv-cache-dtype` given to simulated workers (`conduit serve` / `conduit worker --engine sim`) is ignored with a
// warning that states the KV element the simulated deployment does count: that of the profile --sim-model names, as
// the worker pool looks it up (resolveSimDeployment calls getModelProfile), not a size written into the message.
import assert from 'node:assert/strict';
import { describe, it } from 'node:test';
import { engineOptionWarnings, parseServeConfig, type ServeConfig } from '../../src/cli/serve.ts';
import { getModelProfile, KV_DTYPE_NAMES, MODEL_PROFILES } from '../../src/sim/models.ts';

function kvWarning(argv: string[], env: NodeJS.ProcessEnv = {}): string | undefined {
  const config = parseServeConfig(['--engine', 'sim', '--kv-cache-dtype', 'f32', ...argv], env) as ServeConfig;
  return config.warnings?.find((w) => w.startsWith('--kv-cache-dtype'));
}

describe('--kv-cache-dtype with simulated workers', () => {
  it('states the KV element of the --sim-model profile the workers run', () => {
    for (const id of Object.keys(MODEL_PROFILES)) {
      const bytes = getModelProfile(id).kvBytesPerElement;
      assert.equal(kvWarning(['--sim-model', id]),
        `--kv-cache-dtype is for cpu workers: simulated workers count KV elements at their profile's size (${id}: ${bytes} bytes, ${KV_DTYPE_NAMES[bytes]})`);
    }
  });

  it('names the default profile, and one set in the environment', () => {
    assert.match(kvWarning([]) ?? '', /\(llama-3\.1-8b: 2 bytes, BF16\)$/);
    assert.match(kvWarning([], { CONDUIT_SIM_MODEL: 'qwen2.5-7b' }) ?? '', /\(qwen2\.5-7b: 2 bytes, BF16\)$/);
  });

  it('claims no size for a profile that does not exist (the start refuses it)', () => {
    const warnings = engineOptionWarnings('sim', {
      'kv-cache-idle-release': 0, 'kv-cache-memory': undefined, 'kv-cache-dtype': 'f16', 'guided-jump-forward': false,
      threads: undefined, backend: undefined, 'lora-dtype': undefined, 'sim-model': 'no-such-model',
    }, {});
    assert.deepEqual(warnings, ['--kv-cache-dtype is for cpu workers: simulated workers count KV elements at their profile\'s size']);
  });
});
