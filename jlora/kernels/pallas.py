"""The `pallas` implementation: the Pallas laning kernel for the target platform.

`target="tpu"` is the Mosaic kernel (pallas_tpu.py), `target="gpu"` the Triton kernel
(pallas_gpu.py). By default the target follows `jax.default_backend()`; on CPU the TPU kernel
runs in interpret mode (slow: for tests, not for speed).
"""

from __future__ import annotations

from functools import partial

import jax

from jlora.kernels.common import check_choice, validate_lora_args
from jlora.kernels.pallas_gpu import lora_delta_pallas_gpu
from jlora.kernels.pallas_tpu import lora_delta_pallas_tpu

TARGETS = ("tpu", "gpu")


def default_target() -> str:
    return "gpu" if jax.default_backend() in ("gpu", "cuda", "rocm") else "tpu"


@partial(jax.jit, static_argnames=("target", "interpret"))
def lora_delta_pallas(
    x: jax.Array,  # [T, D] f32/bf16
    a: jax.Array,  # [N, D, R]
    b: jax.Array,  # [N, R, O]
    slot_ids: jax.Array,  # i32[T], -1 = no adapter
    *,
    target: str | None = None,  # "tpu" | "gpu"; None = follow jax.default_backend()
    interpret: bool | None = None,  # None: interpret unless running on the target
) -> jax.Array:  # [T, O] in x.dtype
    validate_lora_args(x, a, b, slot_ids)
    target = target or default_target()
    check_choice("target", target, TARGETS)
    kernel = lora_delta_pallas_tpu if target == "tpu" else lora_delta_pallas_gpu
    return kernel(x, a, b, slot_ids, interpret=interpret)
