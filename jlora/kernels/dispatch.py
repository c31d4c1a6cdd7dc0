"""`lora_delta`: validates arguments and picks an implementation."""

from __future__ import annotations

from functools import partial
from typing import Callable

import jax
import jax.numpy as jnp

from jlora.kernels.gather import lora_delta_gather
from jlora.kernels.laned import lora_delta_laned

IMPLS: dict[str, Callable[..., jax.Array]] = {
    "gather": lora_delta_gather,
    "laned": lora_delta_laned,
}


def validate_lora_args(x: jax.Array, a: jax.Array, b: jax.Array, slot_ids: jax.Array) -> None:
    if x.ndim != 2:
        raise ValueError(f"x must be [T, D], got shape {x.shape}")
    if a.ndim != 3:
        raise ValueError(f"a must be [N, D, R], got shape {a.shape}")
    if b.ndim != 3:
        raise ValueError(f"b must be [N, R, O], got shape {b.shape}")
    if a.shape[1] != x.shape[1]:
        raise ValueError(f"a's D={a.shape[1]} does not match x's D={x.shape[1]} (a {a.shape}, x {x.shape})")
    if a.shape[0] != b.shape[0] or a.shape[2] != b.shape[1]:
        raise ValueError(f"a {a.shape} and b {b.shape} disagree on N or R")
    if slot_ids.shape != (x.shape[0],):
        raise ValueError(f"slot_ids must be i32[T] with T={x.shape[0]}, got shape {slot_ids.shape}")
    if not jnp.issubdtype(slot_ids.dtype, jnp.integer):
        raise ValueError(f"slot_ids must be an integer array, got {slot_ids.dtype}")
    for name, arr in (("x", x), ("a", a), ("b", b)):
        if arr.dtype not in (jnp.float32, jnp.bfloat16, jnp.float16):
            raise ValueError(f"{name} must be float32, bfloat16 or float16, got {arr.dtype}")


def choose_impl(t: int, d: int, o: int, n: int, r: int, backend: str | None = None) -> str:
    """Implementation for a shape; `laned` until measurements say otherwise."""
    return "laned"


@partial(jax.jit, static_argnames=("impl",))
def lora_delta(
    x: jax.Array,  # [T, D]
    a: jax.Array,  # [N, D, R]
    b: jax.Array,  # [N, R, O]
    slot_ids: jax.Array,  # i32[T], -1 = no adapter
    *,
    impl: str = "auto",
) -> jax.Array:  # [T, O]
    validate_lora_args(x, a, b, slot_ids)
    if impl == "auto":
        impl = choose_impl(x.shape[0], x.shape[1], b.shape[2], a.shape[0], a.shape[2])
    if impl not in IMPLS:
        raise ValueError(f"impl must be 'auto' or one of {sorted(IMPLS)}, got {impl!r}")
    return IMPLS[impl](x, a, b, slot_ids)
