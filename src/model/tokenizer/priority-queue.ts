// A binary min-heap. The merge loops of both BPE flavours pop the best candidate pair, merge it and push the
// (at most two) new pairs it creates, so each merge costs O(log n) instead of a rescan of the whole word.

export class PriorityQueue<T> {
  private readonly items: T[] = [];

  /** `before(a, b)` is true when a must pop before b. */
  constructor(private readonly before: (a: T, b: T) => boolean) {}

  get size(): number { return this.items.length; }

  push(item: T): void {
    const items = this.items;
    let index = items.length;
    items.push(item);
    while (index > 0) {
      const parent = (index - 1) >> 1; // below index, so in range
      const above = items[parent]!;
      if (!this.before(item, above)) break;
      items[index] = above;
      index = parent;
    }
    items[index] = item;
  }

  pop(): T | undefined {
    const items = this.items;
    if (items.length === 0) return undefined;
    const top = items[0];
    const last = items.pop()!;
    const length = items.length;
    if (length > 0) {
      let index = 0;
      for (;;) {
        const left = 2 * index + 1;
        if (left >= length) break;
        const right = left + 1;
        // left < length is checked above and right < length before use.
        const child = right < length && this.before(items[right]!, items[left]!) ? right : left;
        const below = items[child]!;
        if (!this.before(below, last)) break;
        items[index] = below;
        index = child;
      }
      items[index] = last;
    }
    return top;
  }
}
