import assert from 'node:assert/strict';
import { describe, it } from 'node:test';
import {
  ANONYMOUS_TENANT, combineKeyConfig, KeyConfigError, KeyStore, parseKeysFile, parseKeysList,
} from '../../src/api/auth.ts';
import { ApiError } from '../../src/api/errors.ts';

function status(fn: () => unknown): number {
  try {
    fn();
  } catch (err) {
    assert.ok(err instanceof ApiError);
    return err.statusCode;
  }
  return 200;
}

describe('KeyStore', () => {
  it('is open with no keys: everyone is the anonymous tenant', () => {
    const store = new KeyStore({ keys: [], tenants: new Map() });
    assert.equal(store.isOpen, true);
    assert.equal(store.authenticate(undefined).name, ANONYMOUS_TENANT);
    assert.equal(store.authenticate('Bearer whatever').name, ANONYMOUS_TENANT);
  });

  it('maps bearer keys to tenants and refuses the rest with 401', () => {
    const store = new KeyStore({ keys: parseKeysList('sk-alpha-0001:acme,sk-beta-00002:globex'), tenants: new Map() });
    assert.equal(store.authenticate('Bearer sk-alpha-0001').name, 'acme');
    assert.equal(store.authenticate('bearer   sk-beta-00002 ').name, 'globex');
    assert.equal(status(() => store.authenticate(undefined)), 401);
    assert.equal(status(() => store.authenticate('Basic abc')), 401);
    assert.equal(status(() => store.authenticate('Bearer sk-alpha-0002')), 401);
    assert.throws(() => store.authenticate('Bearer sk-wrong-key-123'), (err: ApiError) =>
      err.code === 'invalid_api_key' && err.message.includes('sk-***-123') && !err.message.includes('sk-wrong-key-123'));
  });

  it('knows admins: a tenant marked "admin" in the keys file, the --admin-key tenant, and anyone in open mode', () => {
    const file = parseKeysFile(JSON.stringify({
      keys: [{ key: 'sk-ops-000000001', tenant: 'ops' }, { key: 'sk-acme-00000001', tenant: 'acme' }],
      tenants: { ops: { admin: true }, acme: { rpm: 5 } },
    }));
    const store = new KeyStore(combineKeyConfig(file, [], 'sk-root-00000001'));
    assert.equal(store.hasAdmin, true);
    assert.equal(store.isAdmin(store.authenticate('Bearer sk-ops-000000001')), true);
    assert.equal(store.isAdmin(store.authenticate('Bearer sk-acme-00000001')), false);
    const root = store.authenticate('Bearer sk-root-00000001');
    assert.equal(root.name, 'admin');
    assert.equal(store.isAdmin(root), true);
    assert.equal(new KeyStore(combineKeyConfig(undefined, parseKeysList('sk-acme-00000001:acme'))).hasAdmin, false);
    const open = new KeyStore({ keys: [], tenants: new Map() });
    assert.equal(open.isAdmin(open.authenticate(undefined)), true);
    assert.throws(() => parseKeysFile('{"keys": [], "tenants": {"ops": {"admin": "yes"}}}'), /admin must be true or false/);
  });

  it('gives each tenant its own cache salt unless they share a cache group; a group named like a tenant is not that tenant', () => {
    const config = parseKeysFile(JSON.stringify({
      keys: [{ key: 'k1', tenant: 'a' }, { key: 'k2', tenant: 'b' }, { key: 'k3', tenant: 'c' }, { key: 'k4', tenant: 'd' }],
      tenants: { b: { cache_group: 'shared' }, c: { cache_group: 'shared' }, d: { cache_group: 'a' } },
    }));
    const store = new KeyStore(config);
    const salt = (key: string) => store.authenticate(`Bearer ${key}`).cacheSalt;
    assert.equal(salt('k2'), salt('k3'));
    assert.notEqual(salt('k1'), salt('k2'));
    assert.notEqual(salt('k4'), salt('k1'), 'cache group "a" does not share tenant a\'s blocks');
  });

  it('refuses key sources that would leave the server open or keys no request can present', () => {
    assert.throws(() => combineKeyConfig(parseKeysFile('# nobody yet\n\n'), undefined), /holds no key: refusing to start open/);
    assert.throws(() => combineKeyConfig(parseKeysFile('{"keys": []}'), undefined), /holds no key/);
    assert.throws(() => combineKeyConfig(undefined, parseKeysList(',')), /--api-keys .* holds no key/);
    assert.throws(() => combineKeyConfig(undefined, undefined, ''), /--admin-key .* not empty/);
    assert.throws(() => combineKeyConfig(parseKeysFile('{"keys": [{"key": " sk-space-0001 ", "tenant": "a"}]}'), undefined), /no Authorization header can carry it/);
    assert.throws(() => combineKeyConfig(undefined, parseKeysList('sk\u2011dash-0001:a')), /outside printable ASCII/);
    // A keys-file tenant named "admin" beside --admin-key: its keys would become admin keys unless it says it is one.
    assert.throws(() => combineKeyConfig(parseKeysFile('sk-file-admin-01 admin 2'), undefined, 'sk-root-00000001'), /tenant "admin" is --admin-key's/);
    const marked = combineKeyConfig(parseKeysFile('{"keys": [{"key": "sk-file-admin-01", "tenant": "admin"}], "tenants": {"admin": {"admin": true}}}'),
      undefined, 'sk-root-00000001');
    assert.equal(new KeyStore(marked).authenticate('Bearer sk-file-admin-01').admin, true);
    // No keys option at all: open, as documented.
    assert.equal(new KeyStore(combineKeyConfig(undefined, undefined)).isOpen, true);
  });

  it('applies default limits where a tenant sets none', () => {
    const config = parseKeysFile('k1 acme 10 - 2\nk2 free\n');
    const store = new KeyStore(config, { requestsPerMinute: 99, tokensPerMinute: 5000 });
    assert.deepEqual(store.authenticate('Bearer k1').limits, { requestsPerMinute: 10, tokensPerMinute: 5000, maxConcurrent: 2 });
    assert.deepEqual(store.authenticate('Bearer k2').limits, { requestsPerMinute: 99, tokensPerMinute: 5000 });
  });

  it('refuses one key given to two tenants', () => {
    assert.throws(() => new KeyStore({ keys: parseKeysList('k:a,k:b'), tenants: new Map() }), KeyConfigError);
  });
});

describe('keys file parsing', () => {
  it('reads the line format with comments and limits', () => {
    const config = parseKeysFile('# keys\nsk-1 acme 60 100000 4  # main key\n\nsk-2 acme 60 100000 4\nsk-3 globex\n');
    assert.deepEqual(config.keys.map((g) => `${g.key}=${g.tenant}`), ['sk-1=acme', 'sk-2=acme', 'sk-3=globex']);
    assert.deepEqual(config.tenants.get('acme')!.limits, { requestsPerMinute: 60, tokensPerMinute: 100000, maxConcurrent: 4 });
    assert.equal(config.tenants.has('globex'), false);
  });

  it('starts a comment only at a word beginning with "#": a key or tenant may hold one', () => {
    const config = parseKeysFile('sk-a#b1 acme#1 7 # the first key\n#sk-off off\n  # indented\nsk-c#2 globex\t#tab\n', 'keys.txt');
    assert.deepEqual(config.keys.map((g) => `${g.key}=${g.tenant}`), ['sk-a#b1=acme#1', 'sk-c#2=globex']);
    assert.equal(config.tenants.get('acme#1')!.limits.requestsPerMinute, 7);
  });

  it('reads a file that begins with a byte-order mark, in either format', () => {
    const json = parseKeysFile('\uFEFF{"keys": [{"key": "sk-1", "tenant": "acme"}], "tenants": {"acme": {"rpm": 3}}}', 'k.json');
    assert.equal(json.tenants.get('acme')!.limits.requestsPerMinute, 3);
    assert.deepEqual(parseKeysFile('\uFEFFsk-1 acme\n').keys.map((g) => `${g.key}=${g.tenant}`), ['sk-1=acme']);
  });

  it('names the line of a bad entry', () => {
    assert.throws(() => parseKeysFile('sk-1 acme\nsk-2 acme sixty\n', 'keys.txt'), /keys\.txt:2: rpm must be a positive integer/);
    assert.throws(() => parseKeysFile('lonely\n', 'keys.txt'), /keys\.txt:1: expected "key tenant/);
    assert.throws(() => parseKeysFile('k1 a 1\nk2 a 2\n', 'keys.txt'), /tenant a is given different limits/);
  });

  it('reads a limit only as decimal digits: no hex, exponent, sign or binary spelling', () => {
    for (const bad of ['0x10', '1e3', '+5', '0b1', '1.0', '0', '-1', '١٢']) {
      assert.throws(() => parseKeysFile(`sk-1 acme 5\nsk-2 globex ${bad}\n`, 'keys.txt'),
        new RegExp(`^KeyConfigError: keys\\.txt:2: rpm must be a positive integer in decimal digits, or "-" for no limit, got "${bad.replace(/[.+]/g, '\\$&')}"$`), bad);
    }
    assert.throws(() => parseKeysFile('sk-1 acme - 1e3\n', 'keys.txt'), /keys\.txt:1: tpm must be .* got "1e3"/);
    assert.deepEqual(parseKeysFile('sk-1 acme 010 - 7\n').tenants.get('acme')!.limits, { requestsPerMinute: 10, maxConcurrent: 7 });
  });

  it('refuses a JSON limit that is not a number: "-" and "60" are strings, null leaves the limit unset', () => {
    for (const bad of ['"-"', '"60"', '"0x10"', 'true', '1.5', '0']) {
      assert.throws(() => parseKeysFile(`{"keys": [{"key": "sk-1", "tenant": "acme"}], "tenants": {"acme": {"rpm": ${bad}}}}`, 'k.json'),
        (err: Error) => err instanceof KeyConfigError && err.message === `k.json tenants.acme: rpm must be a positive integer, or null for no limit, got ${JSON.stringify(JSON.parse(bad))}`, bad);
    }
    const config = parseKeysFile('{"keys": [{"key": "sk-1", "tenant": "acme"}], "tenants": {"acme": {"rpm": null, "tpm": 1000}}}');
    assert.deepEqual(config.tenants.get('acme')!.limits, { tokensPerMinute: 1000 });
  });

  it('reads a JSON limit only as decimal digits, as the line format does: 1e3 and 1000.0 are refused, not read as 1000', () => {
    for (const bad of ['1e3', '1E3', '1000.0', '10e2', '1.0e3', '1e+3', '10000e-1']) {
      const text = `{"keys": [{"key": "sk-1", "tenant": "acme"}],\n "tenants": {"acme": {"rpm": 60, "tpm": ${bad}, "max_concurrent": 2}}}`;
      assert.throws(() => parseKeysFile(text, 'k.json'), (err: Error) => err instanceof KeyConfigError
        && err.message === `k.json tenants.acme: tpm must be a positive integer in decimal digits, or null for no limit, got ${bad}`, bad);
    }
    // Found by its tenant and field wherever the file puts them, whatever their names hold.
    assert.throws(() => parseKeysFile('{"tenants": {"a\\"b": {"admin": false, "max_concurrent": 4e0}, "c": {"rpm": 5}},'
      + ' "keys": [{"key": "sk-1", "tenant": "a\\"b"}]}', 'k.json'), /^KeyConfigError: k\.json tenants\.a"b: max_concurrent must be .* got 4e0$/);
    // A key given twice is read as JSON.parse reads it, its last value.
    assert.throws(() => parseKeysFile('{"keys": [], "tenants": {"acme": {"rpm": 5, "rpm": 5.0}}}', 'k.json'), /rpm must be .* got 5\.0$/);
    const config = parseKeysFile('{"keys": [{"key": "sk-1", "tenant": "acme"}], "tenants": {"acme": {"rpm": 1e3, "rpm": 60, "tpm": 9007199254740991}}}');
    assert.deepEqual(config.tenants.get('acme')!.limits, { requestsPerMinute: 60, tokensPerMinute: Number.MAX_SAFE_INTEGER });
  });

  it('reads a line file with any line ending: LF, CRLF or CR alone', () => {
    for (const eol of ['\n', '\r\n', '\r']) {
      const config = parseKeysFile(['# keys', 'sk-1 acme 60', 'sk-2 globex - 100', ''].join(eol), 'keys.txt');
      assert.deepEqual(config.keys.map((g) => `${g.key}=${g.tenant}@${g.where}`), ['sk-1=acme@keys.txt:2', 'sk-2=globex@keys.txt:3'], JSON.stringify(eol));
      assert.deepEqual(config.tenants.get('globex')!.limits, { tokensPerMinute: 100 });
    }
    assert.throws(() => parseKeysFile('sk-1 acme\rsk-2 acme 1e3\r', 'keys.txt'), /keys\.txt:2: rpm/);
  });

  it('names the file and line (or JSON entry) of both grants of a key given to two tenants', () => {
    assert.throws(() => combineKeyConfig(parseKeysFile('sk-1 acme\n# spare\nsk-1 globex\n', 'keys.txt'), undefined),
      /API key \*\*\* is given to two tenants: acme \(keys\.txt:1\) and globex \(keys\.txt:3\)/);
    const json = '{"keys": [{"key": "sk-1", "tenant": "acme"}, {"key": "sk-1", "tenant": "globex"}]}';
    assert.throws(() => combineKeyConfig(parseKeysFile(json, 'k.json'), undefined),
      /given to two tenants: acme \(k\.json keys\[0\]\) and globex \(k\.json keys\[1\]\)/);
    // A key of the file given again in the environment's list: the file's line is named, the list has none.
    assert.throws(() => combineKeyConfig(parseKeysFile('sk-1 acme\n', 'keys.txt'), parseKeysList('sk-1:globex')),
      /given to two tenants: acme \(keys\.txt:1\) and globex$/);
  });

  it('reads the JSON format and names bad entries', () => {
    const config = parseKeysFile('{"keys": [{"key": "sk-1", "tenant": "acme"}], "tenants": {"acme": {"rpm": 5, "tpm": 500}}}');
    assert.deepEqual(config.tenants.get('acme')!.limits, { requestsPerMinute: 5, tokensPerMinute: 500 });
    assert.throws(() => parseKeysFile('{"keys": [{"key": "", "tenant": "a"}]}', 'k.json'), /k\.json keys\[0\]: "key"/);
    assert.throws(() => parseKeysFile('{"keys": 3}', 'k.json'), /"keys" array/);
    assert.throws(() => parseKeysFile('{"keys": [', 'k.json'), /not valid JSON/);
    assert.throws(() => parseKeysFile('{"keys": [], "tenants": {"a": {"tpm": -1}}}', 'k.json'), /tenants\.a: tpm/);
  });

  it('reads the environment list and combines it with a file', () => {
    assert.throws(() => parseKeysList('justakey'), /expected "key:tenant"/);
    const combined = combineKeyConfig(parseKeysFile('f1 filetenant 7'), parseKeysList(' e1:envtenant , '));
    assert.deepEqual(combined.keys.map((g) => g.tenant), ['filetenant', 'envtenant']);
    assert.equal(combined.tenants.get('filetenant')!.limits.requestsPerMinute, 7);
  });

  it('takes spaces around the list\'s colon as layout: two keys written either way are one tenant, with one budget', () => {
    const config = combineKeyConfig(parseKeysFile('{"keys": [{"key": "sk-file-0001", "tenant": "acme"}], "tenants": {"acme": {"rpm": 2}}}'),
      parseKeysList('sk-list-0001: acme, sk-list-0002 :acme'));
    assert.deepEqual(config.keys.map((g) => `${g.key}=${g.tenant}`), ['sk-file-0001=acme', 'sk-list-0001=acme', 'sk-list-0002=acme']);
    const store = new KeyStore(config);
    const tenants = ['sk-file-0001', 'sk-list-0001', 'sk-list-0002'].map((key) => store.authenticate(`Bearer ${key}`));
    assert.ok(tenants.every((tenant) => tenant === tenants[0] && tenant.limits.requestsPerMinute === 2));
    assert.throws(() => parseKeysList('sk-list-0001: '), /expected "key:tenant"/);
    assert.throws(() => parseKeysList(' :acme'), /expected "key:tenant"/);
  });

  it('refuses a tenant name that requests could not carry, that would break a log line, or that 401s are counted under', () => {
    const refused = (tenant: string, pattern: RegExp): void => {
      assert.throws(() => combineKeyConfig(parseKeysFile(JSON.stringify({ keys: [{ key: 'sk-name-00000001', tenant }] }), 'k.json'), undefined),
        (err: Error) => err instanceof KeyConfigError && pattern.test(err.message) && err.message.includes('sk-***0001'));
    };
    refused('t'.repeat(257), /the tenant "t{64}\.\.\." of the API key .* is 257 characters long, over the limit of 256/);
    refused('acme\nINFO forged line', /holds a control character/);
    refused(' acme', /begins or ends with a space/);
    refused('anonymous', /"anonymous" .* the label of requests without a key/);
    assert.throws(() => combineKeyConfig(undefined, parseKeysList('sk-name-00000001:anonymous')), /the label of requests without a key/);
    const longest = 't'.repeat(256);
    assert.equal(new KeyStore(combineKeyConfig(parseKeysFile(JSON.stringify({ keys: [{ key: 'sk-1', tenant: longest }] })), undefined))
      .authenticate('Bearer sk-1').name, longest);
  });
});
