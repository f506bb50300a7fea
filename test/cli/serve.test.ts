import assert from 'node:assert/strict';
import { mkdtempSync, rmSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { after, describe, it } from 'node:test';
import { UsageError } from '../../src/cli/flags.ts';
import { connectionRoom, defaultMaxConnections, maxConnectionsWarning, parseByteSize, parseServeConfig, startServer, type ServeConfig } from '../../src/cli/serve.ts';
import { createLogger, silentLogger } from '../../src/util/log.ts';
import { DEFAULT_SAMPLING, type EngineOutput } from '../../src/engine/types.ts';
import { DisaggregatedEngine } from '../../src/runtime/disaggregated.ts';
import { DEFAULT_DISAGGREGATION_POLICY } from '../../src/runtime/disaggregation-policy.ts';
import { tinySyntheticModel } from '../helpers/cpu-model.ts';
import { runCli } from '../helpers/cli-main.ts';

function config(argv: string[], env: NodeJS.ProcessEnv = {}): ServeConfig {
  const parsed = parseServeConfig(argv, env);
  assert.notEqual(parsed, 'help');
  return parsed as ServeConfig;
}

describe('conduit serve flags', () => {
  const dir = mkdtempSync(join(tmpdir(), 'conduit-serve-flags-'));
  after(() => rmSync(dir, { recursive: true, force: true }));

  it('has the documented defaults', () => {
    const c = config([]);
    assert.equal(c.host, '127.0.0.1');
    assert.equal(c.port, 8000);
    assert.equal(c.modelPath, undefined, 'the built-in model');
    assert.equal(c.maxBodyBytes, 4 * 1024 * 1024);
    assert.equal(c.requestTimeoutMs, undefined);
    assert.equal(c.shutdownGraceMs, 30_000);
    assert.deepEqual(c.keys.keys, []);
    assert.equal(c.backend, 'auto');
    assert.equal(c.kvDtype, undefined, 'auto: each worker\'s backend decides (resolveKvDtype)');
  });

  it('takes --kv-cache-dtype (auto, f32, f16) or CONDUIT_KV_CACHE_DTYPE', () => {
    assert.equal(config(['--kv-cache-dtype', 'f16']).kvDtype, 'f16');
    assert.equal(config(['--kv-cache-dtype', 'F32']).kvDtype, 'f32');
    assert.equal(config(['--kv-cache-dtype', 'auto']).kvDtype, undefined);
    assert.equal(config([], { CONDUIT_KV_CACHE_DTYPE: 'f16' }).kvDtype, 'f16');
    assert.equal(config(['--kv-cache-dtype', 'f32'], { CONDUIT_KV_CACHE_DTYPE: 'f16' }).kvDtype, 'f32');
    assert.equal(config(['--kv-cache-dtype', 'f32', '--engine', 'sim']).warnings?.some((w) => /--kv-cache-dtype is for cpu workers/.test(w)), true,
      'simulated workers say they ignore it');
    assert.equal(config(['--engine', 'sim']).warnings?.some((w) => /--kv-cache-dtype/.test(w)) ?? false, false);
  });

  it('warns that simulated workers size their KV pool from the GPU, not --kv-cache-memory', () => {
    assert.equal(config(['--kv-cache-memory', '1GiB', '--engine', 'sim']).warnings?.some((w) => /--kv-cache-memory is for cpu workers/.test(w)), true);
    assert.equal(config(['--kv-cache-memory', '1GiB']).warnings?.some((w) => /--kv-cache-memory/.test(w)) ?? false, false);
  });

  it('reads every flag from its CONDUIT_* twin, the command line winning', () => {
    const c = config(['--port', '9001'], {
      CONDUIT_PORT: '7000', CONDUIT_HOST: '0.0.0.0', CONDUIT_KV_CACHE_MEMORY: '512MiB', CONDUIT_API_KEYS: 'k1:acme',
      CONDUIT_REQUEST_TIMEOUT: '2.5', CONDUIT_MAX_NUM_SEQS: '4', CONDUIT_TENANT_RPM: '30',
      CONDUIT_KV_CACHE_IDLE_RELEASE: '30',
    });
    assert.equal(c.kvCacheIdleReleaseSeconds, 30);
    assert.equal(config([]).kvCacheIdleReleaseSeconds, 0, 'off by default');
    assert.equal(c.port, 9001);
    assert.equal(c.host, '0.0.0.0');
    assert.equal(c.kvCacheMemoryBytes, 512 * 1024 * 1024);
    assert.deepEqual(c.keys.keys, [{ key: 'k1', tenant: 'acme' }]);
    assert.equal(c.requestTimeoutMs, 2500);
    assert.equal(c.maxNumSeqs, 4);
    assert.deepEqual(c.tenantDefaults, { requestsPerMinute: 30 });
  });

  it('takes --chat-template (or CONDUIT_CHAT_TEMPLATE) as a file or the template itself, refusing one that does not parse', () => {
    const template = '{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}';
    const file = join(dir, 'chat.jinja');
    writeFileSync(file, template);
    assert.equal(config(['--chat-template', file]).chatTemplate, template);
    assert.equal(config([], { CONDUIT_CHAT_TEMPLATE: template }).chatTemplate, template);
    assert.equal(config([]).chatTemplate, undefined, 'each model\'s own by default');
    for (const [value, message] of [
      [join(dir, 'missing.jinja'), /--chat-template: no file .*missing\.jinja/],
      ['{% for m in messages %}', /--chat-template: chat template "default" does not parse/],
    ] as const) {
      assert.throws(() => parseServeConfig(['--chat-template', value], {}), (err: unknown) => err instanceof UsageError && message.test(err.message), value);
    }
  });

  it('combines a keys file with the keys list', () => {
    const path = join(dir, 'keys.txt');
    writeFileSync(path, 'sk-file acme 60 1000 2\n');
    const c = config(['--api-keys-file', path, '--api-keys', 'sk-env:globex']);
    assert.deepEqual(c.keys.keys.map((k) => k.tenant), ['acme', 'globex']);
    assert.deepEqual(c.keys.tenants.get('acme')!.limits, { requestsPerMinute: 60, tokensPerMinute: 1000, maxConcurrent: 2 });
  });

  it('refuses bad values with a usage error naming the flag', () => {
    const bad: [string[], RegExp][] = [
      [['--port', '70000'], /--port/],
      [['--port', 'http'], /--port expects a number/],
      [['--kv-cache-memory', 'lots'], /--kv-cache-memory/],
      [['--kv-cache-dtype', 'fp8'], /--kv-cache-dtype must be one of auto, f32, f16/],
      [['--kv-cache-idle-release', '-1'], /--kv-cache-idle-release/],
      [['--max-body-bytes', '0'], /--max-body-bytes/],
      [['--backend', 'gpu'], /--backend/],
      [['--log-level', 'loud'], /--log-level/],
      [['--tls-cert', 'a.pem'], /--tls-cert and --tls-key/],
      [['--threads', '1.5'], /--threads/],
      [['--threads', '100000'], /^--threads must be at most 1024, got 100000$/],
      // Past what the engine's step arrays hold: the start failed with "Invalid typed array length".
      [['--max-num-seqs', '1e9'], /^--max-num-seqs must be at most 16384, got 1000000000$/],
      [['--max-num-batched-tokens', '1e12'], /^--max-num-batched-tokens must be at most 1048576, got 1000000000000$/],
      // Workers started one after another until memory ran out, with no message.
      [['--workers', '1e9'], /^--workers must be at most 1024, got 1000000000$/],
      [['--prefill-workers', '1025', '--decode-workers', '1'], /^--prefill-workers must be at most 1024, got 1025$/],
      [['--prefill-workers', '1', '--decode-workers', '1e9'], /^--decode-workers must be at most 1024, got 1000000000$/],
      // A higher rank is no low-rank adapter; 1e9 (with --max-lora-rank 1e9) priced a request naming it at hours.
      [['--engine', 'sim', '--sim-lora-rank', '1e9', '--max-lora-rank', '1e9'], /^--sim-lora-rank must be at most 4096 \(the hidden size of Llama 3\.1 8B\), got 1000000000$/],
      [['--engine', 'sim', '--sim-model', 'llama-3.1-70b', '--sim-tp', '4', '--sim-lora-rank', '8193'], /^--sim-lora-rank must be at most 8192 \(the hidden size of Llama 3\.1 70B\), got 8193$/],
      [['--request-timeout', '-1'], /--request-timeout/],
      [['--api-keys-file', join(dir, 'missing.txt')], /--api-keys-file .*missing\.txt: no such file or folder/],
      [['--api-keys', 'no-tenant'], /key:tenant/],
      [['stray'], /unexpected argument/],
    ];
    for (const [argv, message] of bad) {
      assert.throws(() => parseServeConfig(argv, {}), (err: unknown) => err instanceof UsageError && message.test(err.message),
        argv.join(' '));
    }
  });

  it('refuses timeouts and a shutdown grace longer than a timer holds (Node would fire them after 1 ms)', () => {
    // 2^31 - 1 ms: the longest setTimeout Node keeps; anything longer it runs after 1 ms, so every request would time
    // out at once, and a shutdown would abort what runs.
    const longest = String(Math.floor((2 ** 31 - 1) / 1000));
    const ok = config(['--request-timeout', longest, '--write-timeout', longest, '--shutdown-grace', longest, '--headers-timeout', longest]);
    assert.equal(ok.requestTimeoutMs, Number(longest) * 1000);
    assert.equal(ok.shutdownGraceMs, Number(longest) * 1000);
    for (const flag of ['request-timeout', 'write-timeout', 'shutdown-grace', 'headers-timeout']) {
      assert.throws(() => parseServeConfig([`--${flag}`, '99999999'], {}), (err: unknown) => err instanceof UsageError
        && new RegExp(`^--${flag} must be at most 2147483 seconds \\(about 24\\.8 days.*\\), got 99999999$`).test(err.message), flag);
    }
    assert.throws(() => parseServeConfig([], { CONDUIT_SHUTDOWN_GRACE: '99999999' }), (err: unknown) => err instanceof UsageError
      && /^CONDUIT_SHUTDOWN_GRACE \(--shutdown-grace\) must be at most 2147483 seconds/.test(err.message));
  });

  it('refuses counts past 2^53 - 1, where a counter held against them stops moving exactly', () => {
    // 1e300 was taken: a tenant's rate-limit headers said "1e+300", and past 2^53 a count of one more reads the same.
    const disaggregated = ['--prefill-workers', '1', '--decode-workers', '1'];
    const flags: [string, string[]][] = [
      ['tenant-rpm', []], ['tenant-tpm', []], ['tenant-max-concurrent', []], ['max-pending-requests', []],
      ['max-sequences-per-request', []], ['max-connections', []], ['stream-interval', []], ['migration-limit', []],
      ['worker-restart-limit', []], ['disagg-min-remote-prefill-tokens', disaggregated], ['disagg-max-prefill-queue-tokens', disaggregated],
    ];
    for (const [flag, extra] of flags) {
      for (const [value, shown] of [['9007199254740992', '9007199254740992'], ['1e300', '1e\\+300']] as const) {
        assert.throws(() => parseServeConfig([...extra, `--${flag}`, value], {}), (err: unknown) => err instanceof UsageError
          && new RegExp(`^--${flag} must be at most 9007199254740991, got ${shown}$`).test(err.message), `${flag} ${value}`);
      }
      assert.doesNotThrow(() => parseServeConfig([...extra, `--${flag}`, '9007199254740991'], {}), flag);
    }
    const c = config(['--tenant-rpm', '9007199254740991', '--migration-limit', '9007199254740991']);
    assert.equal(c.tenantDefaults.requestsPerMinute, Number.MAX_SAFE_INTEGER);
    assert.equal(c.migrationLimit, Number.MAX_SAFE_INTEGER);
    assert.throws(() => parseServeConfig([], { CONDUIT_TENANT_RPM: '1e300' }), (err: unknown) => err instanceof UsageError
      && /^CONDUIT_TENANT_RPM \(--tenant-rpm\) must be at most 9007199254740991, got 1e\+300$/.test(err.message));
  });

  it('takes the request, connection and access limits from their flags or CONDUIT_* twins', () => {
    const d = config([]);
    assert.equal(d.maxSequencesPerRequest, 128);
    assert.equal(d.maxConnections, defaultMaxConnections());
    assert.equal(d.headersTimeoutMs, 30_000);
    assert.equal(d.publicMetrics, false);
    const c = config(['--max-connections', '100'], {
      CONDUIT_MAX_SEQUENCES_PER_REQUEST: '16', CONDUIT_MAX_CONNECTIONS: '5', CONDUIT_HEADERS_TIMEOUT: '2.5',
      CONDUIT_ADMIN_KEY: 'sk-root-00000001', CONDUIT_PUBLIC_METRICS: 'true',
    });
    assert.equal(c.maxSequencesPerRequest, 16);
    assert.equal(c.maxConnections, 100);
    assert.equal(c.headersTimeoutMs, 2500);
    assert.equal(c.publicMetrics, true);
    assert.deepEqual(c.keys.keys, [{ key: 'sk-root-00000001', tenant: 'admin' }]);
    assert.equal(c.keys.tenants.get('admin')?.admin, true);
    for (const [argv, message] of [[['--max-sequences-per-request', '0'], /--max-sequences-per-request/],
      [['--max-connections', '-3'], /--max-connections/], [['--headers-timeout', '0'], /--headers-timeout/]] as [string[], RegExp][]) {
      assert.throws(() => parseServeConfig(argv, {}), (err: unknown) => err instanceof UsageError && message.test(err.message), argv.join(' '));
    }
  });

  it('caps connections by default at 4096, or three quarters of a lower open-file limit', () => {
    const limits = (soft: number): string => `Limit                     Soft Limit           Hard Limit           Units\nMax open files            ${soft}                 1048576              files\n`;
    assert.equal(defaultMaxConnections(limits(1024)), 768);
    assert.equal(defaultMaxConnections(limits(1048576)), 4096);
    assert.equal(defaultMaxConnections('nothing useful'), 4096);
  });

  it('warns of a --max-connections the open-file limit has no room for: past it connections are closed unanswered, not given a 503', () => {
    const limits = (soft: number): string => `Limit                     Soft Limit           Hard Limit           Units\nMax open files            ${soft}                 1048576              files\n`;
    assert.equal(maxConnectionsWarning(100000, '--max-connections', limits(300)), '--max-connections 100000 is more than the open-file '
      + 'limit (300) leaves for connections (225): past that, new connections are closed unanswered instead of getting a 503; '
      + 'raise the limit (ulimit -n) or lower it');
    assert.equal(maxConnectionsWarning(225, '--max-connections', limits(300)), undefined);
    assert.equal(maxConnectionsWarning(100000, '--max-connections', 'nothing useful'), undefined, 'no limit known, no warning');
    // This process's own limit, as `conduit serve` reads it.
    const room = connectionRoom();
    if (room === undefined) return;
    const warned = (c: ServeConfig): string[] => c.warnings?.filter((w) => /leaves for connections/.test(w)) ?? [];
    assert.deepEqual(warned(config(['--max-connections', String(room.connections)])), []);
    assert.deepEqual(warned(config([])), [], 'the default fits');
    assert.match(warned(config(['--max-connections', String(room.connections + 1)]))[0] ?? '',
      new RegExp(`^--max-connections ${room.connections + 1} is more than the open-file limit \\(${room.openFiles}\\)`));
    assert.match(warned(config([], { CONDUIT_MAX_CONNECTIONS: '1e9' }))[0] ?? '', /^CONDUIT_MAX_CONNECTIONS \(--max-connections\) 1000000000 is more than/);
  });

  it('takes the session header from --session-header or CONDUIT_SESSION_HEADER, lower-cased', () => {
    assert.equal(config([]).sessionHeader, 'x-session-id');
    assert.equal(config([], { CONDUIT_SESSION_HEADER: 'X-Conversation-Id' }).sessionHeader, 'x-conversation-id');
    assert.equal(config(['--session-header', 'x-user'], { CONDUIT_SESSION_HEADER: 'x-other' }).sessionHeader, 'x-user');
    for (const bad of ['', 'x session', 'x-session:', 'séance']) {
      assert.throws(() => parseServeConfig(['--session-header', bad], {}),
        (err: unknown) => err instanceof UsageError && /--session-header must be an HTTP header name/.test(err.message), bad);
    }
  });

  it('takes --sim-speed-up as a positive number or inf', () => {
    assert.equal(config([]).sim.speedUp, 1);
    assert.equal(config(['--sim-speed-up', '250']).sim.speedUp, 250);
    assert.equal(config(['--sim-speed-up', '0.5']).sim.speedUp, 0.5);
    for (const infinite of ['inf', 'Infinity', 'INF', ' infinity ']) {
      assert.equal(config(['--sim-speed-up', infinite]).sim.speedUp, Infinity, infinite);
    }
    assert.equal(config([], { CONDUIT_SIM_SPEED_UP: 'inf' }).sim.speedUp, Infinity);
    for (const bad of ['0', '-2', 'fast', '', '-inf', 'NaN']) {
      assert.throws(() => parseServeConfig(['--sim-speed-up', bad], {}),
        (err: unknown) => err instanceof UsageError && /--sim-speed-up must be a number > 0 or inf/.test(err.message), bad);
    }
  });

  it('takes --sim-calibration (roofline by default, or measured) and its twin CONDUIT_SIM_CALIBRATION', () => {
    assert.equal(config([]).sim.calibration, 'roofline');
    assert.equal(config(['--sim-calibration', 'measured']).sim.calibration, 'measured');
    assert.equal(config([], { CONDUIT_SIM_CALIBRATION: 'measured' }).sim.calibration, 'measured');
    assert.equal(config(['--sim-calibration', 'roofline'], { CONDUIT_SIM_CALIBRATION: 'measured' }).sim.calibration, 'roofline');
    assert.throws(() => parseServeConfig(['--sim-calibration', 'fast'], {}), (err: unknown) => err instanceof UsageError
      && /--sim-calibration: unknown simulator calibration "fast"; known: roofline, measured/.test(err.message));
  });

  it('turns on one decode_step span per engine step with --trace-decode-steps or its twin', async () => {
    assert.equal(config([]).traceDecodeSteps, false);
    assert.equal(config(['--trace-decode-steps']).traceDecodeSteps, true);
    assert.equal(config([], { CONDUIT_TRACE_DECODE_STEPS: 'true' }).traceDecodeSteps, true);
    assert.equal(config(['--no-trace-decode-steps'], { CONDUIT_TRACE_DECODE_STEPS: 'true' }).traceDecodeSteps, false);
    for (const on of [false, true]) {
      const served = config(['--port', '0', '--engine', 'sim', '--sim-speed-up', 'inf', ...(on ? ['--trace-decode-steps'] : [])]);
      const running = await startServer(served, silentLogger);
      try {
        assert.equal(running.api.telemetry.perTokenSpans, on);
      } finally {
        await running.api.shutdown(0);
      }
    }
  });

  it('takes --guided-jump-forward or CONDUIT_GUIDED_JUMP_FORWARD, off by default; simulated workers say they ignore it', () => {
    assert.equal(config([]).guidedJumpForward, false);
    assert.equal(config(['--guided-jump-forward']).guidedJumpForward, true);
    assert.equal(config([], { CONDUIT_GUIDED_JUMP_FORWARD: 'true' }).guidedJumpForward, true);
    assert.equal(config(['--no-guided-jump-forward'], { CONDUIT_GUIDED_JUMP_FORWARD: 'true' }).guidedJumpForward, false);
    assert.equal(config(['--guided-jump-forward', '--engine', 'sim']).warnings?.some((w) => /--guided-jump-forward is for cpu workers/.test(w)), true);
    assert.equal(config(['--guided-jump-forward']).warnings?.some((w) => /--guided-jump-forward/.test(w)) ?? false, false);
  });

  it('takes --migration-limit or CONDUIT_MIGRATION_LIMIT, 0 (off) by default', () => {
    assert.equal(config([]).migrationLimit, 0);
    assert.equal(config(['--migration-limit', '3']).migrationLimit, 3);
    assert.equal(config([], { CONDUIT_MIGRATION_LIMIT: '2' }).migrationLimit, 2);
    assert.equal(config(['--migration-limit', '0'], { CONDUIT_MIGRATION_LIMIT: '2' }).migrationLimit, 0);
    for (const bad of ['-1', '1.5', 'many']) {
      assert.throws(() => parseServeConfig(['--migration-limit', bad], {}),
        (err: unknown) => err instanceof UsageError && /--migration-limit/.test(err.message), bad);
    }
  });

  it('asks for help', () => {
    assert.equal(parseServeConfig(['--help'], {}), 'help');
  });
});

describe('conduit serve disaggregation thresholds', () => {
  const DISAGG = ['--prefill-workers', '1', '--decode-workers', '1'];

  it('reads each threshold from its flag or CONDUIT_DISAGG_* twin, leaving the others to the policy defaults', () => {
    assert.equal(config(DISAGG).disaggregationPolicy, undefined);
    assert.deepEqual(config([...DISAGG, '--disagg-min-remote-prefill-tokens', '64']).disaggregationPolicy, { minRemotePrefillTokens: 64 });
    assert.deepEqual(config(DISAGG, {
      CONDUIT_DISAGG_MIN_REMOTE_PREFILL_TOKENS: '0', CONDUIT_DISAGG_MAX_PREFILL_QUEUE_TOKENS: '2048',
      CONDUIT_DISAGG_TRANSFER_OVERHEAD_MS: '1.5',
    }).disaggregationPolicy, { minRemotePrefillTokens: 0, maxPrefillQueueTokens: 2048, transferOverheadMs: 1.5 });
    assert.deepEqual(config([...DISAGG, '--disagg-max-prefill-queue-tokens', '100'], { CONDUIT_DISAGG_MAX_PREFILL_QUEUE_TOKENS: '7' })
      .disaggregationPolicy, { maxPrefillQueueTokens: 100 }, 'the command line wins');
    assert.deepEqual(config([...DISAGG, '--no-disagg-compare-transfer']).disaggregationPolicy, { compareTransfer: false });
    assert.deepEqual(config(DISAGG, { CONDUIT_DISAGG_COMPARE_TRANSFER: 'false' }).disaggregationPolicy, { compareTransfer: false });
    assert.equal(config([...DISAGG, '--disagg-compare-transfer']).disaggregationPolicy, undefined, 'on is the default');
    assert.throws(() => parseServeConfig(DISAGG, { CONDUIT_DISAGG_COMPARE_TRANSFER: 'sometimes' }), (err: unknown) => err instanceof UsageError
      && err.message === 'CONDUIT_DISAGG_COMPARE_TRANSFER --disagg-compare-transfer expects true or false, got "sometimes"');
  });

  it('refuses bad thresholds, and thresholds without disaggregated serving', () => {
    const bad: [string[], RegExp][] = [
      [[...DISAGG, '--disagg-min-remote-prefill-tokens', '-1'], /--disagg-min-remote-prefill-tokens must be a whole number >= 0/],
      [[...DISAGG, '--disagg-min-remote-prefill-tokens', '2.5'], /--disagg-min-remote-prefill-tokens must be a whole number >= 0/],
      [[...DISAGG, '--disagg-max-prefill-queue-tokens', '-5'], /--disagg-max-prefill-queue-tokens must be a whole number >= 0/],
      [[...DISAGG, '--disagg-transfer-overhead-ms', '-0.1'], /--disagg-transfer-overhead-ms must be >= 0 ms/],
      [[...DISAGG, '--disagg-transfer-overhead-ms', 'soon'], /--disagg-transfer-overhead-ms expects a number/],
      [['--workers', '2', '--disagg-transfer-overhead-ms', '1'], /--disagg-transfer-overhead-ms: only for disaggregated serving/],
      [['--workers', '2', '--no-disagg-compare-transfer'], /--disagg-compare-transfer: only for disaggregated serving/],
    ];
    for (const [argv, message] of bad) {
      assert.throws(() => parseServeConfig(argv, {}), (err: unknown) => err instanceof UsageError && message.test(err.message),
        argv.join(' '));
    }
  });

  it('ignores thresholds set only in the environment without disaggregated serving, one warning line per variable', () => {
    const env = {
      CONDUIT_DISAGG_MIN_REMOTE_PREFILL_TOKENS: '1024', CONDUIT_DISAGG_TRANSFER_OVERHEAD_MS: '0.5',
      // Out of range too: a value that has no effect is not checked either.
      CONDUIT_DISAGG_MAX_PREFILL_QUEUE_TOKENS: '-3',
    };
    for (const argv of [[], ['--workers', '2'], ['--engine', 'sim']]) {
      const c = config(argv, env);
      assert.equal(c.disaggregationPolicy, undefined, argv.join(' '));
      assert.deepEqual(c.warnings, [
        'ignoring CONDUIT_DISAGG_MIN_REMOTE_PREFILL_TOKENS=1024: --disagg-min-remote-prefill-tokens is only for disaggregated serving (--prefill-workers with --decode-workers)',
        'ignoring CONDUIT_DISAGG_MAX_PREFILL_QUEUE_TOKENS=-3: --disagg-max-prefill-queue-tokens is only for disaggregated serving (--prefill-workers with --decode-workers)',
        'ignoring CONDUIT_DISAGG_TRANSFER_OVERHEAD_MS=0.5: --disagg-transfer-overhead-ms is only for disaggregated serving (--prefill-workers with --decode-workers)',
      ]);
    }
    assert.equal(config([]).warnings, undefined, 'nothing to say without them');
    // With disaggregated serving the same environment takes effect, and is checked.
    assert.deepEqual(config(DISAGG, { CONDUIT_DISAGG_MIN_REMOTE_PREFILL_TOKENS: '1024' }).disaggregationPolicy, { minRemotePrefillTokens: 1024 });
    assert.equal(config(DISAGG, { CONDUIT_DISAGG_MIN_REMOTE_PREFILL_TOKENS: '1024' }).warnings, undefined);
    assert.throws(() => parseServeConfig(DISAGG, env),
      (err: unknown) => err instanceof UsageError
        && /^CONDUIT_DISAGG_MAX_PREFILL_QUEUE_TOKENS \(--disagg-max-prefill-queue-tokens\) must be a whole number >= 0, got -3/.test(err.message));
  });

  it('says that simulated workers ignore --kv-cache-idle-release (their KV pools hold no host memory)', () => {
    assert.deepEqual(config(['--engine', 'sim', '--kv-cache-idle-release', '30']).warnings,
      ['--kv-cache-idle-release is for cpu workers (their KV pools are host memory): simulated workers ignore it']);
    assert.equal(config(['--kv-cache-idle-release', '30']).warnings, undefined, 'cpu workers use it');
    assert.equal(config(['--engine', 'sim']).warnings, undefined, 'off by default: nothing to say');
  });

  it('says that simulated workers ignore --threads, --backend, --lora-dtype and --model\'s file', () => {
    assert.deepEqual(config(['--engine', 'sim', '--threads', '4', '--backend', 'reference', '--lora-dtype', 'f32', '--model', 'llama=/models/m.gguf']).warnings, [
      '--threads is for cpu workers (their kernels\' compute threads): simulated workers ignore it',
      '--backend is for cpu workers (the kernels a model file runs on): simulated workers ignore it',
      '--lora-dtype is for cpu workers (how adapter weights are held): simulated workers read only an adapter\'s rank and projections',
      '--model llama=/models/m.gguf: simulated workers load no model file (they run the --sim-model profile)',
    ]);
    assert.deepEqual(config(['--engine', 'sim', '--model', '/models/m.gguf']).warnings,
      ['--model /models/m.gguf: simulated workers load no model file (they run the --sim-model profile)']);
    assert.equal(config(['--engine', 'sim', '--backend', 'auto']).warnings, undefined, 'the default says nothing');
    assert.equal(config(['--threads', '4', '--backend', 'reference', '--lora-dtype', 'f32', '--model', '/models/m.gguf']).warnings, undefined,
      'cpu workers use them');
  });

  it('says that cpu workers ignore the --sim-* options typed for them, not those from the environment', () => {
    assert.deepEqual(config(['--sim-gpu', 'h200', '--sim-tp', '2']).warnings, [
      '--sim-gpu is for simulated workers (--engine sim): cpu workers ignore it',
      '--sim-tp is for simulated workers (--engine sim): cpu workers ignore it',
    ]);
    assert.equal(config(['--engine', 'sim', '--sim-gpu', 'h200']).warnings, undefined, 'simulated workers use it');
    assert.equal(config([], { CONDUIT_SIM_GPU: 'h200' }).warnings, undefined, 'from the environment: no warning');
  });

  it('ignores a stray threshold whose text is not even a number, and refuses it once it applies', () => {
    const env = { CONDUIT_DISAGG_TRANSFER_OVERHEAD_MS: 'fast' };
    assert.deepEqual(config([], env).warnings, [
      'ignoring CONDUIT_DISAGG_TRANSFER_OVERHEAD_MS=fast: --disagg-transfer-overhead-ms is only for disaggregated serving (--prefill-workers with --decode-workers)',
    ]);
    assert.throws(() => parseServeConfig(DISAGG, env),
      (err: unknown) => err instanceof UsageError && err.message === 'CONDUIT_DISAGG_TRANSFER_OVERHEAD_MS --disagg-transfer-overhead-ms expects a number, got "fast"');
    // Other flags' environment values are checked as before.
    assert.throws(() => parseServeConfig([], { ...env, CONDUIT_PORT: 'eighty' }),
      (err: unknown) => err instanceof UsageError && /CONDUIT_PORT --port expects a number, got "eighty"/.test(err.message));
  });

  it('still refuses the same thresholds typed on the command line, naming only those', () => {
    assert.throws(() => parseServeConfig(['--disagg-min-remote-prefill-tokens', '64'], { CONDUIT_DISAGG_TRANSFER_OVERHEAD_MS: '0.5' }),
      (err: unknown) => err instanceof UsageError
        && err.message === '--disagg-min-remote-prefill-tokens: only for disaggregated serving (--prefill-workers with --decode-workers)');
    assert.throws(() => parseServeConfig(['--disagg-max-prefill-queue-tokens=9', '--disagg-transfer-overhead-ms', '1'], {}),
      (err: unknown) => err instanceof UsageError
        && /^--disagg-max-prefill-queue-tokens, --disagg-transfer-overhead-ms: only for disaggregated serving/.test(err.message));
  });

  it('a plain server starts with a stray threshold in its environment and says at start that it ignores it', async () => {
    const lines: string[] = [];
    const served = config(['--port', '0', '--engine', 'sim', '--sim-speed-up', 'inf'], { CONDUIT_DISAGG_MIN_REMOTE_PREFILL_TOKENS: '1024' });
    const running = await startServer(served, createLogger('warn', (line) => lines.push(line)));
    try {
      assert.equal(running.api.gateway.engine instanceof DisaggregatedEngine, false);
      const warned = lines.filter((line) => line.includes('CONDUIT_DISAGG_MIN_REMOTE_PREFILL_TOKENS'));
      assert.equal(warned.length, 1, lines.join(''));
      assert.match(warned[0]!, /^\S+ WARN  ignoring CONDUIT_DISAGG_MIN_REMOTE_PREFILL_TOKENS=1024: .*only for disaggregated serving.*\n$/);
    } finally {
      await running.api.shutdown(0);
    }
  });

  /** The reason the served engine gives for where a 600-token prompt was prefilled. */
  async function decisionWith(flags: string[]): Promise<{ policy: unknown; reason: string; detail: string }> {
    const served = config(['--port', '0', '--log-level', 'silent', '--engine', 'sim', '--sim-speed-up', 'inf', ...DISAGG, ...flags]);
    const running = await startServer(served, silentLogger);
    try {
      const engine = running.api.gateway.engine;
      assert.ok(engine instanceof DisaggregatedEngine);
      const outputs: EngineOutput[] = [];
      for await (const output of engine.generate({
        id: 'disagg-flag-probe', promptTokenIds: Array.from({ length: 600 }, (_, i) => 100 + i), priority: 0, arrivalMs: 0,
        sampling: { ...DEFAULT_SAMPLING, maxTokens: 2, temperature: 0, ignoreEos: true },
      })) outputs.push(output);
      const why = outputs.at(-1)!.routing!.disaggregation!;
      return { policy: { ...engine.policy }, reason: why.reason, detail: why.detail };
    } finally {
      await running.api.shutdown(0);
    }
  }

  it('hands the thresholds to the served disaggregated engine, where they decide', async () => {
    // By default a 600-token prompt is long enough to leave the decode worker.
    const byDefault = await decisionWith([]);
    assert.deepEqual(byDefault.policy, DEFAULT_DISAGGREGATION_POLICY);
    assert.equal(byDefault.reason, 'remote-prefill', byDefault.detail);

    const shortBound = await decisionWith(['--disagg-min-remote-prefill-tokens', '100000', '--disagg-max-prefill-queue-tokens', '9']);
    assert.deepEqual(shortBound.policy, { ...DEFAULT_DISAGGREGATION_POLICY, minRemotePrefillTokens: 100000, maxPrefillQueueTokens: 9 });
    assert.equal(shortBound.reason, 'short-prompt');
    assert.match(shortBound.detail, /< 100000/);

    const slowTransfer = await decisionWith(['--disagg-transfer-overhead-ms', '1e9']);
    assert.equal(slowTransfer.reason, 'transfer-slower', slowTransfer.detail);
    // The same overhead weighs nothing once the comparison is off: the prompt's length alone sends it out.
    const unweighed = await decisionWith(['--disagg-transfer-overhead-ms', '1e9', '--no-disagg-compare-transfer']);
    assert.deepEqual(unweighed.policy, { ...DEFAULT_DISAGGREGATION_POLICY, transferOverheadMs: 1e9, compareTransfer: false });
    assert.equal(unweighed.reason, 'remote-prefill', unweighed.detail);
  });
});

describe('conduit serve with simulated workers that cannot exist', () => {
  it('says in one line that the model leaves no GPU memory for the KV cache, naming the options, exit code 2, and stops', async () => {
    const { code, err } = await runCli(['serve', '--engine', 'sim', '--sim-model', 'llama-3.1-70b', '--sim-tp', '1', '--port', '0', '--log-level', 'silent']);
    assert.equal(code, 2, err);
    assert.equal(err, 'conduit serve: --sim-model: Llama 3.1 70B on 1 x H100 SXM5 80GB: the weights leave no HBM for the KV cache; '
      + 'use a larger --sim-tp or a --sim-gpu with more memory');
  });

  it('names the variables when the environment gave the deployment', async () => {
    const { code, err } = await runCli(['serve', '--engine', 'sim', '--port', '0', '--log-level', 'silent'],
      { CONDUIT_SIM_MODEL: 'llama-3.1-70b', CONDUIT_SIM_GPU: 'h100' });
    assert.equal(code, 2, err);
    assert.equal(err, 'conduit serve: CONDUIT_SIM_MODEL (--sim-model): Llama 3.1 70B on 1 x H100 SXM5 80GB: the weights leave no HBM for '
      + 'the KV cache; use a larger --sim-tp or a CONDUIT_SIM_GPU (--sim-gpu) with more memory');
  });
});

describe('parseByteSize', () => {
  it('reads bytes and binary and decimal units', () => {
    assert.equal(parseByteSize('1024', 'x'), 1024);
    assert.equal(parseByteSize('512MiB', 'x'), 512 * 1024 ** 2);
    assert.equal(parseByteSize('2GiB', 'x'), 2 * 1024 ** 3);
    assert.equal(parseByteSize('2g', 'x'), 2 * 1024 ** 3);
    assert.equal(parseByteSize('1.5GB', 'x'), 1.5e9);
    assert.equal(parseByteSize(' 64 KiB ', 'x'), 65536);
  });

  it('refuses what it cannot read', () => {
    for (const text of ['', 'MiB', '-1MiB', '12 parsecs', '1e3']) {
      assert.throws(() => parseByteSize(text, 'kv-cache-memory'), /--kv-cache-memory expects bytes/, text);
    }
  });

  it('takes 0 only for a size whose 0 means none (--kv-offload-memory, as its help says)', () => {
    assert.throws(() => parseByteSize('0', 'kv-cache-memory'), /--kv-cache-memory must be more than 0 bytes/);
    assert.throws(() => parseByteSize('0.1', 'kv-offload-memory', { allowZero: true }), /must be more than 0 bytes/);
    assert.equal(parseByteSize('0', 'kv-offload-memory', { allowZero: true }), 0);
    assert.equal(parseByteSize('0GiB', 'kv-offload-memory', { allowZero: true }), 0);
    const none = parseServeConfig(['--kv-offload-memory', '0'], {});
    assert.ok(none !== 'help' && none.kvOffloadMemoryBytes === undefined);
    const some = parseServeConfig([], { CONDUIT_KV_OFFLOAD_MEMORY: '64MiB' });
    assert.ok(some !== 'help' && some.kvOffloadMemoryBytes === 64 * 1024 ** 2);
  });
});

describe('conduit serve start-up warnings', () => {
  async function startLines(argv: string[]): Promise<string[]> {
    const lines: string[] = [];
    const running = await startServer(config(['--port', '0', ...argv]), createLogger('info', (line) => lines.push(line)));
    await running.api.shutdown(0);
    return lines;
  }
  const fallbackWarning = /WARN {2}(.*) has no chat template: \/v1\/chat\/completions renders messages with the plain fallback/;

  it('says at start when the model has no chat template and chat falls back', async () => {
    const path = tinySyntheticModel(); // written without tokenizer.chat_template
    const warnings = (await startLines(['--model', path])).filter((line) => fallbackWarning.test(line));
    assert.equal(warnings.length, 1, 'one warning line');
    assert.equal(fallbackWarning.exec(warnings[0]!)![1], path);
  });

  it('says nothing of the kind for a model with a template (the built-in one)', async () => {
    assert.equal((await startLines([])).filter((line) => fallbackWarning.test(line)).length, 0);
  });
});

describe('conduit serve request log', () => {
  async function withServer(argv: string[], env: NodeJS.ProcessEnv, body: (url: string) => Promise<void>): Promise<string[]> {
    const lines: string[] = [];
    const served = config(['--port', '0', '--engine', 'sim', '--sim-speed-up', 'inf', ...argv], env);
    const running = await startServer(served, createLogger('info', (line) => lines.push(line)));
    try {
      await body(running.url);
    } finally {
      await running.api.shutdown(0);
    }
    return lines;
  }
  const post = (url: string, path: string, payload: object) => fetch(`${url}${path}`, {
    method: 'POST', headers: { 'Content-Type': 'application/json' }, body: JSON.stringify(payload),
  });

  it('writes one info line per request as it ends, with status, tenant, tokens, TTFT and total time', async () => {
    let usage: { prompt_tokens: number; completion_tokens: number } | undefined;
    let id = '';
    const lines = await withServer([], {}, async (url) => {
      const res = await post(url, '/v1/completions', { prompt: 'Hello there', max_tokens: 5 });
      const body = await res.json() as { id: string; usage: typeof usage };
      usage = body.usage;
      id = body.id;
      assert.equal((await post(url, '/v1/completions', { prompt: 'Hello', max_tokens: -1 })).status, 400);
      // Refused for its length after tokenizing: the line still says how long the prompt was.
      const models = await (await fetch(`${url}/v1/models`)).json() as { data: { max_model_len: number }[] };
      const tooLong = await post(url, '/v1/completions', { prompt: [100, 101, 102], max_tokens: models.data[0]!.max_model_len });
      assert.equal(((await tooLong.json()) as { error: { code: string } }).error.code, 'context_length_exceeded');
      assert.equal((await fetch(`${url}/health`)).status, 200);
      assert.equal((await fetch(`${url}/v1/models`)).status, 200);
    });
    const requestLines = lines.filter((line) => / INFO {2}(GET|POST) \//.test(line));
    assert.equal(requestLines.length, 5, `the completion, /v1/models, the two refused ones and /v1/models (not /health):\n${lines.join('')}`);
    assert.match(requestLines[0]!, new RegExp(`INFO {2}POST /v1/completions 200 tenant=anonymous prompt_tokens=${usage!.prompt_tokens} `
      + `output_tokens=${usage!.completion_tokens} ttft_ms=\\d+\\.\\d total_ms=\\d+\\.\\d id=${id}\\n$`));
    assert.match(requestLines[1]!, /POST \/v1\/completions 400 tenant=anonymous prompt_tokens=- output_tokens=- ttft_ms=- total_ms=/);
    assert.match(requestLines[2]!, /GET \/v1\/models 200 /);
    assert.match(requestLines[3]!, /POST \/v1\/completions 400 tenant=anonymous prompt_tokens=3 output_tokens=- ttft_ms=- total_ms=/);
    assert.match(requestLines[4]!, /GET \/v1\/models 200 tenant=anonymous total_ms=\d+\.\d\n$/);
  });

  it('is off with --no-request-log or CONDUIT_REQUEST_LOG=false', async () => {
    assert.equal(config([]).requestLog, true);
    for (const [argv, env] of [[['--no-request-log'], {}], [[], { CONDUIT_REQUEST_LOG: 'false' }]] as const) {
      const lines = await withServer([...argv], env, async (url) => {
        assert.equal((await post(url, '/v1/completions', { prompt: 'Hello', max_tokens: 2 })).status, 200);
      });
      assert.deepEqual(lines.filter((line) => /POST \/v1\/completions/.test(line)), [], argv.join(' ') || JSON.stringify(env));
    }
  });
});
