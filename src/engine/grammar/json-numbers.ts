// Numbers in a JSON schema's enum and const values, written as JSON writes them. XGrammar (0.1.27) writes such a
// value into its grammar through picojson, which spells a number that is not an integer below 2^53 with 17
// significant digits: {"const": 2.39} produced 2.3900000000000001, 1e-7 9.9999999999999995e-08, 1e20 1e+20; the
// same number to a JSON parser, but not the text the request wrote. No schema spells a decimal otherwise, so such a
// value goes to XGrammar as a string of its own (a placeholder), and the placeholder's literal in the EBNF XGrammar
// makes of the schema is replaced by the number's shortest JSON text (JSON.stringify's) before the grammar is
// compiled. Integers below 2^53 come out as written already and are left alone (the grammar then is XGrammar's own).

/** Keywords whose value is a schema, a list of schemas or a map of schemas (where enum and const are looked for). */
const SCHEMA_VALUED = new Set(['items', 'additionalProperties', 'unevaluatedProperties', 'additionalItems']);
const SCHEMA_LISTS = new Set(['anyOf', 'oneOf', 'allOf', 'prefixItems']);
const SCHEMA_MAPS = new Set(['properties', '$defs', 'definitions']);

type Json = null | boolean | number | string | Json[] | { [key: string]: Json };

const isObject = (value: Json): value is { [key: string]: Json } => typeof value === 'object' && value !== null && !Array.isArray(value);

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
  let schema: Json;
  try {
    schema = JSON.parse(schemaText) as Json;
  } catch {
    return undefined;
  }
  let stem = 'jsonnumber';
  while (schemaText.includes(stem)) stem += 'x';
  const numbers: Record<string, string> = {};
  const value = (item: Json): Json => {
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
      else out[key] = item;
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
