"""Compiling and storing the step graphs: warm-up (eager or in the background), the executable store.

`GraphCompiler` is a base of ModelRunner and owns what the runner's compiled graphs are and how
they came to be: `_executables` ((R, P, Q), with LoRA) -> compiled step, filled by `_compile`
(trace and lower each graph, then compile them side by side), by `_load_stored` (a serialized
executable of an earlier start, `jlora.engine.executables`) or, in a background warm-up, by a
thread (`_compile_pending`) while the engine serves; `compile_seconds` says where the time went.
It holds no device state: it reads the runner's `lower(key)` and `step_inputs(key)` (the step's
arguments, which are the runner's), its `config`, `lora` (whose slot writes it compiles too) and
`_out_layouts` (how each shape's packed outputs unpack, filled when a graph is traced). The step
reads `_executables`, and `_pending` (graphs a background warm-up has not compiled yet).
"""

from __future__ import annotations

import atexit
import os
import sys
import threading
import time
import weakref
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import jax
from tqdm.auto import tqdm

from jlora import compile_stats
from jlora.engine import executables
from jlora.engine.executables import ExecutableStore, graph_name


class GraphCompiler:
    """The step graphs' compiling, loading and background warm-up, as methods of ModelRunner (see the module)."""

    def __init__(self) -> None:
        # ((R, P, Q), with LoRA) -> compiled step (EngineConfig.step_graphs)
        self._executables: dict[tuple[tuple[int, int, int], bool], Any] = {}
        self.compile_seconds: dict[str, Any] = {"load_stored": 0.0, "trace_and_lower": 0.0, "compile": 0.0,
                                                "graphs": {}}
        # A background warm-up's graphs not compiled yet (`warmup(background=True)`), the thread that
        # compiles them, and what it raised.
        self._pending: set[tuple[tuple[int, int, int], bool]] = set()
        self._background: threading.Thread | None = None
        self._stop_background = threading.Event()
        self.background_error: BaseException | None = None
        # Serialized step graphs of an earlier start (jlora.engine.executables; LLM sets it), and
        # the graphs taken from it instead of compiled.
        self.executable_store: ExecutableStore | None = None
        self.loaded_graphs: set[tuple[tuple[int, int, int], bool]] = set()

    def _compile(self, keys: list[tuple[tuple[int, int, int], bool]], progress: bool = False,
                 stage: str = "step", stop: threading.Event | None = None) -> None:
        """Trace and lower each graph ((shape, with LoRA): Python, one at a time), then compile them on
        all cores at once (one at a time on XLA:CPU, below): XLA compiles outside the GIL, and the step
        graphs do not depend on each other. Not overlapped: on XLA:CPU a compile-cache load beside the next graph's tracing crashed
        the process (a segfault in XLA's executable deserialization; the later CI segfaults there were
        the test process out of memory maps, which may have been this one's cause too). `stop`: once
        set, lower no more graphs and start no more compiles."""
        if not keys:
            return
        t0 = time.perf_counter()
        store = self.executable_store
        if store is not None:
            store.prefetch(graph_name(k) for k in keys)
            keys = [k for k in keys if not self._load_stored(k, store)]
        t_loaded = time.perf_counter()
        lowered = {}
        for key in keys:
            if stop is not None and stop.is_set():
                return
            lowered[key] = self.lower(key)
        t1 = time.perf_counter()

        def build(key: tuple[tuple[int, int, int], bool]) -> None:
            if stop is not None and stop.is_set():
                return
            t, hits = time.perf_counter(), compile_stats.thread_cache_hit_count()
            with compile_stats.stage(stage):
                compiled = lowered[key].compile()
            compiled_here = compile_stats.thread_cache_hit_count() == hits
            self._executables[key] = compiled
            self._pending.discard(key)  # after the executable is in: a reader that sees it gone finds it
            self.compile_seconds["graphs"][f"{key[0]}{'' if key[1] else ' base'}"] = time.perf_counter() - t
            # Written off the warm-up's path (serving does not wait for the disk), and only when
            # compiled here: XLA:CPU re-serializes a compile-cache load without its kernels (it then
            # fails to run: "Function wrapped_iota not found").
            if store is not None and compiled_here:
                _STORE_WRITES.submit(store.put, graph_name(key), compiled, self._out_layouts[key[0]])

        if keys:
            bar = tqdm(total=len(keys), desc="jlora warm-up (compiling step graphs)", disable=not progress)
            # One graph at a time on XLA:CPU: its compiler runs threads of its own, and two graphs at
            # once were no faster on 2 cores (docs/benchmarks.md, "Warm-up on XLA:CPU").
            workers = 1 if jax.default_backend() == "cpu" else min(len(keys), os.cpu_count() or 1)
            with ThreadPoolExecutor(max_workers=workers) as pool:
                for _ in pool.map(build, keys):
                    bar.update(1)
            bar.close()
        # Where warm-up goes (start-up's largest part on a TPU): stored executables loaded, Python
        # tracing and lowering, one graph at a time, then the compiles (or persistent-cache loads)
        # side by side.
        part = "background_" if stage == compile_stats.BACKGROUND else ""
        for name, seconds in (("load_stored", t_loaded - t0), ("trace_and_lower", t1 - t_loaded),
                              ("compile", time.perf_counter() - t1)):
            self.compile_seconds[part + name] = self.compile_seconds.get(part + name, 0.0) + seconds

    def _load_stored(self, key: tuple[tuple[int, int, int], bool], store: ExecutableStore) -> bool:
        """Install the graph `key` from the executable store; False when it is not there or does not
        take this runner's arguments (then it compiles as usual)."""
        got = store.get(graph_name(key))
        if got is None:
            return False
        compiled, out_layout = got
        args, _ = self.step_inputs(key)
        if not executables.matches(compiled, jax.tree.map(_abstract, args)):
            return False
        self._out_layouts[key[0]] = out_layout
        self._executables[key] = compiled
        self._pending.discard(key)
        self.compile_seconds["graphs"][f"{key[0]}{'' if key[1] else ' base'}"] = 0.0
        self.loaded_graphs.add(key)
        return True

    def warmup(self, progress: bool = True, background: bool = False) -> None:
        """Compile the slot write and every step graph once, before the first request.

        background=True compiles `EngineConfig.first_graphs()` (which run any step) now and the rest
        in a thread while the engine serves: the scheduler picks among the compiled shapes
        (`can_run`), and no step waits for a compile. `wait_warmup` joins it."""
        self.lora.warmup()
        todo = [g for g in self.config.step_graphs() if g not in self._executables]
        if not background:
            self._compile(todo, progress)
            return
        self._compile([g for g in self.config.first_graphs() if g in todo], progress)
        rest = [g for g in todo if g not in self._executables]
        if not rest:
            return
        self._pending = set(rest)
        self._background = threading.Thread(target=self._compile_pending, args=(rest,), daemon=True,
                                            name="jlora-warmup")
        self._background.start()
        _BACKGROUND_RUNNERS.add(self)

    def _compile_pending(self, keys: list[tuple[tuple[int, int, int], bool]]) -> None:
        """The background warm-up: every pending graph lowered (the decode graphs first, the smallest
        rows first), then all compiled side by side (one at a time took twice as long on a v5e
        host); at interpreter exit none is lowered or compiled any more."""
        t = time.perf_counter()
        try:
            self._compile(sorted(keys, key=lambda k: (k[0][1] > 0, not k[1], k[0])), stage=compile_stats.BACKGROUND,
                          stop=self._stop_background)
        except BaseException as e:  # noqa: BLE001 (kept for wait_warmup; steps keep the compiled graphs)
            if self._stop_background.is_set():  # stopped (close, interpreter exit): not a failure
                return
            self.background_error = _without_tracebacks(e)
            print(f"jlora: background warm-up failed, steps keep to the graphs compiled so far: "
                  f"{type(e).__name__}: {e}", file=sys.stderr, flush=True)
        finally:
            self.compile_seconds["background"] = time.perf_counter() - t

    def wait_warmup(self, timeout: float | None = None) -> bool:
        """Wait for a background warm-up; True when every graph is compiled. Raises what the
        background compile raised."""
        if self._background is not None:
            self._background.join(timeout)
        if self.background_error is not None:
            raise RuntimeError("jlora's background warm-up failed") from self.background_error
        return not self._pending

    def stop_background_warmup(self) -> None:
        """Stop a background warm-up: it lowers no more graphs and starts no more compiles; the
        compile under way finishes (what `close` and interpreter exit wait for)."""
        self._stop_background.set()
        if self._background is not None:
            self._background.join()
        _BACKGROUND_RUNNERS.discard(self)


def _without_tracebacks(e: BaseException) -> BaseException:
    """`e` and the exceptions it chains, their tracebacks dropped: a traceback's frames hold the runner
    that keeps `e`, a reference cycle that kept a runner after a failed background warm-up alive
    until the cyclic collector ran."""
    seen: set[int] = set()
    x: BaseException | None = e
    while x is not None and id(x) not in seen:
        seen.add(id(x))
        x.__traceback__ = None
        x = x.__cause__ or x.__context__
    return e


def _abstract(x: Any) -> Any:
    """An array's shape, dtype and sharding (what lowering a step graph reads of it)."""
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding) if isinstance(x, jax.Array) else x


# Stored executables are written by one thread, after the compile: a warm-up never waits for them.
_STORE_WRITES = ThreadPoolExecutor(max_workers=1, thread_name_prefix="jlora-executable-writes")

def wait_for_stored_executables() -> None:
    """Wait until the executables handed to the store so far are written."""
    _STORE_WRITES.submit(lambda: None).result()


# Runners with a background warm-up: at exit each stops lowering and starting compiles and finishes
# the compile under way, so none is left running while JAX shuts its backends down. Registered to
# run before concurrent.futures' own exit hook (threading's exit hooks run before atexit's, the last
# registered first): after that hook a warm-up could not hand a stored executable to its writer
# ("cannot schedule new futures after shutdown"), and atexit's hooks ran beside a warm-up still
# lowering (a KeyError from inside the trace); both were printed as a failed warm-up.
_BACKGROUND_RUNNERS: "weakref.WeakSet[GraphCompiler]" = weakref.WeakSet()


def _stop_background_warmups() -> None:
    for runner in list(_BACKGROUND_RUNNERS):
        runner.stop_background_warmup()


getattr(threading, "_register_atexit", atexit.register)(_stop_background_warmups)
