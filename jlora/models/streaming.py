"""The streaming weight loader: checkpoint tensors to device arrays one layer at a time.

Every tensor goes from its source (`jlora.models.tensors`: an mmap of a safetensors file, GGUF blocks,
an array) straight to the parameter's storage dtype (the compute dtype, or int8 + per-channel scales)
and onto the device(s). Stacked [L, ...] parameters are allocated once on the device(s), zeroed, and
each layer is written into them by one jitted, donated update (one graph for all layers; the
transposes of float projections run there, on the device). With several devices each receives only
its shard: `jax.make_array_from_callback` asks for each device's slice, which is read from the
source rows that slice needs, already in the tensor-parallel layout (shard-major packed columns,
KV heads repeated: `jlora.models.tensor_parallel`). No float32 copy of the checkpoint is made:
host memory above the mmap is about one layer's tensors (the largest non-layer tensor, the
embedding or lm head, when that is bigger), and the file's pages are handed back after each layer.
"""

from __future__ import annotations

import dataclasses
import resource
import sys
import time
from typing import Any, Callable, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import PartitionSpec as P

from jlora.models import quant
from jlora.models.config import PACKED_MODULES, LlamaConfig
from jlora.models.llama import LORA_MODULES, Llama, rope_inv_freq
from jlora.models.tensor_parallel import TensorParallel, packed_columns, weight_spec
from jlora.models.tensors import ArrayTensor, Cast, Tensor, _threads, as_tensor, nbytes, prefetch, quantized

Entry = tuple  # (path: tuple, layer: int | None, transpose: bool, columns: (start, stop) | None)


def hf_name_table(cfg: LlamaConfig) -> dict[str, Entry]:
    """HF tensor name -> (path in the NNX state, layer index or None, transpose?, columns) for every
    weight.

    Per-layer weights land at `layer` in the stacked [L, ...] parameter at `path`; `columns`
    (start, stop) places a sub-module in its packed module's output columns (q, k, v in
    `qkv_proj`, gate, up in `gate_up_proj`), None is the whole parameter.
    """
    table: dict[str, Entry] = {
        "model.embed_tokens.weight": (("embed_tokens",), None, False, None),
        "model.norm.weight": (("norm", "weight"), None, False, None),
    }
    if not cfg.tie_word_embeddings:
        table["lm_head.weight"] = (("lm_head",), None, True, None)
    shapes = cfg.module_shapes()
    columns = {}
    for fused, subs in PACKED_MODULES.items():
        start = 0
        for sub in subs:
            width = shapes[sub][1]
            columns[sub] = (fused, (start, start + width) if len(subs) > 1 else None)
            start += width
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        for sub in LORA_MODULES:
            fused, cols = columns[sub]
            parent = "mlp" if sub in PACKED_MODULES["gate_up_proj"] + PACKED_MODULES["down_proj"] else "self_attn"
            table[p + f"{parent}.{sub}.weight"] = (("layers", fused), i, True, cols)
        table[p + "input_layernorm.weight"] = (("layers", "input_layernorm"), i, False, None)
        table[p + "post_attention_layernorm.weight"] = (("layers", "post_attention_layernorm"), i, False, None)
        if cfg.qkv_bias:  # base-only biases, in qkv_proj's column order
            for sub in PACKED_MODULES["qkv_proj"]:
                table[p + f"self_attn.{sub}.bias"] = (("layers", "qkv_bias"), i, False, columns[sub][1])
        if cfg.o_bias:
            table[p + "self_attn.o_proj.bias"] = (("layers", "o_bias"), i, False, None)
        if cfg.qk_norm:
            table[p + "self_attn.q_norm.weight"] = (("layers", "q_norm"), i, False, None)
            table[p + "self_attn.k_norm.weight"] = (("layers", "k_norm"), i, False, None)
    return table


def prepare(tensors: Mapping[str, Any], tied: bool, dtype: Any, quantization: str | None) -> dict[str, Tensor]:
    """`quant.prepare_tensors` without reading anything: quantized projections become (int8, scale)
    tensors, the rest `Cast` to `dtype` (None: as they are); tensors with a `<name>_scale` beside them
    are already in the stored form (a weights-cache entry)."""
    np_dtype = None if dtype is None else np.dtype(dtype)
    names = set(quant.quantized_tensor_names(tensors, tied)) if quant.check_quantization(quantization) != "none" else set()
    out: dict[str, Tensor] = {}
    for name, t in tensors.items():
        if name in out:
            continue
        t = as_tensor(t)
        if name.endswith("_scale") or quant.scale_name(name) in tensors:
            out[name] = t
        elif name in names:
            out[name], out[quant.scale_name(name)] = quantized(t)
        else:
            out[name] = t if np_dtype is None else Cast(t, np_dtype)
    return out


# ---- host memory --------------------------------------------------------------------------------------


def host_rss_bytes() -> int:
    """This process's resident set now (Linux /proc; elsewhere its peak so far)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * resource.getpagesize()
    except (OSError, ValueError, IndexError):
        return peak_rss_bytes()


def peak_rss_bytes() -> int:
    """The process's peak resident set: Linux's VmHWM, else getrusage's maxrss.

    On Linux getrusage's maxrss is max(VmHWM, the RSS of the process image before exec): a process
    started from a big parent (a test runner) reports the parent's size, and clear_refs cannot
    reset that part. VmHWM is this process's own high-water mark."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)


def reset_peak_rss() -> bool:
    """Start a new peak (Linux: /proc/self/clear_refs 5 resets VmHWM to the RSS now).
    False where it cannot: the peak then also covers what came before."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


@dataclasses.dataclass(frozen=True)
class LoadStats:
    """What one load cost the host: `peak_rss_bytes` is the process's peak resident set during the load
    (mmapped file pages included while they were resident), `rss_before_bytes` the resident set when it
    began, so `peak_rss_bytes - rss_before_bytes` is what loading added at its peak. `peak_reset`: False
    when the peak could not be restarted at the load (it then may come from earlier)."""

    seconds: float
    rss_before_bytes: int
    peak_rss_bytes: int
    peak_reset: bool
    source: str  # "checkpoint", "gguf", "weights_cache", "orbax"

    @property
    def peak_added_bytes(self) -> int:
        return self.peak_rss_bytes - self.rss_before_bytes

    def to_dict(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "peak_added_bytes": self.peak_added_bytes}


# ---- the plan: one entry per model parameter ---------------------------------------------------------


@dataclasses.dataclass
class _Param:
    key: str  # "layers.qkv_proj"
    path: tuple[Any, ...]
    shape: tuple[int, ...]  # stored (layout) shape, [L, ...] when layered
    stored: np.dtype  # the parameter's dtype (bf16 here, its uint16 bits on the device on XLA:CPU)
    layered: bool
    transpose: bool  # stored as the transpose of the HF [out, in] orientation (float projections, lm head)
    spec: P  # of the stored array
    perm: np.ndarray | None  # stored output row -> logical output row (tensor-parallel layout)
    parts: dict[int | None, list[tuple[str, int, int]]]  # layer -> [(tensor, first logical row, end)]

    @property
    def piece_shape(self) -> tuple[int, ...]:  # one layer (or the whole parameter), HF orientation
        s = self.shape[1:] if self.layered else self.shape
        return tuple(reversed(s)) if self.transpose else tuple(s)

    @property
    def piece_spec(self) -> P:
        entries = list(self.spec) + [None] * (len(self.shape) - len(self.spec))
        if self.layered:
            entries = entries[1:]
        return P(*(reversed(entries) if self.transpose else entries))


def _plan(cfg: LlamaConfig, tensors: Mapping[str, Tensor], logical: Any, layout: Any,
          tp: TensorParallel) -> dict[str, _Param]:
    """Checks every tensor against the model (names, shapes) before anything is read, and plans
    where each one's rows go."""
    flat = {path: v.get_value() for path, v in nnx.to_flat_state(nnx.state(logical, nnx.Param))}
    flat_layout = {path: v.get_value() for path, v in nnx.to_flat_state(nnx.state(layout, nnx.Param))}
    table = hf_name_table(cfg)
    table.update(quant.scale_table(table, flat))
    ignored = {"lm_head.weight"} if cfg.tie_word_embeddings else set()
    unknown = sorted(k for k in tensors if k not in table and k not in ignored and "rotary_emb" not in k)
    if unknown:
        raise ValueError(f"checkpoint has tensors this Llama does not use: {unknown[:5]}")
    params: dict[str, _Param] = {}
    for name, (path, layer, transpose, cols) in table.items():
        if name not in tensors:
            raise ValueError(f"checkpoint is missing tensor {name!r}")
        stored = np.dtype(flat[path].dtype)
        int8 = stored == np.int8
        transpose = transpose and not int8  # int8 weights keep the HF [out, in] layout
        logical_shape = flat[path].shape[1:] if layer is not None else flat[path].shape
        expected = list(reversed(logical_shape) if transpose else logical_shape)  # HF orientation: out first
        if cols is not None:
            expected[0] = cols[1] - cols[0]
        if tuple(tensors[name].shape) != tuple(expected):
            raise ValueError(f"tensor {name!r} has shape {tuple(tensors[name].shape)}, expected {tuple(expected)}")
        key = ".".join(str(p) for p in path)
        if key not in params:
            pname = str(path[-1])
            shape = tuple(flat_layout[path].shape)
            module = "qkv_proj" if pname == "qkv_bias" else pname.removesuffix("_scale")
            perm = packed_columns(cfg, tp.size, module) if tp.size > 1 else None
            params[key] = _Param(key, path, shape, stored, layer is not None, transpose,
                                 weight_spec(pname, shape, int8, tp.size), perm, {})
        start, stop = cols if cols is not None else (0, expected[0])
        params[key].parts.setdefault(layer, []).append((name, start, stop))
    return params


def _cast(x: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """x as `dtype` (through float32 for other float pairs, as `Cast`), in its storage form (bf16 as
    its uint16 bits on XLA:CPU)."""
    if x.dtype != dtype:
        if x.dtype != np.float32 and dtype != np.float32:
            x = x.astype(np.float32)
        x = x.astype(dtype)
    return quant.to_storage(x)


def _contiguous(sel: np.ndarray) -> slice | np.ndarray:
    if sel.size and sel[-1] - sel[0] + 1 == sel.size and np.all(np.diff(sel) == 1):
        return slice(int(sel[0]), int(sel[-1]) + 1)
    return sel


_COPY_CHUNK_BYTES = 4 << 20  # the packed modules' host copies, a chunk a task of `tensors._threads()`


def _shard_fn(param: _Param, parts: list[tuple[str, int, int]], tensors: Mapping[str, Tensor],
              reads: list[tuple[str, tuple[int, ...], tuple[int, ...]]] | None) -> Callable[[tuple[slice, ...]], np.ndarray]:
    """The callback that builds one device's slice of one layer (or non-layer parameter) in the HF
    orientation: the logical rows the slice holds, gathered from the sub-module tensors."""
    shape = param.piece_shape

    def shard(index: tuple[slice, ...]) -> np.ndarray:
        rows = np.arange(shape[0])[index[0]]
        logical = param.perm[rows] if param.perm is not None else rows
        rest = tuple(index[1:])
        out_shape = (len(rows),) + tuple(len(range(*s.indices(n))) for s, n in zip(rest, shape[1:]))
        if reads is not None:
            reads.append((param.key, shape, out_shape))
        if len(parts) == 1 and parts[0][1] == 0:  # one tensor: read its rows directly
            name = parts[0][0]
            x = tensors[name].rows(_contiguous(logical))
            return _cast(x[(slice(None),) + rest] if rest else x, param.stored)
        out = np.empty(out_shape, np.dtype(quant.storage_dtype(param.stored)))
        jobs = []  # (sub-module, its rows, where they go in `out`), cut into ~4 MB row chunks
        for name, start, stop in parts:
            mask = (logical >= start) & (logical < stop)
            if not mask.any():
                continue
            src, dst = logical[mask] - start, np.flatnonzero(mask)
            step = max(1, _COPY_CHUNK_BYTES // max(1, out[:1].nbytes))
            jobs += [(name, src[i:i + step], dst[i:i + step]) for i in range(0, len(src), step)]

        def fill(job: tuple[str, np.ndarray, np.ndarray]) -> None:
            name, src, dst = job
            x = tensors[name].rows(_contiguous(src))
            out[_contiguous(dst)] = _cast(x[(slice(None),) + rest] if rest else x, param.stored)

        # A packed module (q|k|v, gate|up) is assembled on the host: a copy of every byte, faulting in
        # both the file's pages and the new array's (1.3 s of a 2.3 s warm load of the 1B shape on a v5e
        # host, one thread). NumPy copies without the GIL, so the chunks are copied side by side;
        # only for in-memory tensors (the quantizing and GGUF readers keep per-tensor state).
        if len(jobs) > 1 and all(isinstance(tensors[name], ArrayTensor) for name, _, _ in jobs):
            list(_threads().map(fill, jobs))
        else:
            for job in jobs:
                fill(job)
        return out

    return shard


# ---- the loader ----------------------------------------------------------------------------------------


def stream_model(
    cfg: LlamaConfig,
    tensors: Mapping[str, Any],
    dtype: Any = jnp.float32,
    quantization: str | None = None,
    devices: Sequence[Any] | None = None,
    reads: list[tuple[str, tuple[int, ...], tuple[int, ...]]] | None = None,
) -> Llama:
    """An NNX Llama holding `tensors` (HF names, [out, in] layout; arrays or `jlora.models.tensors`
    tensors, read only here, a layer at a time); every tensor checked by name and shape first.

    `quantization` ("int8", "int8-weight-only"): projections and the lm head become int8 with
    per-output-channel scales; tensors that come with a `<name>_scale` are used as they are.
    `devices`: the devices to place it on (default: the first device). Several: the arrays are laid
    out and sharded for a tensor-parallel mesh over them (`jlora.models.tensor_parallel`), each device
    receiving only its shard; the model's config stays the logical one and `placed_on` records the
    devices, so the runner of that mesh uses its arrays as they are (`ModelRunner`). Such a model
    (`layout_shards` = k) can also be called directly when k divides the KV heads; when KV heads are
    repeated (k > KV heads) only through the engine, whose runner swaps in the repeated-heads config.
    `reads` (for tests): each device slice built is appended as (parameter, layer's shape, slice shape).
    """
    from jlora import compile_stats

    with compile_stats.stage("load"):  # its few graphs (zeros, the layer write) get their own row
        return _stream(cfg, tensors, dtype, quantization, devices, reads)


def _stream(cfg: LlamaConfig, tensors: Mapping[str, Any], dtype: Any, quantization: str | None,
            devices: Sequence[Any] | None, reads: list | None) -> Llama:
    quantization = quant.check_quantization(quantization)
    src = prepare(tensors, cfg.tie_word_embeddings, None, quantization)
    devices = list(devices) if devices else jax.devices()[:1]
    tp = TensorParallel.create(cfg, devices)

    def abstract(c: LlamaConfig) -> Llama:
        return nnx.eval_shape(lambda: quant.quantize_model(Llama(c, dtype=dtype, rngs=nnx.Rngs(0)), quantization))

    logical = abstract(cfg)
    model = logical if tp.layout_cfg == cfg else abstract(tp.layout_cfg)
    params = _plan(cfg, src, logical, model, tp)

    def array(p: _Param, layer: int | None) -> jax.Array:
        fn = _shard_fn(p, p.parts[layer], src, reads)
        return jax.make_array_from_callback(p.piece_shape, tp.sharding(p.piece_spec), fn)

    def release(layer: int | None, ps: list[_Param]) -> None:
        for p in ps:
            for name, _, _ in p.parts[layer]:
                src[name].release()

    values: dict[str, jax.Array] = {}
    for p in (p for p in params.values() if not p.layered):
        x = array(p, None)
        if p.transpose:  # the float lm head: [V, D] from the file, stored [D, V]
            x = jax.jit(lambda a: a.T, out_shardings=tp.sharding(p.spec))(x)
        values[p.key] = jax.block_until_ready(x)
        release(None, [p])

    layered = [p for p in params.values() if p.layered]
    if layered:
        storage = {p.key: np.dtype(quant.storage_dtype(p.stored)) for p in layered}
        stack_shardings = {p.key: tp.sharding(p.spec) for p in layered}
        zeros = jax.jit(lambda: {p.key: jnp.zeros(p.shape, storage[p.key]) for p in layered},
                        out_shardings=stack_shardings)
        transposed = {p.key: p.transpose for p in layered}

        def write(stacks: dict[str, jax.Array], pieces: dict[str, jax.Array], i: jax.Array) -> dict[str, jax.Array]:
            return {k: jax.lax.dynamic_update_index_in_dim(s, pieces[k].T if transposed[k] else pieces[k], i, 0)
                    for k, s in stacks.items()}

        write_layer = jax.jit(write, donate_argnums=(0,), out_shardings=stack_shardings)
        stacks = zeros()
        for i in range(cfg.num_hidden_layers):
            if i + 1 < cfg.num_hidden_layers:  # the disk reads the next layer while this one is placed
                for p in layered:
                    for name, _, _ in p.parts[i + 1]:
                        prefetch(src[name])
            pieces = {p.key: array(p, i) for p in layered}
            stacks = write_layer(stacks, pieces, np.int32(i))  # a host scalar: fine under jax.distributed too
            jax.block_until_ready(stacks)  # one layer in flight: host memory stays at one layer
            del pieces
            release(i, layered)
        values.update(stacks)

    flat = dict(nnx.to_flat_state(nnx.state(model, nnx.Param)))
    for p in params.values():
        flat[p.path].set_value(values[p.key])
    nnx.update(model, nnx.from_flat_state(flat))
    model.inv_freq = nnx.Variable(tp.put(rope_inv_freq(cfg)))  # eval_shape left it abstract
    model.cfg = cfg
    model.layout_shards = tp.size
    model.placed_on = tuple(devices)
    return model


def tensors_nbytes(tensors: Mapping[str, Any]) -> int:
    return sum(nbytes(t) for t in tensors.values())


def timed_load(load: Callable[[], Any], source: str) -> tuple[Any, LoadStats]:
    """`load()` with the time and host memory it took (`LoadStats`)."""
    before = host_rss_bytes()
    reset = reset_peak_rss()
    t0 = time.perf_counter()
    out = load()
    seconds = time.perf_counter() - t0
    return out, LoadStats(seconds, before, max(peak_rss_bytes(), before), reset, source)
