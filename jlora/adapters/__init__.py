"""LoRA adapters: PEFT conversion (`peft`), requests from a path or memory (`request`), the device
slots (`slots`), the host store of converted adapters (`host_store`), the slot table that
coordinates them (`manager`), the on-disk cache of converted adapters (`disk_cache`).

`from jlora.adapters import X` works for every name below; the JAX-heavy modules load on first use,
so `from jlora import LoRARequest` stays light.
"""

from jlora.adapters.request import LoRACombination, LoRARequest

_LAZY = {
    "AdapterManager": "manager", "NoFreeSlotError": "manager", "padded_update": "slots", "set_slot": "slots",
    "slot_module": "slots", "AdapterHandle": "host_store", "LoRASlots": "slots", "SlotWrite": "slots",
    "LoRAAdapter": "peft", "convert": "peft", "convert_main": "peft", "convert_peft_state_dict": "peft",
    "load_adapter": "peft",
    "read_adapter": "peft", "read_peft_adapter": "peft", "save_adapter": "peft",
}

__all__ = ["LoRACombination", "LoRARequest", *_LAZY]


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f"jlora.adapters.{_LAZY[name]}"), name)
    raise AttributeError(f"module 'jlora.adapters' has no attribute {name!r}")
