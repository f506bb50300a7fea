// A NATS server list (--nats-server a,b) with a server down at the first connection: natsConnect connects to one
// that answers, and keeps the one that did not in its pool. nats.js drops from its pool, for good, each server its
// first connection finds down (it tries them in random order, so about one start in two), and the connection then
// waited for the server it had reached alone, even once the dropped one answered again. Real nats-server
// (/usr/sbin/nats-server) on free loopback ports; each case runs several times, as nats.js shuffles the list.
import assert from 'node:assert/strict';
import { existsSync } from 'node:fs';
import { after, describe, it } from 'node:test';
import type { NatsConnection } from '@nats-io/transport-node';
import { natsConnect } from '../../src/cluster/events.ts';
import { freePort, NATS_BIN, startNats, startProcess, stopAll, waitForPort } from '../helpers/cluster-services.ts';
import { waitUntil } from '../helpers/wait-until.ts';

const skip = existsSync(NATS_BIN) ? undefined : `needs ${NATS_BIN} (Debian nats-server)`;
const ROUNDS = 6;

describe('natsConnect with several servers, one down at the start', { skip }, () => {
  after(stopAll);

  it('connects to the live one, whichever place either has in the list, and keeps the other in its pool', async () => {
    const live = await startNats();
    const downPort = await freePort();
    const down = `nats://127.0.0.1:${downPort}`;
    try {
      for (let round = 0; round < 2 * ROUNDS; round++) {
        const servers = round % 2 === 0 ? [down, live.url] : [live.url, down];
        const nc = await natsConnect({ servers }, { retryMs: 100 });
        try {
          assert.equal(nc.getServer(), live.url.replace('nats://', ''), servers.join(','));
          assert.deepEqual(nc.getServers().map((s) => s.listen).sort(), [`127.0.0.1:${downPort}`, live.url.replace('nats://', '')].sort(),
            `${servers.join(',')}: the server that was down is still in the pool`);
        } finally {
          await nc.close();
        }
      }
    } finally {
      await live.stop();
    }
  });

  it('moves to the server that was down once it answers and the other goes away', { timeout: 120_000 }, async () => {
    for (let round = 0; round < ROUNDS; round++) {
      const first = await startNats();
      const laterPort = await freePort();
      const nc: NatsConnection = await natsConnect({ servers: [`nats://127.0.0.1:${laterPort}`, first.url] }, { retryMs: 100 });
      const reconnectedTo: string[] = [];
      void (async () => {
        for await (const status of nc.status()) if (status.type === 'reconnect') reconnectedTo.push(status.server);
      })();
      const later = startProcess(NATS_BIN, ['-a', '127.0.0.1', '-p', String(laterPort)]);
      try {
        await waitForPort(laterPort);
        await first.stop();
        await waitUntil(() => reconnectedTo.length > 0, `round ${round}: a reconnection to 127.0.0.1:${laterPort}`, 15_000);
        assert.equal(reconnectedTo[0], `127.0.0.1:${laterPort}`);
        // The connection works there.
        const sub = nc.subscribe('list.check', { max: 1 });
        nc.publish('list.check', 'x');
        for await (const msg of sub) assert.equal(msg.string(), 'x');
      } finally {
        await nc.close();
        later.kill();
        await later.exited;
        await first.stop();
      }
    }
  });
});
