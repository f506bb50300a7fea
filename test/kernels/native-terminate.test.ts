// A worker thread that uses the addon can be terminated at any moment (a lost or killed engine worker, shutdown).
// If termination lands while a native call is converting an error into a JavaScript exception, the exception cannot
// be thrown any more; the addon must then drop it, not let a C++ exception escape into Node (which aborts the whole
// process with "terminate called after throwing an instance of 'Napi::Error'"). The check runs in a child process
// so that a failure is an exit code here, not the end of the test run.
import assert from 'node:assert/strict';
import { spawnSync } from 'node:child_process';
import { describe, it } from 'node:test';

import { NATIVE_ADDON_PATH } from '../../src/kernels/native.ts';
import { skipNative } from './native-harness.ts';

// The worker calls the addon in a tight loop, half of the calls throwing (an unknown variant name), so termination
// finds it inside a native call, often on the error path. 60 rounds aborted the process every time before the fix.
const ROUNDS = 60;
const script = `
const { Worker } = require('node:worker_threads');
const workerCode = \`
  const addon = require(\${JSON.stringify(process.env.ADDON)});
  require('node:worker_threads').parentPort.postMessage('ready');
  for (;;) {
    try { addon.cpuInfo(); addon.kernelVariants('generic'); addon.kernelVariants('no-such-variant'); } catch {}
  }\`;
(async () => {
  for (let i = 0; i < ${ROUNDS}; i++) {
    const worker = new Worker(workerCode, { eval: true });
    await new Promise((resolve) => worker.once('message', resolve));
    await new Promise((resolve) => setTimeout(resolve, 1 + (i % 5)));
    await worker.terminate();
  }
  console.log('survived');
})();
`;

describe('native addon under worker termination', { skip: skipNative }, () => {
  it('survives workers terminated in the middle of native calls', () => {
    const result = spawnSync(process.execPath, ['-e', script], {
      env: { ...process.env, ADDON: NATIVE_ADDON_PATH }, encoding: 'utf8', timeout: 120_000,
    });
    assert.equal(result.signal, null, `the process was killed by ${result.signal}: ${result.stderr}`);
    assert.equal(result.status, 0, result.stderr);
    assert.equal(result.stdout.trim(), 'survived');
  });
});
