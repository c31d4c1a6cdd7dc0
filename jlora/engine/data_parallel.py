"""Data parallelism: d engine replicas (each its own devices, KV cache and adapter slots) behind
one front end with the LLMEngine interface, so `LLM` and the server use it unchanged.

A request goes to the replica that already holds its adapter in a slot (no slot write, no
eviction elsewhere) unless that replica is a full batch busier than the least loaded one; else to
the least loaded replica. An adapter is converted once: the first replica's manager prepares it
and the others adopt the same handle (`ReplicatedAdapters`). Each step runs every busy replica's
step at once (threads: their device work and transfers overlap; the Python parts take turns).
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import itertools
from typing import Any, Sequence

from jlora.adapters.manager import AdapterHandle, AdapterManager
from jlora.adapters.request import LoRARequest
from jlora.engine.llm_engine import EngineStats, LLMEngine
from jlora.outputs import RequestOutput


class ReplicatedAdapters:
    """The replicas' adapter managers as one: prepare converts once (the first manager) and every
    other manager adopts the handle; unload reaches all of them."""

    def __init__(self, managers: Sequence[AdapterManager]):
        self.managers = list(managers)

    def __getattr__(self, name: str) -> Any:  # sizes and settings every replica shares (model_cfg, max_loras, ...)
        return getattr(self.managers[0], name)

    def prepare(self, req: LoRARequest) -> AdapterHandle:
        handle = self.managers[0].prepare(req)
        for m in self.managers[1:]:
            m.adopt(handle)
        return handle

    def prepare_async(self, req: LoRARequest) -> concurrent.futures.Future:
        first = self.managers[0].prepare_async(req)  # a missing path raises here
        out: concurrent.futures.Future = concurrent.futures.Future()

        def adopt(f: concurrent.futures.Future) -> None:
            try:
                handle = f.result()
                for m in self.managers[1:]:
                    m.adopt(handle)
            except BaseException as e:
                out.set_exception(e)
            else:
                out.set_result(handle)

        first.add_done_callback(adopt)
        return out

    def unload(self, name: str) -> bool:
        return any([m.unload(name) for m in self.managers])

    def set_disk_cache(self, disk_cache: Any) -> None:
        for m in self.managers:
            m.set_disk_cache(disk_cache)

    def set_max_cpu_lora_bytes(self, max_cpu_lora_bytes: int | None) -> None:
        for m in self.managers:
            m.set_max_cpu_lora_bytes(max_cpu_lora_bytes)

    @property
    def stats(self) -> collections.Counter:
        """Every replica's counters added up (slot hits, writes, evictions, ...)."""
        return sum((m.stats for m in self.managers), collections.Counter())

    def resident(self) -> dict[tuple[int, int], str]:
        """(replica, slot) -> adapter name."""
        return {(r, slot): name for r, m in enumerate(self.managers) for slot, name in m.resident().items()}


class DataParallelEngine:
    """d LLMEngines, one per device group, as one engine (`LLMEngine`'s interface)."""

    def __init__(self, replicas: Sequence[LLMEngine]):
        if len(replicas) < 2:
            raise ValueError(f"DataParallelEngine needs at least 2 replicas, got {len(replicas)}")
        self.replicas = list(replicas)
        self.adapters = ReplicatedAdapters([r.adapters for r in self.replicas])
        first = self.replicas[0]
        self.config, self.tokenizer, self.eos_token_id = first.config, first.tokenizer, first.eos_token_id
        self._owner: dict[str, LLMEngine] = {}  # request id -> its replica
        self._ids = itertools.count()
        self._pool = concurrent.futures.ThreadPoolExecutor(len(self.replicas), thread_name_prefix="jlora-dp")

    @property
    def runner(self):  # the first replica's (its config and shapes are every replica's)
        return self.replicas[0].runner

    @property
    def runners(self) -> list:
        return [r.runner for r in self.replicas]

    @property
    def running(self) -> list:
        return [s for r in self.replicas for s in r.running]

    @property
    def waiting(self) -> list:
        return [s for r in self.replicas for s in r.waiting]

    @property
    def num_preemptions(self) -> int:
        return sum(r.num_preemptions for r in self.replicas)

    def replica_of(self, request_id: str) -> int | None:
        """Which replica serves `request_id` (None: unknown)."""
        eng = self._owner.get(request_id)
        return None if eng is None else self.replicas.index(eng)

    def _load(self, eng: LLMEngine) -> int:
        return len(eng.running) + len(eng.waiting)

    def _route(self, handle: AdapterHandle | None) -> LLMEngine:
        least = min(self.replicas, key=self._load)
        if handle is not None:
            holders = [r for r in self.replicas if r.adapters.slot_of(handle.name) is not None]
            if holders:
                best = min(holders, key=self._load)
                if self._load(best) - self._load(least) < self.config.max_num_seqs:
                    return best
        return least

    def add_request(self, prompt: Any, params: Any = None, lora_request: LoRARequest | None = None,
                    request_id: str | None = None, lora_handle: AdapterHandle | None = None) -> str:
        """`LLMEngine.add_request` on the replica `_route` picks; request ids are unique across replicas."""
        if lora_request is not None and lora_handle is None:
            lora_handle = self.adapters.prepare(lora_request)  # once, for every replica
        request_id = str(next(self._ids)) if request_id is None else str(request_id)
        if request_id in self._owner:
            raise ValueError(f"request_id {request_id!r} is already in use")
        eng = self._route(lora_handle)
        eng.add_request(prompt, params, lora_request, request_id=request_id, lora_handle=lora_handle)
        self._owner[request_id] = eng
        return request_id

    def step(self) -> list[RequestOutput]:
        busy = [r for r in self.replicas if r.has_unfinished()]
        if len(busy) == 1:
            return busy[0].step()
        return [o for outs in self._pool.map(lambda r: r.step(), busy) for o in outs]

    def has_unfinished(self) -> bool:
        return any(r.has_unfinished() for r in self.replicas)

    def abort(self, request_id: str) -> RequestOutput | None:
        eng = self._owner.get(request_id)
        return None if eng is None else eng.abort(request_id)

    def get_output(self, request_id: str) -> RequestOutput | None:
        eng = self._owner.get(request_id)
        return None if eng is None else eng.get_output(request_id)

    def pop_finished(self, request_id: str) -> RequestOutput:
        out = self._owner[request_id].pop_finished(request_id)
        del self._owner[request_id]
        return out

    def stream_deltas(self, request_id: str) -> list[str]:
        return self._owner[request_id].stream_deltas(request_id)

    def stats(self) -> EngineStats:
        """Every replica's stats added up (`lora_resident` counts slots over all replicas)."""
        parts = [r.stats() for r in self.replicas]
        summed = {f.name: sum(getattr(p, f.name) for p in parts)
                  for f in dataclasses.fields(EngineStats) if f.name != "lora"}
        return EngineStats(**summed, lora=dict(sum((collections.Counter(p.lora) for p in parts), collections.Counter())))
