"""LoRA shrink/expand kernels behind one entry point, `lora_delta`.

Per token t with slot s = slot_ids[t]: delta[t] = x[t] @ a[s] @ b[s], and zero where s == -1.
Implementations live in their own modules, each next to nothing but its own math; `gather`
is the reference every other one is tested against.
"""

from jlora.kernels.dispatch import IMPLS, lora_delta, validate_lora_args
from jlora.kernels.gather import lora_delta_gather
from jlora.kernels.laned import lora_delta_laned

__all__ = ["IMPLS", "lora_delta", "lora_delta_gather", "lora_delta_laned", "validate_lora_args"]
