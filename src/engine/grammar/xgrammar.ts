// XGrammar (the constrained-decoding engine vLLM and SGLang use), from its WebAssembly build @mlc-ai/web-xgrammar.
//
// Its bundle is UMD and its JavaScript wrappers are async (each awaits the module's start-up), while an engine step
// is synchronous. So the bundle is evaluated here with the three names a UMD script under CommonJS expects
// (exports, module, require, __filename: a small shim, no global is touched), and two lines of it are widened so
// that, once the module has started, this file calls the embind classes directly and synchronously:
//   - the module object (`binding`) is handed out, for the classes and the vector helpers;
//   - the module's stderr printer is ours, so a FATAL check's message (XGrammar reports a bad schema, regex or EBNF
//     by aborting) reaches the caller as the error's text instead of the console.
// An abort leaves the WASM instance unusable in principle (the C++ stack was not unwound), so a module that aborted
// is thrown away and the next call loads a fresh one. Inputs are checked in the gateway (src/api/guided.ts) on its own
// instance; a worker compiles only what passed there.

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
}

const PACKAGE = '@mlc-ai/web-xgrammar';
const require = createRequire(import.meta.url);

let bundle: { file: string; source: string } | undefined;

function bundleSource(): { file: string; source: string } {
  if (bundle) return bundle;
  const file = require.resolve(PACKAGE);
  let source = readFileSync(file, 'utf8');
  const widen = (from: string, to: string) => {
    if (!source.includes(from)) throw new GrammarError(`${PACKAGE}: unexpected bundle (no "${from}"); version 0.1.27 is expected`);
    source = source.replace(from, to);
  };
  widen('let binding = null;', 'let binding = null; exports.__binding = () => binding;');
  widen('binding = await Module();', 'binding = await Module(exports.__moduleArg || {});');
  bundle = { file, source };
  return bundle;
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

  /** Evaluates the bundle and starts its WASM module (tens of ms). */
  static async load(): Promise<XGrammar> {
    const { file, source } = bundleSource();
    const exportsObject: Record<string, unknown> = {};
    const messages: string[] = [];
    exportsObject.__moduleArg = {
      print: () => {},
      printErr: (text: string) => { if (messages.length < 20) messages.push(String(text)); },
    };
    new Function('exports', 'module', 'require', '__filename', source)(exportsObject, { exports: exportsObject }, require, file);
    // Any async wrapper starts the module; this one is the cheapest.
    const grammar = await (exportsObject.Grammar as { builtinJSONGrammar(): Promise<{ dispose(): void }> }).builtinJSONGrammar();
    grammar.dispose();
    const binding = (exportsObject.__binding as () => XgBinding)();
    return new XGrammar(binding, messages);
  }

  get usable(): boolean {
    return !this.aborted;
  }

  /** Calls into the module; a FATAL check inside becomes a GrammarError carrying XGrammar's message. */
  run<R>(what: string, call: (binding: XgBinding) => R): R {
    if (this.aborted) throw new GrammarError(`${what}: the grammar engine aborted earlier and must be reloaded`);
    this.messages.length = 0;
    try {
      return call(this.binding);
    } catch (error) {
      const fatal = this.messages.find((line) => line.includes('[FATAL]'));
      if ((error as Error)?.name === 'RuntimeError' || fatal !== undefined) {
        this.aborted = true;
        throw new GrammarError(`${what}: ${fatal ? fatalText(fatal) : (error as Error).message}`);
      }
      throw error;
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
