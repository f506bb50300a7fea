// A prefill worker restarted under its id while the old process still drains: the new process has joined in the
// old one's place, yet the blocks of a request the old process prefilled are pinned there. The decode worker must
// pull them from the process that handed them off (the connection the handoff came on), not from whichever process
// holds the id now, which never had them and would refuse the pull (the decode worker would then compute the whole
// prompt again). Real CPU workers (a tiny model) behind WorkerServers on 127.0.0.1, reached through RemoteEngines.
import { after, describe, test } from 'node:test';
import assert from 'node:assert/strict';
import { engineNow } from '../../src/engine/clock.ts';
import type { AdoptedResult, KvHandoff } from '../../src/engine/handoff.ts';
import { LocalEngine } from '../../src/engine/local-engine.ts';
import { DEFAULT_SAMPLING, type EngineRequest } from '../../src/engine/types.ts';
import { RemoteEngine } from '../../src/cluster/remote-engine.ts';
import { WorkerServer } from '../../src/cluster/worker-server.ts';
import { cpuTestModel } from '../helpers/cpu-model.ts';
import { collect, tokens } from '../helpers/outputs.ts';

const TOKEN = 'handoff-origin-token';

describe('a handoff is pulled from the prefill process that pinned it', () => {
  const model = cpuTestModel();
  const engines: LocalEngine[] = [];
  const servers: WorkerServer[] = [];
  const remotes: RemoteEngine[] = [];

  after(async () => {
    for (const remote of remotes) await remote.close();
    for (const server of servers) await server.close();
    for (const engine of engines) await engine.close();
  });

  async function serve(id: string, role: 'prefill' | 'decode'): Promise<RemoteEngine> {
    const engine = await LocalEngine.start({ modelPath: model.path, kvCacheMemoryBytes: 2 << 20, threads: 1, blockSize: 16, enableKvEvents: true, role });
    engines.push(engine);
    const server = new WorkerServer({ workerId: id, engine, role, clusterToken: TOKEN, kvLink: 'tcp' });
    servers.push(server);
    const port = await server.listen(0, '127.0.0.1');
    const remote = await RemoteEngine.connect(`127.0.0.1:${port}`, { clusterToken: TOKEN });
    remotes.push(remote);
    return remote;
  }

  test('the old process of the id, not the new one', async () => {
    const draining = await serve('p1', 'prefill');
    const replacement = await serve('p1', 'prefill');
    const decode = await serve('d1', 'decode');
    assert.notEqual(draining.kvPort, replacement.kvPort);
    // What a frontend answers for the id once the replacement joined: the new process's KV port.
    decode.kvSourceAddress = (id) => (id === 'p1' ? { host: '127.0.0.1', port: replacement.kvPort! } : undefined);

    const request: EngineRequest = {
      id: 'handed-off-before-the-restart', promptTokenIds: Array.from({ length: 70 }, (_, i) => 10 + ((i * 37) % 250)), priority: 0,
      arrivalMs: engineNow(), sampling: { ...DEFAULT_SAMPLING, maxTokens: 6, ignoreEos: true, temperature: 0 },
    };
    let handoff: KvHandoff | undefined;
    for await (const event of draining.prefill(request)) {
      if (event.type === 'handoff') {
        handoff = event.handoff;
        break;
      }
    }
    assert.ok(handoff, 'the old process handed the request off');
    const adopted: AdoptedResult[] = [];
    decode.onAdopted((result) => adopted.push(result));
    const outputs = await collect(decode.adopt(handoff, 'p1'));
    draining.releaseHandoff(request.id);
    assert.equal(outputs.at(-1)?.finishReason, 'length');
    assert.equal(tokens(outputs).length + handoff.outputTokenIds.length, 6);
    assert.equal(adopted.length, 1);
    assert.equal(adopted[0]!.status, 'imported', `the blocks came from the old process (${adopted[0]!.error ?? 'no error'})`);
    assert.ok((adopted[0]!.transfer?.blocks ?? 0) > 0, 'blocks moved over the KV link');
  });
});
