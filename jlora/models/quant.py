"""Weight storage formats: int8 per-output-channel weights, and bfloat16 on backends that emulate it.

**int8.** Every projection and the lm head is stored as symmetric int8 with one float32 scale per
output channel, in the Hugging Face [out, in] layout (the faster operand layout for XLA:CPU's int8
dot, measured 1.1-1.2x over [in, out]): `w[o, i] ~= q[o, i] * scale[o]`, `scale[o] =
max_i |w[o, i]| / 127` (a zero channel has scale 0 and q 0), `q = round_half_even(w / scale)`. The quantizer has a NumPy
reference (`quantize_np`, used at load time on Hugging Face [out, in] tensors) and a JAX twin
(`quantize`, used in the graph and by `quantize_model`); tests hold them equal. A `QArray`
carries `q` and `scale` through jit and `lax.scan` like any array. `linear(x, w)` multiplies by
a float or a quantized weight:
  * activations "int8" (W8A8): x is quantized per token inside the graph, the dot runs
    int8 x int8 -> int32, and the result is scaled by (token scale x channel scale). Picked by
    `int8` where the backend multiplies int8 natively (XLA:CPU, measured faster; TPU, whose v5e
    MXU runs int8 x int8 at twice its bf16 rate: `jlora bench tpu --quantization int8` measures it).
  * activations "float" (W8A16): the int8 weight is widened in the matmul and the channel scale
    applied to its output. Picked by `int8` on GPU, and by `int8-weight-only` everywhere.
LoRA A/B never go through here: they stay in the compute dtype.

**bfloat16 on XLA:CPU.** XLA:CPU has no native bf16 arithmetic: its float-normalization pass
rewrites bf16 gathers, scatters, dynamic slices and dots to f32 with converts around them, and
inside a `while` loop it hoists the convert of a whole loop-carried or loop-constant bf16 array
out of the loop. In the decoder's layer scan that meant converting every layer's stacked
weights, the LoRA slots and the whole KV cache to f32 on every layer of every step (measured:
a bf16 engine 10-23x slower than f32). So on CPU bf16 is a storage format only: arrays that enter
a loop or are indexed cross as their uint16 bit patterns (`to_bits`), integer ops slice and
scatter them, and `widen` turns the slice it needs into f32 (the compute dtype there). On
backends with native bf16 (TPU, GPU) none of this applies and bf16 is computed in bf16.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jlora.engine_args import QUANTIZATIONS
from jlora.models.config import FUSED_OF  # every projection's Hugging Face name -> its packed module

QMAX = 127  # symmetric: -127..127 (-128 unused, so negation is exact)
# scale = amax * (1/127) in float32, in both implementations: XLA rewrites a division by a constant
# into this multiplication, so the NumPy reference does the same to stay bit-equal.
INV_QMAX = np.float32(1.0 / QMAX)
HEAD_CHUNK = 4096  # vocabulary rows per lm-head step when the head must be widened chunk by chunk


# ---- the quantizer: NumPy reference and JAX twin ------------------------------------------------


def quantize_np(w: np.ndarray, axis: int = -1) -> tuple[np.ndarray, np.ndarray]:
    """Symmetric int8 over `axis` (the reduced one): (q i8[w.shape], scale f32[w.shape without axis]).

    For a Hugging Face weight [out, in] `axis=-1` gives one scale per output channel.
    """
    w = np.asarray(w, np.float32)
    amax = np.max(np.abs(w), axis=axis, keepdims=True)
    scale = amax * INV_QMAX
    safe = np.where(scale > 0, scale, np.float32(1.0))
    q = np.clip(np.rint(w / safe), -QMAX, QMAX).astype(np.int8)
    return q, np.squeeze(scale, axis=axis).astype(np.float32)


def quantize(x: jax.Array, axis: int = -1) -> tuple[jax.Array, jax.Array]:
    """`quantize_np` in JAX (same rounding, same zero handling): (q i8[x.shape], scale f32[...])."""
    x = x.astype(jnp.float32)
    amax = jnp.max(jnp.abs(x), axis=axis, keepdims=True)
    scale = amax * INV_QMAX
    safe = jnp.where(scale > 0, scale, 1.0)
    q = jnp.clip(jnp.round(x / safe), -QMAX, QMAX).astype(jnp.int8)
    return q, jnp.squeeze(scale, axis=axis)


def dequantize_np(q: np.ndarray, scale: np.ndarray, axis: int = -1) -> np.ndarray:
    return q.astype(np.float32) * np.expand_dims(scale, axis)


def check_quantization(quantization: str | None) -> str:
    """'none' for None; ValueError naming the argument for anything not in QUANTIZATIONS."""
    q = "none" if quantization is None else quantization
    if q not in QUANTIZATIONS:
        raise ValueError(f"quantization must be one of {list(QUANTIZATIONS)} or None, got {quantization!r}")
    return q


def int8_dot_is_fast(backend: str | None = None) -> bool:
    """XLA:CPU's int8 x int8 -> int32 dot beats its f32 dot (measured 1.4-2x at model shapes, AVX2);
    a TPU's MXU multiplies int8 natively (v5e: 394 TOPS against 197 TFLOP/s bf16; not yet measured
    in jlora: `jlora bench tpu --sections qmatmul`). GPU dequantizes in the matmul instead."""
    return (backend or jax.default_backend()) in ("cpu", "tpu")


def activation_mode(quantization: str, backend: str | None = None) -> str | None:
    """How a quantized linear treats its input: 'int8' (W8A8), 'float' (W8A16) or None (not quantized)."""
    quantization = check_quantization(quantization)
    if quantization == "none":
        return None
    if quantization == "int8" and int8_dot_is_fast(backend):
        return "int8"
    return "float"


# ---- quantized arrays in the graph --------------------------------------------------------------


@dataclasses.dataclass
class QArray:
    """A quantized weight, rows = output channels: q i8[..., out, in], scale f32[..., out]. `act` is static."""

    q: jax.Array
    scale: jax.Array
    act: str = "int8"  # "int8" (W8A8) or "float" (W8A16)

    @property
    def shape(self) -> tuple[int, ...]:
        return self.q.shape

    @property
    def nbytes(self) -> int:
        return int(self.q.nbytes + self.scale.nbytes)


jax.tree_util.register_dataclass(QArray, data_fields=["q", "scale"], meta_fields=["act"])


def _dot_rows(x: jax.Array, rows: jax.Array, acc: Any) -> jax.Array:  # x [..., in] . rows [out, in] -> [..., out]
    return jax.lax.dot_general(x, rows, (((x.ndim - 1,), (1,)), ((), ())), preferred_element_type=acc)


def linear(x: jax.Array, w: jax.Array | QArray, out_dtype: Any = None) -> jax.Array:
    """x [..., in] @ w -> [..., out] in `out_dtype` (default x.dtype). w: a float [in, out] (f32
    accumulation) or a QArray q [out, in] (int32 accumulation for W8A8)."""
    out_dtype = out_dtype or x.dtype
    if not isinstance(w, QArray):
        return jnp.dot(x, w, preferred_element_type=jnp.float32).astype(out_dtype)
    if w.act == "int8":
        xq, sx = quantize(x, axis=-1)  # per token
        acc = _dot_rows(xq, w.q, jnp.int32)
        return (acc.astype(jnp.float32) * sx[..., None] * w.scale).astype(out_dtype)
    wide = w.q.astype(jnp.float32 if x.dtype == jnp.float32 else x.dtype)
    return (_dot_rows(x, wide, jnp.float32) * w.scale).astype(out_dtype)


# ---- bfloat16 as bits on backends that emulate it --------------------------------------------------


def bf16_as_bits(backend: str | None = None) -> bool:
    """Whether bf16 arrays cross loops and indexing as uint16 bits here (XLA:CPU; see the module doc)."""
    return (backend or jax.default_backend()) == "cpu"


def to_bits(tree: Any) -> Any:
    """Every bf16 array in `tree` as its uint16 bits, where `bf16_as_bits()`; anything else unchanged."""
    if not bf16_as_bits():
        return tree

    def one(x: Any) -> Any:
        if isinstance(x, jax.Array) and x.dtype == jnp.bfloat16:
            return jax.lax.bitcast_convert_type(x, jnp.uint16)
        return x

    return jax.tree.map(one, tree)


def _on_bits(tree: Any, fn: Any) -> Any:
    """`fn(bf16 array)` for every uint16 (bf16 bits) array in `tree`; QArrays and the rest unchanged."""

    def one(x: Any) -> Any:
        if isinstance(x, jax.Array) and x.dtype == jnp.uint16:
            return fn(jax.lax.bitcast_convert_type(x, jnp.bfloat16))
        return x

    return jax.tree.map(one, tree, is_leaf=lambda v: isinstance(v, QArray))


def from_bits(tree: Any) -> Any:
    """`to_bits` undone: uint16 arrays back to bf16 (a bitcast, no conversion)."""
    return _on_bits(tree, lambda b: b)


def widen(tree: Any) -> Any:
    """uint16 bf16 bits -> f32 (the compute dtype where bf16 is stored as bits); others unchanged."""
    return _on_bits(tree, lambda b: b.astype(jnp.float32))


def like(x: jax.Array, ref: jax.Array) -> jax.Array:
    """x (maybe bits) back in `ref`'s dtype: bf16 where `ref` is bf16, bits where `ref` is bits."""
    return from_bits(x) if ref.dtype == jnp.bfloat16 and x.dtype == jnp.uint16 else x


def storage_dtype(dtype: Any) -> Any:
    """The dtype arrays of `dtype` are kept in on this backend: uint16 bits for bf16 on XLA:CPU."""
    return jnp.uint16 if jnp.dtype(dtype) == jnp.bfloat16 and bf16_as_bits() else dtype


def to_storage(x: Any) -> Any:
    """A host or device array in its storage dtype (`storage_dtype`): bf16 becomes its uint16 bits
    (a NumPy view, no copy, for host arrays)."""
    if jnp.dtype(x.dtype) != jnp.bfloat16 or not bf16_as_bits():
        return x
    if isinstance(x, np.ndarray):
        return x.view(np.uint16)
    return jax.lax.bitcast_convert_type(x, jnp.uint16)


def narrow(x: jax.Array, like: jax.Array) -> jax.Array:
    """x cast to the storage of `like` (bf16 bits when `like` is uint16), for scatters into it."""
    if like.dtype == jnp.uint16:
        return jax.lax.bitcast_convert_type(x.astype(jnp.bfloat16), jnp.uint16)
    return x.astype(like.dtype)


# ---- embedding and lm head -------------------------------------------------------------------------


def embed(table: jax.Array | QArray, tokens: jax.Array) -> jax.Array:
    """Rows of the embedding table [V, D] (a QArray here holds q [V, D], scale [V]); float output
    (f32 where bf16 is stored as bits)."""
    if isinstance(table, QArray):
        return table.q[tokens].astype(jnp.float32) * table.scale[tokens][..., None]
    return widen(to_bits(table)[tokens])


def lm_head(x: jax.Array, rows: jax.Array | QArray) -> jax.Array:
    """Logits f32[..., V] = x [..., D] @ rows [V, D]^T (the tied embedding, or the head transposed;
    a QArray holds q [V, D] and one scale per vocabulary row).

    Direct dot for float32, W8A8, and W8A16 off the CPU (XLA:TPU and XLA:GPU fuse the int8
    widening into the dot). On XLA:CPU a head that must be widened (bf16 stored as bits, W8A16) is
    widened HEAD_CHUNK rows at a time inside a scan, so the whole [V, D] table is never converted.
    (On a v5e chip the scan cost the 8B's int8 head a relayout copy of all 0.53 GB every step,
    1.6 ms of a 19.5 ms decode step: its 4,008-row chunks do not tile int8's 32 sublanes.)
    """
    if isinstance(rows, QArray):
        if rows.act == "int8" or not bf16_as_bits():
            return linear(x, rows, jnp.float32)
        return _chunked_head(x, rows.q, rows.scale)
    bits = to_bits(rows)
    if bits.dtype == jnp.uint16:
        return _chunked_head(x, bits, None)
    return jnp.dot(x, rows.T, preferred_element_type=jnp.float32)


def head_rows(model: Any) -> jax.Array | QArray:
    """The lm head of a `Llama` as rows [V, D] for `lm_head`: the tied embedding, or lm_head [D, V]
    transposed (a QArray keeps its per-vocabulary-row scales)."""
    if model.cfg.tie_word_embeddings:
        return weight(model, "embed_tokens")
    w = weight(model, "lm_head")  # float [D, V], or a QArray [V, D]
    return w if isinstance(w, QArray) else w.T


def _chunked_head(x: jax.Array, rows: jax.Array, scale: jax.Array | None) -> jax.Array:
    v, d = rows.shape
    c = next(c for c in range(min(HEAD_CHUNK, v), 0, -1) if v % c == 0)  # the largest divisor of V that fits
    lead = x.shape[:-1]
    xf = x.reshape(-1, d).astype(jnp.float32)

    def body(_, chunk):
        r = chunk[0]
        w = r.astype(jnp.float32) if r.dtype == jnp.int8 else widen(r).astype(jnp.float32)
        y = jax.lax.dot_general(xf, w, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
        return None, y if scale is None else y * chunk[1]

    chunks = (rows.reshape(v // c, c, d), None if scale is None else scale.reshape(v // c, c))
    _, ys = jax.lax.scan(body, None, chunks)  # [V/c, T, c]
    return jnp.moveaxis(ys, 0, 1).reshape(*lead, v)


# ---- quantizing a model or a checkpoint ------------------------------------------------------------


def quantize_model(model: Any, quantization: str | None, backend: str | None = None) -> Any:
    """Replaces, in place, a float `Llama`'s projections (and its lm head, or the tied embedding)
    with int8 weights and per-output-channel scales (`<name>_scale` beside each); returns it.

    Works under `nnx.eval_shape` (the loaders build the abstract quantized model this way).
    """
    from flax import nnx

    act = activation_mode(quantization, backend)
    if act is None:
        return model
    layers = model.layers
    for name in model.cfg.packed_shapes():  # the fused GEMMs: qkv_proj, o_proj, gate_up_proj, down_proj
        q, s = quantize(jnp.swapaxes(getattr(layers, name)[...], -1, -2), axis=-1)  # [L, in, out] -> [L, out, in]
        setattr(layers, name, nnx.Param(q))
        setattr(layers, name + "_scale", nnx.Param(s))
    if model.cfg.tie_word_embeddings:  # [V, D]: per vocabulary row = per lm-head output channel
        q, s = quantize(model.embed_tokens[...], axis=-1)
        model.embed_tokens, model.embed_tokens_scale = nnx.Param(q), nnx.Param(s)
    else:  # lm_head [D, V] -> [V, D]
        q, s = quantize(model.lm_head[...].T, axis=-1)
        model.lm_head, model.lm_head_scale = nnx.Param(q), nnx.Param(s)
    layers.quant_act = model.quant_act = act
    model.quantization = check_quantization(quantization)
    return model


def weight(module: Any, name: str) -> jax.Array | QArray:
    """`module.<name>` as an array, or a QArray when `module.<name>_scale` exists."""
    w = getattr(module, name)[...]
    scale = getattr(module, name + "_scale", None)
    return w if scale is None else QArray(w, scale[...], getattr(module, "quant_act", "int8"))


def quantized_tensor_names(names: Any, tied: bool) -> list[str]:
    """The Hugging Face tensors that int8 quantization replaces: every projection, and the lm head
    (the token embedding when the two are tied)."""
    head = "model.embed_tokens.weight" if tied else "lm_head.weight"
    return [n for n in names
            if n == head or (n.endswith(".weight") and n.rsplit(".", 2)[-2] in FUSED_OF)]


def scale_name(name: str) -> str:
    return name + "_scale"


def prepare_tensors(tensors: dict[str, np.ndarray], tied: bool, dtype: Any, quantization: str | None
                    ) -> dict[str, np.ndarray]:
    """Checkpoint tensors (HF names, [out, in], any float dtype) -> the stored form: quantized ones
    as int8 + `<name>_scale` f32[out] (from their float32 values), the rest cast to `dtype` (None:
    left as they are). Tensors that already have a `<name>_scale` are kept as they are."""
    np_dtype = None if dtype is None else np.dtype(dtype)
    quantized = set(quantized_tensor_names(tensors, tied)) if check_quantization(quantization) != "none" else set()
    out: dict[str, np.ndarray] = {}
    for name, arr in tensors.items():
        if name in out:
            continue
        if name.endswith("_scale") or scale_name(name) in tensors:  # already in the stored form
            out[name] = arr
        elif name in quantized:
            out[name], out[scale_name(name)] = quantize_np(np.asarray(arr, np.float32), axis=-1)
        else:
            out[name] = arr if np_dtype is None else np.asarray(arr).astype(np_dtype, copy=False)
    return out


def scale_table(table: dict[str, tuple[Any, ...]], flat_paths: Any) -> dict[str, tuple[Any, ...]]:
    """Entries for `<name>_scale` tensors beside every entry of an HF name table whose parameter has a
    `<param>_scale` sibling in the model (`flat_paths`). A scale is per output channel: no transpose,
    and a sub-module's scales go to its output channels of the packed module (the same columns)."""
    paths = set(flat_paths)
    out = {}
    for name, (path, layer, _, cols) in table.items():
        sp = path[:-1] + (path[-1] + "_scale",)
        if sp in paths:
            out[scale_name(name)] = (sp, layer, False, cols)
    return out
