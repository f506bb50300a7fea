// Flags of the distributed runtime shared by `conduit worker` and `conduit frontend`: where etcd and NATS are, their
// credentials, the namespace, the cluster token of the request plane and its frame limit.

import { readFileSync } from 'node:fs';
import type { EtcdConnectOptions } from '../cluster/discovery.ts';
import { DEFAULT_NAMESPACE } from '../cluster/discovery.ts';
import type { NatsConnectOptions } from '../cluster/events.ts';
import { DEFAULT_MAX_FRAME_BYTES } from '../cluster/frames.ts';
import { UsageError, type FlagTable, type FlagValues } from './flags.ts';
import { parseByteSize } from './serve.ts';

export const CLUSTER_FLAGS = {
  'etcd-endpoints': { type: 'string', help: 'etcd endpoints, comma-separated (http://host:2379,...): discovery' },
  'nats-server': { type: 'string', help: 'NATS servers, comma-separated (nats://host:4222,...): KV events and load' },
  namespace: { type: 'string', help: 'namespace of the workers\' keys in etcd and of the NATS subjects', default: DEFAULT_NAMESPACE },
  'cluster-token': { type: 'string', help: 'shared secret every request-plane connection must present (required)' },
  'max-frame-bytes': { type: 'string', help: 'largest request-plane frame accepted, bytes or with a unit', default: `${DEFAULT_MAX_FRAME_BYTES / 1024 / 1024}MiB` },
  'etcd-username': { type: 'string', help: 'etcd user (password auth)' },
  'etcd-password': { type: 'string', help: 'etcd password' },
  'etcd-ca-file': { type: 'string', help: 'PEM CA of etcd\'s TLS certificate (https endpoints)' },
  'etcd-cert-file': { type: 'string', help: 'PEM client certificate for etcd (with --etcd-key-file)' },
  'etcd-key-file': { type: 'string', help: 'PEM client key for etcd' },
  'nats-token': { type: 'string', help: 'NATS token' },
  'nats-user': { type: 'string', help: 'NATS user' },
  'nats-password': { type: 'string', help: 'NATS password' },
  'nats-ca-file': { type: 'string', help: 'PEM CA of the NATS server\'s TLS certificate' },
  'nats-cert-file': { type: 'string', help: 'PEM client certificate for NATS (with --nats-key-file)' },
  'nats-key-file': { type: 'string', help: 'PEM client key for NATS' },
} satisfies FlagTable;

export interface ClusterConfig {
  namespace: string;
  clusterToken: string;
  maxFrameBytes: number;
  etcd?: EtcdConnectOptions;
  nats?: NatsConnectOptions;
}

function list(text: string | undefined): string[] | undefined {
  const items = text?.split(',').map((s) => s.trim()).filter(Boolean);
  return items && items.length > 0 ? items : undefined;
}

function readPem(path: string | undefined, flag: string): Buffer | undefined {
  if (path === undefined) return undefined;
  try {
    return readFileSync(path);
  } catch {
    throw new UsageError(`--${flag}: cannot read ${path}`);
  }
}

/**
 * The cluster's settings from the flags' values. `label` names a flag in a message that names two of them (default
 * `--name`; `conduit worker` and `conduit frontend` pass flagLabel, so a value from the environment is named by its
 * variable).
 */
export function parseClusterConfig(values: FlagValues<typeof CLUSTER_FLAGS>, needServices: boolean,
  label: (name: keyof typeof CLUSTER_FLAGS) => string = (name) => `--${name}`): ClusterConfig {
  const token = values['cluster-token'];
  if (!token) throw new UsageError('--cluster-token (or CONDUIT_CLUSTER_TOKEN) is required: the request plane refuses connections without it');
  const namespace = values.namespace!;
  if (!/^[A-Za-z0-9_-]{1,64}$/.test(namespace)) throw new UsageError(`--namespace must be 1-64 letters, digits, "-" or "_", got "${namespace}"`);
  // A password is sent only with its user: alone it would be dropped without a word and the connection made
  // unauthenticated (against a server with auth on, an endless retry on "permission denied" or "authorization").
  for (const [password, user] of [['etcd-password', 'etcd-username'], ['nats-password', 'nats-user']] as const) {
    if (values[password] !== undefined && values[user] === undefined) {
      throw new UsageError(`${label(password)} needs ${label(user)} (the user whose password it is)`);
    }
  }
  const endpoints = list(values['etcd-endpoints']);
  const servers = list(values['nats-server']);
  if (needServices && !endpoints) throw new UsageError('--etcd-endpoints (or CONDUIT_ETCD_ENDPOINTS) is required');
  if (needServices && !servers) throw new UsageError('--nats-server (or CONDUIT_NATS_SERVER) is required');
  const config: ClusterConfig = { namespace, clusterToken: token, maxFrameBytes: parseByteSize(values['max-frame-bytes']!, 'max-frame-bytes') };
  if (endpoints) {
    const ca = readPem(values['etcd-ca-file'], 'etcd-ca-file');
    const cert = readPem(values['etcd-cert-file'], 'etcd-cert-file');
    const key = readPem(values['etcd-key-file'], 'etcd-key-file');
    if (!cert !== !key) {
      throw new UsageError(`${label('etcd-cert-file')} and ${label('etcd-key-file')} go together (the client certificate and its key)`);
    }
    config.etcd = {
      endpoints,
      ...(values['etcd-username'] !== undefined ? { username: values['etcd-username'], password: values['etcd-password'] ?? '' } : {}),
      ...(ca ? { caFile: ca } : {}), ...(cert ? { certFile: cert } : {}), ...(key ? { keyFile: key } : {}),
    };
  }
  if (servers) {
    // nats.js reads these files itself, at every connection attempt: an unreadable one, or a certificate without its
    // key, would otherwise show only as a connection that never comes up ("waiting for NATS ..." for ever), where
    // the same mistake in the etcd flags is refused at start.
    for (const flag of ['nats-ca-file', 'nats-cert-file', 'nats-key-file'] as const) readPem(values[flag], flag);
    if ((values['nats-cert-file'] === undefined) !== (values['nats-key-file'] === undefined)) {
      throw new UsageError(`${label('nats-cert-file')} and ${label('nats-key-file')} go together (the client certificate and its key)`);
    }
    config.nats = {
      servers,
      ...(values['nats-token'] !== undefined ? { token: values['nats-token'] } : {}),
      ...(values['nats-user'] !== undefined ? { user: values['nats-user'], password: values['nats-password'] ?? '' } : {}),
      ...(values['nats-ca-file'] !== undefined ? { caFile: values['nats-ca-file'] } : {}),
      ...(values['nats-cert-file'] !== undefined ? { certFile: values['nats-cert-file'] } : {}),
      ...(values['nats-key-file'] !== undefined ? { keyFile: values['nats-key-file'] } : {}),
    };
  }
  return config;
}
