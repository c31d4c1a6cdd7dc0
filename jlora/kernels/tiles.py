"""Block sizes per shape, in one table, for the grouped loop and the Pallas kernels.

Kept apart from the kernels so that tuning is one edit in one place. Values for XLA:CPU are
measured (docs/kernels.md); TPU and GPU values are chosen from the hardware's tile rules and
on-chip memory budgets, not measured (no accelerator was available when they were written).
"""

from __future__ import annotations

from typing import NamedTuple

from jlora.kernels.common import pow2_ceil, pow2_floor, round_up


# ---- grouped "blocks" loop (XLA:CPU) ---------------------------------------------------------
# Cost model, constants measured on the 2-core XLA:CPU host of docs/kernels.md: a loop block
# costs a fixed overhead (loop step, slices, fetching its adapter) plus its rows' matmul work.
CPU_BLOCK_OVERHEAD_S = 15e-6  # one loop iteration with tiny operands
CPU_BYTES_PER_S = 20e9  # streaming an adapter out of memory
CPU_FLOPS = 50e9  # skinny f32 matmuls ([rows, D] @ [D, R], [rows, R] @ [R, O])
GROUPED_MAX_BIG = 128  # larger blocks measured no faster and waste more on padding


class GroupedPlan(NamedTuple):
    big: int  # rows per full block
    small: int  # rows per remainder block
    overhead_rows: float  # a block's fixed cost, in rows of matmul work


def grouped_plan(t: int, d: int, o: int, n: int, r: int) -> GroupedPlan:
    """Block sizes for the grouped loop over T tokens, N slots, D -> R -> O.

    `small` is about the rows whose work equals one block's overhead (so a remainder block
    wastes at most ~2x its overhead), and never above the mean tokens per slot T // N (decode:
    one row per token when tokens rarely share a slot). `big` amortizes the overhead over
    many rows for slots that hold many tokens (prefill).
    """
    row_s = 2 * (d + o) * r / CPU_FLOPS
    overhead_rows = (CPU_BLOCK_OVERHEAD_S + 4 * (d + o) * r / CPU_BYTES_PER_S) / row_s
    small = max(1, min(32, pow2_floor(int(overhead_rows)), pow2_floor(max(1, t // n))))
    big = max(small, min(GROUPED_MAX_BIG, pow2_ceil(t)))
    return GroupedPlan(min(big, t), min(small, t), overhead_rows)


# ---- Pallas TPU (Mosaic) -------------------------------------------------------------------
# Tiles: block_t a multiple of 16 (bf16 packs 16 rows per sublane tile), lane tiles of 128
# (one vreg / v5e MXU width) holding 128 // R adapters, feature blocks either the full
# dimension (always legal) or a multiple of 128. VMEM budget: double-buffered x and A blocks
# plus accumulators stay under ~10 MiB, inside the 16 MiB default scoped VMEM of v5e.

TPU_LANES = 128
TPU_MAX_FULL_D = 2048  # feature dims up to this are one block (no padding)
TPU_BLOCK_D = 2048  # else blocks of this many (D padded to a multiple)
TPU_MAX_FULL_O = 2048
TPU_BLOCK_O = 1024


class TpuBlocks(NamedTuple):
    block_t: int  # tokens per block (multiple of 16)
    block_d: int  # shrink reduction block (== D or a multiple of 128)
    block_o: int  # expand output block (== O or a multiple of 128)
    lane_tile: int  # lanes per tile; holds lane_tile // R adapters (R <= lane_tile)


def tpu_blocks(t: int, d: int, o: int, r: int) -> TpuBlocks:
    block_t = min(256 if t >= 1024 else 128, round_up(t, 16))
    block_d = d if d <= TPU_MAX_FULL_D else TPU_BLOCK_D
    block_o = o if o <= TPU_MAX_FULL_O else TPU_BLOCK_O
    lane_tile = TPU_LANES if r <= TPU_LANES else round_up(r, TPU_LANES)
    return TpuBlocks(block_t, block_d, block_o, lane_tile)


# ---- Pallas GPU (Triton) -------------------------------------------------------------------
# Triton needs power-of-two block shapes and tl.dot needs every dim >= 16. Register budget per
# program (4 warps): accumulators of block_t x 128 f32 at most.


class GpuBlocks(NamedTuple):
    block_t: int  # tokens per program (power of two >= 16)
    block_d: int  # shrink reduction chunk (power of two)
    block_o: int  # expand output block (power of two)
    lane_tile: int  # lanes per tile (power of two); holds lane_tile // R adapters
    num_warps: int
    num_stages: int


def gpu_blocks(t: int, d: int, o: int, r: int) -> GpuBlocks:
    block_t = min(64, max(16, pow2_ceil(t)))
    lane_tile = max(128, pow2_ceil(r))
    return GpuBlocks(block_t, 64, 128 if o >= 128 else max(16, pow2_ceil(o)), lane_tile, 4, 3)
