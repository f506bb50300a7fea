// What `conduit serve` (and `conduit generate`) say when they cannot start: a file or address problem is one line
// naming the option and the cause, and a non-zero exit, never a Node stack trace; an option that would open the server
// to everyone (no keys, every interface) is refused. The CLI runs as a child process, as a user runs it.
import assert from 'node:assert/strict';
import { execFile, execFileSync } from 'node:child_process';
import { chmodSync, mkdirSync, mkdtempSync, rmSync, symlinkSync, writeFileSync } from 'node:fs';
import { createServer, type Server } from 'node:net';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { fileURLToPath } from 'node:url';
import { after, before, describe, it } from 'node:test';

const CONDUIT = fileURLToPath(new URL('../../bin/conduit.js', import.meta.url));

interface Run { code: number | null; stdout: string; stderr: string }

/** The environment of the test run without any CONDUIT_* variable, plus `env`. */
function cleanEnv(env: Record<string, string>): NodeJS.ProcessEnv {
  const base = Object.fromEntries(Object.entries(process.env).filter(([key]) => !key.startsWith('CONDUIT_')));
  return { ...base, ...env };
}

function conduit(args: string[], env: Record<string, string> = {}, user?: { uid: number; gid: number }): Promise<Run> {
  return new Promise((resolve) => {
    execFile(process.execPath, [CONDUIT, ...args], {
      timeout: 60_000, env: cleanEnv(env), ...(user ? { ...user, cwd: '/' } : {}),
    }, (err, stdout, stderr) => {
      resolve({ code: err ? (typeof err.code === 'number' ? err.code : null) : 0, stdout, stderr });
    });
  });
}

/** The run failed with `code`, its stderr one line `conduit <command>: ...` matching `pattern`, with no stack trace. */
function assertOneLine(run: Run, command: string, code: number, pattern: RegExp): void {
  assert.doesNotMatch(run.stderr, /\n\s+at |node:internal|^node:/m, `no stack trace, got:\n${run.stderr}`);
  assert.equal(run.code, code, `exit code; stderr:\n${run.stderr}`);
  const lines = run.stderr.trim().split('\n');
  assert.equal(lines.length, 1, `one line, got:\n${run.stderr}`);
  assert.match(lines[0]!, new RegExp(`^conduit ${command}: `));
  assert.match(lines[0]!, pattern);
}

/**
 * The run failed with `code` and a last line `conduit <command>: ...` matching `pattern`, with no stack trace (the
 * gateway's warnings, such as "no API keys configured", may come first: it is built before the port opens).
 */
function assertLastLine(run: Run, command: string, code: number, pattern: RegExp): void {
  assert.doesNotMatch(run.stderr, /\n\s+at |node:internal|^node:/m, `no stack trace, got:\n${run.stderr}`);
  assert.equal(run.code, code, `exit code; stderr:\n${run.stderr}`);
  const last = run.stderr.trim().split('\n').at(-1)!;
  assert.match(last, new RegExp(`^conduit ${command}: `), run.stderr);
  assert.match(last, pattern);
}

const SIM = ['serve', '--port', '0', '--host', '127.0.0.1', '--engine', 'sim'];
const NOBODY = { uid: 65534, gid: 65534 };
const notRoot = process.getuid?.() !== 0 ? 'needs root to run the CLI as user nobody (uid 65534) against a file it cannot read' : false;

describe('conduit serve refuses options that would open it to everyone', () => {
  it('an empty --api-keys is refused as "," is, not taken as no keys (open mode)', async () => {
    assertOneLine(await conduit([...SIM, '--api-keys', '']), 'serve', 2, /--api-keys .*holds no key: refusing to start open to everyone/);
    assertOneLine(await conduit([...SIM, '--api-keys=']), 'serve', 2, /holds no key/);
  });

  it('an empty CONDUIT_API_KEYS is refused too', async () => {
    assertOneLine(await conduit(SIM, { CONDUIT_API_KEYS: '' }), 'serve', 2, /CONDUIT_API_KEYS.* holds no key/);
  });

  for (const command of ['serve', 'frontend', 'worker']) {
    it(`conduit ${command}: an empty --host is refused (Node would listen on every interface)`, async () => {
      const extra = command === 'serve' ? ['--engine', 'sim', '--port', '0'] : [];
      for (const host of [['--host', ''], ['--host='], ['--host', ' ']]) {
        assertOneLine(await conduit([command, ...host, ...extra]), command, 2, /--host needs an address \(0\.0\.0\.0 or :: for every interface\)/);
      }
    });
  }
});

describe('conduit serve: a file an option names that cannot be used is one line', () => {
  let dir: string;
  let cert: string, key: string, otherKey: string;
  const hasOpenssl = (() => {
    try {
      execFileSync('openssl', ['version'], { stdio: 'ignore' });
      return true;
    } catch {
      return false;
    }
  })();
  before(() => {
    dir = mkdtempSync(join(tmpdir(), 'conduit-startup-errors-'));
    chmodSync(dir, 0o755);
    writeFileSync(join(dir, 'garbage.pem'), 'garbage\n');
    writeFileSync(join(dir, 'a-file'), 'not a folder\n');
    if (!hasOpenssl) return;
    cert = join(dir, 'cert.pem');
    key = join(dir, 'key.pem');
    otherKey = join(dir, 'other-key.pem');
    execFileSync('openssl', ['req', '-x509', '-newkey', 'rsa:2048', '-nodes', '-keyout', key, '-out', cert, '-subj', '/CN=localhost', '-days', '1'], { stdio: 'ignore' });
    execFileSync('openssl', ['genpkey', '-algorithm', 'RSA', '-pkeyopt', 'rsa_keygen_bits:2048', '-out', otherKey], { stdio: 'ignore' });
  });
  after(() => rmSync(dir, { recursive: true, force: true }));

  it('--tls-cert / --tls-key that do not exist', async () => {
    assertOneLine(await conduit([...SIM, '--tls-cert', join(dir, 'no-cert.pem'), '--tls-key', join(dir, 'no-key.pem')]), 'serve', 2,
      /--tls-cert .*no-cert\.pem: no such file or folder/);
  });

  it('--tls-cert / --tls-key that are not PEM', async () => {
    const garbage = join(dir, 'garbage.pem');
    assertOneLine(await conduit([...SIM, '--tls-cert', garbage, '--tls-key', garbage]), 'serve', 2, /--tls-cert .*garbage\.pem: not a PEM certificate/);
  });

  it('a --tls-key that is not a PEM key, or not the certificate\'s', { skip: hasOpenssl ? false : 'needs openssl to make a certificate' }, async () => {
    assertOneLine(await conduit([...SIM, '--tls-cert', cert, '--tls-key', join(dir, 'garbage.pem')]), 'serve', 2, /--tls-key .*garbage\.pem: not a PEM private key/);
    assertOneLine(await conduit([...SIM, '--tls-cert', cert, '--tls-key', otherKey]), 'serve', 2,
      /--tls-key .*other-key\.pem is not the private key of --tls-cert .*cert\.pem/);
  });

  it('--api-keys-file naming a folder', async () => {
    assertOneLine(await conduit([...SIM, '--api-keys-file', dir]), 'serve', 2, /--api-keys-file .*: is a folder, not a file/);
  });

  it('one API key given to two tenants (on the command line or in the keys file)', async () => {
    assertOneLine(await conduit([...SIM, '--api-keys', 'sk-shared:t1,sk-shared:t2']), 'serve', 2, /API key \*\*\* is given to two tenants: t1 and t2/);
    const file = join(dir, 'dup-keys.txt');
    writeFileSync(file, 'sk-dup-000001 acme\nsk-dup-000001 globex\n');
    assertOneLine(await conduit([...SIM, '--api-keys-file', file]), 'serve', 2, /API key sk-\*\*\*0001 is given to two tenants: acme \(.*dup-keys\.txt:1\) and globex \(.*dup-keys\.txt:2\)/);
  });

  it('--kv-offload-disk under a file: the folder cannot be made', async () => {
    assertOneLine(await conduit(['serve', '--port', '0', '--kv-offload-disk', join(dir, 'a-file', 'tier')]), 'serve', 2,
      /--kv-offload-disk .*a-file\/tier: .*a-file is a file, not a folder/);
    assertOneLine(await conduit(['serve', '--port', '0', '--kv-offload-disk', join(dir, 'a-file')]), 'serve', 2, /a-file is a file, not a folder/);
  });

  it('--kv-offload-disk at a dangling symbolic link, or in /proc or /sys: a usage error naming the flag', async () => {
    const link = join(dir, 'dangling-tier');
    symlinkSync(join(dir, 'nowhere'), link);
    assertOneLine(await conduit(['serve', '--port', '0', '--kv-offload-disk', link]), 'serve', 2,
      /--kv-offload-disk .*dangling-tier: .*dangling-tier is a symbolic link to .*nowhere, which does not exist/);
    assertOneLine(await conduit(['serve', '--port', '0', '--kv-offload-disk', join(link, 'sub')]), 'serve', 2, /dangling-tier is a symbolic link/);
    assertOneLine(await conduit(['serve', '--port', '0'], { CONDUIT_KV_OFFLOAD_DISK: link }), 'serve', 2,
      /^conduit serve: CONDUIT_KV_OFFLOAD_DISK \(--kv-offload-disk\) .*dangling-tier is a symbolic link/);
    assertOneLine(await conduit(['serve', '--port', '0', '--kv-offload-disk', '/sys/kernel/conduit-tier']), 'serve', 2,
      /--kv-offload-disk \/sys\/kernel\/conduit-tier: \/sys is a kernel filesystem/);
    assertOneLine(await conduit(['serve', '--port', '0', '--kv-offload-disk', '/proc/self/conduit-tier']), 'serve', 2,
      /--kv-offload-disk \/proc\/self\/conduit-tier: \/proc is a kernel filesystem/);
    const intoProc = join(dir, 'into-proc');
    symlinkSync('/proc/self', intoProc);
    assertOneLine(await conduit(['serve', '--port', '0', '--kv-offload-disk', join(intoProc, 'tier')]), 'serve', 2, /\/proc is a kernel filesystem/);
  });

  it('--kv-offload-disk-size below one KV block file: a usage error naming the flag', async () => {
    assertLastLine(await conduit(['serve', '--port', '0', '--host', '127.0.0.1', '--kv-offload-disk', join(dir, 'small-tier'), '--kv-offload-disk-size', '100']),
      'serve', 2, /^conduit serve: --kv-offload-disk-size 100 bytes holds no KV block file of \d+ bytes$/);
    assertLastLine(await conduit(['serve', '--port', '0', '--host', '127.0.0.1', '--kv-offload-disk', join(dir, 'small-tier')], { CONDUIT_KV_OFFLOAD_DISK_SIZE: '100' }),
      'serve', 2, /^conduit serve: CONDUIT_KV_OFFLOAD_DISK_SIZE \(--kv-offload-disk-size\) 100 bytes holds no KV block file/);
  });

  it('--kv-cache-memory below one KV block: a usage error naming the flag, with threads or worker processes', async () => {
    assertLastLine(await conduit(['serve', '--port', '0', '--host', '127.0.0.1', '--kv-cache-memory', '1KiB']),
      'serve', 2, /^conduit serve: --kv-cache-memory 1024 bytes holds no block of \d+ bytes$/);
    assertLastLine(await conduit(['serve', '--port', '0', '--host', '127.0.0.1', '--worker-processes', '--kv-cache-memory', '1KiB']),
      'serve', 2, /^conduit serve: worker process \S+ could not start: --kv-cache-memory 1024 bytes holds no block of \d+ bytes$/);
    assertLastLine(await conduit(['serve', '--port', '0', '--host', '127.0.0.1'], { CONDUIT_KV_CACHE_MEMORY: '1KiB' }),
      'serve', 2, /^conduit serve: CONDUIT_KV_CACHE_MEMORY \(--kv-cache-memory\) 1024 bytes holds no block/);
  });

  it('--kv-offload-memory below one KV block: a usage error; split between workers, the value given and each one\'s share', async () => {
    assertLastLine(await conduit(['serve', '--port', '0', '--host', '127.0.0.1', '--kv-offload-memory', '100']),
      'serve', 2, /^conduit serve: --kv-offload-memory 100 bytes holds no KV block of \d+ bytes$/);
    assertLastLine(await conduit(['serve', '--port', '0', '--host', '127.0.0.1', '--workers', '2', '--kv-offload-memory', '1000']),
      'serve', 2, /^conduit serve: --kv-offload-memory 1000 bytes gives each worker 500 bytes \(split evenly between the workers\), which holds no KV block of \d+ bytes$/);
    assertLastLine(await conduit(['serve', '--port', '0', '--host', '127.0.0.1', '--workers', '2', '--kv-offload-disk', join(dir, 'small-tier-2')], { CONDUIT_KV_OFFLOAD_DISK_SIZE: '1000' }),
      'serve', 2, /^conduit serve: CONDUIT_KV_OFFLOAD_DISK_SIZE \(--kv-offload-disk-size\) 1000 bytes gives each worker 500 bytes \(split evenly between the workers\), which holds no KV block file of \d+ bytes$/);
  });

  it('the built-in model\'s cache folder cannot be made (a file in its way)', async () => {
    assertLastLine(await conduit(['serve', '--port', '0', '--host', '127.0.0.1'], { CONDUIT_CACHE_DIR: join(dir, 'a-file', 'cache') }), 'serve', 1,
      /cannot create .*a-file\/cache: a part of the path is a file, not a folder/);
    assertOneLine(await conduit(['generate', '--prompt', 'hi'], { CONDUIT_CACHE_DIR: join(dir, 'a-file', 'cache') }), 'generate', 1,
      /cannot create .*a-file\/cache: a part of the path is a file, not a folder/);
  });

  it('a --generation-config file it refuses: the process ends, its workers (already started) with it', async () => {
    const folder = join(dir, 'bad-generation-config');
    mkdirSync(folder);
    writeFileSync(join(folder, 'generation_config.json'), JSON.stringify({ temperature: -1 }));
    assertLastLine(await conduit(['serve', '--port', '0', '--host', '127.0.0.1', '--kv-cache-memory', '8MiB', '--threads', '1',
      '--generation-config', folder]), 'serve', 1, /generation_config\.json: temperature must be a number in \[0, 2\], got -1$/);
  });

  describe('files another user owns (the CLI run as nobody)', { skip: notRoot }, () => {
    let secret: string;
    before(() => {
      secret = join(dir, 'secret');
      mkdirSync(secret, { mode: 0o755 });
      for (const name of ['keys.txt', 'template.jinja', 'cert.pem']) {
        writeFileSync(join(secret, name), name === 'keys.txt' ? 'sk-test-0001 acme\n' : '{{ messages }}\n', { mode: 0o600 });
      }
      mkdirSync(join(secret, 'cache'), { mode: 0o700 });
    });

    it('--api-keys-file, --chat-template and --tls-cert it cannot read', async () => {
      assertOneLine(await conduit([...SIM, '--api-keys-file', join(secret, 'keys.txt')], {}, NOBODY), 'serve', 2, /--api-keys-file .*keys\.txt: permission denied/);
      assertOneLine(await conduit([...SIM, '--chat-template', join(secret, 'template.jinja')], {}, NOBODY), 'serve', 2,
        /--chat-template .*template\.jinja: permission denied/);
      assertOneLine(await conduit([...SIM, '--tls-cert', join(secret, 'cert.pem'), '--tls-key', join(secret, 'cert.pem')], {}, NOBODY), 'serve', 2,
        /--tls-cert .*cert\.pem: permission denied/);
    });

    it('a cache folder it may not write is not blamed on the port (EACCES that is not a listen)', async () => {
      const cache = join(secret, 'cache', 'conduit');
      const run = await conduit(['serve', '--port', '0', '--host', '127.0.0.1'], { CONDUIT_CACHE_DIR: cache, HOME: '/tmp' }, NOBODY);
      assert.doesNotMatch(run.stderr, /cannot listen/);
      assertLastLine(run, 'serve', 1, /cannot create .*cache\/conduit: permission denied/);
      assertOneLine(await conduit(['generate', '--prompt', 'hi'], { CONDUIT_CACHE_DIR: cache, HOME: '/tmp' }, NOBODY), 'generate', 1,
        /cannot create .*cache\/conduit: permission denied/);
    });
  });
});

describe('conduit serve: an address it cannot listen on', () => {
  let busy: Server;
  let busyPort: number;
  before(async () => {
    busy = createServer();
    await new Promise<void>((resolve) => busy.listen(0, '127.0.0.1', resolve));
    busyPort = (busy.address() as { port: number }).port;
  });
  after(() => new Promise<void>((resolve) => busy.close(() => resolve())));

  it('a host name that does not resolve', async () => {
    assertLastLine(await conduit(['serve', '--engine', 'sim', '--port', '0', '--host', 'no-such-host.invalid']), 'serve', 1,
      /^conduit serve: cannot listen on no-such-host\.invalid:0: no such host no-such-host\.invalid/);
  });

  it('an address that is not this machine\'s (EADDRNOTAVAIL)', async () => {
    // 192.0.2.0/24 is TEST-NET-1: never assigned to a host.
    assertLastLine(await conduit(['serve', '--engine', 'sim', '--port', '0', '--host', '192.0.2.7']), 'serve', 1,
      /^conduit serve: cannot listen on 192\.0\.2\.7:0: listen EADDRNOTAVAIL/);
  });

  it('a port in use says so even with --log-level silent', async () => {
    const run = await conduit(['serve', '--engine', 'sim', '--host', '127.0.0.1', '--port', String(busyPort), '--log-level', 'silent']);
    assertOneLine(run, 'serve', 1, new RegExp(`cannot listen on 127\\.0\\.0\\.1:${busyPort}: listen EADDRINUSE`));
  });
});

describe('conduit serve: --workers beside --prefill-workers and --decode-workers', () => {
  it('is refused when typed (it would be dropped)', async () => {
    assertOneLine(await conduit([...SIM, '--workers', '3', '--prefill-workers', '1', '--decode-workers', '1']), 'serve', 2,
      /--workers: an alternative to --prefill-workers with --decode-workers/);
  });
});
