"""Grouped LoRA: tokens sorted by slot, each adapter applied only to its own tokens.

Cost is about T * (D + O) * R (one adapter's worth of work per token) plus one read of each
*used* adapter, independent of N. Two methods share the sort:

  * "blocks": the sorted tokens of each slot are cut into blocks (big ones, and small ones for
    remainders when that is cheaper); a loop runs over the blocks actually present (dynamic
    trip count, static shapes), multiplies the block's rows by that block's adapter (fetched
    once per block, not per token) and writes them back in place; one gather unsorts at the
    end. Fast on XLA:CPU; block sizes come from `tiles.grouped_plan`.
  * "ragged": `jax.lax.ragged_dot` for shrink and expand over the sorted tokens, then a gather
    back into token order. XLA:TPU lowers ragged_dot to a grouped matmul; XLA:CPU expands it to
    a dense masked matmul per group (cost ~N): 2-20x slower than laned there (docs/kernels.md).

`method="auto"` picks "ragged" on TPU and "blocks" elsewhere.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp

from jlora.kernels.common import check_block, check_choice, expand_splits, validate_lora_args
from jlora.kernels.tiles import GroupedPlan, grouped_plan

METHODS = ("auto", "blocks", "ragged")


COUNTING_SORT_MAX = 1 << 20  # T * (N + 1) up to this: counting sort (measured faster than argsort)


def _sort_by_slot(slot_ids: jax.Array, n: int):
    """Stable sort of tokens by slot, invalid ids (outside [0, N)) last.

    Returns order i32[T] (sorted position -> token), rank i32[T] (token -> sorted position)
    and counts i32[N] (tokens per slot).
    """
    t = slot_ids.shape[0]
    valid = (slot_ids >= 0) & (slot_ids < n)
    key = jnp.where(valid, slot_ids, n).astype(jnp.int32)
    iota = jnp.arange(t, dtype=jnp.int32)
    if t * (n + 1) <= COUNTING_SORT_MAX:
        onehot = (key[:, None] == jnp.arange(n + 1, dtype=jnp.int32)[None, :]).astype(jnp.int32)  # [T, N+1]
        counts = onehot.sum(axis=0)
        before = jnp.sum((jnp.cumsum(onehot, axis=0) - onehot) * onehot, axis=1)  # same-slot tokens before t
        rank = (jnp.cumsum(counts) - counts)[key] + before
        order = jnp.zeros((t,), jnp.int32).at[rank].set(iota)
    else:
        order = jnp.argsort(key, stable=True).astype(jnp.int32)
        rank = jnp.zeros((t,), jnp.int32).at[order].set(iota)
        counts = jnp.zeros((n + 1,), jnp.int32).at[key].add(1)
    return order, rank, counts[:n]


def _block_pass(xs, a, b, ys, first, n_blocks, block_t: int, splits=None):
    """One loop over blocks of `block_t` sorted rows, block k using the slot first(k) names.

    xs [T, D] sorted tokens, ys [T, O] sorted output, updated with dynamic_update_slice (in
    place in the loop carry). first(k) -> (slot, first row, live rows). A block that would run
    past row T is shifted back to end at T, and only its live rows are written; every other
    row keeps what ys holds, so blocks and passes may overlap in any order. (No padding: a
    padded copy of x made inside the jit measured ~3x slower to slice in the loop on XLA:CPU.)
    """
    t = xs.shape[0]
    lane = jnp.arange(block_t, dtype=jnp.int32)[:, None]

    def body(k, ys):
        g, start, live = first(k)
        s0 = jnp.minimum(start, t - block_t)
        rows = jax.lax.dynamic_slice_in_dim(xs, s0, block_t)  # [bt, D]
        h = jnp.dot(rows, a[g], preferred_element_type=jnp.float32).astype(b.dtype)  # [bt, R]
        y = expand_splits(h, b[g], splits, lambda h, b: jnp.dot(h, b, preferred_element_type=jnp.float32))
        y = y.astype(ys.dtype)  # [bt, O]
        keep = (lane >= start - s0) & (lane < start - s0 + live)
        y = jnp.where(keep, y, jax.lax.dynamic_slice_in_dim(ys, s0, block_t))
        return jax.lax.dynamic_update_slice_in_dim(ys, y, s0, 0)

    return jax.lax.fori_loop(0, n_blocks, body, ys)


def _blocks(x, a, b, slot_ids, plan: GroupedPlan, splits=None):
    """Each slot's sorted tokens in blocks of `plan.big` rows; a remainder goes either into one
    more (padded) big block or into blocks of `plan.small` rows, whichever the cost model says
    is cheaper (a block costs `plan.overhead_rows` rows' worth of time on top of its rows)."""
    t, n, o = x.shape[0], a.shape[0], b.shape[2]
    big, small, over = plan
    order, rank, counts = _sort_by_slot(slot_ids, n)
    grp_start = jnp.cumsum(counts) - counts  # first sorted row of each slot
    xs = x[order]  # [T, D]
    ys = jnp.zeros((t, o), x.dtype)

    rest = counts % big
    m = (rest + small - 1) // small  # small blocks the remainder would need
    pad_big = (over + big) < m * (over + small)  # cheaper as one padded big block
    n_big = counts // big + pad_big.astype(jnp.int32)  # [N]
    n_small = jnp.where(pad_big, 0, m)
    big_end, small_end = jnp.cumsum(n_big), jnp.cumsum(n_small)

    def locate(ends, n_per, rows_before, size):
        def first(k):
            g = jnp.minimum(jnp.searchsorted(ends, k, side="right"), n - 1).astype(jnp.int32)
            off = rows_before(g) + (k - (ends[g] - n_per[g])) * size  # rows of slot g before block k
            return g, grp_start[g] + off, counts[g] - off

        return first

    ys = _block_pass(xs, a, b, ys, locate(big_end, n_big, lambda g: 0, big), big_end[-1], big, splits)
    small_first = locate(small_end, n_small, lambda g: (counts[g] // big) * big, small)
    ys = _block_pass(xs, a, b, ys, small_first, small_end[-1], small, splits)
    return ys[rank]  # rows of invalid ids sit past sum(counts): zeros


def _ragged(x, a, b, slot_ids, splits=None):
    t, n = x.shape[0], a.shape[0]
    order, rank, counts = _sort_by_slot(slot_ids, n)
    xs = x[order]  # [T, D], invalid ids sorted last, beyond sum(counts)
    h = jax.lax.ragged_dot(xs, a, counts, preferred_element_type=jnp.float32).astype(b.dtype)
    y = expand_splits(h, b, splits, lambda h, b: jax.lax.ragged_dot(h, b, counts, preferred_element_type=jnp.float32))
    y = jnp.where((jnp.arange(t) < jnp.sum(counts))[:, None], y, 0.0)  # rows of invalid ids
    return y.astype(x.dtype)[rank]


@partial(jax.jit, static_argnames=("method", "block_t", "splits"))
def lora_delta_grouped(
    x: jax.Array,  # [T, D] f32/bf16
    a: jax.Array,  # [N, D, R]
    b: jax.Array,  # [N, R, O]
    slot_ids: jax.Array,  # i32[T], -1 = no adapter
    *,
    method: str = "auto",  # "auto" | "blocks" | "ragged"
    block_t: int | None = None,  # one block size for "blocks"; None = tiles.grouped_plan
    splits: tuple[int, ...] | None = None,  # packed module: a [N, D, S*R], output widths per sub-module
) -> jax.Array:  # [T, O] in x.dtype
    validate_lora_args(x, a, b, slot_ids, splits)
    check_choice("method", method, METHODS)
    check_block("block_t", block_t)
    if method == "auto":
        method = "ragged" if jax.default_backend() == "tpu" else "blocks"
    if method == "ragged":
        return _ragged(x, a, b, slot_ids, splits)
    (t, d), (n, _, r), o = x.shape, a.shape, b.shape[2]
    plan = grouped_plan(t, d, o, n, r)
    if block_t is not None:
        plan = GroupedPlan(min(block_t, t), min(block_t, t), plan.overhead_rows)
    return _blocks(x, a, b, slot_ids, plan, splits)
