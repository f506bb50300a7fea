// `conduit worker` and `conduit frontend` send an etcd or NATS password only with its user: a password given alone
// (the user's flag or variable forgotten or misspelt) is a usage error naming both, as a client certificate without
// its key is, rather than dropped so that the process connects without credentials.
import assert from 'node:assert/strict';
import { describe, it } from 'node:test';
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
