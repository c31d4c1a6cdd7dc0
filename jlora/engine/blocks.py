"""BlockAllocator: the free list of KV cache blocks (host side; the device only sees block tables)."""

from __future__ import annotations

import heapq


class BlockAllocator:
    def __init__(self, num_blocks: int):
        self.num_blocks = num_blocks
        self._free = list(range(num_blocks))  # a heap: low ids first keeps reuse predictable

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise RuntimeError(f"asked for {n} KV blocks with {len(self._free)} free")
        return [heapq.heappop(self._free) for _ in range(n)]

    def free(self, blocks: list[int]) -> None:
        for b in blocks:
            heapq.heappush(self._free, b)
