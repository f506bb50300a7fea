#!/usr/bin/env node
// The `conduit` command. Sources are TypeScript run through tsx's loader, so there is no build step to forget;
// worker threads get the same loader from src/util/worker-thread.ts.
import { register } from 'tsx/esm/api';

// Output piped into a reader that stops early (`conduit sim decode-sweep | head -1`): end as a Unix tool killed by
// SIGPIPE does (`yes | head -1`), quietly with status 141 (128 + SIGPIPE), rather than with a stack trace. Node
// ignores SIGPIPE itself, so a write to the closed pipe comes back as an EPIPE error on the stream.
for (const stream of [process.stdout, process.stderr]) {
  stream.on('error', (err) => {
    if (err.code === 'EPIPE') process.exit(141);
    throw err;
  });
}

register();
const { main } = await import('../src/cli/main.ts');
process.exitCode = await main(process.argv.slice(2));
