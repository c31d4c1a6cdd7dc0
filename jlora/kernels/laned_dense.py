"""Dense XLA laning: all N slots side by side along the lane axis, no gather.

One matmul x [T, D] @ a [D, N*R] computes every slot's shrink for every token, a one-hot mask
keeps each token's own R lanes, one matmul [T, N*R] @ b [N*R, O] expands. Cost grows with N*R,
so it wins while N*R is small. This is the form vLLM's TPU backend and tpu-inference ended up
with (an einsum XLA can fuse with its neighbours).

Two shrink formulations, picked statically by T (measured on XLA:CPU):
  * T > 64: einsum "td,ndr->tnr". XLA relayouts a to [D, N*R] (one copy of a) and runs one GEMM.
  * T <= 64: one batched matmul per slot, x broadcast over N, which reads a in place. At decode
    the op is bound by reading a, and the relayout copy would triple that traffic.
The crossover comes from a model-shaped stream (30 layers x 7 modules of distinct adapters,
N=4, R=32, so nothing stays in cache): batched/einsum = 8.9/34.0 ms at T=4, 10.5/43.7 at T=16,
31.8/54.9 at T=64, 204/187 at T=512. An isolated kernel benchmark, which re-reads one cached
`a`, puts the crossover lower (T=8) and misses the relayout's memory traffic.
"""

from __future__ import annotations

import itertools
from functools import partial

import jax
import jax.numpy as jnp

from jlora.kernels.common import expand_splits, validate_lora_args

BATCHED_SHRINK_MAX_T = 64  # crossover measured in a model-shaped stream on XLA:CPU (see above)


@partial(jax.jit, static_argnames=("splits", "block_expand"))
def lora_delta_laned(
    x: jax.Array,  # [T, D] f32/bf16
    a: jax.Array,  # [N, D, R]
    b: jax.Array,  # [N, R, O]
    slot_ids: jax.Array,  # i32[T], -1 = no adapter
    *,
    splits: tuple[int, ...] | None = None,  # packed module: a [N, D, S*R], output widths per sub-module
    block_expand: bool | None = None,  # T > 64 with splits: one block-diagonal expand (None: on a TPU)
) -> jax.Array:  # [T, O] in x.dtype
    validate_lora_args(x, a, b, slot_ids, splits)
    t, n = x.shape[0], a.shape[0]
    slots = jnp.arange(n, dtype=slot_ids.dtype)
    # An id outside [0, N) (-1, padding) matches no slot: its mask row is all zeros, so it never
    # reads a real slot.
    if t <= BATCHED_SHRINK_MAX_T:
        xb = jnp.broadcast_to(x[None], (n, *x.shape))  # [N, T, D]
        h = jax.lax.dot_general(xb, a, (((2,), (1,)), ((0,), (0,))), preferred_element_type=jnp.float32)
        keep = slot_ids[None, :] == slots[:, None]  # [N, T]
        h = jnp.where(keep[:, :, None], h, 0.0).astype(b.dtype)  # [N, T, R] (S*R lanes when packed)
        y = expand_splits(h, b, splits, lambda h, b: jnp.einsum("ntr,nro->to", h, b,
                                                                preferred_element_type=jnp.float32))
    else:
        h = jnp.einsum("td,ndr->tnr", x, a, preferred_element_type=jnp.float32)  # [T, N, R]
        keep = slot_ids[:, None] == slots[None, :]  # [T, N]
        h = jnp.where(keep[:, :, None], h, 0.0).astype(b.dtype)
        if block_expand is None:
            block_expand = jax.default_backend() == "tpu"
        if splits is not None and block_expand:
            y = jnp.einsum("tnk,nko->to", h, block_diagonal(b, splits), preferred_element_type=jnp.float32)
        else:
            y = expand_splits(h, b, splits, lambda h, b: jnp.einsum("tnr,nro->to", h, b,
                                                                    preferred_element_type=jnp.float32))
    return y.astype(x.dtype)


def block_diagonal(
    b: jax.Array,  # [N, R, O]: sub-module s owns its columns of each shard's block (expand_splits)
    splits: tuple[int, ...],
) -> jax.Array:  # [N, S*R, O]: rows s*R..(s+1)*R keep sub-module s's columns, zeros elsewhere
    """A packed module's B as one block-diagonal matrix, so its expand is one matmul over S*R
    lanes (S times the MXU work of the split expand, which at R <= 64 is still small) whose
    [T, O] result XLA can add to the base projection's output in one pass. The split expand
    writes S slices and concatenates them, [T, O] more than once: on a v5e chip 168 us a
    layer for gate_up at a 1,088-token step (2026-12-06)."""
    per_shard = sum(splits)
    col = jnp.arange(b.shape[-1]) % per_shard  # a column's place in its shard's block
    bounds = [0, *itertools.accumulate(splits)]
    rows = [jnp.where((col >= bounds[s]) & (col < bounds[s + 1]), b, jnp.zeros((), b.dtype))
            for s in range(len(splits))]
    return jnp.concatenate(rows, axis=-2)
