"""A content-addressed disk cache of converted arrays: one entry is one safetensors file and a meta.json.

Two users, each a thin layer over `ContentCache`: `jlora.models.weights_cache` (the converted model
weights, so a second start does not dequantize the GGUF again) and `jlora.adapters.disk_cache`
(converted adapters, so a restart or a second engine does not convert again).

    <root>/<key>/<tensors file>   the arrays, read back through mmap (`jlora.formats.read_safetensors`)
    <root>/<key>/meta.json        format_version, key, file_size, tensor names, plus the user's fields
    <root>/hashes/<tag>           memoized sha256 of source files, by (path, size, mtime)

The key hashes what the arrays depend on (the sources' contents, never their paths or mtimes), the
user's kind ("weights", "adapter") and FORMAT_VERSION, so an edited source misses and a copy of the
same file elsewhere hits. An entry is written into a temporary directory and renamed into place, so
a crash leaves no half-written entry under its key; one that is damaged anyway (truncated, edited,
wrong format, arrays its user rejects) is detected on read, logged, removed and rebuilt: never a
crash, never wrong data. Never pickle.

Each `ContentCache` counts what it did in its own `stats` (hits, misses, rebuilds, bytes_read,
bytes_written, write_errors, evicted); nothing else is process-global. Where the caches live, their size
caps (least recently used entries go when one is written) and the rule that a cache folder must be
the user's own: `jlora.caches`.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import json
import logging
import os
import shutil
import tempfile
import threading
from pathlib import Path
from typing import Any, Callable, TypeVar

import numpy as np

from jlora import caches
from jlora.formats import read_safetensors, write_safetensors

logger = logging.getLogger(__name__)

FORMAT_VERSION = 1
META_FILE = "meta.json"
HASHES_DIR = "hashes"
# What a damaged entry raises on read (a user's `decode` raises ValueError for arrays it rejects).
DAMAGED = (OSError, ValueError, KeyError, TypeError)

T = TypeVar("T")


def env_enabled(var: str) -> bool:
    """False when the environment variable `var` says off (0, false, no, off); on by default."""
    return os.environ.get(var, "1").strip().lower() not in ("0", "false", "no", "off")


def file_sha256(path: Path, root: Path | None = None) -> str:
    """sha256 of the file's bytes; memoized under `root` by (absolute path, size, mtime_ns).

    Hashing the 98 MB default GGUF takes ~0.15 s; the memo makes a multi-GB checkpoint hashed once.
    """
    st = path.stat()
    memo = None
    if root is not None:
        tag = hashlib.sha1(f"{path.resolve()}|{st.st_size}|{st.st_mtime_ns}".encode()).hexdigest()
        memo = root / HASHES_DIR / tag
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


@dataclasses.dataclass(frozen=True)
class CacheKind:
    """One user of the cache: its kind (in every key), its tensors file, its switch (`<env>=0` turns it
    off), its folder's name in `jlora.caches` (folder, cap) and whether a hit hands out views of the
    entry's file (then the entry is held: this process's evictions keep it)."""

    kind: str
    tensors_file: str
    env: str
    dir_name: str
    holds_entries: bool = False

    def enabled(self) -> bool:
        return env_enabled(self.env)

    def default_dir(self) -> Path:
        """`jlora.caches.cache_dir`: its own variable (`<env>_DIR`), else `$JLORA_CACHE_DIR/<dir_name>`."""
        return caches.cache_dir(self.dir_name)

    def open(self, root: str | os.PathLike | None = None) -> ContentCache:
        """The cache at `root` (default: `default_dir()`); its `stats` count what it did."""
        return ContentCache(root if root is not None else self.default_dir(), self.kind, self.tensors_file,
                            cap_name=self.dir_name, holds_entries=self.holds_entries)


def content_key(kind: str, *parts: str) -> str:
    """32 hex digits over the kind, FORMAT_VERSION and `parts` (what the arrays depend on)."""
    raw = "|".join((f"jlora-{kind}-v{FORMAT_VERSION}", *parts))
    return hashlib.sha256(raw.encode()).hexdigest()[:32]


class ContentCache:
    """Entries of one kind under `root`, each `<root>/<key>/{tensors_file, meta.json}`."""

    def __init__(self, root: str | os.PathLike, kind: str, tensors_file: str, cap_name: str | None = None,
                 holds_entries: bool = False):
        """`cap_name`: the `jlora.caches` cache whose cap bounds this folder (None: no cap)."""
        self.root = Path(root)
        self.kind = kind
        self.tensors_file = tensors_file
        self.cap_name = cap_name
        self.holds_entries = holds_entries
        self.stats: collections.Counter[str] = collections.Counter()
        self._lock = threading.Lock()  # conversion workers share one cache

    def __repr__(self) -> str:
        return f"ContentCache({str(self.root)!r}, kind={self.kind!r})"

    def _count(self, key: str, n: int = 1) -> None:
        with self._lock:
            self.stats[key] += n

    # ---- keys -------------------------------------------------------------------------------------

    def key(self, *parts: str) -> str:
        return content_key(self.kind, *parts)

    def digest(self, path: Path) -> str:
        """sha256 of a source file, memoized under this cache's root."""
        return file_sha256(path, self.root)

    # ---- entries ----------------------------------------------------------------------------------

    def entry(self, key: str) -> Path:
        return self.root / key

    def read(self, key: str) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
        """(meta, read-only tensors over an mmap) of the entry; one of DAMAGED if it does not check out."""
        entry = self.entry(key)
        meta = json.loads((entry / META_FILE).read_text())
        if not isinstance(meta, dict) or meta.get("format_version") != FORMAT_VERSION or meta.get("key") != key:
            raise ValueError(f"format_version={meta.get('format_version')!r}, key={meta.get('key')!r}"
                             if isinstance(meta, dict) else "meta.json is not an object")
        file = entry / self.tensors_file
        size = file.stat().st_size
        if size != meta.get("file_size"):
            raise ValueError(f"{file} has {size} bytes, meta.json says {meta.get('file_size')}")
        tensors = read_safetensors(file)
        if sorted(tensors) != sorted(meta.get("tensors", [])):
            raise ValueError("tensor names differ from meta.json")
        return meta, tensors

    def get(self, key: str, decode: Callable[[dict[str, Any], dict[str, np.ndarray]], T]) -> T | None:
        """`decode(meta, tensors)` of the entry under `key`, or None (a miss) when there is none or it is
        damaged: a damaged entry (or one `decode` rejects with one of DAMAGED) is logged and removed, so
        the caller's rebuild replaces it. A hit marks the entry used (and held, for a kind whose values
        are views of it). A folder that is not the user's own (`caches.usable`) is always a miss."""
        entry = self.entry(key)
        if not caches.usable(self.root):
            self._count("misses")
            return None
        if entry.exists():
            try:
                meta, tensors = self.read(key)
                value = decode(meta, tensors)
                self._count("hits")
                self._count("bytes_read", int(meta["file_size"]))
                caches.touch(entry)
                if self.holds_entries:
                    caches.hold(entry)
                return value
            except DAMAGED as e:
                logger.warning("%s cache entry %s is damaged (%s); rebuilding it", self.kind, entry, e)
                self._count("rebuilds")
                shutil.rmtree(entry, ignore_errors=True)
        self._count("misses")
        return None

    def put(self, key: str, tensors: dict[str, np.ndarray], info: dict[str, Any]) -> Path | None:
        """Write an entry into a temporary directory, then rename it to `<root>/<key>` (atomic: no half
        entries; if another process finished the same entry first, theirs is kept). None when it could
        not be written (a full disk, a read-only home, a folder that is not the user's own): the caller
        serves its arrays uncached. Then the least recently used entries go while the folder is over
        its cap (never this one)."""
        if not caches.usable(self.root):
            self._count("write_errors")
            return None
        tmp: Path | None = None
        try:
            caches.make_dir(self.root)
            tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{key}-", dir=self.root))
            size = write_safetensors(tmp / self.tensors_file, tensors)
            meta = {"format_version": FORMAT_VERSION, "key": key, "file_size": size, "tensors": sorted(tensors),
                    **info}
            (tmp / META_FILE).write_text(json.dumps(meta, indent=1))
            try:
                os.rename(tmp, self.entry(key))
            except OSError:
                if not (self.entry(key) / META_FILE).is_file():
                    raise
            self._count("bytes_written", size)
            if self.holds_entries:
                caches.hold(self.entry(key))
            if self.cap_name is not None:
                evicted = caches.evict(self.cap_name, self.root, keep=[self.entry(key)], skip=[HASHES_DIR])
                if evicted:
                    self._count("evicted", len(evicted))
            return self.entry(key)
        except OSError as e:
            logger.warning("could not write the %s cache under %s (%s); continuing without it", self.kind,
                           self.root, e)
            self._count("write_errors")
            return None
        finally:
            if tmp is not None:
                shutil.rmtree(tmp, ignore_errors=True)
