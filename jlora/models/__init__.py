"""Llama-family models in Flax NNX, their configs and weight loaders."""

from jlora.models import flax_cycles

flax_cycles.install()  # before any model is built: Flax's flatten keeps Variables in a reference cycle

from jlora.models.config import PACKED_MODULES, PRESETS, LlamaConfig
from jlora.models.llama import LORA_MODULES, Llama, init_cache, init_lora_state, lora_state_modules
from jlora.models.loading import (
    build_model, default_model_path, load_model, read_gguf, read_hf_checkpoint, restore_model, save_model,
)

__all__ = [
    "PACKED_MODULES", "PRESETS", "LlamaConfig", "LORA_MODULES", "Llama", "init_cache", "init_lora_state",
    "lora_state_modules",
    "build_model", "default_model_path", "load_model", "read_gguf", "read_hf_checkpoint",
    "restore_model", "save_model",
]
