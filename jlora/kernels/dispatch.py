"""`lora_delta`: validates arguments and picks an implementation per backend and shape."""

from __future__ import annotations

from functools import partial
from typing import Callable

import jax

import jax.numpy as jnp

from jlora.kernels.common import MIX_SLOT, check_choice, validate_lora_args, validate_row_weights
from jlora.kernels.gather import lora_delta_gather
from jlora.kernels.grouped import lora_delta_grouped
from jlora.kernels.laned_dense import lora_delta_laned
from jlora.kernels.pallas import lora_delta_pallas

IMPLS: dict[str, Callable[..., jax.Array]] = {
    "gather": lora_delta_gather,
    "laned": lora_delta_laned,
    "grouped": lora_delta_grouped,
    "pallas": lora_delta_pallas,
}
CHOICES = ("auto", *IMPLS)


# Crossovers on XLA:CPU, from `jlora bench kernels` (docs/kernels.md, f32, 2 cores,
# 126 shapes: T in {8, 16, 64, 512, 2048}, D=O in {576, 2048, 4096}, N in {1, 4, 16, 64},
# R in {8, 16, 64}). Times there are medians of interleaved rounds; the table lists them all.
DECODE_MAX_T = 64  # T above this is "prefill" (measured at 512 and 2048)
LANED_MAX_N = 4  # decode: laned's dense GEMM over all N*R lanes wins up to N=4; at N=16 it
#                  loses to gather and grouped (0.3-0.8x gather at T=8)
GATHER_MIN_SLOTS_PER_TOKEN = 4  # decode with N >= 4T (T=8 or 16, N=64): tokens almost never
#                                 share a slot, gather reads just their adapters; grouped's
#                                 sort + one loop step per token measured 0.5-1.0x gather there
GATHER_MAX_R = 16  # decode at R <= 16 with fewer than 4 tokens per slot (T < 4N): gather
GROUPED_MIN_TOKENS_PER_SLOT = 4  # (small per-token copies; grouped 0.55-2x gather at T <= 16).
#                                  From 4 tokens per slot (T=64, N=16) grouped beat gather 2-6x,
#                                  and at R=64 by 1.1-10x.
PREFILL_LANED_MAX_NR = 512  # prefill: laned up to N*R=512, grouped above.
#   In isolation grouped already wins from N*R=64 (1.3-21x faster than laned at N=16/R>=8 and
#   N=4/R=64). But inside the model every one of the 210 LoRA calls (30 layers x 7 modules)
#   becomes its own loop, and a SmolLM2 prefill graph then took ~40 s to compile instead of
#   ~5 s (B*T=512, N=4, R=32). Up to N*R=512 laned's extra flops cost less than that; beyond
#   it (N=16 at R=64, N=64) grouped's N-independent cost wins. Force impl="grouped" for
#   long-prompt workloads with many slots.


def choose_impl(t: int, d: int, o: int, n: int, r: int, backend: str | None = None) -> str:
    """Implementation for x [T, D], a [N, D, R], b [N, R, O] on `backend` (default: JAX's).

    CPU: the measured crossovers above. TPU and GPU have not been measured; they get laned
    (the dense XLA form vLLM's TPU backend and tpu-inference settled on) while N*R fits a few
    lane tiles, otherwise grouped (ragged_dot) on TPU, and on GPU gather at decode (one
    kernel, where grouped's loop would launch kernels per block) and grouped at prefill.
    `pallas` is never picked automatically until it is measured on the hardware; force it
    with impl="pallas".
    """
    backend = backend or jax.default_backend()
    if backend != "cpu":
        if n * r <= 512:
            return "laned"
        if backend == "tpu":
            return "grouped"  # ragged_dot: a native grouped matmul in XLA:TPU
        return "gather" if t <= DECODE_MAX_T else "grouped"  # no per-block kernel launches at decode
    if t <= DECODE_MAX_T:
        if n <= LANED_MAX_N:
            return "laned"
        if n >= GATHER_MIN_SLOTS_PER_TOKEN * t:
            return "gather"
        if r <= GATHER_MAX_R and t < GROUPED_MIN_TOKENS_PER_SLOT * n:
            return "gather"
        return "grouped"
    return "laned" if n * r <= PREFILL_LANED_MAX_NR else "grouped"


@partial(jax.jit, static_argnames=("impl", "interpret", "splits"))
def lora_delta(
    x: jax.Array,  # [T, D] f32/bf16
    a: jax.Array,  # [N, D, R]
    b: jax.Array,  # [N, R, O]
    slot_ids: jax.Array,  # i32[T], -1 = no adapter
    *,
    impl: str = "auto",  # "auto" | "gather" | "laned" | "grouped" | "pallas"
    interpret: bool | None = None,  # pallas only; None: interpret unless on its target
    splits: tuple[int, ...] | None = None,  # packed module: a [N, D, S*R], output widths per sub-module
    scale: jax.Array | None = None,  # f32[T]: multiplies token t's delta (a request's LoRA scale); None = 1
    mix: jax.Array | None = None,  # f32[T, N]: a token with slot id MIX_SLOT (-2) reads sum_n mix[t, n] * slot n
) -> jax.Array:  # [T, O] in x.dtype
    """Per token t with slot s = slot_ids[t]: x[t] @ a[s] @ b[s], zero where s is outside [0, N).

    `scale` multiplies each token's delta; with `mix`, a token whose id is MIX_SLOT gets
    sum_n mix[t, n] * x[t] @ a[n] @ b[n] (several adapters in one request). "laned" folds both
    into its lane mask (one pass); the others scale x (linear, so the same product) and add the
    MIX_SLOT tokens through a laned pass under a conditional that a batch without them skips.

    A packed module (`splits`, S sub-modules such as q/k/v): a [N, D, S*R] holds each
    sub-module's A side by side and b [N, R, O] each sub-module's B in its own output columns
    (widths `splits`); sub-module s is x @ a[s][:, s*R:(s+1)*R] @ b[s][:, its columns].
    f32 accumulation; the shrink result is cast to b.dtype before the expand; output in x.dtype.
    """
    validate_lora_args(x, a, b, slot_ids, splits)
    validate_row_weights(x, a, scale, mix)
    check_choice("impl", impl, CHOICES)
    if impl == "auto":  # a packed module picks as its sub-modules would (R = b's rank axis)
        impl = choose_impl(x.shape[0], x.shape[1], b.shape[2], a.shape[0], b.shape[1])
    if impl == "laned" and (scale is not None or mix is not None):
        return lora_delta_laned(x, a, b, slot_ids, splits=splits, scale=scale, mix=mix)
    xs = x if scale is None else (x.astype(jnp.float32) * scale.astype(jnp.float32)[:, None]).astype(x.dtype)
    if impl == "pallas":
        y = lora_delta_pallas(xs, a, b, slot_ids, interpret=interpret, splits=splits)
    else:
        y = IMPLS[impl](xs, a, b, slot_ids, splits=splits)
    if mix is None:
        return y
    is_mix = slot_ids == MIX_SLOT
    ids = jnp.where(is_mix, MIX_SLOT, -1).astype(slot_ids.dtype)
    return jax.lax.cond(jnp.any(is_mix), lambda: y + lora_delta_laned(x, a, b, ids, splits=splits, mix=mix), lambda: y)
