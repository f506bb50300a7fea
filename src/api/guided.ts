// Structured outputs at the edge: response_format (json_object, json_schema), vLLM's guided_json / guided_regex /
// guided_choice / guided_grammar and its newer structured_outputs object, read into the engine's GuidedDecoding
// (plain data), then checked by compiling the grammar without a vocabulary on the gateway's own XGrammar, so that
// a schema the engine cannot follow is a 400 naming the field before any work is queued. Schema keywords XGrammar
// would silently ignore (so the output could break them) are refused by name here too.

import { GrammarError, XGrammar } from '../engine/grammar/xgrammar.ts';
import { ExactInteger, exactJsonText } from '../engine/grammar/json-numbers.ts';
import { grammarSource, parseGrammar, type GrammarSource } from '../engine/grammar/runtime.ts';
import type { GuidedDecoding } from '../engine/types.ts';
import { exactBodyField, parseJsonExactNumbers, TemplateNumber } from '../model/template-values.ts';
import { InvalidValueError, UnsupportedFieldError } from './errors.ts';
import { childPath, Fields, isJsonObject, readArray, readObject, readString, type JsonObject } from './validate.ts';

/** A guided-decoding request and the field it came from (what a 400 names). */
export interface GuidedRequest {
  spec: GuidedDecoding;
  param: string;
}

export const MAX_GUIDED_CHOICES = 1024;
/**
 * Enum values in one schema, all its enums together: an enum compiles as a choice list does, and compiling runs on
 * the worker's engine thread, between steps of every request there (measured at a 32k vocabulary: 1024 values about
 * 70 ms, 16384 values 1.2 s, 100k values seconds more), hence guided_choice's bound.
 */
export const MAX_GUIDED_ENUM_VALUES = MAX_GUIDED_CHOICES;
/**
 * Bytes of what a grammar is compiled from: a schema's JSON text (without its annotations: description, title,
 * examples, default, ...), a regex, an EBNF grammar, a choice list's strings together. Compile time grows with it, and
 * faster than linearly for some shapes (an object of 550 optional properties, 22 KB, took 0.5 s; 2200 of them 5 s).
 */
export const MAX_GUIDED_BYTES = 64 * 1024;
// XGrammar (0.1.27) compiling a schema of 54 nested objects runs out of its WebAssembly stack, which aborts the
// worker's grammar engine and the requests running there: 32 levels keep a wide margin (nested arrays compile to 64).
const MAX_SCHEMA_DEPTH = 32;
/**
 * Parenthesised groups nested in a regex (guided_regex, a schema's 'pattern') or an EBNF grammar. XGrammar parses
 * them recursively: 200 nested regex groups overflow its stack when compiled against a vocabulary (which spoils the
 * worker's instance), 250 spoil the gateway's own silently and 1000 never finish there; EBNF fails at 200.
 */
export const MAX_GROUP_DEPTH = 64;
/**
 * Objects and arrays nested in a schema's JSON, counting every level (values of unknown keywords, const, enum and
 * annotations too, which MAX_SCHEMA_DEPTH's walk does not enter). XGrammar parses the whole text recursively: about
 * 400 levels ran its WebAssembly stack out (an aborted grammar engine), and some 10,000 overflowed the walks here.
 * The deepest schema MAX_SCHEMA_DEPTH accepts is about 70 levels of JSON.
 */
export const MAX_SCHEMA_JSON_DEPTH = 128;

/**
 * JSON Schema keywords the grammar cannot enforce: XGrammar would accept the schema and ignore them, so an output
 * could violate them. Refused, naming where they are.
 */
const UNSUPPORTED_KEYWORDS: Record<string, string> = {
  not: "'not' cannot be enforced by a grammar",
  if: "conditional schemas ('if'/'then'/'else') are not supported",
  then: "conditional schemas ('if'/'then'/'else') are not supported",
  else: "conditional schemas ('if'/'then'/'else') are not supported",
  dependentSchemas: "'dependentSchemas' is not supported",
  dependentRequired: "'dependentRequired' is not supported",
  dependencies: "'dependencies' is not supported",
  uniqueItems: "'uniqueItems' cannot be enforced by a grammar",
  contains: "'contains' is not supported",
  minContains: "'minContains' is not supported",
  maxContains: "'maxContains' is not supported",
  multipleOf: "'multipleOf' is not supported",
  patternProperties: "'patternProperties' is not supported",
  propertyNames: "'propertyNames' is not supported",
  unevaluatedItems: "'unevaluatedItems' is not supported",
  $dynamicRef: "'$dynamicRef' is not supported",
  $recursiveRef: "'$recursiveRef' is not supported",
  // XGrammar 0.1.27 turns allOf of object schemas into any JSON value, and lets it replace 'properties' beside it.
  allOf: "'allOf' is not enforced by the grammar engine; merge its schemas into one",
};

/**
 * Bounds XGrammar 0.1.27 enforces on integers only: on other numbers a fractional bound's "." became any character
 * (output such as {"x": 1F5}), exclusive bounds were not kept, and integral bounds let decimals past them.
 */
const INTEGER_ONLY_BOUNDS = new Set(['minimum', 'maximum', 'exclusiveMinimum', 'exclusiveMaximum']);
/**
 * Keywords XGrammar 0.1.27 applies to strings only when "type" says string (without it, it allows any JSON value);
 * and of which it keeps one: 'format' over 'pattern' over 'minLength'/'maxLength', the others ignored.
 */
const STRING_KEYWORDS = ['format', 'pattern', 'minLength', 'maxLength'];
/** Keywords whose value is a schema, a list of schemas or a map of schemas: walked into. */
const SCHEMA_VALUED = new Set(['items', 'additionalProperties', 'unevaluatedProperties', 'additionalItems']);
const SCHEMA_LISTS = new Set(['anyOf', 'oneOf', 'prefixItems']);
const SCHEMA_MAPS = new Set(['properties', '$defs', 'definitions']);
const TYPES = new Set(['object', 'array', 'string', 'number', 'integer', 'boolean', 'null']);
/** Keywords that only annotate (XGrammar ignores them): left out of the schema the grammar is compiled from. */
const ANNOTATIONS = new Set(['title', 'description', 'examples', 'default', '$comment', 'deprecated', 'readOnly', 'writeOnly', '$schema']);

// 'format' values. XGrammar 0.1.27's own grammars for some produce values that are not of the format (a minute of
// 60, the 31st of April, an IPv4 part with a leading zero, hostname labels of any length, an invalid JSON escape in
// an email's quoted local part, a raw '"' in a JSON pointer): those are enforced here by a pattern instead, each
// a subset of the format (so every value produced is of it). The others are XGrammar's (random walks through each
// grammar gave only values a format validator accepts).
const UTC_OFFSET = '(Z|[+\\-]([01][0-9]|2[0-3]):[0-5][0-9])';
const FULL_DATE = '([0-9]{4}-(0[13578]|1[02])-(0[1-9]|[12][0-9]|3[01])|[0-9]{4}-(0[469]|11)-(0[1-9]|[12][0-9]|30)'
  + '|[0-9]{4}-02-(0[1-9]|1[0-9]|2[0-8])|([0-9]{2}(0[48]|[2468][048]|[13579][26])|([02468][048]|[13579][26])00)-02-29)';
const FULL_TIME = `([01][0-9]|2[0-3]):[0-5][0-9]:[0-5][0-9](\\.[0-9]+)?${UTC_OFFSET}`;
const IPV4_PART = '(25[0-5]|2[0-4][0-9]|1[0-9][0-9]|[1-9]?[0-9])';
const POINTER = '(/([^/~"\\\\\\x00-\\x1f]|~[01])*)*';
const EMAIL_ATOM = "[A-Za-z0-9!#$%&'*+/=?^_`{|}~\\-]+";
const DOMAIN_LABEL = '[A-Za-z0-9]([A-Za-z0-9\\-]*[A-Za-z0-9])?';
/** Formats enforced by a pattern given here (XGrammar's own grammar for them being wrong). */
export const FORMAT_PATTERNS: Record<string, string> = {
  date: FULL_DATE,
  time: FULL_TIME,
  'date-time': `${FULL_DATE}T${FULL_TIME}`,
  ipv4: `${IPV4_PART}(\\.${IPV4_PART}){3}`,
  // Lowercase; at most 4 labels, the first of at most 61 characters, so that the whole stays within 253.
  hostname: '[a-z0-9]([a-z0-9\\-]{0,59}[a-z0-9])?(\\.[a-z0-9]([a-z0-9\\-]{0,61}[a-z0-9])?){0,3}',
  // A dot-atom local part (no quoted one) and a domain of at least two labels.
  email: `${EMAIL_ATOM}(\\.${EMAIL_ATOM})*@(${DOMAIN_LABEL}\\.)+${DOMAIN_LABEL}`,
  'json-pointer': POINTER,
  'relative-json-pointer': `(0|[1-9][0-9]*)(#|${POINTER})`,
};
/** Formats whose XGrammar grammar is used as it is. */
const XGRAMMAR_FORMATS = ['duration', 'ipv6', 'uri', 'uri-reference', 'uri-template', 'uuid'];
export const GUIDED_FORMATS: readonly string[] = [...Object.keys(FORMAT_PATTERNS), ...XGRAMMAR_FORMATS].sort();

/** What a walk over one schema counts. */
interface SchemaWalk {
  enumValues: number;
  /** The whole schema, where its '$ref's point. */
  root: unknown;
}

/**
 * Throws a 400 naming the first part of `schema` (at JSON path `path`) the grammar cannot follow, or that no value
 * could satisfy (checkSatisfiable).
 */
export function checkJsonSchema(schema: unknown, path: string): void {
  checkJsonDepth(schema, path);
  walkSchema(schema, path, 0, { enumValues: 0, root: schema });
  checkSatisfiable(schema, path);
}

/** The schema's JSON nested at most MAX_SCHEMA_JSON_DEPTH levels; walked with a list, not recursion, as it may be far deeper. */
function checkJsonDepth(schema: unknown, path: string): void {
  const pending: { value: unknown; depth: number }[] = [{ value: schema, depth: 0 }];
  while (pending.length > 0) {
    const { value, depth } = pending.pop()!;
    if (value === null || typeof value !== 'object') continue;
    if (depth >= MAX_SCHEMA_JSON_DEPTH) {
      throw new InvalidValueError(path, `the schema's JSON is nested more than ${MAX_SCHEMA_JSON_DEPTH} levels deep (objects and arrays, `
        + 'in any keyword).');
    }
    for (const child of Object.values(value)) pending.push({ value: child, depth: depth + 1 });
  }
}

function walkSchema(schema: unknown, path: string, depth: number, walk: SchemaWalk): void {
  if (typeof schema === 'boolean') return;
  if (!isJsonObject(schema)) throw new InvalidValueError(path, 'a JSON schema must be an object or a boolean.');
  if (depth > MAX_SCHEMA_DEPTH) throw new InvalidValueError(path, `the schema is nested more than ${MAX_SCHEMA_DEPTH} levels deep.`);
  const types = schemaTypes(schema);
  if (schema.type === 'integer') checkIntegerBounds(schema, path);
  for (const [key, value] of Object.entries(schema)) {
    const at = childPath(path, key);
    const unsupported = Object.hasOwn(UNSUPPORTED_KEYWORDS, key) ? UNSUPPORTED_KEYWORDS[key] : undefined;
    if (unsupported !== undefined) throw new UnsupportedFieldError(at, `${unsupported} in guided decoding.`);
    if (INTEGER_ONLY_BOUNDS.has(key) && schema.type !== 'integer') {
      throw new UnsupportedFieldError(at, `'${key}' is enforced on "type": "integer" only in guided decoding (on other numbers the `
        + 'grammar engine could produce values outside it, or invalid JSON).');
    }
    if (STRING_KEYWORDS.includes(key)) checkStringKeyword(schema, key, value, types, path);
    if (key === 'type') {
      const list = Array.isArray(value) ? value : [value];
      for (const type of list) {
        if (typeof type !== 'string' || !TYPES.has(type)) {
          throw new InvalidValueError(at, `unknown type ${JSON.stringify(type)}; expected one of ${[...TYPES].join(', ')}.`);
        }
      }
    } else if (key === '$ref') {
      if (typeof value !== 'string' || !(value === '#' || value.startsWith('#/'))) {
        throw new UnsupportedFieldError(at, `only references inside the schema ('#/...') are supported, not ${JSON.stringify(value)}.`);
      }
      checkRef(walk.root, value, at);
    } else if (key === 'required') {
      if (!Array.isArray(value) || value.some((name) => typeof name !== 'string')) {
        throw new InvalidValueError(at, "'required' must be an array of property names.");
      }
      checkRequired(schema, value as string[], at);
    } else if (SCHEMA_VALUED.has(key)) {
      if (key === 'items' && Array.isArray(value)) value.forEach((item, i) => walkSchema(item, childPath(at, i), depth + 1, walk));
      else walkSchema(value, at, depth + 1, walk);
    } else if (SCHEMA_LISTS.has(key)) {
      if (!Array.isArray(value)) throw new InvalidValueError(at, `'${key}' must be an array of schemas.`);
      value.forEach((item, i) => walkSchema(item, childPath(at, i), depth + 1, walk));
    } else if (SCHEMA_MAPS.has(key)) {
      if (!isJsonObject(value)) throw new InvalidValueError(at, `'${key}' must be an object of schemas.`);
      for (const [name, item] of Object.entries(value)) walkSchema(item, childPath(at, name), depth + 1, walk);
    } else if (key === 'enum') {
      if (!Array.isArray(value) || value.length === 0) throw new InvalidValueError(at, "'enum' must be a non-empty array.");
      walk.enumValues += value.length;
      if (walk.enumValues > MAX_GUIDED_ENUM_VALUES) {
        throw new InvalidValueError(at, `a schema may hold at most ${MAX_GUIDED_ENUM_VALUES} enum values in all (as guided_choice holds at most `
          + `${MAX_GUIDED_CHOICES} choices); this one holds more.`);
      }
      value.forEach((item, i) => {
        checkValueType(item, types, childPath(at, i), 'enum value');
        checkWholeCharacters(item, childPath(at, i), 'enum value');
      });
    } else if (key === 'const') {
      checkValueType(value, types, at, "'const'");
      checkWholeCharacters(value, at, "'const'");
    }
  }
}

/**
 * Integer bounds XGrammar 0.1.27 enforces as written. It turns them into a regex of digit patterns, and some shapes
 * come out wider or narrower than the bounds (100..110 allowed 100..119, 2000..2100 allowed 2000..2999, a negative
 * minimum refused -105..-1 and let "-" alone through), so the output broke the schema without a word. Refused here
 * are exactly those shapes; the others were checked against XGrammar's matcher over thousands of random ranges.
 * An exclusive bound is the inclusive one next to it (XGrammar reads it so); one of each side only.
 */
function checkIntegerBounds(schema: JsonObject, path: string): void {
  const bound = (key: string): number | undefined => {
    const value = schema[key];
    if (value === undefined) return undefined;
    if (typeof value !== 'number' || !Number.isInteger(value)) {
      throw new InvalidValueError(childPath(path, key), `'${key}' of an integer must be an integer, not ${JSON.stringify(value)}.`);
    }
    if (!Number.isSafeInteger(value)) {
      throw new UnsupportedFieldError(childPath(path, key), `'${key}' beyond ${Number.MAX_SAFE_INTEGER} (2^53 - 1) either way is not `
        + 'enforced in guided decoding (the grammar engine would produce integers past it).');
    }
    return value;
  };
  for (const [inclusive, exclusive] of [['minimum', 'exclusiveMinimum'], ['maximum', 'exclusiveMaximum']] as const) {
    if (schema[inclusive] !== undefined && schema[exclusive] !== undefined) {
      throw new UnsupportedFieldError(childPath(path, exclusive), `'${inclusive}' beside '${exclusive}' is not enforced in guided `
        + 'decoding (the grammar engine keeps one of them); give only the tighter one.');
    }
  }
  const exclusiveMinimum = bound('exclusiveMinimum');
  const exclusiveMaximum = bound('exclusiveMaximum');
  const low = bound('minimum') ?? (exclusiveMinimum === undefined ? undefined : exclusiveMinimum + 1);
  const high = bound('maximum') ?? (exclusiveMaximum === undefined ? undefined : exclusiveMaximum - 1);
  if (low === undefined && high === undefined) return;
  const lowKey = schema.minimum !== undefined ? 'minimum' : 'exclusiveMinimum';
  const highKey = schema.maximum !== undefined ? 'maximum' : 'exclusiveMaximum';
  if (low !== undefined && high !== undefined && low > high) {
    throw new InvalidValueError(childPath(path, lowKey), `no integer lies between '${lowKey}' and '${highKey}'.`);
  }
  if (integerRangeEnforced(low, high)) return;
  const range = `${low ?? '-infinity'}..${high ?? 'infinity'}`;
  const blamed = low === undefined || (high !== undefined && integerRangeEnforced(low, undefined)) ? highKey : lowKey;
  throw new UnsupportedFieldError(childPath(path, blamed), `the integer range ${range} is not `
    + 'enforced as written by the grammar engine in guided decoding (its digit patterns for these bounds let other integers '
    + 'through or leave some out). Among the bounds it enforces: a minimum alone of 0, 1 or 10 and more; a maximum alone of -1 '
    + 'or 0; ranges such as 0..99, 0..129, 1..9, 18..65, 120..128, 2000..2999, -50..50. 0..120 is not: it allowed up to 129. '
    + 'The rule is in docs/structured-outputs.md.');
}

/**
 * Whether XGrammar 0.1.27's regex for the integers low..high (each bound optional) is exactly those integers. Its
 * regex for a span of positive integers is a union over each digit count (see positiveSpanEnforced); a negative span
 * is written as "-" before the span of their magnitudes.
 */
export function integerRangeEnforced(low: number | undefined, high: number | undefined): boolean {
  if (low === undefined && high === undefined) return true;
  // A one-digit minimum above 1 comes out as "[5-9] | [1-9][0-9]*" (every positive integer); a negative one as
  // garbage; a negative maximum other than -1 counts its digits the wrong way.
  if (high === undefined) return low! === 0 || low! === 1 || low! >= 10;
  if (low === undefined) return high >= 0 ? positiveSpanEnforced(1, high) : high === -1;
  if (low < 0 && !positiveSpanEnforced(Math.max(1, -high), -low)) return false;
  return high <= 0 || positiveSpanEnforced(Math.max(1, low), high);
}

/** Whether XGrammar's digit patterns for low..high (1 <= low <= high) are exact: each digit count's part is. */
function positiveSpanEnforced(low: number, high: number): boolean {
  if (low > high) return true;
  const lowDigits = String(low).length;
  const highDigits = String(high).length;
  // Both bounds written digit by digit, in different digit counts: each digit count's patterns are right, but the
  // engine's automaton merges states of the two enumerations and lets other numbers through: past the upper bound
  // from five digits up (64..19069 allowed 19070, 64..190069 190070), and below a two-digit lower bound ending in 9
  // beside a three-digit upper bound ending in 9 (39..799 allowed 30..38), and below a lower bound of 901..999 beside
  // a four-digit upper bound (901..1234 allowed 900, 929..2163 others). From two digits to three or four, and from
  // three digits below 900 to four, the others were exact (over 600 random ranges, every integer up to past the
  // upper bound checked in each).
  if (lowDigits !== highDigits && lowDigits > 1 && !/^10*$/.test(String(low)) && !/^9+$/.test(String(high))) {
    const bothEndIn9 = low % 10 === 9 && high % 10 === 9;
    const exact = (lowDigits === 2 && highDigits <= 4 && !(highDigits === 3 && bothEndIn9))
      || (lowDigits === 3 && highDigits === 4 && low < 900);
    if (!exact) return false;
  }
  for (let digits = lowDigits; digits <= highDigits; digits++) {
    const start = digits === lowDigits ? String(low) : `1${'0'.repeat(digits - 1)}`;
    const end = digits === highDigits ? String(high) : '9'.repeat(digits);
    if (!sameLengthSpanEnforced(start, end)) return false;
  }
  return true;
}

/**
 * For two bounds of the same digit count: XGrammar writes their common prefix, then one digit range and free digits
 * after it, when they differ in the last two digits only (exact only with 0s after the lower bound's differing
 * digit and 9s after the upper's); and, when they share the first digit but differ earlier, "lower bound up to
 * the first digit's last number" joined with "the first digit's first number up to the upper bound", the whole block
 * of that first digit. A lower bound of 10..0 or an upper bound of 99..9 is written from the other bound alone (exact).
 */
function sameLengthSpanEnforced(start: string, end: string): boolean {
  const digits = start.length;
  let prefix = 0;
  while (prefix < digits && start[prefix] === end[prefix]) prefix++;
  if (digits === 1 || prefix === digits) return true;
  const zerosAfter = (text: string, from: number) => /^0*$/.test(text.slice(from));
  const ninesAfter = (text: string, from: number) => /^9*$/.test(text.slice(from));
  // Different first digits: right as written, but at three digits, both bounds ending in 9 and the upper one not all
  // 9s, the automaton's merged states let the lower bound's last digit go below 9 (109..409 allowed 100..108,
  // 539..909 530, and 339..599 330, which the upper bound's 9s did not save). Other three- and four-digit ranges
  // were exact (over 1,000 random ones, 100 of them ending in 9 both); five and more are kept to the bounds written
  // from 10..0 or up to a block of 9s.
  if (prefix === 0) {
    if (digits === 3) return !(start.endsWith('9') && end.endsWith('9')) || /^9+$/.test(end);
    return digits < 3 || digits === 4 || zerosAfter(start, 1) || ninesAfter(end, 1);
  }
  if (prefix >= digits - 2) return zerosAfter(start, prefix + 1) && ninesAfter(end, prefix + 1);
  if (zerosAfter(start, 1) && start[0] === '1' || ninesAfter(end, 0)) return true;
  return zerosAfter(start, 1) && ninesAfter(end, 1);
}

/** The types a schema's "type" names (undefined without one). */
function schemaTypes(schema: JsonObject): string[] | undefined {
  if (schema.type === undefined) return undefined;
  return (Array.isArray(schema.type) ? schema.type : [schema.type]).filter((type): type is string => typeof type === 'string');
}

/**
 * 'format', 'pattern', 'minLength', 'maxLength': enforced beside "type": "string" and one kind at a time ('format', or
 * 'pattern', or the lengths), a format from GUIDED_FORMATS, a pattern nested at most MAX_GROUP_DEPTH groups deep.
 */
function checkStringKeyword(schema: JsonObject, key: string, value: unknown, types: string[] | undefined, path: string): void {
  const at = childPath(path, key);
  if (key === 'format' && typeof value !== 'string') throw new InvalidValueError(at, "'format' must be a string.");
  if (key === 'pattern') {
    if (typeof value !== 'string') throw new InvalidValueError(at, "'pattern' must be a string.");
    checkGroupDepth(value, 'regex', at);
    checkCharacterClasses(value, 'regex', at);
  }
  if (key === 'format' && !GUIDED_FORMATS.includes(value as string)) {
    throw new UnsupportedFieldError(at, `format ${JSON.stringify(value)} is not enforced in guided decoding; the formats enforced are `
      + `${GUIDED_FORMATS.join(', ')}. Leave it out, or state the values with 'pattern' (strings) or 'minimum'/'maximum' (integers).`);
  }
  if (types === undefined) {
    throw new UnsupportedFieldError(at, `'${key}' is enforced only beside "type": "string" in guided decoding (without a type the `
      + 'grammar engine allows any value).');
  }
  const kept = schema.format !== undefined ? 'format' : schema.pattern !== undefined ? 'pattern' : undefined;
  if (kept !== undefined && key !== kept && types.includes('string')) {
    throw new UnsupportedFieldError(at, `'${key}' beside '${kept}' is not enforced in guided decoding (the grammar engine keeps `
      + `'${kept}' alone)${kept === 'pattern' && key !== 'format' ? '; put the length in the pattern, e.g. {1,20}' : ''}.`);
  }
  if (key === 'pattern') checkPatternInJson(value as string, at);
}

/** The characters a JSON string holds only escaped: '"', '\' and the controls U+0000-U+001F. */
const JSON_ESCAPED = [...Array.from({ length: 0x20 }, (_, i) => i), 0x22, 0x5c];
const isJsonEscaped = (codePoint: number) => codePoint < 0x20 || codePoint === 0x22 || codePoint === 0x5c;
/** Of those, the ones each shorthand class matches in XGrammar 0.1.27 (checked with its matcher). */
const SHORTHAND_ESCAPED: Record<string, number[]> = {
  d: [], w: [], s: [9, 10, 11, 12, 13], D: JSON_ESCAPED, W: JSON_ESCAPED, S: JSON_ESCAPED.filter((c) => c < 9 || c > 13),
};
/** Escapes of one character outside \x, \u and \U: the controls they name (others name themselves). */
const CONTROL_ESCAPES: Record<string, number> = { n: 10, t: 9, r: 13, f: 12, v: 11, a: 7, e: 27, '0': 0 };

/** The ASCII characters each shorthand class matches, as XGrammar 0.1.27 reads it outside a class (checked with its matcher). */
const ASCII_WORD = (codePoint: number) => /[0-9A-Za-z_]/.test(String.fromCharCode(codePoint));
const ASCII_SPACE = (codePoint: number) => (codePoint >= 9 && codePoint <= 13) || codePoint === 0x20;
const ASCII_DIGIT = (codePoint: number) => codePoint >= 0x30 && codePoint <= 0x39;
const SHORTHAND_ASCII: Record<string, (codePoint: number) => boolean> = {
  w: ASCII_WORD, s: ASCII_SPACE, d: ASCII_DIGIT,
  W: (c) => !ASCII_WORD(c), S: (c) => !ASCII_SPACE(c), D: (c) => !ASCII_DIGIT(c),
};

/** A regex character class that matches no character at all once \W, \S or \D in it are read as outside one. */
export class EmptyCharacterClass extends Error {}

/** ASCII code points as regex class members, runs as ranges ([0x30..0x39, 0x41] as \x30-\x39\x41). */
function asciiMembers(codePoints: number[]): string {
  const hex = (codePoint: number) => `\\x${codePoint.toString(16).padStart(2, '0')}`;
  let out = '';
  for (let k = 0; k < codePoints.length;) {
    let last = k;
    while (last + 1 < codePoints.length && codePoints[last + 1] === codePoints[last]! + 1) last++;
    out += last === k ? hex(codePoints[k]!) : `${hex(codePoints[k]!)}-${hex(codePoints[last]!)}`;
    k = last + 1;
  }
  return out;
}

/**
 * A regex with every character class holding \W, \S or \D written as XGrammar 0.1.27 enforces it. Outside a class it
 * reads \w, \s and \d as ASCII ([0-9A-Za-z_], [\t\n\v\f\r ], [0-9]; Python's re.ASCII reading) and \W, \S, \D as
 * everything else, every character outside ASCII included; inside a class it took \W, \S and \D for their ASCII
 * characters alone, so [\W]+ never gave "é", and a negated class then let every character outside ASCII through:
 * [^\W] (\w) gave "é", [^\S] (\s) gave "中", [^\W\d] (letters and '_') gave "😀". Such a class matches every
 * character outside ASCII, so it is written as its ASCII characters beside [^\x00-\x7f] ([a\W] as
 * (?:[...]|[^\x00-\x7f])), and negated as the ASCII characters it leaves out, a class of ASCII only ([^\W\d] as
 * [\x41-\x5a\x5f\x61-\x7a]). Other classes are left as they are (XGrammar reads \w, \s and \d in them as outside).
 * A negated one that leaves out every character throws EmptyCharacterClass.
 */
export function shorthandClasses(pattern: string): string {
  let out = '';
  for (let i = 0; i < pattern.length; i++) {
    const c = pattern[i]!;
    if (c === '\\') {
      out += pattern.slice(i, i + 2);
      i++;
      continue;
    }
    if (c !== '[') {
      out += c;
      continue;
    }
    let j = i + 1;
    const negated = pattern[j] === '^';
    if (negated) j++;
    const ascii = new Set<number>();
    let complemented = false;
    let known = true;
    /** One member at j: the character it names, if one (a shorthand class adds its ASCII characters itself). */
    const member = (): number | undefined => {
      if (pattern[j] !== '\\') {
        const codePoint = pattern.codePointAt(j)!;
        j += codePoint > 0xffff ? 2 : 1;
        return codePoint;
      }
      const letter = pattern[j + 1] ?? '';
      const width = Object.hasOwn(HEX_ESCAPE_DIGITS, letter) ? HEX_ESCAPE_DIGITS[letter]! : 0;
      if (width > 0) {
        const hexDigits = pattern.slice(j + 2, j + 2 + width);
        j += 2 + width;
        if (!/^[0-9a-fA-F]+$/.test(hexDigits) || hexDigits.length < width) known = false;
        return parseInt(hexDigits, 16);
      }
      j += 2;
      if (Object.hasOwn(SHORTHAND_ASCII, letter)) {
        for (let codePoint = 0; codePoint < 0x80; codePoint++) if (SHORTHAND_ASCII[letter]!(codePoint)) ascii.add(codePoint);
        if (letter === 'W' || letter === 'S' || letter === 'D') complemented = true;
        return undefined;
      }
      if (Object.hasOwn(CONTROL_ESCAPES, letter)) return CONTROL_ESCAPES[letter]!;
      if (/[A-Za-z]/.test(letter) || letter === '') known = false;
      return letter.codePointAt(0);
    };
    for (let first = true; j < pattern.length && (pattern[j] !== ']' || first); first = false) {
      const low = member();
      if (low !== undefined && pattern[j] === '-' && j + 1 < pattern.length && pattern[j + 1] !== ']') {
        j++;
        const high = member() ?? 0x10ffff;
        for (let codePoint = low; codePoint <= Math.min(high, 0x7f); codePoint++) ascii.add(codePoint);
      } else if (low !== undefined && low < 0x80) {
        ascii.add(low);
      }
    }
    const whole = pattern.slice(i, j + 1);
    i = j;
    if (!complemented || !known) {
      out += whole;
      continue;
    }
    const members = [...ascii].sort((a, b) => a - b);
    if (negated) {
      const left = Array.from({ length: 0x80 }, (_, codePoint) => codePoint).filter((codePoint) => !ascii.has(codePoint));
      if (left.length === 0) throw new EmptyCharacterClass(whole);
      out += `[${asciiMembers(left)}]`;
    } else {
      out += members.length === 0 ? '[^\\x00-\\x7f]' : `(?:[${asciiMembers(members)}]|[^\\x00-\\x7f])`;
    }
  }
  return out;
}

/**
 * Regex class members (inside [...]) for the characters JSON writes escaped: '\', U+0000-U+001F and '"' last (a hex
 * digit after \x1f would be read as part of that escape).
 */
const JSON_ESCAPED_MEMBERS = '\\\\\\x00-\\x1f"';

/** A part of a schema's 'pattern' that jsonStringPattern cannot write without the characters JSON writes escaped. */
class EscapedOnlyPart extends Error {
  /** Whether the part matches nothing else (else: it is not rewritten here, an escape letter not known or a class of \S, \W, \D). */
  constructor(part: string, readonly only: boolean) {
    super(part);
  }
}

/**
 * A schema's 'pattern' as it goes to XGrammar: without the characters a JSON string holds only escaped ('"', '\' and
 * the controls U+0000-U+001F). XGrammar 0.1.27 writes the pattern between the string's quotes as it is, so such a
 * character came out raw inside the JSON string ('.' let "a"b" through, which does not parse; '\S' a raw backslash).
 * So the parts that match such characters among others match only the others: '.' is [^\\\x00-\x1f"]; \S, \W and \D
 * are [^\s...], [^\w...] and [^\d...] of the same; \s is a space; a negated class leaves those characters out too,
 * and a class that holds some (its ASCII characters and ranges, \d, \w) is written again without them ([ -~] as
 * [\x20-\x21\x23-\x5b\x5d-\x7e]). Every string the pattern then gives is one the pattern allows, so the output fits
 * the schema; the strings holding those characters are no longer produced. A part that matches nothing else ('"',
 * \\, \n, a raw control character, [\x00-\x1f]) throws EscapedOnlyPart naming it, and so do an escape letter not
 * known here (\b). Classes holding \S, \W or \D are rewritten first (shorthandClasses). Non-ASCII characters are left
 * to XGrammar as they were (a negated class matches the same of them with those characters added).
 */
export function jsonStringPattern(pattern: string): string {
  /** The escape at `i` (a backslash at i): the escaped characters it matches, the one character it names if it does, its end. */
  const escape = (i: number): { matched: number[]; codePoint?: number; end: number } => {
    const letter = pattern[i + 1] ?? '';
    const width = letter === 'x' ? 2 : letter === 'u' ? 4 : letter === 'U' ? 8 : 0;
    const one = (codePoint: number, end: number) => ({ matched: isJsonEscaped(codePoint) ? [codePoint] : [], codePoint, end });
    if (width > 0) {
      const hex = pattern.slice(i + 2, i + 2 + width);
      return one(/^[0-9a-fA-F]+$/.test(hex) ? parseInt(hex, 16) : 0, i + 2 + width);
    }
    if (Object.hasOwn(SHORTHAND_ESCAPED, letter)) return { matched: SHORTHAND_ESCAPED[letter]!, end: i + 2 };
    if (Object.hasOwn(CONTROL_ESCAPES, letter)) return one(CONTROL_ESCAPES[letter]!, i + 2);
    if (/[A-Za-z]/.test(letter) && letter !== 'p' && letter !== 'P') return { matched: JSON_ESCAPED, end: i + 2 };
    const codePoint = letter === '' ? 0x5c : letter.codePointAt(0)!;
    return one(codePoint, i + 1 + (codePoint > 0xffff ? 2 : 1));
  };
  const hex = (codePoint: number) => `\\x${codePoint.toString(16).padStart(2, '0')}`;
  let out = '';
  for (let i = 0; i < pattern.length; i++) {
    const c = pattern[i]!;
    if (c === '\\') {
      const letter = pattern[i + 1] ?? '';
      const { matched, end } = escape(i);
      if (letter === 'S' || letter === 'W' || letter === 'D') out += `[^\\${letter.toLowerCase()}${JSON_ESCAPED_MEMBERS}]`;
      else if (letter === 's') out += '[ ]';
      else if (matched.length > 0) throw new EscapedOnlyPart(`escape ${pattern.slice(i, end)}`, /^[A-Za-z]$/.test(letter) ? Object.hasOwn(CONTROL_ESCAPES, letter) : true);
      else out += pattern.slice(i, end);
      i = end - 1;
    } else if (c === '.') {
      out += `[^${JSON_ESCAPED_MEMBERS}]`;
    } else if (c === '[') {
      // A class: its members (a ']' right after '[' or '[^' is one), and which escaped characters it matches.
      let j = i + 1;
      const negated = pattern[j] === '^';
      if (negated) j++;
      const bodyStart = j;
      const members = new Set<number>();
      const ascii = new Set<number>();
      const shorthands = new Set<string>();
      /** One member at j, a character or an escape: the character it names, if one. */
      const member = (): number | undefined => {
        if (pattern[j] === '\\') {
          const letter = pattern[j + 1] ?? '';
          const { matched, codePoint, end } = escape(j);
          matched.forEach((special) => members.add(special));
          if (letter === 's') ascii.add(0x20);
          else if (Object.hasOwn(SHORTHAND_ESCAPED, letter)) shorthands.add(letter);
          else if (codePoint === undefined) shorthands.add('?');
          j = end;
          return codePoint;
        }
        const codePoint = pattern.codePointAt(j)!;
        if (isJsonEscaped(codePoint)) members.add(codePoint);
        j += codePoint > 0xffff ? 2 : 1;
        return codePoint;
      };
      for (let first = true; j < pattern.length && (pattern[j] !== ']' || first); first = false) {
        const low = member();
        if (low !== undefined && pattern[j] === '-' && j + 1 < pattern.length && pattern[j + 1] !== ']') {
          j++;
          const high = member() ?? 0x10ffff;
          for (const special of JSON_ESCAPED) if (special >= low && special <= high) members.add(special);
          for (let codePoint = low; codePoint <= Math.min(high, 0x7f); codePoint++) ascii.add(codePoint);
          if (high > 0x7f) shorthands.add('?');
        } else if (low !== undefined) {
          if (low <= 0x7f) ascii.add(low);
          else shorthands.add('?');
        }
      }
      const body = pattern.slice(bodyStart, j);
      if (negated) {
        // The escaped characters first, and a leading ']' or '-' of the class escaped, so that it stays a member.
        out += `[^${JSON_ESCAPED_MEMBERS}${/^[\]-]/.test(body) ? `\\${body}` : body}]`;
      } else if (members.size === 0) {
        out += pattern.slice(i, j + 1);
      } else {
        const kept = [...ascii].filter((codePoint) => !isJsonEscaped(codePoint)).sort((a, b) => a - b);
        const other = [...shorthands].some((letter) => letter !== 'd' && letter !== 'w');
        if (other || (kept.length === 0 && shorthands.size === 0)) throw new EscapedOnlyPart(`character class ${pattern.slice(i, j + 1)}`, !other);
        let rebuilt = [...shorthands].map((letter) => `\\${letter}`).join('');
        for (let k = 0; k < kept.length;) {
          let last = k;
          while (last + 1 < kept.length && kept[last + 1] === kept[last]! + 1) last++;
          rebuilt += last === k ? hex(kept[k]!) : `${hex(kept[k]!)}-${hex(kept[last]!)}`;
          k = last + 1;
        }
        out += `[${rebuilt}]`;
      }
      i = j;
    } else if (isJsonEscaped(c.codePointAt(0)!)) {
      throw new EscapedOnlyPart(`character ${JSON.stringify(c)}`, true);
    } else {
      out += c;
    }
  }
  return out;
}

/** A schema's 'pattern' that requires a character JSON writes escaped (jsonStringPattern): refused, naming the part. */
function checkPatternInJson(pattern: string, at: string): void {
  try {
    jsonStringPattern(shorthandClasses(pattern));
  } catch (error) {
    if (!(error instanceof EscapedOnlyPart)) throw error;
    throw new UnsupportedFieldError(at, `the pattern's ${error.message} ${error.only ? 'matches only' : 'can match'} '"', '\\' or control `
      + 'characters, which JSON writes escaped; the grammar engine would write them raw inside the string (invalid JSON). Leave them '
      + `out of the pattern${error.only ? '' : ', or name the characters allowed (e.g. [^\\s\\\\\\x00-\\x1f"] for \\S)'}.`);
  }
}

/** Whether a JSON value is of one of `types` (any, without a type). */
function fitsTypes(value: unknown, types: string[] | undefined): boolean {
  if (types === undefined) return true;
  return types.some((type) => {
    switch (type) {
      case 'null': return value === null;
      case 'boolean': return typeof value === 'boolean';
      case 'integer': return typeof value === 'number' && Number.isInteger(value);
      case 'number': return typeof value === 'number';
      case 'string': return typeof value === 'string';
      case 'array': return Array.isArray(value);
      case 'object': return isJsonObject(value);
      default: return false;
    }
  });
}

/** An enum or const value must be of the schema's type: the grammar produces the value as given, whatever the type. */
function checkValueType(value: unknown, types: string[] | undefined, at: string, what: string): void {
  if (!fitsTypes(value, types)) {
    throw new InvalidValueError(at, `${what} ${JSON.stringify(value)} is not of the schema's type (${types!.join(', ')}): no output `
      + 'could fit both.');
  }
}

/**
 * An enum or const value holds no lone UTF-16 surrogate (JSON's "\ud800": half of a surrogate pair, no character), in
 * a string of it or a key, however deep: XGrammar failed such a schema with its own "Failed to parse JSON", which
 * named neither the value nor the field, and no UTF-8 output could spell the value anyway.
 */
function checkWholeCharacters(value: unknown, at: string, what: string): void {
  const lone = (text: string) => LONE_SURROGATE.test(text);
  const holds = (item: unknown): boolean => {
    if (typeof item === 'string') return lone(item);
    if (Array.isArray(item)) return item.some(holds);
    if (isJsonObject(item)) return Object.entries(item).some(([key, inner]) => lone(key) || holds(inner));
    return false;
  };
  if (holds(value)) {
    throw new InvalidValueError(at, `${what} ${JSON.stringify(value)} holds a lone UTF-16 surrogate (half of a surrogate pair), which no `
      + 'UTF-8 output can spell. Send whole characters.');
  }
}

/**
 * Each required property must be one 'properties' lists: XGrammar enforces 'required' only for those (a name it does
 * not list is left out of the output), and with additionalProperties false no value has it at all.
 */
function checkRequired(schema: JsonObject, required: string[], at: string): void {
  const properties = isJsonObject(schema.properties) ? schema.properties : {};
  required.forEach((name, i) => {
    if (Object.hasOwn(properties, name)) return;
    if (schema.additionalProperties === false) {
      throw new InvalidValueError(childPath(at, i), `'${name}' is required, but 'properties' does not define it and additionalProperties `
        + 'is false: no value can satisfy the schema.');
    }
    throw new UnsupportedFieldError(childPath(at, i), `'${name}' is required but not defined in 'properties': the grammar engine `
      + "enforces 'required' only for the properties listed there; define it under 'properties'.");
  });
}

/** A regex or EBNF grammar nested at most MAX_GROUP_DEPTH parenthesised groups deep (strings, classes and escapes skipped). */
function checkGroupDepth(text: string, kind: 'regex' | 'ebnf', param: string): void {
  let depth = 0;
  let deepest = 0;
  for (let i = 0; i < text.length; i++) {
    const c = text[i]!;
    if (c === '\\') {
      i++;
    } else if (c === '[') {
      // A class: to its closing ']' (a ']' right after '[' or '[^' is a member).
      let j = i + 1;
      if (text[j] === '^') j++;
      if (text[j] === ']') j++;
      while (j < text.length && text[j] !== ']') j += text[j] === '\\' ? 2 : 1;
      i = j;
    } else if (kind === 'ebnf' && (c === '"' || c === "'")) {
      let j = i + 1;
      while (j < text.length && text[j] !== c) j += text[j] === '\\' ? 2 : 1;
      i = j;
    } else if (kind === 'ebnf' && c === '#') {
      while (i < text.length && text[i] !== '\n') i++;
    } else if (c === '(') {
      depth++;
      if (depth > deepest) deepest = depth;
    } else if (c === ')') {
      depth = Math.max(0, depth - 1);
    }
  }
  if (deepest > MAX_GROUP_DEPTH) {
    throw new InvalidValueError(param, `the ${kind === 'regex' ? 'regex' : 'grammar'} nests groups ${deepest} deep; at most `
      + `${MAX_GROUP_DEPTH} in guided decoding.`);
  }
}

/** Hex digits each of \x, \u and \U takes in a regex. */
const HEX_ESCAPE_DIGITS: Record<string, number> = { x: 2, u: 4, U: 8 };

function hexRunLength(text: string, from: number): number {
  let end = from;
  while (end < text.length && /[0-9a-fA-F]/.test(text[end]!)) end++;
  return end - from;
}

/**
 * Character classes and escapes XGrammar 0.1.27 compiles into something other than what they say (in a regex, a
 * schema's 'pattern' or an EBNF grammar), so the output could break them; refused. Its character-class automaton
 * handles UTF-8 only for ASCII: a class holding another character ([à-ÿ], [a-zé], [\u4e00-\u9fa5], [^é]) matched
 * single bytes, or, past U+00FF, almost any text but its own characters. \x inside a class took every hex digit
 * after it ([\x41a] became the one character U+041A, not A or a; [\x41-\x5a0-9] a range up to U+05A0), as it does
 * outside a class in a regex, and so did \u and \U of a character outside ASCII. \p{...} inside a class was read as
 * the letters p, {, ... . A class of one character ([é]) compiles as that character and is kept, as are
 * alternatives of characters ((é|ü|[a-z])). In EBNF, comments are skipped, and string literals but for \x followed by
 * more than two hex digits, which XGrammar reads as one escape there too ("\x41a" is "К", where GBNF reads "Aa").
 */
function checkCharacterClasses(text: string, kind: 'regex' | 'ebnf', param: string): void {
  const refuse = (why: string): never => {
    throw new UnsupportedFieldError(param, `${why} The grammar engine does not enforce it as written in guided decoding, so the output `
      + 'could break it.');
  };
  if (kind === 'regex') {
    try {
      shorthandClasses(text);
    } catch (error) {
      if (!(error instanceof EmptyCharacterClass)) throw error;
      throw new InvalidValueError(param, `the character class ${error.message} matches no character.`);
    }
  }
  for (let i = 0; i < text.length; i++) {
    const c = text[i]!;
    if (kind === 'ebnf' && (c === '"' || c === "'")) {
      let j = i + 1;
      while (j < text.length && text[j] !== c) {
        if (text[j] === '\\' && text[j + 1] === 'x' && hexRunLength(text, j + 2) > 2) {
          refuse(`The escape ${text.slice(j, j + 5)}... in a string literal is followed by more hex digits, which the grammar engine reads `
            + 'as part of it ("\\x41a" as U+041A, not "Aa"); write the next character another way (e.g. "\\x41" "a" or "\\u0041a").');
        }
        j += text[j] === '\\' ? 2 : 1;
      }
      i = j;
    } else if (kind === 'ebnf' && c === '#') {
      while (i < text.length && text[i] !== '\n') i++;
    } else if (c === '\\') {
      if (kind === 'regex' && text[i + 1] === 'x' && hexRunLength(text, i + 2) > 2) {
        refuse(`The escape ${text.slice(i, i + 5)}... is followed by more hex digits, which the grammar engine reads as part of it `
          + '(\\x41a as U+041A, not "Aa"); write the next character another way (e.g. [a] or \\u0061).');
      }
      i++;
    } else if (c === '[') {
      let j = i + 1;
      const negated = text[j] === '^';
      if (negated) j++;
      const members: number[] = [];
      while (j < text.length && text[j] !== ']') {
        if (text[j] === '\\') {
          const letter = text[j + 1] ?? '';
          if (letter === 'p' || letter === 'P') {
            refuse(`A Unicode property (\\${letter}{...}) inside a character class is read as its letters.`);
          }
          const width = Object.hasOwn(HEX_ESCAPE_DIGITS, letter) ? HEX_ESCAPE_DIGITS[letter]! : 0;
          if (width > 0) {
            // \u and \U of an ASCII character are read as it; \x and those of other characters take every hex digit after them.
            const digits = hexRunLength(text, j + 2);
            if (digits < width || (letter === 'x' && digits > width)) {
              refuse(`The escape ${text.slice(j, j + 2 + Math.max(digits, width))} inside a character class is read with every hex digit `
                + `after \\${letter} (the grammar engine's reading of [\\x41a] is U+041A, not A or a), so it names another character. `
                + 'Write the character itself, or put the escape last in the class.');
            }
            members.push(parseInt(text.slice(j + 2, j + 2 + width), 16));
            j += 2 + width;
          } else {
            members.push(letter.charCodeAt(0));
            j += 2;
          }
        } else {
          const codePoint = text.codePointAt(j)!;
          members.push(codePoint);
          j += codePoint > 0xffff ? 2 : 1;
        }
      }
      if (members.some((codePoint) => codePoint >= 0x80) && (negated || members.length > 1)) {
        refuse(`The character class ${text.slice(i, j + 1)} holds a character outside ASCII; the grammar engine matches such classes `
          + `byte by byte. Spell the characters as alternatives instead, e.g. ${kind === 'regex' ? '(é|ü|[a-z])' : '("é" | "ü" | [a-z])'}.`);
      }
      i = j;
    }
  }
}

/** A grammar source's text within MAX_GUIDED_BYTES. */
function checkBytes(text: string, param: string, what: string, uncounted = 0): void {
  const bytes = Buffer.byteLength(text, 'utf8') - uncounted;
  if (bytes > MAX_GUIDED_BYTES) {
    throw new InvalidValueError(param, `${what} is ${bytes} bytes; at most ${MAX_GUIDED_BYTES} in guided decoding.`);
  }
}

/**
 * A copy of `schema` with `edit` applied to every schema in it (the root and each at a schema position: items,
 * properties, $defs, anyOf, ...), inner ones first; `edit` gets the copy (its parts edited already) and the schema it
 * was copied from. Values that are not schemas (enum, const, ...) and boolean schemas are kept as they are.
 */
export function mapSchemas(schema: unknown, edit: (node: JsonObject, original: JsonObject) => JsonObject): unknown {
  if (!isJsonObject(schema)) return schema;
  const out: JsonObject = {};
  for (const [key, value] of Object.entries(schema)) {
    if (SCHEMA_VALUED.has(key)) {
      out[key] = Array.isArray(value) ? value.map((item) => mapSchemas(item, edit)) : mapSchemas(value, edit);
    } else if (SCHEMA_LISTS.has(key) && Array.isArray(value)) {
      out[key] = value.map((item) => mapSchemas(item, edit));
    } else if (SCHEMA_MAPS.has(key) && isJsonObject(value)) {
      out[key] = Object.fromEntries(Object.entries(value).map(([name, item]) => [name, mapSchemas(item, edit)]));
    } else {
      out[key] = value;
    }
  }
  return edit(out, schema);
}

/**
 * The schema the grammar is compiled from, for a schema checkJsonSchema passed: its annotations left out, the formats
 * of FORMAT_PATTERNS turned into their patterns, an enum, or an anyOf/oneOf of nothing but consts and enums
 * (choiceBranches), as the pattern of their prefix tree when its values are ASCII strings (stringEnumPattern), else
 * as an anyOf of one rule per value (valueRules), each pattern in a group of its own, and the parts no finite value
 * satisfies left out where a value may go without them (leaveOutUnsatisfiable).
 */
export function grammarSchema(schema: unknown): unknown {
  const has = finiteSchemas(schema);
  const hoisted = hoistedRefs(schema);
  let input = schema;
  if (hoisted.size > 0) {
    const defs = { ...(isJsonObject((schema as JsonObject).$defs) ? (schema as JsonObject).$defs as JsonObject : {}) };
    for (const { name, target } of hoisted.values()) defs[name] = target as JsonObject;
    input = { ...(schema as JsonObject), $defs: defs };
  }
  return mapSchemas(input, (node, original) => {
    leaveOutUnsatisfiable(node, original, has);
    spellPropertyNames(node);
    if (typeof node.$ref === 'string') {
      const to = hoisted.get(node.$ref);
      node.$ref = to !== undefined ? `#/$defs/${to.name}` : grammarRef(schema, node.$ref);
    }
    const values = node.$ref === undefined && node.const === undefined ? enumValues(node) ?? choiceBranches(original) : undefined;
    if (values !== undefined && values.length > 1) {
      const enumTree = stringEnumPattern(values);
      if (enumTree !== undefined) return { type: 'string', pattern: enumTree };
      return valueRules(values);
    }
    for (const key of Object.keys(node)) if (ANNOTATIONS.has(key)) delete node[key];
    const pattern = typeof node.format === 'string' && Object.hasOwn(FORMAT_PATTERNS, node.format) ? FORMAT_PATTERNS[node.format] : undefined;
    if (pattern !== undefined) {
      delete node.format;
      node.pattern = pattern;
    }
    // XGrammar 0.1.27 writes a pattern between the string's quotes without a group around it, so an alternation at
    // its top ("521|60[01]") split the quotes between its branches: the output was 600" or "521, not JSON.
    if (typeof node.pattern === 'string') node.pattern = `(?:${jsonStringPattern(shorthandClasses(node.pattern))})`;
    return node;
  });
}

/**
 * XGrammar 0.1.27 writes a property's name into its grammar between quotes as it is, where the grammar reads
 * escapes: a name holding '"', or ending in '\', was XGrammar's "EBNF lexer error" (a 400 that did not say why),
 * a\b came out as "a", a raw backspace, "b" (not JSON), x\x41a as "xК", and a raw tab or other control character,
 * which JSON writes escaped, came out raw (not JSON either). So such a name goes to it as the grammar's escaped
 * spelling of the name's JSON text (a"b as a\\\"b, which it reads back as a\"b, the JSON text), in 'properties' and
 * 'required' alike. Other names are left as they are: their JSON text is themselves, and they hold no '\', which
 * every rewritten one does, so no two names meet. A '$ref' through such a name is rewritten with it (grammarRef).
 */
function spellPropertyNames(node: JsonObject): void {
  const spelling = propertyNameSpelling;
  const properties = node.properties;
  if (isJsonObject(properties) && Object.keys(properties).some((name) => spelling(name) !== name)) {
    node.properties = Object.fromEntries(Object.entries(properties).map(([name, schema]) => [spelling(name), schema]));
  }
  if (Array.isArray(node.required)) node.required = node.required.map((name) => (typeof name === 'string' ? spelling(name) : name));
}

/** A property name as the grammar schema holds it (spellPropertyNames). */
function propertyNameSpelling(name: string): string {
  return JSON.stringify(name).slice(1, -1).replace(/["\\]/g, '\\$&');
}

/** An enum's values, each once (by JSON text: the text the grammar spells). */
function enumValues(schema: JsonObject): unknown[] | undefined {
  if (!Array.isArray(schema.enum)) return undefined;
  const seen = new Set<string>();
  return schema.enum.filter((value) => !seen.has(JSON.stringify(value)) && seen.add(JSON.stringify(value)));
}

/**
 * The values of a schema that is nothing but an anyOf or a oneOf whose every branch is a const or an enum
 * (annotations and "type" aside: XGrammar reads neither beside anyOf/oneOf): XGrammar 0.1.27 compiles such branches
 * side by side, as it does an enum's values, and mixed them the same way ({"anyOf": [{"const": "521"}, {"const":
 * "600"}, {"const": "601"}]} took "520"). Undefined for any other schema, and for a oneOf two of whose branches share
 * a value (no value matches exactly one branch then, which a list of the values would not say).
 */
function choiceBranches(schema: JsonObject): unknown[] | undefined {
  const only = (node: JsonObject, keys: string[]) => Object.keys(node).every((key) => ANNOTATIONS.has(key) || key === 'type' || keys.includes(key));
  const key = Object.hasOwn(schema, 'anyOf') ? 'anyOf' : 'oneOf';
  const branches = schema[key];
  if (!Array.isArray(branches) || !only(schema, [key])) return undefined;
  const values: unknown[] = [];
  const texts = new Set<string>();
  for (const branch of branches) {
    if (!isJsonObject(branch) || !only(branch, ['const', 'enum'])) return undefined;
    if (Object.hasOwn(branch, 'const') === Object.hasOwn(branch, 'enum')) return undefined;
    const own = Object.hasOwn(branch, 'const') ? [branch.const] : enumValues(branch);
    if (own === undefined) return undefined;
    for (const value of own) {
      const text = JSON.stringify(value);
      if (texts.has(text)) {
        if (key === 'oneOf') return undefined;
        continue;
      }
      texts.add(text);
      values.push(value);
    }
  }
  return values;
}

/**
 * Values that are not all ASCII strings (numbers, mixed types, strings outside ASCII, or a prefix tree too deep) as
 * an anyOf whose every branch is a rule of its own spelling one value: {"anyOf": [{"anyOf": [{"const": 521}]}, ...]}.
 * XGrammar 0.1.27 turns a rule's alternatives into one automaton over bytes, and merges two states reached by the
 * same byte from the same state in the same pass as two states with the same way out, which together join states
 * that are neither: {"enum": [521, 600, 601]} took 520, and so did the anyOf of those consts, whose branches (a rule
 * that references no other) it copies into the anyOf's rule. A branch that is an anyOf of one const references the
 * const's rule, so it is not copied in: the enum's rule then parts on rule references, never on bytes, and each
 * value's rule is one string. (ASCII strings keep the prefix tree: one pattern, no rule per value.) Checked against
 * XGrammar's matcher over random enums of numbers, of mixed values and of strings outside ASCII: every output was
 * one of the values.
 */
function valueRules(values: unknown[]): JsonObject {
  return { anyOf: values.map((value) => ({ anyOf: [{ const: value }] })) };
}

/** The JSON text valueRules writes around each value (grammarSchemaText does not count it). */
const VALUE_RULE_OPEN = '{"anyOf":[{"const":';
const VALUE_RULE_CLOSE = '}]}';

/**
 * Characters a string enum value may hold to be written as a pattern: ASCII. A tree of values with other characters
 * is one of code points, and XGrammar's automaton works on bytes: values whose characters share UTF-8 bytes mixed
 * there too (["a中", "丁", "中"] took "a丁"); such enums get a rule per value instead (valueRules).
 */
const ASCII_ENUM_VALUE = /^[\x00-\x7f]*$/;

/**
 * An enum of ASCII strings as a pattern that is the tree of their common prefixes ("521|60(?:0|1)"): XGrammar 0.1.27
 * compiles an enum's values side by side and merges states of that automaton unsoundly ({"enum": ["521", "600",
 * "601"]} let "520" through; over random enums of short digit strings, about half let some other string through),
 * as it did guided_choice's (choiceGrammar). Written as a tree, two values share no state but that of a prefix they
 * share: no wrong string got through over thousands of random enums. Undefined (the values then get a rule each,
 * valueRules) for any other enum, or one whose tree would nest more than MAX_GROUP_DEPTH groups.
 */
export function stringEnumPattern(values: unknown): string | undefined {
  if (!Array.isArray(values) || values.length < 2) return undefined;
  if (!values.every((value) => typeof value === 'string' && ASCII_ENUM_VALUE.test(value))) return undefined;
  // The pattern is matched against the string's JSON text, escapes as written: '"', '\\' and control characters
  // as the escapes JSON.stringify writes for them (the only ones the value may then be written with).
  const texts = (values as string[]).map((value) => JSON.stringify(value).slice(1, -1));
  let deepest = 0;
  const literal = (text: string) => text.replace(/[.*+?^${}()|[\]\\\/-]/g, '\\$&');
  const tree = (group: string[], depth: number): string => {
    deepest = Math.max(deepest, depth);
    let prefix = group[0]!;
    for (const value of group) while (!value.startsWith(prefix)) prefix = prefix.slice(0, -1);
    const rests = group.map((value) => value.slice(prefix.length));
    const byFirst = new Map<string, string[]>();
    for (const rest of rests) if (rest !== '') byFirst.set(rest[0]!, [...(byFirst.get(rest[0]!) ?? []), rest]);
    if (byFirst.size === 0) return literal(prefix);
    const branches = [...byFirst.values()].map((branch) => (branch.length === 1 ? literal(branch[0]!) : tree(branch, depth + 1)));
    const optional = rests.includes('');
    const body = branches.length === 1 && !optional ? branches[0]! : `(?:${branches.join('|')})${optional ? '?' : ''}`;
    return literal(prefix) + body;
  };
  const pattern = tree([...new Set(texts)], 1);
  return deepest + 1 > MAX_GROUP_DEPTH ? undefined : pattern;
}

/**
 * JSON Schema's reading of a part no finite value satisfies (a `false` schema; one that needs such a part through a
 * required property, a '$ref', every anyOf branch or minItems; a '$ref' cycle with no way out), where the value may go
 * without it: the value leaves that part out. XGrammar (0.1.27) refuses `false` as an optional property, an
 * anyOf/oneOf branch or a prefixItems entry, so `node` (the copy of `original` the grammar is compiled from) leaves
 * such parts out itself: an anyOf/oneOf branch is dropped, an optional property too (checkLeftOut refused it beside
 * other properties allowed, which would let it back in), an array ends before such a prefixItems entry, and such a
 * schema under items, additionalProperties, unevaluatedProperties or additionalItems becomes `false` (no element, no
 * other property), which XGrammar takes. Needed parts are not touched: a schema that needs one has no value itself,
 * and is left out where it is used (checkSatisfiable refused it where it is needed).
 */
function leaveOutUnsatisfiable(node: JsonObject, original: JsonObject, has: (schema: unknown) => boolean): void {
  for (const key of SCHEMA_VALUED) {
    if (Object.hasOwn(original, key) && !Array.isArray(original[key]) && !has(original[key])) node[key] = false;
  }
  for (const key of ['anyOf', 'oneOf']) {
    const list = original[key];
    if (!Array.isArray(list)) continue;
    const kept = (node[key] as unknown[]).filter((_, i) => has(list[i]));
    if (kept.length > 0) node[key] = kept; // none: the schema has no value (left out where it is used)
  }
  const properties = original.properties;
  if (isJsonObject(properties)) {
    const required = Array.isArray(original.required) ? original.required : [];
    for (const [name, schema] of Object.entries(properties)) {
      if (!has(schema) && !required.includes(name)) delete (node.properties as JsonObject)[name];
    }
  }
  const prefix = original.prefixItems;
  if (Array.isArray(prefix)) {
    const end = prefix.findIndex((item) => !has(item));
    if (end >= 0) {
      node.prefixItems = (node.prefixItems as unknown[]).slice(0, end);
      node.items = false;
    }
  }
}

/**
 * The JSON text of a grammar schema, within MAX_GUIDED_BYTES. The wrapper valueRules puts around each value is not
 * counted: an enum counts as its values do, as the request wrote them (1024 values of 40 bytes, 43 KB, became 65 KB
 * with the wrappers, and compiled no slower than the same enum side by side).
 */
export function grammarSchemaText(schema: unknown, param: string, what = 'the schema (without its annotations)'): string {
  const text = exactJsonText(JSON.stringify(schema));
  const wrappers = text.split(VALUE_RULE_OPEN).length - 1;
  checkBytes(text, param, what, wrappers * (VALUE_RULE_OPEN.length + VALUE_RULE_CLOSE.length));
  return text;
}

/** Where a '$ref' points in its schema: the keys (array indices as digits) it steps through, and the schema there. */
interface RefTarget {
  keys: { key: string; propertyName: boolean }[];
  target: unknown;
  /**
   * Whether the grammar schema holds the target at the same keys, so that XGrammar can follow them: not when they
   * index an array (XGrammar 0.1.27 follows object keys only: "Cannot find field 1"; and an anyOf, oneOf or
   * prefixItems list loses the entries no value satisfies, or is rewritten whole), go through what is not a schema
   * (an annotation, left out) or through a key holding '/' or empty (XGrammar splits a pointer at every '/').
   */
  direct: boolean;
}

/**
 * A '$ref' target: the schema at a JSON pointer inside `root` ('#', '#/$defs/a', ...); undefined when there is none.
 * A segment is read as the URI fragment's JSON pointer says (percent-decoded, then ~1 as '/' and ~0 as '~'), or else
 * as it is written (as XGrammar reads it: '#/$defs/a~1b' reaches a definition named a~1b there). Each key says
 * whether it is a property's name (one under 'properties'), which the grammar spells otherwise.
 */
function refTarget(root: unknown, ref: string): RefTarget | undefined {
  if (ref === '#') return { keys: [], target: root, direct: true };
  type Place = 'schema' | 'map' | 'properties' | 'list' | 'value';
  const keys: RefTarget['keys'] = [];
  let node = root;
  let place: Place = 'schema';
  let direct = true;
  for (const segment of ref.slice(2).split('/')) {
    const unescape = (text: string) => text.replace(/~1/g, '/').replace(/~0/g, '~');
    let decoded: string | undefined;
    try {
      decoded = unescape(decodeURIComponent(segment));
    } catch {
      // Not percent-encoding ("%zz"): read as written.
    }
    if (Array.isArray(node) && /^\d+$/.test(segment)) {
      keys.push({ key: segment, propertyName: false });
      node = node[Number(segment)];
      place = place === 'list' ? 'schema' : 'value';
      direct = false;
      continue;
    }
    if (!isJsonObject(node)) return undefined;
    const key = [decoded, unescape(segment), segment].find((candidate) => candidate !== undefined && Object.hasOwn(node as JsonObject, candidate));
    if (key === undefined) return undefined;
    keys.push({ key, propertyName: place === 'properties' });
    const value: unknown = node[key];
    node = value;
    if (place === 'map' || place === 'properties') place = 'schema';
    else if (place !== 'schema') place = 'value';
    else if (key === 'properties') place = 'properties';
    else if (SCHEMA_MAPS.has(key)) place = 'map';
    else if (SCHEMA_LISTS.has(key) || (key === 'items' && Array.isArray(value))) place = 'list';
    else place = SCHEMA_VALUED.has(key) ? 'schema' : 'value';
    if (place === 'value' || key === '' || key.includes('/')) direct = false;
  }
  return { keys, target: node, direct };
}

function resolveRef(root: unknown, ref: string): unknown {
  return refTarget(root, ref)?.target;
}

/**
 * A '$ref' as the grammar schema holds it, for one whose target the grammar schema holds at the same keys
 * (RefTarget.direct): XGrammar 0.1.27 reads a pointer's segments as written (no ~ or percent escapes), so each key
 * goes to it as it is, a property's name spelled as the grammar spells it (spellPropertyNames: '#/properties/a"b'
 * pointed nowhere once that name was a\\\"b).
 */
function grammarRef(root: unknown, ref: string): string {
  const found = refTarget(root, ref);
  if (found === undefined || found.keys.length === 0) return ref;
  return `#/${found.keys.map(({ key, propertyName }) => (propertyName ? propertyNameSpelling(key) : key)).join('/')}`;
}

/** A '$ref' whose target is not a schema of `root` (checkJsonSchema): a 400 at `at`. */
function checkRef(root: unknown, ref: string, at: string): void {
  const found = refTarget(root, ref);
  if (found === undefined) throw new InvalidValueError(at, `the reference ${JSON.stringify(ref)} points to nothing in the schema.`);
  if (typeof found.target !== 'boolean' && !isJsonObject(found.target)) {
    throw new InvalidValueError(at, `the reference ${JSON.stringify(ref)} points to ${JSON.stringify(found.target)}, which is not a schema.`);
  }
}

/**
 * The targets of the '$ref's XGrammar could not follow as written (RefTarget.direct: through an array, an annotation,
 * a key holding '/'), each given a name under the root's '$defs' that the '$ref' points to instead; by target, each
 * once, so that a reference to a reference's own target stays a cycle. A copy of the target goes into the grammar
 * schema there, rewritten as any schema is, while the list it came from may lose or rewrite entries.
 */
function hoistedRefs(root: unknown): Map<string, { name: string; target: unknown }> {
  const byRef = new Map<string, { name: string; target: unknown }>();
  if (!isJsonObject(root)) return byRef;
  const taken = new Set(isJsonObject(root.$defs) ? Object.keys(root.$defs) : []);
  const byTarget = new Map<unknown, { name: string; target: unknown }>();
  mapSchemas(root, (node) => {
    if (typeof node.$ref !== 'string' || byRef.has(node.$ref)) return node;
    const found = refTarget(root, node.$ref);
    if (found === undefined || found.direct) return node;
    let hoisted = byTarget.get(found.target);
    if (hoisted === undefined) {
      let name = `ref_${byTarget.size}`;
      while (taken.has(name)) name += '_';
      taken.add(name);
      hoisted = { name, target: found.target };
      byTarget.set(found.target, hoisted);
    }
    byRef.set(node.$ref, hoisted);
    return node;
  });
  return byRef;
}

/**
 * Refuses a schema no finite value satisfies, as XGrammar reads it: `false` itself; one whose every value must
 * contain itself through '$ref' (a required property, an array's minItems, every anyOf branch leading back), so that
 * the grammar never ends; or that requires a property it forbids (a `false` schema). Not complete: types, bounds and
 * enums that contradict each other otherwise are XGrammar's to refuse, or go through (docs/structured-outputs.md).
 *
 * Which schemas have a finite value: finiteSchemas. If the root has none, a walk down the parts it needs names the
 * place: where it comes back to a schema on its way (the cycle), or a `false` schema. If it has one, such parts where
 * a value may go without them are left out of the grammar (leaveOutUnsatisfiable), except an optional property beside
 * other properties allowed, refused (checkLeftOut).
 */
function checkSatisfiable(root: unknown, path: string): void {
  if (root === false) throw new InvalidValueError(path, 'the schema is false: no value can satisfy it.');
  const has = finiteSchemas(root);
  if (has(root)) {
    checkLeftOut(root, path, has);
    return;
  }
  // Down from the root through a part that has no finite value, to a false schema or a '$ref' leading back.
  const onWay = new Set<unknown>([root]);
  let node = root as JsonObject;
  let at = path;
  for (;;) {
    const [part] = needs(node, root).find((options) => !options.some(({ schema }) => has(schema)))!;
    const ref = part!.at === '$ref' ? node.$ref as string : undefined;
    const partAt = childPath(at, part!.at);
    if (part!.schema === false) {
      throw new InvalidValueError(partAt, 'a value is needed here (a required property, an item under minItems, every anyOf/oneOf '
        + 'branch) but its schema is false: no value can satisfy the schema.');
    }
    if (onWay.has(part!.schema)) {
      throw new InvalidValueError(partAt, 'no finite value satisfies the schema: this reference leads back to a schema whose every value '
        + 'needs it again (through required properties, minItems, or every anyOf branch), so the output could never end; make the '
        + 'recursion optional somewhere.');
    }
    onWay.add(part!.schema);
    node = part!.schema as JsonObject;
    at = ref === undefined ? partAt : pointerPath(path, root, ref);
  }
}

/**
 * Which schemas of `root`'s document have a finite value (a predicate on them; booleans and non-schemas too: `false`
 * has none, `true` any value). A least fixed point over the schemas in the document: a schema has a finite value
 * once the parts it needs have one (a '$ref' not found counts as satisfiable, XGrammar refuses it).
 */
function finiteSchemas(root: unknown): (schema: unknown) => boolean {
  const nodes: JsonObject[] = [];
  const seen = new Set<JsonObject>();
  const visit = (schema: unknown): void => {
    if (!isJsonObject(schema) || seen.has(schema)) return;
    seen.add(schema);
    for (const [key, value] of Object.entries(schema)) {
      if (SCHEMA_VALUED.has(key)) (Array.isArray(value) ? value : [value]).forEach(visit);
      else if (SCHEMA_LISTS.has(key) && Array.isArray(value)) value.forEach(visit);
      else if (SCHEMA_MAPS.has(key) && isJsonObject(value)) Object.values(value).forEach(visit);
    }
    if (typeof schema.$ref === 'string') visit(resolveRef(root, schema.$ref));
    nodes.push(schema); // after its parts: most fixed points are reached in one pass
  };
  visit(root);
  const finite = new Set<JsonObject>();
  const has = (schema: unknown): boolean => schema === false ? false : !isJsonObject(schema) || finite.has(schema);
  for (let changed = true; changed;) {
    changed = false;
    for (const node of nodes) {
      if (!finite.has(node) && needs(node, root).every((group) => group.some(({ schema }) => has(schema)))) {
        finite.add(node);
        changed = true;
      }
    }
  }
  return has;
}

/**
 * Refuses an optional property no finite value satisfies (a `false` one: the property must not appear) in an object
 * schema that allows other properties (additionalProperties, or else unevaluatedProperties, neither false): the
 * grammar leaves the property out of 'properties' (leaveOutUnsatisfiable), and XGrammar would then let it in as one
 * of the others, with any value. Walks the schema's own tree (not through '$ref'), naming the place.
 */
function checkLeftOut(schema: unknown, path: string, has: (schema: unknown) => boolean): void {
  if (!isJsonObject(schema)) return;
  const properties = schema.properties;
  const others = schema.additionalProperties !== undefined ? schema.additionalProperties : schema.unevaluatedProperties;
  const types = schemaTypes(schema);
  if (isJsonObject(properties) && others !== undefined && has(others) && (types === undefined || types.includes('object'))) {
    const required = Array.isArray(schema.required) ? schema.required : [];
    for (const [name, property] of Object.entries(properties)) {
      if (has(property) || required.includes(name)) continue;
      const key = schema.additionalProperties !== undefined ? 'additionalProperties' : 'unevaluatedProperties';
      throw new UnsupportedFieldError(childPath(childPath(path, 'properties'), name), `no value satisfies this property's schema, so the `
        + `property must not appear; beside ${key} that allows other properties the grammar engine cannot keep it out (it would `
        + `come back as another property, with any value). Set ${key} to false, or leave the property out.`);
    }
  }
  for (const [key, value] of Object.entries(schema)) {
    const at = childPath(path, key);
    if (SCHEMA_VALUED.has(key)) {
      if (Array.isArray(value)) value.forEach((item, i) => checkLeftOut(item, childPath(at, i), has));
      else checkLeftOut(value, at, has);
    } else if (SCHEMA_LISTS.has(key) && Array.isArray(value)) {
      value.forEach((item, i) => checkLeftOut(item, childPath(at, i), has));
    } else if (SCHEMA_MAPS.has(key) && isJsonObject(value)) {
      for (const [name, item] of Object.entries(value)) checkLeftOut(item, childPath(at, name), has);
    }
  }
}

/** Where a '$ref' points, as a request path from the schema's own (`path`). */
function pointerPath(path: string, root: unknown, ref: string): string {
  const keys = refTarget(root, ref)?.keys.map(({ key }) => key) ?? (ref === '#' ? [] : ref.slice(2).split('/'));
  return keys.reduce((at, key) => childPath(at, /^\d+$/.test(key) ? Number(key) : key), path);
}

/**
 * What a schema needs to have a value, for checkSatisfiable: groups of parts, each group satisfied by any one of its
 * parts (every group needed), each part with its path relative to the schema. Over-approximates what is satisfiable:
 * only what surely has no value is left unsatisfied.
 */
function needs(schema: JsonObject, root: unknown): { schema: unknown; at: string }[][] {
  const groups: { schema: unknown; at: string }[][] = [];
  if (typeof schema.$ref === 'string') {
    const target = resolveRef(root, schema.$ref);
    if (target !== undefined) groups.push([{ schema: target, at: '$ref' }]);
  }
  if (schema.enum !== undefined || schema.const !== undefined) return groups;
  for (const key of ['anyOf', 'oneOf']) {
    const list = schema[key];
    if (Array.isArray(list) && list.length > 0) groups.push(list.map((item, i) => ({ schema: item, at: `${key}[${i}]` })));
  }
  const types = schemaTypes(schema) ?? (schema.properties !== undefined || schema.required !== undefined ? ['object'] : undefined);
  if (types === undefined || types.some((type) => type !== 'object' && type !== 'array')) return groups;
  // Objects and arrays only: what the type needs, when the schema allows no other type.
  const options: { schema: unknown; at: string }[][] = [];
  if (types.includes('object')) {
    const properties = isJsonObject(schema.properties) ? schema.properties : {};
    const required = Array.isArray(schema.required) ? schema.required.filter((name): name is string => typeof name === 'string') : [];
    options.push(required.filter((name) => Object.hasOwn(properties, name)).map((name) => ({ schema: properties[name], at: `properties.${name}` })));
  }
  if (types.includes('array')) {
    const minItems = typeof schema.minItems === 'number' ? schema.minItems : 0;
    const prefix = Array.isArray(schema.prefixItems) ? schema.prefixItems : Array.isArray(schema.items) ? schema.items : [];
    const key = Array.isArray(schema.prefixItems) ? 'prefixItems' : 'items';
    const parts = prefix.slice(0, minItems).map((item, i) => ({ schema: item, at: `${key}[${i}]` }));
    if (minItems > prefix.length && !Array.isArray(schema.items) && schema.items !== undefined) parts.push({ schema: schema.items, at: 'items' });
    options.push(parts);
  }
  // With both types allowed, either one's needs will do: only a single type's needs are kept (as groups of one).
  if (options.length === 1) for (const part of options[0]!) groups.push([part]);
  return groups;
}

/**
 * A value read with exact numbers (TemplateNumber: parseJsonExactNumbers, exactBodyField) with its integers past 2^53
 * as ExactIntegers and every other number a number; undefined when it holds no such integer.
 */
export function exactIntegers(value: unknown): unknown {
  let found = false;
  const exact = (item: unknown): unknown => {
    if (item instanceof TemplateNumber) {
      if (!item.isInteger || Number.isSafeInteger(item.value)) return item.value;
      found = true;
      return new ExactInteger(item.text);
    }
    if (Array.isArray(item)) return item.map(exact);
    if (isJsonObject(item)) return Object.fromEntries(Object.entries(item).map(([key, inner]) => [key, exact(inner)]));
    return item;
  };
  const out = exact(value);
  return found ? out : undefined;
}

/** Whether JSON.parse's value holds an integer past 2^53, which it rounded (1234567890123456789 to ...800). */
function holdsLargeIntegers(value: unknown, depth = 0): boolean {
  if (typeof value === 'number') return Number.isInteger(value) && !Number.isSafeInteger(value);
  if (typeof value !== 'object' || value === null || depth > MAX_SCHEMA_DEPTH * 4) return false;
  return (Array.isArray(value) ? value : Object.values(value)).some((item) => holdsLargeIntegers(item, depth + 1));
}

/**
 * A json_schema spec. The grammar is compiled from the schema with its integers past 2^53 spelled as the request
 * wrote them (an enum of 1234567890123456789 was produced as 1234567890123456800, as JSON.parse had read it):
 * `exact` reads the schema again from the request's text with exact numbers, when it holds such an integer.
 */
function jsonSchemaSpec(param: string, value: unknown, exact: () => unknown): GuidedDecoding {
  let schema = value;
  if (typeof value === 'string') {
    try {
      schema = JSON.parse(value);
    } catch (error) {
      throw new InvalidValueError(param, `the schema is not valid JSON: ${(error as Error).message}`);
    }
  }
  // Checked first: the exact reading below walks the schema (and, for a field of the body, the whole body) again.
  checkJsonSchema(schema, param);
  const spelled = holdsLargeIntegers(schema) ? exactIntegers(typeof value === 'string' ? parseJsonExactNumbers(value) : exact()) : undefined;
  return { kind: 'json_schema', schema: grammarSchemaText(grammarSchema(spelled ?? schema), param) };
}

/** A field of the request body read again with exact numbers (exactBodyField), then down `keys`. */
function exactField(fields: Fields, name: string, ...keys: string[]): unknown {
  let value = exactBodyField(fields.object, name, fields.raw(name));
  for (const key of keys) value = isJsonObject(value) ? value[key] : undefined;
  return value;
}

/** A UTF-16 surrogate without its pair (a paired one is part of a code point outside Cs under the u flag). */
const LONE_SURROGATE = /\p{Cs}/u;

function choiceSpec(param: string, value: unknown): GuidedDecoding {
  const choices = readArray(param, value, { nonEmpty: true, maxItems: MAX_GUIDED_CHOICES })
    .map((choice, i) => readString(childPath(param, i), choice, { nonEmpty: true }));
  // JSON's "\ud800" escape can write half of a surrogate pair, which is no character: XGrammar spelled it as the
  // bytes ED A0 80, which decode as three U+FFFD, so the output was none of the choices.
  choices.forEach((choice, i) => {
    if (LONE_SURROGATE.test(choice)) {
      throw new InvalidValueError(childPath(param, i), 'the choice holds a lone UTF-16 surrogate (half of a surrogate pair), which no '
        + 'UTF-8 output can spell. Send whole characters.');
    }
  });
  checkBytes(choices.join(''), param, 'the choices together');
  return { kind: 'choice', choices };
}

function regexSpec(param: string, pattern: string): GuidedDecoding {
  checkBytes(pattern, param, 'the regex');
  checkGroupDepth(pattern, 'regex', param);
  checkCharacterClasses(pattern, 'regex', param);
  return { kind: 'regex', pattern: shorthandClasses(pattern) };
}

function grammarSpec(param: string, ebnf: string): GuidedDecoding {
  checkBytes(ebnf, param, 'the grammar');
  checkGroupDepth(ebnf, 'ebnf', param);
  checkCharacterClasses(ebnf, 'ebnf', param);
  return { kind: 'grammar', ebnf };
}

function readResponseFormat(fields: Fields): GuidedRequest | undefined {
  const format = fields.fields('response_format');
  if (!format) return undefined;
  const type = readString(format.path('type'), format.required('type'));
  switch (type) {
    case 'text':
      return undefined;
    case 'json_object':
      return { spec: { kind: 'json_object' }, param: format.path('type') };
    case 'json_schema': {
      const jsonSchema = format.fields('json_schema');
      if (!jsonSchema) throw new InvalidValueError(format.path('json_schema'), "response_format of type 'json_schema' needs a json_schema object.");
      readString(jsonSchema.path('name'), jsonSchema.required('name'), { nonEmpty: true, maxLength: 64 });
      jsonSchema.boolean('strict');
      // OpenAI's default schema is an empty one (any JSON); absent means that here too.
      const schema = jsonSchema.has('schema') ? readObject(jsonSchema.path('schema'), jsonSchema.raw('schema')) : {};
      return { spec: jsonSchemaSpec(jsonSchema.path('schema'), schema, () => exactField(fields, 'response_format', 'json_schema', 'schema')),
        param: jsonSchema.path('schema') };
    }
    default:
      throw new InvalidValueError(format.path('type'), `unknown response format '${type}'; expected text, json_object or json_schema.`);
  }
}

/**
 * vLLM's fields for what this server's grammars do not offer: refused rather than ignored, since a request that
 * relies on one would run without it. (vLLM's guided_decoding_backend is accepted and ignored: one backend here.)
 */
const WHITESPACE_PATTERN = 'a custom whitespace pattern is not supported; JSON whitespace is bounded, and '
  + 'structured_outputs.disable_any_whitespace makes it compact.';
const UNSUPPORTED_STRUCTURED: Record<string, string> = {
  structural_tag: 'structural tags are not supported; use json, regex, choice or grammar.',
  whitespace_pattern: WHITESPACE_PATTERN,
};

/** vLLM's guided_* fields and structured_outputs, each into a spec. */
function readVllmGuided(fields: Fields): GuidedRequest[] {
  const found: GuidedRequest[] = [];
  if (fields.has('guided_whitespace_pattern')) throw new UnsupportedFieldError('guided_whitespace_pattern', WHITESPACE_PATTERN);
  if (fields.has('guided_json')) {
    found.push({ spec: jsonSchemaSpec('guided_json', fields.raw('guided_json'), () => exactField(fields, 'guided_json')), param: 'guided_json' });
  }
  if (fields.has('guided_regex')) {
    found.push({ spec: regexSpec('guided_regex', fields.string('guided_regex', { nonEmpty: true })!), param: 'guided_regex' });
  }
  if (fields.has('guided_choice')) found.push({ spec: choiceSpec('guided_choice', fields.raw('guided_choice')), param: 'guided_choice' });
  if (fields.has('guided_grammar')) {
    found.push({ spec: grammarSpec('guided_grammar', fields.string('guided_grammar', { nonEmpty: true })!), param: 'guided_grammar' });
  }
  const structured = fields.fields('structured_outputs');
  if (structured) {
    for (const [key, reason] of Object.entries(UNSUPPORTED_STRUCTURED)) {
      if (structured.has(key)) throw new UnsupportedFieldError(structured.path(key), reason);
    }
    if (structured.has('json')) {
      const spec = jsonSchemaSpec(structured.path('json'), structured.raw('json'), () => exactField(fields, 'structured_outputs', 'json'));
      found.push({ spec, param: structured.path('json') });
    }
    if (structured.has('regex')) {
      found.push({ spec: regexSpec(structured.path('regex'), structured.string('regex', { nonEmpty: true })!), param: structured.path('regex') });
    }
    if (structured.has('choice')) found.push({ spec: choiceSpec(structured.path('choice'), structured.raw('choice')), param: structured.path('choice') });
    if (structured.has('grammar')) {
      found.push({ spec: grammarSpec(structured.path('grammar'), structured.string('grammar', { nonEmpty: true })!), param: structured.path('grammar') });
    }
    if (structured.boolean('json_object')) found.push({ spec: { kind: 'json_object' }, param: structured.path('json_object') });
  }
  return found;
}

/**
 * The one guided-decoding constraint a request sets, if any; two at once is a 400 naming the second. vLLM's
 * structured_outputs.disable_any_whitespace makes JSON compact (no whitespace but a space after ',' and ':').
 */
export function readGuided(fields: Fields): GuidedRequest | undefined {
  const found = [readResponseFormat(fields), ...readVllmGuided(fields)].filter((g): g is GuidedRequest => g !== undefined);
  if (found.length > 1) {
    throw new InvalidValueError(found[1]!.param, `only one output constraint may be given; ${found[0]!.param} is set already.`);
  }
  const guided = found[0];
  const compact = fields.fields('structured_outputs')?.boolean('disable_any_whitespace') ?? false;
  if (guided && compact && (guided.spec.kind === 'json_schema' || guided.spec.kind === 'json_object')) {
    return { ...guided, spec: { ...guided.spec, compact: true } };
  }
  return guided;
}

/**
 * Compiles guided requests' grammars (without a vocabulary) on the gateway's XGrammar instance, started on first use.
 * A grammar XGrammar refuses is a 400 naming the field. Such a refusal aborts the instance, so the next check starts
 * a fresh one (a new instance of the module compiled once); checks run one at a time, so concurrent bad
 * grammars never hold more than one instance between them, and verdicts are remembered by grammar (bounded), so a
 * repeated bad grammar is refused without touching XGrammar.
 *
 * Only verdicts from a sound instance are remembered. An instance that fails without XGrammar's own diagnosis of the
 * input (a trap, a C++ exception: its memory may have been spoilt by an earlier check, one that passed) takes the
 * verdicts it gave with it, and the grammar it failed on is checked again on a fresh instance: what that one says
 * is the verdict, remembered unless it too fails undiagnosed (then the grammar is refused, and checked again next
 * time).
 */
export class GuidedChecker {
  private instance: CheckerInstance | undefined;
  /**
   * Verdicts by grammar source (undefined for good, the reason for bad) and the instance each came from (its number:
   * a failed instance is not kept alive by them); oldest first.
   */
  private readonly verdicts = new Map<string, { verdict: string | undefined; from: number }>();
  private instances = 0;
  /** The check in progress (each waits for the one before it). */
  private queue: Promise<unknown> = Promise.resolve();
  static readonly MAX_VERDICTS = 4096;

  async check(guided: GuidedRequest): Promise<void> {
    const source = grammarSource(guided.spec);
    const key = JSON.stringify(source);
    let verdict = this.verdicts.get(key)?.verdict;
    if (!this.verdicts.has(key)) {
      const run = this.queue.then(() => this.verdicts.has(key) ? this.verdicts.get(key)!.verdict : this.compile(key, source, guided.param));
      this.queue = run.catch(() => {});
      verdict = await run;
    }
    if (verdict !== undefined) throw new InvalidValueError(guided.param, verdict);
  }

  /** Whether a verdict on this request's grammar is remembered (a check of it would not compile it). */
  remembered(guided: GuidedRequest): boolean {
    return this.verdicts.has(JSON.stringify(grammarSource(guided.spec)));
  }

  /** Compiles one grammar: its verdict, remembered when it can be trusted; throws only when XGrammar is unavailable. */
  private async compile(key: string, source: GrammarSource, param: string): Promise<string | undefined> {
    for (let attempt = 0; ; attempt++) {
      const instance = this.instance ??= { xg: XGrammar.load(), checks: 0, id: ++this.instances };
      let xg: XGrammar;
      try {
        xg = await instance.xg;
      } catch (error) {
        if (this.instance === instance) this.instance = undefined;
        throw new UnsupportedFieldError(param, `guided decoding is unavailable: ${(error as Error).message}`);
      }
      instance.checks++;
      try {
        parseGrammar(xg, source);
      } catch (error) {
        if (!(error instanceof GrammarError)) throw error;
        this.instance = undefined; // failed: the next check starts a fresh instance
        if (error.diagnosed) return this.remember(key, error.message, instance.id);
        for (const [held, { from }] of this.verdicts) if (from === instance.id) this.verdicts.delete(held);
        if (instance.checks > 1 && attempt === 0) continue; // it had checked others before: once more on a fresh one
        return error.message;
      }
      return this.remember(key, undefined, instance.id);
    }
  }

  private remember(key: string, verdict: string | undefined, from: number): string | undefined {
    if (this.verdicts.size >= GuidedChecker.MAX_VERDICTS) this.verdicts.delete(this.verdicts.keys().next().value!);
    this.verdicts.set(key, { verdict, from });
    return verdict;
  }
}

/** The gateway's XGrammar instance, how many checks it has run and its number. */
interface CheckerInstance {
  xg: Promise<XGrammar>;
  checks: number;
  id: number;
}
