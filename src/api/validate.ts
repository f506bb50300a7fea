// Typed reading of untrusted JSON. Each accessor names the offending field with its full path ("messages[2].role")
// so the 400 tells the client exactly what to fix. An explicit null counts as absent, as in OpenAI's API.

import { InvalidValueError, MissingFieldError, WrongTypeError } from './errors.ts';

export type JsonObject = Record<string, unknown>;

export interface NumberRange {
  min?: number;
  max?: number;
  /** The bounds themselves are not allowed (e.g. top_p in (0, 1]). */
  minExclusive?: boolean;
  maxExclusive?: boolean;
}

export function isJsonObject(value: unknown): value is JsonObject {
  return typeof value === 'object' && value !== null && !Array.isArray(value);
}

export function childPath(prefix: string, key: string | number): string {
  if (typeof key === 'number') return `${prefix}[${key}]`;
  return prefix ? `${prefix}.${key}` : key;
}

function describeRange(range: NumberRange): string {
  const low = range.min === undefined ? undefined : `${range.minExclusive ? '>' : '>='} ${range.min}`;
  const high = range.max === undefined ? undefined : `${range.maxExclusive ? '<' : '<='} ${range.max}`;
  return [low, high].filter(Boolean).join(' and ');
}

export function checkRange(param: string, value: number, range: NumberRange): number {
  const tooLow = range.min !== undefined && (range.minExclusive ? value <= range.min : value < range.min);
  const tooHigh = range.max !== undefined && (range.maxExclusive ? value >= range.max : value > range.max);
  if (tooLow || tooHigh) throw new InvalidValueError(param, `${value} is out of range; it must be ${describeRange(range)}.`);
  return value;
}

export function readNumber(param: string, value: unknown, range: NumberRange = {}): number {
  if (typeof value !== 'number') throw new WrongTypeError(param, 'a number', value);
  if (!Number.isFinite(value)) throw new InvalidValueError(param, 'the number is not finite.');
  return checkRange(param, value, range);
}

export function readInteger(param: string, value: unknown, range: NumberRange = {}): number {
  if (typeof value !== 'number' || !Number.isInteger(value)) {
    if (typeof value === 'number' && !Number.isFinite(value)) {
      throw new InvalidValueError(param, 'the number is not finite.');
    }
    throw new WrongTypeError(param, 'an integer', value);
  }
  if (!Number.isSafeInteger(value)) {
    throw new InvalidValueError(param, `${value} is too large; integers must lie within +-${Number.MAX_SAFE_INTEGER}.`);
  }
  return checkRange(param, value, range);
}

export function readString(param: string, value: unknown, options: { nonEmpty?: boolean; maxLength?: number } = {}): string {
  if (typeof value !== 'string') throw new WrongTypeError(param, 'a string', value);
  if (options.nonEmpty && value.length === 0) throw new InvalidValueError(param, 'the string must not be empty.');
  if (options.maxLength !== undefined && value.length > options.maxLength) {
    throw new InvalidValueError(param, `the string is ${value.length} characters long; the limit is ${options.maxLength}.`);
  }
  return value;
}

export function readBoolean(param: string, value: unknown): boolean {
  if (typeof value !== 'boolean') throw new WrongTypeError(param, 'a boolean', value);
  return value;
}

export function readArray(param: string, value: unknown, options: { nonEmpty?: boolean; maxItems?: number } = {}): unknown[] {
  if (!Array.isArray(value)) throw new WrongTypeError(param, 'an array', value);
  if (options.nonEmpty && value.length === 0) throw new InvalidValueError(param, 'the array must not be empty.');
  if (options.maxItems !== undefined && value.length > options.maxItems) {
    throw new InvalidValueError(param, `the array has ${value.length} items; the limit is ${options.maxItems}.`);
  }
  return value;
}

/**
 * How deep the values a request hands to the chat template (tool parameters, tool-call arguments, chat_template_kwargs,
 * documents) may be nested: the template engine renders them recursively, and a value thousands of levels deep
 * overflowed its stack, which the client saw as a template failure blaming `messages`.
 */
export const MAX_TEMPLATE_VALUE_DEPTH = 64;

/** Refuses a value with arrays or objects nested more than MAX_TEMPLATE_VALUE_DEPTH deep (walked without recursion). */
export function checkTemplateValueDepth(param: string, value: unknown): void {
  const pending: [unknown, number][] = [[value, 1]];
  while (pending.length > 0) {
    const [item, depth] = pending.pop()!;
    if (typeof item !== 'object' || item === null) continue;
    if (depth > MAX_TEMPLATE_VALUE_DEPTH) {
      throw new InvalidValueError(param, `the value is nested more than ${MAX_TEMPLATE_VALUE_DEPTH} levels deep; the chat template renders it.`);
    }
    for (const child of Array.isArray(item) ? item : Object.values(item)) pending.push([child, depth + 1]);
  }
}

/** The same for a tool call's arguments, a JSON text the template renders parsed (left alone when it is not JSON). */
export function checkArgumentsDepth(param: string, text: string): string {
  let parsed: unknown;
  try {
    parsed = JSON.parse(text);
  } catch {
    return text;
  }
  checkTemplateValueDepth(param, parsed);
  return text;
}

export function readObject(param: string, value: unknown): JsonObject {
  if (!isJsonObject(value)) throw new WrongTypeError(param, 'an object', value);
  return value;
}

/** The fields of one JSON object, read with their paths. */
export class Fields {
  /** Every key asked about (has, and so every accessor): what unreadKeys leaves out. */
  private readonly asked = new Set<string>();

  constructor(readonly object: JsonObject, readonly prefix = '') {}

  /** The object's keys no accessor asked about: fields a parser that is done ignored. */
  unreadKeys(): string[] {
    return Object.keys(this.object).filter((key) => !this.asked.has(key));
  }

  path(key: string): string {
    return childPath(this.prefix, key);
  }

  /** Present and not null. */
  has(key: string): boolean {
    this.asked.add(key);
    return Object.hasOwn(this.object, key) && this.object[key] !== null && this.object[key] !== undefined;
  }

  raw(key: string): unknown {
    return this.has(key) ? this.object[key] : undefined;
  }

  required(key: string): unknown {
    if (!this.has(key)) throw new MissingFieldError(this.path(key));
    return this.object[key];
  }

  string(key: string, options?: { nonEmpty?: boolean; maxLength?: number }): string | undefined {
    return this.has(key) ? readString(this.path(key), this.object[key], options) : undefined;
  }

  boolean(key: string): boolean | undefined {
    return this.has(key) ? readBoolean(this.path(key), this.object[key]) : undefined;
  }

  number(key: string, range?: NumberRange): number | undefined {
    return this.has(key) ? readNumber(this.path(key), this.object[key], range) : undefined;
  }

  integer(key: string, range?: NumberRange): number | undefined {
    return this.has(key) ? readInteger(this.path(key), this.object[key], range) : undefined;
  }

  array(key: string, options?: { nonEmpty?: boolean; maxItems?: number }): unknown[] | undefined {
    return this.has(key) ? readArray(this.path(key), this.object[key], options) : undefined;
  }

  fields(key: string): Fields | undefined {
    return this.has(key) ? new Fields(readObject(this.path(key), this.object[key]), this.path(key)) : undefined;
  }
}
