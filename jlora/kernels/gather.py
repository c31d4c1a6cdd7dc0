"""The textbook baseline: gather each token's adapter, then two batched matvecs. Reference only."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def lora_delta_gather(
    x: jax.Array,  # [T, D]
    a: jax.Array,  # [N, D, R]
    b: jax.Array,  # [N, R, O]
    slot_ids: jax.Array,  # i32[T], -1 = no adapter
) -> jax.Array:  # [T, O]
    valid = slot_ids >= 0
    # Clip before indexing: JAX clamps/wraps out-of-range indices silently, so -1 would read slot N-1.
    safe = jnp.where(valid, slot_ids, 0)
    a_t = a[safe]  # [T, D, R]
    b_t = b[safe]  # [T, R, O]
    h = jnp.einsum("td,tdr->tr", x, a_t, preferred_element_type=jnp.float32)
    y = jnp.einsum("tr,tro->to", h.astype(b.dtype), b_t, preferred_element_type=jnp.float32)
    return jnp.where(valid[:, None], y, 0.0).astype(x.dtype)
