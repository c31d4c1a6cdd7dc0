"""DoRA (weight-decomposed LoRA) as a per-slot, per-output-column factor.

PEFT's DoRA layer (peft/tuners/lora/dora.py, `DoraLinearLayer`, peft 0.21) computes in eval mode

    norm   = ||W + s B A||  over the input axis, one value per output feature (torch.linalg.norm(dim=1)
             of the [out, in] weight), detached
    factor = m / norm       (m = lora_magnitude_vector [out])
    y      = base(x) + (factor - 1) * (x W^T) + factor * s * B A x  =  factor * (x W^T + s B A x) + bias

(dropout is the identity in eval, so `base_result` is the base layer's output with its bias taken
off and added back). Nothing in `factor` depends on x: it is known when an adapter is written into
a slot. So a slot carries `M = factor - 1` per output column (0 for plain adapters, for columns of
sub-modules or layers without DoRA, and for empty slots), and a row multiplies its projection,
base plus LoRA delta, by 1 + M[its slot] (`jlora.models.llama.lora_linear`): no per-step norm, no
extra graph, and every `lora_impl` gives the same result since the factor is applied outside the
kernel.

The norm is taken of the weights the engine multiplies by: the base weight as held (a GGUF file's
weights dequantized to the compute dtype; int8 weights as int8 values times their scales) plus the
slot's A and B as stored (bf16 slots: their bf16 values), in float32. PEFT takes the norm of its
own float weight, so on an int8 engine the factor belongs to the quantized base (the same
rounding the base projection sees).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from jlora.kernels.common import expand_splits
from jlora.models import quant


def _dense(w: Any) -> jax.Array:  # one layer's weight: float [in, out] (maybe bf16 bits) or QArray -> f32[in, out]
    if isinstance(w, quant.QArray):  # q i8[out, in], scale f32[out]
        return (w.q.astype(jnp.float32) * w.scale.astype(jnp.float32)[:, None]).T
    return quant.widen(w).astype(jnp.float32)


def dora_factor(
    w: jax.Array | quant.QArray,  # the base weight, [L, in, out] (a QArray: q [L, out, in])
    a: jax.Array,  # [L, in, S*R] the slot's A as stored
    b: jax.Array,  # [L, R, out] the slot's B as stored (PEFT scale folded in)
    magnitude: jax.Array,  # f32[L, out]: PEFT's lora_magnitude_vector, NaN = no DoRA in that column
    splits: tuple[int, ...] | None,  # packed module: the sub-modules' output widths (per shard)
) -> jax.Array:  # f32[L, out]: m / ||W + s B A||_col - 1, 0 where magnitude is NaN
    """The DoRA factor minus one for one slot of one packed module. Plain writes (every magnitude
    NaN) skip the norm (a conditional): they never read the base weight."""
    dora = ~jnp.isnan(magnitude)

    def norms() -> jax.Array:
        def one(args):  # one layer at a time: W + delta is [in, out] once, not [L, in, out]
            w_l, a_l, b_l = args
            a_l, b_l = quant.widen(a_l).astype(jnp.float32), quant.widen(b_l).astype(jnp.float32)
            delta = expand_splits(a_l, b_l, splits,
                                  lambda h, bb: jnp.dot(h, bb, precision=jax.lax.Precision.HIGHEST))
            return jnp.sqrt(jnp.sum(jnp.square(_dense(w_l) + delta), axis=0))

        norm = jax.lax.map(one, (w, a, b))  # [L, out]
        return jnp.where(dora, jnp.where(dora, magnitude, 0.0) / norm - 1.0, 0.0)

    return jax.lax.cond(jnp.any(dora), norms, lambda: jnp.zeros(magnitude.shape, jnp.float32))
