// `conduit generate` on the built-in model, in-process through main(): the prompt and its continuation on stdout,
// the speed on stderr; a seed gives the same text alone and beside other requests (--concurrency runs seeds seed,
// seed + 1, ...); environment twins; usage errors with exit code 2.
import { test } from 'node:test';
import assert from 'node:assert/strict';
import { mkdtempSync, readFileSync, rmSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { readGguf } from '../../src/model/gguf.ts';
import { runCli as run } from '../helpers/cli-main.ts';
import { writeTinyModel } from '../helpers/cpu-model.ts';

const PROMPT = 'Once upon a time';
const BASE = ['generate', '--prompt', PROMPT, '--ignore-eos', '--threads', '1'];

/** The continuations printed by one run: one per request, in order (the prompt and, with several, the header taken off). */
function continuations(out: string, requests: number): string[] {
  if (requests === 1) {
    assert.ok(out.startsWith(PROMPT), `stdout starts with the prompt: ${JSON.stringify(out)}`);
    return [out.slice(PROMPT.length)];
  }
  const parts = out.split(/^--- request (\d+) \(seed (\d+)\)\n/m).slice(1);
  assert.equal(parts.length, 3 * requests, `one section per request: ${JSON.stringify(out)}`);
  return Array.from({ length: requests }, (_, i) => {
    assert.equal(Number(parts[3 * i]), i);
    const text = parts[3 * i + 2]!.replace(/\n$/, '');
    assert.ok(text.startsWith(PROMPT));
    return text.slice(PROMPT.length);
  });
}

test('conduit generate prints the prompt and its continuation, and the speed', async () => {
  const { code, out, err } = await run([...BASE, '--max-tokens', '6']);
  assert.equal(code, 0, err);
  const [text] = continuations(out, 1);
  assert.ok(text!.length > 0, 'a continuation');
  assert.match(err, /on native|on reference/);
  assert.match(err, /prompt \d+ tokens, time to first token [\d.]+ ms; decode [\d.]+ tok\/s per request; 6 tokens from 1 request\(s\) in \d+ ms = [\d.]+ tok\/s aggregate; finish: length/);
});

test('conduit generate: a seed gives the same text alone and beside other requests', async () => {
  const sampled = ['--max-tokens', '12', '--temperature', '1'];
  const alone5 = continuations((await run([...BASE, ...sampled, '--seed', '5'])).out, 1)[0]!;
  const alone6 = continuations((await run([...BASE, ...sampled, '--seed', '6'])).out, 1)[0]!;
  assert.notEqual(alone5, alone6, 'two seeds, two texts');
  const together = await run([...BASE, ...sampled, '--seed', '5', '--concurrency', '2']);
  assert.equal(together.code, 0, together.err);
  assert.deepEqual(continuations(together.out, 2), [alone5, alone6]);
  assert.match(together.err, /24 tokens from 2 request\(s\)/);

  // Greedy: every request of a batch continues the prompt as one alone does.
  const greedy = continuations((await run([...BASE, '--max-tokens', '8'])).out, 1)[0]!;
  const batch = await run([...BASE, '--max-tokens', '8', '--concurrency', '3']);
  assert.deepEqual(continuations(batch.out, 3), [greedy, greedy, greedy]);
});

test('conduit generate reads its flags\' environment twins, the command line winning', async () => {
  const fromEnv = await run(['generate', '--threads', '1'], { CONDUIT_PROMPT: PROMPT, CONDUIT_MAX_TOKENS: '3', CONDUIT_IGNORE_EOS: '1' });
  assert.equal(fromEnv.code, 0, fromEnv.err);
  continuations(fromEnv.out, 1);
  assert.match(fromEnv.err, /3 tokens from 1 request\(s\)/);
  const flagWins = await run([...BASE, '--max-tokens', '2'], { CONDUIT_MAX_TOKENS: '3' });
  assert.match(flagWins.err, /2 tokens from 1 request\(s\)/);
});

test('conduit generate refuses bad flags with exit code 2 and says which', async () => {
  for (const [argv, message] of [
    [['generate'], /--prompt is required/],
    [[...BASE, '--max-tokens', '0'], /--max-tokens must be a whole number >= 1/],
    [[...BASE, '--concurrency', '1.5'], /--concurrency must be a whole number >= 1/],
    [[...BASE, '--temperature', '-1'], /--temperature must be >= 0/],
    [[...BASE, '--backend', 'gpu'], /--backend must be auto, native or reference/],
    [[...BASE, '--max-tokens', 'many'], /--max-tokens expects a number/],
    [[...BASE, '--max-tokens', '1e20'], /^conduit generate: --max-tokens must be at most 9007199254740991, got 100000000000000000000$/],
    [[...BASE, '--threads', '0'], /--threads must be a whole number >= 1, got 0/],
    // More threads than the system lets a process start: the native backend aborted the process, with no message.
    [[...BASE, '--threads', '100000'], /^conduit generate: --threads must be at most 1024, got 100000$/],
    // More requests than one engine batch holds: the engine's step arrays failed with "Invalid typed array length".
    [[...BASE, '--concurrency', '1e9'], /^conduit generate: --concurrency must be at most 16384, got 1000000000$/],
    [[...BASE, '--concurrency', '16385'], /^conduit generate: --concurrency must be at most 16384, got 16385$/],
    [[...BASE, '--top-p', '0'], /--top-p must be in \(0, 1\], got 0/],
    [[...BASE, '--top-p', '5'], /--top-p must be in \(0, 1\], got 5/],
    [[...BASE, 'stray'], /^conduit generate: unexpected argument "stray" \(the text to continue is --prompt "\.\.\."\)$/],
    [['generate', 'Once upon a time'], /unexpected argument "Once upon a time"/],
    [[...BASE, '--seed', '1.5'], /--seed must be a whole number from -9007199254740991 to 9007199254740991, got 1\.5/],
    [[...BASE, '--seed', '1e300'], /--seed must be a whole number from -9007199254740991 to 9007199254740991, got 1e\+300/],
    [[...BASE, '--seed', '9007199254740992'], /--seed must be a whole number from -9007199254740991 to 9007199254740991, got 9007199254740992/],
    [[...BASE, '--seed', '9007199254740991', '--concurrency', '3'],
      /--seed must be a whole number from -9007199254740991 to 9007199254740989 \(with --concurrency 3 the requests take seeds seed to seed \+ 2\), got 9007199254740991/],
  ] as const) {
    const { code, err } = await run([...argv]);
    assert.equal(code, 2, `${argv.join(' ')}: ${err}`);
    assert.match(err, message);
  }
});

test('conduit generate takes every seed a request takes, the largest safe integer included', async () => {
  for (const [seed, concurrency] of [['9007199254740991', '1'], ['9007199254740990', '2'], ['-9007199254740991', '1']]) {
    const { code, out, err } = await run([...BASE, '--max-tokens', '1', '--seed', seed!, '--concurrency', concurrency!]);
    assert.equal(code, 0, `${seed}: ${err}`);
    if (concurrency === '2') assert.match(out, /^--- request 1 \(seed 9007199254740991\)$/m);
  }
});

test('conduit generate: a request the engine refuses (a prompt longer than the context) is one line and exit code 1', async () => {
  const prompt = 'hello world '.repeat(1500);
  for (const concurrency of ['1', '2']) {
    const { code, out, err } = await run(['generate', '--prompt', prompt, '--max-tokens', '2', '--threads', '1', '--concurrency', concurrency]);
    assert.equal(code, 1, err);
    assert.equal(out, '');
    const lines = err.split('\n').filter((line) => !line.startsWith('conduit: '));
    assert.deepEqual(lines.length, 1, err);
    assert.match(lines[0]!, /^conduit generate: prompt of \d+ tokens leaves no room for output within the context length \d+$/);
  }
});

test('conduit generate warns on stderr when --max-tokens does not fit beside the prompt in the context', async () => {
  // The built-in model's context is 2048 tokens; this prompt leaves a few dozen of them.
  const prompt = 'hello world '.repeat(1000);
  const { code, out, err } = await run(['generate', '--prompt', prompt, '--max-tokens', '200', '--threads', '1', '--ignore-eos']);
  assert.equal(code, 0, err);
  assert.ok(out.startsWith(prompt));
  const warning = /^conduit generate: --max-tokens 200 does not fit: the prompt's (\d+) tokens leave room for (\d+) within the context length (\d+); generating at most (\d+) \(finish "length"\)$/m.exec(err);
  assert.ok(warning, err);
  const [promptTokens, room, context, most] = warning.slice(1).map(Number) as [number, number, number, number];
  assert.equal(room, context - promptTokens);
  assert.equal(most, room);
  assert.match(err, new RegExp(`prompt ${promptTokens} tokens, .* ${room} tokens from 1 request\\(s\\) .* finish: length$`, 'm'));
  // From the environment, the variable is named; with room to spare, nothing is said.
  const fromEnv = await run(['generate', '--prompt', prompt, '--threads', '1', '--ignore-eos'], { CONDUIT_MAX_TOKENS: '200' });
  assert.match(fromEnv.err, /^conduit generate: CONDUIT_MAX_TOKENS \(--max-tokens\) 200 does not fit:/m);
  const fits = await run([...BASE, '--max-tokens', '3']);
  assert.equal(fits.code, 0, fits.err);
  assert.doesNotMatch(fits.err, /does not fit/);
});

test('conduit generate: a request the engine fails after taking it is one line on stderr and exit code 1', async () => {
  // A model whose every embedding row is NaN: its logits cannot be sampled, so the request ends with an error output
  // (not a refusal). The speed line would have printed a time to first token of minus the arrival time.
  const dir = mkdtempSync(join(tmpdir(), 'conduit-generate-nan-'));
  try {
    const path = writeTinyModel(join(dir, 'nan.gguf'), { seed: 3 });
    const file = readGguf(path);
    const info = file.tensorInfos.find((t) => t.name === 'token_embd.weight')!;
    assert.equal(info.type, 0, 'an F32 embedding');
    const elements = info.shape.reduce((a, b) => a * b, 1);
    const bytes = readFileSync(path);
    new Float32Array(bytes.buffer, bytes.byteOffset + file.dataOffset + info.offset, elements).fill(NaN);
    writeFileSync(path, bytes);
    const { code, out, err } = await run(['generate', '--model', path, '--prompt', PROMPT, '--max-tokens', '4', '--threads', '1']);
    assert.equal(code, 1, err);
    assert.equal(out, '');
    assert.match(err, /^conduit generate: .*NaN/m);
    assert.doesNotMatch(err, /time to first token/);
  } finally {
    rmSync(dir, { recursive: true, force: true });
  }
});
