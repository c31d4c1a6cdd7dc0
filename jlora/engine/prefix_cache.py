"""Adapter-aware prefix caching: which KV blocks hold which token prefix, under which adapter version.

A full block's identity is a chained hash: sha256(parent identity + the block's token ids), where
the chain starts from the adapter identity (`root_hash`): the base model, or the adapter's
version as the AdapterManager names it (name, lora_int_id, path, and the files' fingerprint or
the in-memory content hash). Keys and values depend on every earlier token and on the LoRA
weights of every layer below, so a block is reused only for the same tokens, after the same
prefix, under exactly the same weights: never under another adapter, the base model, or a
reloaded version of the same name (vLLM's stale-KV bugs #30931, #42125).

`PrefixCache` is the host bookkeeping beside the `BlockAllocator`: hash -> block for computed
blocks, the blocks no sequence references (kept, evicted least recently used when blocks are
needed) and the blocks running sequences are computing now ("claims": a waiting sequence whose
next block is claimed waits for it instead of computing it a second time). Counters: tokens
queried and hit (vLLM's prefix_cache_queries / prefix_cache_hits).
"""

from __future__ import annotations

import collections
import hashlib
from typing import Any, Sequence

import numpy as np

_DOMAIN = b"jlora-prefix-cache-v1\0"


def root_hash(adapter_version: tuple | None) -> bytes:
    """The start of every chain: the base model, or one adapter version (`AdapterHandle.version`)."""
    ident = b"base" if adapter_version is None else b"lora:" + repr(tuple(adapter_version)).encode()
    return hashlib.sha256(_DOMAIN + ident).digest()


def extend_hashes(hashes: list[bytes], root: bytes, token_ids: Sequence[int], block_size: int, n_blocks: int) -> None:
    """Append to `hashes` (the chain of `token_ids`'s first blocks) until it covers `n_blocks` full blocks."""
    parent = hashes[-1] if hashes else root
    for i in range(len(hashes), n_blocks):
        block = np.asarray(token_ids[i * block_size: (i + 1) * block_size], np.int64)
        if len(block) != block_size:
            raise ValueError(f"block {i} is not full ({len(block)} of {block_size} tokens)")
        parent = hashlib.sha256(parent + block.tobytes()).digest()
        hashes.append(parent)


class PrefixCache:
    """hash -> computed block, the unreferenced ("parked") blocks in LRU order, and claims."""

    def __init__(self) -> None:
        self._block_of: dict[bytes, int] = {}
        self._hash_of: dict[int, bytes] = {}
        self._parked: collections.OrderedDict[int, None] = collections.OrderedDict()  # oldest first
        self._claims: dict[bytes, Any] = {}  # hash -> the running sequence computing that block
        self.queries = 0  # prompt tokens looked up
        self.hits = 0  # of them, found computed
        self.evictions = 0  # cached blocks forgotten to make room

    def __len__(self) -> int:
        return len(self._block_of)

    @property
    def num_parked(self) -> int:
        return len(self._parked)

    def lookup(self, hashes: Sequence[bytes]) -> list[int]:
        """The blocks of the longest cached prefix of `hashes` (not referenced: see BlockAllocator.share)."""
        out = []
        for h in hashes:
            b = self._block_of.get(h)
            if b is None:
                break
            out.append(b)
        return out

    def holds(self, block: int) -> bool:
        return block in self._hash_of

    def register(self, h: bytes, block: int) -> bool:
        """`block` now holds the computed keys and values of chain `h`. False (and nothing kept) when
        another block already holds it (two sequences computed it at once): this one stays private."""
        self._claims.pop(h, None)
        if h in self._block_of or block in self._hash_of:
            return False
        self._block_of[h] = block
        self._hash_of[block] = h
        return True

    # ---- blocks nobody references --------------------------------------------------------------

    def park(self, block: int) -> None:
        self._parked[block] = None  # most recently used last

    def unpark(self, block: int) -> None:
        del self._parked[block]

    def is_parked(self, block: int) -> bool:
        return block in self._parked

    def evict_lru(self) -> int:
        """Forget the least recently used unreferenced block and return it for reuse."""
        block, _ = self._parked.popitem(last=False)
        self.evictions += 1
        del self._block_of[self._hash_of.pop(block)]
        return block

    def clear(self) -> list[int]:
        """Forget everything (the KV cache was lost); returns the parked blocks, now plain free ones."""
        parked = list(self._parked)
        self._block_of.clear()
        self._hash_of.clear()
        self._parked.clear()
        self._claims.clear()
        return parked

    # ---- blocks being computed ------------------------------------------------------------------

    def claim(self, hashes: Sequence[bytes], seq: Any) -> None:
        for h in hashes:
            if h not in self._block_of:
                self._claims.setdefault(h, seq)

    def claimed(self, h: bytes) -> bool:
        return h in self._claims

    def drop_claims(self, hashes: Sequence[bytes], seq: Any) -> None:
        for h in hashes:
            if self._claims.get(h) is seq:
                del self._claims[h]
