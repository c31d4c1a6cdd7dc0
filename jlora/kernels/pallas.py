"""The `pallas` implementation: the Pallas laning kernel for the target platform.

`target="tpu"` is the Mosaic kernel (pallas_tpu.py), `target="gpu"` the Triton kernel
(pallas_gpu.py). By default the target follows `jax.default_backend()`; on CPU the TPU kernel
runs in interpret mode (slow: for tests, not for speed).

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
        return kernel(x, a, b, slot_ids, interpret=interpret)
    r, outs, start = b.shape[1], [], 0
    for s, w in enumerate(splits):
        outs.append(kernel(x, a[:, :, s * r:(s + 1) * r], b[:, :, start:start + w], slot_ids, interpret=interpret))
        start += w
    return jnp.concatenate(outs, axis=-1)
