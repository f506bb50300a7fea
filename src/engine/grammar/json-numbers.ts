// Numbers in a JSON schema's enum and const values, written as JSON writes them. XGrammar (0.1.27) writes such a
// value into its grammar through picojson, which spells a number that is not an integer below 2^53 with 17
// significant digits: {"const": 2.39} produced 2.3900000000000001, 1e-7 9.9999999999999995e-08, 1e20 1e+20; the
// same number to a JSON parser, but not the text the request wrote. No schema spells a decimal otherwise, so such a
// value goes to XGrammar as a string of its own (a placeholder), and the placeholder's literal in the EBNF XGrammar
// makes of the schema is replaced by the number's shortest JSON text (JSON.stringify's) before the grammar is
// compiled. Integers below 2^53 come out as written already and are left alone (the grammar then is XGrammar's own).
// An integer past 2^53 keeps its digits as the schema's text writes them: JSON.parse would round 1234567890123456789
// to 1234567890123456800 (Python's json, and so vLLM's schema, keeps it exact). Schema objects built from a request
// (which JSON.parse has read) hold such an integer as an ExactInteger, whose JSON text is its digits (exactJsonText).

/** Keywords whose value is a schema, a list of schemas or a map of schemas (where enum and const are looked for). */
const SCHEMA_VALUED = new Set(['items', 'additionalProperties', 'unevaluatedProperties', 'additionalItems']);
const SCHEMA_LISTS = new Set(['anyOf', 'oneOf', 'allOf', 'prefixItems']);
const SCHEMA_MAPS = new Set(['properties', '$defs', 'definitions']);

type Json = null | boolean | number | string | Json[] | { [key: string]: Json };

const isObject = (value: Json): value is { [key: string]: Json } => typeof value === 'object' && value !== null && !Array.isArray(value);

/**
 * An integer past 2^53 in a schema object, as the request wrote it (a JavaScript number would round it). JSON.stringify
 * writes it as a marked string, which exactJsonText turns back into its digits.
 */
export class ExactInteger {
  constructor(readonly digits: string) {}
  toJSON(): string {
    return `${EXACT_INTEGER_MARK}${this.digits}`;
  }
}

/** Marks an ExactInteger in JSON text; a NUL and a random part no request's text can hold. */
const EXACT_INTEGER_MARK = `\u0000exact-integer-${crypto.randomUUID()}-`;
const EXACT_INTEGER_TEXT = new RegExp(`${JSON.stringify(EXACT_INTEGER_MARK).slice(0, -1).replace(/[\\\-]/g, '\\$&')}(-?[0-9]+)"`, 'g');

/** JSON text made by JSON.stringify with every ExactInteger written as its digits. */
export function exactJsonText(text: string): string {
  return text.includes('exact-integer-') ? text.replace(EXACT_INTEGER_TEXT, '$1') : text;
}

/** Strings first, so digits inside them are skipped; then number literals. */
const JSON_TOKEN = /"(?:[^"\\]|\\.)*"|-?\d+(?:\.\d+)?(?:[eE][+-]?\d+)?/g;

/** A schema with its enum and const numbers as placeholders, and each placeholder's number text. */
export interface SpelledNumbers {
  schema: string;
  /** Placeholder (a string value in `schema`) to the JSON text of the number it stands for. */
  numbers: Record<string, string>;
}

/**
 * The schema text with every enum or const number XGrammar would respell (not an integer of magnitude below 2^53)
 * replaced by a placeholder string; undefined when there is none (or the text is not JSON: XGrammar's to refuse).
 * Placeholders are made of a stem the schema's text does not hold, so no string of the schema is taken for one.
 */
export function spellNumbers(schemaText: string): SpelledNumbers | undefined {
  // No number in the text but integers below 2^53 (at most 16 digits): nothing to do, without parsing it.
  if (!/[0-9][.eE]|[0-9]{16}/.test(schemaText)) return undefined;
  let stem = 'jsonnumber';
  while (schemaText.includes(stem)) stem += 'x';
  // Integers past 2^53 read as marked strings holding their digits, so that JSON.parse does not round them.
  const integers: string[] = [];
  const integerMark = `${stem}_integer_`;
  const marked = schemaText.replace(JSON_TOKEN, (token) => {
    if (token.startsWith('"') || /[.eE]/.test(token) || Number.isSafeInteger(Number(token))) return token;
    integers.push(BigInt(token).toString());
    return JSON.stringify(`${integerMark}${integers.length - 1}`);
  });
  const integerText = (item: Json): string | undefined => (typeof item === 'string' && item.startsWith(integerMark)
    ? integers[Number(item.slice(integerMark.length))] : undefined);
  let schema: Json;
  try {
    schema = JSON.parse(marked) as Json;
  } catch {
    return undefined;
  }
  const numbers: Record<string, string> = {};
  /** A value outside enum and const: its integers past 2^53 back as numbers (as JSON.parse reads them). */
  const restore = (item: Json): Json => {
    const integer = integerText(item);
    if (integer !== undefined) return Number(integer);
    if (Array.isArray(item)) return item.map(restore);
    if (isObject(item)) return Object.fromEntries(Object.entries(item).map(([key, inner]) => [key, restore(inner)]));
    return item;
  };
  const value = (item: Json): Json => {
    const integer = integerText(item);
    if (integer !== undefined) {
      const placeholder = `${stem}_${Object.keys(numbers).length}_`;
      numbers[placeholder] = integer;
      return placeholder;
    }
    if (typeof item === 'number') {
      if (Number.isSafeInteger(item)) return item;
      const placeholder = `${stem}_${Object.keys(numbers).length}_`;
      numbers[placeholder] = JSON.stringify(item);
      return placeholder;
    }
    if (Array.isArray(item)) return item.map(value);
    if (isObject(item)) return Object.fromEntries(Object.entries(item).map(([key, inner]) => [key, value(inner)]));
    return item;
  };
  const walk = (node: Json): Json => {
    if (!isObject(node)) return node;
    const out: { [key: string]: Json } = {};
    for (const [key, item] of Object.entries(node)) {
      if (key === 'const') out[key] = value(item);
      else if (key === 'enum' && Array.isArray(item)) out[key] = item.map(value);
      else if (SCHEMA_VALUED.has(key)) out[key] = Array.isArray(item) ? item.map(walk) : walk(item);
      else if (SCHEMA_LISTS.has(key) && Array.isArray(item)) out[key] = item.map(walk);
      else if (SCHEMA_MAPS.has(key) && isObject(item)) out[key] = Object.fromEntries(Object.entries(item).map(([name, inner]) => [name, walk(inner)]));
      else out[key] = restore(item);
    }
    return out;
  };
  const spelled = walk(schema);
  return Object.keys(numbers).length === 0 ? undefined : { schema: JSON.stringify(spelled), numbers };
}

/**
 * XGrammar's EBNF of the placeholder schema with each placeholder's JSON string (\"stem_0_\" inside a literal)
 * replaced by its number's text. A placeholder may be missing (a value in a definition nothing references).
 */
export function withNumbers(ebnf: string, numbers: Record<string, string>): string {
  let out = ebnf;
  for (const [placeholder, text] of Object.entries(numbers)) out = out.split(`\\"${placeholder}\\"`).join(text);
  return out;
}
