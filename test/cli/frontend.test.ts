// `conduit frontend` takes serve's gateway options and refuses the ones that build engines, which are the workers'
// (conduit worker): typed, each is refused by name before anything connects, and the help does not offer them. Their
// environment twins, in an environment shared with workers, are not the frontend's: it neither reads nor checks them.
import assert from 'node:assert/strict';
import { test } from 'node:test';
import { runCli as run } from '../helpers/cli-main.ts';

// Unreachable services: every case is refused before a connection is tried.
const SERVICES = ['--cluster-token', 't', '--etcd-endpoints', 'http://127.0.0.1:1', '--nats-server', 'nats://127.0.0.1:1'];

test('conduit frontend refuses the workers\' options by name, and its help leaves them out', async () => {
  const workerOnly = [['--model', '/models/m.gguf'], ['--sim-gpu', 'h100'], ['--sim-lora-rank', '8'], ['--lora-modules', 'a=/a.gguf'],
    ['--kv-cache-memory', '1GiB'], ['--worker-processes'], ['--guided-jump-forward'], ['--stream-interval', '4']];
  for (const flag of workerOnly) {
    const { code, err } = await run(['frontend', ...SERVICES, ...flag]);
    assert.equal(code, 2, `${flag[0]}: ${err}`);
    assert.match(err, new RegExp(`${flag[0]} is a worker option \\(conduit worker\\), not a frontend's`));
  }
  const { code, out } = await run(['frontend', '--help']);
  assert.equal(code, 0);
  for (const [flag] of workerOnly) assert.doesNotMatch(out, new RegExp(`^ {2}${flag}\\b`, 'm'), flag);
  // Its own and the gateway's are there.
  for (const flag of ['--host', '--port', '--api-keys-file', '--etcd-endpoints', '--disagg-min-remote-prefill-tokens']) {
    assert.match(out, new RegExp(`^ {2}${flag}\\b`, 'm'), flag);
  }
});

test('conduit frontend leaves the workers\' options in its environment alone', async () => {
  // Each would stop the frontend were it read as serve reads it. A bad --namespace, refused once the gateway's
  // options are parsed and before anything connects, shows that the frontend got past them.
  const twins = { CONDUIT_GENERATION_CONFIG: '/models/only-on-worker-hosts', CONDUIT_PREFILL_WORKERS: '1', CONDUIT_THREADS: '0', CONDUIT_KV_CACHE_DTYPE: 'q8' };
  for (const [name, value] of Object.entries(twins)) {
    const { code, err } = await run(['frontend', ...SERVICES, '--namespace', 'not a namespace'], { [name]: value });
    assert.equal(code, 2, `${name}: ${err}`);
    assert.match(err, /--namespace must be 1-64 letters/, `${name}=${value}`);
  }
});
