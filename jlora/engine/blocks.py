"""BlockAllocator: the KV cache blocks on the host side (the device only sees block tables).

Blocks are reference counted: with prefix caching (`jlora.engine.prefix_cache`) several sequences
may share a computed block. A block nobody references goes back to the free heap, or, when it
holds a cached prefix, is parked: still free to take (`num_free` counts it), but kept until
`allocate` runs out of never-cached blocks and evicts the least recently used parked one.
"""

from __future__ import annotations

import heapq

from jlora.engine.prefix_cache import PrefixCache


class BlockAllocator:
    def __init__(self, num_blocks: int, prefix_cache: PrefixCache | None = None):
        self.num_blocks = num_blocks
        self._free = list(range(num_blocks))  # a heap: low ids first keeps reuse predictable
        self._refs = [0] * num_blocks
        self.cache = prefix_cache

    @property
    def num_free(self) -> int:
        """Blocks `allocate` can hand out: never-cached ones and parked cached ones."""
        return len(self._free) + (self.cache.num_parked if self.cache is not None else 0)

    @property
    def num_cached_free(self) -> int:
        """Parked blocks: cached prefixes no sequence references."""
        return self.cache.num_parked if self.cache is not None else 0

    def refs(self, block: int) -> int:
        return self._refs[block]

    def num_parked_among(self, blocks: list[int]) -> int:
        """How many of `blocks` sharing them would take out of `num_free`."""
        return sum(self._refs[b] == 0 for b in blocks)

    def allocate(self, n: int) -> list[int]:
        """n unreferenced blocks, never-cached ones first, then the least recently used parked ones."""
        if n > self.num_free:
            raise RuntimeError(f"asked for {n} KV blocks with {self.num_free} free")
        out = []
        for _ in range(n):
            b = heapq.heappop(self._free) if self._free else self.cache.evict_lru()
            self._refs[b] = 1
            out.append(b)
        return out

    def share(self, blocks: list[int]) -> list[int]:
        """Take a reference to cached blocks (from `PrefixCache.lookup`); returns them."""
        for b in blocks:
            if self._refs[b] == 0:
                self.cache.unpark(b)
            self._refs[b] += 1
        return list(blocks)

    def free(self, blocks: list[int]) -> None:
        """Drop one reference to each. Last blocks first, so a sequence's later blocks are parked as
        older and evicted before its earlier ones (a chain is useless without its start)."""
        for b in reversed(blocks):
            if self._refs[b] <= 0:
                raise RuntimeError(f"KV block {b} freed while not in use")
            self._refs[b] -= 1
            if self._refs[b] == 0:
                if self.cache is not None and self.cache.holds(b):
                    self.cache.park(b)
                else:
                    heapq.heappush(self._free, b)

    def drop_cache(self) -> None:
        """The KV cache's contents are gone: forget every cached prefix (parked blocks become plain free)."""
        if self.cache is not None:
            for b in self.cache.clear():
                heapq.heappush(self._free, b)
