"""The textbook baseline: gather each token's adapter, then two batched matvecs. Reference only.

Every other implementation is tested against this one. It materializes a [T, D, R] and a
[T, R, O] copy of the adapters, so its cost is T * (D + O) * R memory traffic whatever N is.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp

from jlora.kernels.common import expand_splits, validate_lora_args


@partial(jax.jit, static_argnames=("splits",))
def lora_delta_gather(
    x: jax.Array,  # [T, D] f32/bf16
    a: jax.Array,  # [N, D, R]
    b: jax.Array,  # [N, R, O]
    slot_ids: jax.Array,  # i32[T], -1 = no adapter
    *,
    splits: tuple[int, ...] | None = None,  # packed module: a [N, D, S*R], output widths per sub-module
) -> jax.Array:  # [T, O] in x.dtype
    validate_lora_args(x, a, b, slot_ids, splits)
    # Clip before indexing: JAX clamps/wraps out-of-range indices silently, so -1 would read slot N-1.
    # Any id outside [0, N) means "no adapter" (the same rule in every implementation).
    valid = (slot_ids >= 0) & (slot_ids < a.shape[0])
    safe = jnp.where(valid, slot_ids, 0)
    a_t = a[safe]  # [T, D, R]
    b_t = b[safe]  # [T, R, O]
    h = jnp.einsum("td,tdr->tr", x, a_t, preferred_element_type=jnp.float32).astype(b.dtype)
    y = expand_splits(h, b_t, splits, lambda h, b: jnp.einsum("tr,tro->to", h, b, preferred_element_type=jnp.float32))
    return jnp.where(valid[:, None], y, 0.0).astype(x.dtype)
