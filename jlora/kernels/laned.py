"""Dense XLA laning: all N slots packed side by side along the lane axis.

One matmul [T, D] @ [D, N*R] computes every slot's shrink for every token, a mask keeps each
token's own R lanes, one matmul [T, N*R] @ [N*R, O] expands. No gather; cost grows with N*R, so
it wins while N*R is small (decode, few slots).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def lora_delta_laned(
    x: jax.Array,  # [T, D]
    a: jax.Array,  # [N, D, R]
    b: jax.Array,  # [N, R, O]
    slot_ids: jax.Array,  # i32[T], -1 = no adapter
) -> jax.Array:  # [T, O]
    n, _, r = a.shape
    h = jnp.einsum("td,ndr->tnr", x, a, preferred_element_type=jnp.float32)  # [T, N, R]
    # -1 matches no slot, so its row of the mask is all zeros: padding never reads a real slot.
    keep = slot_ids[:, None] == jnp.arange(n, dtype=slot_ids.dtype)[None, :]  # [T, N]
    h = jnp.where(keep[:, :, None], h, 0.0).astype(b.dtype)
    y = jnp.einsum("tnr,nro->to", h, b, preferred_element_type=jnp.float32)
    return y.astype(x.dtype)
