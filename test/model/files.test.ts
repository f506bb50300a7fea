// Reading model files whole: larger than one read (in chunks, as files over 2 GiB are), and the file system's
// answers as one line naming the file.

import { describe, it, before, after } from 'node:test';
import assert from 'node:assert/strict';
import { mkdirSync, mkdtempSync, rmSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { readModelFile } from '../../src/model/files.ts';
import { ModelFormatError } from '../../src/model/gguf-model.ts';

let dir: string;
before(() => { dir = mkdtempSync(join(tmpdir(), 'conduit-files-')); });
after(() => rmSync(dir, { recursive: true, force: true }));

describe('readModelFile', () => {
  it('reads a file larger than one read in chunks, byte for byte', async () => {
    const path = join(dir, 'data.bin');
    const data = Buffer.from(Array.from({ length: 1000 }, (_, i) => (i * 7) % 256));
    writeFileSync(path, data);
    // A single-read limit of 100 bytes stands for readFile's 2 GiB; 33-byte chunks leave a short last one.
    const read = await readModelFile(path, 'data.bin', { singleReadLimit: 100, chunkBytes: 33 });
    assert.ok(read.equals(data));
    assert.ok((await readModelFile(path)).equals(data));
  });

  it('names the file and the problem in one line', async () => {
    const folder = join(dir, 'folder');
    mkdirSync(folder);
    await assert.rejects(readModelFile(folder, 'shard.safetensors'),
      (e) => e instanceof ModelFormatError && e.message === 'shard.safetensors is not a regular file (a folder)');
    await assert.rejects(readModelFile(join(dir, 'absent')),
      (e) => e instanceof ModelFormatError && /^cannot read .*absent: no such file$/.test(e.message));
  });
});
