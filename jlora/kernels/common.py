"""Argument checks and small helpers shared by every implementation.

Every public kernel entry point calls `validate_lora_args` at trace time, so a bad call fails
with a ValueError that names the argument and its shape before anything is lowered.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

FLOAT_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
# A token whose slot id is MIX_SLOT reads a weighted sum of slots, its row of `mix` f32[T, N]
# (several adapters in one request); without `mix` it is one more id outside [0, N): no adapter.
MIX_SLOT = -2


def validate_lora_args(x: jax.Array, a: jax.Array, b: jax.Array, slot_ids: jax.Array,
                       splits: tuple[int, ...] | None = None) -> None:
    """Raise ValueError unless x [T, D], a [N, D, R], b [N, R, O], slot_ids int[T] fit together.

    With `splits` (a packed module, see `expand_splits`), a is [N, D, S*R] for S = len(splits)
    and the splits are output widths adding up to O (or to O / shards, columns shard-major)."""
    for name, arr, want in (("x", x, "[T, D]"), ("a", a, "[N, D, R]"), ("b", b, "[N, R, O]"), ("slot_ids", slot_ids, "[T]")):
        if not hasattr(arr, "shape") or not hasattr(arr, "dtype"):
            raise ValueError(f"{name} must be an array {want}, got {type(arr).__name__}")
        if arr.ndim != len(want.split(",")):
            raise ValueError(f"{name} must be {want}, got shape {tuple(arr.shape)}")
        if 0 in arr.shape:
            raise ValueError(f"{name} must have no zero-sized dimension, got shape {tuple(arr.shape)}")
    if a.shape[1] != x.shape[1]:
        raise ValueError(f"a [N, D, R] has D={a.shape[1]} but x [T, D] has D={x.shape[1]} (a {a.shape}, x {x.shape})")
    if b.shape[0] != a.shape[0]:
        raise ValueError(f"b [N, R, O] has N={b.shape[0]} but a [N, D, R] has N={a.shape[0]} (a {a.shape}, b {b.shape})")
    if splits is not None:
        check_splits(splits, a, b)
    elif b.shape[1] != a.shape[2]:
        raise ValueError(f"b [N, R, O] has R={b.shape[1]} but a [N, D, R] has R={a.shape[2]} (a {a.shape}, b {b.shape})")
    if slot_ids.shape != (x.shape[0],):
        raise ValueError(f"slot_ids must be int32[T] with T={x.shape[0]} (x {x.shape}), got shape {slot_ids.shape}")
    if not jnp.issubdtype(slot_ids.dtype, jnp.integer):
        raise ValueError(f"slot_ids must be an integer array (int32), got {slot_ids.dtype}")
    for name, arr in (("x", x), ("a", a), ("b", b)):
        if jnp.dtype(arr.dtype) not in FLOAT_DTYPES:
            raise ValueError(f"{name} must be float32, bfloat16 or float16, got {arr.dtype} (shape {arr.shape})")


def validate_row_weights(x: jax.Array, a: jax.Array, scale: jax.Array | None, mix: jax.Array | None) -> None:
    """Raise ValueError unless scale is f32[T] and mix is f32[T, N] (either may be None)."""
    t, n = x.shape[0], a.shape[0]
    for name, arr, want in (("scale", scale, (t,)), ("mix", mix, (t, n))):
        if arr is None:
            continue
        if not hasattr(arr, "shape") or tuple(arr.shape) != want:
            raise ValueError(f"{name} must be float32{list(want)} (T={t} tokens of x {tuple(x.shape)}, N={n} slots "
                             f"of a {tuple(a.shape)}), got {getattr(arr, 'shape', type(arr).__name__)}")
        if not jnp.issubdtype(arr.dtype, jnp.floating):
            raise ValueError(f"{name} must be a float array (float32), got {arr.dtype}")


def row_weights(
    slot_ids: jax.Array,  # i32[T]
    n: int,
    scale: jax.Array | None,  # f32[T]: a token's delta from its own slot is multiplied by it; None = 1
    mix: jax.Array | None,  # f32[T, N]: a MIX_SLOT token's weight of each slot; None = no MIX_SLOT tokens
) -> jax.Array:  # f32[T, N]: how much of each slot's delta each token takes
    """The per-token weights over slots: scale[t] at slot_ids[t] (ids in [0, N)), the row of mix
    for MIX_SLOT tokens, zero elsewhere (padding and -1 read nothing)."""
    keep = slot_ids[:, None] == jnp.arange(n, dtype=slot_ids.dtype)[None, :]
    w = jnp.where(keep, jnp.float32(1) if scale is None else scale.astype(jnp.float32)[:, None], 0.0)
    if mix is not None:
        w = jnp.where((slot_ids == MIX_SLOT)[:, None], mix.astype(jnp.float32), w)
    return w


def check_splits(splits: tuple[int, ...], a: jax.Array, b: jax.Array) -> None:
    if not isinstance(splits, tuple) or not splits or not all(
            isinstance(w, int) and not isinstance(w, bool) and w > 0 for w in splits):
        raise ValueError(f"splits must be a non-empty tuple of positive ints (output widths), got {splits!r}")
    if b.shape[2] % sum(splits):
        raise ValueError(f"splits {splits} add up to {sum(splits)}, which does not divide b [N, R, O]'s "
                         f"O={b.shape[2]} (b {b.shape})")
    if a.shape[2] != len(splits) * b.shape[1]:
        raise ValueError(f"a [N, D, S*R] has {a.shape[2]} lanes but {len(splits)} splits of b's R={b.shape[1]} "
                         f"need {len(splits) * b.shape[1]} (a {a.shape}, b {b.shape})")


def expand_splits(
    h: jax.Array,  # [..., S*R]: the shrink of a packed module, sub-module s in lanes [s*R, (s+1)*R)
    b: jax.Array,  # [..., R, O]: per shard, sub-module s owns columns [sum(splits[:s]), sum(splits[:s+1]))
    splits: tuple[int, ...] | None,
    expand,  # (h_s [..., R], b_s [..., R, O_s]) -> [..., O_s]
) -> jax.Array:
    """The expand of a packed module (vLLM's packed modules: q/k/v or gate/up as one LoRA call).

    A packed module's adapters keep each sub-module's A side by side, so the shrink is one matmul
    to S*R lanes; each sub-module's R lanes then expand into its own output columns only (no
    block-diagonal zeros in B). `splits=None` is one module: `expand(h, b)`.

    Under tensor parallelism the columns are shard-major (`jlora.models.tensor_parallel`): O =
    shards * sum(splits), each shard's block holding its part of every sub-module. The slicing
    is then along a per-shard axis, so a sharded B is never gathered (shards = 1: the plain case)."""
    if splits is None:
        return expand(h, b)
    r, per_shard = b.shape[-2], sum(splits)
    shards = b.shape[-1] // per_shard
    blocks = b.reshape(*b.shape[:-1], shards, per_shard)
    outs, start = [], 0
    for s, w in enumerate(splits):
        y = expand(h[..., s * r:(s + 1) * r], blocks[..., start:start + w].reshape(*b.shape[:-1], shards * w))
        outs.append(y.reshape(*y.shape[:-1], shards, w))
        start += w
    y = jnp.concatenate(outs, axis=-1) if len(outs) > 1 else outs[0]
    return y.reshape(*y.shape[:-2], shards * per_shard)


def check_choice(name: str, value: object, choices: tuple) -> None:
    if value not in choices:
        raise ValueError(f"{name} must be one of {choices}, got {value!r}")


def check_block(name: str, value: int | None, *, power_of_two: bool = False, multiple_of: int = 1) -> None:
    """None means "from the table"; otherwise a positive int (optionally a power of two / multiple)."""
    if value is None:
        return
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"{name} must be a positive int or None, got {value!r}")
    if power_of_two and value & (value - 1):
        raise ValueError(f"{name} must be a power of two, got {value}")
    if value % multiple_of:
        raise ValueError(f"{name} must be a multiple of {multiple_of}, got {value}")


def round_up(v: int, m: int) -> int:
    return -(-v // m) * m


def pow2_floor(v: int) -> int:
    return 1 << (max(1, v).bit_length() - 1)


def pow2_ceil(v: int) -> int:
    return 1 << (max(1, v) - 1).bit_length()


def pad_axis(arr: jax.Array, axis: int, size: int, value=0) -> jax.Array:
    """Pad `arr` with `value` along `axis` up to `size` (no-op when already that size)."""
    extra = size - arr.shape[axis]
    if extra == 0:
        return arr
    widths = [(0, 0)] * arr.ndim
    widths[axis] = (0, extra)
    return jnp.pad(arr, widths, constant_values=value)
