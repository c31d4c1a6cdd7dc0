"""Lane packing shared by the Pallas kernels: N adapters of rank R laid side by side in tiles.

A lane tile of width W holds P = W // R adapters (R <= W), or one adapter padded to W lanes
(R > W, W then a multiple of the hardware lane count). Slots are padded up to a multiple of P
with zero adapters. The per-lane owner map says which slot each lane belongs to (-2 for
padding lanes, which no token can match because ids are masked to -1 first).

    a [N, D, R]  ->  a_lane [D, n_tiles * W]      (one relayout copy of a per call)
    b [N, R, O]  ->  b_lane [n_tiles * W, O]      (a reshape when R divides W and P divides N)
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jlora.kernels.common import pad_axis, round_up

PAD_OWNER = -2  # owner of padding lanes; masked slot ids are -1, so never equal


def lane_layout(n: int, r: int, lane_tile: int) -> tuple[int, int, int]:
    """(tile width W, adapters per tile P, number of tiles) for N adapters of rank R."""
    width = lane_tile if r <= lane_tile else round_up(r, lane_tile)
    per = width // r
    return width, per, -(-n // per)


def lane_owner(n: int, r: int, lane_tile: int) -> np.ndarray:
    """i32[n_tiles * W]: slot owning each lane, PAD_OWNER for padding lanes (a static constant)."""
    width, per, n_tiles = lane_layout(n, r, lane_tile)
    lane = np.arange(n_tiles * width)
    tile, within = lane // width, lane % width
    slot = tile * per + within // r
    return np.where((within < per * r) & (slot < n), slot, PAD_OWNER).astype(np.int32)


def pack_lanes(
    a: jax.Array,  # [N, D, R]
    b: jax.Array,  # [N, R, O]
    lane_tile: int,
) -> tuple[jax.Array, jax.Array]:  # a_lane [D, NL], b_lane [NL, O]
    n, d, r = a.shape
    width, per, n_tiles = lane_layout(n, r, lane_tile)
    a = pad_axis(a, 0, n_tiles * per).reshape(n_tiles, per, d, r)
    a = jnp.transpose(a, (2, 0, 1, 3)).reshape(d, n_tiles, per * r)
    a_lane = pad_axis(a, 2, width).reshape(d, n_tiles * width)
    b = pad_axis(b, 0, n_tiles * per).reshape(n_tiles, per * r, b.shape[2])
    b_lane = pad_axis(b, 1, width).reshape(n_tiles * width, b.shape[2])
    return a_lane, b_lane


def masked_slots(slot_ids: jax.Array, n: int) -> jax.Array:
    """i32[T]: slot ids with everything outside [0, N) mapped to -1."""
    return jnp.where((slot_ids >= 0) & (slot_ids < n), slot_ids, -1).astype(jnp.int32)


def tile_usage(slots: jax.Array, block_t: int, n_tiles: int, per: int) -> tuple[jax.Array, jax.Array]:
    """Which lane tiles each token block touches, and which tile to fetch at each grid step.

    slots: i32[Tp] (masked, Tp a multiple of block_t). Returns used, fetch: i32[n_blocks * n_tiles]
    in row-major (token block, tile) order. For an unused step, fetch repeats the tile of the
    last used step before it, so a pipelined kernel sees an unchanged block index and skips the
    copy; the kernel skips the matmul.
    """
    tile = jnp.where(slots >= 0, slots // per, -1).reshape(-1, block_t)  # [n_blocks, block_t]
    used = (tile[:, :, None] == jnp.arange(n_tiles, dtype=jnp.int32)).any(axis=1).reshape(-1)
    step = jnp.arange(used.shape[0], dtype=jnp.int32)
    last = jax.lax.cummax(jnp.where(used, step, -1), axis=0)
    fetch = jnp.where(last >= 0, last % n_tiles, 0).astype(jnp.int32)
    return used.astype(jnp.int32), fetch
