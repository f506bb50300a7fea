// Command-line flags with environment-variable twins. Every flag `--some-name` can also be set as
// CONDUIT_SOME_NAME; the command line wins over the environment, the environment over the default. `--help` has no
// twin: a stray CONDUIT_HELP must not turn every command (`conduit serve` included) into its help text. Nor has an
// internal flag Conduit sets on a child's command line (FlagSpec.noEnvTwin: `conduit worker --parent-ipc`).
// An environment variable set to "" counts as unset, unless the flag takes "" as a value of its own
// (FlagSpec.emptyIsValue: `--allowed-origins ""` is no origin, and CONDUIT_ALLOWED_ORIGINS="" must be too). A value
// that came from the environment and is refused later is reported under the variable's name (nameEnvironment).
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
  /**
   * A string flag that may be given more than once (ParsedFlags.lists holds every value in order; values holds the
   * last). Its environment twin is a comma-separated list.
   */
  repeatable?: boolean;
  /**
   * No environment variable sets it, as --help: an internal flag Conduit itself puts on a child process's command
   * line, which a variable left in an environment would otherwise turn on for every command run there.
   */
  noEnvTwin?: boolean;
  /**
   * Its environment twin set to "" is the value "", as on the command line, rather than unset: for a flag whose ""
   * means something (--allowed-origins: no origin) or must be refused (--api-keys: no key), where falling back to
   * the default would do the opposite of what was asked.
   */
  emptyIsValue?: boolean;
  /**
   * An empty (or blank) value is refused, with this text saying what to give instead. Every `host` flag has it (see
   * REQUIRED_VALUE): `--host ""` would listen on every interface.
   */
  nonEmpty?: string;
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

/** Where a flag's value came from: 'default' is the table's default, or unset when it has none. */
export type FlagSource = 'command line' | 'environment' | 'default';

export interface ParsedFlags<T extends FlagTable> {
  values: FlagValues<T>;
  positionals: string[];
  sources: Record<keyof T & string, FlagSource>;
  /** The raw text of each value that came from the environment. */
  environment: Partial<Record<keyof T & string, string>>;
  /** One line per environment variable ignored as inapplicable (ParseOptions.inapplicable). */
  warnings: string[];
  /** Every value of each repeatable flag, in order (from the command line, else its environment twin's list). */
  lists: Partial<Record<keyof T & string, string[]>>;
}

/** Flags that have no effect given the other values, and why (see ignoreInapplicable). */
export interface Inapplicable<T extends FlagTable> {
  names: readonly (keyof T & string)[];
  why: string;
}

export interface ParseOptions<T extends FlagTable> {
  /**
   * Decides, from the parsed values, which flags do not apply. An environment variable for such a flag is
   * ignored even when its text would not convert: it may be meant for another deployment sharing the environment.
   */
  inapplicable?: (values: FlagValues<T>) => Inapplicable<T> | undefined;
}

/** The flag no environment variable sets (see the top of this file). */
const NO_ENV_TWIN = 'help';

/**
 * Flags refused empty whatever table declares them, and why: an empty address makes Node listen on every interface
 * (`listen(port, '')`), so `--host "$HOST"` with HOST unset would open a server that listens on loopback by default
 * to the network. Binding everywhere takes an explicit 0.0.0.0 or ::.
 */
const REQUIRED_VALUE: Readonly<Record<string, string>> = {
  host: 'needs an address (0.0.0.0 or :: for every interface)',
};

function nonEmptyRule(name: string, spec: FlagSpec): string | undefined {
  return spec.nonEmpty ?? REQUIRED_VALUE[name];
}

/**
 * The most compute threads --threads may ask for (`conduit serve`, `worker`, `generate`): more than any machine here
 * has cores. Far more (100,000) is more threads than the system lets one process start, and the native backend then
 * aborts the process with no message.
 */
export const MAX_THREADS = 1024;

/**
 * The longest time an option in seconds (a timeout, a shutdown grace) may give: Node's timers hold at most 2^31 - 1
 * ms (about 24.8 days) and fire after 1 ms for anything longer, so a value meant as "for ages" would end at once.
 */
export const MAX_TIMER_SECONDS = Math.floor((2 ** 31 - 1) / 1000);

/** An option in seconds refused above MAX_TIMER_SECONDS; `zero`: what 0 means for it, when that is "no limit". */
export function checkTimerSecondsAtMost(flag: string, seconds: number, zero?: string): void {
  if (seconds > MAX_TIMER_SECONDS) {
    throw new UsageError(`--${flag} must be at most ${MAX_TIMER_SECONDS} seconds (about 24.8 days${zero !== undefined ? `; 0 = ${zero}` : ''}), got ${seconds}`);
  }
}

/** --threads refused above MAX_THREADS (each command checks it is a whole number > 0 first). */
export function checkThreadsAtMost(threads: number | undefined): void {
  if (threads !== undefined && threads > MAX_THREADS) throw new UsageError(`--threads must be at most ${MAX_THREADS}, got ${threads}`);
}

/**
 * The most sequences one engine batch may hold (--max-num-seqs of `serve` and `worker`, --concurrency of `generate`,
 * which runs every request in one batch): the engine sizes its step arrays for a full batch when it starts, a block
 * table row (context / block size entries) per sequence, and 10^9 asked for more than JavaScript allocates ("Invalid
 * typed array length"). Far above vLLM's default of 256; the same bound as `conduit plan --max-num-seqs`.
 */
export const MAX_NUM_SEQS = 16_384;

/**
 * The most tokens one engine step may take (--max-num-batched-tokens of `serve` and `worker`): the engine keeps four
 * arrays of that many entries, so 10^12 failed to start as --max-num-seqs did. The same bound as `conduit plan`'s.
 */
export const MAX_NUM_BATCHED_TOKENS = 1 << 20;

/**
 * The most engine workers one command may start (`conduit serve --workers`, --prefill-workers, --decode-workers and
 * `conduit cluster --workers`): each is a thread or process of its own with a KV pool, and 10^9 started them one after
 * another until the machine ran out of memory, with no message.
 */
export const MAX_WORKERS = 1024;

/**
 * The largest count a flag may give when nothing smaller bounds it (rate limits, bounds on requests and connections,
 * attempt limits, token thresholds): past 2^53 - 1 JavaScript's numbers skip whole numbers (2^53 + 1 reads as 2^53),
 * so a counter held against such a limit no longer moves exactly, and 1e300 was taken and sent back in the rate-limit
 * headers as "1e+300". The same bound as an API keys file's limits.
 */
export const MAX_COUNT = Number.MAX_SAFE_INTEGER;

/** A count flag that may be 0 (0 = off for it), whole and at most MAX_COUNT. */
export function checkCount(flag: string, value: number): number {
  if (!Number.isInteger(value) || value < 0) throw new UsageError(`--${flag} must be a whole number >= 0, got ${value}`);
  if (value > MAX_COUNT) throw new UsageError(`--${flag} must be at most ${MAX_COUNT}, got ${value}`);
  return value;
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

/** A flag's value when it is not set: its default, false for a boolean, else undefined. */
function fallback(spec: FlagSpec): string | number | boolean | undefined {
  return spec.default ?? (spec.type === 'boolean' ? false : undefined);
}

/**
 * Parses `argv` against the table. Returns the values (camel-cased keys are not used: keys stay as declared) and
 * the positional arguments. Unknown flags are an error naming the flag.
 */
export function parseFlags<T extends FlagTable>(
  table: T, argv: readonly string[], env: NodeJS.ProcessEnv = process.env, options: ParseOptions<T> = {},
): ParsedFlags<T> {
  const values: Record<string, string | number | boolean | undefined> = {};
  const sources: Record<string, FlagSource> = {};
  const fromArgs = new Set<string>();
  const lists: Record<string, string[]> = {};
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
    const rule = nonEmptyRule(name, spec);
    if (rule !== undefined && spec.type === 'string' && raw.trim() === '') throw new UsageError(`--${name} ${rule}, got "${raw}"`);
    values[name] = convert(name, spec, raw, 'option');
    if (spec.repeatable) {
      if (!fromArgs.has(name)) lists[name] = [];
      lists[name]!.push(raw);
    }
    sources[name] = 'command line';
    fromArgs.add(name);
  }

  // An environment value that does not convert is an error only once it is known to apply (options.inapplicable);
  // until then the flag holds its default.
  const environment: Record<string, string> = {};
  const invalid = new Map<string, UsageError>();
  for (const [name, spec] of Object.entries(table)) {
    if (fromArgs.has(name)) continue;
    sources[name] = 'default';
    values[name] = fallback(spec);
    if (name === NO_ENV_TWIN || spec.noEnvTwin) continue;
    const fromEnv = env[envName(name, spec)];
    if (fromEnv === undefined || (fromEnv === '' && !spec.emptyIsValue)) continue;
    sources[name] = 'environment';
    environment[name] = fromEnv;
    if (spec.repeatable) lists[name] = splitRepeatableEnv(fromEnv);
    try {
      const rule = nonEmptyRule(name, spec);
      if (rule !== undefined && spec.type === 'string' && fromEnv.trim() === '') {
        throw new UsageError(`${envName(name, spec)} (--${name}) ${rule}, got "${fromEnv}"`);
      }
      values[name] = convert(name, spec, fromEnv, envName(name, spec));
    } catch (err) {
      if (!(err instanceof UsageError)) throw err;
      invalid.set(name, err);
    }
  }
  const parsed: ParsedFlags<T> = {
    values: values as FlagValues<T>, positionals, sources: sources as ParsedFlags<T>['sources'],
    environment: environment as ParsedFlags<T>['environment'], warnings: [],
    lists: lists as ParsedFlags<T>['lists'],
  };
  // `--help` shows the help whatever the environment holds: it is how one finds out what a variable should hold.
  if (sources[NO_ENV_TWIN] === 'command line' && values[NO_ENV_TWIN] === true) return parsed;
  const rule = options.inapplicable?.(parsed.values);
  if (rule) parsed.warnings.push(...ignoreInapplicable(table, parsed, rule.names, rule.why));
  for (const [name, err] of invalid) {
    if (parsed.sources[name as keyof T & string] === 'environment') throw err;
  }
  return parsed;
}

/**
 * Flags that have no effect in the configuration at hand (`why` says why). Typed on the command line they are a
 * usage error: whoever typed them expects them to do something. Set in the environment they are ignored, and set
 * back to their default in `parsed`: an environment is often shared by several deployments, and a variable meant
 * for another one must not stop this one. Returns one warning line per ignored variable.
 */
export function ignoreInapplicable<T extends FlagTable>(table: T, parsed: ParsedFlags<T>,
  names: readonly (keyof T & string)[], why: string): string[] {
  const typed = names.filter((name) => parsed.sources[name] === 'command line');
  if (typed.length > 0) throw new UsageError(`--${typed.join(', --')}: ${why}`);
  const warnings: string[] = [];
  const values = parsed.values as Record<string, string | number | boolean | undefined>;
  for (const name of names) {
    if (parsed.sources[name] !== 'environment') continue;
    const spec = table[name]!;
    warnings.push(`ignoring ${envName(name, spec)}=${parsed.environment[name] ?? String(values[name])}: --${name} is ${why}`);
    values[name] = fallback(spec);
    parsed.sources[name] = 'default';
  }
  return warnings;
}

/**
 * The flag a value came from, as a message should name it: `--port` when typed (or defaulted), `CONDUIT_PORT (--port)`
 * when the environment gave it, so a bad value nobody typed can be found.
 */
export function flagLabel<T extends FlagTable>(table: T, parsed: Pick<ParsedFlags<T>, 'sources'>, name: keyof T & string): string {
  return parsed.sources[name] === 'environment' ? `${envName(name, table[name])} (--${name})` : `--${name}`;
}

/**
 * A usage error about a flag whose value came from the environment, reworded to name the variable: a message that
 * starts with `--port` (the checks after parsing say `--port must be 0..65535`) starts with `CONDUIT_PORT (--port)`
 * instead. Other errors come back as they are. Values are not repeated (a variable may hold a key).
 */
export function nameEnvironment<T extends FlagTable>(table: T, parsed: Pick<ParsedFlags<T>, 'sources'>, err: unknown): unknown {
  if (!(err instanceof UsageError)) return err;
  const message = nameEnvironmentIn(table, parsed, err.message);
  return message === err.message ? err : new UsageError(message);
}

/**
 * nameEnvironment for a message that is not a usage error (an engine that could not start with the value given):
 * the text with its leading `--flag` named by its variable when the environment gave the value, else as it was.
 */
export function nameEnvironmentIn<T extends FlagTable>(table: T, parsed: Pick<ParsedFlags<T>, 'sources'>, message: string): string {
  const match = /^--([a-z0-9][a-z0-9-]*)/.exec(message);
  const name = match?.[1];
  if (name === undefined || !Object.hasOwn(table, name)) return message;
  if (parsed.sources[name as keyof T & string] !== 'environment') return message;
  const variable = envName(name, table[name]);
  if (message.includes(variable)) return message;
  return `${variable} (--${name})${message.slice(match![0].length)}`;
}

/** The flag table as help text: one line per flag with its environment twin and default. */
export function formatFlagHelp(table: FlagTable): string {
  const rows = Object.entries(table).map(([name, spec]) => {
    const left = `  --${name}${spec.short ? `, -${spec.short}` : ''}${spec.type === 'boolean' ? '' : ` <${spec.type}>`}`;
    const def = (spec.default !== undefined ? ` (default ${spec.default})` : '') + (spec.repeatable ? ' (repeatable)' : '');
    const twin = name === NO_ENV_TWIN || spec.noEnvTwin ? ''
      : ` [env ${envName(name, spec)}${spec.emptyIsValue ? ', set to "" it is "" as typed, not unset' : ''}]`;
    return `${left.padEnd(34)} ${spec.help}${def}${twin}`;
  });
  return rows.join('\n');
}

/**
 * The values of a repeatable flag's environment twin: comma-separated, except that JSON objects (`{...}`, as
 * --lora-modules takes) stay whole, commas inside them included.
 */
export function splitRepeatableEnv(value: string): string[] {
  const items: string[] = [];
  let depth = 0, inString = false, start = 0;
  for (let i = 0; i < value.length; i++) {
    const c = value[i];
    if (inString) {
      if (c === '\\') i++;
      else if (c === '"') inString = false;
    } else if (c === '"' && depth > 0) inString = true;
    else if (c === '{') depth++;
    else if (c === '}') depth = Math.max(0, depth - 1);
    else if (c === ',' && depth === 0) {
      items.push(value.slice(start, i));
      start = i + 1;
    }
  }
  items.push(value.slice(start));
  return items.map((item) => item.trim()).filter((item) => item !== '');
}

/**
 * Why a file named by an option could not be used, in words ("permission denied", "is a folder, not a file"), for a
 * one-line message; the system's own message for anything rarer.
 */
export function describeFileError(err: unknown): string {
  const e = err as NodeJS.ErrnoException;
  switch (e?.code) {
    case 'ENOENT': return 'no such file or folder';
    case 'EACCES':
    case 'EPERM': return 'permission denied';
    case 'EISDIR': return 'is a folder, not a file';
    case 'ENOTDIR': return 'a part of the path is a file, not a folder';
    case 'ELOOP': return 'too many symbolic links';
    case 'EROFS': return 'read-only file system';
    default: return e instanceof Error ? e.message : String(err);
  }
}

/**
 * A file system error as one line naming the file and what could not be done with it ("cannot create
 * /var/cache/conduit: permission denied"); undefined for an error that is not one (no path). `what` names the file
 * ("model" gives "cannot read model /m.gguf: ...").
 */
export function fileProblem(err: unknown, what?: string): string | undefined {
  const e = err as NodeJS.ErrnoException;
  if (!(err instanceof Error) || typeof e.code !== 'string' || typeof e.path !== 'string') return undefined;
  const verb = e.syscall === 'mkdir' ? 'create' : ['open', 'read', 'stat', 'lstat', 'scandir', 'access'].includes(e.syscall ?? '') ? 'read' : 'write';
  return `cannot ${verb} ${what !== undefined ? `${what} ` : ''}${e.path}: ${describeFileError(e)}`;
}
