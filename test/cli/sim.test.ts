// `conduit sim` and `conduit plan` run in-process through main(): tables printed, engine cross-checks passing,
// usage errors with exit code 2, environment twins that cannot collide with `serve`'s.
import { test } from 'node:test';
import assert from 'node:assert/strict';
import { runCli as run } from '../helpers/cli-main.ts';
import { readFileSync } from 'node:fs';
import { PLAN_FLAGS, planOptionsFromFlags } from '../../src/cli/plan.ts';
import { DECODE_SWEEP_FLAGS, KV_TIERS_FLAGS, LIFECYCLE_FLAGS } from '../../src/cli/sim.ts';
import { envName, type FlagTable } from '../../src/cli/flags.ts';
import { SERVE_FLAGS } from '../../src/cli/serve.ts';
import { WORKER_FLAGS } from '../../src/cli/worker.ts';
import { MEASURED_EFFICIENCY } from '../../src/sim/calibration.ts';
import { DEFAULT_EFFICIENCY } from '../../src/sim/perf-model.ts';
import { H100_SXM } from '../../src/sim/hardware.ts';
import { LLAMA_3_1_70B, LLAMA_3_1_8B } from '../../src/sim/models.ts';
import { SimWorker } from '../../src/sim/sim-worker.ts';

/** The number in the first cell after `label` on the line that starts with it. */
/** The command exits 2 with `message` in one line (no stack trace) and prints nothing before it. */
async function assertRefusedBeforeOutput(argv: string[], message: RegExp): Promise<void> {
  const result = await run(argv);
  assert.equal(result.code, 2, `${argv.join(' ')}: ${result.err}`);
  assert.match(result.err, message);
  assert.doesNotMatch(result.err, /\n\s+at /, 'no stack trace');
  assert.equal(result.out, '', `${argv.join(' ')}: nothing printed before the refusal`);
}

function firstNumberAfter(text: string, label: RegExp): number {
  const line = text.split('\n').find((l) => label.test(l));
  assert.ok(line, `no line matching ${label}`);
  return Number(line.replace(label, '').trim().split(/\s+/)[0]);
}

test('conduit --help lists sim and plan as available commands', async () => {
  const { code, out } = await run(['--help']);
  assert.equal(code, 0);
  assert.match(out, /^ {2}sim$/m);
  assert.match(out, /^ {2}plan$/m);
  assert.doesNotMatch(out, /sim .*not available/);
});

test('conduit sim --help lists the models, GPUs and links, and every subcommand\'s options', async () => {
  const { code, out } = await run(['sim', '--help']);
  assert.equal(code, 0);
  for (const id of ['llama-3.1-8b', 'llama-3.1-70b', 'llama-3.1-405b', 'qwen2.5-7b', 'qwen2.5-72b', 'h100', 'h200', 'a100', 'b200',
    'nvlink4', 'ib-ndr', 'pcie5']) {
    assert.match(out, new RegExp(`^ {2}${id.replace(/\./g, '\\.')} `, 'm'), id);
  }
  assert.match(out, /CONDUIT_SIM_MODEL/);
  for (const sub of ['lifecycle', 'decode-sweep', 'kv-tiers']) assert.match(out, new RegExp(`^conduit sim ${sub} options:$`, 'm'), sub);
  assert.match(out, /--host-tier/);
  assert.equal((await run(['sim'])).code, 2);
});

test('conduit sim lifecycle prints the cold/warm table and the engine agrees with it', async () => {
  const { code, out } = await run(['sim', 'lifecycle', '--model', 'llama-3.1-70b', '--gpu', 'h100', '--tp', '4', '--prompt', '1024']);
  assert.equal(code, 0);
  assert.match(out, /^phase +cold ms +warm ms +saved ms +note/m);
  assert.match(out, /warm: 1008-token prefix hit, 16 tokens computed/);
  const coldPrefill = firstNumberAfter(out, /^prefill_execution/);
  const engineCold = Number(/cold: 0 cached tokens, engine TTFT ([\d.]+) ms/.exec(out)![1]);
  assert.equal(engineCold, coldPrefill);
  assert.equal(out.match(/ {2}ok$/gm)?.length, 2);
});

test('conduit sim lifecycle, disaggregated with a partial-block hit, says which hit the engine checked', async () => {
  const { code, out } = await run(['sim', 'lifecycle', '--prompt', '1024', '--cached', '1000', '--link', 'ib-ndr']);
  assert.equal(code, 0);
  assert.match(out, /disaggregated, KV over 4 x InfiniBand NDR/);
  // The lifecycle table: the transfer comes after the first token (the prefill worker streams it); the path table
  // beside it puts the transfer on the way to the second token, and both tables have the one cold TTFT.
  assert.match(out, /^kv_transfer +0\.00 +0\.00 +0\.00 /m);
  assert.match(out, /^kv_transfer +0\.00 +[1-9][\d.]* +[1-9]/m);
  const coldTtft = /^TTFT +([\d.]+) /m.exec(out)![1];
  assert.match(out, new RegExp(`^TTFT +${coldTtft!.replace('.', '\\.')} +${coldTtft!.replace('.', '\\.')} +0\\.00 +first token written`, 'm'));
  assert.match(out, /warm: 992 cached tokens/); // 1000 rounded down to 62 whole blocks of 16
});

test('conduit sim decode-sweep prints ITL per batch and the engine agrees row by row', async () => {
  const { code, out } = await run(['sim', 'decode-sweep', '--model', 'llama-3.1-8b', '--tp', '1', '--context', '128', '--batches', '1,8']);
  assert.equal(code, 0);
  assert.match(out, /^batch +ITL ms +tok\/s/m);
  assert.match(out, /decode at context 128 tokens/);
  const rows = out.split('\n').filter((l) => /^ +(1|8) +[\d.]+ +[\d.]+ +ok$/.test(l));
  assert.equal(rows.length, 2);
  for (const row of rows) {
    const [, model, engine] = row.trim().split(/\s+/);
    assert.equal(model, engine);
  }
});

test('conduit sim decode-sweep counts KV capacity in whole blocks, as the simulated worker `conduit serve --engine sim` runs', async () => {
  // 4 x H100 hold 513,092 tokens of Llama 3.1 70B KV: 32,068 blocks of 16 (513,088 tokens), 16,034 of 32 (513,088).
  // Llama 3.1 8B on one H100 holds 467,292: 3,650 blocks of 128 (467,200 tokens).
  for (const [args, worker, blockSize] of [
    [[], { model: LLAMA_3_1_70B, hw: H100_SXM, tp: 4 }, 16],
    [['--block-size', '32'], { model: LLAMA_3_1_70B, hw: H100_SXM, tp: 4 }, 32],
    [['--model', 'llama-3.1-8b', '--tp', '1', '--block-size', '128'], { model: LLAMA_3_1_8B, hw: H100_SXM, tp: 1 }, 128],
  ] as const) {
    const { code, out, err } = await run(['sim', 'decode-sweep', '--batches', '1', '--no-check', ...args]);
    assert.equal(code, 0, err);
    const served = new SimWorker({ ...worker, blockSize }).info.kvCapacityTokens;
    assert.equal(served % blockSize, 0);
    assert.match(out, new RegExp(`; KV capacity ${served} tokens \\(${served / blockSize} blocks of ${blockSize}\\)$`, 'm'), args.join(' '));
  }
});

test('--calibration measured (twin CONDUIT_SIM_CALIBRATION / CONDUIT_PLAN_CALIBRATION) slows the tables to the fitted factors', async () => {
  const argv = ['sim', 'decode-sweep', '--model', 'llama-3.1-8b', '--tp', '1', '--context', '1024', '--batches', '1'];
  const itl = (out: string) => Number(/^\s+1\s+([\d.]+)\s/m.exec(out)![1]);
  const roofline = await run(argv);
  const measured = await run([...argv, '--calibration', 'measured']);
  assert.equal(roofline.code, 0);
  assert.equal(measured.code, 0, measured.err);
  assert.match(roofline.out, /^calibration: roofline$/m);
  assert.match(measured.out, /^calibration: measured$/m);
  assert.match(measured.out, /elementwise passes 41\.7 hidden \/ 2\.91 FFN, layer floor 42\.1 us/);
  assert.match(measured.out, /elementwise ms/);
  assert.doesNotMatch(roofline.out, /elementwise/);
  // The engine cross-check runs with the same factors (it would print MISMATCH and exit 1 otherwise).
  assert.doesNotMatch(measured.out, /MISMATCH/);
  assert.ok(itl(measured.out) > itl(roofline.out), `${itl(measured.out)} vs ${itl(roofline.out)}`);

  const lifecycle = await run(['sim', 'lifecycle', '--prompt', '512']);
  const previous = process.env.CONDUIT_SIM_CALIBRATION;
  process.env.CONDUIT_SIM_CALIBRATION = 'measured';
  try {
    const viaEnv = await run(['sim', 'lifecycle', '--prompt', '512']);
    assert.equal(viaEnv.code, 0, viaEnv.err);
    assert.match(viaEnv.out, /^calibration: measured$/m);
    assert.match(viaEnv.out, /norms, activations, layer floor/);
    assert.doesNotMatch(lifecycle.out, /norms, activations, layer floor/);
  } finally {
    if (previous === undefined) delete process.env.CONDUIT_SIM_CALIBRATION;
    else process.env.CONDUIT_SIM_CALIBRATION = previous;
  }

  assert.equal(planOptionsFromFlags(['--rate', '1'], {})!.efficiency, DEFAULT_EFFICIENCY);
  assert.equal(planOptionsFromFlags(['--rate', '1'], { CONDUIT_PLAN_CALIBRATION: 'measured' })!.efficiency, MEASURED_EFFICIENCY.h100);
  assert.equal(planOptionsFromFlags(['--rate', '1', '--gpu', 'h200', '--calibration', 'measured'], {})!.efficiency,
    MEASURED_EFFICIENCY.h200);
  const bad = await run(['sim', 'lifecycle', '--calibration', 'fast']);
  assert.equal(bad.code, 2);
  assert.match(bad.err, /unknown simulator calibration "fast"; known: roofline, measured/);
});

test('efficiency flags override the calibration: every factor at 100% reproduces the 59.2 ms prefill of docs/simulator.md', async () => {
  const full = ['--matmul-mfu', '1', '--attention-mfu', '1', '--hbm-utilization', '1', '--comm-efficiency', '1', '--step-overhead-ms', '0'];
  const { code, out, err } = await run(['sim', 'lifecycle', '--tp', '8', '--prompt', '2048', ...full]);
  assert.equal(code, 0, err);
  assert.match(out, /efficiency: matmul MFU 1, attention MFU 1, HBM 1, comm 1, step overhead 0 ms/);
  assert.match(out, /^prefill_execution\s+59\.24\s/m);
  assert.match(out, /one layer of the 2048-token prefill, per GPU:/);
  const seed = await run(['sim', 'lifecycle', ...full]);
  assert.match(seed.out, /one layer of the 1024-token prefill, per GPU, next to seed 001:/);
  assert.match(seed.out, /^MLP gate \+ up\s+243\.1\s+compute\s+243\.1\s+70\.1\s+150\s+yes$/m);
  // Seed 001 measured 4 x H100 with BF16 KV: another GPU's or an FP8 cache's layer is not set beside its figures.
  for (const other of [['--gpu', 'b200'], ['--gpu', 'h200'], ['--kv-bytes', '1']]) {
    const notSeed = await run(['sim', 'lifecycle', '--no-check', ...full, ...other]);
    assert.equal(notSeed.code, 0, notSeed.err);
    assert.match(notSeed.out, /one layer of the 1024-token prefill, per GPU:/, other.join(' '));
    assert.doesNotMatch(notSeed.out, /seed 001/, other.join(' '));
  }
  const bad = await run(['sim', 'lifecycle', '--hbm-utilization', '1.5']);
  assert.equal(bad.code, 2);
  assert.match(bad.err, /--hbm-utilization must be in \(0, 1\], got 1\.5/);
  assert.equal(planOptionsFromFlags(['--rate', '1'], { CONDUIT_PLAN_MATMUL_MFU: '0.5' })!.efficiency!.matmulMfu, 0.5);
});

test('usage errors exit 2 and name what is wrong', async () => {
  const unknown = await run(['sim', 'lifecycle', '--model', 'gpt-9']);
  assert.equal(unknown.code, 2);
  assert.match(unknown.err, /unknown model "gpt-9"; known: llama-3\.1-8b/);
  const tp = await run(['sim', 'decode-sweep', '--tp', '3']);
  assert.equal(tp.code, 2);
  assert.match(tp.err, /do not divide over tp 3/);
  assert.equal((await run(['sim', 'warp'])).code, 2);
  const noRate = await run(['plan']);
  assert.equal(noRate.code, 2);
  assert.match(noRate.err, /--rate is required/);
  // Names of built-in object properties are no profile (they hung or printed NaN).
  for (const [argv, message] of [
    [['sim', 'lifecycle', '--link', 'constructor'], /unknown link "constructor"/],
    [['sim', 'lifecycle', '--gpu', '__proto__'], /unknown GPU "__proto__"/],
    [['plan', '--rate', '1', '--model', 'toString'], /unknown model "toString"/],
    [['sim', 'kv-tiers', '--host-tier', 'toString'], /--host-tier must be one of/],
    // --parallel-links means nothing without --link: refused either way, not accepted (0 included) without it.
    [['sim', 'lifecycle', '--parallel-links', '0', '--no-check'], /^conduit sim: --parallel-links: only for a disaggregated deployment \(give --link too\)$/],
    [['sim', 'lifecycle', '--parallel-links', '2'], /--parallel-links: only for a disaggregated deployment/],
    [['sim', 'lifecycle', '--parallel-links', '0', '--link', 'ib-ndr'], /--parallel-links must be a whole number >= 1, got 0/],
    // No upper bound: 10^12 links priced the transfer at nothing, a rank of 10^9 steps of hours.
    [['sim', 'lifecycle', '--parallel-links', '1e12', '--link', 'ib-ndr', '--no-check'],
      /^conduit sim: --parallel-links must be at most 8 \(a link per GPU of the node, which holds 8 H100 SXM5 80GB\), got 1000000000000$/],
    [['sim', 'lifecycle', '--parallel-links', '9', '--link', 'ib-ndr', '--no-check'], /--parallel-links must be at most 8 /],
    [['sim', 'decode-sweep', '--lora-adapters', '4', '--lora-rank', '1e9', '--batches', '1', '--no-check'],
      /^conduit sim: --lora-rank must be at most 8192 \(the hidden size of Llama 3\.1 70B\), got 1000000000$/],
    [['sim', 'decode-sweep', '--model', 'llama-3.1-8b', '--tp', '1', '--lora-adapters', '1', '--lora-rank', '4097', '--batches', '1', '--no-check'],
      /--lora-rank must be at most 4096 \(the hidden size of Llama 3\.1 8B\), got 4097/],
    // A warm hit of the whole prompt or more (it was cut to the prompt less one token without a word).
    [['sim', 'lifecycle', '--cached', '5000', '--no-check'],
      /^conduit sim: --cached must be at most 1023 with --prompt 1024 \(the last prompt token is always computed\), got 5000$/],
    [['sim', 'lifecycle', '--prompt', '512', '--cached', '512'], /--cached must be at most 511 with --prompt 512/],
    // Dtype sizes by their flag's name (the profile's field name was printed).
    [['sim', 'lifecycle', '--weight-bytes', '0'], /^conduit sim: --weight-bytes must be 2 \(BF16\), 1 \(FP8\) or 0\.5 \(INT4\), got 0$/],
    [['sim', 'decode-sweep', '--kv-bytes', '-1'], /^conduit sim: --kv-bytes must be 2 \(BF16\) or 1 \(FP8\), got -1$/],
    [['plan', '--rate', '1', '--weight-bytes', '0'], /^conduit plan: --weight-bytes must be 2 \(BF16\), 1 \(FP8\) or 0\.5 \(INT4\), got 0$/],
    // decode-sweep's context, as lifecycle's and kv-tiers' prompts, within the simulated context (1e9 was accepted).
    [['sim', 'decode-sweep', '--context', '1000000000', '--batches', '1', '--no-check'],
      /^conduit sim: --context \(1000000000 tokens, plus 2 of output\) does not fit the simulated context of 131072 tokens$/],
    [['sim', 'decode-sweep', '--context', '131071', '--batches', '1'], /does not fit the simulated context/],
    // Arguments that are no option (they were ignored).
    [['plan', 'stray', '--rate', '1'], /^conduit plan: unexpected argument "stray"$/],
    [['sim', 'lifecycle', 'stray'], /^conduit sim: unexpected argument "stray"$/],
    [['sim', 'decode-sweep', '--batches', '1', 'stray'], /^conduit sim: unexpected argument "stray"$/],
    // A batch of a billion sequences, each built to be priced: the sweep never finished.
    [['sim', 'decode-sweep', '--batches', '1,1000000000', '--no-check'],
      /^conduit sim: --batches expects batches of at most 1048576 sequences, got "1000000000"$/],
    [['sim', 'kv-tiers', 'stray'], /^conduit sim: unexpected argument "stray"$/],
    // Requests the simulated context cannot hold are refused before anything runs.
    [['sim', 'lifecycle', '--prompt', '200000'], /--prompt \(200000 tokens, plus 1 of output\) does not fit the simulated context of 131072 tokens/],
    [['sim', 'kv-tiers', '--prompt', '600000'], /does not fit the simulated context/],
    [['plan', '--rate', '0.01', '--isl', '200000', '--osl', '4'], /--isl with --osl \(200000 tokens, plus 4 of output\) does not fit/],
    // Llama 3.1 70B on 2 x H100 at 90% of 80 GiB: 77,309,411,328 B less 70,553,706,496 B of weights per GPU (half of
    // 70,553,706,496 params x 2 B) leaves 6,755,704,832 B, 41,233 tokens of 163,840 B (4 KV heads per GPU): 2,577 blocks
    // of 16, so sequences of at most 41,233 tokens. Such requests were cut short (2a) or refused (2b) in simulation.
    [['plan', '--model', 'llama-3.1-70b', '--tp', '2', '--isl', '40000', '--osl', '2000', '--rate', '0.1'],
      /^conduit plan: --isl with --osl: 40000 prompt \+ 2000 output tokens do not fit one worker .* at most 41233 tokens .*; use a larger --tp or a shorter request$/],
    [['plan', '--model', 'llama-3.1-70b', '--tp', '2', '--isl', '40000', '--osl', '1234', '--rate', '0.1'], /at most 41233 tokens/],
    [['plan', '--model', 'llama-3.1-70b', '--tp', '2', '--isl', '50000', '--osl', '2000', '--rate', '0.1'], /at most 41233 tokens/],
    // A step budget no deployment has (it ran out of memory pricing one step per token of it).
    [['plan', '--rate', '1', '--max-num-batched-tokens', '100000000'], /--max-num-batched-tokens must be at most 1048576/],
    // As many simulated requests as no run holds (V8 stopped the process growing their array: a native crash).
    [['plan', '--rate', '1', '--requests', '1e12'], /^conduit plan: --requests must be at most 50000, got 1000000000000$/],
    // Worker that cannot exist or cannot hold the prompt (see the 41,233-token limit above): refused before any table,
    // with or without the engine check (the check died after the tables; kv-tiers printed them and exited 0).
    [['sim', 'lifecycle', '--model', 'llama-3.1-70b', '--tp', '2', '--prompt', '50000'],
      /^conduit sim: --prompt: 50000 prompt \+ 1 output tokens do not fit one worker of Llama 3\.1 70B on 2 x H100.* at most 41233 tokens .*; use a larger --tp or a shorter request$/],
    [['sim', 'lifecycle', '--model', 'llama-3.1-70b', '--tp', '2', '--prompt', '41233', '--no-check'], /at most 41233 tokens/],
    [['sim', 'lifecycle', '--model', 'llama-3.1-70b', '--tp', '1'],
      /^conduit sim: --model: Llama 3\.1 70B on 1 x H100 SXM5 80GB: the weights leave no HBM for the KV cache; use a larger --tp or a --gpu with more memory$/],
    [['sim', 'lifecycle', '--model', 'llama-3.1-70b', '--tp', '1', '--no-check'], /the weights leave no HBM/],
    [['sim', 'kv-tiers', '--model', 'llama-3.1-70b', '--tp', '1'], /the weights leave no HBM/],
    [['sim', 'kv-tiers', '--model', 'llama-3.1-70b', '--tp', '2', '--prompt', '50000'], /at most 41233 tokens/],
    // kv-tiers' worker holds the prompt, 2 output tokens and a few spare blocks: ceil((41,220 + 32) / 16) + 2 = 2,581
    // blocks, more than the 2,577 the deployment has. The refusal names the longest prompt that does run,
    // (2,577 - 2) x 16 - 32 = 41,168 tokens (below the 41,233 of lifecycle, which keeps no spare blocks).
    [['sim', 'kv-tiers', '--model', 'llama-3.1-70b', '--tp', '2', '--prompt', '41220'],
      /^conduit sim: --prompt: a 41220-token prompt does not fit one worker .* needs 2581 KV blocks of 16 tokens .* the pool holds 2577, enough for a prompt of at most 41168 tokens; use a larger --tp or a shorter prompt$/],
    [['sim', 'kv-tiers', '--model', 'llama-3.1-70b', '--tp', '2', '--prompt', '41169'],
      /needs 2578 KV blocks of 16 tokens .* the pool holds 2577, enough for a prompt of at most 41168 tokens;/],
  ] as const) {
    await assertRefusedBeforeOutput([...argv], message);
  }
});

test('refused before any table: dtype widths no dtype has, a deployment whose weights do not fit, a kv-tiers prompt with no block for a tier', async () => {
  for (const [argv, message] of [
    // --weight-bytes and --kv-bytes name a dtype: 3 and 100 bytes per weight were priced as such.
    [['sim', 'decode-sweep', '--weight-bytes', '3', '--no-check'], /^conduit sim: --weight-bytes must be 2 \(BF16\), 1 \(FP8\) or 0\.5 \(INT4\), got 3$/],
    [['sim', 'kv-tiers', '--weight-bytes', '100'], /^conduit sim: --weight-bytes must be .*, got 100$/],
    [['sim', 'lifecycle', '--kv-bytes', '4', '--no-check'], /^conduit sim: --kv-bytes must be 2 \(BF16\) or 1 \(FP8\), got 4$/],
    [['plan', '--rate', '1', '--weight-bytes', '3'], /^conduit plan: --weight-bytes must be .*, got 3$/],
    // decode-sweep too (it printed a table with "KV capacity 0 tokens", then exited 0 with --no-check, which skips
    // only the engine cross-check, and 2 without).
    [['sim', 'decode-sweep', '--model', 'llama-3.1-70b', '--tp', '1', '--batches', '1', '--no-check'],
      /^conduit sim: --model: Llama 3\.1 70B on 1 x H100[^\n]*: the weights leave no HBM for the KV cache; use a larger --tp or a --gpu with more memory$/],
    [['sim', 'decode-sweep', '--model', 'llama-3.1-70b', '--tp', '1'], /^conduit sim: [^\n]*the weights leave no HBM/],
    // FP8 weights of 405B (405.9e9 bytes) on 4 x H100 (4 x 77.3e9 bytes at 90%): they do not fit either.
    [['sim', 'decode-sweep', '--model', 'llama-3.1-405b', '--tp', '4', '--weight-bytes', '1', '--no-check'], /the weights leave no HBM/],
    // A prompt of one block or less has no block a lower tier could serve (its rows were the HBM row's).
    [['sim', 'kv-tiers', '--prompt', '16'],
      /^conduit sim: --prompt: a 16-token prompt has no whole KV block of 16 tokens before its last token, so no part of it can come from host RAM or NVMe/],
  ] as const) {
    await assertRefusedBeforeOutput([...argv], message);
  }
  // The widths that are dtypes still run: INT4 weights of 70B fit one H100 (35.3e9 bytes), FP8 KV.
  const int4 = await run(['sim', 'decode-sweep', '--model', 'llama-3.1-70b', '--tp', '1', '--weight-bytes', '0.5', '--kv-bytes', '1', '--batches', '1']);
  assert.equal(int4.code, 0, int4.err);
  assert.match(int4.out, /^ +1 +[\d.]+ +[\d.]+ +ok$/m);
  // The longest kv-tiers prompt a refusal names does run: every lower-tier block of it onboarded.
  const longest = await run(['sim', 'kv-tiers', '--model', 'llama-3.1-70b', '--tp', '2', '--prompt', '41168']);
  assert.equal(longest.code, 0, longest.err);
  assert.match(longest.out, /^\| host DRAM [^|]*\| [\d.]+ \| 41152 \| 2572 \|/m);
});

test('conduit sim lifecycle: a CONDUIT_SIM_PARALLEL_LINKS without --link is ignored with a warning; --cached up to the prompt less one token', async () => {
  const ignored = await run(['sim', 'lifecycle', '--no-check'], { CONDUIT_SIM_PARALLEL_LINKS: '2' });
  assert.equal(ignored.code, 0, ignored.err);
  assert.equal(ignored.err, 'conduit sim: ignoring CONDUIT_SIM_PARALLEL_LINKS=2: --parallel-links is only for a disaggregated deployment (give --link too)');
  const applied = await run(['sim', 'lifecycle', '--no-check', '--link', 'ib-ndr'], { CONDUIT_SIM_PARALLEL_LINKS: '2' });
  assert.equal(applied.code, 0, applied.err);
  assert.match(applied.out, /KV over 2 x InfiniBand NDR/);
  const all = await run(['sim', 'lifecycle', '--cached', '1023', '--no-check']);
  assert.equal(all.code, 0, all.err);
  assert.match(all.out, /warm: 1023-token prefix hit, 1 token computed/);
});

test('conduit sim lifecycle counts one token, one cached token and one block in the singular', async () => {
  // A one-token prompt moves one block to the decode worker; a two-token prompt with one cached token computes one.
  const one = await run(['sim', 'lifecycle', '--prompt', '1', '--link', 'ib-ndr']);
  assert.equal(one.code, 0, one.err);
  assert.match(one.out, /prompt 1 token, disaggregated/);
  assert.match(one.out, /prompt 1 token, cold: aggregated vs disaggregated/);
  assert.match(one.out, /warm: 0-token prefix hit, 1 token computed/);
  assert.match(one.out, /^tokenize .* 1 token at \d+ tokens\/s$/m);
  assert.match(one.out, /^prefill_execution .* 1 token on the prefill worker,/m);
  assert.match(one.out, /^kv_transfer .* 1 block \(/m);
  assert.match(one.out, /, 1 block moved {2}ok$/m);
  const cachedOne = await run(['sim', 'lifecycle', '--prompt', '2', '--cached', '1', '--block-size', '1']);
  assert.equal(cachedOne.code, 0, cachedOne.err);
  assert.match(cachedOne.out, /^ {2}warm: 1 cached token, engine TTFT/m);
  for (const { out } of [one, cachedOne]) assert.doesNotMatch(out, /\b1 (cached )?(token|block)s\b/);
});

test('conduit sim decode-sweep and kv-tiers count one token, one LoRA adapter and one block in the singular', async () => {
  const sweep = await run(['sim', 'decode-sweep', '--context', '1', '--lora-adapters', '1', '--batches', '1', '--no-check']);
  assert.equal(sweep.code, 0, sweep.err);
  assert.match(sweep.out, /decode at context 1 token; KV capacity \d+ tokens/);
  assert.match(sweep.out, /; 1 LoRA adapter of rank 16 /);
  // 17 tokens on 70B: one whole block before the last token, which NVMe is too slow to serve, so it is recomputed.
  const tiers = await run(['sim', 'kv-tiers', '--prompt', '17']);
  assert.equal(tiers.code, 0, tiers.err);
  assert.match(tiers.out, /^\(NVMe Gen4 x4 SSD: 1 block held there was recomputed instead, the cost model finding it slower/m);
  for (const { out } of [sweep, tiers]) assert.doesNotMatch(out, /\b1 (token|block|LoRA adapter)s\b/);
});

test('conduit sim decode-sweep: --lora-rank without --lora-adapters is refused typed, ignored with a warning from the environment', async () => {
  await assertRefusedBeforeOutput(['sim', 'decode-sweep', '--lora-rank', '64', '--batches', '1', '--no-check'],
    /^conduit sim: --lora-rank: only with LoRA adapters \(give --lora-adapters N > 0 too\)$/);
  // CONDUIT_SIM_LORA_RANK is also serve's --sim-lora-rank: a serving environment does not stop a sweep without adapters.
  const ignored = await run(['sim', 'decode-sweep', '--batches', '1', '--no-check'], { CONDUIT_SIM_LORA_RANK: '8' });
  assert.equal(ignored.code, 0, ignored.err);
  assert.equal(ignored.err, 'conduit sim: ignoring CONDUIT_SIM_LORA_RANK=8: --lora-rank is only with LoRA adapters (give --lora-adapters N > 0 too)');
  const applied = await run(['sim', 'decode-sweep', '--batches', '1', '--lora-adapters', '1', '--no-check'], { CONDUIT_SIM_LORA_RANK: '8' });
  const typed = await run(['sim', 'decode-sweep', '--batches', '1', '--lora-adapters', '1', '--lora-rank', '8', '--no-check']);
  assert.equal(applied.code, 0, applied.err);
  assert.equal(applied.err, '');
  assert.equal(applied.out, typed.out, 'the variable gives the rank as the flag does');
});

test('conduit plan prints the tried worker counts and the answer', async () => {
  const { code, out } = await run(['plan', '--model', 'llama-3.1-8b', '--gpu', 'h100', '--tp', '1', '--rate', '0.5', '--isl', '128',
    '--osl', '16', '--requests', '40', '--ttft-p99', '100', '--itl-p99', '50']);
  assert.equal(code, 0);
  assert.match(out, /^workers +GPUs +TTFT p50 ms +TTFT p99 ms +ITL p50 ms +ITL p99 ms/m);
  assert.match(out, /^ +1 +1 +[\d.]+ +[\d.]+ +[\d.]+ +[\d.]+ +\d+ +yes$/m);
  assert.match(out, /answer: 1 worker\(s\) x tp 1 = 1 GPU\(s\)/);
  // A TTFT target under one idle prefill step cannot be met by any number of workers: exit 1.
  const impossible = await run(['plan', '--rate', '1', '--isl', '128', '--ttft-p99', '1']);
  assert.equal(impossible.code, 1);
  assert.match(impossible.out, /answer: none \(no worker count can/);
});

test('conduit plan stops at the worker count it can simulate in memory, with the reason, instead of crashing', async () => {
  // 100,000 req/s needs 2,418 workers of Llama 3.1 8B on H100 (29,205 KV blocks each): 70 million simulated blocks,
  // which ran the process out of memory (a native crash, no message) once --max-workers allowed it.
  const plan = await run(['plan', '--rate', '1e5', '--max-workers', '1e12']);
  assert.equal(plan.code, 1, plan.err);
  assert.match(plan.out, /^answer: none \(throughput alone needs 2418 workers; more than 684 workers of 29205 KV blocks each cannot be simulated in memory\)$/m);
});

test('conduit plan says which TTFT --ttft-p99 is checked against: the workers\', without the gateway phases sim lifecycle adds', async () => {
  const plan = await run(['plan', '--rate', '0.5', '--isl', '128', '--osl', '16', '--requests', '40']);
  assert.equal(plan.code, 0, plan.err);
  const note = /^TTFT below: from a request reaching a worker to its first token \(queueing and prefill\), the one the p99 TTFT target is checked against; the gateway's phases, which conduit sim lifecycle's TTFT includes, add ([\d.]+) ms at 128 prompt tokens, not included$/m.exec(plan.out);
  assert.ok(note, plan.out);
  // The same deployment's lifecycle: its cold TTFT less the worker's phases (queue and prefill) is what the note says.
  const lifecycle = await run(['sim', 'lifecycle', '--model', 'llama-3.1-8b', '--tp', '1', '--prompt', '128', '--no-check']);
  assert.equal(lifecycle.code, 0, lifecycle.err);
  const gatewayMs = firstNumberAfter(lifecycle.out, /^TTFT/) - firstNumberAfter(lifecycle.out, /^prefill_execution/)
    - firstNumberAfter(lifecycle.out, /^scheduler_queue/);
  assert.ok(Math.abs(Number(note[1]) - gatewayMs) <= 0.011, `${note[1]} vs ${gatewayMs}`);
  assert.equal(firstNumberAfter(plan.out, /^idle worker: TTFT/), firstNumberAfter(lifecycle.out, /^prefill_execution/),
    'the idle worker\'s TTFT is the prefill alone');
  assert.match(readFileSync(new URL('../../docs/simulator.md', import.meta.url), 'utf8'), /The TTFT it simulates, checks `--ttft-p99` against and prints is the workers'/);
});

test('plan flags have CONDUIT_PLAN_ twins, and serve\'s CONDUIT_MODEL (a file path) is not read', () => {
  const fromEnv = planOptionsFromFlags([], { CONDUIT_PLAN_RATE: '3', CONDUIT_PLAN_MODEL: 'qwen2.5-7b', CONDUIT_PLAN_TTFT_P99: '250' })!;
  assert.equal(fromEnv.ratePerSec, 3);
  assert.equal(fromEnv.model.id, 'qwen2.5-7b');
  assert.equal(fromEnv.ttftP99Ms, 250);
  const flagWins = planOptionsFromFlags(['--rate', '7'], { CONDUIT_PLAN_RATE: '3', CONDUIT_MODEL: '/models/x.gguf' })!;
  assert.equal(flagWins.ratePerSec, 7);
  assert.equal(flagWins.model.id, 'llama-3.1-8b');
});

test('docs/simulator.md names every option of conduit sim and conduit plan, and no option they lack', () => {
  const doc = readFileSync(new URL('../../docs/simulator.md', import.meta.url), 'utf8');
  const tables: Record<string, object> = {
    'sim lifecycle': LIFECYCLE_FLAGS, 'sim decode-sweep': DECODE_SWEEP_FLAGS, 'sim kv-tiers': KV_TIERS_FLAGS, plan: PLAN_FLAGS,
  };
  for (const [command, table] of Object.entries(tables)) {
    const missing = Object.keys(table).filter((flag) => flag !== 'help' && !new RegExp(`--(no-)?${flag}\\b`).test(doc));
    assert.deepEqual(missing, [], `conduit ${command}: in --help, not in docs/simulator.md`);
  }
  // The command lines the page shows (code spans, $ lines) take only their subcommand's options.
  const lines = [...doc.matchAll(/`(conduit (?:sim|plan) [^`]*)`/g)].map((m) => m[1]!.replace(/\s+/g, ' '))
    .concat([...doc.matchAll(/^\$ (conduit (?:sim|plan) .*)$/gm)].map((m) => m[1]!));
  let checked = 0;
  for (const line of lines) {
    const command = /^conduit (sim (?:lifecycle|decode-sweep|kv-tiers)|plan)\b/.exec(line)?.[1];
    if (command === undefined) continue;
    checked++;
    for (const [, , flag] of line.matchAll(/--(no-)?([a-z0-9-]+)/g)) {
      assert.ok(Object.hasOwn(tables[command]!, flag!), `conduit ${command} has no --${flag}: ${line}`);
    }
  }
  assert.ok(checked >= 5, `command lines found: ${checked}`);
});

test('the deployment\'s twins are shared with serve\'s --sim-* options, --sim-lora-rank with decode-sweep\'s --lora-rank', () => {
  const shared = { model: 'sim-model', gpu: 'sim-gpu', tp: 'sim-tp', calibration: 'sim-calibration', 'lora-rank': 'sim-lora-rank' } as const;
  for (const [flag, serveFlag] of Object.entries(shared)) {
    const twin = envName(serveFlag, SERVE_FLAGS[serveFlag]);
    assert.equal(envName(flag, (DECODE_SWEEP_FLAGS as FlagTable)[flag]), twin, `--${flag}`);
    assert.equal(envName(serveFlag, WORKER_FLAGS[serveFlag]), twin, `conduit worker --${serveFlag}`);
  }
});

test('a deployment that cannot exist or cannot hold the request: the refusal names the options that set it, by their variables when the environment gave them', async () => {
  const heads = 'Llama 3.1 8B: 32 attention heads do not divide over tp 3';
  const noHbm = 'Llama 3.1 70B on 1 x H100 SXM5 80GB: the weights leave no HBM for the KV cache';
  const tooLong = (request: string, tokens: string) => `${request}: ${tokens} do not fit one worker of Llama 3.1 70B on 2 x H100 SXM5 80GB: `
    + 'it holds sequences of at most 41233 tokens (KV pool 2577 blocks x 16 tokens, context 131072); use a larger --tp or a shorter request';
  const cases: [string[], Record<string, string>, string][] = [
    // Tensor parallelism the model does not split over (it named no option).
    [['sim', 'lifecycle', '--model', 'llama-3.1-8b', '--tp', '3'], {}, `conduit sim: --tp: ${heads}`],
    [['sim', 'lifecycle', '--model', 'llama-3.1-8b', '--no-check'], { CONDUIT_SIM_TP: '3' }, `conduit sim: CONDUIT_SIM_TP (--tp): ${heads}`],
    [['sim', 'decode-sweep', '--model', 'llama-3.1-8b'], { CONDUIT_SIM_TP: '3' }, `conduit sim: CONDUIT_SIM_TP (--tp): ${heads}`],
    [['sim', 'kv-tiers', '--model', 'llama-3.1-8b'], { CONDUIT_SIM_TP: '3' }, `conduit sim: CONDUIT_SIM_TP (--tp): ${heads}`],
    [['sim', 'lifecycle', '--model', 'llama-3.1-8b', '--tp', '16'], {},
      'conduit sim: --tp: tp 16 exceeds the 8 GPUs of one H100 SXM5 80GB node; tensor parallelism across nodes is not modelled'],
    [['plan', '--rate', '1', '--tp', '3'], {}, `conduit plan: --tp: ${heads}`],
    [['plan', '--rate', '1'], { CONDUIT_PLAN_TP: '3' }, `conduit plan: CONDUIT_PLAN_TP (--tp): ${heads}`],
    // Weights that leave no HBM for the KV cache: the model's option leads, tp's and the GPU's say what would help
    // (it named --sim-tp whatever the command, and no variable).
    [['sim', 'lifecycle', '--tp', '1'], {}, `conduit sim: --model: ${noHbm}; use a larger --tp or a --gpu with more memory`],
    [['sim', 'decode-sweep', '--no-check'], { CONDUIT_SIM_TP: '1' },
      `conduit sim: --model: ${noHbm}; use a larger CONDUIT_SIM_TP (--tp) or a --gpu with more memory`],
    [['sim', 'kv-tiers', '--tp', '1'], { CONDUIT_SIM_MODEL: 'llama-3.1-70b', CONDUIT_SIM_GPU: 'h100' },
      `conduit sim: CONDUIT_SIM_MODEL (--model): ${noHbm}; use a larger --tp or a CONDUIT_SIM_GPU (--gpu) with more memory`],
    [['plan', '--rate', '1'], { CONDUIT_PLAN_MODEL: 'llama-3.1-70b' },
      `conduit plan: CONDUIT_PLAN_MODEL (--model): ${noHbm}; use a larger --tp or a --gpu with more memory`],
    [['plan', '--rate', '1', '--model', 'llama-3.1-70b'], { CONDUIT_PLAN_TP: '1' },
      `conduit plan: --model: ${noHbm}; use a larger CONDUIT_PLAN_TP (--tp) or a --gpu with more memory`],
    // A request longer than the KV pool holds: led by the options that set its length.
    [['sim', 'lifecycle', '--model', 'llama-3.1-70b', '--tp', '2', '--no-check'], { CONDUIT_SIM_PROMPT: '50000' },
      `conduit sim: ${tooLong('CONDUIT_SIM_PROMPT (--prompt)', '50000 prompt + 1 output tokens')}`],
    [['sim', 'kv-tiers', '--model', 'llama-3.1-70b', '--tp', '2', '--prompt', '50000'], {},
      `conduit sim: ${tooLong('--prompt', '50000 prompt + 1 output tokens')}`],
    [['plan', '--rate', '0.1', '--model', 'llama-3.1-70b', '--tp', '2', '--osl', '2000'], { CONDUIT_PLAN_ISL: '40000' },
      `conduit plan: ${tooLong('CONDUIT_PLAN_ISL (--isl) with --osl', '40000 prompt + 2000 output tokens')}`],
    [['sim', 'kv-tiers', '--model', 'llama-3.1-70b', '--tp', '2'], { CONDUIT_SIM_PROMPT: '41220' },
      'conduit sim: CONDUIT_SIM_PROMPT (--prompt): a 41220-token prompt does not fit one worker of Llama 3.1 70B on 2 x H100 SXM5 80GB: '
      + 'the measurement needs 2581 KV blocks of 16 tokens (the prompt, its output and a few spare blocks), the pool holds 2577, enough for a prompt of at most 41168 tokens; '
      + 'use a larger --tp or a shorter prompt'],
    // The calibration (it named no option).
    [['sim', 'lifecycle', '--no-check'], { CONDUIT_SIM_CALIBRATION: 'x' },
      'conduit sim: CONDUIT_SIM_CALIBRATION (--calibration): unknown simulator calibration "x"; known: roofline, measured'],
    [['plan', '--rate', '1', '--calibration', 'x'], {}, 'conduit plan: --calibration: unknown simulator calibration "x"; known: roofline, measured'],
  ];
  for (const [argv, env, message] of cases) {
    const result = await run(argv, env);
    const what = `${argv.join(' ')} ${JSON.stringify(env)}`;
    assert.equal(result.code, 2, `${what}: ${result.err}`);
    assert.equal(result.err, message, what);
    assert.equal(result.out, '', `${what}: nothing printed before the refusal`);
  }
});
