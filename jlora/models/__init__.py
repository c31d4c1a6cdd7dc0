"""Llama-family models in Flax NNX, their configs and weight loaders."""

from jlora.models.config import PRESETS, LlamaConfig
from jlora.models.llama import LORA_MODULES, Llama, LoRALinear, init_cache, init_lora_state
from jlora.models.loading import (
    build_model, default_model_path, load_model, read_gguf, read_hf_checkpoint, restore_model, save_model,
)

__all__ = [
    "PRESETS", "LlamaConfig", "LORA_MODULES", "Llama", "LoRALinear", "init_cache", "init_lora_state",
    "build_model", "default_model_path", "load_model", "read_gguf", "read_hf_checkpoint",
    "restore_model", "save_model",
]
