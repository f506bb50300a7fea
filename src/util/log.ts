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
