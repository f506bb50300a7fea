// The LoRA adapters of one served model: which are registered (name -> file, from --lora-modules or
// POST /v1/load_lora_adapter), which are resident on the workers (at most maxLoras, least recently used evicted
// first, never one with requests in flight), and the loading of a registered adapter on demand when a request names
// it. The workers themselves only hold what this tells them to (Engine.loadLora / unloadLora).
//
// A refused adapter evicts nothing: its rank is checked against maxLoraRank (--max-lora-rank) from the file's header
// (inspectLoraAdapter) first, and an adapter is loaded onto the workers before anything is evicted to make room for
// it, so whatever they refuse (no file, not an adapter, made for another base model) leaves the resident adapters as
// they were; only a load they took evicts the least recently used idle adapter after it (for that moment the workers
// hold one adapter more than maxLoras). That adapter is chosen when the load starts and takes no new requests until
// it is evicted (they wait, as for a yielding one), or until the load is refused. A refusal is the same whatever the
// occupancy: never a LoraCapacityError.
// Only when nothing is at the path here (a simulated worker's adapter named without a file) is the rank known after
// a worker loaded it; it is then checked and the adapter unloaded again.
//
// A request for an adapter that is not resident while every resident one has requests in flight waits here (as a
// request vLLM's scheduler cannot give a LoRA slot stays in its waiting queue while the ones behind it run): base-model
// requests and requests for resident adapters go on meanwhile, since the engine never sees the waiting one. The waiters
// are served first come, first served; so that a resident adapter kept busy by a steady stream of requests cannot keep
// them waiting forever, one busy resident adapter (the least recently used) is asked to yield its slot while anyone
// waits for one: it takes no new requests (they wait too, in the same queue), and once its requests in flight end it is
// evicted for the first waiter. A waiter therefore waits at most for the queue ahead of it and for the requests in
// flight on one adapter, each bounded by its max_tokens. A wait ends early when its signal aborts (the client left, a
// timeout) or its adapter is unregistered.
//
// Unregistering an adapter that requests still use does not refuse (as vLLM does not): its name is gone at once
// (new requests get 404, the name can be registered again), and it stays resident, draining, until the last of its
// requests releases it; then the workers unload it.
//
// Each registration gets a key, the name the workers know the adapter by and the one its KV blocks are hashed
// under: the name and a digest of the adapter's bytes. An adapter evicted and loaded again keeps its key (its cached
// prefixes stay valid); every worker that holds the same adapter under the same name has the same key (a frontend's
// router hashes with it too); and a name registered again with other bytes, in this process or after a restart
// (a disk KV tier outlives the process), gets another, so no block computed with other weights is reused. Loading
// again after an eviction reads the path again, so the bytes are checked against that digest: the workers report the
// digest of what they loaded (WorkerLoraInfo; checked before the loads of engines that do not are made, from the file
// here), and an adapter whose file changed (or went) since it was registered is refused, a 400 saying to load it
// again, rather than served with new weights under the old key.

import { createHash } from 'node:crypto';
import { LoraLoadError } from '../engine/errors.ts';
import type { Engine, LoraLoadInfo } from '../engine/types.ts';
import { inspectLoraAdapter, type LoraAdapterHeader } from '../model/lora.ts';

/** Adapters resident per model by default. */
export const DEFAULT_MAX_LORAS = 8;
/** The highest adapter rank loaded by default (vLLM's --max-lora-rank default). */
export const DEFAULT_MAX_LORA_RANK = 16;

/** Every resident adapter has requests in flight, so none can make room for another: retry later. */
export class LoraCapacityError extends Error {
  override name = 'LoraCapacityError';
  /** `message`: a worker's own words, when the refusal came from one over the request plane. */
  constructor(readonly adapter: string, readonly maxLoras: number, message?: string) {
    super(message ?? `LoRA adapter '${adapter}' cannot be loaded now: all ${maxLoras} resident adapters (--max-loras) have requests in flight`);
  }
}

export interface LoraManagerStats {
  registered: number;
  /** Resident on the workers now. */
  resident: number;
  loads: number;
  evictions: number;
  /** Requests waiting for their adapter to get a slot (every resident one busy). */
  waiting: number;
}

export interface LoraManagerOptions {
  /** Reads an adapter's rank and digest before it is loaded (default inspectLoraAdapter). */
  inspect?: (path: string) => Promise<LoraAdapterHeader | undefined>;
}

/** One registered adapter as list() gives it. */
export interface LoraAdapterEntry {
  name: string;
  path: string;
  resident: boolean;
  /** The key the workers know it by (EngineRequest.lora). */
  key: string;
  /** Its rank, once known (from the header, or from a load). */
  rank?: number;
}

interface Registration {
  name: string;
  path: string;
  key: string;
  /** The SHA-256 of the adapter's bytes its key was made from; undefined when nothing was at the path (simulated). */
  digest?: string;
  /** Loaded at least once: a load after this one reads the path again. */
  loaded?: boolean;
  info?: LoraLoadInfo;
  rank?: number;
  resident: boolean;
  /** Set while its load runs: later acquirers wait for the same load. */
  loading?: Promise<void>;
  inFlight: number;
  lastUsed: number;
  /** Chosen to give its slot to a waiter: takes no new requests until it is evicted or nobody waits for a slot. */
  yielding: boolean;
  /**
   * An idle adapter a load under way will evict once the workers took the new one: it takes no new requests meanwhile
   * (they wait), and takes them again if that load is refused.
   */
  evictFor?: Registration;
}

/** A request waiting for its adapter (acquire); settled by grant() or an abort. */
interface Waiter {
  registration: Registration;
  resolve: () => void;
  reject: (error: unknown) => void;
  /** Detaches the abort listener. */
  done: () => void;
}

export class LoraManager {
  private readonly adapters = new Map<string, Registration>();
  /** Unregistered adapters whose requests are still in flight: resident until the last one releases. */
  private readonly draining = new Set<Registration>();
  /** Requests waiting for their adapter, first come first served. */
  private readonly waiters: Waiter[] = [];
  private useClock = 0;
  private loads = 0;
  private evictions = 0;
  /** Whether the engine's loads report the digest of the bytes they read (known after the first load). */
  private engineDigests: boolean | undefined;

  private readonly inspect: (path: string) => Promise<LoraAdapterHeader | undefined>;

  constructor(private readonly engine: Engine, readonly maxLoras: number = DEFAULT_MAX_LORAS,
    private readonly log?: (message: string) => void, readonly maxLoraRank: number = DEFAULT_MAX_LORA_RANK,
    options: LoraManagerOptions = {}) {
    this.inspect = options.inspect ?? inspectLoraAdapter;
    if (!Number.isInteger(maxLoras) || maxLoras < 1) throw new RangeError(`maxLoras must be a whole number >= 1, got ${maxLoras}`);
    if (!Number.isInteger(maxLoraRank) || maxLoraRank < 1) throw new RangeError(`maxLoraRank must be a whole number >= 1, got ${maxLoraRank}`);
  }

  /** Registered adapters in registration order, with whether each is resident. */
  list(): LoraAdapterEntry[] {
    return [...this.adapters.values()].map(({ name, path, resident, key, rank }) => ({ name, path, resident, key, ...(rank !== undefined ? { rank } : {}) }));
  }

  has(name: string): boolean {
    return this.adapters.has(name);
  }

  stats(): LoraManagerStats {
    let resident = 0;
    for (const a of [...this.adapters.values(), ...this.draining]) if (a.resident) resident++;
    return { registered: this.adapters.size, resident, loads: this.loads, evictions: this.evictions, waiting: this.waiters.length };
  }

  /**
   * Registers an adapter and loads it now (so a bad file is refused at once, with the workers' reason), evicting
   * the least recently used idle adapter when maxLoras are resident. Throws LoraLoadError (the file, a name taken)
   * or LoraCapacityError.
   */
  async register(name: string, path: string): Promise<LoraLoadInfo> {
    const taken = () => new LoraLoadError('invalid_adapter', `The lora adapter '${name}' has already been loaded.`);
    if (this.adapters.has(name)) throw taken();
    // The rank first, from the file: a refusal must not have evicted anything.
    let header: LoraAdapterHeader | undefined;
    try {
      header = await this.inspect(path);
    } catch (error) {
      throw new LoraLoadError('invalid_adapter', (error as Error).message);
    }
    if (header) this.checkRank(name, header.rank);
    if (this.adapters.has(name)) throw taken();
    // A simulated adapter has no file to digest: its path stands for it.
    const key = `${name}#${(header?.digest ?? createHash('sha256').update(path).digest('hex')).slice(0, 16)}`;
    // The same adapter under the same name, unregistered while its requests still run: it is taken back as it is.
    const drained = [...this.draining].find((r) => r.key === key);
    if (drained) {
      this.draining.delete(drained);
      drained.path = path;
      this.adapters.set(name, drained);
      await this.makeResident(drained);
      return drained.info!;
    }
    const registration: Registration = {
      name, path, key, resident: false, inFlight: 0, lastUsed: ++this.useClock, yielding: false,
      ...(header ? { rank: header.rank, digest: header.digest } : {}),
    };
    this.adapters.set(name, registration);
    try {
      await this.makeResident(registration);
    } catch (error) {
      // Only this registration: the name may have been unloaded and loaded again while this load ran.
      if (this.adapters.get(name) === registration) this.adapters.delete(name);
      throw error;
    }
    return registration.info!;
  }

  private checkRank(name: string, rank: number): void {
    if (rank > this.maxLoraRank) {
      throw new LoraLoadError('invalid_adapter',
        `LoRA adapter '${name}' has rank ${rank}, greater than the maximum LoRA rank ${this.maxLoraRank} (--max-lora-rank)`);
    }
  }

  /**
   * Forgets an adapter: new requests no longer find it. With no request in flight it is unloaded from the workers
   * now; otherwise when the last of them releases it (drained). Resolves the requests still in flight.
   */
  async unregister(name: string): Promise<{ inFlight: number }> {
    const registration = this.adapters.get(name);
    if (!registration) throw new LoraLoadError('lora_not_loaded', `The lora adapter '${name}' cannot be found.`);
    this.adapters.delete(name);
    registration.yielding = false;
    this.rejectWaiters(registration, () => new LoraLoadError('lora_not_loaded', `The lora adapter '${name}' cannot be found.`));
    if (registration.inFlight > 0) {
      this.draining.add(registration);
      this.log?.(`LoRA adapter '${name}' unregistered; unloaded once its ${registration.inFlight} request(s) in flight finish`);
      return { inFlight: registration.inFlight };
    }
    await this.unloadDetached(registration);
    return { inFlight: 0 };
  }

  /** Unloads a registration no longer in the table from the workers (after a load under way settles). */
  private async unloadDetached(registration: Registration): Promise<void> {
    this.draining.delete(registration);
    await registration.loading?.catch(() => {});
    if (registration.resident) {
      registration.resident = false;
      try {
        await this.engine.unloadLora!(registration.key);
      } finally {
        this.pump();
      }
    }
  }

  /**
   * A request is about to run with the adapter: loads it if it is not resident (evicting as needed) and counts the
   * request until release(). Returns the key the engine knows the adapter by (EngineRequest.lora). When every
   * resident adapter is busy (or this one yields its slot), it waits its turn (see the top of this file) until
   * `signal` aborts: then it rejects with the signal's reason.
   */
  async acquire(name: string, signal?: AbortSignal): Promise<string> {
    const registration = this.adapters.get(name);
    if (!registration) throw new LoraLoadError('lora_not_loaded', `The lora adapter '${name}' cannot be found.`);
    signal?.throwIfAborted();
    // Not past those already waiting for a slot, nor onto an adapter that yields its slot.
    const queue = registration.yielding || registration.evictFor !== undefined
      || (this.waiters.length > 0 && !registration.resident && registration.loading === undefined);
    // Nor is a load tried that could only end in waiting: every resident adapter is busy.
    const full = !registration.resident && registration.loading === undefined && !this.hasRoomFor(registration);
    if (!queue && !full) {
      registration.inFlight++;
      registration.lastUsed = ++this.useClock;
      try {
        if (!registration.resident) await this.makeResident(registration);
        return registration.key;
      } catch (error) {
        registration.inFlight--;
        if (!(error instanceof LoraCapacityError)) throw error;
      }
    }
    await this.wait(registration, signal);
    return registration.key;
  }

  /** Queues a request for the registration; resolves once grant() counted it in flight with the adapter resident. */
  private wait(registration: Registration, signal: AbortSignal | undefined): Promise<void> {
    return new Promise<void>((resolve, reject) => {
      const onAbort = () => {
        const at = this.waiters.indexOf(waiter);
        if (at < 0) return;
        this.waiters.splice(at, 1);
        waiter.done();
        reject(signal!.reason);
        this.pump();
      };
      const waiter: Waiter = {
        registration, resolve, reject,
        done: () => signal?.removeEventListener('abort', onAbort),
      };
      signal?.addEventListener('abort', onAbort);
      this.waiters.push(waiter);
      if (this.waiters.length === 1) this.log?.(`a request for LoRA adapter '${registration.name}' waits: all ${this.maxLoras} resident adapters (--max-loras) have requests in flight`);
      this.pump();
    });
  }

  /**
   * Serves the waiters that can be served now, in order: those whose adapter is resident (and not yielding) or
   * loading, and those that find a slot (free, or an idle adapter to evict) while nobody ahead of them still needs
   * one. When someone is left needing a slot, one busy adapter is asked to yield it; when nobody is, none yields.
   */
  private pump(): void {
    for (let pass = 0; pass < 2; pass++) {
      let blocked = false;
      for (let i = 0; i < this.waiters.length;) {
        const waiter = this.waiters[i]!;
        const { registration } = waiter;
        const ready = (registration.resident && !registration.yielding && registration.evictFor === undefined) || registration.loading !== undefined;
        if (ready || (!blocked && !registration.resident && this.hasRoomFor(registration))) {
          this.waiters.splice(i, 1);
          this.grant(waiter);
          continue;
        }
        if (!registration.resident) blocked = true;
        i++;
      }
      if (blocked) {
        this.chooseYielding();
        return;
      }
      const yielding = [...this.adapters.values()].filter((r) => r.yielding);
      if (yielding.length === 0) return;
      // Nobody needs a slot any more: the yielding adapter takes requests again, those queued for it first.
      for (const registration of yielding) registration.yielding = false;
    }
  }

  /** A waiter's turn: counted in flight, and the adapter loaded when it is not resident. */
  private grant(waiter: Waiter): void {
    const { registration } = waiter;
    registration.inFlight++;
    registration.lastUsed = ++this.useClock;
    if (registration.resident) {
      waiter.done();
      waiter.resolve();
      return;
    }
    this.makeResident(registration).then(() => {
      waiter.done();
      waiter.resolve();
    }, (error: unknown) => {
      registration.inFlight--;
      if (error instanceof LoraCapacityError && this.adapters.get(registration.name) === registration) {
        // Another load took the slot meanwhile: first in the queue again.
        this.waiters.unshift(waiter);
      } else {
        waiter.done();
        waiter.reject(error);
      }
      this.pump();
    });
  }

  /**
   * Whether a load of `incoming` finds a slot now: a free one, or an idle resident adapter to evict that no load under
   * way will take (a load evicts only once it has loaded, so each counts in the slots until then).
   */
  private hasRoomFor(incoming: Registration): boolean {
    const occupying = [...this.adapters.values(), ...this.draining].filter((a) => a !== incoming && (a.resident || a.loading));
    const idle = occupying.filter((a) => a.resident && !a.loading && a.inFlight === 0).length;
    return occupying.length + 1 - this.maxLoras <= idle;
  }

  /** Asks the least recently used busy adapter to give its slot up, unless one already does (or drains). */
  private chooseYielding(): void {
    if ([...this.adapters.values()].some((r) => r.yielding && r.resident) || [...this.draining].some((r) => r.resident)) return;
    const busy = [...this.adapters.values()].filter((r) => r.resident && !r.loading && r.inFlight > 0).sort((x, y) => x.lastUsed - y.lastUsed);
    const victim = busy[0];
    if (!victim) return;
    victim.yielding = true;
    this.log?.(`LoRA adapter '${victim.name}' takes no new requests until its ${victim.inFlight} in flight end: its slot goes to a waiting adapter`);
  }

  /** Rejects the waiters for a registration (unregistered). */
  private rejectWaiters(registration: Registration, error: () => Error): void {
    for (let i = 0; i < this.waiters.length;) {
      const waiter = this.waiters[i]!;
      if (waiter.registration !== registration) {
        i++;
        continue;
      }
      this.waiters.splice(i, 1);
      waiter.done();
      waiter.reject(error());
    }
    this.pump();
  }

  /**
   * acquire() by the key a request carries (a worker: the frontend names the adapter by the key the worker
   * published). Throws LoraLoadError lora_not_loaded when no registered adapter has that key.
   */
  acquireKey(key: string, signal?: AbortSignal): Promise<string> {
    const registration = [...this.adapters.values()].find((r) => r.key === key);
    if (!registration) return Promise.reject(new LoraLoadError('lora_not_loaded', `no LoRA adapter with key '${key}' is loaded here`));
    return this.acquire(registration.name, signal);
  }

  /** A request that acquire() returned `key` for is done with the adapter. */
  release(key: string): void {
    const registration = [...this.adapters.values(), ...this.draining].find((r) => r.key === key);
    if (!registration || registration.inFlight === 0) return;
    registration.inFlight--;
    if (registration.inFlight === 0 && this.draining.has(registration)) {
      this.unloadDetached(registration).catch((error: unknown) => {
        this.log?.(`LoRA adapter '${registration.name}' (unregistered) failed to unload: ${(error as Error).message}`);
      });
    } else if (registration.inFlight === 0 && this.waiters.length > 0) {
      this.pump();
    }
  }

  private async makeResident(registration: Registration): Promise<void> {
    if (registration.resident) return;
    if (registration.loading) return registration.loading;
    const load = async () => {
      if (!this.engine.loadLora) throw new LoraLoadError('invalid_adapter', 'this engine runs no LoRA adapters');
      // Loaded first, evicting nothing: a file the workers refuse leaves the resident adapters as they were. The idle
      // adapter that will make room is chosen now, and takes no new requests until then.
      const victim = this.chooseVictim(registration);
      try {
        // Loading again reads the path again: for an engine that does not say what it read, the file is checked here.
        if (registration.loaded && registration.digest !== undefined && this.engineDigests !== true) await this.checkUnchanged(registration);
        const info = await this.engine.loadLora(registration.key, registration.path);
        try {
          this.checkLoaded(registration, info);
          await this.makeRoom(registration);
        } catch (error) {
          await this.engine.unloadLora!(registration.key).catch(() => {});
          throw error;
        }
        registration.info = info;
        registration.rank = info.rank;
      } finally {
        if (victim?.evictFor === registration) {
          victim.evictFor = undefined;
          if (this.waiters.length > 0) this.pump();
        }
      }
      registration.resident = true;
      registration.loaded = true;
      this.loads++;
    };
    registration.loading = load().finally(() => {
      registration.loading = undefined;
      if (this.waiters.length > 0) this.pump();
    });
    return registration.loading;
  }

  /**
   * What the workers loaded, checked: its rank (a file with no header here, a simulated adapter), and the digest of
   * the bytes they read against the one the adapter's key was made from (the file changed since it was registered).
   */
  private checkLoaded(registration: Registration, info: LoraLoadInfo & { digest?: unknown }): void {
    const digest = typeof info.digest === 'string' ? info.digest : undefined;
    this.engineDigests ??= digest !== undefined;
    if (registration.digest !== undefined && digest !== undefined && digest !== registration.digest) throw this.changed(registration);
    this.checkRank(registration.name, info.rank);
  }

  /** Before a load the engine cannot check: the file still holds the bytes the adapter was registered with. */
  private async checkUnchanged(registration: Registration): Promise<void> {
    let header: LoraAdapterHeader | undefined;
    try {
      header = await this.inspect(registration.path);
    } catch (error) {
      throw new LoraLoadError('invalid_adapter', (error as Error).message);
    }
    if (header?.digest !== registration.digest) throw this.changed(registration, header === undefined);
  }

  private changed(registration: Registration, gone = false): LoraLoadError {
    const { name, path } = registration;
    if (!registration.loaded) return new LoraLoadError('invalid_adapter', `LoRA adapter '${name}': ${path} changed while it was being loaded; load it again`);
    return new LoraLoadError('invalid_adapter', `LoRA adapter '${name}': ${path} ${gone ? 'no longer exists' : 'changed'} since the adapter was `
      + `loaded (its cached prompts are the old file's); unload it and load it again, or load ${gone ? 'another' : 'the new'} file under another name`);
  }

  /** Idle resident adapters `incoming` may evict, least recently used first: those chosen for it, then unclaimed ones. */
  private evictable(incoming: Registration, occupying: Registration[]): Registration[] {
    return occupying.filter((a) => a.resident && !a.loading && a.inFlight === 0 && (a.evictFor === undefined || a.evictFor === incoming))
      .sort((x, y) => Number(y.evictFor === incoming) - Number(x.evictFor === incoming) || x.lastUsed - y.lastUsed);
  }

  /** The idle adapter a load will evict once it loaded, claimed now (none when a slot is free, or none is idle). */
  private chooseVictim(incoming: Registration): Registration | undefined {
    const occupying = [...this.adapters.values(), ...this.draining].filter((a) => a !== incoming && (a.resident || a.loading));
    const claimed = occupying.filter((a) => a.evictFor !== undefined).length;
    if (occupying.length - claimed < this.maxLoras) return undefined;
    const victim = this.evictable(incoming, occupying).find((a) => a.evictFor === undefined);
    if (victim) victim.evictFor = incoming;
    return victim;
  }

  /** Evicts least recently used idle adapters (the one chosen for it first) until one more fits. */
  private async makeRoom(incoming: Registration): Promise<void> {
    for (;;) {
      const occupying = [...this.adapters.values(), ...this.draining].filter((a) => a !== incoming && (a.resident || a.loading));
      if (occupying.length < this.maxLoras) return;
      const victim = this.evictable(incoming, occupying)[0];
      if (!victim) throw new LoraCapacityError(incoming.name, this.maxLoras);
      victim.resident = false;
      victim.yielding = false;
      victim.evictFor = undefined;
      this.evictions++;
      this.log?.(`LoRA adapter '${victim.name}' evicted (least recently used) to load '${incoming.name}'`);
      await this.engine.unloadLora!(victim.key);
    }
  }
}
