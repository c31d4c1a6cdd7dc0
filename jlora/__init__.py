"""jlora: many LoRA adapters over one Llama-family model, in pure JAX/Flax."""

from importlib import metadata as _metadata

try:
    __version__ = _metadata.version("jlora")
except _metadata.PackageNotFoundError:  # a source tree that was never installed
    __version__ = "0.0.0+unknown"

__all__ = ["LLM", "LoRARequest", "SamplingParams", "RequestOutput", "CompletionOutput", "init_distributed",
           "__version__"]

# Loaded on first use: SamplingParams and LLM pull in JAX, and `jlora --help`, `jlora --version` or
# `import jlora.engine_args` should not pay for it.
_LAZY = {"LLM": "jlora.llm", "LoRARequest": "jlora.adapters.request", "SamplingParams": "jlora.sampling_params",
         "RequestOutput": "jlora.outputs", "CompletionOutput": "jlora.outputs",
         "init_distributed": "jlora.distributed"}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'jlora' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
