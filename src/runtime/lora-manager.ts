// The LoRA adapters of one served model: which are registered (name -> file, from --lora-modules or
// POST /v1/load_lora_adapter), which are resident on the workers (at most maxLoras, least recently used evicted
// first, never one with requests in flight), and the loading of a registered adapter on demand when a request names
// it. The workers themselves only hold what this tells them to (Engine.loadLora / unloadLora). An adapter whose rank
// is above maxLoraRank (--max-lora-rank) is refused when it is loaded (unloaded again from the workers that read it).
//
// Unregistering an adapter that requests still use does not refuse (as vLLM does not): its name is gone at once
// (new requests get 404, the name can be registered again), and it stays resident, draining, until the last of its
// requests releases it; then the workers unload it.
//
// Each registration gets its own key, the name the workers know the adapter by and the one its KV blocks are hashed
// under: an adapter evicted and loaded again from the same registration keeps its key (its cached prefixes stay
// valid), while a name unloaded and registered again with another file gets a new one (no stale KV reuse).

import { LoraLoadError } from '../engine/errors.ts';
import type { Engine, LoraLoadInfo } from '../engine/types.ts';

/** Adapters resident per model by default. */
export const DEFAULT_MAX_LORAS = 8;
/** The highest adapter rank loaded by default (vLLM's --max-lora-rank default). */
export const DEFAULT_MAX_LORA_RANK = 16;

/** Every resident adapter has requests in flight, so none can make room for another: retry later. */
export class LoraCapacityError extends Error {
  override name = 'LoraCapacityError';
  constructor(readonly adapter: string, readonly maxLoras: number) {
    super(`LoRA adapter '${adapter}' cannot be loaded now: all ${maxLoras} resident adapters (--max-loras) have requests in flight`);
  }
}

export interface LoraManagerStats {
  registered: number;
  /** Resident on the workers now. */
  resident: number;
  loads: number;
  evictions: number;
}

interface Registration {
  name: string;
  path: string;
  key: string;
  info?: LoraLoadInfo;
  resident: boolean;
  /** Set while its load runs: later acquirers wait for the same load. */
  loading?: Promise<void>;
  inFlight: number;
  lastUsed: number;
}

export class LoraManager {
  private readonly adapters = new Map<string, Registration>();
  /** Unregistered adapters whose requests are still in flight: resident until the last one releases. */
  private readonly draining = new Set<Registration>();
  private generation = 0;
  private useClock = 0;
  private loads = 0;
  private evictions = 0;

  constructor(private readonly engine: Engine, readonly maxLoras: number = DEFAULT_MAX_LORAS,
    private readonly log?: (message: string) => void, readonly maxLoraRank: number = DEFAULT_MAX_LORA_RANK) {
    if (!Number.isInteger(maxLoras) || maxLoras < 1) throw new RangeError(`maxLoras must be a whole number >= 1, got ${maxLoras}`);
    if (!Number.isInteger(maxLoraRank) || maxLoraRank < 1) throw new RangeError(`maxLoraRank must be a whole number >= 1, got ${maxLoraRank}`);
  }

  /** Registered adapters in registration order, with whether each is resident. */
  list(): { name: string; path: string; resident: boolean }[] {
    return [...this.adapters.values()].map(({ name, path, resident }) => ({ name, path, resident }));
  }

  has(name: string): boolean {
    return this.adapters.has(name);
  }

  stats(): LoraManagerStats {
    let resident = 0;
    for (const a of [...this.adapters.values(), ...this.draining]) if (a.resident) resident++;
    return { registered: this.adapters.size, resident, loads: this.loads, evictions: this.evictions };
  }

  /**
   * Registers an adapter and loads it now (so a bad file is refused at once, with the workers' reason), evicting
   * the least recently used idle adapter when maxLoras are resident. Throws LoraLoadError (the file, a name taken)
   * or LoraCapacityError.
   */
  async register(name: string, path: string): Promise<LoraLoadInfo> {
    if (this.adapters.has(name)) throw new LoraLoadError('invalid_adapter', `The lora adapter '${name}' has already been loaded.`);
    const registration: Registration = { name, path, key: `${name}#${++this.generation}`, resident: false, inFlight: 0, lastUsed: ++this.useClock };
    this.adapters.set(name, registration);
    try {
      await this.makeResident(registration);
    } catch (error) {
      this.adapters.delete(name);
      throw error;
    }
    return registration.info!;
  }

  /**
   * Forgets an adapter: new requests no longer find it. With no request in flight it is unloaded from the workers
   * now; otherwise when the last of them releases it (drained). Resolves the requests still in flight.
   */
  async unregister(name: string): Promise<{ inFlight: number }> {
    const registration = this.adapters.get(name);
    if (!registration) throw new LoraLoadError('lora_not_loaded', `The lora adapter '${name}' cannot be found.`);
    this.adapters.delete(name);
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
      await this.engine.unloadLora!(registration.key);
    }
  }

  /**
   * A request is about to run with the adapter: loads it if it is not resident (evicting as needed) and counts the
   * request until release(). Returns the key the engine knows the adapter by (EngineRequest.lora).
   */
  async acquire(name: string): Promise<string> {
    const registration = this.adapters.get(name);
    if (!registration) throw new LoraLoadError('lora_not_loaded', `The lora adapter '${name}' cannot be found.`);
    registration.inFlight++;
    registration.lastUsed = ++this.useClock;
    try {
      if (!registration.resident) await this.makeResident(registration);
    } catch (error) {
      registration.inFlight--;
      throw error;
    }
    return registration.key;
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
    }
  }

  private async makeResident(registration: Registration): Promise<void> {
    if (registration.resident) return;
    if (registration.loading) return registration.loading;
    const load = async () => {
      await this.makeRoom(registration);
      if (!this.engine.loadLora) throw new LoraLoadError('invalid_adapter', 'this engine runs no LoRA adapters');
      const info = await this.engine.loadLora(registration.key, registration.path);
      // The rank is known once a worker has read the adapter (the path is the workers', which may be elsewhere).
      if (info.rank > this.maxLoraRank) {
        await this.engine.unloadLora!(registration.key).catch(() => {});
        throw new LoraLoadError('invalid_adapter',
          `LoRA adapter '${registration.name}' has rank ${info.rank}, greater than the maximum LoRA rank ${this.maxLoraRank} (--max-lora-rank)`);
      }
      registration.info = info;
      registration.resident = true;
      this.loads++;
    };
    registration.loading = load().finally(() => { registration.loading = undefined; });
    return registration.loading;
  }

  /** Evicts least recently used idle adapters until one more fits. */
  private async makeRoom(incoming: Registration): Promise<void> {
    for (;;) {
      const occupying = [...this.adapters.values(), ...this.draining].filter((a) => a !== incoming && (a.resident || a.loading));
      if (occupying.length < this.maxLoras) return;
      const idle = occupying.filter((a) => a.resident && !a.loading && a.inFlight === 0).sort((x, y) => x.lastUsed - y.lastUsed);
      const victim = idle[0];
      if (!victim) throw new LoraCapacityError(incoming.name, this.maxLoras);
      victim.resident = false;
      this.evictions++;
      this.log?.(`LoRA adapter '${victim.name}' evicted (least recently used) to load '${incoming.name}'`);
      await this.engine.unloadLora!(victim.key);
    }
  }
}
