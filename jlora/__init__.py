"""jlora: many LoRA adapters over one Llama-family model, in pure JAX/Flax."""

from jlora.adapters.request import LoRARequest
from jlora.outputs import CompletionOutput, RequestOutput
from jlora.sampling import SamplingParams

__all__ = ["LLM", "LoRARequest", "SamplingParams", "RequestOutput", "CompletionOutput"]


def __getattr__(name: str):
    # The engine pulls in the whole runtime; `import jlora.models` alone should stay light.
    if name == "LLM":
        from jlora.llm import LLM

        return LLM
    raise AttributeError(f"module 'jlora' has no attribute {name!r}")
