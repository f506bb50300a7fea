// The `conduit` command: dispatches to one module per subcommand, loaded lazily so `conduit generate` does not pay
// for the HTTP server's imports.

import { UsageError } from './flags.ts';

export interface Command {
  summary: string;
  run(argv: string[]): Promise<number>;
}

const COMMANDS: Record<string, () => Promise<Command>> = {
  serve: async () => (await import('./serve.ts')).serveCommand,
  generate: async () => (await import('./generate.ts')).generateCommand,
  sim: async () => (await import('./sim.ts')).simCommand,
  plan: async () => (await import('./plan.ts')).planCommand,
  bench: async () => (await import('./bench.ts')).benchCommand,
  trace: async () => (await import('./trace.ts')).traceCommand,
  worker: async () => (await import('./worker.ts')).workerCommand,
  frontend: async () => (await import('./frontend.ts')).frontendCommand,
  cluster: async () => (await import('./cluster.ts')).clusterCommand,
};

const PLANNED: Record<string, string> = {
};

function usage(): string {
  const lines = ['Usage: conduit <command> [options]', '', 'Commands:'];
  for (const name of Object.keys(COMMANDS)) lines.push(`  ${name}`);
  for (const [name, what] of Object.entries(PLANNED)) lines.push(`  ${name.padEnd(9)} (not available yet: ${what})`);
  lines.push('', '`conduit --version` prints the version. Run `conduit <command> --help` (or `conduit help <command>`) for its options. Every option --x-y but\n--help (and the internal worker --parent-ipc) has an environment twin CONDUIT_X_Y (sim, plan and bench: CONDUIT_SIM_X_Y, CONDUIT_PLAN_X_Y, CONDUIT_BENCH_X_Y;\ntrace and bench share CONDUIT_URL and CONDUIT_API_KEY; trace --json and --timeout are CONDUIT_TRACE_JSON and CONDUIT_TRACE_TIMEOUT).');
  return lines.join('\n');
}

export async function main(argv: string[]): Promise<number> {
  // `conduit help serve` is `conduit serve --help`, as git and cargo read it.
  if (argv[0] === 'help' && argv.length === 2 && (COMMANDS[argv[1]!] || PLANNED[argv[1]!])) return main([argv[1]!, '--help']);
  if (argv[0] === 'help' && argv.length > 1) {
    console.error(`conduit help: unknown command "${argv.slice(1).join(' ')}"\n\n${usage()}`);
    return 2;
  }
  const [name, ...rest] = argv;
  if (!name || name === '--help' || name === '-h' || name === 'help') {
    console.log(usage());
    return name ? 0 : 2;
  }
  if (name === '--version' || name === '-V' || name === 'version') {
    console.log((await import('../util/version.ts')).CONDUIT_VERSION);
    return 0;
  }
  const load = COMMANDS[name];
  if (!load) {
    if (PLANNED[name]) {
      console.error(`conduit ${name} is not available in this version (${PLANNED[name]}).`);
    } else {
      console.error(`conduit: unknown command "${name}"\n\n${usage()}`);
    }
    return 2;
  }
  try {
    const command = await load();
    return await command.run(rest);
  } catch (err) {
    // A configuration the environment gave that Conduit refuses (OTEL_EXPORTER_OTLP_PROTOCOL=grpc), or a simulated
    // worker that cannot exist (a model too large for its GPUs): one line, by name, so this file need not load the
    // telemetry or simulator modules.
    if (err instanceof UsageError || (err instanceof Error && (err.name === 'TracingConfigError' || err.name === 'SimConfigError'))) {
      console.error(`conduit ${name}: ${err.message}`);
      return 2;
    }
    throw err;
  }
}
