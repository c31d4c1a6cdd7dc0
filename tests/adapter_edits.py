"""A PEFT adapter directory copied with edits to its tensors or config (bad-input tests)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any, Callable


def edited_adapter(src: Path, dst: Path, edit_tensors: Callable[[dict[str, Any]], None] | None = None,
                   edit_config: Callable[[dict[str, Any]], None] | None = None) -> Path:
    """`src` copied to `dst`, its safetensors and adapter_config.json changed in place by the edits."""
    from safetensors.numpy import load_file, save_file

    shutil.copytree(src, dst)
    t = load_file(str(dst / "adapter_model.safetensors"))
    c = json.loads((dst / "adapter_config.json").read_text())
    if edit_tensors:
        edit_tensors(t)
    if edit_config:
        edit_config(c)
    save_file(t, str(dst / "adapter_model.safetensors"))
    (dst / "adapter_config.json").write_text(json.dumps(c))
    return dst
