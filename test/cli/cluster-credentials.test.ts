// The credentials `conduit worker` and `conduit frontend` take for etcd and NATS are checked at start, the NATS TLS
// files as the etcd ones are: a file that cannot be read, or a client certificate without its key (or a key without
// its certificate), is a usage error naming the flag (or its variable), rather than a process that starts and then
// waits for NATS for ever because nats.js fails every connection attempt on the same file. A password is sent only
// with its user: one given alone (the user's flag or variable forgotten or misspelt) is a usage error naming both,
// rather than dropped so that the process connects without credentials.
import assert from 'node:assert/strict';
import { mkdtempSync, rmSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { after, before, describe, it } from 'node:test';
import { CLUSTER_FLAGS, parseClusterConfig } from '../../src/cli/cluster-flags.ts';
import { flagLabel, parseFlags, UsageError } from '../../src/cli/flags.ts';

const SERVICES = ['--cluster-token', 't', '--etcd-endpoints', 'http://127.0.0.1:1', '--nats-server', 'nats://127.0.0.1:1'];

function config(argv: string[], env: Record<string, string> = {}): ReturnType<typeof parseClusterConfig> {
  const parsed = parseFlags(CLUSTER_FLAGS, [...SERVICES, ...argv], env);
  return parseClusterConfig(parsed.values, true, (name) => flagLabel(CLUSTER_FLAGS, parsed, name));
}

function refused(argv: string[], env: Record<string, string>, message: RegExp): void {
  assert.throws(() => config(argv, env), (err: unknown) => err instanceof UsageError && message.test(err.message),
    `${argv.join(' ')} ${JSON.stringify(env)}`);
}

describe('NATS TLS files', () => {
  let dir = '';
  let pem = '';
  before(() => {
    dir = mkdtempSync(join(tmpdir(), 'conduit-nats-tls-'));
    pem = join(dir, 'x.pem');
    writeFileSync(pem, '-----BEGIN CERTIFICATE-----\nAA==\n-----END CERTIFICATE-----\n');
  });
  after(() => rmSync(dir, { recursive: true, force: true }));

  it('refuses a file that cannot be read, naming the flag', () => {
    const missing = join(dir, 'missing.pem');
    for (const flag of ['--nats-ca-file', '--nats-cert-file', '--nats-key-file']) {
      const pair = flag === '--nats-cert-file' ? ['--nats-key-file', pem] : flag === '--nats-key-file' ? ['--nats-cert-file', pem] : [];
      refused([flag, missing, ...pair], {}, new RegExp(`^${flag}: cannot read ${missing.replace(/[.]/g, '\\.')}$`));
    }
  });

  it('refuses a client certificate without its key and a key without its certificate, as the etcd pair', () => {
    refused(['--nats-cert-file', pem], {}, /^--nats-cert-file and --nats-key-file go together/);
    refused(['--nats-key-file', pem], {}, /^--nats-cert-file and --nats-key-file go together/);
    refused([], { CONDUIT_NATS_KEY_FILE: pem }, /^--nats-cert-file and CONDUIT_NATS_KEY_FILE \(--nats-key-file\) go together/);
    refused([], { CONDUIT_NATS_CERT_FILE: pem }, /^CONDUIT_NATS_CERT_FILE \(--nats-cert-file\) and --nats-key-file go together/);
  });

  it('passes readable files on to the NATS connection by path', () => {
    assert.deepEqual(config(['--nats-ca-file', pem, '--nats-cert-file', pem, '--nats-key-file', pem]).nats,
      { servers: ['nats://127.0.0.1:1'], caFile: pem, certFile: pem, keyFile: pem });
    assert.deepEqual(config(['--nats-ca-file', pem]).nats, { servers: ['nats://127.0.0.1:1'], caFile: pem });
  });
});

describe('a cluster password without its user', () => {
  it('is refused, naming the flags or the variable that gave the password', () => {
    refused(['--etcd-password', 'p'], {}, /^--etcd-password needs --etcd-username/);
    refused(['--nats-password', 'p'], {}, /^--nats-password needs --nats-user/);
    refused([], { CONDUIT_ETCD_PASSWORD: 'p' }, /^CONDUIT_ETCD_PASSWORD \(--etcd-password\) needs --etcd-username/);
    refused([], { CONDUIT_NATS_PASSWORD: 'p' }, /^CONDUIT_NATS_PASSWORD \(--nats-password\) needs --nats-user/);
  });

  it('with its user, both reach the connection options', () => {
    const both = config(['--etcd-username', 'u', '--etcd-password', 'p', '--nats-user', 'n', '--nats-password', 'q']);
    assert.equal(both.etcd?.username, 'u');
    assert.equal(both.etcd?.password, 'p');
    assert.equal(both.nats?.user, 'n');
    assert.equal(both.nats?.password, 'q');
  });
});
