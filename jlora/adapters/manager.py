"""The AdapterManager: which adapter version is in which device slot, coordinating the host store and the slots.

Three owners, one module each:
- `jlora.adapters.slots`: the device slots. `LoRASlots` holds the slot arrays (`lora_state`) and is
  the only thing that writes them, through the one jitted, donated `set_slot`; the engine's
  ModelRunner holds it, beside the weights and the KV cache.
- `jlora.adapters.host_store`: the host copies. `HostStore` reads and converts PEFT adapters (or
  reads the disk cache of converted ones) and keeps an LRU of `AdapterHandle`s.
- here: the slot table, host-side bookkeeping only. Which version is in which slot, pins, the LRU
  eviction of unpinned slots, which version of each name is current, and the queue of `SlotWrite`s.

`acquire(handle)` assigns a slot and queues a `SlotWrite` (slot index + the update, already
padded); the scheduler hands the queue to the step plan (`take_writes`) and the runner applies it
right before the step that reads those slots. The padding (`padded_update`, 78 MB of zeros per
adapter at rank 64 on SmolLM2) happens where the adapter is converted (`prepare`, on the
`prepare_async` worker for the server) and is kept in the handle, which is also the host cache's
entry: a slot miss on the step thread copies nothing on the host. Measured (SmolLM2, rank 64, 2
busy cores): padding 76 ms, the slot write 59 ms, so a miss costs the step ~59 ms, not ~135.

`prepare(req)` converts and returns an `AdapterHandle`; `acquire(handle)` pins a slot holding that
version (reusing it if resident, else taking a free slot or evicting the least recently used
unpinned one); `release(slot)` unpins it (pins are counted).

Versions. A name is one adapter. A request for a known name whose lora_int_id or lora_path
differs, or whose files changed on disk (mtime/size) since they were read, or (for an adapter
held in memory, `LoRARequest(..., tensors=, config=)`) whose content_hash differs, is a new version: it
is loaded (a bad one raises and changes nothing), the old version leaves the host cache, and the
old version's slot is retired: freed at once if unpinned, else when its last pin is released.
Requests already running keep the weights they started with; no request ever gets weights other
than those at its own LoRARequest's path. One lora_int_id used for two different names at once
is rejected (ValueError), since vLLM identifies adapters by that id.

The names of `slots` and `host_store` are re-exported here (`from jlora.adapters.manager import
LoRASlots, SlotWrite, padded_update, set_slot, AdapterHandle` keep working).
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import logging
import os
import threading
from pathlib import Path
from typing import Any, Collection, Sequence

import jax.numpy as jnp
import numpy as np

from jlora.adapters.host_store import MEMORY, AdapterHandle, HostStore, _Version, fingerprint, request_version
from jlora.adapters.request import LoRARequest
from jlora.adapters.slots import (
    LoRASlots, SlotUpdate, SlotWrite, base_weights, packed_splits, padded_update, set_slot, slot_module,
)
from jlora.engine.config import default_max_cpu_loras
from jlora.models.config import LORA_MODULES, LlamaConfig

__all__ = [
    "AdapterHandle", "AdapterManager", "HostStore", "LoRASlots", "MEMORY", "NoFreeSlotError", "SlotUpdate",
    "SlotWrite", "base_weights", "fingerprint", "packed_splits", "padded_update", "request_version", "set_slot",
    "slot_module",
]

logger = logging.getLogger(__name__)


class NoFreeSlotError(RuntimeError):
    """Every device slot is pinned by a running request; retry after one is released."""


# ---- the manager ----------------------------------------------------------------------------------------


@dataclasses.dataclass
class _Slot:
    version: _Version
    handle: AdapterHandle  # what it was written from
    pins: int = 0
    last_used: int = 0
    stale: bool = False  # an older version of its name: never handed out again, freed when unpinned

    @property
    def name(self) -> str:
        return self.version[0]

    @property
    def int_id(self) -> int:
        return self.version[1]


class AdapterManager:
    """The slot table of N device slots (which adapter version each holds, pins, LRU eviction), the
    queue of slot writes, and a `HostStore` (`host`) of converted adapters."""

    def __init__(
        self,
        model_cfg: LlamaConfig,
        max_loras: int,
        max_lora_rank: int,
        max_cpu_loras: int | None = None,
        dtype: Any = jnp.float32,
        modules: tuple[str, ...] = LORA_MODULES,
        max_cpu_lora_bytes: int | None = None,
        disk_cache: bool | str | os.PathLike = False,
        slot_ranks: Sequence[int] | None = None,
        dora: bool = False,
    ):
        """`dora`: the slots hold DoRA factors (`EngineConfig.enable_dora`); without it a DoRA adapter
        is refused when prepared, naming the option.
        `max_cpu_loras` (default `default_max_cpu_loras(max_loras)`, as the engine's) and `max_cpu_lora_bytes` (default: no bound) bound the
        host LRU cache of converted adapters; `disk_cache` is False (off), True (the default directory,
        `jlora.adapters.disk_cache.default_cache_dir()`) or a directory."""
        for name, v in (("max_loras", max_loras), ("max_lora_rank", max_lora_rank)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"AdapterManager: {name} must be a positive int, got {v!r}")
        if max_cpu_loras is None:
            max_cpu_loras = default_max_cpu_loras(max_loras)
        if isinstance(max_cpu_loras, bool) or not isinstance(max_cpu_loras, int) or max_cpu_loras < 0:
            raise ValueError(f"AdapterManager: max_cpu_loras must be an int >= 0, got {max_cpu_loras!r}")
        self.model_cfg = model_cfg
        self.max_loras = max_loras
        self.max_lora_rank = max_lora_rank
        # Each slot's rank (LoRASlots' pools, ascending): an adapter goes only where it fits.
        self.slot_ranks = tuple(sorted(slot_ranks)) if slot_ranks is not None else (max_lora_rank,) * max_loras
        if len(self.slot_ranks) != max_loras or self.slot_ranks[-1] > max_lora_rank:
            raise ValueError(f"AdapterManager: slot_ranks={self.slot_ranks} must have max_loras={max_loras} "
                             f"entries of at most max_lora_rank={max_lora_rank}")
        self.dtype = dtype
        self.modules = tuple(modules)
        self.dora = bool(dora)
        self._slots: list[_Slot | None] = [None] * max_loras
        self._writes: dict[int, SlotWrite] = {}  # slot -> its queued write (take_writes)
        self._current: dict[str, _Version] = {}  # name -> its newest version seen
        self._unloads: dict[str, int] = {}  # name -> how often it was unloaded (prepare checks it did not change)
        self._clock = 0
        self._lock = threading.RLock()
        self._converting: dict[_Version, concurrent.futures.Future] = {}  # conversions in flight (prepare)
        self._worker: concurrent.futures.ThreadPoolExecutor | None = None  # prepare_async's thread, made on first use
        self._closed = False
        # disk_loads (host-cache misses: read from the disk cache or converted), conversions, host_hits,
        # host_evictions, disk_cache_hits / _misses / _rebuilds, slot_hits, slot_writes (queued), evictions
        self.stats = collections.Counter()
        self.host = HostStore(model_cfg, max_lora_rank, max_cpu_loras, dtype, self.modules, max_cpu_lora_bytes,
                              disk_cache, lock=self._lock, stats=self.stats, dora=self.dora)

    # ---- cache settings -------------------------------------------------------------------------------

    @property
    def max_cpu_loras(self) -> int:
        return self.host.max_cpu_loras

    @property
    def max_cpu_lora_bytes(self) -> int | None:
        return self.host.max_cpu_lora_bytes

    @property
    def disk_cache_dir(self) -> Path | None:
        return self.host.disk_cache_dir

    def set_max_cpu_lora_bytes(self, max_cpu_lora_bytes: int | None) -> None:
        """Bound the host cache's bytes (None: no bound); evicts least recently used adapters at once."""
        self.host.set_max_cpu_lora_bytes(max_cpu_lora_bytes)

    def set_disk_cache(self, disk_cache: bool | str | os.PathLike | None) -> None:
        """False/None: no disk cache; True: the default directory; a path: there. JLORA_ADAPTER_CACHE=0
        turns it off whatever is asked."""
        self.host.set_disk_cache(disk_cache)

    def host_bytes(self) -> int:
        """Bytes of the host cache: converted adapters and their padded copies (what
        `max_cpu_lora_bytes` bounds)."""
        return self.host.host_bytes()

    def close(self) -> None:
        """Stop `prepare_async`'s worker (conversions not started are cancelled, one under way is not
        waited for) and drop the host cache. Idempotent; `prepare_async` raises after it."""
        with self._lock:
            self._closed = True
            worker, self._worker = self._worker, None
            self.host.clear()
            self._writes.clear()
        if worker is not None:
            worker.shutdown(wait=False, cancel_futures=True)

    # ---- public API -----------------------------------------------------------------------------------

    def prepare(self, req: LoRARequest) -> AdapterHandle:
        """Read and convert `req`'s adapter, pad it to the slot shape (the host cache is used and
        filled) and return a handle to exactly this version, for `acquire(handle)`.

        Touches no slot. Raises ValueError / FileNotFoundError for a bad adapter, so a caller can
        reject a request up front instead of when it is scheduled. The conversion runs without the
        manager's lock, so another thread's `acquire`/`release` (the engine's step loop) never
        waits for it; concurrent prepares of one version convert it once.
        """
        self._check_request(req)
        version = self._version(req)
        with self._lock:
            self._check_int_id(req)
            unloads = self._unloads.get(req.lora_name, 0)  # an unload while converting must stay unloaded
            handle = self._cached(version)
            pending = None if handle is not None else self._converting.get(version)
            mine = handle is None and pending is None
            if mine:
                pending = self._converting[version] = concurrent.futures.Future()
        if handle is None and not mine:
            handle = pending.result()  # another thread is converting it (its error is ours too)
        elif mine:
            try:
                handle = self.host.convert(version, req)
            except BaseException as e:
                with self._lock:
                    del self._converting[version]
                pending.set_exception(e)
                raise
            with self._lock:
                del self._converting[version]
                if self._unloads.get(req.lora_name, 0) == unloads:
                    self.host.store(version, handle)
            pending.set_result(handle)
        with self._lock:
            # Unloaded meanwhile: the handle still serves the request that asked (as a retired
            # version), but the name is not brought back.
            if self._unloads.get(req.lora_name, 0) == unloads:
                self._current[req.lora_name] = version
        return handle

    def adopt(self, handle: AdapterHandle) -> None:
        """Take `handle`, prepared by another manager of the same model and slot shape (a
        data-parallel replica's), as the current version of its name and keep it in the host cache:
        an adapter is converted once for all replicas, and `acquire(handle)` works here too."""
        if not isinstance(handle, AdapterHandle):
            raise ValueError(f"adopt: expected an AdapterHandle, got {type(handle).__name__}")
        with self._lock:
            if self._cached(handle.version) is None:
                self.host.store(handle.version, handle)
            self._current[handle.name] = handle.version

    def prepare_async(self, req: LoRARequest) -> concurrent.futures.Future:
        """`prepare(req)` on the manager's background worker: a Future of the AdapterHandle, done at
        once when the adapter is already converted. A missing path raises here; conversion errors
        come out of the Future."""
        self._check_request(req)
        version = self._version(req)
        with self._lock:
            if self._closed:
                raise RuntimeError("this adapter manager is closed (its engine was closed)")
            done = self._cached(version, touch=False) is not None
            if not done and self._worker is None:
                self._worker = concurrent.futures.ThreadPoolExecutor(2, thread_name_prefix="jlora-adapters")
        if done:
            fut: concurrent.futures.Future = concurrent.futures.Future()
            try:
                fut.set_result(self.prepare(req))
            except Exception as e:  # e.g. a lora_int_id clash
                fut.set_exception(e)
            return fut
        return self._worker.submit(self.prepare, req)

    def acquire(self, handle: AdapterHandle | None, protect: Collection[str] = ()) -> int:
        """A pinned slot holding exactly `handle`'s version (from `prepare`); -1 for None (base model).

        Reuses the slot if that version is resident (current or retired); otherwise takes a free
        slot, else the least recently used unpinned one, and queues its write (`take_writes`): the
        device state changes only when the runner applies the queue. If the name has moved on to
        a newer version (or was unloaded), the slot is written as a retired one that only holders
        of this handle use. Raises NoFreeSlotError when every slot is pinned; nothing changes then.
        `protect`: adapter names still needed soon (the queue's); their unpinned slots are evicted last.
        """
        if handle is None:
            return -1
        if not isinstance(handle, AdapterHandle):
            raise ValueError(f"acquire: expected an AdapterHandle (from prepare) or None, got {type(handle).__name__}")
        with self._lock:
            version = handle.version
            for i, s in enumerate(self._slots):  # resident, current or retired
                if s is not None and s.version == version:
                    s.pins += 1
                    s.last_used = self._tick()
                    self.stats["slot_hits"] += 1
                    return i
            current = self._current.get(handle.name) == version
            # An unpinned older version of a current name will be retired: its slot counts as free.
            rank = handle.adapter.rank
            victim = self._pick_slot(also_free=lambda s: current and s.name == handle.name, protect=protect,
                                     rank=rank)
            if victim is None:
                fitting = sum(r >= rank for r in self.slot_ranks)
                raise NoFreeSlotError(
                    f"all {fitting} adapter slots of rank >= {rank} are pinned by running requests "
                    f"({', '.join(repr(s.name) for s in self._slots if s is not None)}); cannot load "
                    f"{handle.name!r} until one is released (or raise max_loras)")
            if current:
                self._retire_other_versions(version)
            if self._slots[victim] is not None:
                self.stats["evictions"] += 1
            self._writes[victim] = SlotWrite(victim, handle.update)  # a write queued earlier for it is void
            self.stats["slot_writes"] += 1
            self._slots[victim] = _Slot(version, handle, pins=1, last_used=self._tick(), stale=not current)
            return victim

    def take_writes(self) -> tuple[SlotWrite, ...]:
        """The slot writes queued since the last call (one per slot, the latest), emptying the queue.
        The scheduler puts them in the next step plan; the runner applies them before that step."""
        with self._lock:
            writes = tuple(self._writes.values())
            self._writes.clear()
            return writes

    def release(self, slot: int) -> None:
        """Unpin one acquire of `slot` (-1 is the base model: a no-op)."""
        if slot is None or slot == -1:
            return
        with self._lock:
            if isinstance(slot, bool) or not isinstance(slot, (int, np.integer)) or not 0 <= slot < self.max_loras:
                raise ValueError(f"release: slot={slot!r} must be -1 or in [0, {self.max_loras})")
            s = self._slots[slot]
            if s is None or s.pins <= 0:
                raise ValueError(f"release: slot {slot} is not pinned")
            s.pins -= 1
            s.last_used = self._tick()
            if s.pins == 0 and s.stale:
                self._slots[slot] = None

    def unload(self, name: str) -> bool:
        """Forget adapter `name`: drop it from the host cache and free its slot (at once if unpinned,
        else when released). Returns whether anything was known under that name."""
        with self._lock:
            found = False
            self._unloads[name] = self._unloads.get(name, 0) + 1
            self._current.pop(name, None)
            for v in [v for v in self.host.versions() if v[0] == name]:
                self.host.drop(v)
                found = True
            for i, s in enumerate(self._slots):
                if s is not None and s.name == name:
                    found = found or not s.stale
                    if s.pins == 0:
                        self._slots[i] = None
                    else:
                        s.stale = True
            return found

    def list_adapters(self) -> list[str]:
        """Names of adapters the manager holds, on the host or in a slot (current versions)."""
        with self._lock:
            names = {v[0] for v in self.host.versions()}
            names |= {s.name for s in self._slots if s is not None and not s.stale}
            return sorted(names)

    def resident(self) -> dict[int, str]:
        """slot -> adapter name for every slot serving a current adapter version."""
        with self._lock:
            return {i: s.name for i, s in enumerate(self._slots) if s is not None and not s.stale}

    def pins(self, slot: int) -> int:
        with self._lock:
            s = self._slots[slot]
            return 0 if s is None else s.pins

    def slot_of(self, name: str) -> int | None:
        """The slot serving the current version of `name`, if resident."""
        with self._lock:
            for i, s in enumerate(self._slots):
                if s is not None and not s.stale and s.name == name:
                    return i
            return None

    # ---- internals ------------------------------------------------------------------------------------

    @staticmethod
    def _check_request(req: Any) -> None:
        if not isinstance(req, LoRARequest):
            raise ValueError(f"expected a LoRARequest, got {type(req).__name__}")

    def _tick(self) -> int:
        self._clock += 1
        return self._clock

    def _version(self, req: LoRARequest) -> _Version:
        return request_version(req)

    def _check_int_id(self, req: LoRARequest) -> None:
        known = self.host.versions() + [s.version for s in self._slots if s is not None and not s.stale]
        for name, int_id, *_ in known:
            if int_id == req.lora_int_id and name != req.lora_name:
                raise ValueError(f"lora_int_id={req.lora_int_id} is already used by adapter {name!r}; "
                                 f"{req.lora_name!r} needs its own id (or unload {name!r} first)")

    def _pick_slot(self, also_free, protect: Collection[str] = (), rank: int = 0) -> int | None:
        """The slot to write an adapter of `rank` into: among slots of at least that rank, a free one
        (the smallest rank), else retired versions, then unneeded adapters, least recently used first."""
        best, best_key = None, None
        for i, s in enumerate(self._slots):
            if self.slot_ranks[i] < rank:
                continue
            if s is None:
                key = (0, 0, self.slot_ranks[i], i)
            elif s.pins == 0:
                key = (1 if also_free(s) else 2, s.name in protect, s.last_used, i)
            else:
                continue
            if best_key is None or key < best_key:
                best, best_key = i, key
        return best

    def _cached(self, version: _Version, touch: bool = True) -> AdapterHandle | None:
        """`version` as already converted: a slot's handle or the host cache's (under the lock).
        `touch`: count a host-cache hit and mark it recently used."""
        for s in self._slots:
            if s is not None and s.version == version:
                return s.handle
        return self.host.get(version, touch)

    def _retire_other_versions(self, version: _Version) -> None:
        self.host.drop_others(version)
        for i, s in enumerate(self._slots):
            if s is not None and s.name == version[0] and s.version != version:
                if s.pins == 0:
                    self._slots[i] = None
                else:
                    s.stale = True


