"""LoRARequest: which adapter a request uses (vLLM's shape)."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class LoRARequest:
    lora_name: str
    lora_int_id: int
    lora_path: str

    def __post_init__(self) -> None:
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise ValueError(f"LoRARequest.lora_name must be a non-empty string, got {self.lora_name!r}")
        if not isinstance(self.lora_int_id, int) or self.lora_int_id < 1:
            raise ValueError(f"LoRARequest.lora_int_id must be an int >= 1, got {self.lora_int_id!r}")
        object.__setattr__(self, "lora_path", str(self.lora_path))
