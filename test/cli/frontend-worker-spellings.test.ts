// `conduit frontend` refuses a worker's option however it is spelt: its short alias (-m) and its negation
// (--no-enable-prefix-caching) as well as --model and --enable-prefix-caching=false, by name and before anything
// connects; an option the gateway does not know is refused too. The command runs as a child process (a frontend that
// took one would wait for its services), each wait bounded.
import assert from 'node:assert/strict';
import { after, test } from 'node:test';
import { startConduit, stopAll } from '../helpers/cluster-services.ts';

// Unreachable services: every case is refused before a connection is tried.
const SERVICES = ['--cluster-token', 't', '--etcd-endpoints', 'http://127.0.0.1:1', '--nats-server', 'nats://127.0.0.1:1', '--port', '0'];

after(stopAll);

async function run(args: string[]): Promise<{ code: number | string; output: string }> {
  const proc = startConduit(['frontend', ...args, ...SERVICES]);
  let timer: NodeJS.Timeout | undefined;
  const code = await Promise.race([proc.exited, new Promise<string>((resolve) => { timer = setTimeout(() => resolve('still running'), 20_000); })]);
  clearTimeout(timer);
  proc.kill('SIGKILL');
  return { code, output: proc.output() };
}

test('conduit frontend refuses worker options given by their short alias or as a negation', async () => {
  const cases: [string[], RegExp][] = [
    [['-m', '/models/m.gguf'], /conduit frontend: -m \(--model\) is a worker option \(conduit worker\), not a frontend's/],
    [['--no-enable-prefix-caching'], /conduit frontend: --no-enable-prefix-caching is a worker option \(conduit worker\), not a frontend's/],
    [['--no-guided-jump-forward'], /conduit frontend: --no-guided-jump-forward is a worker option/],
    [['--enable-prefix-caching=false'], /conduit frontend: --enable-prefix-caching is a worker option/],
  ];
  for (const [args, message] of cases) {
    const { code, output } = await run(args);
    assert.equal(code, 2, `${args.join(' ')}:\n${output}`);
    assert.match(output, message);
  }
});

test('conduit frontend reads an option\'s value as a value, and refuses what the gateway does not know', async () => {
  // "-m" here is --api-keys' value (a key), not --model: what follows it is the unknown option.
  const { code, output } = await run(['--api-keys', '-m', '--not-an-option']);
  assert.equal(code, 2, output);
  assert.match(output, /conduit frontend: unknown option --not-an-option/);
});
