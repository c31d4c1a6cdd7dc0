"""Device adapter slots: the slot layout, the one jitted `set_slot`, and `LoRASlots`, which owns the slot arrays.

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

Device state has one owner. `LoRASlots` holds the slot arrays (`lora_state`, in pools of equal
rank) and is the only thing that writes them, applying queued `SlotWrite`s; the engine's
ModelRunner holds it, beside the weights and the KV cache. Which adapter goes into which slot is
decided on the host (jlora.adapters.manager), which queues the writes.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jlora import compile_stats
from jlora.adapters.dora import dora_factor
from jlora.adapters.peft import LoRAAdapter
from jlora.models import quant
from jlora.models.config import LORA_MODULES, PACKED_MODULES, VOCAB_MODULES, LlamaConfig
from jlora.models.llama import LoRAState, host_zeros, init_lora_state, lora_state_modules
from jlora.models.tensor_parallel import TensorParallel, lora_spec


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
