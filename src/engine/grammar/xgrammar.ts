// XGrammar (the constrained-decoding engine vLLM and SGLang use), from its WebAssembly build @mlc-ai/web-xgrammar.
//
// Its bundle is UMD and its JavaScript wrappers are async (each awaits the module's start-up), while an engine step
// is synchronous. So the bundle is evaluated here, once per thread, with the names a UMD script under CommonJS
// expects (exports, module, require, __filename: a small shim, no global is touched), one line of it widened to hand
// out the Emscripten module factory, and its inline WebAssembly binary compiled once. Each XGrammar below is an
// instance of that module started through the factory (its own memory), whose embind classes this file
// calls directly and synchronously; its stderr printer is ours, so a FATAL check's message (XGrammar reports a bad
// schema, regex or EBNF by aborting) reaches the caller as the error's text instead of the console.
// An abort leaves the WASM instance unusable in principle (the C++ stack was not unwound), so an instance that
// aborted, or that let out anything but a result (a trap, a C++ exception, a stack overflow), is thrown away and the
// next call starts a fresh one. Inputs are checked in the gateway (src/api/guided.ts) on its own instance; a worker
// compiles only what passed there. Once the binary is compiled, an instance can also be started synchronously
// (startSync: a worker's grammar runtime replaces a failed instance between two engine steps, which never await).

import { readFileSync } from 'node:fs';
import { createRequire } from 'node:module';

/** The embind surface of XGrammar 0.1.27 this file uses (untyped in the package). */
/* eslint-disable @typescript-eslint/no-explicit-any */
export interface XgBinding {
  TokenizerInfo: new (vocab: any, vocabType: string, vocabSize: number, stopTokenIds: any, prependSpace: boolean) => XgHandle;
  GrammarCompiler: new (info: XgHandle, maxThreads: number, cacheEnabled: boolean) => XgHandle;
  GrammarMatcher: new (compiled: XgHandle, stopTokens: any, terminateWithoutStop: boolean, maxRollback: number) => XgHandle;
  Grammar: {
    FromJSONSchema: new (schema: string, anyWhitespace: boolean, indent: number | undefined, separators: any,
      strict: boolean, maxWhitespace: number | undefined, print: boolean) => XgHandle;
    FromEBNF: new (ebnf: string, root: string) => XgHandle;
    BuiltinJSONGrammar: new () => XgHandle;
    FromStructuralTag(json: string): XgHandle;
  };
  vecStringFromJSArray(values: string[]): any;
  vecIntFromJSArray(values: number[]): any;
  vecIntToView(vector: any): Int32Array;
}
export type XgHandle = any;
/* eslint-enable @typescript-eslint/no-explicit-any */

export class GrammarError extends Error {
  override name = 'GrammarError';
  /**
   * XGrammar's own report of a bad input (its FATAL check's message): a verdict on the grammar, the same on any
   * instance. Otherwise the instance failed some other way (a trap, a C++ exception, a stack overflow, or it had
   * failed before), which says nothing sure about the input.
   */
  readonly diagnosed: boolean;

  constructor(message: string, diagnosed = false) {
    super(message);
    this.diagnosed = diagnosed;
  }
}

const PACKAGE = '@mlc-ai/web-xgrammar';
const require = createRequire(import.meta.url);

/** The bundle evaluated once per thread: its module factory and its WebAssembly module, compiled once. */
interface Bundle {
  factory: (moduleArg: Record<string, unknown>) => Promise<XgBinding>;
  wasm: Promise<WasmModule>;
  /** The compiled module, once `wasm` has resolved. */
  compiled?: WasmModule;
}

/** The two WebAssembly calls used here (the project's TypeScript libs declare no WebAssembly types). */
type WasmModule = object;
type WasmInstance = object;
const wasmApi = (globalThis as unknown as {
  WebAssembly: {
    compile(bytes: Uint8Array): Promise<WasmModule>;
    Instance: new (module: WasmModule, imports: object) => WasmInstance;
  };
}).WebAssembly;

let bundle: Bundle | undefined;
const counts = { bundles: 0, instances: 0 };
/** Instances started and not yet garbage-collected (see XGrammar.stats). */
const live = new Set<number>();
const finalizer = new FinalizationRegistry<number>((id) => live.delete(id));

function loadBundle(): Bundle {
  if (bundle) return bundle;
  const file = require.resolve(PACKAGE);
  let source = readFileSync(file, 'utf8');
  const widen = (from: string, to: string) => {
    if (!source.includes(from)) throw new GrammarError(`${PACKAGE}: unexpected bundle (no "${from}"); version 0.1.27 is expected`);
    source = source.replace(from, to);
  };
  widen('let binding = null;', 'let binding = null; exports.__factory = Module;');
  // Its only await under Node, before anything else runs: without it, a module handed its instance synchronously
  // (startSync) is ready when the factory returns.
  widen("const{createRequire:createRequire}=await import('module');", "const{createRequire:createRequire}=require('module');");
  // The module's WebAssembly binary is inlined as base64: compiled here once, every instance reuses it.
  const prefix = 'wasmBinaryFile="data:application/octet-stream;base64,';
  const start = source.indexOf(prefix);
  if (start < 0) throw new GrammarError(`${PACKAGE}: unexpected bundle (no inline WebAssembly binary); version 0.1.27 is expected`);
  const end = source.indexOf('"', start + prefix.length);
  const bytes = Buffer.from(source.slice(start + prefix.length, end), 'base64');
  const exportsObject: Record<string, unknown> = {};
  new Function('exports', 'module', 'require', '__filename', source)(exportsObject, { exports: exportsObject }, require, file);
  counts.bundles++;
  const loaded: Bundle = {
    factory: exportsObject.__factory as Bundle['factory'],
    wasm: wasmApi.compile(bytes),
  };
  loaded.wasm.then((compiled) => { loaded.compiled = compiled; }, () => { if (bundle === loaded) bundle = undefined; });
  bundle = loaded;
  return loaded;
}

/** One started XGrammar module. Every call into it goes through run(), which turns an abort into a GrammarError. */
export class XGrammar {
  readonly binding: XgBinding;
  private messages: string[];
  private aborted = false;

  private constructor(binding: XgBinding, messages: string[]) {
    this.binding = binding;
    this.messages = messages;
  }

  /**
   * Starts a fresh module: a new instance (its own memory) of the WebAssembly module compiled once per thread; only
   * the first load evaluates the bundle and compiles the binary.
   */
  static async load(): Promise<XGrammar> {
    await loadBundle().wasm;
    return XGrammar.startSync();
  }

  /**
   * Starts a fresh module without awaiting: the binary must be compiled already (a load() has completed in this
   * thread). A few milliseconds: the instance's memory and the module's start-up.
   */
  static startSync(): XGrammar {
    const { factory, compiled } = loadBundle();
    if (compiled === undefined) throw new GrammarError(`${PACKAGE}: the WebAssembly binary is not compiled yet`);
    const messages: string[] = [];
    const moduleArg: Record<string, unknown> = {
      print: () => {},
      printErr: (text: string) => { if (messages.length < 20) messages.push(String(text)); },
      // Handed over at once, so the module starts within the factory call (its returned promise is not needed).
      instantiateWasm: (imports: object, receive: (instance: WasmInstance, module: WasmModule) => void) => {
        const instance = new wasmApi.Instance(compiled, imports);
        receive(instance, compiled);
        return (instance as { exports: object }).exports;
      },
    };
    factory(moduleArg).catch(() => {});
    if (moduleArg.calledRun !== true) {
      throw new GrammarError(`${PACKAGE}: the module did not start${messages.length > 0 ? ` (${messages.join('; ')})` : ''}`);
    }
    const binding = moduleArg as unknown as XgBinding;
    const xg = new XGrammar(binding, messages);
    const id = ++counts.instances;
    live.add(id);
    finalizer.register(binding, id); // the module object: it holds the instance and its memory
    return xg;
  }

  /**
   * Bundles evaluated and instances started in this thread so far, and instances not yet garbage-collected (a
   * finalizer counts them down some time after collection).
   */
  static stats(): { bundles: number; instances: number; live: number } {
    return { bundles: counts.bundles, instances: counts.instances, live: live.size };
  }

  get usable(): boolean {
    return !this.aborted;
  }

  /**
   * Calls into the module. Anything thrown out of it marks the instance unusable (its state is no longer known: an
   * abort leaves the C++ stack as it was, a trap or a stack overflow may leave memory half written) and becomes a
   * GrammarError: XGrammar's message when a FATAL check reported a bad input (`diagnosed`), else what was thrown.
   */
  run<R>(what: string, call: (binding: XgBinding) => R): R {
    if (this.aborted) throw new GrammarError(`${what}: the grammar engine aborted earlier and must be reloaded`);
    this.messages.length = 0;
    try {
      return call(this.binding);
    } catch (error) {
      this.aborted = true;
      const fatal = this.messages.find((line) => line.includes('[FATAL]'));
      if (fatal !== undefined) throw new GrammarError(`${what}: ${fatalText(fatal)}`, true);
      const text = error instanceof Error ? error.message : `an uncaught C++ exception (${String(error)})`;
      throw new GrammarError(`${what}: the grammar engine failed: ${text}`);
    }
  }
}

/** "[FATAL] /path/file.cc:75: Regex parsing error ..." -> "Regex parsing error ...". */
function fatalText(line: string): string {
  const text = line.replace(/^\[FATAL\]\s*\S+:\d+:\s*/, '').replace(/^Check failed: \(.*?\) is false:\s*/, '');
  return text.length > 300 ? `${text.slice(0, 300)}...` : text;
}

// GPT-2's byte <-> printable character table: every token is handed to XGrammar as its exact bytes in this
// encoding ("byte_level"), whatever the tokenizer's own kind, so the grammar sees the bytes the detokenizer emits.
let byteToChar: string[] | undefined;

export function byteLevelChars(): string[] {
  if (byteToChar) return byteToChar;
  const bytes: number[] = [];
  for (let b = 33; b <= 126; b++) bytes.push(b);
  for (let b = 161; b <= 172; b++) bytes.push(b);
  for (let b = 174; b <= 255; b++) bytes.push(b);
  const chars = bytes.slice();
  let extra = 0;
  for (let b = 0; b < 256; b++) {
    if (!bytes.includes(b)) {
      bytes.push(b);
      chars.push(256 + extra++);
    }
  }
  const table: string[] = new Array(256);
  bytes.forEach((b, i) => { table[b] = String.fromCodePoint(chars[i]!); });
  byteToChar = table;
  return table;
}
