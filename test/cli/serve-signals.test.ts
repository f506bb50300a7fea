// `conduit serve` as a process: SIGHUP (the terminal that started it closed) drains as SIGTERM does: the stream in
// flight finishes whole, then the process exits 0. Node's default for SIGHUP would end it at once, mid-stream.
import { after, describe, it } from 'node:test';
import assert from 'node:assert/strict';
import { freePort, startConduit, stopAll } from '../helpers/cluster-services.ts';
import { forEachStreamEvent } from '../helpers/sse-stream.ts';

describe('conduit serve and signals', () => {
  after(stopAll);

  it('drains on SIGHUP: the stream in flight ends whole, then exit code 0', { timeout: 120_000 }, async () => {
    const port = await freePort();
    // Simulated workers in real time: a 150-token stream of the 8B profile lasts about a second.
    const proc = startConduit(['serve', '--engine', 'sim', '--sim-speed-up', '1', '--port', String(port), '--no-request-log']);
    const url = `http://127.0.0.1:${port}`;
    for (let tries = 0; ; tries++) {
      const ready = await fetch(`${url}/health`).then((res) => res.status === 200, () => false);
      if (ready) break;
      assert.ok(tries < 600, `the server came up: ${proc.output()}`);
      await new Promise((resolve) => setTimeout(resolve, 100));
    }
    const res = await fetch(`${url}/v1/completions`, {
      method: 'POST', headers: { 'content-type': 'application/json' },
      body: JSON.stringify({ prompt: 'Once upon a time', max_tokens: 150, ignore_eos: true, stream: true }),
    });
    assert.equal(res.status, 200);
    let chunks = 0;
    let finish: string | undefined;
    await forEachStreamEvent(res, (json) => {
      if (chunks++ === 3) proc.kill('SIGHUP');
      finish = json.choices?.[0]?.finish_reason ?? finish;
    });
    assert.equal(finish, 'length', 'the stream in flight finished');
    assert.equal(await proc.exited, 0, proc.output());
    assert.match(proc.output(), /SIGHUP: shutting down/);
  });
});
