// A minimal leveled logger: one line per event on stderr, filtered by --log-level. Shared by the server and the
// engine threads (the KV disk tier warns when its writes fail).

export type LogLevel = 'debug' | 'info' | 'warn' | 'error' | 'silent';

export const LOG_LEVELS: readonly LogLevel[] = ['debug', 'info', 'warn', 'error', 'silent'];

export interface Logger {
  debug(message: string): void;
  info(message: string): void;
  warn(message: string): void;
  error(message: string): void;
}

export function isLogLevel(value: string): value is LogLevel {
  return (LOG_LEVELS as readonly string[]).includes(value);
}

export function createLogger(level: LogLevel, write: (line: string) => void = (line) => process.stderr.write(line)): Logger {
  const threshold = LOG_LEVELS.indexOf(level);
  const at = (which: Exclude<LogLevel, 'silent'>) => (message: string): void => {
    if (LOG_LEVELS.indexOf(which) >= threshold) write(`${new Date().toISOString()} ${which.toUpperCase().padEnd(5)} ${message}\n`);
  };
  return { debug: at('debug'), info: at('info'), warn: at('warn'), error: at('error') };
}

export const silentLogger: Logger = createLogger('silent');

/**
 * What a worker or pool says about itself once started, with the level to log it at: info for what it is (its
 * deployment, the KV blocks its disk tier found), warn for what runs worse than it could (no native kernels, AMX not
 * granted, weights not repacked).
 */
export interface Notice {
  level: 'info' | 'warn';
  message: string;
}

export const infoNotice = (message: string): Notice => ({ level: 'info', message });
export const warnNotice = (message: string): Notice => ({ level: 'warn', message });

/** createLogger's line: the time, the level padded to five characters, a space, the message. */
const LOG_LINE = /^\d{4}-\d\d-\d\dT\S+ (DEBUG|INFO |WARN |ERROR) (.*)$/;

/**
 * The level and message of a line createLogger wrote (another process's: a worker's output read by the server that
 * started it), or undefined for any other line.
 */
export function parseLogLine(line: string): { level: Exclude<LogLevel, 'silent'>; message: string } | undefined {
  const match = LOG_LINE.exec(line);
  if (!match) return undefined;
  return { level: match[1]!.trimEnd().toLowerCase() as Exclude<LogLevel, 'silent'>, message: match[2]! };
}
