"""Checkpoint tensors that are read only when asked, a few rows at a time (the streaming loader's input).

A `Tensor` has a `shape` and a `dtype` and gives any rows (its first axis) with `rows(index)`; nothing
is read before that. Sources and transforms:

    open_safetensors(file)   views over an mmap of the file: reading rows copies nothing
    GGUFTensor               GGML blocks of a GGUF file dequantized row by row (and Q/K rows un-permuted)
    Cast(t, dtype)           rows cast to `dtype` (through float32, as the eager loader did)
    quantized(t)             (q, scale): int8 rows and their per-row scales (`quant.quantize_np`), which
                             are per row, so a subset of rows quantizes exactly as the whole tensor does

`release()` hands the file pages a tensor touched back to the kernel (madvise DONTNEED on the shared,
read-only mapping: the page cache keeps them, this process's RSS drops them, a later read faults them
in again), so host memory above the mmap stays at what the loader holds in flight.
"""

from __future__ import annotations

import mmap
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Mapping, Protocol

import numpy as np

Index = Any  # a slice or an int array over the first axis
# float32 bytes of the rows quantized per task: bounds each thread's temporaries (a few copies of
# a chunk) whatever the row length, and spreads a tensor over the threads.
QUANT_CHUNK_BYTES = 4 << 20


class Tensor(Protocol):
    shape: tuple[int, ...]
    dtype: np.dtype

    def rows(self, index: Index = slice(None)) -> np.ndarray: ...

    def release(self) -> None: ...


def nbytes(t: Any) -> int:
    return int(np.prod(t.shape, dtype=np.int64)) * np.dtype(t.dtype).itemsize


def release_pages(arr: np.ndarray) -> None:
    """madvise(DONTNEED) the pages of `arr` when it is a view of a read-only np.memmap; else nothing."""
    _advise(arr, "MADV_DONTNEED")


def prefetch_pages(arr: np.ndarray) -> None:
    """madvise(WILLNEED): the kernel starts reading `arr`'s pages in the background (the next layer's,
    while this one is being placed)."""
    _advise(arr, "MADV_WILLNEED")


def prefetch(t: Any) -> None:
    fn = getattr(t, "prefetch", None)
    if fn is not None:
        fn()


def _advise(arr: np.ndarray, advice: str) -> None:
    root = arr  # the array made over the mmap object itself (views and slices of a memmap are memmaps too)
    while isinstance(root, np.ndarray) and not isinstance(root.base, mmap.mmap):
        root = root.base
    if not isinstance(root, np.memmap) or not hasattr(mmap, advice) or root.mode != "r" or arr.nbytes == 0:
        return
    mm = root.base
    # The mapping starts at the file offset rounded down to the allocation granularity.
    start = (arr.__array_interface__["data"][0] - root.__array_interface__["data"][0]
             + root.offset % mmap.ALLOCATIONGRANULARITY)
    page = mmap.PAGESIZE
    lo = max(0, (start // page) * page)
    hi = min(len(mm), -(-(start + arr.nbytes) // page) * page)
    try:
        mm.madvise(getattr(mmap, advice), lo, hi - lo)
    except (OSError, ValueError):  # not fatal: the pages stay resident until the kernel wants them
        pass


class ArrayTensor:
    """An array already in memory, or a view over an mmap (released with `release_pages`)."""

    def __init__(self, array: np.ndarray):
        self.array = array
        self.shape, self.dtype = tuple(array.shape), array.dtype

    def rows(self, index: Index = slice(None)) -> np.ndarray:
        return self.array[index]

    def release(self) -> None:
        release_pages(self.array)

    def prefetch(self) -> None:
        prefetch_pages(self.array)

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        return np.asarray(self.array, dtype)


def as_tensor(x: Any) -> Tensor:
    return x if hasattr(x, "rows") else ArrayTensor(np.asarray(x))


def open_safetensors(file: str | Path) -> dict[str, Tensor]:
    """The tensors of a safetensors file as views over its mmap (checked as `read_safetensors` does)."""
    from jlora.formats import read_safetensors

    return {k: ArrayTensor(v) for k, v in read_safetensors(file).items()}


class Cast:
    """`src`'s rows as `dtype`. Other float dtypes go through float32 first (what the eager loader did:
    every tensor widened to float32, then cast), so both give the same bits."""

    def __init__(self, src: Tensor, dtype: Any):
        self.src, self.dtype, self.shape = src, np.dtype(dtype), src.shape

    def rows(self, index: Index = slice(None)) -> np.ndarray:
        x = self.src.rows(index)
        if x.dtype == self.dtype:
            return x
        if x.dtype != np.float32 and self.dtype != np.float32:
            x = x.astype(np.float32)
        return x.astype(self.dtype)

    def release(self) -> None:
        self.src.release()

    def prefetch(self) -> None:
        prefetch(self.src)

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        return np.asarray(self.rows(), dtype)


_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


def _threads() -> ThreadPoolExecutor:
    """A shared pool for row-chunk work (NumPy releases the GIL in its loops): one thread per core, up
    to 16 (int8 quantization of an 8B checkpoint runs here, ~50M weights/s per core)."""
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(max_workers=max(1, min(16, os.cpu_count() or 1)), thread_name_prefix="jlora-load")
        return _pool


class _Quantizer:
    """int8 rows + scales of `src` ([out, in], quantized per row), computed once per `rows` index
    for both parts (the q and scale parts ask for the same rows one after the other)."""

    def __init__(self, src: Tensor):
        self.src = src
        self._memo: tuple[Any, np.ndarray, np.ndarray] | None = None

    def compute(self, index: Index) -> tuple[np.ndarray, np.ndarray]:
        key = _index_key(index)
        if self._memo is not None and self._memo[0] == key:
            return self._memo[1], self._memo[2]
        from jlora.models.quant import quantize_np

        x = self.src.rows(index)
        q = np.empty(x.shape, np.int8)
        s = np.empty(x.shape[:-1], np.float32)

        step = max(1, QUANT_CHUNK_BYTES // (4 * max(1, x.shape[-1])))

        def chunk(lo: int) -> None:  # quantize_np of a row block: scales are per row, so exact
            q[lo:lo + step], s[lo:lo + step] = quantize_np(np.asarray(x[lo:lo + step], np.float32), axis=-1)

        starts = range(0, x.shape[0], step)
        if len(starts) > 1:
            list(_threads().map(chunk, starts))
        else:
            chunk(0)
        self._memo = (key, q, s)
        return q, s

    def release(self) -> None:
        self._memo = None
        self.src.release()


class _QPart:
    def __init__(self, quantizer: _Quantizer, part: int):
        self.quantizer, self.part = quantizer, part
        shape = quantizer.src.shape
        self.shape = tuple(shape) if part == 0 else tuple(shape[:-1])
        self.dtype = np.dtype(np.int8 if part == 0 else np.float32)

    def rows(self, index: Index = slice(None)) -> np.ndarray:
        return self.quantizer.compute(index)[self.part]

    def release(self) -> None:
        # The scale part is asked for after the weight part (the loader's and the cache writer's
        # order), so only its release drops the computed rows; the weight part's drops the pages.
        if self.part == 1:
            self.quantizer.release()
        else:
            self.quantizer.src.release()

    def prefetch(self) -> None:
        prefetch(self.quantizer.src)

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        return np.asarray(self.rows(), dtype)


def quantized(src: Tensor) -> tuple[Tensor, Tensor]:
    """(q i8[out, in], scale f32[out]) of `src`, per output row as `quant.quantize_np(w, axis=-1)`."""
    qz = _Quantizer(src)
    return _QPart(qz, 0), _QPart(qz, 1)


def _index_key(index: Index) -> Any:
    if isinstance(index, slice):
        return ("s", index.start, index.stop, index.step)
    a = np.asarray(index)
    return ("a", a.shape, a.tobytes())


# ---- GGUF -------------------------------------------------------------------------------------------


class GGUFTensor:
    """One GGUF tensor, dequantized (to float32) only for the rows asked for. `perm`: stored row of
    each output row (llama.cpp's Q/K row permutation undone), or None."""

    def __init__(self, data: np.ndarray, info: Any, perm: np.ndarray | None = None):
        import gguf

        self.data, self.info, self.perm = data, info, perm
        self.qtype = gguf.GGMLQuantizationType(info.ggml_type)
        block, type_size = gguf.GGML_QUANT_SIZES[self.qtype]
        self.shape, self.dtype = tuple(info.shape), np.dtype(np.float32)
        row = self.shape[-1] if self.shape else 1
        if row % block:
            raise ValueError(f"tensor {info.name!r}: a row of {row} is not a multiple of the {self.qtype.name} "
                             f"block size {block}")
        n_bytes = int(np.prod(self.shape, dtype=np.int64)) // block * type_size
        if info.offset + n_bytes > data.size:
            raise ValueError(f"tensor {info.name!r} runs past the end of the file")
        self.raw = data[info.offset:info.offset + n_bytes].reshape(-1, row // block * type_size)

    def rows(self, index: Index = slice(None)) -> np.ndarray:
        if len(self.shape) < 2:  # a vector is one GGML row: dequantize it whole
            v = self._dequantize(self.raw).reshape(self.shape)
            return (v if self.perm is None else v[self.perm])[index]
        sel = np.arange(self.shape[0])[index] if self.perm is not None else index
        raw = self.raw[self.perm[sel]] if self.perm is not None else self.raw[sel]
        out = self._dequantize(raw)
        return out.reshape((raw.shape[0],) + self.shape[1:])

    def _dequantize(self, raw: np.ndarray) -> np.ndarray:
        import gguf

        try:
            out = np.asarray(gguf.quants.dequantize(raw, self.qtype), np.float32)
        except NotImplementedError as e:
            raise ValueError(f"tensor {self.info.name!r}: {e}") from e
        return np.array(out) if np.may_share_memory(out, self.data) else out  # F32: no view of the file kept

    def release(self) -> None:
        release_pages(self.raw)

    def prefetch(self) -> None:
        prefetch_pages(self.raw)

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        return np.asarray(self.rows(), dtype)


def gguf_row_permutation(rows: int, n_head: int) -> np.ndarray:
    """The stored row of each HF row for llama.cpp's Q/K layout (`loading.reverse_gguf_permute` as indices)."""
    dim = rows // n_head // 2
    return np.arange(rows).reshape(n_head, dim, 2).swapaxes(1, 2).reshape(-1)


def materialize(tensors: Mapping[str, Any]) -> dict[str, np.ndarray]:
    """Every tensor read into memory (what the eager readers return)."""
    return {k: np.asarray(v.rows() if hasattr(v, "rows") else v) for k, v in tensors.items()}
