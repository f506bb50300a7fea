// Command-line flags with environment-variable twins. Every flag `--some-name` can also be set as
// CONDUIT_SOME_NAME; the command line wins over the environment, the environment over the default.
// Commands declare their flags as a table so `--help` and the docs come from the same place.

export type FlagType = 'string' | 'number' | 'boolean';

export interface FlagSpec {
  type: FlagType;
  help: string;
  default?: string | number | boolean;
  /** Environment variable other than CONDUIT_<NAME> (e.g. the OpenAI-style OTEL_* names). */
  env?: string;
  /** Short alias, e.g. 'p' for -p. */
  short?: string;
}

export type FlagTable = Record<string, FlagSpec>;

export type FlagValues<T extends FlagTable> = {
  [K in keyof T]: T[K]['type'] extends 'number' ? number | undefined
    : T[K]['type'] extends 'boolean' ? boolean
      : string | undefined;
};

export class UsageError extends Error {
  override name = 'UsageError';
}

export function envName(flag: string, spec?: FlagSpec): string {
  return spec?.env ?? `CONDUIT_${flag.replace(/-/g, '_').toUpperCase()}`;
}

function convert(flag: string, spec: FlagSpec, raw: string, origin: string): string | number | boolean {
  switch (spec.type) {
    case 'string':
      return raw;
    case 'number': {
      const value = Number(raw);
      if (raw.trim() === '' || !Number.isFinite(value)) {
        throw new UsageError(`${origin} --${flag} expects a number, got "${raw}"`);
      }
      return value;
    }
    case 'boolean': {
      const lowered = raw.toLowerCase();
      if (['1', 'true', 'yes', 'on', ''].includes(lowered)) return true;
      if (['0', 'false', 'no', 'off'].includes(lowered)) return false;
      throw new UsageError(`${origin} --${flag} expects true or false, got "${raw}"`);
    }
  }
}

/**
 * Parses `argv` against the table. Returns the values (camel-cased keys are not used: keys stay as declared) and
 * the positional arguments. Unknown flags are an error naming the flag.
 */
export function parseFlags<T extends FlagTable>(
  table: T, argv: readonly string[], env: NodeJS.ProcessEnv = process.env,
): { values: FlagValues<T>; positionals: string[] } {
  const values: Record<string, string | number | boolean | undefined> = {};
  const fromArgs = new Set<string>();
  const positionals: string[] = [];
  const byShort = new Map(Object.entries(table).filter(([, s]) => s.short).map(([n, s]) => [s.short!, n]));

  for (let i = 0; i < argv.length; i++) {
    const arg = argv[i]!;
    if (arg === '--') { positionals.push(...argv.slice(i + 1)); break; }
    let name: string | undefined;
    let inline: string | undefined;
    if (arg.startsWith('--')) {
      const eq = arg.indexOf('=');
      name = eq >= 0 ? arg.slice(2, eq) : arg.slice(2);
      inline = eq >= 0 ? arg.slice(eq + 1) : undefined;
    } else if (arg.startsWith('-') && arg.length === 2) {
      name = byShort.get(arg.slice(1));
      if (!name) throw new UsageError(`unknown option ${arg}`);
    } else {
      positionals.push(arg);
      continue;
    }
    let spec = table[name];
    let negated = false;
    if (!spec && name.startsWith('no-') && table[name.slice(3)]?.type === 'boolean') {
      name = name.slice(3);
      spec = table[name];
      negated = true;
    }
    if (!spec) throw new UsageError(`unknown option --${name} (see --help)`);
    let raw: string;
    if (spec.type === 'boolean') {
      raw = negated ? 'false' : inline ?? 'true';
    } else if (inline !== undefined) {
      raw = inline;
    } else {
      const next = argv[i + 1];
      if (next === undefined) throw new UsageError(`--${name} needs a value`);
      raw = next;
      i++;
    }
    values[name] = convert(name, spec, raw, 'option');
    fromArgs.add(name);
  }

  for (const [name, spec] of Object.entries(table)) {
    if (fromArgs.has(name)) continue;
    const fromEnv = env[envName(name, spec)];
    if (fromEnv !== undefined && fromEnv !== '') values[name] = convert(name, spec, fromEnv, envName(name, spec));
    else if (spec.default !== undefined) values[name] = spec.default;
    else values[name] = spec.type === 'boolean' ? false : undefined;
  }
  return { values: values as FlagValues<T>, positionals };
}

/** The flag table as help text: one line per flag with its environment twin and default. */
export function formatFlagHelp(table: FlagTable): string {
  const rows = Object.entries(table).map(([name, spec]) => {
    const left = `  --${name}${spec.short ? `, -${spec.short}` : ''}${spec.type === 'boolean' ? '' : ` <${spec.type}>`}`;
    const def = spec.default !== undefined ? ` (default ${spec.default})` : '';
    return `${left.padEnd(34)} ${spec.help}${def} [env ${envName(name, spec)}]`;
  });
  return rows.join('\n');
}
