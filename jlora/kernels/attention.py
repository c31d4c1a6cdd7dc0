"""Paged attention over a block-table KV cache, beside its plain reference.

The cache holds every layer's keys and values in fixed-size blocks, `k, v: [L, NB, bs, KVH*Dh]`
(each position's heads side by side on the minor axis); sequence b's position p lives in block
`block_tables[b, p // bs]` at offset `p % bs`. The minor axis is KVH*Dh rather than Dh so that on
a TPU one position is one contiguous row of lanes: XLA:TPU tiles the two minor axes (8 or 16 x 128),
so [bs, KVH, Dh] with Dh = 64 either pads Dh to 128 or makes XLA re-layout the whole cache every
step (the four whole-cache copies a v5e profile showed); [bs, KVH*Dh] needs neither, a new token
is one row to write, and a page is one DMA (`jlora.kernels.paged_attention_tpu`). Queries
come as B sequences of Q tokens (`positions[b, q]`, -1 = padding), so one call serves decode
(Q = 1) and a chunk of prefill (Q > 1, causal inside the chunk). Heads are grouped: query head h
reads key head h // (H // KVH).

  * `paged_attention`: walks the keys `chunk` positions at a time up to the furthest query
    position in the call (a loop with a data-dependent trip count and an online softmax), so one
    graph serves every span and a short sequence does not pay for `max_model_len`.
  * `paged_attention_reference`: gathers every block of each sequence, masks, softmaxes. Obvious,
    and it reads all MB * bs positions: the thing the kernel is tested against.

`window` (an int scalar, optional) is a sliding window: a query at position p sees the keys at
positions in (p - window, p] (Mistral, Qwen2's sliding layers); the kernel then skips the chunks
wholly before every query's window.

A cache of dtype uint16 holds bfloat16 bit patterns (how jlora stores bf16 on XLA:CPU, see
`jlora.models.quant`); both functions widen the blocks they read to float32. An int8 cache comes
with `k_scale`, `v_scale` f32[L, NB, KVH, bs] (jlora.kernels.kv_quant): the blocks read are
dequantized as they are gathered, a chunk at a time, never the whole cache. Outputs are float32,
zeros for a padded query.
"""

from __future__ import annotations

import math
from functools import partial

import jax
import jax.numpy as jnp

from jlora.kernels.common import FLOAT_DTYPES
from jlora.kernels.kv_quant import dequantize_kv

CACHE_DTYPES = FLOAT_DTYPES + (jnp.dtype(jnp.uint16), jnp.dtype(jnp.int8))  # uint16 = bf16 bits; int8 + scales


def validate_attention_args(q: jax.Array, cache_k: jax.Array, cache_v: jax.Array, layer: jax.Array,
                            positions: jax.Array, block_tables: jax.Array, chunk: int | None = None,
                            window: jax.Array | None = None, k_scale: jax.Array | None = None,
                            v_scale: jax.Array | None = None) -> None:
    """Raise ValueError unless q [B, Q, H, Dh], cache_k/cache_v [L, NB, bs, KVH*Dh], layer int scalar,
    positions int[B, Q], block_tables int[B, MB] (and `chunk` a positive multiple of bs) fit together,
    and an int8 cache comes with float k_scale/v_scale [L, NB, KVH, bs] (a float cache without)."""
    int8 = hasattr(cache_k, "dtype") and jnp.dtype(cache_k.dtype) == jnp.int8
    if int8 != (k_scale is not None) or (k_scale is None) != (v_scale is None):
        raise ValueError(f"an int8 cache needs k_scale and v_scale, a float cache neither (cache_k "
                         f"{getattr(cache_k, 'dtype', None)}, k_scale {'given' if k_scale is not None else 'None'}, "
                         f"v_scale {'given' if v_scale is not None else 'None'})")
    if int8 and hasattr(q, "shape") and len(getattr(cache_k, "shape", ())) == 4 and q.ndim == 4:
        L, nb, bs, kd = cache_k.shape
        want = (L, nb, kd // q.shape[3], bs)
        for name, sc in (("k_scale", k_scale), ("v_scale", v_scale)):
            if getattr(sc, "shape", None) != want or jnp.dtype(sc.dtype) not in FLOAT_DTYPES:
                raise ValueError(f"{name} must be float [L, NB, KVH, bs] = {list(want)} for cache_k "
                                 f"{tuple(cache_k.shape)}, got {getattr(sc, 'dtype', None)}"
                                 f"{tuple(getattr(sc, 'shape', ()))}")
    for name, arr, want in (("q", q, "[B, Q, H, Dh]"), ("cache_k", cache_k, "[L, NB, bs, KVH*Dh]"),
                            ("cache_v", cache_v, "[L, NB, bs, KVH*Dh]"), ("positions", positions, "[B, Q]"),
                            ("block_tables", block_tables, "[B, MB]"), ("layer", layer, "[]")):
        if not hasattr(arr, "shape") or not hasattr(arr, "dtype"):
            raise ValueError(f"{name} must be an array {want}, got {type(arr).__name__}")
        rank = 0 if want == "[]" else len(want.split(","))
        if arr.ndim != rank:
            raise ValueError(f"{name} must be {want}, got shape {tuple(arr.shape)}")
        if 0 in arr.shape:
            raise ValueError(f"{name} must have no zero-sized dimension, got shape {tuple(arr.shape)}")
    if jnp.dtype(q.dtype) not in FLOAT_DTYPES:
        raise ValueError(f"q must be float32, bfloat16 or float16, got {q.dtype} (shape {q.shape})")
    for name, arr in (("cache_k", cache_k), ("cache_v", cache_v)):
        if jnp.dtype(arr.dtype) not in CACHE_DTYPES:
            raise ValueError(f"{name} must be float32, bfloat16, float16, uint16 (bf16 bits) or int8 (with scales), "
                             f"got {arr.dtype}")
    if cache_v.shape != cache_k.shape or cache_v.dtype != cache_k.dtype:
        raise ValueError(f"cache_v {cache_v.dtype}{tuple(cache_v.shape)} must match cache_k "
                         f"{cache_k.dtype}{tuple(cache_k.shape)}")
    bsz, nq, h, dh = q.shape
    if cache_k.shape[3] % dh:
        raise ValueError(f"cache_k [L, NB, bs, KVH*Dh] has KVH*Dh={cache_k.shape[3]}, not a multiple of "
                         f"q [B, Q, H, Dh]'s Dh={dh}")
    kvh = cache_k.shape[3] // dh
    if h % kvh:
        raise ValueError(f"q has H={h} heads, not a multiple of cache_k's KVH={kvh} key heads")
    if positions.shape != (bsz, nq):
        raise ValueError(f"positions must be int32[B, Q] = [{bsz}, {nq}] (q {tuple(q.shape)}), "
                         f"got shape {tuple(positions.shape)}")
    if block_tables.shape[0] != bsz:
        raise ValueError(f"block_tables must be int32[B, MB] with B={bsz} (q {tuple(q.shape)}), "
                         f"got shape {tuple(block_tables.shape)}")
    for name, arr in (("positions", positions), ("block_tables", block_tables), ("layer", layer)):
        if not jnp.issubdtype(arr.dtype, jnp.integer):
            raise ValueError(f"{name} must be an integer array (int32), got {arr.dtype}")
    if window is not None and (not hasattr(window, "dtype") or jnp.ndim(window) != 0
                               or not jnp.issubdtype(window.dtype, jnp.integer)):
        raise ValueError(f"window must be None or an integer scalar array, got {window!r}")
    bs = cache_k.shape[2]
    if chunk is not None and (not isinstance(chunk, int) or isinstance(chunk, bool) or chunk <= 0 or chunk % bs):
        raise ValueError(f"chunk must be a positive multiple of the block size {bs}, got {chunk!r}")


def _widen(x: jax.Array, scale: jax.Array | None = None) -> jax.Array:
    """Cache blocks [..., bs, KVH*Dh] -> f32 (uint16 holds bf16 bits; int8 times its blocks' scales
    [..., KVH, bs])."""
    if x.dtype == jnp.uint16:
        x = jax.lax.bitcast_convert_type(x, jnp.bfloat16)
    if scale is None:
        return x.astype(jnp.float32)
    return dequantize_kv(x, jnp.swapaxes(scale, -1, -2))


def _grouped_queries(q: jax.Array, kvh: int) -> jax.Array:  # [B, Q, H, Dh] -> f32[B, Q, KVH, G, Dh], scaled
    bsz, nq, h, dh = q.shape
    return q.reshape(bsz, nq, kvh, h // kvh, dh).astype(jnp.float32) / math.sqrt(dh)


def _heads_out(out: jax.Array) -> jax.Array:  # f32[B, KVH, G, Q, Dh] -> f32[B, Q, H, Dh]
    bsz, kvh, g, nq, dh = out.shape
    return jnp.transpose(out, (0, 3, 1, 2, 4)).reshape(bsz, nq, kvh * g, dh)


@partial(jax.jit, static_argnames=("chunk",))
def paged_attention(
    q: jax.Array,  # [B, Q, H, Dh]
    cache_k: jax.Array,  # [L, NB, bs, KVH*Dh]
    cache_v: jax.Array,  # [L, NB, bs, KVH*Dh]
    layer: jax.Array,  # i32 scalar: which layer of the cache
    positions: jax.Array,  # i32[B, Q], -1 = padding
    block_tables: jax.Array,  # i32[B, MB]: the blocks holding each sequence's positions, in order
    window: jax.Array | None = None,  # i32 scalar sliding window; None = full causal
    *,
    chunk: int,  # key positions per loop iteration, a multiple of bs
    k_scale: jax.Array | None = None,  # f32[L, NB, KVH, bs]: an int8 cache's scales
    v_scale: jax.Array | None = None,  # f32[L, NB, KVH, bs]
) -> jax.Array:  # f32[B, Q, H, Dh]
    """Causal grouped-query attention over each sequence's cached keys, `chunk` positions at a time.

    The loop runs to the furthest query position in the call (data-dependent trip count, so one
    graph serves every span) with an online softmax; a fully padded row returns zeros. With a
    window it starts at the first chunk any query can see.
    """
    validate_attention_args(q, cache_k, cache_v, layer, positions, block_tables, chunk, window, k_scale, v_scale)
    bsz, nq, h, dh = q.shape
    bs, kvh = cache_k.shape[2], cache_k.shape[3] // dh
    per_chunk = chunk // bs
    qg = _grouped_queries(q, kvh)
    n_chunks = (jnp.max(positions) + chunk) // chunk  # 0 when every query is padding
    first_chunk = 0
    if window is not None:  # keys below the lowest query's window are never visible
        lowest = jnp.min(jnp.where(positions >= 0, positions, jnp.iinfo(jnp.int32).max))
        first_chunk = jnp.minimum(jnp.maximum(lowest - window + 1, 0) // chunk, n_chunks)

    def body(j, carry):
        m, l, acc = carry  # running max, denominator [B, KVH, G, Q]; numerator [B, KVH, G, Q, Dh]
        cols = jnp.minimum(j * per_chunk + jnp.arange(per_chunk), block_tables.shape[1] - 1)
        blocks = block_tables[:, cols]  # [B, per_chunk]
        ks = None if k_scale is None else k_scale[layer, blocks]  # [B, per_chunk, KVH, bs]
        vs = None if v_scale is None else v_scale[layer, blocks]
        keys = _widen(cache_k[layer, blocks], ks).reshape(bsz, chunk, kvh, dh)
        values = _widen(cache_v[layer, blocks], vs).reshape(bsz, chunk, kvh, dh)
        s = jnp.einsum("bqkgd,bckd->bkgqc", qg, keys, preferred_element_type=jnp.float32)
        key_pos = j * chunk + jnp.arange(chunk)
        visible = key_pos[None, None, :] <= positions[:, :, None]  # [B, Q, C]
        if window is not None:
            visible &= key_pos[None, None, :] > positions[:, :, None] - window
        s = jnp.where(visible[:, None, None], s, -jnp.inf)
        m_new = jnp.maximum(m, s.max(-1))
        m_safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
        p = jnp.exp(s - m_safe[..., None])
        scale = jnp.exp(m - m_safe)
        l = l * scale + p.sum(-1)
        acc = acc * scale[..., None] + jnp.einsum("bkgqc,bckd->bkgqd", p, values)
        return m_new, l, acc

    shape = (bsz, kvh, h // kvh, nq)
    init = (jnp.full(shape, -jnp.inf, jnp.float32), jnp.zeros(shape, jnp.float32),
            jnp.zeros(shape + (dh,), jnp.float32))
    _, l, acc = jax.lax.fori_loop(first_chunk, n_chunks, body, init)
    return _heads_out(acc / jnp.where(l > 0, l, 1.0)[..., None])


@jax.jit
def paged_attention_reference(
    q: jax.Array,  # [B, Q, H, Dh]
    cache_k: jax.Array,  # [L, NB, bs, KVH*Dh]
    cache_v: jax.Array,  # [L, NB, bs, KVH*Dh]
    layer: jax.Array,  # i32 scalar
    positions: jax.Array,  # i32[B, Q], -1 = padding
    block_tables: jax.Array,  # i32[B, MB]
    window: jax.Array | None = None,  # i32 scalar sliding window; None = full causal
    k_scale: jax.Array | None = None,  # f32[L, NB, KVH, bs]: an int8 cache's scales
    v_scale: jax.Array | None = None,  # f32[L, NB, KVH, bs]
) -> jax.Array:  # f32[B, Q, H, Dh]
    """`paged_attention` the obvious way: gather all MB blocks of each sequence (dequantized, for an
    int8 cache), mask, softmax."""
    validate_attention_args(q, cache_k, cache_v, layer, positions, block_tables, window=window,
                            k_scale=k_scale, v_scale=v_scale)
    bsz, nq, h, dh = q.shape
    bs, kvh = cache_k.shape[2], cache_k.shape[3] // dh
    span = block_tables.shape[1] * bs
    ks = None if k_scale is None else k_scale[layer][block_tables]  # [B, MB, KVH, bs]
    vs = None if v_scale is None else v_scale[layer][block_tables]
    keys = _widen(cache_k[layer][block_tables], ks).reshape(bsz, span, kvh, dh)  # [B, S, KVH, Dh]
    values = _widen(cache_v[layer][block_tables], vs).reshape(bsz, span, kvh, dh)
    s = jnp.einsum("bqkgd,bskd->bkgqs", _grouped_queries(q, kvh), keys)
    key_pos = jnp.arange(span)[None, None, :]
    visible = key_pos <= positions[:, :, None]  # [B, Q, S]; a padded row sees nothing
    if window is not None:
        visible &= key_pos > positions[:, :, None] - window
    p = jax.nn.softmax(jnp.where(visible[:, None, None], s, -jnp.inf), axis=-1)
    p = jnp.where(visible[:, None, None], p, 0.0)  # a row that sees nothing is NaN above: zeros here
    return _heads_out(jnp.einsum("bkgqs,bskd->bkgqd", p, values))


def causal_attention(
    q: jax.Array,  # [B, T, H, Dh]
    k: jax.Array,  # [B, T, KVH, Dh]
    v: jax.Array,  # [B, T, KVH, Dh]
    window: jax.Array | None = None,  # i32 scalar sliding window; None = full
) -> jax.Array:  # f32[B, T, H, Dh]
    """Dense causal grouped-query attention within each row (the training forward's; the
    serving step reads the paged cache instead)."""
    bsz, t, h, dh = q.shape
    kvh = k.shape[2]
    qg = q.reshape(bsz, t, kvh, h // kvh, dh).astype(jnp.float32) / math.sqrt(dh)
    s = jnp.einsum("bqkgd,bckd->bkgqc", qg, k.astype(jnp.float32))
    pos = jnp.arange(t)
    visible = pos[None, :] <= pos[:, None]  # [Q, C]
    if window is not None:
        visible &= pos[None, :] > pos[:, None] - window
    p = jax.nn.softmax(jnp.where(visible, s, -jnp.inf), axis=-1)
    out = jnp.einsum("bkgqc,bckd->bqkgd", p, v.astype(jnp.float32))
    return out.reshape(bsz, t, h, dh)
