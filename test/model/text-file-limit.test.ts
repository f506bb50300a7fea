// A model's text files (config.json, tokenizer.json, tokenizer_config.json, a chat template, generation_config.json)
// are read into one string, which V8 caps at about 512 MiB. A larger one is refused as a malformed model file, naming
// the file and the limit, before it is read: it used to be read whole and then fail in Buffer.toString with a plain
// Error ("Cannot create a string longer than ...") that the CLI printed as a crash.

import { describe, it, before, after } from 'node:test';
import assert from 'node:assert/strict';
import { mkdtempSync, rmSync, truncateSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { MAX_TEXT_FILE_BYTES, readModelText } from '../../src/model/files.ts';
import { readGenerationConfig } from '../../src/model/generation-config.ts';
import { ModelFormatError } from '../../src/model/gguf-model.ts';
import { isModelLoadError, loadModel } from '../../src/model/loader.ts';
import { makeTinyModel, writeTinyHf } from './loader-fixtures.ts';

let dir: string;
before(() => { dir = mkdtempSync(join(tmpdir(), 'conduit-text-limit-')); });
after(() => rmSync(dir, { recursive: true, force: true }));

/** `path` grown to one byte past the limit; sparse, so it costs no disk and (refused unread) no memory. */
function oversize(path: string): void {
  truncateSync(path, MAX_TEXT_FILE_BYTES + 1);
}

function isLimitRefusal(error: unknown, file: string): true {
  assert.ok(error instanceof ModelFormatError, `expected a ModelFormatError, got ${String((error as Error)?.stack ?? error)}`);
  assert.ok(isModelLoadError(error), 'the CLI prints it as one line');
  assert.ok(error.message.includes(file), `names the file: ${error.message}`);
  assert.ok(error.message.includes(`${MAX_TEXT_FILE_BYTES + 1} bytes`), `gives the size: ${error.message}`);
  assert.ok(error.message.includes(`${MAX_TEXT_FILE_BYTES} bytes`), `names the limit: ${error.message}`);
  return true;
}

describe('text files of a model past the longest string', () => {
  it('readModelText: up to the limit is read, one byte more is refused naming the file and the limit', async () => {
    const path = join(dir, 'small.json');
    writeFileSync(path, '{"a": "é"}');
    const bytes = Buffer.byteLength('{"a": "é"}');
    assert.equal(await readModelText(path, 'small.json', bytes), '{"a": "é"}');
    await assert.rejects(readModelText(path, 'small.json', bytes - 1), (e) => e instanceof ModelFormatError &&
      e.message === `small.json is ${bytes} bytes, more than the ${bytes - 1} bytes a text file of a model may have ` +
        '(the longest string JavaScript holds)');
  });

  const files = ['config.json', 'tokenizer.json', 'tokenizer_config.json', 'chat_template.jinja', 'chat_template.json'];
  for (const name of files) {
    it(`a Hugging Face folder whose ${name} is too large is refused as a malformed model file`, async () => {
      const folder = join(dir, name);
      writeTinyHf(folder, makeTinyModel(), { tokenizerConfig: { bos_token: '<s>' } });
      writeFileSync(join(folder, name), '{}');
      oversize(join(folder, name));
      await assert.rejects(loadModel(folder), (e) => isLimitRefusal(e, join(folder, name)));
    });
  }

  it('generation_config.json too large: said as such, not as "not JSON"', async () => {
    const folder = join(dir, 'generation');
    writeTinyHf(folder, makeTinyModel());
    writeFileSync(join(folder, 'generation_config.json'), '{}');
    oversize(join(folder, 'generation_config.json'));
    await assert.rejects(readGenerationConfig(folder), (e) => isLimitRefusal(e, 'generation_config.json') &&
      !(e as Error).message.includes('not JSON'));
  });
});
