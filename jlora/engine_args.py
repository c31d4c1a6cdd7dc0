"""The engine sizes' single source, and the checks `LLM(...)` arguments get before any model is loaded.

`LLM()`, `jlora generate`, `jlora demo` and `jlora serve` all default to `EngineConfig`'s field
defaults, so one persistent compile cache serves them all: other sizes are other graphs, compiled again.
Light to import (no JAX), so the CLI can show these in `--help` and check arguments in milliseconds.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence as Seq

from jlora.engine.config import ATTN_IMPLS, BASE_GRAPHS, KV_CACHE_DTYPES, EngineConfig  # noqa: F401 (the CLI's choices)

ENGINE_DEFAULTS: dict[str, Any] = {f.name: f.default for f in dataclasses.fields(EngineConfig)}
ENGINE_DEFAULTS["block_size"] = None  # auto: `default_block_size` for the backend
ENGINE_DEFAULTS["base_graphs"] = None  # auto: `default_base_graphs` for the backend
ENGINE_DEFAULTS["kv_cache_memory_fraction"] = "auto"  # `default_kv_cache_memory_fraction` for the backend
# The share of a TPU's memory the weights, LoRA slots and KV cache take when nothing else is said:
# the rest is for the steps' temporaries (a 2,048-token prefill chunk's prompt log-probabilities over
# the 1B shape's 128,256-token vocabulary are 1 GB in float32, twice that with their softmax). At
# 15.75 GiB (a v5e) 0.8 leaves 3.4 GB.
TPU_KV_CACHE_MEMORY_FRACTION = 0.8
DTYPES = ("float32", "bfloat16", "float16")
# Weight quantization (jlora.models.quant): "int8" = int8 weights with per-token int8 activations
# where the backend multiplies int8 natively (CPU, TPU), else dequantized in the matmul; "int8-weight-only" =
# int8 weights, float activations everywhere.
QUANTIZATIONS = ("none", "int8", "int8-weight-only")
LORA_IMPLS = ("auto", "gather", "laned", "grouped", "pallas")  # jlora.kernels.dispatch.CHOICES, without JAX


def default_block_size(max_model_len: int, backend: str | None) -> int:
    """KV positions per block when `block_size` is None (auto). 16 off the TPU. On a TPU a
    sixteenth of max_model_len as a power of two, 16 to 128 (vLLM's TPU backend sizes its pages
    the same way): the Pallas kernel moves a page per DMA, and 16-position pages (16 KB at the 1B
    shape) left it issue-bound, far under the chip's HBM bandwidth (45% against 61-70%; docs/tpu.md)."""
    if backend != "tpu":
        return 16
    return min(128, max(16, 1 << max(0, (max_model_len - 1).bit_length() - 4)))


def default_base_graphs(backend: str | None) -> str:
    """Which step shapes get a graph without LoRA when `base_graphs` is None (auto). Off the TPU
    none: XLA:CPU's LoRA conditionals cost little, and every graph costs start-up. On a TPU the
    decode-only shapes, where the conditionals cost most (a one-row step 4.68 -> 3.19 ms on a v5e
    chip, timed before the step-output fix of 2026-12-07); "all" also speeds up prefill steps (1.47 -> 1.41 s of prefill for 64 prompts of 1,024
    tokens, 1.64 -> 1.55 s with 4 adapters) but compiles twice the graphs (a cold start of 105 s
    instead of 60; v5e, 2026-12-06)."""
    return "decode" if backend == "tpu" else "none"


def default_kv_cache_memory_fraction(backend: str | None, num_kv_blocks: int | None, devices: int = 1) -> float | None:
    """`kv_cache_memory_fraction` when it is "auto": on one TPU device without num_kv_blocks,
    TPU_KV_CACHE_MEMORY_FRACTION (vLLM sizes its cache to gpu_memory_utilization=0.9 by default);
    elsewhere None, num_kv_blocks (default max_num_seqs full-length sequences). Several devices
    (tensor or data parallel) keep num_kv_blocks: the sizing reads one device's memory."""
    if backend == "tpu" and num_kv_blocks is None and devices == 1:
        return TPU_KV_CACHE_MEMORY_FRACTION
    return None


def engine_config(
    *,
    dtype: str = "float32",
    block_size: int | None = None,
    base_graphs: str | None = None,
    backend: str | None = None,
    max_cpu_loras: int | None = None,
    token_buckets: Seq[int] | None = None,
    lora_slot_ranks: Seq[int] | None = None,
    lora_impl: str = ENGINE_DEFAULTS["lora_impl"],
    kv_cache_memory_fraction: float | str | None = ENGINE_DEFAULTS["kv_cache_memory_fraction"],
    devices: int = 1,
    **sizes: Any,
) -> EngineConfig:
    """The EngineConfig `LLM(...)` builds from these arguments; ValueError naming the bad one.

    Needs no model, so callers (the CLI, a server) can reject bad sizes before loading anything.
    `block_size` None is `default_block_size` for `backend` (None: not a TPU); `base_graphs` None
    is `default_base_graphs` for it; `kv_cache_memory_fraction` "auto" is
    `default_kv_cache_memory_fraction` for it, `num_kv_blocks` and `devices` (the engine's devices,
    tensor x data parallel).
    """
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {list(DTYPES)}, got {dtype!r}")
    if lora_impl not in LORA_IMPLS:
        raise ValueError(f"lora_impl must be one of {list(LORA_IMPLS)}, got {lora_impl!r}")
    buckets: dict[str, tuple[int, ...] | None] = {}
    for name, b in (("token_buckets", token_buckets), ("lora_slot_ranks", lora_slot_ranks)):
        if b is not None:  # a list is fine here; the config must hold a (hashable) tuple
            if isinstance(b, (str, bytes)) or not all(isinstance(x, int) and not isinstance(x, bool) for x in b):
                raise ValueError(f"{name} must be a sequence of ints, got {b!r}")
            b = tuple(b)
        buckets[name] = b
    if block_size is None:
        block_size = default_block_size(sizes.get("max_model_len", ENGINE_DEFAULTS["max_model_len"]), backend)
    if base_graphs is None:
        base_graphs = default_base_graphs(backend)
    if kv_cache_memory_fraction == "auto":
        kv_cache_memory_fraction = default_kv_cache_memory_fraction(backend, sizes.get("num_kv_blocks"), devices)
    return EngineConfig(max_cpu_loras=max_cpu_loras, lora_impl=lora_impl, block_size=block_size,
                        base_graphs=base_graphs, kv_cache_memory_fraction=kv_cache_memory_fraction,
                        **buckets, **sizes)


def target_modules_flag(text: str) -> tuple[str, ...] | None:
    """--lora-target-modules (argparse type): comma-separated decoder module names, checked
    (`check_lora_target_modules`: None where they name every packed projection)."""
    import argparse

    from jlora.engine.config import check_lora_target_modules

    try:
        return check_lora_target_modules(tuple(x.strip() for x in text.split(",") if x.strip()), "module names")
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def warmup_flag(args: Any) -> str | None:
    """LLM(warmup=...) from the CLI's --lazy and --warmup (None: LLM's default for the backend)."""
    return "lazy" if getattr(args, "lazy", False) else getattr(args, "warmup", None)
