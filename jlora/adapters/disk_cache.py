"""On-disk cache of converted adapters, so a restart or a second engine does not convert again.

An entry holds one `LoRAAdapter` (per module A f32[L, in, r], B f32[L, r, out], scale folded in):

    <root>/<key>/adapter.safetensors   '{module}.A' / '{module}.B'
    <root>/<key>/meta.json             format version, key, ranks, file size, tensor names, source

The key hashes what the converted arrays depend on: the adapter's content (sha256 of its
adapter_config.json and weights file, or an in-memory request's `content_hash`), max_lora_rank,
the base model's config, the stored dtype (float32: conversion does not depend on the engine's
dtype, the cast happens when a slot is written) and FORMAT_VERSION. Edited files therefore miss;
a copy of the same adapter elsewhere hits. Directories written by `jlora convert` (orbax) are
already converted and are not cached again.

Writes and damage handling are those of `jlora.models.weights_cache` (whose helpers this uses):
an entry is written into a temporary directory and renamed into place; one that is damaged
(truncated, edited, wrong format, wrong shapes) is detected on read and rebuilt. Never pickle.

Where: `JLORA_ADAPTER_CACHE_DIR`, else an `adapters` sibling of `JLORA_CACHE_DIR` (the persistent
XLA cache), else `~/.cache/jlora/adapters`. `JLORA_ADAPTER_CACHE=0` (or `LLM(adapter_cache=False)`)
turns it off.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

import numpy as np

from jlora.adapters.peft import ADAPTER_CONFIG, BIN_FILE, SAFETENSORS_FILE, LoRAAdapter
from jlora.models.config import LlamaConfig
from jlora.models.weights_cache import cache_root, env_enabled, file_sha256, read_safetensors_mmap, write_safetensors

FORMAT_VERSION = 1
TENSORS_FILE = "adapter.safetensors"
META_FILE = "meta.json"
STORED_DTYPE = "float32"


def cache_enabled() -> bool:
    return env_enabled("JLORA_ADAPTER_CACHE")


def default_cache_dir() -> Path:
    return cache_root("adapters", "JLORA_ADAPTER_CACHE_DIR")


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
    raw = (f"jlora-adapter-v{FORMAT_VERSION}|{STORED_DTYPE}|max_lora_rank={max_lora_rank}|"
           f"model={model_fingerprint(model_cfg)}|content={content}")
    return hashlib.sha256(raw.encode()).hexdigest()[:32]


# ---- entries ----------------------------------------------------------------------------------------


def read_entry(entry: Path, key: str, model_cfg: LlamaConfig, max_lora_rank: int, name: str) -> LoRAAdapter:
    """The adapter stored in `entry`; ValueError (or OSError) if it is damaged or from another format."""
    meta = json.loads((entry / META_FILE).read_text())
    if meta.get("format_version") != FORMAT_VERSION or meta.get("key") != key:
        raise ValueError(f"format_version={meta.get('format_version')!r}, key={meta.get('key')!r}")
    file = entry / TENSORS_FILE
    if file.stat().st_size != meta.get("file_size"):
        raise ValueError(f"{file} has {file.stat().st_size} bytes, meta.json says {meta.get('file_size')}")
    tensors = read_safetensors_mmap(file)
    if sorted(tensors) != sorted(meta.get("tensors", [])):
        raise ValueError("tensor names differ from meta.json")
    ranks = {str(m): int(r) for m, r in meta["ranks"].items()}
    # Copies, so the entry can be replaced or deleted while the adapter is in use.
    weights = {m: (np.array(tensors[f"{m}.A"], np.float32), np.array(tensors[f"{m}.B"], np.float32)) for m in ranks}
    if len(tensors) != 2 * len(ranks):
        raise ValueError("tensors other than the modules' A and B")
    adapter = LoRAAdapter(name=name, ranks=ranks, weights=weights, source=str(meta.get("source", "")))
    adapter.validate(model_cfg, max_lora_rank)
    return adapter


def write_entry(root: Path, key: str, adapter: LoRAAdapter) -> Path:
    """Write into a temporary directory, then rename it to `<root>/<key>` (atomic: no half entries)."""
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{key}-", dir=root))
    try:
        tensors = {}
        for m, (a, b) in adapter.weights.items():
            tensors[f"{m}.A"] = np.ascontiguousarray(a, np.float32)
            tensors[f"{m}.B"] = np.ascontiguousarray(b, np.float32)
        size = write_safetensors(tmp / TENSORS_FILE, tensors)
        meta = {"format_version": FORMAT_VERSION, "key": key, "file_size": size, "tensors": sorted(tensors),
                "ranks": adapter.ranks, "dtype": STORED_DTYPE, "source": adapter.source}
        (tmp / META_FILE).write_text(json.dumps(meta, indent=1))
        try:
            os.rename(tmp, root / key)
        except OSError:  # another process finished the same entry first: keep theirs
            if not (root / key / META_FILE).is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return root / key
