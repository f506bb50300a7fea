#!/usr/bin/env node
// The `conduit` command. Sources are TypeScript run through tsx's loader, so there is no build step to forget;
// worker threads get the same loader from src/util/worker-thread.ts.
import { register } from 'tsx/esm/api';

register();
const { main } = await import('../src/cli/main.ts');
process.exitCode = await main(process.argv.slice(2));
