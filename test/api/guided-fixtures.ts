// A JSON schema bounded in every part and its hand-written check, shared by the structured-output and tool tests.

import assert from 'node:assert/strict';

/** Bounded in every part (string lengths, integer range, enums), so a noise model's output must end. */
export const PERSON_SCHEMA = {
  type: 'object',
  properties: {
    name: { type: 'string', minLength: 1, maxLength: 8 },
    age: { type: 'integer', minimum: 0, maximum: 99 },
    member: { type: 'boolean' },
    color: { enum: ['red', 'green', 'blue'] },
    tags: { type: 'array', items: { type: 'string', maxLength: 4 }, maxItems: 2 },
  },
  required: ['name', 'age', 'member', 'color', 'tags'],
  additionalProperties: false,
} as const;

/** Checks a value against PERSON_SCHEMA by hand (every constraint the schema states). */
export function assertPerson(value: unknown): void {
  assert.ok(typeof value === 'object' && value !== null && !Array.isArray(value), `not an object: ${JSON.stringify(value)}`);
  const person = value as Record<string, unknown>;
  assert.deepEqual(Object.keys(person).sort(), ['age', 'color', 'member', 'name', 'tags']);
  assert.equal(typeof person.name, 'string');
  const name = person.name as string;
  assert.ok([...name].length >= 1 && [...name].length <= 8, `name length: ${JSON.stringify(name)}`);
  assert.ok(Number.isInteger(person.age) && (person.age as number) >= 0 && (person.age as number) <= 99, `age ${person.age}`);
  assert.equal(typeof person.member, 'boolean');
  assert.ok(['red', 'green', 'blue'].includes(person.color as string), `color ${person.color}`);
  assert.ok(Array.isArray(person.tags) && person.tags.length <= 2);
  for (const tag of person.tags as unknown[]) assert.ok(typeof tag === 'string' && [...tag].length <= 4, `tag ${JSON.stringify(tag)}`);
}

/**
 * The ways `value` breaks `schema` (empty when it fits), for the keywords the guided tests use: $ref (JSON pointers
 * inside `root`), type, properties, required, additionalProperties, items, prefixItems, minItems, maxItems, enum,
 * const, anyOf, oneOf, minimum, maximum, minLength, maxLength, pattern and the formats of FORMAT_CHECKS.
 */
export function schemaErrors(schema: unknown, value: unknown, root: unknown = schema, at = '$'): string[] {
  if (schema === true) return [];
  if (schema === false) return [`${at}: no value is allowed`];
  const s = schema as Record<string, any>;
  const errors: string[] = [];
  if (typeof s.$ref === 'string') {
    let target: any = root;
    if (s.$ref !== '#') for (const segment of s.$ref.slice(2).split('/')) target = target?.[segment];
    if (target === undefined) return [`${at}: ${s.$ref} not found`];
    errors.push(...schemaErrors(target, value, root, at));
  }
  if (s.type !== undefined) {
    const types: string[] = Array.isArray(s.type) ? s.type : [s.type];
    const kind = value === null ? 'null' : Array.isArray(value) ? 'array' : typeof value;
    const fits = types.some((type) => type === kind || (type === 'integer' && Number.isInteger(value)) || (type === 'number' && kind === 'number'));
    if (!fits) return [...errors, `${at}: ${JSON.stringify(value)} is not of type ${types.join('|')}`];
  }
  if (s.enum !== undefined && !s.enum.some((v: unknown) => JSON.stringify(v) === JSON.stringify(value))) errors.push(`${at}: not in enum`);
  if (s.const !== undefined && JSON.stringify(s.const) !== JSON.stringify(value)) errors.push(`${at}: not the const`);
  if (s.anyOf !== undefined && !s.anyOf.some((option: unknown) => schemaErrors(option, value, root, at).length === 0)) errors.push(`${at}: no anyOf branch fits`);
  if (s.oneOf !== undefined && s.oneOf.filter((option: unknown) => schemaErrors(option, value, root, at).length === 0).length !== 1) {
    errors.push(`${at}: not exactly one oneOf branch fits`);
  }
  if (typeof value === 'number') {
    if (s.minimum !== undefined && value < s.minimum) errors.push(`${at}: below ${s.minimum}`);
    if (s.maximum !== undefined && value > s.maximum) errors.push(`${at}: above ${s.maximum}`);
  }
  if (typeof value === 'string') {
    const length = [...value].length;
    if (s.minLength !== undefined && length < s.minLength) errors.push(`${at}: shorter than ${s.minLength}`);
    if (s.maxLength !== undefined && length > s.maxLength) errors.push(`${at}: longer than ${s.maxLength}`);
    if (s.pattern !== undefined && !new RegExp(s.pattern, 'u').test(value)) errors.push(`${at}: does not match ${s.pattern}`);
    if (s.format !== undefined) {
      const check = FORMAT_CHECKS[s.format as string];
      if (check === undefined) errors.push(`${at}: format ${s.format} has no check here`);
      else if (!check(value)) errors.push(`${at}: ${JSON.stringify(value)} is not a ${s.format}`);
    }
  }
  if (Array.isArray(value)) {
    if (s.minItems !== undefined && value.length < s.minItems) errors.push(`${at}: fewer than ${s.minItems} items`);
    if (s.maxItems !== undefined && value.length > s.maxItems) errors.push(`${at}: more than ${s.maxItems} items`);
    const prefix: unknown[] = s.prefixItems ?? [];
    value.forEach((item, i) => {
      const itemSchema = i < prefix.length ? prefix[i] : s.items;
      if (itemSchema !== undefined) errors.push(...schemaErrors(itemSchema, item, root, `${at}[${i}]`));
    });
  }
  if (typeof value === 'object' && value !== null && !Array.isArray(value)) {
    const object = value as Record<string, unknown>;
    for (const name of s.required ?? []) if (!Object.hasOwn(object, name)) errors.push(`${at}: missing ${name}`);
    for (const [name, item] of Object.entries(object)) {
      if (s.properties !== undefined && Object.hasOwn(s.properties, name)) errors.push(...schemaErrors(s.properties[name], item, root, `${at}.${name}`));
      else if (s.additionalProperties !== undefined) errors.push(...schemaErrors(s.additionalProperties, item, root, `${at}.${name}`));
    }
  }
  return errors;
}

function leapYear(year: number): boolean {
  return year % 4 === 0 && (year % 100 !== 0 || year % 400 === 0);
}

function validDate(text: string): boolean {
  const match = /^(\d{4})-(\d{2})-(\d{2})$/.exec(text);
  if (!match) return false;
  const [year, month, day] = [Number(match[1]), Number(match[2]), Number(match[3])];
  const days = [31, leapYear(year) ? 29 : 28, 31, 30, 31, 30, 31, 31, 30, 31, 30, 31][month - 1];
  return days !== undefined && day >= 1 && day <= days;
}

function validTime(text: string): boolean {
  const match = /^(\d{2}):(\d{2}):(\d{2})(\.\d+)?(Z|z|[+-](\d{2}):(\d{2}))$/.exec(text);
  if (!match) return false;
  const [hour, minute, second] = [Number(match[1]), Number(match[2]), Number(match[3])];
  const offsetOk = match[5]!.toUpperCase() === 'Z' || (Number(match[6]) < 24 && Number(match[7]) < 60);
  // (A leap second, 60, is valid only at the end of a UTC day; the grammar never produces one.)
  return hour < 24 && minute < 60 && second < 60 && offsetOk;
}

/** RFC 3339 / JSON Schema checks for the formats the guided tests produce. */
export const FORMAT_CHECKS: Record<string, (text: string) => boolean> = {
  date: validDate,
  time: validTime,
  'date-time': (text) => {
    const t = text.search(/[Tt]/);
    return t === 10 && validDate(text.slice(0, t)) && validTime(text.slice(t + 1));
  },
  ipv4: (text) => {
    const parts = text.split('.');
    return parts.length === 4 && parts.every((part) => /^(0|[1-9]\d{0,2})$/.test(part) && Number(part) <= 255);
  },
  hostname: (text) => text.length <= 253 && text.split('.').every((label) => /^[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?$/.test(label)),
  email: (text) => /^[A-Za-z0-9!#$%&'*+/=?^_`{|}~-]+(\.[A-Za-z0-9!#$%&'*+/=?^_`{|}~-]+)*@([A-Za-z0-9]([A-Za-z0-9-]*[A-Za-z0-9])?\.)+[A-Za-z0-9]([A-Za-z0-9-]*[A-Za-z0-9])?$/.test(text),
  'json-pointer': (text) => /^(\/([^/~]|~[01])*)*$/u.test(text),
  'relative-json-pointer': (text) => /^(0|[1-9]\d*)(#|(\/([^/~]|~[01])*)*)$/u.test(text),
  uuid: (text) => /^[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}$/.test(text),
};
