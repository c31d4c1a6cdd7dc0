"""On-disk cache of converted weights, so a second start neither dequantizes GGUF nor converts again.

An entry holds what `read_gguf` / `read_hf_checkpoint` return (Hugging Face names, [out, in]
layout, already cast to the compute dtype) as one safetensors file that is read back through
mmap, plus the model's config:

    <root>/<key>/model.safetensors
    <root>/<key>/meta.json          format version, key, config, dtype, sources, file size

The key hashes the source files' contents (sha256), the dtype and FORMAT_VERSION, so an edited
source misses and a copy of the same file elsewhere hits. Hashing the 98 MB default GGUF takes
~0.15 s; digests are memoized by (path, size, mtime) so multi-GB checkpoints are hashed once.
An entry is written into a temporary directory and renamed into place, so a crash leaves no
half-written entry under its key; one that is damaged anyway (truncated, edited, wrong format) is
detected on read and rebuilt.

Where: `JLORA_WEIGHTS_CACHE_DIR`, else a `weights` sibling of `JLORA_CACHE_DIR` (the persistent
XLA cache, see `jlora.llm.enable_compilation_cache`), else `~/.cache/jlora/weights`.
`JLORA_WEIGHTS_CACHE=0` (or `LLM(weights_cache=False)`) turns it off.
"""

from __future__ import annotations

import collections
import hashlib
import json
import logging
import os
import shutil
import struct
import tempfile
from pathlib import Path
from typing import Any, Callable

import numpy as np

from jlora.models.config import LlamaConfig

logger = logging.getLogger(__name__)

FORMAT_VERSION = 1
TENSORS_FILE = "model.safetensors"
META_FILE = "meta.json"
# hits, misses, rebuilds (a damaged entry replaced): `LLM` reads these to report what happened.
stats: collections.Counter[str] = collections.Counter()

_ST_DTYPES = {"F32": np.dtype(np.float32), "F16": np.dtype(np.float16), "I8": np.dtype(np.int8)}


def _st_dtypes() -> dict[str, np.dtype]:
    import ml_dtypes  # a jax dependency; NumPy itself has no bfloat16

    return {**_ST_DTYPES, "BF16": np.dtype(ml_dtypes.bfloat16)}


def env_enabled(var: str) -> bool:
    """False when the environment variable `var` says off (0, false, no, off); on by default."""
    return os.environ.get(var, "1").strip().lower() not in ("0", "false", "no", "off")


def cache_root(name: str, override_var: str) -> Path:
    """`$override_var`, else a `name` sibling of `$JLORA_CACHE_DIR`, else ~/.cache/jlora/`name`."""
    if os.environ.get(override_var):
        return Path(os.environ[override_var])
    if os.environ.get("JLORA_CACHE_DIR"):
        return Path(os.environ["JLORA_CACHE_DIR"]).parent / name
    return Path.home() / ".cache" / "jlora" / name


def cache_enabled() -> bool:
    return env_enabled("JLORA_WEIGHTS_CACHE")


def default_cache_dir() -> Path:
    return cache_root("weights", "JLORA_WEIGHTS_CACHE_DIR")


# ---- keys -------------------------------------------------------------------------------------------


def file_sha256(path: Path, root: Path | None = None) -> str:
    """sha256 of the file's bytes; memoized under `root` by (absolute path, size, mtime_ns)."""
    st = path.stat()
    memo = None
    if root is not None:
        tag = hashlib.sha1(f"{path.resolve()}|{st.st_size}|{st.st_mtime_ns}".encode()).hexdigest()
        memo = root / "hashes" / tag
        if memo.is_file():
            digest = memo.read_text().strip()
            if len(digest) == 64:
                return digest
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    digest = h.hexdigest()
    if memo is not None:
        try:
            memo.parent.mkdir(parents=True, exist_ok=True)
            memo.write_text(digest)
        except OSError:  # a read-only cache still works, it just hashes again
            pass
    return digest


def source_files(path: Path) -> list[Path]:
    """The files a GGUF model or an HF checkpoint directory is read from."""
    if path.is_file():
        return [path]
    files = [path / "config.json", *sorted(path.glob("*.safetensors"))]
    index = path / "model.safetensors.index.json"
    return files + ([index] if index.is_file() else [])


def entry_key(sources: list[Path], dtype_name: str, root: Path | None = None) -> str:
    h = hashlib.sha256(f"jlora-weights-v{FORMAT_VERSION}|{dtype_name}".encode())
    for f in sources:
        h.update(f"|{f.name}|{file_sha256(f, root)}".encode())
    return h.hexdigest()[:32]


# ---- safetensors, written and read here so bfloat16 needs no framework ------------------------------


def write_safetensors(file: Path, tensors: dict[str, np.ndarray]) -> int:
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


def read_safetensors_mmap(file: Path) -> dict[str, np.ndarray]:
    """Read-only arrays over an mmap of `file`; ValueError if its layout does not add up."""
    size = file.stat().st_size
    with open(file, "rb") as f:
        head = f.read(8)
        if len(head) != 8:
            raise ValueError(f"{file} is shorter than a safetensors header")
        (n,) = struct.unpack("<Q", head)
        if n > size - 8:
            raise ValueError(f"{file}: header length {n} runs past the end of the file ({size} bytes)")
        header = json.loads(f.read(n))
    header.pop("__metadata__", None)
    dtypes = _st_dtypes()
    buf = np.memmap(file, dtype=np.uint8, mode="r")
    out: dict[str, np.ndarray] = {}
    end_of_data = 0
    for name, info in header.items():
        dtype = dtypes.get(info.get("dtype"))
        start, end = info["data_offsets"]
        shape = tuple(int(s) for s in info["shape"])
        if dtype is None or end - start != int(np.prod(shape)) * dtype.itemsize or 8 + n + end > size:
            raise ValueError(f"{file}: tensor {name!r} ({info}) does not fit the file")
        out[name] = buf[8 + n + start: 8 + n + end].view(dtype).reshape(shape)
        end_of_data = max(end_of_data, end)
    if 8 + n + end_of_data != size:
        raise ValueError(f"{file}: {size} bytes, but the header accounts for {8 + n + end_of_data}")
    return out


# ---- entries --------------------------------------------------------------------------------------------


def _config_from_json(raw: dict[str, Any]) -> LlamaConfig:
    return LlamaConfig.from_json_dict(raw)


def read_entry(entry: Path, key: str) -> tuple[LlamaConfig, dict[str, np.ndarray]]:
    """An entry's config and tensors; ValueError (or OSError) if it is damaged or from another format."""
    meta = json.loads((entry / META_FILE).read_text())
    if meta.get("format_version") != FORMAT_VERSION or meta.get("key") != key:
        raise ValueError(f"format_version={meta.get('format_version')!r}, key={meta.get('key')!r}")
    file = entry / TENSORS_FILE
    if file.stat().st_size != meta.get("file_size"):
        raise ValueError(f"{file} has {file.stat().st_size} bytes, meta.json says {meta.get('file_size')}")
    tensors = read_safetensors_mmap(file)
    if sorted(tensors) != sorted(meta.get("tensors", [])):
        raise ValueError("tensor names differ from meta.json")
    return _config_from_json(dict(meta["config"])), tensors


def write_entry(root: Path, key: str, cfg: LlamaConfig, tensors: dict[str, np.ndarray], info: dict[str, Any]) -> Path:
    """Write into a temporary directory, then rename it to `<root>/<key>` (atomic: no half entries)."""
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{key}-", dir=root))
    try:
        size = write_safetensors(tmp / TENSORS_FILE, tensors)
        meta = {"format_version": FORMAT_VERSION, "key": key, "config": cfg.to_json_dict(),
                "file_size": size, "tensors": sorted(tensors), **info}
        (tmp / META_FILE).write_text(json.dumps(meta, indent=1))
        try:
            os.rename(tmp, root / key)
        except OSError:  # another process finished the same entry first: keep theirs
            if not (root / key / META_FILE).is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return root / key


def cached_read(
    path: Path,
    dtype: Any,
    read: Callable[[Path], tuple[LlamaConfig, dict[str, np.ndarray]]],
    root: Path | None = None,
    quantization: str | None = None,
) -> tuple[LlamaConfig, dict[str, np.ndarray], bool]:
    """(config, tensors cast to `dtype`, hit?) of the model at `path`, from the cache when it has them.

    `quantization` ("int8", "int8-weight-only"): the projections and lm head are stored as int8 plus
    `<name>_scale` (`jlora.models.quant.prepare_tensors`); both int8 modes share one entry.
    `read(path)` converts the source on a miss. The tensors returned on a miss are read back from the
    new entry, so a hit and a miss hand `build_model` the same bytes.
    """
    from jlora.models import quant

    root = Path(root) if root is not None else default_cache_dir()
    np_dtype = np.dtype(dtype)
    dtype_name = np_dtype.name
    quantized = quant.check_quantization(quantization) != "none"
    sources = source_files(path)
    key = entry_key(sources, dtype_name + ("|int8" if quantized else ""), root)
    entry = root / key
    if entry.exists():
        try:
            cfg, tensors = read_entry(entry, key)
            stats["hits"] += 1
            return cfg, tensors, True
        except (OSError, ValueError, KeyError, TypeError) as e:
            logger.warning("weights cache entry %s is damaged (%s); rebuilding it", entry, e)
            stats["rebuilds"] += 1
            shutil.rmtree(entry, ignore_errors=True)
    stats["misses"] += 1
    cfg, tensors = read(path)
    tensors = quant.prepare_tensors(tensors, cfg.tie_word_embeddings, np_dtype, quantization)
    info = {"dtype": dtype_name, "quantization": "int8" if quantized else "none", "sources": [{"path": str(f.resolve()), "size": f.stat().st_size} for f in sources]}
    try:
        entry = write_entry(root, key, cfg, tensors, info)
        cfg, tensors = read_entry(entry, key)
    except OSError as e:  # a full disk or read-only home: serve from memory, uncached
        logger.warning("could not write the weights cache under %s (%s); continuing without it", root, e)
    return cfg, tensors, False
