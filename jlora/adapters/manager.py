"""Device adapter slots: one jitted `set_slot`, and the AdapterManager that decides what goes where.

All slots live in one fixed-shape pytree (docs/engine.md, "The rooms of a step"), one entry per packed module
(`qkv_proj`, `o_proj`, `gate_up_proj`, `down_proj`; S sub-modules each):

    lora_state[packed module] = {"A": [L, N, in, S*R], "B": [L, N, R, out], "M": f32[L, N, out]}

("M", only in an engine with `enable_dora`: each slot's DoRA factor minus one per output column,
computed by `set_slot` from a DoRA adapter's magnitudes and the base weights, zeros otherwise;
jlora.adapters.dora. Without it the state has no "M" and DoRA adapters are refused.)

`padded_update` lays an adapter's per-module (PEFT) weights out that way: sub-module s's A in
lanes [s*R, s*R + r), its B in rows [0, r) of its own output columns, zeros elsewhere.

`set_slot` writes one adapter into one slot. The slot is a traced int32 scalar and the update is
already zero-padded to R on the host, so one compiled graph serves every slot, adapter and rank;
the old state is donated, so there is never a second copy of it in memory.

Device state has one owner. `LoRASlots` holds the slot arrays (`lora_state`) and is the only
thing that writes them; the engine's ModelRunner holds it, beside the weights and the KV cache.
AdapterManager is host-side bookkeeping: which adapter version is in which slot, pins, LRU, the
host cache. `acquire(handle)` assigns a slot and queues a `SlotWrite` (slot index + the update,
already padded); the scheduler hands the queue to the step plan (`take_writes`) and the runner
applies it right before the step that reads those slots. The padding (`padded_update`, 78 MB of
zeros per adapter at rank 64 on SmolLM2) happens where the adapter is converted (`prepare`, on
the `prepare_async` worker for the server) and is kept in the handle, which is also the host
cache's entry: a slot miss on the step thread copies nothing on the host. Measured (SmolLM2, rank
64, 2 busy cores): padding 76 ms, the slot write 59 ms, so a miss costs the step ~59 ms, not ~135.

AdapterManager keeps a host LRU cache of converted adapters, bounded in count (`max_cpu_loras`)
and optionally in bytes (`max_cpu_lora_bytes`, counting each entry's padded copy too). Below the
host cache sits an optional disk cache of converted adapters keyed by content (`disk_cache`, see
`jlora.adapters.disk_cache`), so a restart or a second engine reads instead of converting.
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

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jlora import compile_stats
from jlora.adapters import disk_cache as dc
from jlora.adapters.dora import dora_factor
from jlora.adapters.peft import (
    ADAPTER_CONFIG, BIN_FILE, JLORA_ADAPTER_META, SAFETENSORS_FILE, LoRAAdapter, convert_peft_state_dict,
    is_jlora_adapter_dir, read_adapter,
)
from jlora.adapters.request import LoRARequest
from jlora.engine.config import default_max_cpu_loras
from jlora.models import quant
from jlora.models.config import LORA_MODULES, PACKED_MODULES, VOCAB_MODULES, LlamaConfig
from jlora.models.llama import LoRAState, host_zeros, init_lora_state, lora_state_modules
from jlora.models.tensor_parallel import TensorParallel, lora_spec

logger = logging.getLogger(__name__)


class NoFreeSlotError(RuntimeError):
    """Every device slot is pinned by a running request; retry after one is released."""


# ---- the one jitted write -----------------------------------------------------------------------------


def _set_slot_impl(lora_state: LoRAState, slot: jax.Array, update: dict[str, dict[str, jax.Array]],
                   base: dict[str, Any] | None = None, splits: tuple = ()) -> LoRAState:
    """`base`: packed module -> the base weight [L, in, out] (DoRA's norm reads it); `splits`:
    ((packed module, its sub-modules' widths or None), ...), static."""
    widths = dict(splits)
    out = {}
    for m, s in lora_state.items():
        out[m] = {}
        for k in ("A", "B"):
            u = update[m][k]  # [L, in, S*R] / [L, R, out]
            out[m][k] = lax.dynamic_update_slice(s[k], u[:, None].astype(s[k].dtype), (0, slot, 0, 0))
        if "M" in s:  # DoRA: the factor - 1 per output column ([L, N, out]), from the magnitudes
            mag = update[m]["M"]
            f = (jnp.zeros(mag.shape, jnp.float32) if base is None
                 else dora_factor(base[m], update[m]["A"], update[m]["B"], mag, widths.get(m)))
            out[m]["M"] = lax.dynamic_update_slice(s["M"], f[:, None].astype(s["M"].dtype), (0, slot, 0))
    return out


_set_slot_jit = jax.jit(_set_slot_impl, donate_argnums=(0,), static_argnames=("splits",))


def set_slot(
    lora_state: LoRAState,  # packed module -> {"A": [L, N, in, S*R], "B": [L, N, R, out], "M": f32[L, N, out]}; donated
    slot: int | jax.Array,  # i32 scalar in [0, N)
    update: dict[str, dict[str, Any]],  # packed module -> {"A": [L, in, S*R], "B": [L, R, out], "M": [L, out]}
    model: Any = None,  # the Llama whose weights DoRA's norm reads (needed for a DoRA update only)
) -> LoRAState:
    """Write `update` into slot `slot` of `lora_state`; returns the new state (the old one is deleted).

    One compiled graph for every slot and adapter: the slot is traced and shapes never change.
    Every module of `lora_state` must be in `update` (zeros for modules an adapter lacks), so a
    write also clears what the slot held before. Host arrays are cast to the state's dtype first.
    A DoRA update (`padded_update` of a DoRA adapter: magnitudes in "M") needs `model`, whose
    base weights the slot's DoRA factor is computed from (jlora.adapters.dora).
    """
    slot, upd = _checked_write(lora_state, slot, update)
    if model is None:
        if any(np.any(~np.isnan(np.asarray(u["M"]))) for u in upd.values() if "M" in u):
            raise ValueError("set_slot: this update carries DoRA magnitudes; pass model= (the base model whose "
                             "weights the DoRA norm is taken of)")
        return _set_slot_jit(lora_state, slot, upd)
    return _set_slot_jit(lora_state, slot, upd, base_weights(model, lora_state),
                         splits=packed_splits(model.cfg, getattr(model, "layout_shards", 1)))


def base_weights(model: Any, lora_state: LoRAState) -> dict[str, Any]:
    """The base weights of the packed modules `lora_state` holds, as the model keeps them."""
    weights = model.layers.weights()
    return {m: weights[m] for m in lora_state if m not in VOCAB_MODULES}


def packed_splits(model_cfg: LlamaConfig, shards: int = 1) -> tuple:
    """((packed module, its sub-modules' output widths per shard, or None for one module), ...)."""
    return tuple((m, tuple(w // shards for w in outs) if len(outs) > 1 else None)
                 for m, (_, outs) in model_cfg.packed_shapes().items())


def _checked_write(lora_state: LoRAState, slot: Any, update: dict) -> tuple[Any, dict]:
    """`set_slot`'s argument checks; the slot as an int32 scalar and the update in the state's dtype."""
    if set(update) != set(lora_state):
        raise ValueError(f"set_slot: update has modules {sorted(update)}, lora_state has {sorted(lora_state)}")
    n = next(iter(lora_state.values()))["A"].shape[1]
    if isinstance(slot, (int, np.integer)):
        if isinstance(slot, bool) or not 0 <= int(slot) < n:
            raise ValueError(f"set_slot: slot={slot!r} must be in [0, {n})")
        slot = np.int32(slot)
    elif not (hasattr(slot, "shape") and slot.shape == () and jnp.issubdtype(slot.dtype, jnp.integer)):
        raise ValueError(f"set_slot: slot must be an int scalar, got {slot!r}")
    elif slot.dtype != jnp.int32:
        slot = slot.astype(jnp.int32)
    upd = {}
    for m, s in lora_state.items():
        u = dict(update[m])
        if set(u) - {"M"} != {"A", "B"}:
            raise ValueError(f"set_slot: update[{m!r}] must have keys 'A', 'B' (and 'M', DoRA magnitudes), "
                             f"got {sorted(u)}")
        want_a = s["A"].shape[:1] + s["A"].shape[2:]
        want_b = s["B"].shape[:1] + s["B"].shape[2:]
        if tuple(u["A"].shape) != want_a:
            raise ValueError(f"set_slot: update[{m!r}]['A'] has shape {tuple(u['A'].shape)}, expected {want_a} "
                             f"[L, in, S*R] (padded_update lays an adapter out)")
        if tuple(u["B"].shape) != want_b:
            raise ValueError(f"set_slot: update[{m!r}]['B'] has shape {tuple(u['B'].shape)}, expected {want_b} "
                             f"[L, R, out] (padded_update lays an adapter out)")
        upd[m] = {k: _as_dtype(u[k], s[k].dtype) for k in ("A", "B")}
        want_m = s["A"].shape[:1] + s["B"].shape[-1:]  # [L, out]
        if "M" in u and tuple(u["M"].shape) != want_m:
            raise ValueError(f"set_slot: update[{m!r}]['M'] has shape {tuple(u['M'].shape)}, expected {want_m} "
                             f"[L, out] (DoRA magnitudes, NaN where none)")
        if "M" in s:  # an update without magnitudes (a plain adapter) leaves no DoRA factor
            upd[m]["M"] = _as_dtype(u["M"], jnp.float32) if "M" in u else np.full(want_m, np.nan, np.float32)
        elif "M" in u and np.any(~np.isnan(np.asarray(u["M"]))):
            raise ValueError(f"set_slot: update[{m!r}] carries DoRA magnitudes but lora_state[{m!r}] has no 'M' "
                             f"(DoRA factor) array; make the state with init_lora_state(..., dora=True)")
    return slot, upd


def _as_dtype(x: Any, dtype: Any) -> Any:
    if dtype == jnp.uint16:  # a bf16 state kept as its bits (jlora.models.quant.storage_dtype)
        if isinstance(x, jax.Array):
            return x if x.dtype == dtype else lax.bitcast_convert_type(x.astype(jnp.bfloat16), jnp.uint16)
        x = np.asarray(x)
        return x if x.dtype == np.uint16 else np.asarray(x, dtype=jnp.bfloat16).view(np.uint16)  # bits already, or bf16
    if isinstance(x, jax.Array):
        return x if x.dtype == dtype else x.astype(dtype)
    return np.asarray(x, dtype=dtype)


def padded_update(
    adapter: LoRAAdapter | None,
    model_cfg: LlamaConfig,
    max_rank: int,
    modules: tuple[str, ...] = LORA_MODULES,
    dtype: Any = np.float32,
    dora: bool = False,
) -> dict[str, dict[str, np.ndarray]]:
    """Host arrays for `set_slot`: the packed layout of the LoRA state holding PEFT `modules`.

    Per packed module {"A": [L, in, S*R], "B": [L, R, out]} with R = `max_rank`, and with `dora`
    (a state made with `init_lora_state(..., dora=True)`) "M": f32[L, out]: sub-module s (q, k, v
    of `qkv_proj`; gate, up of `gate_up_proj`) has its A in lanes [s*R, s*R + r) and its B in rows
    [0, r) of its own output columns; what the adapter does not target stays zero. "M" holds a DoRA
    adapter's magnitudes in the same columns, NaN elsewhere (and everywhere for a plain adapter);
    without `dora` a DoRA adapter is refused (ValueError naming enable_dora). embed_tokens /
    lm_head (in `modules`: an engine with enable_embedding_lora) are {"A": [1, in, R], "B": [1, R,
    out]}, the adapter's in lanes [0, r). `adapter=None` gives all zeros (an empty slot).
    """
    shapes = model_cfg.packed_shapes()
    L = model_cfg.num_hidden_layers
    dtype = np.dtype(dtype)
    if adapter is not None:
        adapter.validate(model_cfg, max_rank, holds=tuple(modules), dora=dora)
    out = {}
    for f in lora_state_modules(modules):
        if f in VOCAB_MODULES:
            d_in, d_out = model_cfg.vocab_shapes()[f]
            a, b = np.zeros((1, d_in, max_rank), dtype), np.zeros((1, max_rank, d_out), dtype)
            if adapter is not None and f in adapter.weights:
                wa, wb = adapter.weights[f]
                a[:, :, :wa.shape[-1]], b[:, :wb.shape[1]] = wa, wb
            out[f] = {"A": a, "B": b}
            continue
        d_in, outs = shapes[f]
        a = np.zeros((L, d_in, len(outs) * max_rank), dtype)
        b = np.zeros((L, max_rank, sum(outs)), dtype)
        mag = np.full((L, sum(outs)), np.nan, np.float32)  # DoRA magnitudes; NaN: no DoRA in that column
        col = 0
        for s, (m, width) in enumerate(zip(PACKED_MODULES[f], outs)):
            if adapter is not None and m in adapter.weights:
                wa, wb = adapter.weights[m]  # [L, in, r], [L, r, out_m]
                r = wa.shape[-1]
                a[:, :, s * max_rank: s * max_rank + r] = wa
                b[:, :r, col: col + width] = wb
                if m in adapter.magnitudes:
                    mag[:, col: col + width] = adapter.magnitudes[m]
            col += width
        out[f] = {"A": a, "B": b, **({"M": mag} if dora else {})}
    return out


def slot_module(
    lora_state: LoRAState, model_cfg: LlamaConfig, slot: int, module: str,
) -> tuple[np.ndarray, np.ndarray]:  # A [L, in, R], B [L, R, out]
    """One PEFT module's A and B in one slot, read back out of the packed layout (for tests and
    inspection; the inverse of `padded_update` for that module)."""
    fused = next(f for f, subs in PACKED_MODULES.items() if module in subs)
    s = PACKED_MODULES[fused].index(module)
    outs = model_cfg.packed_shapes()[fused][1]
    a, b = np.asarray(lora_state[fused]["A"][:, slot]), np.asarray(lora_state[fused]["B"][:, slot])
    r = b.shape[1]
    col = sum(outs[:s])
    return a[:, :, s * r:(s + 1) * r], b[:, :, col:col + outs[s]]


SlotUpdate = dict  # packed module -> {"A": [L, in, S*R], "B": [L, R, out]}, host arrays in the slots' storage
#                    dtype, and "M": f32[L, out] DoRA magnitudes (NaN: none)


@dataclasses.dataclass(frozen=True, eq=False)
class SlotWrite:
    """One queued write: `update` (already padded, `padded_update`) goes into slot `slot`."""

    slot: int
    update: SlotUpdate


class LoRASlots:
    """The device side of N adapter slots: `state`, the one `lora_state` pytree the step reads, and
    the one way it changes, `write(writes)`: queued `SlotWrite`s, each through the one compiled,
    donated `set_slot` graph of its pool. The engine's ModelRunner holds one, beside the weights and
    KV cache.

    Slots of several ranks (`slot_ranks`, ascending) form pools of equal rank, each its own
    `{module: {"A", "B"}}` state: then `state` is a tuple of them (slots numbered across the pools
    in order) and a write narrows its update (padded to max_lora_rank) to its pool's rank."""

    def __init__(self, model_cfg: LlamaConfig, max_loras: int, max_lora_rank: int, dtype: Any = jnp.float32,
                 modules: tuple[str, ...] = LORA_MODULES, tp: TensorParallel | None = None,
                 slot_ranks: Sequence[int] | None = None, base: dict[str, Any] | None = None,
                 dora: bool = False):
        # `dora`: the slots hold DoRA factors ("M", `init_lora_state`); `base`: packed module -> the
        # base weight as the step reads it ([L, in, out], or a QArray), for DoRA's norm
        # (jlora.adapters.dora); without it a DoRA write is refused. Without `dora` it is not kept.
        # Under tensor parallelism (`tp`) each slot array is sharded like its base layer and every
        # shard is written in place on its own device (jlora.models.tensor_parallel).
        self.tp = tp
        ranks = tuple(sorted(slot_ranks)) if slot_ranks is not None else (max_lora_rank,) * max_loras
        if len(ranks) != max_loras or ranks[-1] > max_lora_rank:
            raise ValueError(f"LoRASlots: slot_ranks={ranks} must have max_loras={max_loras} entries "
                             f"of at most max_lora_rank={max_lora_rank}")
        self.pools: list[tuple[int, int, int]] = []  # (first slot, slots, rank)
        for i, r in enumerate(ranks):
            if self.pools and self.pools[-1][2] == r:
                first, n, _ = self.pools[-1]
                self.pools[-1] = (first, n + 1, r)
            else:
                self.pools.append((i, 1, r))
        self.dora = dora
        self._states = [self._zeros(model_cfg, n, r, dtype, tuple(modules)) for _, n, r in self.pools]
        self.base = (None if base is None or not dora
                     else {m: base[m] for m in self._states[0] if m not in VOCAB_MODULES})
        self.splits = packed_splits(model_cfg) if tp is None else packed_splits(tp.layout_cfg, tp.size)
        self.num_writes = 0
        self._writes: list[Any] = [None] * len(self.pools)  # each pool's compiled set_slot (warmup, or first write)

    def _zeros(self, model_cfg: LlamaConfig, n: int, rank: int, dtype: Any, modules: tuple[str, ...]) -> LoRAState:
        if self.tp is None:
            return init_lora_state(model_cfg, n, rank, quant.storage_dtype(dtype), modules, zeros=host_zeros,
                                   dora=self.dora)
        shapes = init_lora_state(self.tp.layout_cfg, n, rank, quant.storage_dtype(dtype), modules,
                                 zeros=jax.ShapeDtypeStruct, dora=self.dora)
        return {m: {k: self.tp.zeros(v.shape, v.dtype, lora_spec(m, k, self.tp.size)) for k, v in s.items()}
                for m, s in shapes.items()}

    @property
    def state(self) -> LoRAState | tuple[LoRAState, ...]:
        return self._states[0] if len(self._states) == 1 else tuple(self._states)

    def _update_sharding(self, module: str, kind: str) -> Any:
        return None if self.tp is None else self.tp.sharding(lora_spec(module, kind, self.tp.size, slot_axis=False))

    def _compiled(self, p: int):
        if self._writes[p] is None:
            state = self._states[p]
            upd = {m: {k: jax.ShapeDtypeStruct(v.shape[:1] + v.shape[2:], v.dtype, sharding=self._update_sharding(m, k))
                       for k, v in s.items()} for m, s in state.items()}
            fn = _set_slot_jit if self.tp is None else jax.jit(
                _set_slot_impl, donate_argnums=(0,), static_argnames=("splits",),
                out_shardings=jax.tree.map(lambda x: x.sharding, state))
            with compile_stats.stage("set_slot"):
                self._writes[p] = fn.lower(state, np.int32(0), upd, self.base, splits=self.splits).compile()
        return self._writes[p]

    def warmup(self) -> None:
        """Compile the slot writes now (one per pool); writes nothing."""
        for p in range(len(self.pools)):
            self._compiled(p)

    def close(self) -> None:
        """Free the slot arrays and the compiled writes (the runner's `close`)."""
        for x in jax.tree.leaves(self._states):
            x.delete()
        self._states, self._writes, self.base = [], [None] * len(self.pools), None

    def _pool_of(self, slot: Any) -> tuple[int, Any]:
        if len(self.pools) == 1:
            return 0, slot
        n = sum(count for _, count, _ in self.pools)
        if isinstance(slot, bool) or not isinstance(slot, (int, np.integer)) or not 0 <= int(slot) < n:
            raise ValueError(f"set_slot: slot={slot!r} must be an int in [0, {n})")
        p = next(p for p, (first, count, _) in enumerate(self.pools) if first <= slot < first + count)
        return p, int(slot) - self.pools[p][0]

    def write(self, writes: Sequence[SlotWrite]) -> None:
        """Apply `writes` in order (a later write to a slot wins); the old state is donated."""
        for w in writes:
            p, local = self._pool_of(w.slot)
            update = w.update if len(self.pools) == 1 else _narrow_rank(w.update, self.pools[p][2])
            state = self._states[p]
            if self.tp is not None:  # the shard-major column order, then each shard to its device
                update = {m: {k: self.tp.layout_update(m, k, np.asarray(x)) for k, x in u.items()}
                          for m, u in update.items()} if set(update) == set(state) else update
            slot, upd = _checked_write(state, local, update)
            if self.base is None and any(np.any(~np.isnan(np.asarray(u["M"]))) for u in upd.values() if "M" in u):
                raise ValueError("set_slot: a DoRA update, but these slots were made without the base weights "
                                 "(LoRASlots(base=...)) that its norm needs")
            if self.tp is not None:
                upd = {m: {k: self.tp.put(x, lora_spec(m, k, self.tp.size, slot_axis=False)) for k, x in u.items()}
                       for m, u in upd.items()}
            self._states[p] = self._compiled(p)(state, slot, upd, self.base)
            self.num_writes += 1


def _narrow_rank(update: SlotUpdate, rank: int) -> SlotUpdate:
    """A padded update ({"A": [L, in, S*R], "B": [L, R, out]}) cut to `rank` <= R lanes per
    sub-module (the lanes past the adapter's own rank are zeros, so nothing is lost)."""
    out = {}
    for m, u in update.items():
        a, b = np.asarray(u["A"]), np.asarray(u["B"])
        r = b.shape[1]
        if r == rank:
            out[m] = dict(u)
            continue
        if np.any(b[:, rank:]):
            raise ValueError(f"set_slot: the update for {m!r} uses more than the slot's {rank} lanes")
        subs = a.shape[-1] // r
        out[m] = {"A": np.ascontiguousarray(a.reshape(*a.shape[:-1], subs, r)[..., :rank].reshape(*a.shape[:-1], subs * rank)),
                  "B": np.ascontiguousarray(b[:, :rank]), **({"M": u["M"]} if "M" in u else {})}
    return out


# ---- the manager ----------------------------------------------------------------------------------------

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


def _fingerprint(path: Path) -> tuple:
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


class AdapterManager:
    """N device slots of LoRA weights plus a host LRU cache of converted adapters."""

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
        self.max_cpu_loras = max_cpu_loras
        self.dtype = dtype
        self.modules = tuple(modules)
        self.dora = bool(dora)
        self._storage_dtype = quant.storage_dtype(dtype)
        self._slots: list[_Slot | None] = [None] * max_loras
        self._writes: dict[int, SlotWrite] = {}  # slot -> its queued write (take_writes)
        self._host: collections.OrderedDict[_Version, AdapterHandle] = collections.OrderedDict()
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
            self._evict_host()

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

    def close(self) -> None:
        """Stop `prepare_async`'s worker (conversions not started are cancelled, one under way is not
        waited for) and drop the host cache. Idempotent; `prepare_async` raises after it."""
        with self._lock:
            self._closed = True
            worker, self._worker = self._worker, None
            self._host.clear()
            self._host_bytes = 0
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
                handle = self._convert(version, req)
            except BaseException as e:
                with self._lock:
                    del self._converting[version]
                pending.set_exception(e)
                raise
            with self._lock:
                del self._converting[version]
                if self._unloads.get(req.lora_name, 0) == unloads:
                    self._store(version, handle)
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
                self._store(handle.version, handle)
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
            for v in [v for v in self._host if v[0] == name]:
                self._host_drop(v)
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
            names = {v[0] for v in self._host}
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
        if req.in_memory:
            return (req.lora_name, req.lora_int_id, MEMORY, (req.content_hash,))
        path = Path(req.lora_path).expanduser().resolve()
        return (req.lora_name, req.lora_int_id, str(path), _fingerprint(path))

    def _check_int_id(self, req: LoRARequest) -> None:
        known = [v for v in self._host] + [s.version for s in self._slots if s is not None and not s.stale]
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
        handle = self._host.get(version)
        if handle is not None and touch:
            self._host.move_to_end(version)
            self.stats["host_hits"] += 1
        return handle

    def _convert(self, version: _Version, req: LoRARequest) -> AdapterHandle:
        """Read (disk cache) or convert `req`'s adapter, check it fits and pad it to the slot shape;
        needs no lock, and runs on the thread that prepares (the worker, for `prepare_async`)."""
        adapter = self._read_source(version, req)
        update = padded_update(adapter, self.model_cfg, self.max_lora_rank, self.modules, self.dtype,
                               dora=self.dora)  # checks fit
        update = {m: {k: _as_dtype(x, np.float32 if k == "M" else self._storage_dtype) for k, x in u.items()}
                  for m, u in update.items()}
        self._count("disk_loads")
        return AdapterHandle(version, adapter, update)

    def _store(self, version: _Version, handle: AdapterHandle) -> None:
        """Put a converted adapter into the host cache (under the lock); older versions of its name leave."""
        if self.max_cpu_loras > 0 and version not in self._host:
            for v in [v for v in self._host if v[0] == version[0] and v != version]:
                self._host_drop(v)
            self._host[version] = handle
            self._host_bytes += handle.nbytes
            self._evict_host()

    def _count(self, key: str) -> None:
        with self._lock:
            self.stats[key] += 1

    def _host_drop(self, version: _Version) -> None:
        self._host_bytes -= self._host.pop(version).nbytes

    def _evict_host(self) -> None:
        """Drop least recently used host copies until both bounds hold (an adapter larger than the byte
        bound on its own is served but not kept)."""
        cap = self.max_cpu_lora_bytes
        while self._host and (len(self._host) > self.max_cpu_loras or (cap is not None and self._host_bytes > cap)):
            self._host_drop(next(iter(self._host)))
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

    def _read_source(self, version: _Version, req: LoRARequest) -> LoRAAdapter:
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

    def _retire_other_versions(self, version: _Version) -> None:
        for v in [v for v in self._host if v[0] == version[0] and v != version]:
            self._host_drop(v)
        for i, s in enumerate(self._slots):
            if s is not None and s.name == version[0] and s.version != version:
                if s.pins == 0:
                    self._slots[i] = None
                else:
                    s.stale = True


