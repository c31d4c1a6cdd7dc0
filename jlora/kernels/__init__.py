"""LoRA shrink/expand kernels behind one entry point, `lora_delta`.

Per token t with slot s = slot_ids[t]: delta[t] = x[t] @ a[s] @ b[s], and zero where s == -1
(any id outside [0, N)). Implementations live in their own modules; `gather` is the reference
every other one is tested against, `choose_impl` holds the measured crossovers (docs/kernels.md).
`paged_attention` (attention over the block-table KV cache) sits beside its reference in `attention`.
"""

from jlora.kernels.attention import paged_attention, paged_attention_reference, validate_attention_args

from jlora.kernels.common import MIX_SLOT, validate_lora_args
from jlora.kernels.dispatch import CHOICES, IMPLS, choose_impl, lora_delta
from jlora.kernels.gather import lora_delta_gather
from jlora.kernels.grouped import lora_delta_grouped
from jlora.kernels.laned_dense import lora_delta_laned
from jlora.kernels.pallas import lora_delta_pallas
from jlora.kernels.pallas_gpu import lora_delta_pallas_gpu
from jlora.kernels.pallas_tpu import lora_delta_pallas_tpu

__all__ = [
    "CHOICES",
    "MIX_SLOT",
    "IMPLS",
    "choose_impl",
    "lora_delta",
    "lora_delta_gather",
    "lora_delta_grouped",
    "lora_delta_laned",
    "lora_delta_pallas",
    "lora_delta_pallas_gpu",
    "lora_delta_pallas_tpu",
    "paged_attention",
    "paged_attention_reference",
    "validate_attention_args",
    "validate_lora_args",
]
