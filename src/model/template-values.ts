// Numbers in the values a chat template renders, printed as Hugging Face's Python renderer prints them.
//
// A tool call's `arguments` is JSON text that the template gets parsed (templates write it back with `| tojson`).
// Parsed into JavaScript numbers, 1234567890123456789 became 1234567890123456800 and 1.0 became 1 in the prompt;
// Python's json keeps integers exact and floats as floats, so vLLM's prompt has the text the client sent. Here such
// text is parsed into TemplateNumber values, and the template engine (@huggingface/jinja, which prints numbers as
// JavaScript does and offers no hook for it) is run with number values that print the exact text, in `{{ }}`,
// `| string` and `| tojson` alike. They still compare and compute as the nearest double.
//
// The interpreter is the library's with what Python's Jinja does differently put back (see ExactNumberInterpreter):
// values printed as Python's str(), tojson as transformers' json.dumps, Python's strip, `'%s' % x` formatting, and a
// bound on the steps of one rendering.

import { Environment, Interpreter, type Template } from '@huggingface/jinja';

/** A JSON number as Python's json module reads it: exact integer digits, or a float printed as repr() prints it. */
export class TemplateNumber {
  /** The text Python prints for it (str(), repr() and json.dumps() agree for int and float). */
  readonly text: string;
  readonly value: number;
  readonly isInteger: boolean;

  constructor(literal: string) {
    this.isInteger = !/[.eE]/.test(literal);
    this.value = Number(literal);
    this.text = this.isInteger ? BigInt(literal).toString() : pythonFloatText(this.value);
  }
}

/**
 * Python's repr() of a float: the shortest digits that read back to it (as JavaScript's), written in fixed notation
 * when the decimal point falls within 16 digits and with at least one decimal ("1.0"), else in exponent notation
 * with a signed two-digit exponent ("1e+16", "1.5e-07"). json.dumps writes infinities as Infinity.
 */
export function pythonFloatText(value: number): string {
  if (Number.isNaN(value)) return 'NaN';
  if (!Number.isFinite(value)) return value > 0 ? 'Infinity' : '-Infinity';
  const sign = value < 0 || Object.is(value, -0) ? '-' : '';
  const [mantissa, exponentText] = Math.abs(value).toExponential().split('e') as [string, string];
  const digits = mantissa.replace('.', '');
  const exponent = Number(exponentText);
  const point = exponent + 1; // digits before the decimal point
  if (point > -4 && point <= 16) {
    if (point <= 0) return `${sign}0.${'0'.repeat(-point)}${digits}`;
    if (point >= digits.length) return `${sign}${digits}${'0'.repeat(point - digits.length)}.0`;
    return `${sign}${digits.slice(0, point)}.${digits.slice(point)}`;
  }
  const fraction = digits.length > 1 ? `.${digits.slice(1)}` : '';
  const exponentSign = exponent < 0 ? '-' : '+';
  return `${sign}${digits[0]}${fraction}e${exponentSign}${String(Math.abs(exponent)).padStart(2, '0')}`;
}

// Strings first, so digits inside them are skipped; then number literals.
const JSON_TOKEN = /"(?:[^"\\]|\\.)*"|-?\d+(?:\.\d+)?(?:[eE][+-]?\d+)?/g;

/** Marks a number's place while JSON.parse reads the rest; a NUL and a random part no client text can guess. */
const NUMBER_MARK = `\u0000number-${crypto.randomUUID()}-`;

/**
 * JSON text to a value, as JSON.parse reads it but with every number a TemplateNumber. Throws as JSON.parse does on
 * text that is not JSON.
 */
export function parseJsonExactNumbers(text: string): unknown {
  JSON.parse(text); // the same refusal, and the same message, as before for text that is not JSON
  const literals: string[] = [];
  const marked = text.replace(JSON_TOKEN, (token) => {
    if (token.startsWith('"')) return token;
    literals.push(token);
    return JSON.stringify(NUMBER_MARK + (literals.length - 1));
  });
  const restore = (value: unknown): unknown =>
    typeof value === 'string' && value.startsWith(NUMBER_MARK) ? new TemplateNumber(literals[Number(value.slice(NUMBER_MARK.length))]!) : value;
  // Walked with a list, not recursion: the text is a whole request body, which may nest deeper than the stack goes
  // in a field whose own depth check comes later (the parse is of the body, not of the field asked for).
  const root = restore(JSON.parse(marked));
  const pending: object[] = typeof root === 'object' && root !== null && !(root instanceof TemplateNumber) ? [root] : [];
  while (pending.length > 0) {
    const node = pending.pop() as Record<string, unknown>;
    for (const key of Object.keys(node)) {
      const item = node[key];
      const restored = restore(item);
      if (restored !== item) node[key] = restored;
      else if (typeof item === 'object' && item !== null) pending.push(item);
    }
  }
  return root;
}

// ---------------------------------------------------------------------------------------------------------------
// Rendering

/**
 * The library's runtime value classes, which it does not export: read off the values its Environment makes. The
 * type is loose on purpose (the classes' declarations are not exported either).
 */
type RuntimeValueClass = new (value?: unknown) => { value: unknown; type: string; toString(): string };
const probe = new Environment();
const runtimeClass = (value: unknown, name: string): RuntimeValueClass => {
  const made = probe.set(`__probe_${name}`, value) as unknown as { constructor: RuntimeValueClass; type: string };
  if (made.type !== name) throw new Error(`@huggingface/jinja made a ${made.type} where a ${name} was expected`);
  return made.constructor;
};
const IntegerValue = runtimeClass(1, 'IntegerValue');
const FloatValue = runtimeClass(1.5, 'FloatValue');
const StringValue = runtimeClass('', 'StringValue');
const ArrayValue = runtimeClass([], 'ArrayValue');
const ObjectValue = runtimeClass({}, 'ObjectValue');
const FunctionValue = runtimeClass(() => undefined, 'FunctionValue');

/** A number that prints the text it was written with (the nearest double stays its value for arithmetic). */
class ExactIntegerValue extends IntegerValue {
  constructor(readonly number: TemplateNumber) { super(number.value); }
  override toString(): string { return this.number.text; }
}
class ExactFloatValue extends FloatValue {
  constructor(readonly number: TemplateNumber) { super(number.value); }
  override toString(): string { return this.number.text; }
}
type ExactValue = ExactIntegerValue | ExactFloatValue;
const isExact = (value: unknown): value is ExactValue => value instanceof ExactIntegerValue || value instanceof ExactFloatValue;

/** Whether a value holds TemplateNumbers (only those need more than the library's own conversion). */
function holdsExactNumbers(value: unknown, depth = 0): boolean {
  if (value instanceof TemplateNumber) return true;
  if (typeof value !== 'object' || value === null || depth > 1000) return false;
  return (Array.isArray(value) ? value : Object.values(value)).some((item) => holdsExactNumbers(item, depth + 1));
}

/** The library's conversion of a JavaScript value (convertToRuntimeValues), with TemplateNumbers as exact values. */
function toRuntimeValue(value: unknown): unknown {
  if (value instanceof TemplateNumber) return value.isInteger ? new ExactIntegerValue(value) : new ExactFloatValue(value);
  if (!holdsExactNumbers(value)) return new Environment().set('value', value);
  if (Array.isArray(value)) return new ArrayValue(value.map(toRuntimeValue));
  return new ObjectValue(new Map(Object.entries(value as object).map(([key, item]) => [key, toRuntimeValue(item)])));
}

// ---------------------------------------------------------------------------------------------------------------
// Printing values as Python prints them
//
// Jinja writes a value with Python's str(): in {{ }}, with | string, ~ and join. The library writes JavaScript's
// text instead: JSON for a list or dict ({"a": 1, "b": true}, where Python writes {'a': 1, 'b': True}), true and
// false, nothing for none (Python: None), 1e16 as 10000000000000000.0 (Python: 1e+16).

interface RuntimeValue { type: string; value: unknown; toString(): string }

/** Python's str() of a runtime value (an undefined value is "", as Jinja's Undefined prints). */
export function pythonStr(value: RuntimeValue): string {
  if (value.type === 'StringValue') return value.value as string;
  if (value.type === 'UndefinedValue') return '';
  return pythonRepr(value);
}

/** Python's repr() of a runtime value: how str() of a list or dict writes its items. */
function pythonRepr(value: RuntimeValue): string {
  switch (value.type) {
    case 'StringValue': return pythonStringRepr(value.value as string);
    case 'BooleanValue': return value.value ? 'True' : 'False';
    case 'NullValue': return 'None';
    case 'UndefinedValue': return 'Undefined';
    case 'IntegerValue': return isExact(value) ? value.number.text : pythonIntegerText(value.value as number);
    case 'FloatValue': return isExact(value) ? value.number.text : pythonFloatStr(value.value as number);
    case 'ArrayValue': return `[${(value.value as RuntimeValue[]).map(pythonRepr).join(', ')}]`;
    case 'TupleValue': {
      const items = (value.value as RuntimeValue[]).map(pythonRepr);
      return items.length === 1 ? `(${items[0]},)` : `(${items.join(', ')})`;
    }
    case 'ObjectValue':
      return `{${[...(value.value as Map<string, RuntimeValue>)].map(([key, item]) => `${pythonStringRepr(key)}: ${pythonRepr(item)}`).join(', ')}}`;
    default: return value.toString();
  }
}

function pythonIntegerText(value: number): string {
  return Number.isFinite(value) && !Number.isSafeInteger(value) ? BigInt(value).toString() : String(value);
}

/** str() of a float: repr's digits, with inf and nan as Python names them (json.dumps writes Infinity, NaN). */
function pythonFloatStr(value: number): string {
  if (Number.isNaN(value)) return 'nan';
  if (!Number.isFinite(value)) return value > 0 ? 'inf' : '-inf';
  return pythonFloatText(value);
}

/** Characters Python's repr() escapes (str.isprintable is false): controls, format, separators but the space. */
const NOT_PRINTABLE = /^(?! )[\p{C}\p{Z}]$/u;

/** Python's repr() of a str: single quotes unless the text has one and no double quote, and its escapes. */
function pythonStringRepr(text: string): string {
  const quote = text.includes("'") && !text.includes('"') ? '"' : "'";
  let out = quote;
  for (const char of text) {
    if (char === quote || char === '\\') out += `\\${char}`;
    else if (char === '\n') out += '\\n';
    else if (char === '\r') out += '\\r';
    else if (char === '\t') out += '\\t';
    else if (NOT_PRINTABLE.test(char)) {
      const code = char.codePointAt(0)!;
      out += code < 0x100 ? `\\x${hex(code, 2)}` : code < 0x10000 ? `\\u${hex(code, 4)}` : `\\U${hex(code, 8)}`;
    } else out += char;
  }
  return out + quote;
}

const hex = (code: number, digits: number): string => code.toString(16).padStart(digits, '0');

/** Python's whitespace, what str.strip() takes off (JavaScript's trim() takes U+FEFF too, and not U+001C-U+001F, U+0085). */
const PYTHON_WHITESPACE = new Set([...'\t\n\v\f\r\x1c\x1d\x1e\x1f \x85\xa0\u1680\u2028\u2029\u202f\u205f\u3000',
  ...Array.from({ length: 11 }, (_, i) => String.fromCharCode(0x2000 + i))]);

/** Python's str.strip / lstrip / rstrip: whitespace, or the characters of `chars`, off the chosen ends. */
function pythonStrip(text: string, chars: string | undefined, ends: 'strip' | 'lstrip' | 'rstrip'): string {
  const strips = chars === undefined ? PYTHON_WHITESPACE : new Set(chars);
  const characters = [...text];
  let start = 0;
  let end = characters.length;
  if (ends !== 'rstrip') while (start < end && strips.has(characters[start]!)) start++;
  if (ends !== 'lstrip') while (end > start && strips.has(characters[end - 1]!)) end--;
  return characters.slice(start, end).join('');
}

/** The characters argument of a strip: none given (or none) is whitespace; anything but a string is refused. */
function stripCharacters(args: RuntimeValue[], kwargs: Map<string, RuntimeValue>, name: string): string | undefined {
  const chars = args[0] ?? kwargs.get('chars');
  if (chars === undefined || chars.type === 'NullValue' || chars.type === 'UndefinedValue') return undefined;
  if (chars.type !== 'StringValue') throw new Error(`${name}() takes a string of characters, got ${chars.type}`);
  return chars.value as string;
}

const STRIP_METHODS: ReadonlySet<string> = new Set(['strip', 'lstrip', 'rstrip']);

/** json.dumps' options, as transformers' tojson filter passes them. */
interface JsonOptions { ensureAscii: boolean; indent: string | undefined; itemSeparator: string; keySeparator: string; sortKeys: boolean }

/** tojson's arguments, in transformers' order: tojson(ensure_ascii=False, indent=None, separators=None, sort_keys=False). */
function jsonOptions(args: RuntimeValue[], kwargs: Map<string, RuntimeValue>): JsonOptions {
  const argument = (position: number, name: string): RuntimeValue | undefined => {
    const value = args[position] ?? kwargs.get(name);
    return value === undefined || value.type === 'NullValue' || value.type === 'UndefinedValue' ? undefined : value;
  };
  const indentValue = argument(1, 'indent');
  let indent: string | undefined;
  if (indentValue?.type === 'IntegerValue') indent = ' '.repeat(Math.max(0, indentValue.value as number));
  else if (indentValue?.type === 'StringValue') indent = indentValue.value as string;
  else if (indentValue !== undefined) throw new Error(`tojson indent must be a number or a string, got ${indentValue.type}`);
  const separators = argument(2, 'separators');
  let [itemSeparator, keySeparator] = [indent === undefined ? ', ' : ',', ': '];
  if (separators !== undefined) {
    const pair = separators.value as RuntimeValue[];
    if (!Array.isArray(pair) || pair.length !== 2 || pair.some((item) => item.type !== 'StringValue')) {
      throw new Error('tojson separators must be a pair of strings');
    }
    [itemSeparator, keySeparator] = pair.map((item) => item.value as string) as [string, string];
  }
  const truthy = (value: RuntimeValue | undefined): boolean =>
    value !== undefined && !!(value as unknown as { __bool__(): { value: boolean } }).__bool__().value;
  return { ensureAscii: truthy(argument(0, 'ensure_ascii')), indent, itemSeparator, keySeparator, sortKeys: truthy(argument(3, 'sort_keys')) };
}

/** Python's order of str keys: by code point (JavaScript's < compares UTF-16 units, the library's localeCompare letters). */
function compareCodePoints(a: string, b: string): number {
  const left = [...a];
  const right = [...b];
  for (let i = 0; i < Math.min(left.length, right.length); i++) {
    const difference = left[i]!.codePointAt(0)! - right[i]!.codePointAt(0)!;
    if (difference !== 0) return difference;
  }
  return left.length - right.length;
}

function jsonString(text: string, ensureAscii: boolean): string {
  const json = JSON.stringify(text);
  return ensureAscii ? json.replace(/[^\x20-\x7e]/g, (char) => `\\u${hex(char.charCodeAt(0), 4)}`) : json;
}

/**
 * Python's json.dumps of a runtime value, as transformers' tojson filter calls it: floats as repr() writes them (1.0,
 * 1e+16, Infinity), exact numbers as their text, keys sorted by code point, Python's indent and separators. An
 * undefined value is null, as the library writes it (vLLM's tools hold None where a field was not sent).
 */
function pythonJson(value: RuntimeValue, options: JsonOptions, level = 0): string {
  switch (value.type) {
    case 'NullValue':
    case 'UndefinedValue':
      return 'null';
    case 'BooleanValue': return value.value ? 'true' : 'false';
    case 'IntegerValue': return isExact(value) ? value.number.text : pythonIntegerText(value.value as number);
    case 'FloatValue': return isExact(value) ? value.number.text : pythonFloatText(value.value as number);
    case 'StringValue': return jsonString(value.value as string, options.ensureAscii);
    case 'ArrayValue':
    case 'TupleValue':
      return jsonContainer('[', ']', (value.value as RuntimeValue[]).map((item) => pythonJson(item, options, level + 1)), options, level);
    case 'ObjectValue':
    case 'NamespaceValue': {
      let entries = [...(value.value as Map<string, RuntimeValue>)];
      if (options.sortKeys) entries = entries.sort(([a], [b]) => compareCodePoints(a, b));
      return jsonContainer('{', '}', entries.map(([key, item]) =>
        `${jsonString(key, options.ensureAscii)}${options.keySeparator}${pythonJson(item, options, level + 1)}`), options, level);
    }
    default:
      throw new Error(`Object of type ${value.type} is not JSON serializable`);
  }
}

function jsonContainer(open: string, close: string, items: string[], options: JsonOptions, level: number): string {
  if (items.length === 0) return open + close;
  if (options.indent === undefined) return open + items.join(options.itemSeparator) + close;
  const inner = `\n${options.indent.repeat(level + 1)}`;
  return `${open}${inner}${items.join(options.itemSeparator + inner)}\n${options.indent.repeat(level)}${close}`;
}

/** One conversion of printf-style formatting: %[(key)][flags][width][.precision]type. */
const CONVERSION = /%(?:\(([^)]*)\))?([-+ #0]*)(\d+)?(?:\.(\d+))?(.)?/g;

/**
 * Python's `format % values` (printf-style formatting, which Jinja templates write as `'%s' % x`): the conversions
 * s, r, d, i, u, f, F, x, X, o and %, with flags, width and precision; values a tuple, one value, or a dict for
 * %(key)s. Others are refused, as Python refuses what it does not know.
 */
function pythonPercentFormat(format: string, values: RuntimeValue): string {
  const positional = values.type === 'TupleValue' ? [...values.value as RuntimeValue[]] : [values];
  const mapping = values.type === 'ObjectValue' ? values.value as Map<string, RuntimeValue> : undefined;
  let used = 0;
  let usedMapping = false;
  const text = format.replace(CONVERSION, (_match, key: string | undefined, flags: string, width: string | undefined,
    precisionText: string | undefined, type: string | undefined) => {
    if (type === undefined) throw new Error('incomplete format');
    if (type === '%' && key === undefined) return '%';
    let value: RuntimeValue | undefined;
    if (key !== undefined) {
      if (mapping === undefined) throw new Error('format requires a mapping');
      value = mapping.get(key);
      if (value === undefined) throw new Error(`KeyError: ${pythonStringRepr(key)}`);
      usedMapping = true;
    } else {
      value = positional[used++];
      if (value === undefined) throw new Error('not enough arguments for format string');
    }
    const precision = precisionText === undefined ? undefined : Number(precisionText);
    let body: string;
    let sign = '';
    const number = (): number => {
      if (value!.type === 'BooleanValue') return value!.value ? 1 : 0;
      if (value!.type !== 'IntegerValue' && value!.type !== 'FloatValue') {
        throw new Error(`%${type} format: a real number is required, not ${value!.type}`);
      }
      return value!.value as number;
    };
    switch (type) {
      case 's': body = pythonStr(value); break;
      case 'r': body = pythonRepr(value); break;
      case 'd': case 'i': case 'u': {
        const n = isExact(value) && value.number.isInteger ? BigInt(value.number.text) : BigInt(Math.trunc(number()));
        sign = n < 0n ? '-' : '';
        body = (n < 0n ? -n : n).toString();
        if (precision !== undefined) body = body.padStart(precision, '0');
        break;
      }
      case 'x': case 'X': case 'o': {
        if (value.type === 'FloatValue') throw new Error(`%${type} format: an integer is required, not float`);
        const n = BigInt(number());
        sign = n < 0n ? '-' : '';
        body = (n < 0n ? -n : n).toString(type === 'o' ? 8 : 16);
        if (type === 'X') body = body.toUpperCase();
        if (flags.includes('#')) body = (type === 'o' ? '0o' : type === 'x' ? '0x' : '0X') + body;
        break;
      }
      case 'f': case 'F': {
        const n = number();
        sign = n < 0 || Object.is(n, -0) ? '-' : '';
        body = Number.isFinite(n) ? fixedHalfEven(Math.abs(n), precision ?? 6) : Number.isNaN(n) ? 'nan' : 'inf';
        if (type === 'F') body = body.toUpperCase();
        break;
      }
      default: throw new Error(`unsupported format character '${type}'`);
    }
    if (type === 's' || type === 'r') {
      if (precision !== undefined) body = [...body].slice(0, precision).join('');
    } else if (sign === '') sign = flags.includes('+') ? '+' : flags.includes(' ') ? ' ' : '';
    const size = width === undefined ? 0 : Number(width);
    if (flags.includes('-')) return (sign + body).padEnd(size);
    if (flags.includes('0') && type !== 's' && type !== 'r') return sign + body.padStart(size - sign.length, '0');
    return (sign + body).padStart(size);
  });
  if (!usedMapping && mapping === undefined && used < positional.length) {
    throw new Error('not all arguments converted during string formatting');
  }
  return text;
}

/** A non-negative number in fixed notation, ties rounded to even as Python rounds them (toFixed rounds them up). */
function fixedHalfEven(value: number, digits: number): string {
  const rounded = value.toFixed(digits);
  if (value >= 1e21 || digits > 50) return rounded;
  const exact = value.toFixed(Math.min(100, digits + 50)); // every digit of a double this side of 1e21, near enough
  const rest = exact.slice(exact.length - (Math.min(100, digits + 50) - digits));
  if (!/^50*$/.test(rest)) return rounded;
  const truncated = exact.slice(0, exact.length - rest.length).replace(/\.$/, '');
  const lastDigit = Number(truncated.at(-1));
  return lastDigit % 2 === 0 ? truncated : rounded;
}

interface FilterNode { type: string; value?: string; callee?: { type: string; value?: string }; args?: unknown[] }
interface BinaryNode { type: string; operator: { value: string }; left: unknown; right: unknown }
type ApplyFilter = (operand: unknown, filter: FilterNode, environment: Environment) => { value: unknown };
type EvaluateBinary = (node: BinaryNode, environment: Environment) => unknown;
type Evaluate = (node: unknown, environment: Environment) => RuntimeValue;
interface MemberNode { type: string; object: unknown; property: { type: string; value?: unknown }; computed: boolean }
type EvaluateMember = (node: MemberNode, environment: Environment) => unknown;
type EvaluateBlock = (statements: { type: string }[], environment: Environment) => unknown;
type EvaluateArguments = (args: unknown[], environment: Environment) => [RuntimeValue[], Map<string, RuntimeValue>];

/** Statements that write nothing: their none is no output, where an expression's none prints "None". */
const SILENT_STATEMENTS: ReadonlySet<string> = new Set(['Set', 'Macro', 'Comment', 'If', 'For']);

/**
 * The library's interpreter, writing values as Python's Jinja writes them:
 * - what a template prints, `| string`, `~` and `join` are Python's str() of the values (see pythonStr), exact
 *   numbers as their text;
 * - `tojson` is Python's json.dumps with transformers' options (see pythonJson);
 * - a string's trim filter and strip methods take off what Python's would (see pythonStrip);
 * - `+` with a string: the library joins the operands' raw values;
 * - `'%s' % x`, string formatting, which the library lacks, as Python's (see pythonPercentFormat).
 */
class ExactNumberInterpreter extends Interpreter {
  constructor(env: Environment, stepBudget: number) {
    super(env);
    const prototype = Interpreter.prototype as unknown as {
      applyFilter: ApplyFilter; evaluateBinaryExpression: EvaluateBinary; evaluate: Evaluate; evaluateArguments: EvaluateArguments;
      evaluateMemberExpression: EvaluateMember;
    };
    const self = this as unknown as {
      applyFilter: ApplyFilter; evaluateBinaryExpression: EvaluateBinary; evaluateBlock: EvaluateBlock; evaluateMemberExpression: EvaluateMember;
    };
    // Every node the interpreter evaluates is a step; a rendering that takes more than its budget is stopped.
    let stepsLeft = stepBudget;
    (this as unknown as { evaluate: Evaluate }).evaluate = (node, environment) => {
      if (--stepsLeft < 0) throw new TemplateStepBudgetExceeded(stepBudget);
      return prototype.evaluate.call(this, node, environment);
    };
    const filterArguments = (filter: FilterNode, environment: Environment): [RuntimeValue[], Map<string, RuntimeValue>] =>
      filter.type === 'CallExpression' ? prototype.evaluateArguments.call(this, filter.args ?? [], environment) : [[], new Map()];
    // A string's strip, lstrip and rstrip methods, as Python's.
    self.evaluateMemberExpression = (node, environment) => {
      const method = !node.computed && node.property.type === 'Identifier' ? node.property.value as string : undefined;
      if (method === undefined || !STRIP_METHODS.has(method)) return prototype.evaluateMemberExpression.call(this, node, environment);
      const object = prototype.evaluate.call(this, node.object, environment);
      if (object.type === 'StringValue') {
        return new FunctionValue((args: RuntimeValue[]) => {
          const kwargs = args.at(-1)?.type === 'KeywordArgumentsValue' ? args.pop()!.value as Map<string, RuntimeValue> : new Map();
          return new StringValue(pythonStrip(object.value as string, stripCharacters(args, kwargs, method), method as 'strip'));
        });
      }
      // The library's own lookup, on the object already evaluated.
      const scope = new Environment(environment);
      declare(scope, '__object', object);
      return prototype.evaluateMemberExpression.call(this, { ...node, object: { type: 'Identifier', value: '__object' } }, scope);
    };
    self.evaluateBlock = (statements, environment) => {
      let result = '';
      for (const statement of statements) {
        const value = prototype.evaluate.call(this, statement, environment);
        if (SILENT_STATEMENTS.has(statement.type) && (value.type === 'NullValue' || value.type === 'UndefinedValue')) continue;
        result += pythonStr(value);
      }
      return new StringValue(result);
    };
    self.applyFilter = (operand, filter, environment) => {
      const name = filter.type === 'Identifier' ? filter.value
        : filter.type === 'CallExpression' && filter.callee?.type === 'Identifier' ? filter.callee.value : undefined;
      const value = operand as RuntimeValue;
      if (name === 'string' && filter.type === 'Identifier') return new StringValue(pythonStr(value));
      if (name === 'trim' && value.type === 'StringValue') {
        const [args, kwargs] = filterArguments(filter, environment);
        return new StringValue(pythonStrip(value.value as string, stripCharacters(args, kwargs, 'trim'), 'strip'));
      }
      if (name === 'join' && value.type === 'ArrayValue') {
        const [args, kwargs] = filterArguments(filter, environment);
        const separator = args[0] ?? kwargs.get('d') ?? kwargs.get('separator');
        if (!kwargs.has('attribute') && (separator === undefined || separator.type === 'StringValue')) {
          return new StringValue((value.value as RuntimeValue[]).map(pythonStr).join((separator?.value as string | undefined) ?? ''));
        }
      }
      if (name === 'tojson') {
        const [args, kwargs] = filterArguments(filter, environment);
        return new StringValue(pythonJson(value, jsonOptions(args, kwargs)));
      }
      return prototype.applyFilter.call(this, operand, filter, environment);
    };
    self.evaluateBinaryExpression = (node, environment) => {
      const operator = node.operator.value;
      if (operator !== '~' && operator !== '+' && operator !== '%') return prototype.evaluateBinaryExpression.call(this, node, environment);
      const left = prototype.evaluate.call(this, node.left, environment);
      const right = prototype.evaluate.call(this, node.right, environment);
      if (operator === '~') return new StringValue(pythonStr(left) + pythonStr(right));
      if (operator === '%' && left.type === 'StringValue') return new StringValue(pythonPercentFormat(left.value as string, right));
      const joins = (left.type === 'StringValue' && isExact(right)) || (isExact(left) && right.type === 'StringValue');
      if (joins) return new StringValue(joinedText(left) + joinedText(right));
      // The library's own operation, on the operands already evaluated (evaluating them again would repeat calls).
      const operands = new Environment(environment);
      declare(operands, '__left', left);
      declare(operands, '__right', right);
      return prototype.evaluateBinaryExpression.call(this, { ...node, left: { type: 'Identifier', value: '__left' },
        right: { type: 'Identifier', value: '__right' } }, operands);
    };
  }
}

/**
 * How many steps (nodes evaluated) one rendering may take. The interpreter runs on the server's thread, one to two
 * microseconds a step: a template that loops over the messages for each message took over a minute for 4096 messages,
 * stalling every other request. Real templates take tens to a few hundred steps a message (Llama 2's about 30), so
 * the most messages a request may send render within a fraction of the budget.
 */
export const TEMPLATE_STEP_BUDGET = 5_000_000;

/** Thrown when a rendering takes more steps than its budget. */
export class TemplateStepBudgetExceeded extends Error {
  constructor(readonly budget: number) {
    super(`rendering these messages takes the chat template more than ${budget} steps (it loops over them too many ` +
      'times); send fewer or shorter messages');
  }
}

/** A runtime value as a variable (Environment.set would convert it again, as a plain object). */
function declare(env: Environment, name: string, value: unknown): void {
  (env as unknown as { declareVariable(name: string, value: unknown): unknown }).declareVariable(name, value);
}

function joinedText(value: { value: unknown }): string {
  return isExact(value) ? value.number.text : String(value.value);
}

/**
 * What @huggingface/jinja's Template.render does (its globals, then the context), with the context's
 * TemplateNumbers printing exactly. raise_exception and range are not declared: the chat template's compile step
 * routes them to functions of the context.
 */
export function renderExact(program: Template['parsed'], context: Record<string, unknown>, stepBudget = TEMPLATE_STEP_BUDGET): string {
  const env = new Environment();
  const globals: Record<string, unknown> = {
    false: false, true: true, none: null, False: false, True: true, None: null, strftime_now: strftimeNow,
  };
  for (const [name, value] of Object.entries({ ...globals, ...context })) declare(env, name, toRuntimeValue(value));
  const interpreter = new ExactNumberInterpreter(env, stepBudget) as unknown as { run(program: Template['parsed']): { value: unknown } };
  return interpreter.run(program).value as string;
}

/** The library's strftime_now: the few directives chat templates use, in local time. */
function strftimeNow(format: string): string {
  const date = new Date();
  const pad2 = (n: number): string => String(n).padStart(2, '0');
  return format.replace(/%[YmdbBHM%]/g, (directive) => {
    switch (directive) {
      case '%Y': return String(date.getFullYear());
      case '%m': return pad2(date.getMonth() + 1);
      case '%d': return pad2(date.getDate());
      case '%b': return new Intl.DateTimeFormat(undefined, { month: 'short' }).format(date);
      case '%B': return new Intl.DateTimeFormat(undefined, { month: 'long' }).format(date);
      case '%H': return pad2(date.getHours());
      case '%M': return pad2(date.getMinutes());
      default: return '%';
    }
  });
}

// ---------------------------------------------------------------------------------------------------------------
// Request fields

/**
 * Request bodies are parsed with JSON.parse, which has already rounded their numbers; the text each was parsed from
 * is kept here so that the fields handed to the chat template (tools, chat_template_kwargs, documents) can be read
 * again with exact numbers, and only when they hold a number at all.
 */
const bodyTexts = new WeakMap<object, string>();
const exactBodies = new WeakMap<object, Record<string, unknown>>();

/** Notes the text a request body was parsed from. */
export function rememberBodyText(body: unknown, text: string): void {
  if (typeof body === 'object' && body !== null) bodyTexts.set(body, text);
}

function holdsNumbers(value: unknown, depth = 0): boolean {
  if (typeof value === 'number') return true;
  if (typeof value !== 'object' || value === null || depth > 1000) return false;
  return (Array.isArray(value) ? value : Object.values(value)).some((item) => holdsNumbers(item, depth + 1));
}

/**
 * A top-level field of a request body as the chat template should see it: `value` (what JSON.parse made of it,
 * already validated), or, when it holds numbers, the same field read again from the body's text with exact numbers.
 */
export function exactBodyField(body: unknown, name: string, value: unknown): unknown {
  if (!holdsNumbers(value) || typeof body !== 'object' || body === null) return value;
  let exact = exactBodies.get(body);
  if (exact === undefined) {
    const text = bodyTexts.get(body);
    if (text === undefined) return value;
    exact = parseJsonExactNumbers(text) as Record<string, unknown>;
    exactBodies.set(body, exact);
  }
  return exact[name] ?? value;
}

/**
 * Lets a body built from another's fields in shapes of its own (a Responses request's flat tools as chat's) be read
 * with exact numbers: `exact` holds those fields, already in the built body's shape, read from the other's text.
 */
export function rememberExactFields(body: unknown, exact: Record<string, unknown>): void {
  if (typeof body === 'object' && body !== null) exactBodies.set(body, exact);
}

/** Lets a body built from another's fields (of the same names) be read exactly from the other's text. */
export function shareBodyText(from: unknown, to: unknown): void {
  const text = typeof from === 'object' && from !== null ? bodyTexts.get(from) : undefined;
  if (text !== undefined) rememberBodyText(to, text);
}
