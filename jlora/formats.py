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
both readers to the reference libraries (`tests/test_formats.py`). Measured on the default Q4_1 GGUF
(2026-12-04, the shared 2-core machine, same run): the config alone (`read_model_config`) 7.8 s with
`GGUFReader` -> 0.23 s here; all tensors dequantized (`read_gguf`, an uncached start) 11.0 s -> 5.0 s.
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


def write_safetensors(file: str | Path, tensors: dict[str, Any]) -> int:
    """Tensors back to back after a JSON header padded to 8 bytes (the safetensors layout). Returns the file size.

    A value is an array, or a lazy tensor (`jlora.models.tensors`: `shape`, `dtype`, `rows()`,
    `release()`), which is read, written and released one at a time: a file larger than memory can be written.
    """
    names = {v: k for k, v in _st_dtypes().items()}
    header: dict[str, Any] = {}
    offset = 0
    for name, arr in tensors.items():
        dtype, shape = np.dtype(arr.dtype), tuple(int(s) for s in arr.shape)
        if dtype not in names:
            raise ValueError(f"write_safetensors: tensor {name!r} has dtype {dtype}; expected one of {list(names)}")
        size = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        header[name] = {"dtype": names[dtype], "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with open(file, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for name, arr in tensors.items():
            a = np.asarray(arr.rows() if hasattr(arr, "rows") else arr)
            a = a if a.flags.c_contiguous else a.copy(order="C")  # (ascontiguousarray makes a 0-d array 1-d)
            if list(a.shape) != header[name]["shape"] or names.get(a.dtype) != header[name]["dtype"]:
                raise ValueError(f"write_safetensors: tensor {name!r} read as {a.dtype}{list(a.shape)}, "
                                 f"declared {header[name]['dtype']}{header[name]['shape']}")
            f.write(a.reshape(-1).view(np.uint8).data)
            del a
            if hasattr(arr, "release"):
                arr.release()
    return 8 + len(raw) + offset


# ---- GGUF -------------------------------------------------------------------------------------------
# llama.cpp's file: magic "GGUF", version (2 or 3), tensor count, metadata count, the metadata
# key/value pairs, one info per tensor (name, dims with ne0 -- the fastest axis -- first, GGML type,
# offset), padding to `general.alignment` (32 by default), then the tensors' data.

# GGUF metadata value types (llama.cpp's gguf_type): fixed-size ones by struct format, then string, array.
_GGUF_SCALAR = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_GGUF_STRING, _GGUF_ARRAY = 8, 9
GGUF_DEFAULT_ALIGNMENT = 32


@dataclasses.dataclass(frozen=True)
class GGUFTensorInfo:
    name: str
    shape: tuple[int, ...]  # NumPy order (slowest axis first), as the dequantized array has it
    ggml_type: int  # gguf.GGMLQuantizationType value
    offset: int  # absolute byte offset of the data in the file


def _gguf_file(path: str | Path) -> Path:
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"GGUF file {str(path)!r} does not exist")
    return path


def read_gguf_fields(path: str | Path) -> dict[str, Any]:
    """`{name: value}` for every metadata field of a GGUF file, as `gguf.GGUFReader`'s `contents()`
    (without its "GGUF.*" pseudo-fields). Reads only the metadata at the head of the file."""
    path = _gguf_file(path)
    try:
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            return _gguf_fields(buf)[0]
    except (ValueError, struct.error, UnicodeDecodeError, OSError) as e:
        raise ValueError(f"{path} is not a readable GGUF file: {e}") from e


def read_gguf_header(path: str | Path) -> tuple[dict[str, Any], dict[str, GGUFTensorInfo]]:
    """(metadata fields, {tensor name: info}) from the file's head; no tensor data is read."""
    path = _gguf_file(path)
    try:
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            return _gguf_header(buf)
    except (ValueError, struct.error, UnicodeDecodeError, OSError) as e:
        raise ValueError(f"{path} is not a readable GGUF file: {e}") from e


def read_gguf_tensors(path: str | Path) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """(metadata fields, {tensor name: f32 array in NumPy order}), dequantized by `gguf.quants`."""
    import gguf

    fields, infos = read_gguf_header(path)
    try:
        data = np.memmap(path, dtype=np.uint8, mode="r")
        tensors = {}
        for t in infos.values():
            qtype = gguf.GGMLQuantizationType(t.ggml_type)
            block, type_size = gguf.GGML_QUANT_SIZES[qtype]
            row = t.shape[-1] if t.shape else 1
            if row % block:
                raise ValueError(f"tensor {t.name!r}: a row of {row} is not a multiple of the {qtype.name} "
                                 f"block size {block}")
            n_bytes = int(np.prod(t.shape)) // block * type_size
            if t.offset + n_bytes > data.size:
                raise ValueError(f"tensor {t.name!r} runs past the end of the file")
            raw = data[t.offset:t.offset + n_bytes].reshape(-1, row // block * type_size)
            try:
                arr = np.asarray(gguf.quants.dequantize(raw, qtype), np.float32).reshape(t.shape)
            except NotImplementedError as e:
                raise ValueError(f"tensor {t.name!r}: {e}") from e
            # F32 tensors come back as views of the file: copy them, so no array holds the mmap.
            tensors[t.name] = np.array(arr) if np.may_share_memory(arr, data) else arr
        return fields, tensors
    except (ValueError, KeyError, OSError) as e:
        raise ValueError(f"{path} is not a readable GGUF file: {e}") from e


def _gguf_fields(buf: mmap.mmap) -> tuple[dict[str, Any], int, int]:
    """(fields, tensor count, position after the metadata)."""
    magic, version, n_tensors, n_kv = struct.unpack_from("<4sIQQ", buf, 0)
    if magic != b"GGUF" or version not in (2, 3):
        raise ValueError(f"magic {magic!r} version {version}, expected b'GGUF' version 2 or 3 (little-endian)")
    fields: dict[str, Any] = {}
    pos = 24
    for _ in range(n_kv):
        key, pos = _gguf_string(buf, pos)
        (kind,) = struct.unpack_from("<I", buf, pos)
        fields[key], pos = _gguf_value(buf, pos + 4, kind)
    return fields, n_tensors, pos


def _gguf_header(buf: mmap.mmap) -> tuple[dict[str, Any], dict[str, GGUFTensorInfo]]:
    fields, n_tensors, pos = _gguf_fields(buf)
    entries = []
    for _ in range(n_tensors):
        name, pos = _gguf_string(buf, pos)
        (n_dims,) = struct.unpack_from("<I", buf, pos)
        dims = struct.unpack_from(f"<{n_dims}Q", buf, pos + 4)
        ggml_type, offset = struct.unpack_from("<IQ", buf, pos + 4 + 8 * n_dims)
        pos += 4 + 8 * n_dims + 12
        entries.append((name, tuple(int(d) for d in reversed(dims)), ggml_type, offset))
    align = fields.get("general.alignment", GGUF_DEFAULT_ALIGNMENT)
    if not isinstance(align, int) or align <= 0 or align & (align - 1):
        raise ValueError(f"general.alignment={align!r}, expected a power of two")
    start = pos + (-pos % align)
    infos: dict[str, GGUFTensorInfo] = {}
    for name, shape, ggml_type, offset in entries:
        if name in infos:
            raise ValueError(f"tensor {name!r} is listed twice")
        infos[name] = GGUFTensorInfo(name, shape, ggml_type, start + offset)
    return fields, infos


def _gguf_string(buf: mmap.mmap, pos: int) -> tuple[str, int]:
    (n,) = struct.unpack_from("<Q", buf, pos)
    end = pos + 8 + n
    if end > len(buf):
        raise ValueError(f"a string at byte {pos} runs past the end of the file")
    return buf[pos + 8:end].decode("utf-8"), end


def _gguf_value(buf: mmap.mmap, pos: int, kind: int) -> tuple[Any, int]:
    if kind == _GGUF_STRING:
        return _gguf_string(buf, pos)
    if kind in _GGUF_SCALAR:
        fmt = _GGUF_SCALAR[kind]
        return struct.unpack_from(fmt, buf, pos)[0], pos + struct.calcsize(fmt)
    if kind != _GGUF_ARRAY:
        raise ValueError(f"unknown GGUF value type {kind} at byte {pos}")
    kind, count = struct.unpack_from("<IQ", buf, pos)
    pos += 12
    if kind in _GGUF_SCALAR:  # one NumPy read for a numeric array (token types, scores)
        nbytes = count * struct.calcsize(_GGUF_SCALAR[kind])
        if pos + nbytes > len(buf):
            raise ValueError(f"an array at byte {pos} runs past the end of the file")
        return np.frombuffer(buf[pos:pos + nbytes], dtype=_GGUF_SCALAR[kind]).tolist(), pos + nbytes
    items = []
    for _ in range(count):
        item, pos = _gguf_value(buf, pos, kind)
        items.append(item)
    return items, pos
