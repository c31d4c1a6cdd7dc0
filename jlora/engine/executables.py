"""Compiled step graphs kept on disk as serialized executables, so a warm start skips tracing.

JAX's persistent compile cache skips XLA's compile but not the Python tracing and lowering that
compute its key: on a v5e host 3.7 s of a 17.9 s warm start for the two graphs `LLM()` waits for
(v5e, 2026-12-06). This store keeps each compiled step graph
(`jax.experimental.serialize_executable`) under a key of everything its trace depends on, so a
later start of the same engine loads it without tracing it:

    <root>/<fingerprint>/<graph>.pkl    the executable, its argument and output trees, and how the
                                        host unpacks its outputs (the layout the trace recorded)

The fingerprint hashes jlora's version and its source files' bytes, the versions of Python, JAX,
jaxlib, Flax and NumPy, the platform and its version (libtpu's build), the devices, `XLA_FLAGS` /
`LIBTPU_INIT_ARGS`, JAX's configuration, the model's config, dtype and quantization and the engine's
config, whose `tuning` (jlora.tuning) holds every switch a trace reads. Anything else
a graph could depend on is checked when it is used: a loaded executable whose argument shapes,
dtypes or shardings differ from the runner's is dropped and the graph compiled as usual. An
unreadable or stale file is a miss, never an error.

Where: `JLORA_EXECUTABLE_CACHE_DIR`, else `$JLORA_CACHE_DIR/executables` (default
`~/.cache/jlora/executables`, `jlora.caches`). `JLORA_EXECUTABLE_CACHE=0` (or
`LLM(executable_cache=False)`) turns it off. The folder is capped (`JLORA_CACHE_MAX_EXECUTABLES_GB`):
when a graph is stored, the least recently used fingerprints go (never this store's own), so edits
to the source do not grow it without bound. Loading a file runs a pickle, so a folder that is not
the user's own, or that group or others can write, is not used (`jlora.caches.usable`: a warning,
and the graphs compile as usual).
"""

from __future__ import annotations

import hashlib
import logging
import os
import pickle
import platform
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, Iterable

import jax

from jlora import caches
from jlora.content_cache import env_enabled

logger = logging.getLogger(__name__)

FORMAT_VERSION = 1
ENV = "JLORA_EXECUTABLE_CACHE"
_PACKAGE = Path(__file__).resolve().parents[1]  # the jlora package
_SIMPLE = (bool, int, float, str, bytes, type(None))


def enabled() -> bool:
    return env_enabled(ENV)


def default_dir() -> Path:
    """`jlora.caches.cache_dir("executables")`: JLORA_EXECUTABLE_CACHE_DIR, else under JLORA_CACHE_DIR."""
    return caches.cache_dir("executables")


def graph_name(key: tuple[tuple[int, int, int], bool]) -> str:
    """A step graph's file name: (R, P, Q) and whether it carries LoRA."""
    (r, p, q), with_lora = key
    return f"{r}-{p}-{q}-{'lora' if with_lora else 'base'}"


_source_digest: str | None = None


def source_digest() -> str:
    """sha256 over jlora's Python sources (path and bytes): any edit to the code is a new fingerprint."""
    global _source_digest
    if _source_digest is None:
        h = hashlib.sha256()
        for f in sorted(_PACKAGE.rglob("*.py")):
            h.update(str(f.relative_to(_PACKAGE)).encode() + b"\0" + f.read_bytes() + b"\0")
        _source_digest = h.hexdigest()
    return _source_digest


def _stable(value: Any) -> str | None:
    """A repr that is the same in every process, or None for a value without one."""
    if isinstance(value, _SIMPLE):
        return repr(value)
    if isinstance(value, (tuple, list)):
        parts = [_stable(v) for v in value]
        return None if None in parts else f"{type(value).__name__}({', '.join(parts)})"
    if isinstance(value, dict):
        items = [(_stable(k), _stable(v)) for k, v in value.items()]
        return None if any(None in kv for kv in items) else "{" + ", ".join(f"{k}: {v}" for k, v in items) + "}"
    if isinstance(value, (set, frozenset)):
        parts = sorted(_stable(v) or "?" for v in value)
        return None if "?" in parts else f"set({', '.join(parts)})"
    return None


def _jax_config() -> list[str]:
    skip = ("cache", "log", "traceback", "dir", "profil")
    out = []
    for name in sorted(jax.config.values):
        if any(s in name for s in skip):
            continue
        text = _stable(getattr(jax.config, name, jax.config.values[name]))
        out.append(f"{name}={text}")
    return out


def _versions() -> list[str]:
    import flax
    import jaxlib
    import numpy

    import jlora

    return [f"jlora={jlora.__version__}", f"python={platform.python_version()}", f"jax={jax.__version__}", f"jaxlib={jaxlib.__version__}",
            f"flax={flax.__version__}", f"numpy={numpy.__version__}"]


def fingerprint(devices: Iterable[Any], *parts: str) -> str:
    """The key of a runner's graphs: the code, the libraries, the platform and `devices`, the
    environment's XLA options, JAX's configuration and the caller's `parts` (the model's config and
    the engine's, tuning options included). 32 hex digits."""
    devices = list(devices)
    client = devices[0].client
    raw = [f"jlora-executables-v{FORMAT_VERSION}", source_digest(), *_versions(),
           f"platform={client.platform} {client.platform_version}",
           "devices=" + ";".join(f"{d.id}:{d.device_kind}" for d in devices), f"processes={jax.process_count()}",
           *(f"{v}={os.environ.get(v, '')}" for v in ("XLA_FLAGS", "LIBTPU_INIT_ARGS", "JAX_PLATFORMS")),
           *_jax_config(), *parts]
    return hashlib.sha256("\n".join(raw).encode()).hexdigest()[:32]


class ExecutableStore:
    """The serialized step graphs of one fingerprint. `prefetch` starts reading some in threads
    (deserializing is the backend's work, so it overlaps the weights' transfer); `get` returns one
    (waiting for its prefetch); `put` writes one atomically. Counts what it did in `stats`."""

    def __init__(self, root: str | os.PathLike, key: str):
        self.root, self.key = Path(root), key
        self.dir = self.root / key
        caches.hold(self.dir)  # this process's evictions keep it
        self.stats = {"hits": 0, "misses": 0, "writes": 0, "errors": 0, "load_seconds": 0.0}
        # Each load's seconds, file size and when it finished (seconds since the store opened).
        self.loads: dict[str, dict[str, float]] = {}
        self.t0 = time.perf_counter()
        self._lock = threading.Lock()
        self._futures: dict[str, Future] = {}
        self._pool: ThreadPoolExecutor | None = None

    def __repr__(self) -> str:
        return f"ExecutableStore({str(self.dir)!r})"

    def path(self, name: str) -> Path:
        return self.dir / f"{name}.pkl"

    def prefetch(self, names: Iterable[str]) -> None:
        with self._lock:
            todo = [n for n in names if n not in self._futures and self.path(n).is_file()]
            if todo and self._pool is None:
                threads = int(os.environ.get("JLORA_EXECUTABLE_LOAD_THREADS", "4"))  # (an experiment's knob)
                self._pool = ThreadPoolExecutor(max_workers=max(1, min(threads, os.cpu_count() or 1)),
                                                thread_name_prefix="jlora-executables")
            for n in todo:
                self._futures[n] = self._pool.submit(self._read, n)

    def close(self) -> None:
        """Stop the prefetch threads (reads not started are cancelled). Idempotent; a later
        `prefetch` starts them again."""
        with self._lock:
            pool, self._pool = self._pool, None
            self._futures.clear()
        if pool is not None:
            pool.shutdown(wait=False, cancel_futures=True)

    def get(self, name: str) -> tuple[Any, Any] | None:
        """(compiled executable, output layout) of `name`, or None (not there, or unreadable)."""
        with self._lock:
            future = self._futures.pop(name, None)
        got = future.result() if future is not None else (self._read(name) if self.path(name).is_file() else None)
        with self._lock:
            self.stats["hits" if got is not None else "misses"] += 1
        return got

    def _read(self, name: str) -> tuple[Any, Any] | None:
        from jax.experimental.serialize_executable import deserialize_and_load

        t = time.perf_counter()
        try:
            data = self.path(name).read_bytes()
            payload, in_tree, out_tree, out_layout = pickle.loads(data)
            compiled = deserialize_and_load(payload, in_tree, out_tree)
        except Exception as e:  # noqa: BLE001 (a damaged or stale file is a miss: the graph compiles)
            logger.warning("jlora: executable %s unreadable, compiling it instead: %s: %s", self.path(name),
                           type(e).__name__, e)
            with self._lock:
                self.stats["errors"] += 1
            return None
        done = time.perf_counter()
        with self._lock:
            self.stats["load_seconds"] += done - t
            self.loads[name] = {"seconds": round(done - t, 3), "bytes": len(data), "done_at": round(done - self.t0, 3)}
        caches.touch(self.dir)  # recently used: kept by `_prune`
        return compiled, out_layout

    def put(self, name: str, compiled: Any, out_layout: Any) -> bool:
        """Write `compiled`; False (and a warning) when the backend cannot serialize it or the disk
        refuses it."""
        from jax.experimental.serialize_executable import serialize

        try:
            payload, in_tree, out_tree = serialize(compiled)
            data = pickle.dumps((payload, in_tree, out_tree, out_layout), protocol=pickle.HIGHEST_PROTOCOL)
            caches.make_dir(self.dir)
            tmp = self.path(name).with_suffix(f".tmp{os.getpid()}.{threading.get_ident()}")
            tmp.write_bytes(data)
            os.replace(tmp, self.path(name))
        except Exception as e:  # noqa: BLE001 (the store is an optimization: serving goes on)
            logger.warning("jlora: could not store executable %s: %s: %s", name, type(e).__name__, e)
            with self._lock:
                self.stats["errors"] += 1
            return False
        with self._lock:
            self.stats["writes"] += 1
        self._prune()
        return True

    def _prune(self) -> None:
        """Remove the least recently used fingerprints' folders while the store is over its cap
        (`jlora.caches`); never this store's own."""
        caches.evict("executables", self.root, keep=[self.dir])


def open_store(cache: bool | str | os.PathLike, key: str) -> ExecutableStore | None:
    """The store for `key`: None when off (`cache` False or JLORA_EXECUTABLE_CACHE=0) or when the
    folder is not the user's own (`caches.usable`, a warning); True: the default folder; a path: there."""
    if cache is False or not enabled():
        return None
    root = default_dir() if cache is True else Path(cache)
    if not caches.usable(root):
        return None
    return ExecutableStore(root, key)


def matches(compiled: Any, args: tuple[Any, ...]) -> bool:
    """Whether a loaded executable takes exactly these (abstract) arguments: the same tree, and
    every leaf's shape, dtype and sharding."""
    try:
        given = (tuple(args), {})
        if compiled.in_tree != jax.tree.structure(given):
            return False
        infos, shardings = jax.tree.leaves(compiled.args_info), jax.tree.leaves(compiled.input_shardings)
        leaves = jax.tree.leaves(given)
        return len(infos) == len(shardings) == len(leaves) and all(
            tuple(i.shape) == tuple(g.shape) and i.dtype == g.dtype and s.is_equivalent_to(g.sharding, len(g.shape))
            for i, s, g in zip(infos, shardings, leaves))
    except Exception:  # noqa: BLE001 (anything unexpected: not a match, the graph compiles)
        return False
