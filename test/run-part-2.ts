// Part 2 of the two npm test runs side by side (`node --test` starts one process per entry file): most suites wait
// on child processes, sockets and timers more than they compute, so two processes share the machine's cores.
import { importTestFiles } from './run-files.ts';

await importTestFiles({ filter: process.env.CONDUIT_TEST_FILTER, part: [2, 2] });
