"""Counts XLA compilations per stage through `jax.monitoring`, so "zero recompiles" is testable."""

from __future__ import annotations

import contextlib
import threading
from collections import defaultdict
from typing import Iterator

import jax

_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
BACKGROUND = "background"  # the stage of a background warm-up's compiles (ModelRunner.warmup)
_lock = threading.Lock()
_local = threading.local()
_total = 0
_by_stage: dict[str, list[float]] = defaultdict(list)


def _listener(event: str, duration: float, **_: object) -> None:
    global _total
    if event != _COMPILE_EVENT:
        return
    with _lock:
        _total += 1
        _by_stage[getattr(_local, "stage", None) or "other"].append(duration)


jax.monitoring.register_event_duration_secs_listener(_listener)

_CACHE_HIT_EVENT = "/jax/compilation_cache/cache_hits"
_cache_hits = 0


def _hit_listener(event: str, **_: object) -> None:
    global _cache_hits
    if event == _CACHE_HIT_EVENT:
        with _lock:
            _cache_hits += 1
        _local.hits = getattr(_local, "hits", 0) + 1  # recorded by the thread that compiles


jax.monitoring.register_event_listener(_hit_listener)


def cache_hit_count() -> int:
    """Compilations in this process so far that were loaded from the persistent compile cache."""
    return _cache_hits


def thread_cache_hit_count() -> int:
    """Persistent-cache loads in this thread so far (a compile's own thread records its hit)."""
    return getattr(_local, "hits", 0)


def compile_count(exclude: tuple[str, ...] = ()) -> int:
    """XLA compilations in this process so far (all stages, but those in `exclude`)."""
    with _lock:
        return _total - sum(len(_by_stage[s]) for s in exclude if s in _by_stage)


@contextlib.contextmanager
def stage(name: str) -> Iterator[None]:
    """Attribute compilations inside this block to `name` in the report."""
    prev = getattr(_local, "stage", None)
    _local.stage = name
    try:
        yield
    finally:
        _local.stage = prev


def stage_table() -> dict[str, tuple[int, float]]:
    """stage -> (graphs compiled, total compile seconds)."""
    with _lock:
        return {k: (len(v), float(sum(v))) for k, v in _by_stage.items()}


def format_table(table: dict[str, tuple[int, float]]) -> str:
    rows = [f"{'stage':<14} {'graphs':>6} {'compile s':>10}"]
    for name, (n, secs) in sorted(table.items()):
        rows.append(f"{name:<14} {n:>6} {secs:>10.2f}")
    n_all = sum(n for n, _ in table.values())
    s_all = sum(s for _, s in table.values())
    rows.append(f"{'total':<14} {n_all:>6} {s_all:>10.2f}")
    return "\n".join(rows)
