"""int8 KV cache: symmetric absmax quantization per token and KV head.

`LLM(kv_cache_dtype="int8")` keeps keys and values as int8 `[L, NB, bs, KVH*Dh]` (one byte an
element instead of the model dtype's two or four) beside float32 scales `[L, NB, KVH, bs]`: one a
position and KV head, written with the values (`quantize_kv`) and read with them by both attention
paths (`jlora.kernels.attention.paged_attention` on the chunk it gathers,
`jlora.kernels.paged_attention_tpu` in VMEM), never dequantized cache-wide. The scales sit per
block like the values, so a prefix-cached block shared between requests carries its own.

Why [KVH, bs] and not [bs, KVH]: a TPU tiles an array's two minor axes (8 x 128 for float32);
[bs, KVH] would pad KVH (3 for SmolLM2) to 128 lanes, 512 bytes of scale a position against 256
of int8 keys, while [KVH, bs] pads KVH to 8 sublanes (32 bytes a position), what
`jlora.engine.kv_plan` counts.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

QMAX = 127.0
SCALE_DTYPE = jnp.float32
SCALE_SUBLANES = 8  # a TPU stores a float32 [KVH, bs] page in tiles of 8 rows (kv_plan's count)


def quantize_kv(x: jax.Array,  # [T, KVH, Dh]
                ) -> tuple[jax.Array, jax.Array]:  # int8[T, KVH*Dh], f32[T, KVH]
    """Each token's each head as round(x / s) with s = max|x| / 127 (0 for an all-zero head,
    which then quantizes to zeros)."""
    xf = x.astype(jnp.float32)
    scale = jnp.max(jnp.abs(xf), axis=-1) / QMAX  # [T, KVH]
    q = jnp.round(xf / jnp.where(scale > 0, scale, 1.0)[..., None])
    q = jnp.clip(q, -QMAX, QMAX).astype(jnp.int8)
    return q.reshape(x.shape[0], -1), scale.astype(SCALE_DTYPE)


def dequantize_kv(q: jax.Array,  # int8[..., KVH*Dh]
                  scale: jax.Array,  # f32[..., KVH]
                  ) -> jax.Array:  # f32[..., KVH*Dh]
    kvh = scale.shape[-1]
    x = q.astype(jnp.float32).reshape(*q.shape[:-1], kvh, q.shape[-1] // kvh)
    return (x * scale[..., None].astype(jnp.float32)).reshape(q.shape)


def is_int8_cache(cache: dict) -> bool:
    return "k_scale" in cache
