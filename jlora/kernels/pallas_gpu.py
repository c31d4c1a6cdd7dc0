"""Pallas laning kernel for GPU (Triton lowering): shrink and expand as two pallas_calls.

Same lane packing as the TPU kernel (lanes.py), with Triton's rules: power-of-two blocks, every
dot dim >= 16. One program per (token block, lane tile) for the shrink, which loops over D in
chunks and skips the loop entirely when no token of its block uses the tile; one program per
(token block, O block) for the expand, which loops only over the lane tiles its token block
uses (a compact per-block list built in the wrapper).

  shrink  program (i, j):  h[i, j] = mask(sum_k x[i, k] @ a_lane[k, j])
  expand  program (i, o):  y[i, o] = sum_{j used by block i} h[i, j] @ b_lane[j, o]

f32 dots use the GPU's default precision (TF32 on Ampere and later), like XLA's default. The
reference is `lora_delta_gather` (gather.py); tests/test_kernels.py runs this in interpret mode
on CPU and lowers it with `jax.export` for platforms=["cuda"]. The Triton custom call carries
no cross-version compatibility guarantee, so exporting it needs
`jax.export.DisabledSafetyCheck.custom_call(TRITON_CUSTOM_CALL)`.

Why Triton and not Mosaic GPU: Mosaic GPU matmuls are wgmma/tcgen05 (Hopper/Blackwell only)
and its kernels do not run under interpret=True, so they could not be tested on CPU. Triton
runs on every CUDA GPU JAX supports and in the interpreter.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from jlora.kernels.common import check_block, pad_axis, round_up, validate_lora_args
from jlora.kernels.pallas_lanes import lane_layout, lane_owner, masked_slots, pack_lanes, tile_usage
from jlora.kernels.tiles import gpu_blocks

TRITON_CUSTOM_CALL = "__gpu$xla.gpu.triton"


def _shrink_kernel(slot_ref, owner_ref, x_ref, a_ref, h_ref, *, block_d, n_d):
    # slot_ref i32[bt], owner_ref i32[W], x_ref [bt, Dp], a_ref [Dp, W], h_ref [bt, W]
    keep = slot_ref[...][:, None] == owner_ref[...][None, :]  # [bt, W]
    used = jnp.max(keep.astype(jnp.int32))

    def body(k, acc):
        xs = x_ref[:, pl.ds(k * block_d, block_d)]
        ws = a_ref[pl.ds(k * block_d, block_d), :]
        return acc + jnp.dot(xs, ws, preferred_element_type=jnp.float32)

    acc = jax.lax.fori_loop(0, used * n_d, body, jnp.zeros(h_ref.shape, jnp.float32))
    h_ref[...] = jnp.where(keep, acc, 0.0).astype(h_ref.dtype)


def _expand_kernel(tiles_ref, count_ref, h_ref, b_ref, y_ref, *, width, n_tiles):
    # tiles_ref i32[n_blocks * n_tiles] (used tiles first), count_ref i32[n_blocks],
    # h_ref [bt, NL], b_ref [NL, bo], y_ref [bt, bo]
    i = pl.program_id(0)

    def body(jj, acc):
        j = tiles_ref[i * n_tiles + jj]
        hs = h_ref[:, pl.ds(j * width, width)]
        ws = b_ref[pl.ds(j * width, width), :]
        return acc + jnp.dot(hs, ws, preferred_element_type=jnp.float32)

    acc = jax.lax.fori_loop(0, count_ref[i], body, jnp.zeros(y_ref.shape, jnp.float32))
    y_ref[...] = acc.astype(y_ref.dtype)


@partial(jax.jit, static_argnames=("interpret", "block_t", "block_d", "block_o", "lane_tile"))
def lora_delta_pallas_gpu(
    x: jax.Array,  # [T, D] f32/bf16
    a: jax.Array,  # [N, D, R]
    b: jax.Array,  # [N, R, O]
    slot_ids: jax.Array,  # i32[T], -1 = no adapter
    *,
    interpret: bool | None = None,  # None: interpret unless running on a GPU
    block_t: int | None = None,  # powers of two; None = tiles.gpu_blocks
    block_d: int | None = None,
    block_o: int | None = None,
    lane_tile: int | None = None,
) -> jax.Array:  # [T, O] in x.dtype
    validate_lora_args(x, a, b, slot_ids)
    for name, v in (("block_t", block_t), ("block_d", block_d), ("block_o", block_o), ("lane_tile", lane_tile)):
        check_block(name, v, power_of_two=True, multiple_of=16)
    if interpret is None:
        interpret = jax.default_backend() != "gpu"
    t, d = x.shape
    n, _, r = a.shape
    o = b.shape[2]
    table = gpu_blocks(t, d, o, r)
    bt, bd, bo = block_t or table.block_t, block_d or table.block_d, block_o or table.block_o
    width, per, n_tiles = lane_layout(n, r, lane_tile or table.lane_tile)
    if width & (width - 1):
        raise ValueError(f"lane_tile must be at least R={r} for the GPU kernel (a power of two), got {lane_tile}")
    tp, dp, op = round_up(t, bt), round_up(d, bd), round_up(o, bo)
    n_t, n_o = tp // bt, op // bo

    cdt = jnp.promote_types(x.dtype, a.dtype)
    a_lane, b_lane = pack_lanes(a, b, width)  # [D, NL], [NL, O]
    a_lane = pad_axis(a_lane.astype(cdt), 0, dp)
    b_lane = pad_axis(b_lane, 1, op)
    xp = pad_axis(pad_axis(x.astype(cdt), 0, tp), 1, dp)
    slots = pad_axis(masked_slots(slot_ids, n), 0, tp, value=-1)  # [Tp]
    owner = jnp.asarray(lane_owner(n, r, width))  # [NL]
    used, _ = tile_usage(slots, bt, n_tiles, per)
    used = used.reshape(n_t, n_tiles)
    tiles = jnp.argsort(1 - used, axis=1, stable=True).astype(jnp.int32).reshape(-1)  # used first
    count = used.sum(axis=1).astype(jnp.int32)
    params = plgpu.CompilerParams(num_warps=table.num_warps, num_stages=table.num_stages)

    h = pl.pallas_call(
        partial(_shrink_kernel, block_d=bd, n_d=dp // bd),
        out_shape=jax.ShapeDtypeStruct((tp, n_tiles * width), b.dtype),
        grid=(n_t, n_tiles),
        in_specs=[
            pl.BlockSpec((bt,), lambda i, j: (i,)),
            pl.BlockSpec((width,), lambda i, j: (j,)),
            pl.BlockSpec((bt, dp), lambda i, j: (i, 0)),
            pl.BlockSpec((dp, width), lambda i, j: (0, j)),
        ],
        out_specs=pl.BlockSpec((bt, width), lambda i, j: (i, j)),
        compiler_params=params,
        interpret=interpret,
        name="lora_shrink_laned",
    )(slots, owner, xp, a_lane)

    y = pl.pallas_call(
        partial(_expand_kernel, width=width, n_tiles=n_tiles),
        out_shape=jax.ShapeDtypeStruct((tp, op), x.dtype),
        grid=(n_t, n_o),
        in_specs=[
            pl.BlockSpec((n_t * n_tiles,), lambda i, o_: (0,)),
            pl.BlockSpec((n_t,), lambda i, o_: (0,)),
            pl.BlockSpec((bt, n_tiles * width), lambda i, o_: (i, 0)),
            pl.BlockSpec((n_tiles * width, bo), lambda i, o_: (0, o_)),
        ],
        out_specs=pl.BlockSpec((bt, bo), lambda i, o_: (i, o_)),
        compiler_params=params,
        interpret=interpret,
        name="lora_expand_laned",
    )(tiles, count, h, b_lane)
    return y[:t, :o]
