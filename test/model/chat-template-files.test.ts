// Which chat template a Hugging Face folder serves when it has more than one. transformers' tokenizer loading reads
// chat_template.jinja and lets it take priority over tokenizer_config.json's chat_template (replacing it whole, named
// templates included); chat_template.json is a processor's older file the tokenizer never reads. The loader used to
// prefer tokenizer_config.json, so a folder saved by a recent transformers with both served the older template.

import { describe, it, before, after } from 'node:test';
import assert from 'node:assert/strict';
import { mkdtempSync, rmSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { chatTemplateFromConfig } from '../../src/model/chat-template.ts';
import { loadModel } from '../../src/model/loader.ts';
import type { LoadedModel } from '../../src/model/loader.ts';
import { makeTinyModel, writeTinyHf } from './loader-fixtures.ts';

let dir: string;
before(() => { dir = mkdtempSync(join(tmpdir(), 'conduit-chat-template-files-')); });
after(() => rmSync(dir, { recursive: true, force: true }));

const CONFIG_TEMPLATE = 'CONFIG:{{ messages[0].content }}';
const JINJA_TEMPLATE = 'JINJA:{{ messages[0].content }}';
const JSON_TEMPLATE = 'JSON:{{ messages[0].content }}';

let counter = 0;
function folder(tokenizerConfig: Record<string, unknown>, files: { jinja?: string; json?: string } = {}): string {
  const path = join(dir, `case-${counter++}`);
  writeTinyHf(path, makeTinyModel(), { tokenizerConfig: { bos_token: '<s>', eos_token: '</s>', ...tokenizerConfig } });
  if (files.jinja !== undefined) writeFileSync(join(path, 'chat_template.jinja'), files.jinja);
  if (files.json !== undefined) writeFileSync(join(path, 'chat_template.json'), JSON.stringify({ chat_template: files.json }));
  return path;
}

/** What the engine serves: the template createLocalEngine builds from the loaded tokenizer config. */
function served(loaded: LoadedModel): string {
  assert.equal(loaded.tokenizerSource.kind, 'hf');
  const config = loaded.tokenizerSource.kind === 'hf' ? loaded.tokenizerSource.tokenizerConfig : {};
  const template = chatTemplateFromConfig(config);
  assert.equal(template.isFallback, false);
  return template.render([{ role: 'user', content: 'hi' }]);
}

describe('chat template precedence in a Hugging Face folder', () => {
  it('chat_template.jinja over tokenizer_config.json chat_template, as transformers', async () => {
    const loaded = await loadModel(folder({ chat_template: CONFIG_TEMPLATE }, { jinja: JINJA_TEMPLATE }));
    assert.equal(loaded.chatTemplate, JINJA_TEMPLATE);
    assert.equal(served(loaded), 'JINJA:hi');
    const config = loaded.tokenizerSource.kind === 'hf' ? loaded.tokenizerSource.tokenizerConfig : {};
    assert.equal(config.eos_token, '</s>', 'the rest of tokenizer_config.json is kept');
  });

  it('the file replaces a list of named templates whole', async () => {
    const named = [{ name: 'default', template: CONFIG_TEMPLATE }, { name: 'tool_use', template: 'TOOLS:{{ tools }}' }];
    const loaded = await loadModel(folder({ chat_template: named }, { jinja: JINJA_TEMPLATE }));
    const config = loaded.tokenizerSource.kind === 'hf' ? loaded.tokenizerSource.tokenizerConfig : {};
    assert.equal(config.chat_template, JINJA_TEMPLATE);
    assert.equal(served(loaded), 'JINJA:hi');
  });

  it("a tokenizer_config.json template that does not parse does not matter when the file takes priority", async () => {
    const loaded = await loadModel(folder({ chat_template: '{% for %}' }, { jinja: JINJA_TEMPLATE }));
    assert.equal(served(loaded), 'JINJA:hi');
  });

  it('tokenizer_config.json over chat_template.json; each alone is used', async () => {
    assert.equal(served(await loadModel(folder({ chat_template: CONFIG_TEMPLATE }, { json: JSON_TEMPLATE }))), 'CONFIG:hi');
    assert.equal(served(await loadModel(folder({ chat_template: CONFIG_TEMPLATE }))), 'CONFIG:hi');
    assert.equal(served(await loadModel(folder({}, { json: JSON_TEMPLATE }))), 'JSON:hi');
    assert.equal(served(await loadModel(folder({}, { jinja: JINJA_TEMPLATE, json: JSON_TEMPLATE }))), 'JINJA:hi');
  });
});
