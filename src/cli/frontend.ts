// `conduit frontend`: the OpenAI-compatible gateway and the KV-aware router over worker processes found through
// etcd, with their KV events and load from NATS. It serves exactly the API of `conduit serve`; the model's tokenizer
// and chat template come from the first worker (no model file here). /health lists the workers it knows, and says
// why it serves nothing when a worker's model card is over its --max-frame-bytes.

import { createLogger } from '../util/log.ts';
import { etcdClient } from '../cluster/discovery.ts';
import { EventSubscriber, natsConnect, NatsWaitAbortedError } from '../cluster/events.ts';
import { ClusterFrontend } from '../cluster/frontend.ts';
import { CLUSTER_FLAGS, parseClusterConfig, type ClusterConfig } from './cluster-flags.ts';
import { envName, flagLabel, formatFlagHelp, nameEnvironment, parseFlags, UsageError, type FlagSpec, type FlagTable } from './flags.ts';
import type { Command } from './main.ts';
import { createApiServer, parseServeConfig, SERVE_FLAGS } from './serve.ts';

/** serve's options that build engines: the workers' business, not a frontend's. */
const WORKER_ONLY = new Set([
  'model', 'engine', 'backend', 'threads', 'workers', 'worker-processes', 'prefill-workers', 'decode-workers', 'kv-cache-memory',
  'kv-cache-dtype', 'kv-cache-idle-release', 'max-num-seqs', 'max-num-batched-tokens', 'max-model-len', 'enable-prefix-caching', 'guided-jump-forward', 'stream-interval', 'generation-config', 'sim-model', 'sim-gpu', 'sim-tp', 'sim-calibration',
  'sim-speed-up', 'sim-lora-rank', 'worker-restart-limit', 'worker-restart-delay', 'kv-offload-memory', 'kv-offload-disk', 'kv-offload-disk-size',
  'scheduling-policy', 'lora-modules', 'lora-dtype', 'max-loras', 'max-lora-rank',
]);
// The workers hold the LoRA adapters (conduit worker --lora-modules); a frontend lists them, routes requests for
// them to the workers that hold them, and passes /v1/load_lora_adapter and /v1/unload_lora_adapter on to them.

const GATEWAY_FLAGS = Object.fromEntries(Object.entries(SERVE_FLAGS).filter(([name]) => !WORKER_ONLY.has(name))) as FlagTable;

/**
 * The environment without the twins of the workers' options. Typed, those options are refused (splitArgs); set in an
 * environment the frontend shares with workers or a `conduit serve` (CONDUIT_THREADS, CONDUIT_GENERATION_CONFIG ...),
 * they are someone else's and are not read at all: not validated, not applied.
 */
function gatewayEnvironment(env: NodeJS.ProcessEnv): NodeJS.ProcessEnv {
  const twins = new Set([...WORKER_ONLY].map((name) => envName(name, SERVE_FLAGS[name as keyof typeof SERVE_FLAGS])));
  return Object.fromEntries(Object.entries(env).filter(([key]) => !twins.has(key)));
}

/**
 * The option an argument names, whatever its spelling (--name, --name=value, a short alias -m, a negation
 * --no-name), with its table; undefined when it names none (a value, a positional, an unknown option).
 */
function optionOf(arg: string): { name: string; spec: FlagSpec; inline: boolean } | undefined {
  const tables: FlagTable[] = [CLUSTER_FLAGS, SERVE_FLAGS];
  if (arg.startsWith('--')) {
    const name = arg.slice(2).split('=')[0]!;
    const inline = arg.includes('=');
    for (const table of tables) {
      if (table[name]) return { name, spec: table[name], inline };
      const negated = name.startsWith('no-') ? table[name.slice(3)] : undefined;
      if (negated?.type === 'boolean') return { name: name.slice(3), spec: negated, inline: true };
    }
    return undefined;
  }
  if (arg.length === 2 && arg.startsWith('-')) {
    for (const table of tables) {
      const found = Object.entries(table).find(([, spec]) => spec.short === arg.slice(1));
      if (found) return { name: found[0], spec: found[1], inline: false };
    }
  }
  return undefined;
}

/**
 * Splits argv into the cluster flags and the rest (serve's gateway flags). A worker's option is refused however it
 * is spelt (-m, --no-enable-prefix-caching); the rest is parsed against the gateway's flags alone, so nothing
 * serve would take and a frontend ignore gets through.
 */
function splitArgs(argv: readonly string[]): { cluster: string[]; gateway: string[] } {
  const cluster: string[] = [];
  const gateway: string[] = [];
  for (let i = 0; i < argv.length; i++) {
    const arg = argv[i]!;
    if (arg === '--') {
      gateway.push(...argv.slice(i));
      break;
    }
    const option = optionOf(arg);
    if (option && WORKER_ONLY.has(option.name)) {
      const spelt = arg.startsWith('--') ? arg.split('=')[0]! : `${arg} (--${option.name})`;
      throw new UsageError(`${spelt} is a worker option (conduit worker), not a frontend's`);
    }
    // The option's value goes with it, unread: a value that looks like an option (--api-keys -m) is not one.
    const target = option && option.name in CLUSTER_FLAGS ? cluster : gateway;
    target.push(arg);
    if (option && option.spec.type !== 'boolean' && !option.inline && i + 1 < argv.length) target.push(argv[++i]!);
  }
  // Whatever is left names no worker option, but nothing is taken on trust: the gateway's flags alone (its
  // environment is read by parseServeConfig).
  parseFlags(GATEWAY_FLAGS, gateway, {});
  return { cluster, gateway };
}

/**
 * The cluster flags' settings. A value nobody typed is reported under the variable that gave it (CONDUIT_NAMESPACE
 * (--namespace) must be ...), as `conduit worker` reports it; serve's gateway flags are named so by parseServeConfig.
 */
function clusterConfig(args: readonly string[]): ClusterConfig {
  const parsed = parseFlags(CLUSTER_FLAGS, args);
  try {
    return parseClusterConfig(parsed.values, true, (name) => flagLabel(CLUSTER_FLAGS, parsed, name));
  } catch (err) {
    throw nameEnvironment(CLUSTER_FLAGS, parsed, err);
  }
}

export const frontendCommand: Command = {
  summary: 'the gateway and router over worker processes found through etcd',
  async run(argv) {
    const { cluster: clusterArgs, gateway: gatewayArgs } = splitArgs(argv);
    // The disaggregation thresholds apply when the workers found are prefill and decode workers.
    const config = parseServeConfig(gatewayArgs, gatewayEnvironment(process.env), { disaggregation: true });
    if (config === 'help') {
      console.log(`Usage: conduit frontend --etcd-endpoints URLS --nats-server URLS --cluster-token T [options]\n\n`
        + `${formatFlagHelp(CLUSTER_FLAGS)}\n${formatFlagHelp(GATEWAY_FLAGS)}`);
      return 0;
    }
    const cluster = clusterConfig(clusterArgs);
    const logger = createLogger(config.logLevel);
    const log = (level: 'debug' | 'info' | 'warn' | 'error', message: string): void => logger[level](message);
    const { api } = createApiServer(config, logger);
    try {
      await api.listen(config.port, config.host);
    } catch (err) {
      logger.error(`cannot listen on ${config.host}:${config.port}: ${(err as Error).message}`);
      return 1;
    }
    // The signals are heard from here on: a frontend still waiting for NATS stops at once, where it ignored them.
    // SIGHUP (the terminal closed) drains too, as `conduit serve` does.
    let graceMs = config.shutdownGraceMs;
    const stopping = new AbortController();
    const signalled = new Promise<string>((resolve) => {
      let received = false;
      const handler = (name: string): void => {
        if (received) {
          graceMs = 0;
          api.endGrace();
        } else {
          stopping.abort();
          resolve(name);
        }
        received = true;
      };
      for (const name of ['SIGINT', 'SIGTERM', 'SIGHUP'] as const) process.on(name, handler);
    });
    const nats = cluster.nats!;
    let nc;
    try {
      nc = await natsConnect({ ...nats, name: 'conduit-frontend' }, { log, signal: stopping.signal });
    } catch (error) {
      if (!(error instanceof NatsWaitAbortedError)) throw error;
      logger.info(`${await signalled}: ${error.message}`);
      await api.shutdown(0);
      setTimeout(() => process.exit(0), 1000).unref();
      return 0;
    }
    const frontend = new ClusterFrontend({
      namespace: cluster.namespace, clusterToken: cluster.clusterToken, etcd: etcdClient(cluster.etcd!),
      events: (handlers) => new EventSubscriber(nc, cluster.namespace, handlers, log),
      routingPolicy: config.routingPolicy, migrationLimit: config.migrationLimit, maxFrameBytes: cluster.maxFrameBytes, log,
      ...(config.disaggregationPolicy !== undefined ? { disaggregationPolicy: config.disaggregationPolicy } : {}),
    });
    // Until a worker joins, /health lists the workers found and, when one's model card is over --max-frame-bytes,
    // says so (as do refused requests): otherwise it would only ever say "loading".
    api.gateway.loadingView = () => ({ reason: frontend.notServingReason(), workers: frontend.workerViews() });
    await frontend.start();
    logger.info(`Conduit frontend listening at ${api.url}; waiting for workers under /${cluster.namespace}/workers/ `
      + `(etcd ${cluster.etcd!.endpoints.join(',')}, NATS ${nats.servers.join(',')})`);
    void frontend.ready().then((engine) => {
      api.attach({
        engine, tokenizer: frontend.tokenizer!,
        chatTemplate: config.chatTemplate !== undefined ? frontend.chatTemplate!.withTemplate(config.chatTemplate) : frontend.chatTemplate!,
        workerId: 'workerIds' in engine ? engine.workerIds[0] : engine.decodeWorkerIds[0],
        // The adapters the workers hold (their --lora-modules, and those loaded through this API).
        ...(frontend.adapters ? { adapters: frontend.adapters } : {}),
      });
      logger.info(`serving ${engine.info.modelName} (context ${engine.info.maxModelLen}, blocks of ${engine.info.blockSize}) `
        + `through the ${config.routingPolicy} router, migration limit ${config.migrationLimit}`);
    });
    const signal = await signalled;
    logger.info(`${signal}: shutting down, in-flight requests get up to ${graceMs / 1000} s`);
    await api.shutdown(graceMs);
    await frontend.close();
    logger.info('stopped');
    setTimeout(() => process.exit(0), 1000).unref();
    return 0;
  },
};
