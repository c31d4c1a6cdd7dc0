"""A projection and its laned LoRA expand in one Pallas TPU kernel: y = x @ W[l] + expand.

At prefill (T > 64 token rows) XLA computes `y = x @ W` as one dot and the laned expand
`y + h @ B` as a second fusion that reads y [T, O] back and writes it again: ~110 us a layer on a
v5e chip at a 1,088-token step of the 1B shape. Here both matmuls share one output tile:

  grid (token block i, column tile j, D block k):
    acc[i, j] += x[i, k] @ W[l][k, j]                      (f32 VMEM scratch over the D blocks)
    y[i, j] = acc + hs[s(j)][i] @ Bflat[l][:, j]            (last D block; written once)

W is the *stacked* weight [L, D, O] and the layer `l` arrives by scalar prefetch, so the
BlockSpec DMAs read W[l]'s tiles straight out of the stack: XLA never slices or copies a layer's
weight (concatenating [W; B] made it copy the whole weight every layer). The expand needs no
block-diagonal B: column tile j lies inside one sub-module s(j) of a packed module (q|k|v,
gate|up; the column tile divides every split, `column_tile`), and the index_map picks that
sub-module's shrink, hs[s] [T, N*R] (the masked laned shrink, rearranged by `split_shrink`
outside: tiny), against Bflat = B.reshape(L, N*R, O) (a free reshape of the stacked slots).

`lora_matmul_reference` is the same math in jnp; tests/test_lora_matmul_tpu.py runs the kernel in
interpret mode against it and against `quant.linear` + `lora_delta_laned`, and lowers it for TPU.

On a v5e chip (docs/tpu.md, ninth pass) its matmul runs below XLA's dot (gate_up at 1,088 tokens:
482 us fused, 502 unfused, 426 for the projection alone; o and down slower than unfused), and the
engine gained within noise: the model keeps it off (`jlora.models.llama.LORA_FUSED`).
"""

from __future__ import annotations

import math
from functools import partial

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from jlora.kernels.common import FLOAT_DTYPES

LANE = 128  # a column tile (and a D block below D) is a multiple of the MXU/lane width
BLOCK_O = 512  # default column tile: divides q|k|v = 2048|512|512 and gate|up = 8192|8192
BLOCK_D = 2048  # default D block: D <= 2048 is one block (x fetched once for all column tiles)
VMEM_MAX = 100 << 20  # of the v5e's 128 MiB; the default scoped limit is 16 MiB
VMEM_MIN = 32 << 20


def column_tile(widths: tuple[int, ...], want: int = BLOCK_O) -> int | None:
    """The largest multiple of 128 up to `want` that divides every width (None: there is none,
    and a caller takes the unfused path)."""
    g = math.gcd(*widths)
    for bo in range(want // LANE * LANE, 0, -LANE):
        if g % bo == 0:
            return bo
    return None


def depth_block(d: int, want: int = BLOCK_D) -> int:
    """The D block: the largest multiple of 128 up to `want` dividing D, else D whole (the
    stacked weight is never padded: that would copy it)."""
    for bd in range(min(want, d) // LANE * LANE, 0, -LANE):
        if d % bd == 0:
            return bd
    return d


def split_shrink(
    x: jax.Array,  # [T, D]
    a: jax.Array,  # [N, D, S*R]: one layer's A slots, sub-module s in lanes [s*R, (s+1)*R)
    slot_ids: jax.Array,  # i32[T], -1 (any id outside [0, N)) = no adapter
    num_splits: int,  # S (1 for a module that is not packed)
    dtype=None,  # of the result (B's dtype); default x.dtype
) -> jax.Array:  # hs [S, T, N*R]: hs[s, t, n*R + r] = x[t] @ a[n][:, s*R + r] where slot_ids[t] == n, else 0
    """The laned shrink of `lora_delta_laned` (T > 64: one einsum over all N slots, each token's
    own slot kept), rearranged so sub-module s's lanes of every slot sit side by side: the rows
    Bflat = B.reshape(L, N*R, O) multiplies."""
    t, (n, _, sr) = x.shape[0], a.shape
    r = sr // num_splits
    h = jnp.einsum("td,ndr->tnr", x, a, preferred_element_type=jnp.float32)  # [T, N, S*R]
    keep = slot_ids[:, None] == jnp.arange(n, dtype=slot_ids.dtype)[None, :]  # [T, N]
    h = jnp.where(keep[:, :, None], h, 0.0).astype(dtype or x.dtype)
    return h.reshape(t, n, num_splits, r).transpose(2, 0, 1, 3).reshape(num_splits, t, n * r)


def vmem_bytes(t: int, bd: int, bo: int, nr: int, n_d: int, x_dtype, h_dtype) -> int:
    """VMEM the kernel's blocks take: every input and the output double-buffered, plus the f32
    accumulator when D is split."""
    xs, hs = jnp.dtype(x_dtype).itemsize, jnp.dtype(h_dtype).itemsize
    blocks = t * bd * xs + bd * bo * xs + t * nr * hs + nr * bo * hs + t * bo * xs
    return 2 * blocks + (t * bo * 4 if n_d > 1 else 0)


def check_lora_matmul_args(x, w, layer, h, b, splits, block_t, block_d, block_o) -> tuple[int, int, int]:
    """ValueError naming the argument unless the shapes fit; returns the blocks (bt, bd, bo)."""
    for name, arr, rank in (("x", x, 2), ("w", w, 3), ("h", h, 3), ("b", b, 3)):
        if getattr(arr, "ndim", None) != rank:
            raise ValueError(f"{name} must have {rank} dimensions, got shape {getattr(arr, 'shape', type(arr))}")
        if jnp.dtype(arr.dtype) not in FLOAT_DTYPES:
            raise ValueError(f"{name} must be float32, bfloat16 or float16, got {arr.dtype}")
    t, d = x.shape
    num_layers, _, o = w.shape
    widths = splits or (o,)
    if w.shape[1] != d:
        raise ValueError(f"w [L, D, O] has D={w.shape[1]} but x [T, D] has D={d} (w {w.shape}, x {x.shape})")
    if x.dtype != w.dtype or h.dtype != b.dtype:
        raise ValueError(f"x and w, h and b must share dtypes, got x {x.dtype}, w {w.dtype}, h {h.dtype}, b {b.dtype}")
    if h.shape[:2] != (len(widths), t):
        raise ValueError(f"h must be [S, T, N*R] with S={len(widths)} sub-modules and T={t}, got {h.shape}")
    if b.shape != (num_layers, h.shape[2], o):
        raise ValueError(f"b must be [L, N*R, O] = {(num_layers, h.shape[2], o)} (w {w.shape}, h {h.shape}), "
                         f"got {b.shape}")
    if sum(widths) != o:
        raise ValueError(f"splits {splits} must add up to w's O={o}")
    if getattr(layer, "shape", ()) != () or not jnp.issubdtype(jnp.result_type(layer), jnp.integer):
        raise ValueError(f"layer must be an integer scalar, got {layer!r}")
    bo = column_tile(widths) if block_o is None else block_o
    if bo is None or bo % LANE or any(wd % bo for wd in widths):
        raise ValueError(f"block_o={bo} must be a multiple of {LANE} dividing every output width {widths}")
    bd = depth_block(d) if block_d is None else block_d
    if d % bd or (bd != d and bd % LANE):
        raise ValueError(f"block_d={bd} must divide D={d} and be a multiple of {LANE} (or D itself)")
    bt = t if block_t is None else block_t
    if t % bt or (bt != t and bt % 16):
        raise ValueError(f"block_t={bt} must divide T={t} and be a multiple of 16 (or T itself)")
    return bt, bd, bo


def fits(t: int, d: int, o: int, nr: int, splits: tuple[int, ...] | None, dtype, h_dtype) -> bool:
    """Whether the kernel takes these shapes with its default blocks (a caller's fallback test)."""
    bo = column_tile(splits or (o,))
    if bo is None:
        return False
    bd = depth_block(d)
    return vmem_bytes(t, bd, bo, nr, d // bd, dtype, h_dtype) <= VMEM_MAX


def _kernel(layer_ref, x_ref, w_ref, h_ref, b_ref, y_ref, *scratch, n_d: int):
    # x_ref [bt, bd], w_ref [bd, bo], h_ref [bt, N*R], b_ref [N*R, bo], y_ref [bt, bo]
    def expand():
        return jnp.dot(h_ref[...], b_ref[...], preferred_element_type=jnp.float32)

    if n_d == 1:  # D in one block: no accumulator round trip
        y = jnp.dot(x_ref[...], w_ref[...], preferred_element_type=jnp.float32) + expand()
        y_ref[...] = y.astype(y_ref.dtype)
        return
    (acc_ref,) = scratch
    k = pl.program_id(2)

    @pl.when(k == 0)
    def _init():
        acc_ref[...] = jnp.zeros_like(acc_ref)

    acc_ref[...] += jnp.dot(x_ref[...], w_ref[...], preferred_element_type=jnp.float32)

    @pl.when(k == n_d - 1)
    def _store():
        y_ref[...] = (acc_ref[...] + expand()).astype(y_ref.dtype)


@partial(jax.jit, static_argnames=("splits", "block_t", "block_d", "block_o", "interpret"))
def lora_matmul_tpu(
    x: jax.Array,  # [T, D] bf16/f32
    w: jax.Array,  # [L, D, O] the stacked weights (same dtype as x); read in place
    layer: jax.Array,  # i32 scalar: which layer of w and b (clamped to [0, L))
    h: jax.Array,  # [S, T, N*R]: the masked shrink per sub-module (`split_shrink`)
    b: jax.Array,  # [L, N*R, O]: the stacked B slots, B.reshape(L, N*R, O)
    *,
    splits: tuple[int, ...] | None = None,  # packed module: output widths of its S sub-modules
    block_t: int | None = None,  # token rows a block; None = all T (x and W each read once)
    block_d: int | None = None,  # None: `depth_block`
    block_o: int | None = None,  # None: `column_tile` (must divide every split)
    interpret: bool | None = None,  # None: interpret unless running on a TPU
) -> jax.Array:  # [T, O] in x.dtype: x @ w[layer] + hs[s] @ b[layer][:, sub-module s's columns]
    bt, bd, bo = check_lora_matmul_args(x, w, layer, h, b, splits, block_t, block_d, block_o)
    if interpret is None:
        interpret = jax.default_backend() != "tpu"
    t, d = x.shape
    num_layers, _, o = w.shape
    nr = h.shape[2]
    n_t, n_o, n_d = t // bt, o // bo, d // bd
    widths = splits or (o,)
    cuts = [sum(widths[: s + 1]) // bo for s in range(len(widths) - 1)]  # first column tile of sub-module s+1

    def sub_module(j):  # static splits: a sum of comparisons, no table
        s = jnp.int32(0)
        for c in cuts:
            s = s + (j >= c).astype(jnp.int32)
        return s

    need = vmem_bytes(bt, bd, bo, nr, n_d, x.dtype, h.dtype)
    if need > VMEM_MAX:
        raise ValueError(f"blocks (block_t={bt}, block_d={bd}, block_o={bo}) need {need >> 20} MiB of VMEM, "
                         f"more than {VMEM_MAX >> 20}: pass smaller blocks")
    layer_arr = jnp.clip(jnp.asarray(layer, jnp.int32), 0, num_layers - 1).reshape(1)
    return pl.pallas_call(
        partial(_kernel, n_d=n_d),
        out_shape=jax.ShapeDtypeStruct((t, o), x.dtype),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=1,
            grid=(n_t, n_o, n_d),
            in_specs=[
                pl.BlockSpec((bt, bd), lambda i, j, k, l: (i, k)),
                pl.BlockSpec((pl.squeezed, bd, bo), lambda i, j, k, l: (l[0], k, j)),
                pl.BlockSpec((pl.squeezed, bt, nr), lambda i, j, k, l: (sub_module(j), i, 0)),
                pl.BlockSpec((pl.squeezed, nr, bo), lambda i, j, k, l: (l[0], 0, j)),
            ],
            out_specs=pl.BlockSpec((bt, bo), lambda i, j, k, l: (i, j)),
            scratch_shapes=[pltpu.VMEM((bt, bo), jnp.float32)] if n_d > 1 else [],
        ),
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "parallel", "arbitrary"),
            vmem_limit_bytes=min(VMEM_MAX, max(VMEM_MIN, need * 5 // 4 + (4 << 20)))),
        interpret=interpret,
        name="lora_matmul_fused",
    )(layer_arr, x, w, h, b)


def lora_matmul_reference(
    x: jax.Array,  # [T, D]
    w: jax.Array,  # [L, D, O]
    layer: jax.Array,  # i32 scalar
    h: jax.Array,  # [S, T, N*R]
    b: jax.Array,  # [L, N*R, O]
    *,
    splits: tuple[int, ...] | None = None,
) -> jax.Array:  # [T, O] in x.dtype
    """`lora_matmul_tpu` in jnp: the base projection plus each sub-module's expand into its columns."""
    wl, bl = w[layer], b[layer]
    y = jnp.dot(x, wl, preferred_element_type=jnp.float32)
    bounds = [0, *(sum((splits or (w.shape[2],))[: s + 1]) for s in range(h.shape[0]))]
    expand = jnp.concatenate([jnp.dot(h[s], bl[:, lo:hi], preferred_element_type=jnp.float32)
                              for s, (lo, hi) in enumerate(zip(bounds, bounds[1:]))], axis=-1)
    return (y + expand).astype(x.dtype)
