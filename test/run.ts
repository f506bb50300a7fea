// Every test file in one process (test/run-files.ts), or those whose path under test/ contains CONDUIT_TEST_FILTER
// (e.g. "model/gguf"): `node --import tsx test/run.ts`.
import { importTestFiles } from './run-files.ts';

await importTestFiles({ filter: process.env.CONDUIT_TEST_FILTER });
