"""Compiled step graphs kept on disk, so a warm start neither traces nor compiles them.

Why: on a TPU v5e a warm start (weights and XLA's persistent compile cache both filled) spent
9.9 of its 25 s tracing and lowering 7 step graphs in Python, 1.4 s each, only so that XLA's
cache could look each one up by its HLO (docs/tpu.md, fifth pass). This cache is looked up before
tracing: its key describes the graph from the outside (the arguments' shapes, dtypes and
shardings, the static arguments, the model's config), plus everything that could change what the
same description compiles to: jlora's own source files, the JAX and jaxlib versions, the
backend's platform version, the devices, and the flags that reach XLA.

    <root>/<key>.exe   JAX's serialized executable (`jax.experimental.serialize_executable`),
                       its argument and result trees, and how the step's packed outputs unpack

JAX serializes executables with pickle, so an entry is trusted as the persistent XLA cache is:
the directory is the user's own (`$JLORA_EXECUTABLE_CACHE_DIR`, else an `executables` sibling of
the XLA cache); never point it at files from elsewhere. An entry is written to a temporary file
and renamed into place; one that fails to load (truncated, from another build) is logged, removed
and compiled again. `JLORA_EXECUTABLE_CACHE=0` turns the cache off.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import pickle
import tempfile
from pathlib import Path
from typing import Any

import jax

from jlora.content_cache import cache_root, env_enabled

logger = logging.getLogger(__name__)

FORMAT_VERSION = 1
ENV = "JLORA_EXECUTABLE_CACHE"
SUFFIX = ".exe"
# Settings outside the graph's description that change what XLA makes of it.
_XLA_ENV = ("XLA_FLAGS", "LIBTPU_INIT_ARGS", "TPU_ACCELERATOR_TYPE")
_JAX_FLAGS = ("jax_default_matmul_precision", "jax_enable_x64", "jax_default_prng_impl", "jax_threefry_partitionable")


def cache_enabled() -> bool:
    return env_enabled(ENV)


def default_dir(compilation_cache_dir: str | os.PathLike | None = None) -> Path:
    return cache_root("executables", ENV + "_DIR", compilation_cache_dir)


@functools.lru_cache(maxsize=1)
def source_digest() -> str:
    """sha256 over jlora's Python files (paths relative to the package, and contents): any edit to
    the code that builds a graph misses the cache."""
    root = Path(__file__).resolve().parents[1]
    h = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        h.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()


def environment() -> str:
    """What the same graph compiles differently under: versions, backend, devices, XLA's flags."""
    import jaxlib

    dev = jax.devices()
    flags = {f: str(getattr(jax.config, f, None)) for f in _JAX_FLAGS}
    env = {v: os.environ.get(v, "") for v in _XLA_ENV}
    return repr((FORMAT_VERSION, jax.__version__, jaxlib.__version__, dev[0].client.platform,
                 dev[0].client.platform_version, [(d.id, d.device_kind) for d in dev], flags, env, source_digest()))


def describe(args: Any, static: dict[str, Any]) -> str:
    """The graph from the outside: its arguments' tree, each leaf's shape, dtype and sharding, and
    the static arguments."""
    def leaf(x: Any) -> Any:
        return (tuple(x.shape), str(x.dtype), repr(getattr(x, "sharding", None)))

    leaves, tree = jax.tree_util.tree_flatten(args)
    return repr((str(tree), [leaf(x) for x in leaves], sorted((k, repr(v)) for k, v in static.items())))


def entry_key(description: str) -> str:
    """40 hex digits over the environment and a graph's `describe`-style description."""
    return hashlib.sha256((environment() + "|" + description).encode()).hexdigest()[:40]


class ExecutableCache:
    """Serialized executables under `root`; `stats` counts hits, misses, writes and errors."""

    def __init__(self, root: str | os.PathLike):
        self.root = Path(root)
        self.stats = {"hits": 0, "misses": 0, "writes": 0, "errors": 0}

    def path(self, key: str) -> Path:
        return self.root / (key + SUFFIX)

    def load(self, key: str) -> tuple[jax.stages.Compiled, Any] | None:
        """(the executable, its extra payload), or None when absent or unreadable (then removed)."""
        from jax.experimental.serialize_executable import deserialize_and_load

        path = self.path(key)
        if not path.is_file():
            self.stats["misses"] += 1
            return None
        try:
            with open(path, "rb") as f:
                version, payload, in_tree, out_tree, extra = pickle.load(f)
            if version != FORMAT_VERSION:
                raise ValueError(f"format {version}, want {FORMAT_VERSION}")
            compiled = deserialize_and_load(payload, in_tree, out_tree)
        except Exception as e:  # a damaged or foreign entry: compile again, never fail the start
            logger.warning("jlora: executable cache entry %s unreadable (%s: %s); compiling again",
                           path, type(e).__name__, e)
            self.stats["errors"] += 1
            self.stats["misses"] += 1
            path.unlink(missing_ok=True)
            return None
        self.stats["hits"] += 1
        return compiled, extra

    def store(self, key: str, compiled: jax.stages.Compiled, extra: Any) -> bool:
        """Writes the entry (atomically); False, logged, when the executable or the disk refuses."""
        from jax.experimental.serialize_executable import serialize

        try:
            payload, in_tree, out_tree = serialize(compiled)
            self.root.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=self.root, suffix=".tmp")
            try:
                with os.fdopen(fd, "wb") as f:
                    pickle.dump((FORMAT_VERSION, payload, in_tree, out_tree, extra), f)
                os.replace(tmp, self.path(key))
            finally:
                if os.path.exists(tmp):
                    os.unlink(tmp)
        except Exception as e:  # a read-only disk or an executable that cannot be serialized
            logger.warning("jlora: could not write executable cache entry %s (%s: %s)", key, type(e).__name__, e)
            self.stats["errors"] += 1
            return False
        self.stats["writes"] += 1
        return True
