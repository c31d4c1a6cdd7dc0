"""Where jlora keeps what it caches on disk: one root, a folder per cache, a size cap each.

    $JLORA_CACHE_DIR (default ~/.cache/jlora)     the root, like HF_HOME
        xla/           JAX's persistent compile cache (`jlora.engine.startup.enable_compilation_cache`)
        weights/       converted model weights (`jlora.models.weights_cache`)
        adapters/      converted LoRA adapters (`jlora.adapters.disk_cache`)
        executables/   serialized step graphs (`jlora.engine.executables`)

`cache_dir(name)` is the one place a default cache path is computed. A per-cache variable
(`JLORA_WEIGHTS_CACHE_DIR`, `JLORA_ADAPTER_CACHE_DIR`, `JLORA_EXECUTABLE_CACHE_DIR`) or an explicit
path (`LLM(compilation_cache_dir=..., weights_cache=path, adapter_cache=path, executable_cache=path)`)
still puts that one cache elsewhere.

Each cache has a cap in GB (1e9 bytes), `JLORA_CACHE_MAX_<NAME>_GB` (a number > 0, or `none` for no
cap). When an entry is written, the least recently used entries go until the folder fits (`evict`):
never the entry being written, nor one this process holds (`hold`). "Used" is the entry's mtime:
a write sets it, and a read touches it (`touch`), because atime is often off (noatime, relatime).
The XLA cache is JAX's own: its `jax_compilation_cache_max_size` does the same there.

Loading a cached file runs what it holds (executables are pickles), so a folder is used only when
the current user owns it and neither group nor others can write it (`usable`); otherwise a warning,
once per folder, and that cache is not used. Folders jlora creates are 0o700.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import shutil
import threading
from pathlib import Path
from typing import Iterable

logger = logging.getLogger(__name__)

ROOT_ENV = "JLORA_CACHE_DIR"
GB = 10**9


@dataclasses.dataclass(frozen=True)
class Cache:
    """One cache: its folder under the root, its per-cache folder variable (None: none) and its cap."""

    name: str
    dir_env: str | None
    default_cap_gb: float
    what: str

    @property
    def cap_env(self) -> str:
        return f"JLORA_CACHE_MAX_{self.name.upper()}_GB"


# Caps: weights 20 GB holds Llama-3.1-8B in bfloat16 (16 GB) or a few smaller models (the default
# model is 0.5 GB in float32); adapters 5 GB holds ~30 rank-16 adapters of an 8B model (stored as
# float32, ~170 MB each) or thousands of small ones; executables 4 GB and xla 5 GB hold ~6 engine
# configurations of a 1B model on a TPU (14-37 MB per serialized graph, docs/tpu.md) and every graph
# the CPU test suite compiles (~40 MB).
CACHES: dict[str, Cache] = {c.name: c for c in (
    Cache("xla", None, 5, "JAX's persistent compile cache"),
    Cache("weights", "JLORA_WEIGHTS_CACHE_DIR", 20, "converted model weights"),
    Cache("adapters", "JLORA_ADAPTER_CACHE_DIR", 5, "converted LoRA adapters"),
    Cache("executables", "JLORA_EXECUTABLE_CACHE_DIR", 4, "serialized step graphs"),
)}


def _check_name(name: str) -> Cache:
    if name not in CACHES:
        raise ValueError(f"unknown cache {name!r}; the caches are {', '.join(CACHES)}")
    return CACHES[name]


def root() -> Path:
    """`$JLORA_CACHE_DIR` (with ~ expanded), else ~/.cache/jlora."""
    env = os.environ.get(ROOT_ENV)
    return Path(env).expanduser() if env else Path.home() / ".cache" / "jlora"


def cache_dir(name: str) -> Path:
    """The folder of cache `name`: its own variable when set, else `root()/name`."""
    c = _check_name(name)
    if c.dir_env and os.environ.get(c.dir_env):
        return Path(os.environ[c.dir_env]).expanduser()
    return root() / name


def max_bytes(name: str) -> int | None:
    """The cap of cache `name` in bytes (None: no cap), from `JLORA_CACHE_MAX_<NAME>_GB`."""
    c = _check_name(name)
    text = os.environ.get(c.cap_env, "").strip()
    if not text:
        return int(c.default_cap_gb * GB)
    if text.lower() in ("none", "-1"):
        return None
    try:
        gb = float(text)
    except ValueError:
        gb = float("nan")
    if not gb > 0 or gb == float("inf"):
        raise ValueError(f"{c.cap_env} must be a number of GB > 0 or 'none', got {text!r}")
    return int(gb * GB)


def check_env() -> None:
    """ValueError naming the variable when a cap variable is malformed (LLM() calls it before loading)."""
    for name in CACHES:
        max_bytes(name)


# ---- safety --------------------------------------------------------------------------------------------

_warned: set[str] = set()
_warned_lock = threading.Lock()


def refusal(folder: str | os.PathLike) -> str | None:
    """Why files may not be loaded from `folder` (None: they may): it must not exist yet (jlora
    creates it 0o700), or be owned by the current user and not writable by group or others."""
    folder = Path(folder)
    try:
        st = os.stat(folder)
    except (FileNotFoundError, NotADirectoryError):  # not there: jlora creates it (or reports why not)
        return None
    except OSError as e:
        return f"cannot stat it ({e})"
    if not hasattr(os, "getuid"):
        return None
    if st.st_uid != os.getuid():
        return f"it is owned by uid {st.st_uid}, not {os.getuid()}"
    if st.st_mode & 0o022:
        return f"group or others can write it (mode {st.st_mode & 0o777:o}; `chmod go-w {folder}` fixes it)"
    return None


def usable(folder: str | os.PathLike) -> bool:
    """Whether files may be loaded from `folder` (`refusal`). If not: a warning, once per folder, and
    False: the caller goes on without that cache."""
    why = refusal(folder)
    if why is None:
        return True
    with _warned_lock:
        first = str(folder) not in _warned
        _warned.add(str(folder))
    if first:
        logger.warning("jlora: not using the cache %s: %s. A cached file runs code when loaded, so only a "
                       "folder of your own that nobody else can write is used.", folder, why)
    return False


def make_dir(folder: str | os.PathLike) -> Path:
    """Create `folder` (and its parents) as 0o700; an existing one is left as it is."""
    folder = Path(folder)
    if not folder.is_dir():
        missing = [p for p in (folder, *folder.parents) if not p.exists()]
        for p in reversed(missing):
            try:
                p.mkdir(mode=0o700)
            except FileExistsError:
                pass
    return folder


# ---- LRU under a cap -----------------------------------------------------------------------------------

_held: set[Path] = set()
_held_lock = threading.Lock()


def hold(entry: str | os.PathLike) -> None:
    """Mark `entry` in use by this process (the weights it runs on, its executables' folder): no
    eviction in this process removes it."""
    with _held_lock:
        _held.add(Path(entry).absolute())


def touch(entry: str | os.PathLike) -> None:
    """Mark `entry` used now (its mtime), so LRU eviction keeps it; a read-only cache is left as is."""
    try:
        os.utime(entry)
    except OSError:
        pass


def _size(path: Path) -> int:
    try:
        if not path.is_dir() or path.is_symlink():
            return path.lstat().st_size
        return sum(_size(p) for p in path.iterdir())
    except OSError:
        return 0


def entries(folder: str | os.PathLike, skip: Iterable[str] = ()) -> list[tuple[float, int, Path]]:
    """(last used, bytes, path) of each entry of a content or executable cache, oldest first: the
    folder's children but hidden ones (temporary writes) and `skip`."""
    folder, skip = Path(folder), set(skip)
    out = []
    try:
        children = list(folder.iterdir())
    except OSError:
        return []
    for p in children:
        if p.name.startswith(".") or p.name in skip:
            continue
        try:
            used = p.lstat().st_mtime
        except OSError:
            continue
        out.append((used, _size(p), p))
    return sorted(out, key=lambda e: (e[0], str(e[2])))


def evict(name: str, folder: str | os.PathLike, keep: Iterable[str | os.PathLike] = (),
          skip: Iterable[str] = ()) -> list[Path]:
    """Remove the least recently used entries of cache `name` under `folder` until it fits its cap;
    never one in `keep` (the entry being written) or held by this process. The entries removed."""
    try:
        cap = max_bytes(name)
    except ValueError as e:
        logger.warning("jlora: %s; the %s cache is not trimmed", e, name)
        return []
    if cap is None:
        return []
    found = entries(folder, skip)
    total = sum(size for _, size, _ in found)
    with _held_lock:
        protected = {Path(k).absolute() for k in keep} | _held
    removed = []
    for _, size, path in found:
        if total <= cap:
            break
        if path.absolute() in protected:
            continue
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)
        else:
            try:
                path.unlink()
            except OSError:
                pass
        total -= size
        removed.append(path)
    if removed:
        logger.info("jlora: %s cache over its cap of %.1f GB: removed %d least recently used entries", name,
                    cap / GB, len(removed))
    return removed


# ---- the XLA cache -------------------------------------------------------------------------------------

XLA_SUFFIX, XLA_ATIME = "-cache", "-atime"


def prepare_xla_eviction(folder: str | os.PathLike) -> None:
    """Give every entry of JAX's compile cache an `-atime` file (its mtime) where it has none: entries
    written with eviction off have none, and JAX's eviction fails on the first of them."""
    folder = Path(folder)
    try:
        names = {f.name for f in os.scandir(folder)}
    except OSError:
        return
    for n in names:
        if n.endswith(XLA_SUFFIX) and (key := n[:-len(XLA_SUFFIX)]) + XLA_ATIME not in names:
            try:
                ns = (folder / n).stat().st_mtime_ns
                (folder / (key + XLA_ATIME)).write_bytes(ns.to_bytes(8, "little"))
            except OSError:
                pass


# ---- what `jlora cache` shows and clears ---------------------------------------------------------------


def describe(name: str, folder: Path | None = None) -> dict:
    """{name, folder, entries, bytes, cap, refused (why it is not used, or None)} of cache `name` (`folder`: where it is, default `cache_dir`)."""
    folder = cache_dir(name) if folder is None else Path(folder)
    if name == "xla":
        try:
            n = sum(1 for f in os.scandir(folder) if f.name.endswith(XLA_SUFFIX))
        except OSError:
            n = 0
    else:
        n = len(entries(folder, skip=("hashes",)))
    return {"name": name, "folder": str(folder), "entries": n, "bytes": _size(folder) if folder.is_dir() else 0,
            "cap": max_bytes(name), "refused": refusal(folder)}


def strays() -> list[Path]:
    """What the root holds besides the cache folders (an old layout's files: not used)."""
    try:
        return sorted(p for p in root().iterdir() if p.name not in CACHES)
    except OSError:
        return []


def clear(name: str) -> Path:
    """Remove cache `name`'s folder and everything in it. The folder removed."""
    folder = cache_dir(name)
    if folder.is_symlink():
        folder.unlink()
    elif folder.exists():
        shutil.rmtree(folder)
    return folder
