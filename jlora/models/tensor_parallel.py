"""Tensor parallelism (Megatron style) over a `jax.sharding.Mesh`: the layout and the sharding of
every array the runner owns. XLA's SPMD partitioner (GSPMD) splits the one jitted step along
these shardings and inserts the collectives; nothing here is a hand-written collective.

Layout. q/k/v and gate/up are one GEMM each (`qkv_proj`, `gate_up_proj`). Sharding their output
columns over k devices must give each device whole heads (and matching gate and up columns), so
under TP their columns are stored **shard-major**: shard j holds [q heads of j | k heads of j |
v heads of j] (and [gate_j | up_j]). The model splits the GEMM output per shard (`split_packed`),
so the split is local; with k = 1 the order is the logical one. When k exceeds the KV heads, each
KV head is repeated so every shard has its own (`layout_config`: the model then has max(KVH, k)
KV heads; the math is unchanged, grouped-query attention maps query head i to the same head).

Sharding (P = PartitionSpec over the mesh axis "tp"; stacked weights carry a leading layer axis):
  * column-parallel qkv_proj, gate_up_proj: output columns sharded (and their int8 scales, biases);
  * row-parallel o_proj, down_proj: input rows sharded, so their outputs are partial sums that
    XLA all-reduces once per layer;
  * embedding and lm head: over the vocabulary (over the hidden size if k does not divide it);
  * KV cache [L, NB, bs, KVH*Dh]: over the KV heads (whole heads: KVH*Dh splits at head boundaries);
  * LoRA slots follow their base layer (vLLM's layout): column-parallel A replicated, B sharded on
    its output; row-parallel A sharded on its input, B whole, so the delta joins the base partial
    sum before the one reduction;
  * norms, rotary constants and the step's inputs and outputs: replicated.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jlora.models.config import LlamaConfig

AXIS = "tp"
COLUMN_PARALLEL = ("qkv_proj", "gate_up_proj")
ROW_PARALLEL = ("o_proj", "down_proj")


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def check_tensor_parallel(cfg: LlamaConfig, tp: int) -> None:
    """ValueError naming `tensor_parallel_size` unless `tp` shards this model: it must divide the
    query heads and the intermediate size, and divide the KV heads or be a multiple of them (the
    KV heads are then repeated)."""
    if not isinstance(tp, int) or isinstance(tp, bool) or tp < 1:
        raise ValueError(f"tensor_parallel_size must be a positive int, got {tp!r}")
    h, kvh = cfg.num_attention_heads, cfg.num_key_value_heads
    if h % tp:
        ok = [d for d in _divisors(h) if (kvh % d == 0 or d % kvh == 0) and cfg.intermediate_size % d == 0]
        raise ValueError(f"tensor_parallel_size={tp} does not divide the model's {h} attention heads; "
                         f"this model can use tensor_parallel_size in {ok}")
    if kvh % tp and tp % kvh:
        raise ValueError(f"tensor_parallel_size={tp} neither divides the model's {kvh} KV heads nor is a "
                         f"multiple of them (KV heads can only be repeated a whole number of times)")
    if cfg.intermediate_size % tp:
        raise ValueError(f"tensor_parallel_size={tp} does not divide the model's intermediate_size "
                         f"{cfg.intermediate_size}")


def layout_config(cfg: LlamaConfig, tp: int) -> LlamaConfig:
    """The config of the model as laid out for `tp` shards: KV heads repeated up to `tp`."""
    check_tensor_parallel(cfg, tp)
    if tp <= cfg.num_key_value_heads:
        return cfg
    return dataclasses.replace(cfg, num_key_value_heads=tp)


def packed_columns(cfg: LlamaConfig, tp: int, module: str) -> np.ndarray | None:
    """For a column-parallel packed module: the logical output column (of `cfg`'s [q | k | v] or
    [gate | up]) that each stored column holds, shard-major over `tp` shards; None for the others."""
    if module == "qkv_proj":
        h, kvh, dh = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        kv_layout = max(kvh, tp)
        q = np.arange(h * dh).reshape(tp, -1)
        source_head = np.arange(kv_layout) * kvh // kv_layout  # the logical KV head each stored one repeats
        k = (h * dh + source_head[:, None] * dh + np.arange(dh)).reshape(tp, -1)
        return np.concatenate([q, k, k + kvh * dh], axis=1).reshape(-1)
    if module == "gate_up_proj":
        gate = np.arange(cfg.intermediate_size).reshape(tp, -1)
        return np.concatenate([gate, gate + cfg.intermediate_size], axis=1).reshape(-1)
    return None


def layout_model(model: Any, tp: "TensorParallel") -> Any:
    """A `Llama` sharing `model`'s arrays whose static layout is `tp`'s: its config (KV heads
    repeated) and `layout_shards`. The arrays themselves are laid out when the runner places them
    (`TensorParallel.layout_weight`). One device: `model` itself."""
    if tp.size == 1:
        return model
    from flax import nnx

    copy = nnx.merge(*nnx.split(model))
    copy.cfg, copy.layout_shards = tp.layout_cfg, tp.size
    return copy


def split_packed(y: jax.Array, widths: tuple[int, ...], shards: int) -> list[jax.Array]:
    """A packed GEMM's output [T, O] into its sub-modules [T, widths[s]] (logical widths), when its
    columns are stored shard-major over `shards` (for 1: a plain split)."""
    per = [w // shards for w in widths]
    parts = y.reshape(y.shape[0], shards, sum(per))
    bounds = np.cumsum(per)[:-1].tolist()
    return [p.reshape(y.shape[0], -1) for p in jax.numpy.split(parts, bounds, axis=-1)]


# ---- PartitionSpecs --------------------------------------------------------------------------------


def weight_spec(name: str, shape: tuple[int, ...], int8: bool, tp: int) -> P:
    """The sharding of the model parameter `name` (its last path element) of `shape`. int8
    projections keep the [L, out, in] layout (`jlora.models.quant`), float ones [L, in, out]."""
    if tp == 1:
        return P()
    base = name.removesuffix("_scale")
    is_scale = name.endswith("_scale")
    if base in COLUMN_PARALLEL or name == "qkv_bias":
        if is_scale or name == "qkv_bias":  # [L, out]
            return P(None, AXIS)
        return P(None, AXIS, None) if int8 else P(None, None, AXIS)
    if base in ROW_PARALLEL:
        if is_scale:  # per output channel: the output is not sharded
            return P()
        return P(None, None, AXIS) if int8 else P(None, AXIS, None)
    if base == "embed_tokens" or base == "lm_head":
        vocab_axis = 1 if (base == "lm_head" and not int8) else 0  # float lm_head is [D, V]
        if is_scale:
            return P(AXIS) if shape[0] % tp == 0 else P()
        spec = [None, None]
        if shape[vocab_axis] % tp == 0:
            spec[vocab_axis] = AXIS
        elif shape[1 - vocab_axis] % tp == 0:
            spec[1 - vocab_axis] = AXIS
        return P(*spec)
    return P()


def lora_spec(module: str, kind: str, tp: int, slot_axis: bool = True) -> P:
    """A LoRA slot array's sharding: {"A": [L, N, in, S*R], "B": [L, N, R, out], "M": [L, N, out]}
    (without the N axis for a one-slot update: `slot_axis=False`)."""
    if tp == 1:
        return P()
    lead = (None, None) if slot_axis else (None,)
    if module in COLUMN_PARALLEL and kind == "B":
        return P(*lead, None, AXIS)
    if module in COLUMN_PARALLEL and kind == "M":  # DoRA factors: one per output column, like B's
        return P(*lead, AXIS)
    if module in ROW_PARALLEL and kind == "A":
        return P(*lead, AXIS, None)
    return P()


CACHE_SPEC = P(None, None, None, AXIS)  # [L, NB, bs, KVH*Dh]: over the KV heads
CACHE_SCALE_SPEC = P(None, None, AXIS, None)  # an int8 cache's scales [L, NB, KVH, bs]: over the KV heads


# ---- the mesh ----------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class TensorParallel:
    """One engine's devices as a 1-D mesh over "tp" and how its arrays are laid out on it."""

    mesh: Mesh
    cfg: LlamaConfig  # the logical config
    layout_cfg: LlamaConfig  # KV heads repeated for the mesh (`layout_config`)

    @classmethod
    def create(cls, cfg: LlamaConfig, devices: Sequence[Any]) -> "TensorParallel":
        tp = len(devices)
        return cls(Mesh(np.asarray(list(devices), dtype=object), (AXIS,)), cfg, layout_config(cfg, tp))

    @property
    def size(self) -> int:
        return self.mesh.devices.size

    def sharding(self, spec: P) -> NamedSharding:
        return NamedSharding(self.mesh, spec)

    @property
    def replicated(self) -> NamedSharding:
        return NamedSharding(self.mesh, P())

    def put(self, x: Any, spec: P = P()) -> jax.Array:
        """A host (or device) array placed on the mesh as `spec`; each device receives only its shard.
        Under jax.distributed every process passes the same value."""
        sharding = self.sharding(spec)
        if jax.process_count() == 1:
            return jax.device_put(x, sharding)
        # Multi-process device_put checks that every process passed the same value, with a
        # collective compiled per shape; each process builds its shards from its own copy instead.
        def one(a: Any) -> jax.Array:
            host = np.asarray(a)
            return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])

        return jax.tree.map(one, x)

    def zeros(self, shape: tuple[int, ...], dtype: Any, spec: P = P()) -> jax.Array:
        """Zeros sharded as `spec`, made shard by shard on the host (no graph to compile, and no
        device ever holds more than its shard)."""
        def shard(index: tuple[slice, ...]) -> np.ndarray:
            return np.zeros([len(range(*i.indices(n))) for i, n in zip(index, shape)], dtype)

        return jax.make_array_from_callback(tuple(shape), self.sharding(spec), shard)

    def layout_weight(self, name: str, x: np.ndarray) -> np.ndarray:
        """A model parameter in the shard-major column order (the identity for one device)."""
        base = name.removesuffix("_scale")
        module = "qkv_proj" if name == "qkv_bias" else base
        cols = packed_columns(self.cfg, self.size, module) if self.size > 1 else None
        if cols is None:
            return x
        int8 = x.dtype == np.int8
        axis = 1 if (int8 and not name.endswith("_scale")) else x.ndim - 1  # int8 [L, out, in]; float [L, in, out]
        return np.take(x, cols, axis=axis)

    def layout_update(self, module: str, kind: str, x: np.ndarray) -> np.ndarray:
        """One slot's LoRA update ({"A": [L, in, S*R], "B": [L, R, out]}) in the stored column order."""
        cols = packed_columns(self.cfg, self.size, module) if self.size > 1 and kind in ("B", "M") else None
        return x if cols is None else np.take(x, cols, axis=-1)


def fetch(tree: Any) -> Any:
    """Device arrays to NumPy. Under jax.distributed a replicated output is not fully addressable:
    each process reads its own copy (outputs must then be replicated)."""
    leaves = jax.tree.leaves(tree)
    if all(not isinstance(x, jax.Array) or x.is_fully_addressable for x in leaves):
        return jax.device_get(tree)  # one transfer
    return jax.tree.map(lambda x: np.asarray(x.addressable_data(0)) if isinstance(x, jax.Array) else x, tree)
