"""Pallas laning kernel for TPU (Mosaic): shrink and expand as two pipelined pallas_calls.

Adapters are packed `lane_tile // R` to a lane tile (lanes.py). For each token block:

  shrink  grid (token block i, lane tile j, D block k):  h[i, j] = mask(x[i, :] @ a_lane[:, j])
  expand  grid (token block i, O block o, lane tile j):  y[i, o] = sum_j h[i, j] @ b_lane[j, o]

The mask keeps lane l of token t iff owner[l] == slot[t]; ids outside [0, N) are -1 and match
no lane. Which lane tiles a token block uses is computed in the wrapper and scalar-prefetched:
unused steps skip the matmul and re-point their block index at the previous step's tile, so
Mosaic's pipeline issues no DMA for them. Decode with many slots therefore reads only the
tiles its tokens use, and the cost of a prefill block is one tile per slot present in it.

Padding (T to block_t, D/O to their blocks, N to whole tiles, R to the tile layout) happens in
the wrapper; the reference is `lora_delta_gather` (gather.py), the test tests/test_kernels.py
(interpret mode on CPU, and a `jax.export` lowering for platforms=["tpu"]).
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from jlora.kernels.common import check_block, pad_axis, round_up, validate_lora_args
from jlora.kernels.pallas_lanes import lane_layout, lane_owner, masked_slots, pack_lanes, tile_usage
from jlora.kernels.tiles import tpu_blocks


def _shrink_kernel(used_ref, fetch_ref, slot_ref, owner_ref, x_ref, a_ref, h_ref, acc_ref, *, n_tiles, n_d):
    # slot_ref i32[bt, 1], owner_ref i32[1, W], x_ref [bt, bd], a_ref [bd, W], h_ref [bt, W]
    i, j, k = pl.program_id(0), pl.program_id(1), pl.program_id(2)

    @pl.when(k == 0)
    def _init():
        acc_ref[...] = jnp.zeros_like(acc_ref)

    @pl.when(used_ref[i * n_tiles + j] > 0)
    def _accumulate():
        acc_ref[...] += jnp.dot(x_ref[...], a_ref[...], preferred_element_type=jnp.float32)

    @pl.when(k == n_d - 1)
    def _store():
        keep = slot_ref[...] == owner_ref[...]  # [bt, 1] == [1, W] -> [bt, W]
        h_ref[...] = jnp.where(keep, acc_ref[...], 0.0).astype(h_ref.dtype)


def _expand_kernel(used_ref, fetch_ref, h_ref, b_ref, y_ref, acc_ref, *, n_tiles):
    # h_ref [bt, W], b_ref [W, bo], y_ref [bt, bo]
    i, j = pl.program_id(0), pl.program_id(2)

    @pl.when(j == 0)
    def _init():
        acc_ref[...] = jnp.zeros_like(acc_ref)

    @pl.when(used_ref[i * n_tiles + j] > 0)
    def _accumulate():
        acc_ref[...] += jnp.dot(h_ref[...], b_ref[...], preferred_element_type=jnp.float32)

    @pl.when(j == n_tiles - 1)
    def _store():
        y_ref[...] = acc_ref[...].astype(y_ref.dtype)


@partial(jax.jit, static_argnames=("interpret", "block_t", "block_d", "block_o", "lane_tile"))
def lora_delta_pallas_tpu(
    x: jax.Array,  # [T, D] f32/bf16
    a: jax.Array,  # [N, D, R]
    b: jax.Array,  # [N, R, O]
    slot_ids: jax.Array,  # i32[T], -1 = no adapter
    *,
    interpret: bool | None = None,  # None: interpret unless running on a TPU
    block_t: int | None = None,  # None = tiles.tpu_blocks
    block_d: int | None = None,
    block_o: int | None = None,
    lane_tile: int | None = None,
) -> jax.Array:  # [T, O] in x.dtype
    validate_lora_args(x, a, b, slot_ids)
    check_block("block_t", block_t, multiple_of=16)
    check_block("block_d", block_d, multiple_of=128)
    check_block("block_o", block_o, multiple_of=128)
    check_block("lane_tile", lane_tile, multiple_of=128)
    if interpret is None:
        interpret = jax.default_backend() != "tpu"
    t, d = x.shape
    n, _, r = a.shape
    o = b.shape[2]
    table = tpu_blocks(t, d, o, r)
    bt = block_t or table.block_t
    bd = min(block_d or table.block_d, d)  # == D (one block) or a multiple of 128
    bo = min(block_o or table.block_o, o)
    width, per, n_tiles = lane_layout(n, r, lane_tile or table.lane_tile)
    tp, dp, op = round_up(t, bt), round_up(d, bd), round_up(o, bo)
    n_t, n_d, n_o = tp // bt, dp // bd, op // bo

    cdt = jnp.promote_types(x.dtype, a.dtype)
    a_lane, b_lane = pack_lanes(a, b, width)  # [D, NL], [NL, O]
    a_lane = pad_axis(a_lane.astype(cdt), 0, dp)
    b_lane = pad_axis(b_lane, 1, op)
    xp = pad_axis(pad_axis(x.astype(cdt), 0, tp), 1, dp)
    slots = pad_axis(masked_slots(slot_ids, n), 0, tp, value=-1)  # [Tp]
    owner = jnp.asarray(lane_owner(n, r, width)).reshape(1, -1)  # [1, NL]
    used, fetch = tile_usage(slots, bt, n_tiles, per)

    def step(i, j):  # flat index into the prefetched tables
        return i * n_tiles + j

    def k_or_last(i, j, k, used_ref):  # unused steps stay on the last D block: no new DMA
        return jnp.where(used_ref[step(i, j)] > 0, k, n_d - 1)

    h = pl.pallas_call(
        partial(_shrink_kernel, n_tiles=n_tiles, n_d=n_d),
        out_shape=jax.ShapeDtypeStruct((tp, n_tiles * width), b.dtype),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=2,
            grid=(n_t, n_tiles, n_d),
            in_specs=[
                pl.BlockSpec((bt, 1), lambda i, j, k, u, f: (i, 0)),
                pl.BlockSpec((1, width), lambda i, j, k, u, f: (0, j)),
                pl.BlockSpec((bt, bd), lambda i, j, k, u, f: (i, k_or_last(i, j, k, u))),
                pl.BlockSpec((bd, width), lambda i, j, k, u, f: (k_or_last(i, j, k, u), f[step(i, j)])),
            ],
            out_specs=pl.BlockSpec((bt, width), lambda i, j, k, u, f: (i, j)),
            scratch_shapes=[pltpu.VMEM((bt, width), jnp.float32)],
        ),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "arbitrary", "arbitrary")),
        interpret=interpret,
        name="lora_shrink_laned",
    )(used, fetch, slots.reshape(tp, 1), owner, xp, a_lane)

    y = pl.pallas_call(
        partial(_expand_kernel, n_tiles=n_tiles),
        out_shape=jax.ShapeDtypeStruct((tp, op), x.dtype),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=2,
            grid=(n_t, n_o, n_tiles),
            in_specs=[
                pl.BlockSpec((bt, width), lambda i, o_, j, u, f: (i, f[step(i, j)])),
                pl.BlockSpec((width, bo), lambda i, o_, j, u, f: (f[step(i, j)], o_)),
            ],
            out_specs=pl.BlockSpec((bt, bo), lambda i, o_, j, u, f: (i, o_)),
            scratch_shapes=[pltpu.VMEM((bt, bo), jnp.float32)],
        ),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel", "arbitrary")),
        interpret=interpret,
        name="lora_expand_laned",
    )(used, fetch, h, b_lane)
    return y[:t, :o]
