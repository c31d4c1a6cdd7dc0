"""The host adapter store: PEFT adapters read and converted on the host, and the LRU of host copies.

`HostStore` owns everything about an adapter that lives in host memory: it reads an adapter (from
the disk cache of converted adapters when that has it, `jlora.adapters.disk_cache`, else converting
the PEFT files, `jlora.adapters.peft`), pads it to the slot shape (`padded_update`, 78 MB of zeros
per adapter at rank 64 on SmolLM2) once, and keeps the result, an `AdapterHandle`, in an LRU cache
bounded in count (`max_cpu_loras`) and optionally in bytes (`max_cpu_lora_bytes`, counting each
entry's padded copy too). It touches no device memory and no slot; the AdapterManager
(jlora.adapters.manager) shares its lock and stats with it and decides which versions are current.

A version is (name, lora_int_id, resolved path or "<memory>", the files' (name, mtime_ns, size)
or (content_hash,)): `request_version(req)`. A request whose files changed on disk since they
were read names a new version.
"""

from __future__ import annotations

import collections
import dataclasses
import os
import threading
from pathlib import Path

import numpy as np

from jlora.adapters import disk_cache as dc
from jlora.adapters.peft import (
    ADAPTER_CONFIG, BIN_FILE, JLORA_ADAPTER_META, SAFETENSORS_FILE, LoRAAdapter, convert_peft_state_dict,
    is_jlora_adapter_dir, read_adapter,
)
from jlora.adapters.request import LoRARequest
from jlora.adapters.slots import SlotUpdate, _as_dtype, padded_update
from jlora.models import quant
from jlora.models.config import LlamaConfig

_Version = tuple  # (name, int_id, resolved path or "<memory>", file fingerprint or (content_hash,))
MEMORY = "<memory>"


@dataclasses.dataclass(frozen=True, eq=False)
class AdapterHandle:
    """One adapter version as converted when a request arrived, with its slot-shaped copy. A request
    holds its handle, so a preempted request that is admitted again gets the same weights even if
    the files changed; the host cache keeps handles, so the padding is done once per conversion."""

    version: _Version
    adapter: LoRAAdapter
    update: SlotUpdate  # `adapter` padded to the slot shape in the slots' dtype: what a slot write sends

    @property
    def name(self) -> str:
        return self.version[0]

    @property
    def nbytes(self) -> int:
        """Host bytes: the converted adapter and its padded copy."""
        return self.adapter.nbytes + sum(x.nbytes for u in self.update.values() for x in u.values())



def fingerprint(path: Path) -> tuple:
    """(name, mtime_ns, size) of the files that define the adapter at `path`."""
    if not path.exists():
        raise FileNotFoundError(f"adapter path {str(path)!r} does not exist")
    if not path.is_dir():
        raise ValueError(f"adapter path {str(path)!r} is not a directory")
    files = [path / JLORA_ADAPTER_META, path / ADAPTER_CONFIG, path / SAFETENSORS_FILE, path / BIN_FILE]
    weights = path / "weights"
    if weights.is_dir():
        files += sorted(p for p in weights.rglob("*") if p.is_file())
    out = []
    for f in files:
        try:
            st = f.stat()
        except FileNotFoundError:
            continue
        out.append((str(f.relative_to(path)), st.st_mtime_ns, st.st_size))
    return tuple(out)


def request_version(req: LoRARequest) -> _Version:
    """The version `req` names: its name, id and source, with the files' fingerprint (or the content hash)."""
    if req.in_memory:
        return (req.lora_name, req.lora_int_id, MEMORY, (req.content_hash,))
    path = Path(req.lora_path).expanduser().resolve()
    return (req.lora_name, req.lora_int_id, str(path), fingerprint(path))


class HostStore:
    """Converted adapters on the host: an LRU of `AdapterHandle`s bounded in count and bytes, filled by
    `convert` (disk cache or PEFT conversion, then padding). `lock` and `stats` are the AdapterManager's:
    the store is read under the same lock as the slot table, and counts into the same stats
    (disk_loads, conversions, host_hits, host_evictions, disk_cache_hits / _misses / _rebuilds)."""

    def __init__(self, model_cfg: LlamaConfig, max_lora_rank: int, max_cpu_loras: int, dtype: object,
                 modules: tuple[str, ...], max_cpu_lora_bytes: int | None, disk_cache: bool | str | os.PathLike,
                 lock: threading.RLock, stats: collections.Counter, dora: bool = False):
        self.model_cfg = model_cfg
        self.max_lora_rank = max_lora_rank
        self.max_cpu_loras = max_cpu_loras
        self.dtype = dtype
        self.modules = tuple(modules)
        self.dora = dora  # the slots hold DoRA factors; without it a DoRA adapter is refused by `convert`
        self._storage_dtype = quant.storage_dtype(dtype)
        self._lock = lock
        self.stats = stats
        self._host: collections.OrderedDict[_Version, AdapterHandle] = collections.OrderedDict()
        self._host_bytes = 0
        self.max_cpu_lora_bytes: int | None = None
        self.disk_cache_dir: Path | None = None
        self.set_max_cpu_lora_bytes(max_cpu_lora_bytes)
        self.set_disk_cache(disk_cache)

    # ---- cache settings -------------------------------------------------------------------------------

    def set_max_cpu_lora_bytes(self, max_cpu_lora_bytes: int | None) -> None:
        """Bound the host cache's bytes (None: no bound); evicts least recently used adapters at once."""
        v = max_cpu_lora_bytes
        if v is not None and (isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 0):
            raise ValueError(f"AdapterManager: max_cpu_lora_bytes must be None or an int >= 0, got {v!r}")
        with self._lock:
            self.max_cpu_lora_bytes = None if v is None else int(v)
            self.evict()

    def set_disk_cache(self, disk_cache: bool | str | os.PathLike | None) -> None:
        """False/None: no disk cache; True: the default directory; a path: there. JLORA_ADAPTER_CACHE=0
        turns it off whatever is asked."""
        if disk_cache is not None and not isinstance(disk_cache, (bool, str, os.PathLike)):
            raise ValueError(f"AdapterManager: disk_cache must be a bool or a directory, got {disk_cache!r}")
        with self._lock:
            if not disk_cache or not dc.cache_enabled():
                self.disk_cache_dir = None
            elif disk_cache is True:
                self.disk_cache_dir = dc.default_cache_dir()
            else:
                self.disk_cache_dir = Path(disk_cache)

    def host_bytes(self) -> int:
        """Bytes of the host cache: converted adapters and their padded copies (what
        `max_cpu_lora_bytes` bounds)."""
        with self._lock:
            return self._host_bytes

    # ---- the LRU (callers hold the lock) ----------------------------------------------------------------

    def get(self, version: _Version, touch: bool = True) -> AdapterHandle | None:
        """The host copy of `version`, if kept. `touch`: count a host-cache hit and mark it recently used."""
        handle = self._host.get(version)
        if handle is not None and touch:
            self._host.move_to_end(version)
            self.stats["host_hits"] += 1
        return handle

    def versions(self) -> list[_Version]:
        """The versions kept, least recently used first."""
        return list(self._host)

    def drop_others(self, version: _Version) -> None:
        """Drop the host copies of `version`'s name other than `version` itself."""
        for v in [v for v in self._host if v[0] == version[0] and v != version]:
            self.drop(v)

    def clear(self) -> None:
        self._host.clear()
        self._host_bytes = 0

    def convert(self, version: _Version, req: LoRARequest) -> AdapterHandle:
        """Read (disk cache) or convert `req`'s adapter, check it fits and pad it to the slot shape;
        needs no lock, and runs on the thread that prepares (the worker, for `prepare_async`)."""
        adapter = self.read_source(version, req)
        update = padded_update(adapter, self.model_cfg, self.max_lora_rank, self.modules, self.dtype,
                               dora=self.dora)  # checks fit
        update = {m: {k: _as_dtype(x, np.float32 if k == "M" else self._storage_dtype) for k, x in u.items()}
                  for m, u in update.items()}
        self._count("disk_loads")
        return AdapterHandle(version, adapter, update)

    def store(self, version: _Version, handle: AdapterHandle) -> None:
        """Put a converted adapter into the host cache (under the lock); older versions of its name leave."""
        if self.max_cpu_loras > 0 and version not in self._host:
            self.drop_others(version)
            self._host[version] = handle
            self._host_bytes += handle.nbytes
            self.evict()

    def drop(self, version: _Version) -> None:
        self._host_bytes -= self._host.pop(version).nbytes

    def evict(self) -> None:
        """Drop least recently used host copies until both bounds hold (an adapter larger than the byte
        bound on its own is served but not kept)."""
        cap = self.max_cpu_lora_bytes
        while self._host and (len(self._host) > self.max_cpu_loras or (cap is not None and self._host_bytes > cap)):
            self.drop(next(iter(self._host)))
            self.stats["host_evictions"] += 1

    def _disk_key(self, req: LoRARequest) -> str | None:
        """The disk cache key of `req`'s adapter, or None where the disk cache does not apply."""
        if self.disk_cache_dir is None or not req.disk_cache:
            return None
        if req.in_memory:
            content = f"memory:{req.content_hash}"
        else:
            path = Path(req.lora_path).expanduser().resolve()
            try:
                if not path.is_dir() or is_jlora_adapter_dir(path):  # missing, or already converted (orbax)
                    return None
                digest = dc.peft_dir_digest(path, self.disk_cache_dir)
            except OSError:  # unreadable: the converter reports it
                return None
            if digest is None:
                return None
            content = f"peft:{digest}"
        return dc.entry_key(content, self.model_cfg, self.max_lora_rank)

    def read_source(self, version: _Version, req: LoRARequest) -> LoRAAdapter:
        """The converted adapter: from the disk cache when it has it, else converted (and cached)."""
        key = self._disk_key(req)
        if key is not None:
            cache = dc.open_cache(self.disk_cache_dir)  # one per read: its stats are this read's
            adapter = cache.get(key, lambda meta, t: dc.decode(meta, t, self.model_cfg, self.max_lora_rank,
                                                               req.lora_name))
            for k in ("hits", "misses", "rebuilds"):
                if cache.stats[k]:
                    self._count(f"disk_cache_{k}")
            if adapter is not None:
                return adapter
        if req.in_memory:
            adapter = convert_peft_state_dict(req.tensors, req.config, self.model_cfg, self.max_lora_rank,
                                              name=req.lora_name, source=f"memory:{req.content_hash[:16]}")
        else:
            adapter = read_adapter(version[2], self.model_cfg, self.max_lora_rank, name=req.lora_name)
        self._count("conversions")
        if key is not None and (req.in_memory or self._disk_key(req) == key):  # files unchanged while read
            dc.write_entry(self.disk_cache_dir, key, adapter)  # logged and skipped when it cannot be written
        return adapter

    def _count(self, key: str) -> None:
        with self._lock:
            self.stats[key] += 1
