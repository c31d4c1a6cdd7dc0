"""The two file formats jlora reads: safetensors (HF checkpoints, PEFT adapters, the disk caches) and GGUF.

One reader each, so every caller gets the same checks and the same errors on a broken file:

    read_safetensors(file)      {name: read-only array over an mmap of file}; FileNotFoundError when
                                missing, ValueError "... is not a readable safetensors file (corrupt
                                or truncated?): <what>" when its layout does not add up
    write_safetensors(file, t)  the same layout back (bfloat16 included, no framework needed)
    read_gguf_header(path)      (metadata fields, tensor infos) from the file's head, no tensor read
    read_gguf_tensors(path)     (fields, {name: f32 array, dequantized}); ValueError "... is not a
                                readable GGUF file: <what>" when broken

Both are read here rather than through the `safetensors` / `gguf.GGUFReader` classes: NumPy has no
bfloat16, so `safetensors.numpy` cannot hold those files, and `GGUFReader` parses every tensor header and
wraps every metadata array element in a NumPy view, which takes seconds for a vocabulary of 50k
tokens. The `gguf` package still does the dequantization (`gguf.quants.dequantize`), and tests hold
both readers to the reference libraries (`tests/test_formats.py`).
"""

from __future__ import annotations

import dataclasses
import json
import mmap
import struct
from pathlib import Path
from typing import Any

import numpy as np

# ---- safetensors ------------------------------------------------------------------------------------
# 8 bytes little-endian header length n, n bytes of JSON {name: {dtype, shape, data_offsets}} (optional
# "__metadata__"), then the tensors' bytes back to back; offsets count from the end of the header.

_ST_DTYPES = {"F64": "<f8", "F32": "<f4", "F16": "<f2", "I64": "<i8", "I32": "<i4", "I16": "<i2", "I8": "i1",
              "U64": "<u8", "U32": "<u4", "U16": "<u2", "U8": "u1", "BOOL": "?"}


def _st_dtypes() -> dict[str, np.dtype]:
    import ml_dtypes  # a jax dependency; NumPy itself has no bfloat16 or float8

    return {**{k: np.dtype(v) for k, v in _ST_DTYPES.items()}, "BF16": np.dtype(ml_dtypes.bfloat16),
            "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn), "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2)}


def read_safetensors(file: str | Path) -> dict[str, np.ndarray]:
    """Read-only arrays over an mmap of `file` (copy or `astype` them to keep them past the file)."""
    file = Path(file)
    if not file.is_file():
        raise FileNotFoundError(f"safetensors file {str(file)!r} does not exist")
    try:
        return _read_safetensors(file)
    except (ValueError, KeyError, TypeError, AttributeError, OSError, struct.error) as e:
        raise ValueError(f"{file} is not a readable safetensors file (corrupt or truncated?): {e}") from e


def _read_safetensors(file: Path) -> dict[str, np.ndarray]:
    size = file.stat().st_size
    with open(file, "rb") as f:
        head = f.read(8)
        if len(head) != 8:
            raise ValueError(f"{size} bytes, shorter than a safetensors header")
        (n,) = struct.unpack("<Q", head)
        if n > size - 8:
            raise ValueError(f"header length {n} runs past the end of the file ({size} bytes)")
        header = json.loads(f.read(n))
    if not isinstance(header, dict):
        raise ValueError(f"the header is a JSON {type(header).__name__}, not an object")
    header.pop("__metadata__", None)
    dtypes = _st_dtypes()
    buf = np.memmap(file, dtype=np.uint8, mode="r") if size > 8 + n else np.zeros(0, np.uint8)
    out: dict[str, np.ndarray] = {}
    end_of_data = 0
    for name, info in header.items():
        dtype = dtypes.get(info.get("dtype"))
        start, end = (int(x) for x in info["data_offsets"])
        shape = tuple(int(s) for s in info["shape"])
        if dtype is None or not 0 <= start <= end or end - start != int(np.prod(shape)) * dtype.itemsize \
                or 8 + n + end > size:
            raise ValueError(f"tensor {name!r} ({info}) does not fit the file")
        out[name] = buf[8 + n + start: 8 + n + end].view(dtype).reshape(shape)
        end_of_data = max(end_of_data, end)
    if 8 + n + end_of_data != size:
        raise ValueError(f"{size} bytes, but the header accounts for {8 + n + end_of_data}")
    return out


def write_safetensors(file: str | Path, tensors: dict[str, np.ndarray]) -> int:
    """Tensors back to back after a JSON header padded to 8 bytes (the safetensors layout). Returns the file size."""
    names = {v: k for k, v in _st_dtypes().items()}
    header: dict[str, Any] = {}
    offset = 0
    for name, arr in tensors.items():
        if arr.dtype not in names:
            raise ValueError(f"write_safetensors: tensor {name!r} has dtype {arr.dtype}; expected one of {list(names)}")
        header[name] = {"dtype": names[arr.dtype], "shape": list(arr.shape),
                        "data_offsets": [offset, offset + arr.nbytes]}
        offset += arr.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with open(file, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for arr in tensors.values():
            f.write(np.ascontiguousarray(arr).tobytes())
    return 8 + len(raw) + offset
