"""A Llama-family decoder in Flax NNX with multi-slot LoRA on every linear layer.

Every per-layer weight is stacked on a leading layer axis ([L, ...]) and the decoder runs as one
`lax.scan` over the layers: a step traces and compiles one layer, not L (compile time and the
traced program do not grow with depth). q/k/v are one GEMM (`qkv_proj` [L, D, (H+2KVH)*Dh],
columns q | k | v) and gate/up another (`gate_up_proj` [L, D, 2F], columns gate | up); vLLM calls
these packed modules (`PACKED_MODULES`). Adapter weights arrive per call as `lora_state` (data,
not code: one fixed-shape pytree of N slots, so no adapter ever recompiles; docs/engine.md): per packed module `{"A": [L, N, in, S*R], "B": [L, N, R, out]}` for its S
sub-modules, each sub-module's A side by side (one shrink matmul) and each sub-module's B in its
own output columns; a sub-module an adapter does not target is zeros. The PEFT scale is folded
into B. Each token reads its own slot via `slot_ids`; -1 reads none.

The KV cache is paged: `k, v: [L, num_blocks, block_size, KVH*Dh]` (jlora.kernels.attention). Tokens arrive packed
([T]); attention sees them as groups (`AttnGroup`): B sequences with Q query tokens each, their
positions and block tables. The engine's step is two groups, the running sequences' decode
tokens ([R, 1]) and one prefill chunk ([1, Q]); a direct model call is one group [B, T].
Attention (`jlora.kernels.attention.paged_attention`, or on a TPU the Pallas kernel
`jlora.kernels.paged_attention_tpu`: `attn_impl`) walks the keys in chunks of `attn_chunk`
positions up to the furthest query position (a loop with a data-dependent trip count, online
softmax), so no graph is keyed by span.
"""

from __future__ import annotations

import dataclasses
import math
from functools import partial
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jlora.kernels import MIX_SLOT, lora_delta
from jlora.kernels.attention import causal_attention, paged_attention
from jlora.kernels.kv_quant import SCALE_DTYPE, quantize_kv
from jlora.kernels.paged_attention_tpu import paged_attention_tpu
from jlora.models import quant, vocab_lora
from jlora.models.config import LORA_MODULES, PACKED_MODULES, VOCAB_MODULES, LlamaConfig  # PEFT names
from jlora.models.tensor_parallel import split_packed
from jlora.tuning import TuningOptions
FUSED_MODULES = tuple(PACKED_MODULES)  # ("qkv_proj", "o_proj", "gate_up_proj", "down_proj"): the GEMMs
TRAINABLE_IMPLS = ("gather", "laned", "pallas")  # lora_delta implementations with a gradient
KVCache = dict  # {"k": [L, num_blocks, block_size, KVH*Dh], "v": same}; int8: + "k_scale", "v_scale" [L, NB, KVH, bs]
LoRAState = dict  # packed module -> {"A": [L, N, in, S*R], "B": [L, N, R, out]}


# ---- rotary embeddings ------------------------------------------------------------------------


def rope_inv_freq(cfg: LlamaConfig) -> np.ndarray:  # f32[Dh/2]
    dh = cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (np.arange(0, dh, 2, dtype=np.float64) / dh))
    s = cfg.rope_scaling_dict
    if s is not None:  # Llama 3: stretch low frequencies, keep high ones, blend in between
        factor, lo, hi = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
        old_len = s["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv
        scaled = np.where(wavelen > old_len / lo, inv / factor, inv)
        smooth = (old_len / wavelen - lo) / (hi - lo)
        mid = (1 - smooth) * scaled / factor + smooth * scaled
        is_mid = (wavelen >= old_len / hi) & (wavelen <= old_len / lo)
        inv = np.where(is_mid, mid, scaled)
    return inv.astype(np.float32)


def rope_tables(positions: jax.Array, inv_freq: jax.Array) -> tuple[jax.Array, jax.Array]:
    """cos, sin f32[T, 1, Dh/2] for positions i32[T] (computed once per step, used by every layer)."""
    angles = positions.astype(jnp.float32)[:, None] * inv_freq  # [T, Dh/2]
    return jnp.cos(angles)[:, None, :], jnp.sin(angles)[:, None, :]


def apply_rope(
    x: jax.Array,  # [T, H, Dh]
    cos: jax.Array,  # f32[T, 1, Dh/2]
    sin: jax.Array,  # f32[T, 1, Dh/2]
) -> jax.Array:  # [T, H, Dh]
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)  # HF's rotate_half layout
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x.dtype)


# ---- layers -----------------------------------------------------------------------------------


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:  # [..., D], [D]
    xf = x.astype(jnp.float32)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return (xf * quant.widen(weight).astype(jnp.float32)).astype(x.dtype)


class RMSNorm(nnx.Module):
    def __init__(self, dim: int, eps: float, dtype: Any):
        self.weight = nnx.Param(jnp.ones((dim,), dtype))
        self.eps = eps

    def __call__(self, x: jax.Array) -> jax.Array:  # [..., D]
        return rms_norm(x, self.weight[...], self.eps)


def layer_weight(stacked: Any, layer: jax.Array) -> Any:  # [L, ...] (arrays or QArrays) -> [...]
    return quant.widen(jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, layer, 0, keepdims=False), stacked))


def lora_linear(
    x: jax.Array,  # [T, in]
    kernel: jax.Array | quant.QArray | Callable[[], jax.Array | quant.QArray],  # [in, out], float or int8;
    #   a function returning it: read where the projection is computed (inside the conditional's
    #   branches with cond="inside")
    lora: dict[str, jax.Array] | tuple[dict[str, jax.Array], ...] | None,  # {"A": [N, in, R], "B": [N, R, out]}
    #   ([L, ...] with `layer`); a tuple of them for slot pools of several ranks; or None
    slot_ids: jax.Array,  # i32[T]
    lora_impl: str,
    enabled: jax.Array | None = None,  # bool scalar: False skips the LoRA term (no token has an adapter)
    layer: jax.Array | None = None,  # i32 scalar: which layer of stacked [L, N, ...] slots to use
    splits: tuple[int, ...] | None = None,  # packed module: out widths of its sub-modules (A is [.., in, S*R])
    scale: jax.Array | None = None,  # f32[T]: multiplies each token's LoRA delta (per-request scale)
    mix: jax.Array | None = None,  # f32[T, N]: slot weights of MIX_SLOT tokens (adapter combinations)
    slices: str = "inside",  # where a layer's slots are sliced: "inside" the conditional or "before" it
    cond: str = "pass",  # the conditional's base projection: "pass" (computed before it) or "inside" it
) -> jax.Array:  # [T, out]
    """x @ W plus each token's own slot's LoRA term. `slices` and `cond` are
    `jlora.tuning.TuningOptions.lora_slices` / `lora_cond` (resolved): how the graph is built, never
    what it computes."""
    weight = kernel if callable(kernel) else lambda: kernel
    if lora is None:
        return quant.linear(x, weight())
    pools = lora if isinstance(lora, tuple) else (lora,)
    if layer is not None and slices == "before":
        pools = tuple({k: jax.lax.dynamic_index_in_dim(v, layer, 0, keepdims=False) for k, v in p.items()}
                      for p in pools)
        layer = None

    def with_delta(y: jax.Array) -> jax.Array:
        out, first, factor = y, 0, None
        for pool in pools:  # slots numbered across the pools in order; a pool reads its own ids only
            a, b = pool["A"], pool["B"]
            if layer is not None:  # sliced here, inside the cond: a step without adapters never reads the slots
                a = jax.lax.dynamic_index_in_dim(a, layer, 0, keepdims=False)
                b = jax.lax.dynamic_index_in_dim(b, layer, 0, keepdims=False)
            n = a.shape[0]
            ids = slot_ids if len(pools) == 1 else jnp.where(
                (slot_ids >= first) & (slot_ids < first + n), slot_ids - first,
                jnp.where(slot_ids == MIX_SLOT, MIX_SLOT, -1))
            a, b = quant.widen(a), quant.widen(b)  # bf16 slots travel as bits on XLA:CPU
            m = None if mix is None else mix[:, first:first + n]  # this pool's columns
            out = out + lora_delta(x, a, b, ids, impl=lora_impl, splits=splits, scale=scale, mix=m).astype(y.dtype)
            if "M" in pool:  # DoRA (enable_dora): this pool's rows scale base + delta by 1 + M[slot]
                # (jlora.adapters.dora); scaled and combined requests never name a DoRA adapter (refused when added)
                mag = pool["M"] if layer is None else jax.lax.dynamic_index_in_dim(pool["M"], layer, 0, keepdims=False)
                mag = mag.astype(y.dtype)  # [N, out]: the factor in the compute dtype (f32 stays f32)
                f = jnp.where((ids >= 0)[:, None], jnp.take(mag, jnp.maximum(ids, 0), axis=0), 0)  # [T, out]
                factor = f if factor is None else factor + f
            first += n
        if factor is None:
            return out
        # out + out * M (M: the factor minus one), not out * (1 + M): in bf16, 1 + M would round M
        # to steps of 2^-7, while M alone keeps 8 bits of its own.
        return out + out * factor

    if enabled is not None and cond == "inside":
        return jax.lax.cond(enabled, lambda: with_delta(quant.linear(x, weight())), lambda: quant.linear(x, weight()))
    y = quant.linear(x, weight())
    return with_delta(y) if enabled is None else jax.lax.cond(enabled, lambda: with_delta(y), lambda: y)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class AttnGroup:
    """B sequences with Q query tokens each, packed row-major in the step's token axis.
    `runs`: every row's real positions are consecutive from its first column, padding after
    (the engine's prefill chunks); its keys and values are then written a page at a time."""

    positions: jax.Array  # i32[B, Q], -1 = padding
    block_tables: jax.Array  # i32[B, MB]: the blocks holding each sequence's positions, in order
    runs: bool = dataclasses.field(default=False, metadata=dict(static=True))


# A group writes its keys and values page by page when its rows hold runs of at least this many
# tokens: XLA:TPU scatters rows one at a time (~0.1 us each: 107 us a layer for a 1,088-token
# step), while a page is one 128 x KVH*Dh window read, merged and written back.
PAGE_WRITE_MIN_QUERIES = 8


def page_writes(g: AttnGroup, block_size: int, num_blocks: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Where a run group's tokens land, page-wise: the blocks its rows touch ([B*P], `num_blocks`
    = none, dropped), which rows of those pages are new ([B*P, bs, 1]), and where each row's
    first page starts in its tokens padded by `block_size` rows in front ([B])."""
    b, q = g.positions.shape
    bs, p = block_size, -(-q // block_size) + 1  # a run of q positions touches at most P pages
    n = jnp.sum(g.positions >= 0, axis=1)  # [B] real tokens of each row
    first = jnp.maximum(g.positions[:, 0], 0)
    pages = first[:, None] // bs + jnp.arange(p)  # [B, P] page numbers within each sequence
    blocks = jnp.take_along_axis(g.block_tables, jnp.minimum(pages, g.block_tables.shape[1] - 1), axis=1)
    pos = pages[:, :, None] * bs + jnp.arange(bs)  # [B, P, bs]
    new = (pos >= first[:, None, None]) & (pos < (first + n)[:, None, None])
    blocks = jnp.where(new.any(axis=2), blocks, num_blocks)
    return blocks.reshape(b * p), new.reshape(b * p, bs, 1), bs - first % bs


def write_pages(c: jax.Array, layer: jax.Array, rows: jax.Array, where: tuple[jax.Array, jax.Array, jax.Array],
                positions_last: bool = False) -> jax.Array:  # c [L, NB, bs, D], rows [B*Q, D] -> c with the rows written
    """A run group's keys (or values) into layer `layer` of the cache, one window per page: the
    touched pages are read, the new rows merged in, and the pages written back whole.
    `positions_last`: c is [L, NB, D, bs] (an int8 cache's scales, jlora.kernels.kv_quant)."""
    blocks, new, start = where
    nb = c.shape[1]
    bs, d = (c.shape[3], c.shape[2]) if positions_last else c.shape[2:]
    b = start.shape[0]
    p = blocks.shape[0] // b
    rows = rows.reshape(b, -1, d)
    padded = jnp.pad(rows, ((0, 0), (bs, p * bs - rows.shape[1]), (0, 0)))  # [B, bs + P*bs, D]
    fresh = jax.vmap(lambda r, s: jax.lax.dynamic_slice_in_dim(r, s, p * bs))(padded, start)
    old = c[layer, jnp.minimum(blocks, nb - 1)]  # [B*P, bs, D] ([B*P, D, bs] positions last)
    if positions_last:
        merged = jnp.where(jnp.swapaxes(new, 1, 2), jnp.swapaxes(fresh.reshape(b * p, bs, d), 1, 2), old)
    else:
        merged = jnp.where(new, fresh.reshape(b * p, bs, d), old)
    return c.at[layer, blocks].set(merged, mode="drop")


class DecoderLayers(nnx.Module):
    """All L decoder layers; every weight carries a leading layer axis and is scanned over."""

    def __init__(self, cfg: LlamaConfig, dtype: Any, rngs: nnx.Rngs):
        L, d = cfg.num_hidden_layers, cfg.hidden_size
        init = nnx.initializers.normal(stddev=0.02)
        self.input_layernorm = nnx.Param(jnp.ones((L, d), dtype))
        self.post_attention_layernorm = nnx.Param(jnp.ones((L, d), dtype))
        for name, (d_in, outs) in cfg.packed_shapes().items():  # qkv_proj, o_proj, gate_up_proj, down_proj
            setattr(self, name, nnx.Param(init(rngs.params(), (L, d_in, sum(outs)), dtype)))
        # Base-only extras of some families (never part of an adapter); kept in the compute dtype.
        shapes = cfg.packed_shapes()
        if cfg.qkv_bias:  # Qwen2: q | k | v biases in qkv_proj's column order
            self.qkv_bias = nnx.Param(jnp.zeros((L, sum(shapes["qkv_proj"][1])), dtype))
        if cfg.o_bias:
            self.o_bias = nnx.Param(jnp.zeros((L, d), dtype))
        if cfg.qk_norm:  # Qwen3: RMSNorm weights over head_dim, shared by the heads
            self.q_norm = nnx.Param(jnp.ones((L, cfg.head_dim), dtype))
            self.k_norm = nnx.Param(jnp.ones((L, cfg.head_dim), dtype))
        self.extra_names = tuple(n for n, on in (("qkv_bias", cfg.qkv_bias), ("o_bias", cfg.o_bias),
                                                 ("q_norm", cfg.qk_norm), ("k_norm", cfg.qk_norm)) if on)

    def weights(self) -> dict[str, jax.Array | quant.QArray]:  # name -> [L, ...] (int8 ones as QArray)
        names = ("input_layernorm", "post_attention_layernorm") + FUSED_MODULES + self.extra_names
        return {n: quant.weight(self, n) for n in names}


class Llama(nnx.Module):
    def __init__(self, cfg: LlamaConfig, *, dtype: Any = jnp.float32, rngs: nnx.Rngs | None = None):
        rngs = rngs or nnx.Rngs(0)
        self.cfg = cfg
        self.dtype = dtype
        self.embed_tokens = nnx.Param(
            nnx.initializers.normal(stddev=0.02)(rngs.params(), (cfg.vocab_size, cfg.hidden_size), dtype))
        self.layers = DecoderLayers(cfg, dtype, rngs)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        if not cfg.tie_word_embeddings:
            self.lm_head = nnx.Param(
                nnx.initializers.normal(stddev=0.02)(rngs.params(), (cfg.hidden_size, cfg.vocab_size), dtype))
        self.inv_freq = nnx.Variable(jnp.asarray(rope_inv_freq(cfg)))  # a constant, not a trainable Param
        # Tensor-parallel shards the packed columns are laid out for (`tensor_parallel.layout_model`).
        self.layout_shards = 1

    def forward(
        self,
        tokens: jax.Array,  # i32[T], groups packed in order
        slot_ids: jax.Array,  # i32[T], -1 = base model (and padding)
        groups: tuple[AttnGroup, ...],  # their B*Q add up to T
        cache: KVCache,  # {"k", "v": [L, NB, bs, KVH*Dh]}
        lora_state: LoRAState | None = None,  # module -> {"A": [L, N, in, R], "B": [L, N, R, out]}
        *,
        lora_impl: str = "auto",
        attn_chunk: int = 128,
        attn_impl: str = "xla",  # "xla" or "pallas" (resolved by the caller; jlora.engine.config.ATTN_IMPLS)
        lora_skip: bool = True,  # False: LoRA for every token, no conditionals (see `_decoder`)
        slot_scale: jax.Array | None = None,  # f32[T]: each token's LoRA scale (None = 1)
        slot_mix: jax.Array | None = None,  # f32[T, N]: slot weights of tokens whose slot id is MIX_SLOT
        tuning: TuningOptions = TuningOptions(),  # how the graph is built (jlora.tuning), not what it computes
        embed_lora: jax.Array | None = None,  # bool scalar: some token's adapter has embedding LoRA (None: compute)
    ) -> tuple[jax.Array, KVCache]:  # hidden states [T, D] before the final norm, new cache
        """The serving step's forward: keys and values go to the paged cache, attention reads it."""
        if attn_impl not in ("xla", "pallas"):
            raise ValueError(f"attn_impl must be 'xla' or 'pallas' here, got {attn_impl!r}")
        cfg = self.cfg
        # (The kernel's cache rows may end in padding lanes: `cache_lanes`.)
        attention = paged_attention if attn_impl == "xla" else partial(
            paged_attention_tpu, kv_heads=cfg.num_key_value_heads, options=tuning.attention)
        h, dh = cfg.num_attention_heads, cfg.head_dim
        num_blocks, bs = cache["k"].shape[1:3]
        chunk = max(bs, attn_chunk // bs * bs)
        positions = jnp.concatenate([g.positions.reshape(-1) for g in groups])  # [T]
        # Each group's token range and how its keys/values get there: page-wise (page_writes) for
        # runs of tokens, else a row scatter to (block of its position, offset), padding dropped.
        writes, start = [], 0
        for g in groups:
            t = g.positions.size
            if g.runs and g.positions.shape[1] >= PAGE_WRITE_MIN_QUERIES:
                where = page_writes(g, bs, num_blocks)
            else:
                pos = g.positions.reshape(-1)
                block = jnp.take_along_axis(g.block_tables, jnp.maximum(g.positions, 0) // bs, axis=1).reshape(-1)
                where = (jnp.where(pos >= 0, block, num_blocks), jnp.maximum(pos, 0) % bs)
            writes.append((start, start + t, where))
            start += t

        def scatter(c, i, x, positions_last=False):  # x [T, D] -> c with every group's tokens written
            for lo, hi, where in writes:
                if len(where) == 2 and positions_last:  # c [L, NB, D, bs]: [T, D] at (block, :, offset)
                    c = c.at[i, where[0], :, where[1]].set(x[lo:hi], mode="drop")
                elif len(where) == 2:  # (block, offset) of each token
                    c = c.at[i, where[0], where[1]].set(x[lo:hi], mode="drop")
                else:
                    c = write_pages(c, i, x[lo:hi], where, positions_last)
            return c

        def write(kv, i, k, v):  # k, v [T, KVH, Dh] -> the cache arrays with every group's tokens written
            out = []
            for c, x in zip(kv[:2], (k, v)):
                if c.shape[-1] > x.shape[1] * dh:  # the kernel's padded cache rows (cache_lanes): zeros there
                    x = jnp.pad(x, ((0, 0), (0, c.shape[-1] // dh - x.shape[1]), (0, 0)))
                if c.dtype == jnp.int8:  # int8 rows and one scale a head (jlora.kernels.kv_quant)
                    rows, scale = quantize_kv(x)
                    out.append((scatter(c, i, rows), scale))
                else:
                    out.append((scatter(c, i, quant.narrow(x.reshape(x.shape[0], -1), c)), None))
            if len(kv) == 2:
                return out[0][0], out[1][0]
            return (out[0][0], out[1][0], scatter(kv[2], i, out[0][1], True), scatter(kv[3], i, out[1][1], True))

        def attend(q, k, v, i, win, kv):
            kv = write(kv, i, k, v)
            scales = dict(k_scale=kv[2], v_scale=kv[3]) if len(kv) == 4 else {}
            outs, start = [], 0
            for g in groups:
                b, nq = g.positions.shape
                qg = q[start: start + b * nq].reshape(b, nq, h, dh)
                outs.append(attention(qg, kv[0], kv[1], i, g.positions, g.block_tables, win,
                                      chunk=chunk, **scales).reshape(b * nq, h * dh))
                start += b * nq
            return (jnp.concatenate(outs) if len(outs) > 1 else outs[0]), kv

        names = ("k", "v", "k_scale", "v_scale") if "k_scale" in cache else ("k", "v")
        x = quant.embed(quant.weight(self, "embed_tokens"), tokens)
        x = vocab_lora.add_embed_delta(x, lora_state, tokens, slot_ids, slot_scale, slot_mix, embed_lora)
        x, kv = self._decoder(x, positions, slot_ids, lora_state, lora_impl, attend,
                              quant.to_bits(tuple(cache[n] for n in names)), lora_skip, tuning, slot_scale, slot_mix)
        return x, {n: quant.like(c, cache[n]) for n, c in zip(names, kv)}

    def train_logits(
        self,
        tokens: jax.Array,  # i32[B, T]
        lora_state: LoRAState | None = None,  # the slots the engine serves (a training pytree)
        seq_slot_ids: jax.Array | None = None,  # i32[B]: each row's slot; None = slot 0 (or base without slots)
        *,
        lora_impl: str = "laned",
        tuning: TuningOptions = TuningOptions(),
    ) -> jax.Array:  # f32[B, T, V]
        """A training forward: no KV cache, causal attention within each row, differentiable in
        `lora_state` (and the weights). Right padding needs no mask (causal: later tokens never
        reach earlier ones); mask the loss instead. `lora_impl` must be differentiable:
        "gather", "laned" or "pallas" (grouped's block loop has a data-dependent trip count)."""
        if lora_impl not in TRAINABLE_IMPLS:
            raise ValueError(f"lora_impl={lora_impl!r} cannot be differentiated; use one of {list(TRAINABLE_IMPLS)}")
        if vocab_lora.pools_of(lora_state, "embed_tokens") or vocab_lora.pools_of(lora_state, "lm_head"):
            raise ValueError("train_logits: training LoRA on embed_tokens / lm_head is not supported; make the "
                             "training state without them (init_lora_state's default modules)")
        cfg = self.cfg
        bsz, t = tokens.shape
        h, kvh, dh = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        if seq_slot_ids is None:
            seq_slot_ids = jnp.full((bsz,), 0 if lora_state else -1, jnp.int32)
        slot_ids = jnp.repeat(seq_slot_ids.astype(jnp.int32), t)
        positions = jnp.tile(jnp.arange(t, dtype=jnp.int32), bsz)

        def attend(q, k, v, i, win, state):
            out = causal_attention(q.reshape(bsz, t, h, dh), k.reshape(bsz, t, kvh, dh),
                                   v.reshape(bsz, t, kvh, dh), win)
            return out.reshape(bsz * t, h * dh), state

        x = quant.embed(quant.weight(self, "embed_tokens"), tokens.reshape(-1))
        x, _ = self._decoder(x, positions, slot_ids, lora_state, lora_impl, attend, (), tuning=tuning)
        return self.logits(x).reshape(bsz, t, -1)

    def _decoder(self, x, positions, slot_ids, lora_state, lora_impl, attend, state, lora_skip=True,
                 tuning: TuningOptions = TuningOptions(),
                 slot_scale=None, slot_mix=None):
        """The decoder stack over x [T, D] as one scan over the layers. `attend(q, k, v, layer,
        window, state) -> (attention [T, H*Dh], state)` is the one part the serving step (paged
        KV cache) and the training forward (dense causal) do differently. `lora_skip`: a batch
        without adapter tokens skips the LoRA math (a conditional per projection); False computes
        it for every token (tokens without an adapter read zeros: the same result)."""
        cfg = self.cfg
        h, kvh, dh = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        eps = cfg.rms_norm_eps
        cos, sin = rope_tables(positions, self.inv_freq[...])

        # A batch with no adapter token skips the LoRA math (and reading the slots) in every layer;
        # None (lora_skip=False): no conditional.
        any_lora = jnp.any((slot_ids >= 0) | (slot_ids == MIX_SLOT)) if lora_skip else None

        # The stacked slots are a loop constant, not a scanned input: scanning them would slice (and on
        # XLA:CPU copy) every layer's [N, in, R] block each step, also when no token uses an adapter.
        lora = quant.to_bits(lora_state) or None
        pools = lora if isinstance(lora, tuple) else (lora,)  # slot pools of several ranks, or one

        def get(m: str):
            if lora is None or m not in pools[0]:
                return None
            return tuple(p[m] for p in pools) if len(pools) > 1 else pools[0][m]
        # Under tensor parallelism q|k|v and gate|up columns are stored shard-major
        # (jlora.models.tensor_parallel): the splits are per shard.
        shards = self.layout_shards
        packed = cfg.packed_shapes()
        splits = {m: tuple(w // shards for w in outs) if len(outs) > 1 else None for m, (_, outs) in packed.items()}

        # Each layer's sliding window (a scanned i32), or None when the model has none at all; a
        # full-attention layer of a mixed model gets a window past any position.
        windows = None
        if cfg.has_sliding_window:
            windows = jnp.asarray([w or np.iinfo(np.int32).max // 2 for w in cfg.sliding_windows], jnp.int32)

        weights = quant.to_bits(self.layers.weights())
        # lora_cond "inside": the projections under a LoRA conditional slice their weights inside its
        # branches (layer_weight); the scan slices the rest.
        cond = tuning.resolved_lora_cond(jax.default_backend())
        in_branch = set(pools[0]) if lora is not None and any_lora is not None and cond == "inside" else set()

        def layer(carry, xs):
            x, state = carry
            w, i = xs
            win = None if windows is None else windows[i]
            w = quant.widen(w)  # this layer's bf16 weights, sliced as bits, to f32 on XLA:CPU

            def linear(h: jax.Array, name: str) -> jax.Array:
                kernel = (lambda: layer_weight(weights[name], i)) if name in in_branch else w[name]
                return lora_linear(h, kernel, get(name), slot_ids, lora_impl, enabled=any_lora, layer=i,
                                   splits=splits[name], slices=tuning.lora_slices, cond=cond,
                                   scale=slot_scale, mix=slot_mix)

            y = rms_norm(x, w["input_layernorm"], eps)
            qkv = linear(y, "qkv_proj")
            if cfg.qkv_bias:
                qkv = qkv + w["qkv_bias"].astype(qkv.dtype)
            q, k, v = split_packed(qkv, packed["qkv_proj"][1], shards)  # one GEMM
            q, k, v = q.reshape(-1, h, dh), k.reshape(-1, kvh, dh), v.reshape(-1, kvh, dh)
            if cfg.qk_norm:
                q, k = rms_norm(q, w["q_norm"], eps), rms_norm(k, w["k_norm"], eps)
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
            attn, state = attend(q, k, v, i, win, state)
            o = linear(attn.astype(x.dtype), "o_proj")
            x = x + (o + w["o_bias"].astype(o.dtype) if cfg.o_bias else o)
            y = rms_norm(x, w["post_attention_layernorm"], eps)
            gate, up = split_packed(linear(y, "gate_up_proj"), packed["gate_up_proj"][1], shards)  # one GEMM
            x = x + linear(jax.nn.silu(gate) * up, "down_proj")
            return (x, state), None

        xs = ({k: v for k, v in weights.items() if k not in in_branch}, jnp.arange(cfg.num_hidden_layers))
        (x, state), _ = jax.lax.scan(layer, (x, state), xs)
        return x, state

    def logits(
        self,
        x: jax.Array,  # [..., D] hidden before the final norm ([S, D] with lora_state)
        lora_state: LoRAState | None = None,  # its "lm_head" slots, if it holds them, add each row's head LoRA
        slot_ids: jax.Array | None = None,  # i32[S]: each row's slot (-1 none, MIX_SLOT a combination)
        slot_scale: jax.Array | None = None,  # f32[S]
        slot_mix: jax.Array | None = None,  # f32[S, N]
        enabled: jax.Array | None = None,  # bool scalar: some row's adapter has head LoRA (None: compute)
    ) -> jax.Array:  # f32[..., V]
        y = self.norm(x)
        out = quant.lm_head(y, quant.head_rows(self))
        if slot_ids is None:
            return out
        return vocab_lora.add_head_delta(out, y, lora_state, slot_ids, slot_scale, slot_mix, enabled)

    def __call__(
        self,
        tokens: jax.Array,  # i32[B, T]
        positions: jax.Array,  # i32[B, T], -1 = padding
        cache: KVCache,  # {"k","v": [L, NB, bs, KVH*Dh]}
        lora_state: LoRAState | None = None,  # module -> {"A": [L, N, in, R], "B": [L, N, R, out]}
        seq_slot_ids: jax.Array | None = None,  # i32[B], -1 = base model
        logits_index: jax.Array | None = None,  # i32[B]: which token of each row to produce logits for
        block_tables: jax.Array | None = None,  # i32[B, MB]; None = sequence b owns block b
        *,
        lora_impl: str = "auto",
    ) -> tuple[jax.Array, KVCache]:  # logits f32[B, V] (or [B, T, V] without logits_index), new cache
        """A batch of B sequences with T tokens each (one attention group)."""
        bsz, t = tokens.shape
        if block_tables is None:
            block_tables = jnp.arange(bsz, dtype=jnp.int32)[:, None]
        if seq_slot_ids is None:
            seq_slot_ids = jnp.full((bsz,), -1, jnp.int32)
        # Padding tokens must never read a real slot.
        slot_ids = jnp.where(positions >= 0, seq_slot_ids[:, None], -1).reshape(bsz * t)
        x, cache = self.forward(tokens.reshape(-1), slot_ids, (AttnGroup(positions, block_tables),), cache,
                                lora_state, lora_impl=lora_impl)
        x = x.reshape(bsz, t, -1)
        if logits_index is not None:
            x = jnp.take_along_axis(x, logits_index[:, None, None], axis=1)[:, 0]  # [B, D]
            return self.logits(x, lora_state, seq_slot_ids), cache
        return self.logits(x.reshape(bsz * t, -1), lora_state, slot_ids).reshape(bsz, t, -1), cache


def host_zeros(shape: tuple[int, ...], dtype: Any) -> jax.Array:
    """Zeros made on the host and moved over: no XLA graph to compile (for start-up, outside jit)."""
    return jax.device_put(np.zeros(shape, dtype))


def init_cache(cfg: LlamaConfig, num_blocks: int, block_size: int, dtype: Any = jnp.float32,
               zeros: Any = jnp.zeros, lanes: int | None = None, scale_zeros: Any = None) -> KVCache:
    """Zeroed KV cache {"k", "v": [L, NB, bs, KVH*Dh]}; `init_cache(cfg, batch, max_len)` is one
    region (block) per sequence, what a direct model call without block tables reads. `lanes`: a
    wider row, zeros past KVH*Dh (the TPU kernel's `cache_lanes`). `dtype` int8 (or "int8"): int8
    keys and values plus "k_scale", "v_scale": f32[L, NB, KVH, bs] (jlora.kernels.kv_quant; KVH
    counts the pad heads of a wider row), made by `scale_zeros` (default `zeros`)."""
    row = lanes or cfg.num_key_value_heads * cfg.head_dim
    shape = (cfg.num_hidden_layers, num_blocks, block_size, row)
    if jnp.dtype(dtype) != jnp.int8:
        return {"k": zeros(shape, dtype), "v": zeros(shape, dtype)}
    sshape = (cfg.num_hidden_layers, num_blocks, row // cfg.head_dim, block_size)
    scale_zeros = scale_zeros or zeros
    return {"k": zeros(shape, jnp.int8), "v": zeros(shape, jnp.int8),
            "k_scale": scale_zeros(sshape, SCALE_DTYPE), "v_scale": scale_zeros(sshape, SCALE_DTYPE)}


def lora_state_modules(modules: tuple[str, ...] = LORA_MODULES) -> tuple[str, ...]:
    """The packed modules a LoRA state holds for PEFT `modules`: each one with any sub-module there
    (it then holds lanes for all of its sub-modules, zeros for those not in `modules`), then
    embed_tokens / lm_head where `modules` names them (VOCAB_MODULES)."""
    unknown = sorted(set(modules) - set(LORA_MODULES) - set(VOCAB_MODULES))
    if unknown:
        raise ValueError(f"modules: unknown LoRA modules {unknown}; known: {list(LORA_MODULES + VOCAB_MODULES)}")
    return (tuple(f for f, subs in PACKED_MODULES.items() if any(m in modules for m in subs))
            + tuple(m for m in VOCAB_MODULES if m in modules))


def init_lora_state(
    cfg: LlamaConfig, max_loras: int, max_rank: int, dtype: Any = jnp.float32,
    modules: tuple[str, ...] = LORA_MODULES, zeros: Any = jnp.zeros, dora: bool = False,
) -> LoRAState:
    """Empty slots: per packed module {"A": [L, N, in, S*R], "B": [L, N, R, out]} (S sub-modules;
    see `lora_state_modules`), stacked like the weights so the decoder's layer scan slices them
    with its layer. With `dora` (EngineConfig.enable_dora) also "M": f32[L, N, out], each slot's
    DoRA factor minus one per output column (jlora.adapters.dora): zeros for plain adapters and
    empty slots; stored in float32 whatever `dtype` is. Without it a LoRA step computes no factor
    at all (`lora_linear` applies one only where a pool has "M"). With VOCAB_MODULES in `modules`, also
    "embed_tokens" {"A": [1, N, V, R], "B": [1, N, R, D]} and "lm_head" {"A": [1, N, D, R],
    "B": [1, N, R, V]} (jlora.models.vocab_lora), without "M"."""
    shapes = cfg.packed_shapes()
    vocab = cfg.vocab_shapes()
    L = cfg.num_hidden_layers
    out = {}
    for m in lora_state_modules(modules):
        if m in VOCAB_MODULES:
            d_in, d_out = vocab[m]
            out[m] = {"A": zeros((1, max_loras, d_in, max_rank), dtype),
                      "B": zeros((1, max_loras, max_rank, d_out), dtype)}
            continue
        out[m] = {"A": zeros((L, max_loras, shapes[m][0], len(shapes[m][1]) * max_rank), dtype),
                  "B": zeros((L, max_loras, max_rank, sum(shapes[m][1])), dtype)}
        if dora:
            out[m]["M"] = zeros((L, max_loras, sum(shapes[m][1])), jnp.float32)
    return out
