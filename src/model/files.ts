// Reading a model's files whole: a GGUF file, a safetensors shard, a JSON file of a Hugging Face folder.
//
// What the file system answers becomes one ModelFormatError line naming the file: a folder, device or FIFO where a
// file belongs (reading /dev/zero or a FIFO would never end), a file that cannot be opened, a file that shrinks while
// it is read. readFile stops at 2 GiB, and most real checkpoints have larger files (a Llama 3.2 1B model.safetensors
// is 2.5 GB, 7B shards are 4-10 GB), so those are read in chunks into one buffer of their size. A text file
// (config.json, tokenizer.json, a chat template) must fit in one JavaScript string.

import { constants as bufferConstants } from 'node:buffer';
import { open, readFile, stat } from 'node:fs/promises';
import { ModelFormatError } from './gguf-model.ts';

/**
 * The largest text file read as one string: V8's longest string (2^29 - 24 characters, about 512 MiB). UTF-8 never
 * decodes to more characters than it has bytes, so a file of at most this many bytes always fits; a larger one would
 * fail in Buffer.toString with a plain Error that names neither the file nor the limit.
 */
export const MAX_TEXT_FILE_BYTES = bufferConstants.MAX_STRING_LENGTH;

/** The largest file readFile reads in one call (Node's kIoMaxLength). */
const SINGLE_READ_LIMIT = 2 ** 31 - 1;
const CHUNK_BYTES = 1 << 30;

/** What an fs error means for a model file, in a few words. */
function reason(error: unknown): string {
  const e = error as NodeJS.ErrnoException;
  switch (e.code) {
    case 'ENOENT': return 'no such file';
    case 'EACCES': case 'EPERM': return 'permission denied';
    case 'EISDIR': return 'it is a folder, not a file';
    default: return e.message;
  }
}

/**
 * The whole file in one buffer. `what` names the file in errors (defaults to its path). The limits are parameters
 * only so that tests can read in chunks without writing gigabytes.
 */
export async function readModelFile(path: string, what = path,
  { singleReadLimit = SINGLE_READ_LIMIT, chunkBytes = CHUNK_BYTES, maxBytes }:
  { singleReadLimit?: number; chunkBytes?: number; maxBytes?: number } = {},
): Promise<Buffer> {
  const info = await stat(path).catch((error: unknown) => {
    throw new ModelFormatError(`cannot read ${what}: ${reason(error)}`);
  });
  if (!info.isFile()) {
    throw new ModelFormatError(`${what} is not a regular file (${info.isDirectory() ? 'a folder' : 'a device, FIFO or socket'})`);
  }
  if (info.size > bufferConstants.MAX_LENGTH) {
    throw new ModelFormatError(`${what} is ${info.size} bytes, more than one buffer holds (${bufferConstants.MAX_LENGTH})`);
  }
  // Checked before reading: no use reading half a gigabyte to refuse it.
  if (maxBytes !== undefined && info.size > maxBytes) {
    throw new ModelFormatError(`${what} is ${info.size} bytes, more than the ${maxBytes} bytes a text file of a ` +
      'model may have (the longest string JavaScript holds)');
  }
  try {
    if (info.size <= singleReadLimit) return await readFile(path);
    const bytes = Buffer.allocUnsafe(info.size);
    const file = await open(path, 'r');
    try {
      for (let offset = 0; offset < info.size;) {
        const { bytesRead } = await file.read(bytes, offset, Math.min(chunkBytes, info.size - offset), offset);
        if (bytesRead === 0) {
          throw new ModelFormatError(`${what}: the file ended at byte ${offset} of ${info.size} while reading`);
        }
        offset += bytesRead;
      }
    } finally {
      await file.close();
    }
    return bytes;
  } catch (error) {
    if (error instanceof ModelFormatError) throw error;
    throw new ModelFormatError(`cannot read ${what}: ${reason(error)}`);
  }
}

/** A text file (JSON, a Jinja template) of a model, whole, as UTF-8; refused as a ModelFormatError past MAX_TEXT_FILE_BYTES. */
export async function readModelText(path: string, what = path, maxBytes = MAX_TEXT_FILE_BYTES): Promise<string> {
  return (await readModelFile(path, what, { maxBytes })).toString('utf8');
}
