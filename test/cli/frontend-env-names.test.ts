// `conduit frontend` refuses a bad value of a cluster flag that came from the environment under the variable's name,
// as `conduit worker` does (CONDUIT_NAMESPACE (--namespace) must be ...): the checks after flag parsing named only
// the flag, which nobody typed. Serve's gateway flags were already named so (parseServeConfig). A value typed on the
// command line is still named by its flag. Run through the CLI's main(); every case is refused before anything
// listens or connects.
import assert from 'node:assert/strict';
import { mkdtempSync, rmSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { describe, it } from 'node:test';
import { runCli } from '../helpers/cli-main.ts';

// Unreachable services: every case is refused before a connection is tried.
const SERVICES = ['--cluster-token', 't', '--etcd-endpoints', 'http://127.0.0.1:1', '--nats-server', 'nats://127.0.0.1:1'];

async function refused(argv: string[], env: Record<string, string>, message: RegExp): Promise<void> {
  const result = await runCli(argv, env);
  assert.equal(result.code, 2, result.err);
  assert.match(result.err, message);
}

describe('conduit frontend: a refused value from the environment', () => {
  it('is named by its variable and its flag', async () => {
    const cases: [Record<string, string>, RegExp][] = [
      [{ CONDUIT_NAMESPACE: 'a.b' }, /^conduit frontend: CONDUIT_NAMESPACE \(--namespace\) must be 1-64 letters/],
      [{ CONDUIT_MAX_FRAME_BYTES: 'x' }, /^conduit frontend: CONDUIT_MAX_FRAME_BYTES \(--max-frame-bytes\) expects bytes or a size/],
      [{ CONDUIT_ETCD_CA_FILE: '/nonexistent-folder/ca.pem' },
        /^conduit frontend: CONDUIT_ETCD_CA_FILE \(--etcd-ca-file\): cannot read \/nonexistent-folder\/ca\.pem$/],
      [{ CONDUIT_PORT: '70000' }, /^conduit frontend: CONDUIT_PORT \(--port\) must be 0\.\.65535, got 70000$/],
    ];
    for (const [env, message] of cases) await refused(['frontend', ...SERVICES], env, message);
  });

  it('names the variable of either flag of a pair that goes together', async () => {
    const dir = mkdtempSync(join(tmpdir(), 'conduit-frontend-env-names-'));
    try {
      const pem = join(dir, 'x.pem');
      writeFileSync(pem, '-----BEGIN CERTIFICATE-----\nAA==\n-----END CERTIFICATE-----\n');
      await refused(['frontend', ...SERVICES], { CONDUIT_ETCD_KEY_FILE: pem },
        /^conduit frontend: --etcd-cert-file and CONDUIT_ETCD_KEY_FILE \(--etcd-key-file\) go together/);
      await refused(['frontend', ...SERVICES], { CONDUIT_ETCD_CERT_FILE: pem },
        /^conduit frontend: CONDUIT_ETCD_CERT_FILE \(--etcd-cert-file\) and --etcd-key-file go together/);
      await refused(['frontend', ...SERVICES, '--etcd-cert-file', pem], {},
        /^conduit frontend: --etcd-cert-file and --etcd-key-file go together/);
    } finally {
      rmSync(dir, { recursive: true, force: true });
    }
  });

  it('typed on the command line, is named by its flag alone', async () => {
    await refused(['frontend', ...SERVICES, '--namespace', 'a.b'], {}, /^conduit frontend: --namespace must be 1-64 letters/);
    await refused(['frontend', ...SERVICES, '--max-frame-bytes', 'x'], {}, /^conduit frontend: --max-frame-bytes expects bytes/);
  });
});
