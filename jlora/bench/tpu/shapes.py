"""The shapes `jlora bench tpu` measures, their random checkpoints and adapters, and the roofline's
arithmetic. The shapes and the writer are the library's (`jlora.models.random_checkpoint`), the
memory arithmetic too (`jlora.engine.kv_plan`)."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import numpy as np

from jlora.engine.kv_plan import kv_plan, shape_bytes  # noqa: F401 (the bench's memory arithmetic)
from jlora.models.random_checkpoint import NAMED_SHAPES, bench_config, write_random_checkpoint

# HF config fields of each `--shape` (`jlora.models.random_checkpoint.NAMED_SHAPES`); a test or
# `jlora bench tpu-compile --shape-overrides` may add one.
SHAPES: dict[str, dict[str, Any]] = {name: bench_config(name) for name in NAMED_SHAPES}
# Engine sizes per shape where they differ from the bench's defaults: the 8B compiles few graphs
# (one prefill chunk of 512 tokens, one decode row bucket), each costing tens of seconds.
SHAPE_ENGINE = {"llama-3.1-8b": dict(max_num_batched_tokens=512, token_buckets=(512,), one_row_bucket=True)}
AGREE_SHAPE = "llama-3.2-1b"


def write_checkpoint(path: Path, shape: str, seed: int = 0, fill: str = "pool") -> float:
    """A random bf16 Llama of `shape` (`SHAPES`) at `path` with a word-level tokenizer; returns
    seconds. `fill="pool"`: every weight a run of one pool of N(0, 0.02) draws, so the 16 GB of an
    8B checkpoint go at the disk's speed; "normal": every value a fresh draw (the agree section:
    the pool's repeated rows would tie logits exactly)."""
    t0 = time.perf_counter()
    write_random_checkpoint(path, bench_config(SHAPES[shape]), "bfloat16", seed, fill=fill, tokenizer=True)
    return time.perf_counter() - t0


def make_adapters(cfg: Any, n: int, rank: int, root: Path, seed: int = 0) -> list[Path]:
    """n PEFT-format all-linear adapters of `rank` (random A and B, so they change outputs)."""
    from safetensors.numpy import save_file

    rng = np.random.default_rng(seed)
    d, f = cfg.hidden_size, cfg.intermediate_size
    h, kvh, dh = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    dims = {"self_attn.q_proj": (d, h * dh), "self_attn.k_proj": (d, kvh * dh), "self_attn.v_proj": (d, kvh * dh),
            "self_attn.o_proj": (h * dh, d), "mlp.gate_proj": (d, f), "mlp.up_proj": (d, f), "mlp.down_proj": (f, d)}
    paths = []
    for a in range(n):
        out = root / f"adapter{a}"
        out.mkdir(parents=True, exist_ok=True)
        t = {}
        for i in range(cfg.num_hidden_layers):
            for m, (din, dout) in dims.items():
                p = f"base_model.model.model.layers.{i}.{m}."
                t[p + "lora_A.weight"] = (rng.standard_normal((rank, din), np.float32) * 0.02).astype(np.float16)
                t[p + "lora_B.weight"] = (rng.standard_normal((dout, rank), np.float32) * 0.02).astype(np.float16)
        save_file(t, str(out / "adapter_model.safetensors"))
        (out / "adapter_config.json").write_text(json.dumps({
            "peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": [m.split(".")[1] for m in dims],
            "base_model_name_or_path": "random", "task_type": "CAUSAL_LM"}))
        paths.append(out)
    return paths


def matmul_params(cfg: Any) -> int:
    """Parameters of a model's projections (a LlamaConfig): a token's flops are twice this."""
    d, f, L = cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers
    h, kvh, dh = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    return L * (d * (h + 2 * kvh) * dh + h * dh * d + 3 * d * f)
