"""On-disk cache of converted weights, so a second start neither dequantizes GGUF nor converts again.

A thin user of `jlora.content_cache.ContentCache` (root, key, verify, rebuild, atomic write, stats).
An entry holds the checkpoint's tensors (Hugging Face names, [out, in] layout) already in their
stored form (the compute dtype, or int8 + `<name>_scale` for a quantized entry) as one safetensors
file, written one tensor at a time and read back through mmap by the streaming loader, plus the
model's config:

    <root>/<key>/model.safetensors
    <root>/<key>/meta.json          format version, key, config, dtype, sources, file size

The key hashes the source files' contents (sha256), the dtype (and "int8" for a quantized entry) and
the format version, so an edited source misses and a copy of the same file elsewhere hits. Hashing the
98 MB default GGUF takes ~0.15 s; the shards of a sharded checkpoint are hashed in parallel, and digests
are memoized by (path, size, mtime) so multi-GB checkpoints are hashed once. A damaged entry
(truncated, edited, wrong format) is detected on read and rebuilt.

Where: `JLORA_WEIGHTS_CACHE_DIR`, else `$JLORA_CACHE_DIR/weights` (default `~/.cache/jlora/weights`;
see `jlora.caches`, which also caps its size, `JLORA_CACHE_MAX_WEIGHTS_GB`: the least recently used
entries go, never the one this process runs on). `JLORA_WEIGHTS_CACHE=0` (or
`LLM(weights_cache=False)`) turns it off.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Callable

import numpy as np

from jlora.content_cache import DAMAGED, CacheKind, ContentCache
from jlora.models.config import LlamaConfig

# A hit's tensors are views over the entry's file: it is held (kept by this process's evictions).
WEIGHTS = CacheKind(kind="weights", tensors_file="model.safetensors", env="JLORA_WEIGHTS_CACHE", dir_name="weights",
                    holds_entries=True)
TENSORS_FILE = WEIGHTS.tensors_file
cache_enabled = WEIGHTS.enabled
default_cache_dir = WEIGHTS.default_dir
open_cache = WEIGHTS.open


def source_files(path: Path) -> list[Path]:
    """The files a GGUF model or an HF checkpoint directory is read from."""
    if path.is_file():
        return [path]
    files = [path / "config.json", *sorted(path.glob("*.safetensors"))]
    index = path / "model.safetensors.index.json"
    return files + ([index] if index.is_file() else [])


def entry_key(cache: ContentCache, sources: list[Path], dtype_name: str) -> str:
    """The key over the sources' digests, hashed one file per thread (hashlib and file reads release
    the GIL): a sharded 16 GB checkpoint's first hash takes the time of its largest shard, not of all."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max_workers=max(1, min(len(sources), os.cpu_count() or 1))) as pool:
        digests = list(pool.map(cache.digest, sources))
    return cache.key(dtype_name, *(f"{f.name}|{d}" for f, d in zip(sources, digests)))


def model_key(path: Path, dtype: Any, cache: ContentCache, quantization: str | None = None) -> str:
    """The key `cached_read` reads and writes for this model, dtype and quantization."""
    from jlora.models import quant

    quantized = quant.check_quantization(quantization) != "none"
    return entry_key(cache, source_files(path), np.dtype(dtype).name + ("|int8" if quantized else ""))


def _decode(meta: dict[str, Any], tensors: dict[str, np.ndarray]) -> tuple[LlamaConfig, dict[str, np.ndarray]]:
    return LlamaConfig.from_json_dict(meta["config"]), tensors


def cached_read(
    path: Path,
    dtype: Any,
    read: Callable[[Path], tuple[LlamaConfig, dict[str, Any]]],
    cache: ContentCache | None = None,
    quantization: str | None = None,
) -> tuple[LlamaConfig, dict[str, np.ndarray], bool]:
    """(config, tensors cast to `dtype`, hit?) of the model at `path`, from `cache` when it has them.

    `quantization` ("int8", "int8-weight-only"): the projections and lm head are stored as int8 plus
    `<name>_scale` (`jlora.models.quant.prepare_tensors`); both int8 modes share one entry.
    `read(path)` opens the source on a miss (arrays, or `jlora.models.tensors` tensors read only when
    written); the entry is written one tensor at a time. The tensors returned are views over an mmap
    of the entry (on a miss too, so a hit and a miss hand the loader the same bytes).
    """
    from jlora.models import quant
    from jlora.models.streaming import prepare

    cache = cache if cache is not None else open_cache()
    np_dtype = np.dtype(dtype)
    dtype_name = np_dtype.name
    quantized = quant.check_quantization(quantization) != "none"
    sources = source_files(path)
    key = model_key(path, dtype, cache, quantization)
    got = cache.get(key, _decode)
    if got is not None:
        return *got, True
    cfg, tensors = read(path)
    # Converted and written one tensor at a time (no float32 copy of the checkpoint in memory).
    tensors = prepare(tensors, cfg.tie_word_embeddings, np_dtype, quantization)
    info = {"config": cfg.to_json_dict(), "dtype": dtype_name, "quantization": "int8" if quantized else "none",
            "sources": [{"path": str(f.resolve()), "size": f.stat().st_size} for f in sources]}
    if cache.put(key, tensors, info) is not None:  # else (disk full, read-only) convert again as they are read
        try:
            cfg, tensors = _decode(*cache.read(key))
        except DAMAGED:  # removed under us by another process: the lazy tensors give the same values
            pass
    return cfg, tensors, False
