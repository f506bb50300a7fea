// Every option of every command has an environment twin (but --help, and the internal `conduit worker
// --parent-ipc`): `--help` names it, and the command reads it. The commands and their options are walked from the
// help text itself (`conduit --help` lists the commands, `conduit sim --help` the subcommands), so a command or an
// option added later is covered without touching this test. A twin is shown to be read by giving it a value its
// option cannot take (a number's "not-a-number", a boolean's "maybe"): the command must refuse it under the
// variable's name (exit 2), or say it ignores it as inapplicable there; a stray argument after the options makes
// every command stop at its checks, whatever happens, so that nothing starts. A string option's twin has no value its
// type refuses; it is read by the same parse, of the same table, as the number and boolean twins of its command.
import assert from 'node:assert/strict';
import { describe, it } from 'node:test';
import { runCli } from '../helpers/cli-main.ts';

interface HelpOption { name: string; type: 'string' | 'number' | 'boolean'; twin: string | undefined; line: string }

/** The options a help text lists, with their types and the variable each names. */
function helpOptions(help: string): HelpOption[] {
  const options: HelpOption[] = [];
  for (const line of help.split('\n')) {
    const m = /^ {2}--([a-z0-9-]+)(?:, -\w)?(?: <(string|number)>)? .*?(?: \[env ([A-Z][A-Z0-9_]*)[^\]]*\])?$/.exec(line);
    if (m) options.push({ name: m[1]!, type: (m[2] as 'string' | 'number' | undefined) ?? 'boolean', twin: m[3], line });
  }
  return options;
}

/** Options no variable sets, by design (src/cli/flags.ts). */
const NO_TWIN = new Set(['help', 'parent-ipc']);

/** Each command as typed (sim's subcommands each on their own), from the help texts. */
async function commands(): Promise<string[][]> {
  const top = await runCli(['--help']);
  const names = top.out.slice(top.out.indexOf('Commands:')).split('\n').slice(1)
    .map((line) => /^ {2}([a-z]+)\b/.exec(line)?.[1]).filter((name): name is string => name !== undefined);
  assert.ok(names.length >= 9, top.out);
  const out: string[][] = [];
  for (const name of names) {
    if (name !== 'sim') { out.push([name]); continue; }
    const sim = await runCli(['sim', '--help']);
    const subs = /Usage: conduit sim <([^>]+)>/.exec(sim.out)![1]!.split('|').map((s) => s.trim());
    for (const sub of subs) out.push(['sim', sub]);
  }
  return out;
}

/**
 * Options that apply only beside others (the command ignores their variable otherwise, with a warning), and those
 * others: given on the command line for the probe so the variable is read.
 */
const DISAGGREGATED = ['--prefill-workers', '1', '--decode-workers', '1'];
const CONTEXT: Record<string, Record<string, string[]>> = {
  serve: {
    'disagg-min-remote-prefill-tokens': DISAGGREGATED, 'disagg-max-prefill-queue-tokens': DISAGGREGATED,
    'disagg-transfer-overhead-ms': DISAGGREGATED, 'disagg-compare-transfer': DISAGGREGATED,
  },
  'sim lifecycle': { 'parallel-links': ['--link', 'ib-ndr'] },
  'sim decode-sweep': { 'lora-rank': ['--lora-adapters', '2'] },
  bench: Object.fromEntries(['groups', 'system-prompt-tokens', 'question-tokens'].map((option) => [option, ['--workload', 'shared-prefix']])),
};

/**
 * The variable README.md ("Every option `--some-option` but `--help` has an environment twin") says an option of a
 * command has: CONDUIT_<OPTION>, CONDUIT_SIM_<OPTION> for sim, CONDUIT_PLAN_ for plan, CONDUIT_BENCH_ for bench, but
 * the shared CONDUIT_URL and CONDUIT_API_KEY of bench and trace, and trace's CONDUIT_TRACE_JSON and _TIMEOUT.
 */
function documentedTwin(command: readonly string[], option: string): string {
  const upper = option.replace(/-/g, '_').toUpperCase();
  const [name] = command;
  if ((name === 'bench' || name === 'trace') && (option === 'url' || option === 'api-key')) return `CONDUIT_${upper}`;
  if (name === 'trace' && (option === 'json' || option === 'timeout')) return `CONDUIT_TRACE_${upper}`;
  const prefix = name === 'sim' || name === 'plan' || name === 'bench' ? `${name.toUpperCase()}_` : '';
  return `CONDUIT_${prefix}${upper}`;
}

/** A value the option's type refuses. */
const UNTAKEABLE = { number: 'not-a-number', boolean: 'maybe' } as const;

describe('every option has an environment twin', () => {
  it('named by --help for every option of every command, as README.md names it', async () => {
    const missing: string[] = [];
    for (const command of await commands()) {
      const help = await runCli([...command, '--help']);
      assert.equal(help.code, 0, `${command.join(' ')} --help: ${help.err}`);
      const options = helpOptions(help.out);
      assert.ok(options.length > 0, `${command.join(' ')} --help lists no option:\n${help.out}`);
      for (const option of options) {
        if (NO_TWIN.has(option.name)) continue;
        if (option.twin === undefined) missing.push(`${command.join(' ')} --${option.name}: none`);
        else if (option.twin !== documentedTwin(command, option.name)) {
          missing.push(`${command.join(' ')} --${option.name}: ${option.twin}, README.md says ${documentedTwin(command, option.name)}`);
        }
      }
    }
    assert.deepEqual(missing, []);
  });

  it('read by the command: a value its option cannot take is refused (or ignored) under the variable\'s name', async () => {
    const unread: string[] = [];
    for (const command of await commands()) {
      const help = await runCli([...command, '--help']);
      for (const option of helpOptions(help.out)) {
        if (option.twin === undefined || option.type === 'string') continue;
        const context = CONTEXT[command.join(' ')]?.[option.name] ?? [];
        const stray = command[0] === 'trace' ? ['a-request-id', 'env-twin-probe'] : ['env-twin-probe'];
        const result = await runCli([...command, ...context, ...stray], { [option.twin]: UNTAKEABLE[option.type] });
        if (result.code !== 2 || !result.err.includes(option.twin)) unread.push(`${command.join(' ')} --${option.name} (${option.twin}): exit ${result.code}, ${result.err.split('\n')[0]}`);
      }
    }
    assert.deepEqual(unread, []);
  });
});
