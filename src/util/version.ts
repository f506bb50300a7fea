// The package's version, as `conduit --version` prints it and GET /version answers (vLLM's endpoint).

import { readFileSync } from 'node:fs';

export const CONDUIT_VERSION: string = (JSON.parse(readFileSync(new URL('../../package.json', import.meta.url), 'utf8')) as { version: string }).version;
