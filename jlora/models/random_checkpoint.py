"""Random-weight Llama checkpoints of real shapes, written and loaded without torch (benchmarks, tests).

    write_random_checkpoint(path, "8b")   an HF directory (config.json, sharded safetensors + index),
                                          written one tensor at a time: an 8B checkpoint needs ~1 GB of RAM
    write_random_checkpoint(path, bench_config("llama-3.1-8b"), fill="pool")
                                          a benchmark's named shape, at the disk's speed
    measure_load(path, quantization=...)  the streaming loader on it: (model, {seconds, peak RSS, ...})

The values are N(0, std) (norm weights 1), drawn in row blocks on threads (`fill="normal"`), or
runs of one pool of such draws from random offsets (`fill="pool"`: no draw per value, so the 16 GB
of an 8B checkpoint go at the disk's speed; rows repeat, which ties logits where that matters).
Only their shapes and dtypes are meaningful.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from jlora.models.tensors import _threads, nbytes

# Hugging Face config.json fields of the Llama 3.x shapes (config values as the released models).
_LLAMA3_ROPE = {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192}
LLAMA_SHAPES: dict[str, dict[str, Any]] = {
    "1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
               num_key_value_heads=8, head_dim=64, tie_word_embeddings=True, rope_scaling=_LLAMA3_ROPE),
    "3b": dict(hidden_size=3072, intermediate_size=8192, num_hidden_layers=28, num_attention_heads=24,
               num_key_value_heads=8, head_dim=128, tie_word_embeddings=True, rope_scaling=_LLAMA3_ROPE),
    "8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
               num_key_value_heads=8, head_dim=128, tie_word_embeddings=False,
               rope_scaling={**_LLAMA3_ROPE, "factor": 8.0}),
}
# The benchmarks' named shapes (`jlora bench tpu --shape`, the chip check, `jlora bench prefix`):
# HF config fields with a word-level tokenizer's ids (`bench_config`). 1B and 3B with a 49,152-token
# vocabulary, as docs/tpu.md's measurements were made; SmolLM2-135M's; "tiny" for CPU dry runs.
NAMED_SHAPES: dict[str, dict[str, Any]] = {
    "llama-3.2-1b": {**{k: v for k, v in LLAMA_SHAPES["1b"].items() if k != "rope_scaling"}, "vocab_size": 49152},
    "llama-3.2-3b": {**{k: v for k, v in LLAMA_SHAPES["3b"].items() if k != "rope_scaling"}, "vocab_size": 49152},
    "llama-3.1-8b": {**{k: v for k, v in LLAMA_SHAPES["8b"].items() if k != "rope_scaling"}, "vocab_size": 128256},
    "smollm2-135m": dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                         num_key_value_heads=3, head_dim=64, vocab_size=49152, tie_word_embeddings=True),
    "tiny": dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=32, vocab_size=512, tie_word_embeddings=True),
}
_COMMON = dict(model_type="llama", architectures=["LlamaForCausalLM"], vocab_size=128256, rms_norm_eps=1e-5,
               rope_theta=500000.0, max_position_embeddings=131072, bos_token_id=128000, eos_token_id=128001,
               hidden_act="silu", attention_bias=False, mlp_bias=False)
ROW_BLOCK = 1024  # rows drawn per task


class RandomTensor:
    """N(0, std) values of `shape` in `dtype` (ones when std is None), drawn when read."""

    def __init__(self, shape: tuple[int, ...], dtype: Any, seed: int, std: float | None):
        self.shape, self.dtype, self.seed, self.std = tuple(shape), np.dtype(dtype), seed, std

    def rows(self, index: Any = slice(None)) -> np.ndarray:
        if self.std is None:
            return np.ones(self.shape, self.dtype)[index]
        out = np.empty(self.shape, self.dtype)
        flat = out.reshape(self.shape[0], -1) if self.shape else out.reshape(1, 1)
        seeds = np.random.SeedSequence(self.seed).spawn(-(-flat.shape[0] // ROW_BLOCK))

        def block(j: int) -> None:  # one generator per block: blocks draw in parallel, reproducibly
            rng = np.random.default_rng(seeds[j])
            part = flat[j * ROW_BLOCK:(j + 1) * ROW_BLOCK]
            part[...] = (rng.standard_normal(part.shape, np.float32) * np.float32(self.std)).astype(self.dtype)

        list(_threads().map(block, range(len(seeds))))
        return out[index]

    def release(self) -> None:
        pass


def random_config(shape: str | dict[str, Any]) -> dict[str, Any]:
    """The config.json dict of a named shape ("1b", "3b", "8b") or of HF fields given as a dict."""
    if isinstance(shape, str):
        if shape not in LLAMA_SHAPES:
            raise ValueError(f"shape must be one of {sorted(LLAMA_SHAPES)} or a dict of config.json fields, got {shape!r}")
        return {**_COMMON, **LLAMA_SHAPES[shape]}
    return {**_COMMON, **shape}


def bench_config(shape: str | dict[str, Any]) -> dict[str, Any]:
    """The config.json dict of a benchmark shape (`NAMED_SHAPES`, or HF fields given as a dict): no
    rope scaling, 4,096 positions, bos 1 and eos 2 (`write_word_tokenizer`'s ids)."""
    if isinstance(shape, str):
        if shape not in NAMED_SHAPES:
            raise ValueError(f"shape must be one of {sorted(NAMED_SHAPES)} or a dict of config.json fields, got {shape!r}")
        shape = NAMED_SHAPES[shape]
    return {**_COMMON, "max_position_embeddings": 4096, "rope_scaling": None, "bos_token_id": 1, "eos_token_id": 2,
            **shape}


POOL_VALUES = 1 << 24  # fill="pool": the draws every tensor is a run of (32 MB of bf16)


class PoolTensor:
    """`shape` values read from `pool` (wrapping around) from `start`: no draw per value."""

    def __init__(self, shape: tuple[int, ...], pool: np.ndarray, start: int):
        self.shape, self.dtype, self.pool, self.start = tuple(shape), pool.dtype, pool, start

    def rows(self, index: Any = slice(None)) -> np.ndarray:
        n = int(np.prod(self.shape, dtype=np.int64))
        out = np.empty(n, self.dtype)
        at, done = self.start, 0
        while done < n:
            piece = self.pool[at: at + n - done]
            out[done: done + piece.size] = piece
            done += piece.size
            at = 0
        return out.reshape(self.shape)[index]

    def release(self) -> None:
        pass


def random_tensors(config: dict[str, Any], dtype: Any = "bfloat16", seed: int = 0,
                   std: float = 0.02, fill: str = "normal") -> dict[str, RandomTensor | PoolTensor]:
    """Every tensor of the HF checkpoint `config` describes, in HF names and [out, in] layout, not drawn
    yet: fresh N(0, std) draws (`fill="normal"`) or runs of one pool of them (`fill="pool"`)."""
    import ml_dtypes  # noqa: F401 (registers bfloat16 with NumPy)

    if fill not in ("normal", "pool"):
        raise ValueError(f"fill must be 'normal' or 'pool', got {fill!r}")
    dtype = np.dtype(dtype)
    d, f, v = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    h, kvh = config["num_attention_heads"], config.get("num_key_value_heads") or config["num_attention_heads"]
    dh = config.get("head_dim") or d // h
    shapes: dict[str, tuple[tuple[int, ...], float | None]] = {"model.embed_tokens.weight": ((v, d), std)}
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes.update({
            p + "self_attn.q_proj.weight": ((h * dh, d), std), p + "self_attn.k_proj.weight": ((kvh * dh, d), std),
            p + "self_attn.v_proj.weight": ((kvh * dh, d), std), p + "self_attn.o_proj.weight": ((d, h * dh), std),
            p + "mlp.gate_proj.weight": ((f, d), std), p + "mlp.up_proj.weight": ((f, d), std),
            p + "mlp.down_proj.weight": ((d, f), std),
            p + "input_layernorm.weight": ((d,), None), p + "post_attention_layernorm.weight": ((d,), None)})
    shapes["model.norm.weight"] = ((d,), None)
    if not config.get("tie_word_embeddings", False):
        shapes["lm_head.weight"] = ((v, d), std)
    if fill == "pool":
        rng = np.random.default_rng(seed)
        pool = (rng.standard_normal(POOL_VALUES, dtype=np.float32) * np.float32(std)).astype(dtype)
        return {name: PoolTensor(shape, pool, int(rng.integers(0, POOL_VALUES))) if s is not None
                else RandomTensor(shape, dtype, 0, None) for name, (shape, s) in shapes.items()}
    return {name: RandomTensor(shape, dtype, seed * 100003 + j, s) for j, (name, (shape, s)) in enumerate(shapes.items())}


def write_random_checkpoint(path: str | os.PathLike, shape: str | dict[str, Any] = "1b", dtype: Any = "bfloat16",
                            seed: int = 0, max_shard_bytes: int = 5 * 10**9, fill: str = "normal",
                            tokenizer: bool = False) -> Path:
    """An HF checkpoint directory of random weights: config.json, and the tensors in safetensors shards
    of at most `max_shard_bytes` (one file when they fit, else model-0000i-of-0000n.safetensors plus
    model.safetensors.index.json, as transformers writes them). One tensor is in memory at a time.
    `fill`: see `random_tensors`. `tokenizer`: also a word-level tokenizer over the vocabulary
    (`write_word_tokenizer`). config.json is written last, so a checkpoint cut off half way is
    never taken for a whole one."""
    from jlora.formats import write_safetensors

    if not isinstance(max_shard_bytes, int) or max_shard_bytes <= 0:
        raise ValueError(f"max_shard_bytes must be a positive int, got {max_shard_bytes!r}")
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    config = random_config(shape)
    config["torch_dtype"] = np.dtype(dtype).name
    tensors = random_tensors(config, dtype, seed, fill=fill)
    shards: list[dict[str, RandomTensor]] = [{}]
    size = 0
    for name, t in tensors.items():
        if shards[-1] and size + nbytes(t) > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += nbytes(t)
    names = ["model.safetensors"] if len(shards) == 1 else \
        [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    for name, shard in zip(names, shards):
        write_safetensors(path / name, shard)
    if len(shards) > 1:
        index = {"metadata": {"total_size": sum(nbytes(t) for t in tensors.values())},
                 "weight_map": {t: name for name, shard in zip(names, shards) for t in shard}}
        (path / "model.safetensors.index.json").write_text(json.dumps(index, indent=1))
    if tokenizer:
        write_word_tokenizer(path, config["vocab_size"])
    (path / "config.json").write_text(json.dumps(config, indent=1))
    return path


def measure_load(path: str | os.PathLike, dtype: str = "bfloat16", quantization: str | None = None,
                 weights_cache: bool | str | os.PathLike = False,
                 devices: Sequence[Any] | None = None) -> tuple[Any, dict[str, Any]]:
    """Loads `path` with the streaming loader (`load_model`) and says what it cost:
    (model, {"seconds", "rss_before_bytes", "peak_rss_bytes", "peak_added_bytes", "peak_reset", "source",
    "device_bytes", "checkpoint_bytes"}). `peak_added_bytes` is the peak of the process's resident set
    during the load above where it began (file pages the loader still held included); on a CPU
    backend `device_bytes` (the model's arrays) are host memory too."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from jlora.models.loading import load_model

    dtypes = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}
    if dtype not in dtypes:
        raise ValueError(f"dtype must be one of {list(dtypes)}, got {dtype!r}")
    path = Path(path)
    model, _, _ = load_model(path, dtypes[dtype], weights_cache=weights_cache, quantization=quantization,
                             devices=devices)
    leaves = jax.tree.leaves(nnx.state(model, nnx.Param))
    files = [path] if path.is_file() else sorted(path.glob("*.safetensors"))
    return model, {**model.load_stats.to_dict(), "device_bytes": sum(int(x.nbytes) for x in leaves),
                   "checkpoint_bytes": sum(f.stat().st_size for f in files)}


def write_word_tokenizer(path: str | os.PathLike, vocab: int) -> None:
    """A word-level tokenizer over `vocab` words w0..w{V-1} at `path` (tokenizer.json and its
    config; bos w1, eos w2): random-weight checkpoints take token-id prompts, and this only gives
    an engine something to detokenize with."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    path = Path(path)
    words = {f"w{i}": i for i in range(vocab)}
    tok = Tokenizer(models.WordLevel(words, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "w1", "eos_token": "w2", "unk_token": "w0"}))
