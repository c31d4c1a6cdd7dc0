"""LoRARequest: which adapter a request uses (vLLM's shape), from a path or from memory."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from pathlib import Path
from typing import Any, Mapping

import numpy as np

from jlora.adapters.peft import check_adapter_dir


@dataclasses.dataclass(frozen=True)
class LoRARequest:
    """`LoRARequest(lora_name, lora_int_id, lora_path)` as in vLLM, or an adapter held in memory.

    lora_name identifies the adapter; lora_int_id is a positive int id (vLLM's key; jlora rejects
    one id used for two names); lora_path is a PEFT adapter directory or one written by
    `jlora convert`. The directory is checked when the request is made, as `jlora generate --lora`
    checks it (`check_adapter_dir`: it exists, its adapter_config.json parses and asks only for what
    jlora serves, its weights file is there; no tensor is read): FileNotFoundError or ValueError
    naming the request, before any model work.

    In memory: `LoRARequest("mine", 3, tensors=state_dict, config=peft_config)` where `tensors` is
    a PEFT state dict (`...layers.0.self_attn.q_proj.lora_A.weight` -> [r, in], `lora_B` ->
    [out, r]; NumPy or JAX arrays) and `config` is the adapter_config.json content as a dict (or a
    peft `LoraConfig`). Exactly one of lora_path / tensors is given. The arrays are copied to
    read-only host arrays when the request is made, so later changes to the caller's arrays do not
    leak into it; `content_hash` (sha256 of the tensors and the config) identifies the content:
    a new request under the same name with other content is a new version of that adapter.
    Equality and hashing use the name, id, path and content_hash, never the arrays.
    """

    lora_name: str
    lora_int_id: int
    lora_path: str | None = None
    tensors: Mapping[str, np.ndarray] | None = dataclasses.field(
        default=None, kw_only=True, compare=False, hash=False, repr=False)
    config: Mapping[str, Any] | None = dataclasses.field(
        default=None, kw_only=True, compare=False, hash=False, repr=False)
    # False keeps this adapter out of the disk cache of converted adapters (`LLM.update_adapter`:
    # a training loop's versions are served once each and must not pile up on disk).
    disk_cache: bool = dataclasses.field(default=True, kw_only=True, compare=False)
    content_hash: str | None = dataclasses.field(default=None, init=False)

    def __post_init__(self) -> None:
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise ValueError(f"LoRARequest.lora_name must be a non-empty string, got {self.lora_name!r}")
        if isinstance(self.lora_int_id, bool) or not isinstance(self.lora_int_id, int) or self.lora_int_id < 1:
            raise ValueError(f"LoRARequest.lora_int_id must be an int >= 1, got {self.lora_int_id!r}")
        if self.tensors is None and self.config is not None:
            raise ValueError(f"LoRARequest {self.lora_name!r}: config is given without tensors; pass the PEFT "
                             f"state dict as tensors=... (or a lora_path instead of config)")
        if self.tensors is not None:
            if self.lora_path is not None:
                raise ValueError(f"LoRARequest {self.lora_name!r}: give exactly one of lora_path or tensors, "
                                 f"got both")
            if self.config is None:
                raise ValueError(f"LoRARequest {self.lora_name!r}: tensors need config=... (the "
                                 f"adapter_config.json content as a dict: r, lora_alpha, target_modules, ...)")
            tensors = _snapshot_tensors(self.lora_name, self.tensors)
            config = _snapshot_config(self.lora_name, self.config)
            object.__setattr__(self, "tensors", tensors)
            object.__setattr__(self, "config", config)
            object.__setattr__(self, "content_hash", _content_hash(tensors, config))
            return
        if self.lora_path is None:
            raise ValueError(f"LoRARequest {self.lora_name!r}: give exactly one of lora_path or tensors, got "
                             f"neither (lora_path: a PEFT adapter directory; tensors=..., config=...: an "
                             f"adapter in memory)")
        if not isinstance(self.lora_path, (str, os.PathLike)) or not str(self.lora_path):
            raise ValueError(f"LoRARequest.lora_path must be a non-empty path, got {self.lora_path!r}")
        object.__setattr__(self, "lora_path", str(self.lora_path))
        _check_path(self.lora_name, self.lora_path)

    @property
    def in_memory(self) -> bool:
        """Whether the adapter's weights are carried by the request (tensors=...) rather than a path."""
        return self.tensors is not None

    # vLLM's aliases.
    @property
    def adapter_id(self) -> int:
        return self.lora_int_id

    @property
    def name(self) -> str:
        return self.lora_name

    @property
    def path(self) -> str | None:
        return self.lora_path


def _check_path(name: str, path: str) -> None:
    """The CLI's adapter check at construction, so a bad path fails here and not after a model load."""
    try:
        check_adapter_dir(Path(path).expanduser())  # `~` as the adapter manager expands it
    except FileNotFoundError as e:
        from jlora.models.loading import _looks_like_hub_name

        hub = ("; hub names are not supported: download the adapter and pass its local directory"
               if not Path(path).expanduser().exists() and _looks_like_hub_name(path) else "")
        raise FileNotFoundError(f"LoRARequest {name!r}: {e}{hub}") from None
    except ValueError as e:
        raise ValueError(f"LoRARequest {name!r}: {e}") from None


def _snapshot_tensors(name: str, tensors: Any) -> dict[str, np.ndarray]:
    """Read-only host copies of a state dict's arrays (NumPy, JAX or anything `np.asarray` takes)."""
    if not isinstance(tensors, Mapping):
        raise ValueError(f"LoRARequest {name!r}: tensors must be a dict of name -> array (a PEFT state dict), "
                         f"got {type(tensors).__name__}")
    if not tensors:
        raise ValueError(f"LoRARequest {name!r}: tensors is empty")
    out = {}
    for k, v in tensors.items():
        if not isinstance(k, str):
            raise ValueError(f"LoRARequest {name!r}: tensors has a non-string key {k!r}")
        if hasattr(v, "detach"):  # a torch tensor: leave autograd, as numpy() requires
            v = v.detach().cpu()
        try:
            arr = np.array(v, copy=True)
        except Exception as e:
            raise ValueError(f"LoRARequest {name!r}: tensors[{k!r}] is not an array ({type(v).__name__}): {e}") from e
        if arr.dtype.kind not in "fiu" and arr.dtype.name != "bfloat16":
            raise ValueError(f"LoRARequest {name!r}: tensors[{k!r}] has dtype {arr.dtype}; expected a float array")
        arr.flags.writeable = False
        out[k] = arr
    return out


def _plain(x: Any) -> Any:
    """JSON-ready copy of a config value: sets (peft's target_modules) become sorted lists."""
    if isinstance(x, Mapping):
        return {str(k): _plain(v) for k, v in x.items()}
    if isinstance(x, (set, frozenset)):
        return sorted(_plain(v) for v in x)
    if isinstance(x, (list, tuple)):
        return [_plain(v) for v in x]
    if hasattr(x, "value") and isinstance(x, str):  # a str Enum (peft's PeftType / TaskType)
        return str(x.value)
    return x


def _snapshot_config(name: str, config: Any) -> dict[str, Any]:
    if not isinstance(config, Mapping) and hasattr(config, "to_dict"):  # a peft LoraConfig
        config = config.to_dict()
    if not isinstance(config, Mapping):
        raise ValueError(f"LoRARequest {name!r}: config must be the adapter_config.json content as a dict, got "
                         f"{type(config).__name__}")
    try:
        return json.loads(json.dumps(_plain(config)))
    except (TypeError, ValueError) as e:
        raise ValueError(f"LoRARequest {name!r}: config must be JSON-serializable like adapter_config.json: "
                         f"{e}") from e


def _content_hash(tensors: Mapping[str, np.ndarray], config: Mapping[str, Any]) -> str:
    """sha256 over the config JSON (key order kept: rank_pattern's order matters) and every tensor."""
    h = hashlib.sha256(b"jlora-lora-request-v1|")
    h.update(json.dumps(config).encode())
    for k in sorted(tensors):
        a = np.ascontiguousarray(tensors[k])
        h.update(f"|{k}|{a.dtype.name}|{a.shape}|".encode())
        h.update(a.tobytes())
    return h.hexdigest()
