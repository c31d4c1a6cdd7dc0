"""A Llama-family decoder in Flax NNX with multi-slot LoRA on every linear layer.

Weights live in the NNX module; adapter weights do not. They arrive per call as `lora_state`
(see DESIGN.md): for each target module `{"A": [L, N, in, R], "B": [L, N, R, out]}` (held as
one array per layer, see `init_lora_state`), with the
PEFT scale already folded into B. Each token reads its own slot via `slot_ids`; -1 reads none.

The KV cache is paged: per layer `k, v: [KVH, num_blocks, block_size, Dh]`, and each sequence's
block table `i32[B, span // block_size]` lists the blocks holding its positions in order. Without a
block table the cache is read as one region per sequence (block b holds all of sequence b), which
is what `init_cache(cfg, batch, max_len)` builds for direct model calls.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jlora.kernels import lora_delta
from jlora.models.config import LlamaConfig

LORA_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
KVCache = list  # per layer {"k": [KVH, num_blocks, block_size, Dh], "v": same}
LoRAState = dict  # module -> {"A": L x [N, in, R], "B": L x [N, R, out]} (one array per layer)


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


def apply_rope(
    x: jax.Array,  # [B, T, H, Dh]
    positions: jax.Array,  # i32[B, T]
    inv_freq: jax.Array,  # f32[Dh/2]
) -> jax.Array:  # [B, T, H, Dh]
    angles = positions.astype(jnp.float32)[..., None] * inv_freq  # [B, T, Dh/2]
    cos = jnp.cos(angles)[:, :, None, :]
    sin = jnp.sin(angles)[:, :, None, :]
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)  # HF's rotate_half layout
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x.dtype)


# ---- layers -----------------------------------------------------------------------------------


class RMSNorm(nnx.Module):
    def __init__(self, dim: int, eps: float, dtype: Any):
        self.weight = nnx.Param(jnp.ones((dim,), dtype))
        self.eps = eps

    def __call__(self, x: jax.Array) -> jax.Array:  # [..., D]
        xf = x.astype(jnp.float32)
        xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + self.eps)
        return (xf * self.weight[...].astype(jnp.float32)).astype(x.dtype)


class LoRALinear(nnx.Module):
    """y = x @ W + (per-token slot's) x @ A @ B. W is [in, out]; adapters come per call."""

    def __init__(self, in_features: int, out_features: int, dtype: Any, rngs: nnx.Rngs):
        init = nnx.initializers.normal(stddev=0.02)
        self.kernel = nnx.Param(init(rngs.params(), (in_features, out_features), dtype))

    def __call__(
        self,
        x: jax.Array,  # [B, T, in]
        lora: dict[str, jax.Array] | None,  # {"A": [N, in, R], "B": [N, R, out]} or None
        slot_ids: jax.Array,  # i32[B*T]
        lora_impl: str,
    ) -> jax.Array:  # [B, T, out]
        y = x @ self.kernel[...]
        if lora is None:
            return y
        bsz, t, d = x.shape
        delta = lora_delta(x.reshape(bsz * t, d), lora["A"], lora["B"], slot_ids, impl=lora_impl)
        return y + delta.reshape(bsz, t, -1).astype(y.dtype)


class Attention(nnx.Module):
    def __init__(self, cfg: LlamaConfig, dtype: Any, rngs: nnx.Rngs):
        d, h, kvh, dh = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.q_proj = LoRALinear(d, h * dh, dtype, rngs)
        self.k_proj = LoRALinear(d, kvh * dh, dtype, rngs)
        self.v_proj = LoRALinear(d, kvh * dh, dtype, rngs)
        self.o_proj = LoRALinear(h * dh, d, dtype, rngs)
        self.h, self.kvh, self.dh = h, kvh, dh

    def __call__(self, x, positions, cache, block_tables, lora, slot_ids, inv_freq, span, lora_impl):
        """x [B, T, D], positions i32[B, T] (-1 = padding), cache {"k","v": [KVH, NB, bs, Dh]},
        block_tables i32[B, span // bs], or None when sequence b owns block b (bs >= span)."""
        bsz, t, _ = x.shape
        get = lambda name: lora.get(name) if lora else None  # noqa: E731
        q = self.q_proj(x, get("q_proj"), slot_ids, lora_impl).reshape(bsz, t, self.h, self.dh)
        k = self.k_proj(x, get("k_proj"), slot_ids, lora_impl).reshape(bsz, t, self.kvh, self.dh)
        v = self.v_proj(x, get("v_proj"), slot_ids, lora_impl).reshape(bsz, t, self.kvh, self.dh)
        q = apply_rope(q, positions, inv_freq)
        k = apply_rope(k, positions, inv_freq)

        # Write new keys/values at (block of position, offset); padding (position -1) goes to an
        # out-of-range block and is dropped.
        num_blocks, bs = cache["k"].shape[1:3]
        if block_tables is None:
            block = jnp.broadcast_to(jnp.arange(bsz)[:, None], (bsz, t))
            offset = positions
        else:
            block = jnp.take_along_axis(block_tables, jnp.maximum(positions, 0) // bs, axis=1)
            offset = positions % bs
        block = jnp.where(positions >= 0, block, num_blocks)
        heads_first = lambda a, c: jnp.transpose(a, (2, 0, 1, 3)).astype(c.dtype)  # noqa: E731  [KVH, B, T, Dh]
        k_cache = cache["k"].at[:, block, offset].set(heads_first(k, cache["k"]), mode="drop")
        v_cache = cache["v"].at[:, block, offset].set(heads_first(v, cache["v"]), mode="drop")

        # Attend to the first `span` positions (a static bucket), causally.
        if block_tables is None:  # a static slice, no gather
            keys, values = k_cache[:, :bsz, :span], v_cache[:, :bsz, :span]  # [KVH, B, span, Dh]
        else:  # gather the sequence's blocks in order: [KVH, B, span // bs, bs, Dh] -> [KVH, B, span, Dh]
            keys = k_cache[:, block_tables].reshape(self.kvh, bsz, span, self.dh)
            values = v_cache[:, block_tables].reshape(self.kvh, bsz, span, self.dh)
        out = attention(q, keys, values, positions).reshape(bsz, t, self.h * self.dh).astype(x.dtype)
        return self.o_proj(out, get("o_proj"), slot_ids, lora_impl), {"k": k_cache, "v": v_cache}


def attention(
    q: jax.Array,  # [B, T, H, Dh]
    keys: jax.Array,  # [KVH, B, S, Dh]
    values: jax.Array,  # [KVH, B, S, Dh]
    positions: jax.Array,  # i32[B, T]: query positions; key j is visible to query at p iff j <= p
) -> jax.Array:  # f32[B, T, H, Dh]
    """Grouped-query attention over keys and values gathered heads-first (batch dims KVH, B)."""
    bsz, t, h, dh = q.shape
    kvh = keys.shape[0]
    qg = q.reshape(bsz, t, kvh, h // kvh, dh)
    # Operand orders and the small transposes around the softmax are chosen for XLA:CPU (profiled
    # in a SmolLM2 B=16 decode step, attention 27 -> 23 ms): softmax over the minor axis, then
    # probabilities as [.., S, T, G] and the output heads-first, so `values` are read as they lie
    # (asking for [B, T, ...] directly made XLA transpose all of `values`). XLA still transposes the
    # keys for the scores dot; transposing the queries instead measured slower.
    scores = jnp.einsum("kbsd,btkgd->kbtgs", keys, qg, preferred_element_type=jnp.float32) / math.sqrt(dh)
    allowed = jnp.arange(keys.shape[2])[None, None, :] <= positions[:, :, None]  # [B, T, S]
    scores = jnp.where(allowed[None, :, :, None], scores, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores, axis=-1).astype(values.dtype)
    probs = jnp.transpose(probs, (0, 1, 4, 2, 3))  # [KVH, B, S, T, G]
    out = jnp.einsum("kbstg,kbsd->kbtgd", probs, values, preferred_element_type=jnp.float32)
    return jnp.transpose(out, (1, 2, 0, 3, 4)).reshape(bsz, t, h, dh)


class MLP(nnx.Module):
    def __init__(self, cfg: LlamaConfig, dtype: Any, rngs: nnx.Rngs):
        d, f = cfg.hidden_size, cfg.intermediate_size
        self.gate_proj = LoRALinear(d, f, dtype, rngs)
        self.up_proj = LoRALinear(d, f, dtype, rngs)
        self.down_proj = LoRALinear(f, d, dtype, rngs)

    def __call__(self, x, lora, slot_ids, lora_impl):
        get = lambda name: lora.get(name) if lora else None  # noqa: E731
        gate = self.gate_proj(x, get("gate_proj"), slot_ids, lora_impl)
        up = self.up_proj(x, get("up_proj"), slot_ids, lora_impl)
        return self.down_proj(jax.nn.silu(gate) * up, get("down_proj"), slot_ids, lora_impl)


class DecoderLayer(nnx.Module):
    def __init__(self, cfg: LlamaConfig, dtype: Any, rngs: nnx.Rngs):
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.self_attn = Attention(cfg, dtype, rngs)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.mlp = MLP(cfg, dtype, rngs)

    def __call__(self, x, positions, cache, block_tables, lora, slot_ids, inv_freq, span, lora_impl):
        h, cache = self.self_attn(
            self.input_layernorm(x), positions, cache, block_tables, lora, slot_ids, inv_freq, span, lora_impl)
        x = x + h
        x = x + self.mlp(self.post_attention_layernorm(x), lora, slot_ids, lora_impl)
        return x, cache


class Llama(nnx.Module):
    def __init__(self, cfg: LlamaConfig, *, dtype: Any = jnp.float32, rngs: nnx.Rngs | None = None):
        rngs = rngs or nnx.Rngs(0)
        self.cfg = cfg
        self.dtype = dtype
        self.embed_tokens = nnx.Param(
            nnx.initializers.normal(stddev=0.02)(rngs.params(), (cfg.vocab_size, cfg.hidden_size), dtype))
        self.layers = nnx.List([DecoderLayer(cfg, dtype, rngs) for _ in range(cfg.num_hidden_layers)])
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        if not cfg.tie_word_embeddings:
            self.lm_head = nnx.Param(
                nnx.initializers.normal(stddev=0.02)(rngs.params(), (cfg.hidden_size, cfg.vocab_size), dtype))
        self.inv_freq = nnx.Variable(jnp.asarray(rope_inv_freq(cfg)))  # a constant, not a trainable Param

    def __call__(
        self,
        tokens: jax.Array,  # i32[B, T]
        positions: jax.Array,  # i32[B, T], -1 = padding
        cache: KVCache,  # per layer {"k","v": [KVH, NB, bs, Dh]}
        lora_state: LoRAState | None = None,  # module -> {"A": L x [N, in, R], "B": L x [N, R, out]}
        seq_slot_ids: jax.Array | None = None,  # i32[B], -1 = base model
        logits_index: jax.Array | None = None,  # i32[B]: which token of each row to produce logits for
        block_tables: jax.Array | None = None,  # i32[B, span // bs]; None = sequence b owns block b
        *,
        span: int | None = None,
        lora_impl: str = "auto",
    ) -> tuple[jax.Array, KVCache]:  # logits f32[B, V] (or [B, T, V] without logits_index), new cache
        bsz, t = tokens.shape
        if block_tables is not None:
            span = block_tables.shape[1] * cache[0]["k"].shape[2]
        span = span or cache[0]["k"].shape[2]
        if seq_slot_ids is None:
            seq_slot_ids = jnp.full((bsz,), -1, jnp.int32)
        # Padding tokens must never read a real slot.
        slot_ids = jnp.where(positions >= 0, seq_slot_ids[:, None], -1).reshape(bsz * t)
        x = self.embed_tokens[...][tokens]
        new_cache = []
        for i, layer in enumerate(self.layers):
            lora = None
            if lora_state:
                lora = {m: {"A": s["A"][i], "B": s["B"][i]} for m, s in lora_state.items()}
            x, c = layer(x, positions, cache[i], block_tables, lora, slot_ids, self.inv_freq[...], span, lora_impl)
            new_cache.append(c)
        if logits_index is not None:
            x = jnp.take_along_axis(x, logits_index[:, None, None], axis=1)[:, 0]  # [B, D]
        x = self.norm(x)
        head = self.embed_tokens[...].T if self.cfg.tie_word_embeddings else self.lm_head[...]
        logits = jnp.dot(x, head, preferred_element_type=jnp.float32)
        return logits, new_cache


def init_cache(cfg: LlamaConfig, num_blocks: int, block_size: int, dtype: Any = jnp.float32) -> KVCache:
    """Zeroed KV cache, heads first; `init_cache(cfg, batch, max_len)` is one region (block) per sequence."""
    shape = (cfg.num_key_value_heads, num_blocks, block_size, cfg.head_dim)
    return [{"k": jnp.zeros(shape, dtype), "v": jnp.zeros(shape, dtype)} for _ in range(cfg.num_hidden_layers)]


def init_lora_state(
    cfg: LlamaConfig, max_loras: int, max_rank: int, dtype: Any = jnp.float32,
    modules: tuple[str, ...] = LORA_MODULES,
) -> LoRAState:
    """Empty slots: per module {"A": L x [N, in, R], "B": L x [N, R, out]} (tuples over layers).

    Logically A is [L, N, in, R]; it is kept as one array per layer because XLA:CPU copies a
    layer's slice out of a stacked array before each matmul, which measured 5x slower for the
    LoRA part of a decode step (74 ms vs 14 ms, 30 layers x 7 modules, N=4, R=32, T=16).
    """
    shapes = cfg.module_shapes()
    L = cfg.num_hidden_layers
    return {
        m: {"A": tuple(jnp.zeros((max_loras, shapes[m][0], max_rank), dtype) for _ in range(L)),
            "B": tuple(jnp.zeros((max_loras, max_rank, shapes[m][1]), dtype) for _ in range(L))}
        for m in modules
    }
