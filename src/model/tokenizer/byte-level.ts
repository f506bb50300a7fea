// GPT-2's byte-level alphabet: every byte is shown as one printable character, so a byte-level BPE vocabulary is a
// list of ordinary strings. Printable Latin-1 bytes stand for themselves; the 68 others (controls, space, 0x7F-0xA0,
// 0xAD) take the code points from U+0100 upwards, in byte order.

function buildByteToChar(): string[] {
  const table: string[] = new Array(256);
  let next = 0x100;
  for (let byte = 0; byte < 256; byte++) {
    const printable = (byte >= 0x21 && byte <= 0x7e) || (byte >= 0xa1 && byte <= 0xac) || byte >= 0xae;
    table[byte] = String.fromCharCode(printable ? byte : next++);
  }
  return table;
}

/** The character that stands for each byte. All are single UTF-16 code units (below U+0144). */
export const BYTE_TO_CHAR: readonly string[] = buildByteToChar();

const CHAR_CODE_TO_BYTE = new Int16Array(0x144).fill(-1);
BYTE_TO_CHAR.forEach((char, byte) => { CHAR_CODE_TO_BYTE[char.charCodeAt(0)] = byte; });

/** The byte a byte-level character stands for, or -1 for a character outside the alphabet. */
export function byteOfChar(charCode: number): number {
  return charCode < CHAR_CODE_TO_BYTE.length ? CHAR_CODE_TO_BYTE[charCode]! : -1;
}

const utf8 = new TextEncoder();

/**
 * The raw bytes a byte-level token string stands for. A character outside the alphabet (an added token written
 * in plain text, say) contributes its own UTF-8 bytes, so nothing is lost.
 */
export function byteLevelToBytes(token: string): Uint8Array {
  const out: number[] = [];
  for (let i = 0; i < token.length; i++) {
    const byte = byteOfChar(token.charCodeAt(i));
    if (byte >= 0) {
      out.push(byte);
    } else {
      const codePoint = token.codePointAt(i)!;
      const char = String.fromCodePoint(codePoint);
      for (const b of utf8.encode(char)) out.push(b);
      i += char.length - 1;
    }
  }
  return Uint8Array.from(out);
}

/** The byte-level spelling of a string's UTF-8 bytes. */
export function toByteLevel(text: string): string {
  let out = '';
  for (const byte of utf8.encode(text)) out += BYTE_TO_CHAR[byte];
  return out;
}
