"""The `pallas` implementation: the Pallas laning kernel for the target platform.

`target="tpu"` is the Mosaic kernel (pallas_tpu.py), `target="gpu"` the Triton kernel
(pallas_gpu.py). By default the target follows `jax.default_backend()`; on CPU the TPU kernel
runs in interpret mode (slow: for tests, not for speed).

The kernels carry a `jax.custom_vjp` (Pallas calls have no autodiff rule): the input gradient
is itself a LoRA product through the transposed adapter (dy @ B^T @ A^T), so it runs the same
kernel; the weight gradients are per-slot sums of outer products, a masked einsum in XLA (as
`laned` computes its forward).

A packed module (`splits`) runs as one kernel call per sub-module on its own lanes of `a` and
output columns of `b`: correct, but without the shared shrink the XLA implementations get
(the kernels' lane packing would need a block-diagonal expand; not measured on hardware yet).
"""

from __future__ import annotations

from functools import partial

import jax

import jax.numpy as jnp

from jlora.kernels.common import check_choice, validate_lora_args
from jlora.kernels.pallas_gpu import lora_delta_pallas_gpu
from jlora.kernels.pallas_tpu import lora_delta_pallas_tpu

TARGETS = ("tpu", "gpu")


def default_target() -> str:
    return "gpu" if jax.default_backend() in ("gpu", "cuda", "rocm") else "tpu"


@partial(jax.jit, static_argnames=("target", "interpret", "splits"))
def lora_delta_pallas(
    x: jax.Array,  # [T, D] f32/bf16
    a: jax.Array,  # [N, D, R]
    b: jax.Array,  # [N, R, O]
    slot_ids: jax.Array,  # i32[T], -1 = no adapter
    *,
    target: str | None = None,  # "tpu" | "gpu"; None = follow jax.default_backend()
    interpret: bool | None = None,  # None: interpret unless running on the target
    splits: tuple[int, ...] | None = None,  # packed module: a [N, D, S*R], output widths per sub-module
) -> jax.Array:  # [T, O] in x.dtype
    validate_lora_args(x, a, b, slot_ids, splits)
    target = target or default_target()
    check_choice("target", target, TARGETS)
    kernel = lora_delta_pallas_tpu if target == "tpu" else lora_delta_pallas_gpu
    if splits is None:
        return _differentiable(kernel, interpret, x, a, b, slot_ids)
    # Per sub-module, on its own lanes of a and (per shard, when the columns are shard-major under
    # tensor parallelism; see `expand_splits`) its own columns of b.
    r, per_shard, outs, start = b.shape[1], sum(splits), [], 0
    shards = b.shape[2] // per_shard
    blocks = b.reshape(*b.shape[:2], shards, per_shard)
    for s, w in enumerate(splits):
        y = _differentiable(kernel, interpret, x, a[:, :, s * r:(s + 1) * r],
                            blocks[..., start:start + w].reshape(*b.shape[:2], shards * w), slot_ids)
        outs.append(y.reshape(y.shape[0], shards, w))
        start += w
    return jnp.concatenate(outs, axis=-1).reshape(x.shape[0], shards * per_shard)


@partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _differentiable(kernel, interpret, x, a, b, slot_ids):
    return kernel(x, a, b, slot_ids, interpret=interpret)


def _differentiable_fwd(kernel, interpret, x, a, b, slot_ids):
    return kernel(x, a, b, slot_ids, interpret=interpret), (x, a, b, slot_ids)


def _differentiable_bwd(kernel, interpret, res, dy):  # dy [T, O]
    x, a, b, slot_ids = res
    # dx = dy @ B^T @ A^T per token: the same kernel on the transposed adapter.
    dx = kernel(dy.astype(x.dtype), jnp.swapaxes(b, 1, 2), jnp.swapaxes(a, 1, 2), slot_ids, interpret=interpret)
    keep = (slot_ids[:, None] == jnp.arange(a.shape[0], dtype=slot_ids.dtype)[None, :]).astype(jnp.float32)
    f32 = jnp.float32
    h = jnp.einsum("td,ndr->tnr", x, a, preferred_element_type=f32) * keep[:, :, None]  # each token's shrink
    g = jnp.einsum("to,nro->tnr", dy, b, preferred_element_type=f32) * keep[:, :, None]  # dy @ B^T
    da = jnp.einsum("td,tnr->ndr", x.astype(f32), g).astype(a.dtype)
    db = jnp.einsum("tnr,to->nro", h, dy.astype(f32)).astype(b.dtype)
    return dx.astype(x.dtype), da, db, None


_differentiable.defvjp(_differentiable_fwd, _differentiable_bwd)
