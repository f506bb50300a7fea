// A bounded wait for a condition another thread or timer makes true: polls every millisecond and fails the test
// with `what` after `maxTurns` polls (default 30,000: about 30 s) instead of hanging it.
import assert from 'node:assert/strict';

export async function waitUntil(condition: () => boolean, what: string, maxTurns = 30_000): Promise<void> {
  for (let turns = 0; !condition(); turns++) {
    if (turns >= maxTurns) assert.fail(`timed out waiting until ${what}`);
    await new Promise((resolve) => setTimeout(resolve, 1));
  }
}
