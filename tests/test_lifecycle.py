"""Engines clean up after themselves: a dropped LLM frees its memory without the cyclic garbage
collector (also once a server app has served it and stopped), `close()` / `with` free it at once, a closed LLM says so, and neither closing nor
interpreter exit during a background warm-up waits long or reports a failure."""

import asyncio
import contextlib
import gc
import subprocess
import sys
import textwrap
import threading
import time
import types
import weakref

import httpx
import jax
import pytest

from conftest import memory_maps
from jlora import LLM, SamplingParams

ENGINE = dict(max_model_len=128, max_num_seqs=2, max_num_batched_tokens=32, max_loras=2, max_lora_rank=8,
              token_buckets=(16, 32))
GREEDY = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)


@contextlib.contextmanager
def collector_off():
    """The cyclic garbage collector off (after one collection) for the block: what it frees then,
    reference counting alone freed."""
    gc.collect()
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


@pytest.fixture
def no_compile_cache():
    """The persistent compile cache off: a background warm-up's cache loads beside other XLA work
    once crashed XLA:CPU (tests/test_startup.py)."""
    prev = jax.config.jax_enable_compilation_cache
    jax.config.update("jax_enable_compilation_cache", False)
    yield
    jax.config.update("jax_enable_compilation_cache", prev)


def test_a_dropped_llm_frees_its_memory_maps_without_the_cyclic_collector(tiny_dir):
    """No reference cycle holds an engine: with the collector off, `del llm` frees its runner, its
    weights and KV cache, and its compiled graphs' code (most of its memory maps) at once."""
    with collector_off():
        before = memory_maps()
        llm = LLM(str(tiny_dir[0]), progress=False, **ENGINE)
        llm.generate(["Hello there"], GREEDY, use_tqdm=False)
        added = memory_maps() - before
        runner = llm.engine.runner
        held = [weakref.ref(x) for x in (runner, llm.model, *runner._weights, *runner.cache.values())]
        del llm, runner
        kept = memory_maps() - before
        alive = [r() for r in held if r() is not None]
    assert not alive, f"{len(alive)} of the engine's objects and arrays outlived it: {[type(x) for x in alive][:5]}"
    assert added > 0 and kept <= 0.25 * added, f"{kept} of the {added} memory maps the engine added were kept"


def test_with_closes_the_llm_and_frees_its_device_arrays(tiny_dir):
    # warmup=False: the graph the request needs is compiled, and freed at close, all the same.
    with LLM(str(tiny_dir[0]), progress=False, warmup=False, **ENGINE) as llm:
        assert len(llm.generate(["Hello there"], GREEDY, use_tqdm=False)[0].outputs[0].token_ids) == 4
        runner = llm.engine.runner
        arrays = [*runner.cache.values(), *runner._weights, *jax.tree.leaves(runner.lora_state)]
    assert llm.closed and llm.engine.closed
    assert arrays and all(x.is_deleted() for x in arrays)
    assert not runner._executables and runner.cache == {}


def test_a_closed_llm_raises_when_used_and_closes_once(tiny_dir):
    llm = LLM(str(tiny_dir[0]), progress=False, warmup=False, **ENGINE)  # closed before any graph is needed
    llm.close()
    llm.close()  # idempotent
    for use in (lambda: llm.generate(["Hello there"], GREEDY, use_tqdm=False),
                lambda: list(llm.generate_stream("Hello there", GREEDY)),
                lambda: llm.chat({"role": "user", "content": "hi"}, GREEDY, use_tqdm=False),
                lambda: llm.engine.add_request("Hello there", GREEDY),
                lambda: llm.engine.step(),
                lambda: llm.memory_report()):
        with pytest.raises(RuntimeError, match="is closed"):
            use()
    llm.engine.close()  # the engine's close is idempotent too


def test_close_during_a_background_warmup_returns_promptly_and_quietly(tiny_dir, monkeypatch, capsys,
                                                                       no_compile_cache):
    """The warm-up thread is held until a stop is asked for: close stops it before it lowers or
    compiles anything more, and a stop is not reported as a failure."""
    from jlora.engine.runner import ModelRunner

    real = ModelRunner._compile_pending

    def held(self, keys):
        self._stop_background.wait(60)
        real(self, keys)

    monkeypatch.setattr(ModelRunner, "_compile_pending", held)
    llm = LLM(str(tiny_dir[0]), warmup="background", progress=False, use_compilation_cache=False, **ENGINE)
    runner = llm.engine.runner
    pending = set(runner._pending)
    assert pending and runner._background.is_alive()
    t = time.perf_counter()
    llm.close()
    assert time.perf_counter() - t < 10
    assert not runner._background.is_alive() and runner.background_error is None
    assert runner._pending == pending  # stopped before compiling any of them
    assert "warm-up failed" not in capsys.readouterr().err


def test_interpreter_exit_during_a_background_warmup_is_quiet(tiny_dir, tmp_path):
    """Exit right after start: the exit hook stops the warm-up before concurrent.futures' own exit
    hook refuses its work ("cannot schedule new futures after shutdown" was reported as a failed
    warm-up). The executable store is on, so the warm-up hands its graphs to the store's writer."""
    script = textwrap.dedent(f"""
        from jlora import LLM
        llm = LLM({str(tiny_dir[0])!r}, warmup="background", progress=False, use_compilation_cache=False,
                  executable_cache={str(tmp_path / "executables")!r}, **{ENGINE!r})
        assert llm.engine.runner._background.is_alive()
    """)
    t = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "warm-up failed" not in done.stderr, done.stderr[-3000:]
    assert time.perf_counter() - t < 120


def test_data_parallel_close_closes_every_replica_and_its_threads():
    from jlora.engine.data_parallel import DataParallelEngine

    class Replica:
        config = tokenizer = eos_token_id = adapters = None
        closes = 0

        def close(self):
            self.closes += 1

        def has_unfinished(self):
            return True

        def step(self, finished_only=False):
            return []

    replicas = [Replica(), Replica()]
    engine = DataParallelEngine(replicas)
    before = set(threading.enumerate())
    assert engine.step() == []  # the pool's threads start
    threads = [t for t in set(threading.enumerate()) - before if t.name.startswith("jlora-dp")]
    with engine:
        pass
    engine.close()
    assert [r.closes for r in replicas] == [1, 1]
    assert threads and not any(t.is_alive() for t in threads)
    with pytest.raises(RuntimeError, match="is closed"):
        engine.step()
    with pytest.raises(RuntimeError, match="is closed"):
        engine.add_request("hi")


def test_flax_state_flattening_leaves_no_reference_cycle():
    """jlora.models.flax_cycles: nnx.split / merge / state / update leave nothing for the cyclic
    collector (Flax's own flatten kept every flattened Variable in a cycle), and flatten the same."""
    from flax import nnx

    from jlora.models import flax_cycles

    assert nnx.traversals.flatten_to_sequence is flax_cycles.flatten_to_sequence
    xs = {"foo": 1, "bar": {"a": 2, "b": {}}, "c": {"d": {"e": 3}}}
    assert flax_cycles.flatten_to_sequence(xs) == [(("foo",), 1), (("bar", "a"), 2), (("c", "d", "e"), 3)]
    assert flax_cycles.flatten_to_sequence(xs, is_leaf=lambda path, x: path == ("c",)) == [
        (("foo",), 1), (("bar", "a"), 2), (("c",), {"d": {"e": 3}})]
    model = nnx.Linear(2, 3, rngs=nnx.Rngs(0))
    with collector_off():
        copy = nnx.merge(*nnx.split(model))
        nnx.update(copy, nnx.from_flat_state(nnx.to_flat_state(nnx.state(model, nnx.Param))))
        assert gc.collect() == 0


def _threads(prefix: str, ignore: frozenset[threading.Thread] = frozenset()) -> list[threading.Thread]:
    """Live threads named `prefix...`, but those in `ignore` (the engines of other tests in this
    process, e.g. module fixtures, keep their own pools)."""
    return [t for t in threading.enumerate() if t.name.startswith(prefix) and t.is_alive() and t not in ignore]


def _ended(prefixes: tuple[str, ...], ignore: frozenset[threading.Thread] = frozenset(),
           timeout: float = 10.0) -> list[str]:
    """The names of threads with these prefixes, not in `ignore`, still alive after up to `timeout` s
    (a pool shut down without waiting ends its idle threads soon after)."""
    deadline = time.monotonic() + timeout
    while any(_threads(p, ignore) for p in prefixes) and time.monotonic() < deadline:
        time.sleep(0.05)
    return [t.name for p in prefixes for t in _threads(p, ignore)]


@pytest.mark.slow  # an engine that compiles and stores every graph, and its server, ~25 s
def test_the_server_and_then_the_llm_stop_every_thread_they_started(tiny_dir, tiny_adapters, tmp_path,
                                                                  empty_compile_cache):
    """Each pool an LLM and the server start: the server's lifespan ends its engine thread and its
    templating pool; `LLM.close()` the adapter converter's and the executable store's readers."""
    from fastapi.testclient import TestClient

    from jlora import LoRARequest
    from jlora.engine import executables, runner as runner_module
    from jlora.server.app import build_app

    before = frozenset(threading.enumerate())  # only the threads this test's LLM and server start count
    # Compiled here (`empty_compile_cache`): only compiled graphs are stored, and the store's readers need files.
    llm = LLM(str(tiny_dir[0]), progress=False, use_compilation_cache=False,
              executable_cache=str(tmp_path / "executables"), **ENGINE)
    runner_module.wait_for_stored_executables()
    llm.executable_store.prefetch(executables.graph_name(k) for k in llm.config.step_graphs())
    llm.engine.adapters.prepare_async(LoRARequest("a1", 1, str(tiny_adapters[1]))).result(60)
    assert _threads("jlora-executables", before) and _threads("jlora-adapters", before)
    app = build_app(llm, "tiny")
    with TestClient(app) as client:
        r = client.post("/v1/completions", json={"model": "tiny", "prompt": "Hello", "max_tokens": 2})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2
        assert _threads("jlora-engine", before) and _threads("jlora-prep", before)
    assert app.state.stopped_cleanly
    assert _ended(("jlora-engine", "jlora-prep"), before) == []
    assert _threads("jlora-adapters", before)  # the LLM is the caller's: still open, its pools too
    llm.close()
    assert _ended(("jlora-adapters", "jlora-executables"), before) == []


def _holders(obj: object, depth: int = 8) -> list[str]:
    """One chain of referrer types from `obj` up (what keeps it alive), for a failure message."""
    chain, seen = [], {id(obj)}
    for _ in range(depth):
        refs = gc.get_referrers(obj)
        seen.add(id(refs))
        nxt = next((r for r in refs if id(r) not in seen and not isinstance(r, types.FrameType)), None)
        del refs
        if nxt is None:
            break
        obj = nxt
        seen.add(id(obj))
        chain.append(type(obj).__qualname__ + (f" {obj.__qualname__}" if isinstance(obj, types.FunctionType) else ""))
    return chain


def test_a_served_and_dropped_app_frees_its_llm_without_the_cyclic_collector(tiny_dir, tiny_adapters):
    """The app lets go of its server (engine thread, pools, the LLM) when its lifespan ends, and no
    route, handler or middleware closes over it: FastAPI 0.165 keeps every route function in a
    module-level cache, and a FastAPI app sits in reference cycles of its own (its docs routes
    close over it), so either would keep the LLM's memory maps until a full collection or for ever."""
    from live import KEY, serve_live
    from jlora.server.app import build_app

    with collector_off():
        before = memory_maps()
        llm = LLM(str(tiny_dir[0]), progress=False, **ENGINE)
        app = build_app(llm, "tiny", lora_modules={"a1": str(tiny_adapters[1])}, api_key=KEY)
        with serve_live(llm, app) as live, live.http() as http:
            body = {"model": "a1", "prompt": "Hello", "max_tokens": 2}
            assert http.post("/v1/completions", json=body).json()["usage"]["completion_tokens"] == 2
            with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
                assert r.status_code == 200 and "[DONE]" in r.read().decode()
            assert http.post("/v1/completions", json={**body, "model": "nope"}).status_code == 404
            assert http.post("/v1/completions", json={**body, "n": "x"}).status_code == 400
            assert http.post("/tokenize", json={"prompt": "Hello"}).status_code == 200
            assert http.get("/health").status_code == 200 and http.get("/openapi.json").status_code == 200
            long = {**body, "max_tokens": 100, "ignore_eos": True}
            with http.stream("POST", "/v1/completions", json={**long, "stream": True}) as r:  # hang up mid-stream
                next(line for line in r.iter_lines() if line.startswith("data: {"))
            with live.http(timeout=httpx.Timeout(60, read=0.05)) as impatient, pytest.raises(httpx.ReadTimeout):
                impatient.post("/v1/completions", json=long)  # give up waiting for a whole reply
            live.wait_idle()
            failed = live.srv.engine.call(lambda: 1 / 0)  # a command that raises on the engine thread
            assert isinstance(failed.exception(60), ZeroDivisionError)
            del failed
        assert app.state.stopped_cleanly and not hasattr(app.state, "server")

        async def serve_again() -> None:
            async with app.router.lifespan_context(app):
                pass

        with pytest.raises(RuntimeError, match="already run and let go of its LLM"):
            asyncio.run(serve_again())
        added = memory_maps() - before
        held = weakref.ref(llm)
        del llm, app, live, http, r, impatient
        kept = memory_maps() - before
        alive = held() is not None
        holders = _holders(held()) if alive else []
    assert not alive, f"the LLM outlived its app, held by {' <- '.join(holders)}"
    assert added > 0 and kept <= 0.25 * added, f"{kept} of the {added} memory maps the LLM and app added were kept"


def test_naming_the_culprit_of_a_failed_step_leaves_no_reference_cycle():
    """The engine thread reads the locals of a failed step's frames to name its culprit; the frame
    that caught the failure (it holds the engine thread, so the LLM) is not read: a snapshot of its
    locals would hold the exception, whose traceback holds that frame."""
    from jlora.server.engine_thread import culprit_requests

    class Engine:
        pass

    def step(batch: list) -> None:
        raise RuntimeError("a step failed")

    def turn(engine: Engine) -> list[str]:
        try:
            step([])
        except RuntimeError as e:
            return culprit_requests(e.__traceback__)
        return ["unreached"]

    with collector_off():
        engine = Engine()
        held = weakref.ref(engine)
        assert turn(engine) == []
        del engine
        alive = held() is not None
    assert not alive, "the caught failure's traceback kept the caller's frame and its engine"
