"""Data parallelism: d engine replicas (each its own devices, KV cache and adapter slots) behind
one front end with the LLMEngine interface, so `LLM` and the server use it unchanged.

A request goes, among the replicas less than a full batch busier than the least loaded one, to
the one holding the longest prefix of its prompt under its adapter version (cached, being
computed, or routed there and still queued: `jlora.engine.prefix_cache`), then to one holding
its adapter in a slot (no slot write, no eviction elsewhere), then to the least loaded. An adapter is converted once: the first replica's manager prepares it
and the others adopt the same handle (`ReplicatedAdapters`). Each step runs every busy replica's
step at once (threads: their device work and transfers overlap; the Python parts take turns).
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import itertools
from collections import OrderedDict
from typing import Any, Sequence

from jlora.closing import Closable
from jlora.adapters.manager import AdapterHandle, AdapterManager
from jlora.adapters.request import LoRACombination, LoRARequest
from jlora.engine.llm_engine import EngineStats, LLMEngine
from jlora.engine.prefix_cache import extend_hashes, root_hash
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


ROUTED_HASHES = 1 << 16  # block hashes of recently routed prompts remembered for routing (LRU)


class DataParallelEngine(Closable):
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
        # block hash -> replica its prompt went to: a burst of requests sharing a prefix follows the
        # first one before any of them is admitted (and its blocks claimed) there.
        self._routed: OrderedDict[bytes, int] = OrderedDict()

    def _release(self) -> None:
        """`close()`: close every replica (`LLMEngine.close`) and stop the stepping threads."""
        for r in self.replicas:
            r.close()
        self._pool.shutdown(wait=True)

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

    def _prefix_hashes(self, ids: list[int], handle: AdapterHandle | None) -> list[bytes]:
        if not self.config.enable_prefix_caching or any(not 0 <= t < self.runner.cfg.vocab_size for t in ids):
            return []  # bad ids: the replica's add_request says what is wrong
        out: list[bytes] = []
        bs = self.config.block_size
        extend_hashes(out, root_hash(None if handle is None else handle.version), ids, bs, (len(ids) - 1) // bs)
        return out

    def _prefix_held(self, i: int, hashes: list[bytes]) -> int:
        """Leading blocks of `hashes` replica i holds: cached or claimed there, or routed there."""
        routed = 0
        while routed < len(hashes) and self._routed.get(hashes[routed]) == i:
            routed += 1
        return max(routed, self.replicas[i].scheduler.prefix_blocks(hashes))

    def _route(self, handle: AdapterHandle | None, hashes: list[bytes] = ()) -> LLMEngine:
        least = min(self._load(r) for r in self.replicas)
        fits = [i for i, r in enumerate(self.replicas) if self._load(r) - least < self.config.max_num_seqs]

        def key(i: int) -> tuple[int, bool, int]:
            r = self.replicas[i]
            resident = handle is not None and r.adapters.slot_of(handle.name) is not None
            return (self._prefix_held(i, hashes) if hashes else 0), resident, -self._load(r)

        best = max(fits, key=key)  # ties: the first replica
        for h in hashes:
            self._routed[h] = best
            self._routed.move_to_end(h)
        while len(self._routed) > ROUTED_HASHES:
            self._routed.popitem(last=False)
        return self.replicas[best]

    def add_request(self, prompt: Any, params: Any = None, lora_request: LoRARequest | None = None,
                    request_id: str | None = None, lora_handle: AdapterHandle | None = None) -> str:
        """`LLMEngine.add_request` on the replica `_route` picks; request ids are unique across replicas."""
        self._check_open()
        if isinstance(lora_request, LoRACombination) and lora_handle is None:
            lora_handle = tuple(self.adapters.prepare(p) for p in lora_request.parts)  # once, for every replica
        elif lora_request is not None and lora_handle is None:
            lora_handle = self.adapters.prepare(lora_request)  # once, for every replica
        single = None if isinstance(lora_handle, tuple) else lora_handle  # routing looks at one adapter
        request_id = str(next(self._ids)) if request_id is None else str(request_id)
        if request_id in self._owner:
            raise ValueError(f"request_id {request_id!r} is already in use")
        hashes: list[bytes] = []
        if self.config.enable_prefix_caching:  # tokenized once here, to route by the prompt's blocks
            text, ids = self.replicas[0]._tokenize(prompt)
            prompt = {"prompt_token_ids": ids, "prompt": text}
            hashes = self._prefix_hashes(ids, single)
        eng = self._route(single, hashes)
        eng.add_request(prompt, params, lora_request, request_id=request_id, lora_handle=lora_handle)
        self._owner[request_id] = eng
        return request_id

    def step(self, finished_only: bool = False) -> list[RequestOutput]:
        self._check_open()
        busy = [r for r in self.replicas if r.has_unfinished()]
        if len(busy) == 1:
            return busy[0].step(finished_only)
        return [o for outs in self._pool.map(lambda r: r.step(finished_only), busy) for o in outs]

    def has_unfinished(self) -> bool:
        return any(r.has_unfinished() for r in self.replicas)

    def reset_prefix_cache(self) -> bool:
        return not self.has_unfinished() and all([r.reset_prefix_cache() for r in self.replicas])

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
