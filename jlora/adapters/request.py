"""LoRARequest: which adapter a request uses (vLLM's shape)."""

from __future__ import annotations

import dataclasses
import os


@dataclasses.dataclass(frozen=True)
class LoRARequest:
    """`LoRARequest(lora_name, lora_int_id, lora_path)` as in vLLM.

    lora_name identifies the adapter; lora_int_id is a positive int id (vLLM's key; jlora rejects
    one id used for two names); lora_path is a PEFT adapter directory or one written by
    `jlora convert`.
    """

    lora_name: str
    lora_int_id: int
    lora_path: str

    def __post_init__(self) -> None:
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise ValueError(f"LoRARequest.lora_name must be a non-empty string, got {self.lora_name!r}")
        if isinstance(self.lora_int_id, bool) or not isinstance(self.lora_int_id, int) or self.lora_int_id < 1:
            raise ValueError(f"LoRARequest.lora_int_id must be an int >= 1, got {self.lora_int_id!r}")
        if not isinstance(self.lora_path, (str, os.PathLike)) or not str(self.lora_path):
            raise ValueError(f"LoRARequest.lora_path must be a non-empty path, got {self.lora_path!r}")
        object.__setattr__(self, "lora_path", str(self.lora_path))

    # vLLM's aliases.
    @property
    def adapter_id(self) -> int:
        return self.lora_int_id

    @property
    def name(self) -> str:
        return self.lora_name

    @property
    def path(self) -> str:
        return self.lora_path
