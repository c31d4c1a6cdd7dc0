"""On-disk cache of converted adapters, so a restart or a second engine does not convert again.

A thin user of `jlora.content_cache.ContentCache` (root, key, verify, rebuild, atomic write, stats).
An entry holds one `LoRAAdapter` (per module A f32[L, in, r], B f32[L, r, out], scale folded in):

    <root>/<key>/adapter.safetensors   '{module}.A' / '{module}.B'
    <root>/<key>/meta.json             format version, key, ranks, file size, tensor names, source

The key hashes what the converted arrays depend on: the adapter's content (sha256 of its
adapter_config.json and weights file, or an in-memory request's `content_hash`), max_lora_rank,
the base model's config, the stored dtype (float32: conversion does not depend on the engine's
dtype, the cast happens when a slot is written) and the format version. Edited files therefore miss;
a copy of the same adapter elsewhere hits. Directories written by `jlora convert` (orbax) are
already converted and are not cached again. A damaged entry (truncated, edited, wrong format, wrong
shapes) is detected on read and rebuilt.

Where: `JLORA_ADAPTER_CACHE_DIR`, else `$JLORA_CACHE_DIR/adapters` (default `~/.cache/jlora/adapters`;
see `jlora.caches`, which also caps its size, `JLORA_CACHE_MAX_ADAPTERS_GB`: the least recently used
entries go). `JLORA_ADAPTER_CACHE=0` (or `LLM(adapter_cache=False)`) turns it off.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path
from typing import Any

import numpy as np

from jlora.adapters.peft import ADAPTER_CONFIG, BIN_FILE, SAFETENSORS_FILE, LoRAAdapter
from jlora.content_cache import CacheKind, content_key, file_sha256
from jlora.models.config import LlamaConfig

ADAPTERS = CacheKind(kind="adapter", tensors_file="adapter.safetensors", env="JLORA_ADAPTER_CACHE", dir_name="adapters")
TENSORS_FILE = ADAPTERS.tensors_file
STORED_DTYPE = "float32"
cache_enabled = ADAPTERS.enabled
default_cache_dir = ADAPTERS.default_dir
open_cache = ADAPTERS.open


# ---- keys -------------------------------------------------------------------------------------------


def model_fingerprint(model_cfg: LlamaConfig) -> str:
    """sha256 of the base model's config (shapes and layer count decide what an adapter converts to)."""
    raw = json.dumps(dataclasses.asdict(model_cfg), sort_keys=True, default=str)
    return hashlib.sha256(raw.encode()).hexdigest()


def peft_dir_digest(path: Path, root: Path | None = None) -> str | None:
    """sha256 over a PEFT directory's config and weights file (the one `read_peft_tensors` reads);
    None when it is not a complete PEFT directory (the converter then raises its own error)."""
    cfg = path / ADAPTER_CONFIG
    weights = path / SAFETENSORS_FILE
    if not weights.is_file():
        weights = path / BIN_FILE
    if not cfg.is_file() or not weights.is_file():
        return None
    h = hashlib.sha256()
    for f in (cfg, weights):
        h.update(f"|{f.name}|{file_sha256(f, root)}".encode())
    return h.hexdigest()


def entry_key(content: str, model_cfg: LlamaConfig, max_lora_rank: int) -> str:
    return content_key(ADAPTERS.kind, STORED_DTYPE, f"max_lora_rank={max_lora_rank}", f"model={model_fingerprint(model_cfg)}",
                       f"content={content}")


# ---- entries ----------------------------------------------------------------------------------------


def decode(meta: dict[str, Any], tensors: dict[str, np.ndarray], model_cfg: LlamaConfig, max_lora_rank: int,
           name: str) -> LoRAAdapter:
    """The adapter an entry's (meta, tensors) hold; ValueError if its arrays do not fit the model."""
    ranks = {str(m): int(r) for m, r in meta["ranks"].items()}
    if len(tensors) != 2 * len(ranks):
        raise ValueError("tensors other than the modules' A and B")
    # Copies, so the entry can be replaced or deleted while the adapter is in use.
    weights = {m: (np.array(tensors[f"{m}.A"], np.float32), np.array(tensors[f"{m}.B"], np.float32)) for m in ranks}
    adapter = LoRAAdapter(name=name, ranks=ranks, weights=weights, source=str(meta.get("source", "")))
    adapter.validate(model_cfg, max_lora_rank)
    return adapter


def write_entry(root: Path, key: str, adapter: LoRAAdapter) -> Path | None:
    """Write `adapter` under `<root>/<key>` atomically; None (logged) when it could not be written.
    DoRA adapters are not cached (the entry format holds A and B only): None, and they convert again."""
    if adapter.is_dora:
        return None
    tensors = {}
    for m, (a, b) in adapter.weights.items():
        tensors[f"{m}.A"] = np.ascontiguousarray(a, np.float32)
        tensors[f"{m}.B"] = np.ascontiguousarray(b, np.float32)
    info = {"ranks": adapter.ranks, "dtype": STORED_DTYPE, "source": adapter.source}
    return open_cache(root).put(key, tensors, info)
