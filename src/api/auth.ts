// API keys and tenants. Each key belongs to one tenant; limits (requests and tokens per minute, requests in flight)
// and the prefix-cache salt belong to the tenant. With no keys configured the server is open: every request is the
// tenant "anonymous" and no Authorization header is needed.
//
// Keys file (--api-keys-file), either format:
//   JSON:  {"keys": [{"key": "sk-a", "tenant": "acme"}, ...],
//           "tenants": {"acme": {"rpm": 60, "tpm": 100000, "max_concurrent": 4, "cache_group": "shared"},
//                       "ops": {"admin": true}}}
//   Lines: key tenant [rpm] [tpm] [max_concurrent]      ('#' starting a word starts a comment, '-' leaves a limit unset)
// A limit is a positive whole number in decimal digits (JSON: a number so written, not 1e3 or 1000.0; null or absent
// leaves it unset).
// A JSON field other than these is refused (a misspelt "rmp" would leave its tenant unlimited), and so is one key
// given to two tenants.
// Environment (CONDUIT_API_KEYS): "key:tenant,key2:tenant2".
// Tenants with the same cache_group share prefix-cache blocks; by default every tenant is its own group.
// An admin tenant ("admin": true, or the tenant "admin" of --admin-key / CONDUIT_ADMIN_KEY) may read every tenant's
// request traces and the server-wide /v1/slo, /v1/analysis and /metrics; other tenants see only their own traces.

import { createHash } from 'node:crypto';
import { ANONYMOUS_TENANT } from '../telemetry/metrics.ts';
import { InvalidApiKeyError, MissingApiKeyError } from './errors.ts';

export interface TenantLimits {
  requestsPerMinute?: number;
  tokensPerMinute?: number;
  maxConcurrent?: number;
}

export interface Tenant {
  name: string;
  limits: TenantLimits;
  /** Mixed into KV block hashes; undefined = share the cache with everyone (open mode). */
  cacheSalt: string | undefined;
  /** Sees every tenant's traces and the server-wide reports (with keys configured; in open mode everyone does). */
  admin?: boolean;
}

export interface KeyGrant {
  key: string;
  tenant: string;
  /** Where the grant was written (file and line, or file and JSON path), for errors about it. */
  where?: string;
}

export interface TenantConfig {
  limits: TenantLimits;
  cacheGroup?: string;
  admin?: boolean;
}

export interface KeyConfig {
  keys: KeyGrant[];
  tenants: Map<string, TenantConfig>;
}

export class KeyConfigError extends Error {
  override name = 'KeyConfigError';
}

// The tenant of open mode, and the tenant label of a request refused before it had one (a 401), in every metric.
export { ANONYMOUS_TENANT };
/** The tenant of the --admin-key key. */
export const ADMIN_TENANT = 'admin';

function sha256(text: string): string {
  return createHash('sha256').update(text).digest('hex');
}

/** Enough of a key to recognise it in a log or error without revealing it. */
export function keyHint(key: string): string {
  return key.length >= 12 ? `${key.slice(0, 3)}***${key.slice(-4)}` : '***';
}

export class KeyStore {
  /** Keys are held by their SHA-256 so a lookup does not compare secrets byte by byte. */
  private readonly tenantByKeyHash = new Map<string, Tenant>();
  private readonly anonymous: Tenant;

  constructor(config: KeyConfig, defaults: TenantLimits = {}) {
    const tenants = new Map<string, Tenant>();
    const tenantFor = (name: string): Tenant => {
      let tenant = tenants.get(name);
      if (!tenant) {
        const own = config.tenants.get(name);
        // Group names and tenant names salt apart: a group named like a tenant does not join that tenant's cache.
        const cacheSalt = own?.cacheGroup !== undefined ? `group:${own.cacheGroup}` : `tenant:${name}`;
        tenant = { name, limits: { ...defaults, ...own?.limits }, cacheSalt, ...(own?.admin ? { admin: true } : {}) };
        tenants.set(name, tenant);
      }
      return tenant;
    };
    for (const grant of config.keys) {
      const hash = sha256(grant.key);
      const existing = this.tenantByKeyHash.get(hash);
      if (existing && existing.name !== grant.tenant) {
        throw new KeyConfigError(`API key ${keyHint(grant.key)} is given to two tenants: ${existing.name} and ${grant.tenant}${grantPlace(grant)}`);
      }
      this.tenantByKeyHash.set(hash, tenantFor(grant.tenant));
    }
    this.anonymous = { name: ANONYMOUS_TENANT, limits: { ...defaults }, cacheSalt: undefined };
  }

  /** No keys configured: every request is accepted as the anonymous tenant. */
  get isOpen(): boolean {
    return this.tenantByKeyHash.size === 0;
  }

  get keyCount(): number {
    return this.tenantByKeyHash.size;
  }

  /** Some key belongs to an admin tenant. */
  get hasAdmin(): boolean {
    for (const tenant of this.tenantByKeyHash.values()) if (tenant.admin) return true;
    return false;
  }

  /** Whether the tenant may see every tenant's traces and the server-wide reports: any caller in open mode. */
  isAdmin(tenant: Tenant): boolean {
    return this.isOpen || tenant.admin === true;
  }

  /** The tenant for an Authorization header, or a 401. */
  authenticate(authorization: string | undefined): Tenant {
    if (this.isOpen) return this.anonymous;
    const match = authorization?.match(/^\s*Bearer\s+(\S+)\s*$/i);
    if (!match) throw new MissingApiKeyError();
    const tenant = this.tenantByKeyHash.get(sha256(match[1]!));
    if (!tenant) throw new InvalidApiKeyError(keyHint(match[1]!));
    return tenant;
  }
}

// ---- parsing ----

/** Where two grants of one key were written, for the error naming both. */
function grantPlace(grant: KeyGrant): string {
  return grant.where !== undefined ? ` (${grant.where})` : '';
}

/**
 * A limit of the line format: decimal digits, or "-" for none. Number() alone would also take "0x10", "1e3", "0b1"
 * and " 7", so a typo could set a limit far from the one meant.
 */
function lineLimit(raw: string | undefined, what: string, where: string): number | undefined {
  if (raw === undefined || raw === '-') return undefined;
  const value = /^[0-9]+$/.test(raw) ? Number(raw) : NaN;
  if (!Number.isSafeInteger(value) || value <= 0) {
    throw new KeyConfigError(`${where}: ${what} must be a positive integer in decimal digits, or "-" for no limit, got ${JSON.stringify(raw)}`);
  }
  return value;
}

/**
 * A limit of the JSON format: a JSON number, or null or absent for none. A string ("-", "60") is refused, and so is a
 * number not written in decimal digits (`spelling`, its text in the file): 1e3, 1000.0 and 10e2 are 1000 to
 * JSON.parse but are refused by the line format, and by readers that take an integer field as one (Go's encoding/json).
 */
function jsonLimit(raw: unknown, what: string, where: string, spelling: string | undefined): number | undefined {
  if (raw === undefined || raw === null) return undefined;
  if (typeof raw !== 'number' || !Number.isSafeInteger(raw) || raw <= 0) {
    throw new KeyConfigError(`${where}: ${what} must be a positive integer, or null for no limit, got ${JSON.stringify(raw)}`);
  }
  if (spelling !== undefined && !/^[0-9]+$/.test(spelling)) {
    throw new KeyConfigError(`${where}: ${what} must be a positive integer in decimal digits, or null for no limit, got ${spelling}`);
  }
  return raw;
}

/**
 * The text of each number of a JSON document that JSON.parse accepted, by the path of object keys to it joined with
 * NUL (an array's elements under ""); a key given twice keeps its last number, as JSON.parse keeps its last value.
 */
function jsonNumberSpellings(text: string): Map<string, string> {
  const spellings = new Map<string, string>();
  const path: string[] = [];
  let key: string | undefined;
  const number = /-?[0-9]+(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?/y;
  for (let i = 0; i < text.length; i++) {
    const c = text[i]!;
    if (c === '"') {
      const start = i;
      for (i++; text[i] !== '"'; i++) if (text[i] === '\\') i++;
      let next = i + 1;
      while (/\s/.test(text[next] ?? '')) next++;
      key = text[next] === ':' ? JSON.parse(text.slice(start, i + 1)) as string : undefined;
    } else if (c === '{' || c === '[') {
      path.push(key ?? '');
      key = undefined;
    } else if (c === '}' || c === ']') {
      path.pop();
    } else if (c === ',') {
      key = undefined;
    } else if (c === '-' || (c >= '0' && c <= '9')) {
      number.lastIndex = i;
      const token = number.exec(text)![0];
      spellings.set([...path.slice(1), key ?? ''].join('\0'), token);
      i += token.length - 1;
    }
  }
  return spellings;
}

function mergeTenant(config: KeyConfig, name: string, tenant: TenantConfig, where: string): void {
  const previous = config.tenants.get(name);
  if (previous && JSON.stringify(previous) !== JSON.stringify(tenant)) {
    throw new KeyConfigError(`${where}: tenant ${name} is given different limits in two places`);
  }
  config.tenants.set(name, tenant);
}

function dropUndefined(limits: TenantLimits): TenantLimits {
  return Object.fromEntries(Object.entries(limits).filter(([, v]) => v !== undefined)) as TenantLimits;
}

/**
 * Fields of a JSON keys file. Anything else is refused rather than ignored: a misspelt limit ("rmp" for "rpm") would
 * otherwise leave its tenant unlimited without a word.
 */
const JSON_FIELDS = ['keys', 'tenants'];
const JSON_KEY_FIELDS = ['key', 'tenant'];
const JSON_TENANT_FIELDS = ['rpm', 'tpm', 'max_concurrent', 'cache_group', 'admin'];

function refuseUnknownFields(object: object, known: readonly string[], where: string): void {
  const unknown = Object.keys(object).filter((field) => !known.includes(field));
  if (unknown.length > 0) {
    throw new KeyConfigError(`${where}: unknown field${unknown.length > 1 ? 's' : ''} ${unknown.map((f) => JSON.stringify(f)).join(', ')} `
      + `(expected ${known.join(', ')})`);
  }
}

function parseJsonKeys(text: string, source: string): KeyConfig {
  let doc: unknown;
  try {
    doc = JSON.parse(text);
  } catch (err) {
    throw new KeyConfigError(`${source}: not valid JSON (${(err as Error).message})`);
  }
  const root = doc as { keys?: unknown; tenants?: unknown };
  if (typeof root !== 'object' || root === null || !Array.isArray(root.keys)) {
    throw new KeyConfigError(`${source}: expected an object with a "keys" array`);
  }
  refuseUnknownFields(root, JSON_FIELDS, source);
  const config: KeyConfig = { keys: [], tenants: new Map() };
  const spellings = jsonNumberSpellings(text);
  root.keys.forEach((entry: unknown, i: number) => {
    const where = `${source} keys[${i}]`;
    if (typeof entry !== 'object' || entry === null || Array.isArray(entry)) throw new KeyConfigError(`${where}: expected an object {"key", "tenant"}`);
    refuseUnknownFields(entry, JSON_KEY_FIELDS, where);
    const { key, tenant } = entry as { key?: unknown; tenant?: unknown };
    if (typeof key !== 'string' || key.length === 0) throw new KeyConfigError(`${where}: "key" must be a non-empty string`);
    if (typeof tenant !== 'string' || tenant.length === 0) throw new KeyConfigError(`${where}: "tenant" must be a non-empty string`);
    config.keys.push({ key, tenant, where });
  });
  if (root.tenants !== undefined) {
    if (typeof root.tenants !== 'object' || root.tenants === null || Array.isArray(root.tenants)) {
      throw new KeyConfigError(`${source}: "tenants" must be an object keyed by tenant name`);
    }
    for (const [name, raw] of Object.entries(root.tenants as Record<string, unknown>)) {
      const where = `${source} tenants.${name}`;
      if (raw !== null && raw !== undefined && (typeof raw !== 'object' || Array.isArray(raw))) {
        throw new KeyConfigError(`${where}: expected an object of limits {${JSON_TENANT_FIELDS.join(', ')}}`);
      }
      const spec = (raw ?? {}) as Record<string, unknown>;
      refuseUnknownFields(spec, JSON_TENANT_FIELDS, where);
      const cacheGroup = spec.cache_group;
      if (cacheGroup !== undefined && typeof cacheGroup !== 'string') throw new KeyConfigError(`${where}: cache_group must be a string`);
      if (spec.admin !== undefined && typeof spec.admin !== 'boolean') throw new KeyConfigError(`${where}: admin must be true or false`);
      const limit = (field: 'rpm' | 'tpm' | 'max_concurrent'): number | undefined =>
        jsonLimit(spec[field], field, where, spellings.get(['tenants', name, field].join('\0')));
      mergeTenant(config, name, {
        limits: dropUndefined({
          requestsPerMinute: limit('rpm'),
          tokensPerMinute: limit('tpm'),
          maxConcurrent: limit('max_concurrent'),
        }),
        ...(cacheGroup !== undefined ? { cacheGroup } : {}),
        ...(spec.admin === true ? { admin: true } : {}),
      }, where);
    }
  }
  return config;
}

function parseLineKeys(text: string, source: string): KeyConfig {
  const config: KeyConfig = { keys: [], tenants: new Map() };
  // Any line ending: LF, CRLF, or CR alone (old Mac editors), which would otherwise make the whole file one line.
  text.split(/\r\n|\r|\n/).forEach((line, i) => {
    // A comment begins with a word that begins with '#', as in a shell: a key may hold a '#' (a printable
    // character like any other), which would otherwise cut the line inside the key.
    const words = line.replace(/(^|\s)#.*/, '').trim().split(/\s+/).filter(Boolean);
    if (words.length === 0) return;
    const where = `${source}:${i + 1}`;
    if (words.length < 2 || words.length > 5) {
      throw new KeyConfigError(`${where}: expected "key tenant [rpm] [tpm] [max_concurrent]", got ${words.length} words`);
    }
    const [key, tenant, rpm, tpm, maxConcurrent] = words as [string, string, ...(string | undefined)[]];
    config.keys.push({ key, tenant, where });
    if (words.length > 2) {
      mergeTenant(config, tenant, {
        limits: dropUndefined({
          requestsPerMinute: lineLimit(rpm, 'rpm', where),
          tokensPerMinute: lineLimit(tpm, 'tpm', where),
          maxConcurrent: lineLimit(maxConcurrent, 'max_concurrent', where),
        }),
      }, where);
    }
  });
  return config;
}

/** A keys file in either format: JSON when it starts with "{", else one key per line. */
export function parseKeysFile(text: string, source = 'api keys file'): KeyConfig {
  // A byte-order mark (some editors write one) is no part of the text: JSON.parse would refuse it as a token.
  const body = text.startsWith('\uFEFF') ? text.slice(1) : text;
  return body.trimStart().startsWith('{') ? parseJsonKeys(body, source) : parseLineKeys(body, source);
}

/** "key:tenant,key2:tenant2" (CONDUIT_API_KEYS). */
export function parseKeysList(list: string, source = 'CONDUIT_API_KEYS'): KeyGrant[] {
  return list.split(',').map((item) => item.trim()).filter(Boolean).map((item) => {
    const colon = item.lastIndexOf(':');
    // Spaces around the colon ("sk-a: acme") are layout, not part of the name: " acme" would be a tenant apart from
    // "acme", with limits and a cache of its own.
    const key = item.slice(0, Math.max(0, colon)).trim();
    const tenant = item.slice(colon + 1).trim();
    if (colon < 0 || key === '' || tenant === '') {
      throw new KeyConfigError(`${source}: expected "key:tenant", got "${keyHint(item)}"`);
    }
    return { key, tenant };
  });
}

/** What a key may be: what an `Authorization: Bearer <key>` header can carry (printable ASCII, no spaces). */
const KEY_SHAPE = /^[\x21-\x7e]+$/;

/**
 * Longest tenant name: the name goes with each request to worker processes, whose request plane takes at most 1024
 * characters of it, and into every metric series and request log line of the tenant.
 */
export const MAX_TENANT_NAME_LENGTH = 256;

/**
 * Why a tenant name cannot be one, or undefined when it can. A control character would break the request log's
 * line; spaces around the name would make a tenant apart from the one meant; "anonymous" is the label of requests
 * refused before they had a tenant (a 401), so its metrics would mix with theirs.
 */
function tenantNameProblem(name: string): string | undefined {
  if (name.length > MAX_TENANT_NAME_LENGTH) return `is ${name.length} characters long, over the limit of ${MAX_TENANT_NAME_LENGTH}`;
  if (/[\x00-\x1f\x7f]/.test(name)) return 'holds a control character';
  if (name.trim() !== name) return 'begins or ends with a space';
  if (name === ANONYMOUS_TENANT) return 'is the label of requests without a key in every metric';
  return undefined;
}

/**
 * Keys from a file and a list together (either may be absent), plus an admin key (tenant "admin", an admin). Keys
 * given that no request could ever present are refused, and so is a key source given that holds no key: the server
 * would otherwise start open to everyone, the opposite of what was asked.
 */
export function combineKeyConfig(fromFile: KeyConfig | undefined, fromList: KeyGrant[] | undefined, adminKey?: string): KeyConfig {
  const config: KeyConfig = {
    keys: [...(fromFile?.keys ?? []), ...(fromList ?? [])],
    tenants: new Map(fromFile?.tenants ?? []),
  };
  for (const { key, tenant } of config.keys) {
    const problem = tenantNameProblem(tenant);
    if (problem !== undefined) {
      const shown = tenant.length > 64 ? `${tenant.slice(0, 64)}...` : tenant;
      throw new KeyConfigError(`the tenant ${JSON.stringify(shown)} of the API key ${keyHint(key)} ${problem}: rename the tenant`);
    }
    if (!KEY_SHAPE.test(key)) {
      throw new KeyConfigError(`the API key ${keyHint(key)} of tenant ${tenant} has a space or a character outside printable ASCII: `
        + 'no Authorization header can carry it');
    }
  }
  if (adminKey !== undefined) {
    if (!KEY_SHAPE.test(adminKey)) {
      throw new KeyConfigError('--admin-key (CONDUIT_ADMIN_KEY) must be printable ASCII without spaces, and not empty');
    }
    // The admin key's tenant is "admin": keys given to a tenant of that name would become admin keys unasked.
    if (config.keys.some((grant) => grant.tenant === ADMIN_TENANT) && config.tenants.get(ADMIN_TENANT)?.admin !== true) {
      throw new KeyConfigError(`tenant "${ADMIN_TENANT}" is --admin-key's; its keys in the keys file would become admin keys: `
        + 'rename that tenant, or mark it "admin": true');
    }
    config.keys.push({ key: adminKey, tenant: ADMIN_TENANT });
    const own = config.tenants.get(ADMIN_TENANT);
    config.tenants.set(ADMIN_TENANT, { ...own, limits: own?.limits ?? {}, admin: true });
  }
  if (config.keys.length === 0 && (fromFile !== undefined || fromList !== undefined)) {
    throw new KeyConfigError(`${fromFile !== undefined ? 'the API keys file' : '--api-keys (CONDUIT_API_KEYS)'} holds no key: `
      + 'refusing to start open to everyone (give no keys option to run without keys)');
  }
  // The same key for two tenants: which one a request is would depend on the order (KeyStore refuses it too).
  const grantOf = new Map<string, KeyGrant>();
  for (const grant of config.keys) {
    const other = grantOf.get(grant.key);
    if (other !== undefined && other.tenant !== grant.tenant) {
      throw new KeyConfigError(`API key ${keyHint(grant.key)} is given to two tenants: ${other.tenant}${grantPlace(other)} `
        + `and ${grant.tenant}${grantPlace(grant)}`);
    }
    if (other === undefined) grantOf.set(grant.key, grant);
  }
  return config;
}

/** Tenants the configuration gives limits or a role that no key belongs to: most likely misspelt names. */
export function unusedTenants(config: KeyConfig): string[] {
  const named = new Set(config.keys.map((grant) => grant.tenant));
  return [...config.tenants.keys()].filter((name) => !named.has(name));
}
