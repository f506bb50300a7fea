// A JSON schema bounded in every part and its hand-written check, shared by the structured-output and tool tests.

import assert from 'node:assert/strict';

/** Bounded in every part (string lengths, integer range, enums), so a noise model's output must end. */
export const PERSON_SCHEMA = {
  type: 'object',
  properties: {
    name: { type: 'string', minLength: 1, maxLength: 8 },
    age: { type: 'integer', minimum: 0, maximum: 120 },
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
  assert.ok(Number.isInteger(person.age) && (person.age as number) >= 0 && (person.age as number) <= 120, `age ${person.age}`);
  assert.equal(typeof person.member, 'boolean');
  assert.ok(['red', 'green', 'blue'].includes(person.color as string), `color ${person.color}`);
  assert.ok(Array.isArray(person.tags) && person.tags.length <= 2);
  for (const tag of person.tags as unknown[]) assert.ok(typeof tag === 'string' && [...tag].length <= 4, `tag ${JSON.stringify(tag)}`);
}
