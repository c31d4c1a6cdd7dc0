"""Random PEFT LoRA directories for benchmarks, written with safetensors (no torch, no peft).

The layout `peft.save_pretrained` writes: `adapter_config.json` and `adapter_model.safetensors`
with keys `base_model.model.model.layers.{i}.{self_attn|mlp}.{module}.lora_A.weight` [r, in] and
`lora_B.weight` [out, r]. Values: A ~ N(0, 1/in), B ~ N(0, 0.01^2), so the LoRA term is small
beside the base model's output; timings do not depend on them.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

ALL_LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")


def write_peft_adapter(path: Path, cfg: Any, rank: int, modules: tuple[str, ...], rng: np.random.Generator,
                       dora: bool = False) -> Path:
    """One adapter of `rank` on `modules` of every layer of the model `cfg` (a LlamaConfig), at `path`.
    `dora`: a DoRA adapter (use_dora), magnitudes ~ U(0.5, 1.5) per output feature."""
    from safetensors.numpy import save_file

    shapes = cfg.module_shapes()
    tensors = {}
    for layer in range(cfg.num_hidden_layers):
        for m in modules:
            d_in, d_out = shapes[m]
            key = f"base_model.model.model.layers.{layer}.{'self_attn' if m in ATTENTION else 'mlp'}.{m}"
            tensors[f"{key}.lora_A.weight"] = rng.standard_normal((rank, d_in), np.float32) / np.sqrt(d_in)
            tensors[f"{key}.lora_B.weight"] = rng.standard_normal((d_out, rank), np.float32) * 0.01
            if dora:
                tensors[f"{key}.lora_magnitude_vector"] = rng.uniform(0.5, 1.5, d_out).astype(np.float32)
    path.mkdir(parents=True)
    save_file(tensors, str(path / "adapter_model.safetensors"))
    (path / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": 2 * rank, "lora_dropout": 0.0,
        "target_modules": list(modules), "bias": "none", "fan_in_fan_out": False, "use_rslora": False,
        "use_dora": dora, "base_model_name_or_path": "HuggingFaceTB/SmolLM2-135M-Instruct"}))
    return path
