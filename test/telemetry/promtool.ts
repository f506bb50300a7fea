// Runs Prometheus's promtool (Debian package `prometheus`) for the tests that check rules and exposition with the
// real tool. Tests skip with a message when it is not installed; CI installs it.
import { spawnSync } from 'node:child_process';

let found: boolean | undefined;

export function havePromtool(): boolean {
  found ??= spawnSync('promtool', ['--version'], { encoding: 'utf8' }).status === 0;
  return found;
}

export const PROMTOOL_MISSING = 'promtool not found: install Debian\'s "prometheus" package (apt-get install prometheus) to run this test';

export function promtool(args: string[], input?: string): { status: number; output: string } {
  const result = spawnSync('promtool', args, { encoding: 'utf8', ...(input !== undefined ? { input } : {}), timeout: 60_000 });
  if (result.error) throw result.error;
  return { status: result.status ?? -1, output: `${result.stdout ?? ''}${result.stderr ?? ''}` };
}
