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
 * A client's string (an id, a field name) for a log line, as a JSON string literal with every character that is not
 * plain text escaped as well: JSON.stringify leaves DEL, the C1 controls (U+0080..U+009F, among them U+009B, which a
 * terminal reads as the start of an escape sequence, and U+0085, a line break to some readers), the line and
 * paragraph separators and the bidirectional overrides as they are, and with them a client could colour, reorder or
 * break the line it is quoted in.
 */
export function quoteForLog(text: string): string {
  return JSON.stringify(text).replace(/[\p{Cc}\p{Cf}\p{Zl}\p{Zp}]/gu, (char) => {
    let escaped = '';
    for (let i = 0; i < char.length; i++) escaped += `\\u${char.charCodeAt(i).toString(16).padStart(4, '0')}`;
    return escaped;
  });
}

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
