"""Engines clean up after themselves: a dropped LLM frees its memory without the cyclic garbage
collector, and interpreter exit during a background warm-up does not wait long or report a failure."""

import gc
import subprocess
import sys
import textwrap
import time
import weakref

from conftest import memory_maps
from jlora import LLM, SamplingParams

ENGINE = dict(max_model_len=128, max_num_seqs=2, max_num_batched_tokens=32, max_loras=2, max_lora_rank=8,
              token_buckets=(16, 32))
GREEDY = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)


def test_a_dropped_llm_frees_its_memory_maps_without_the_cyclic_collector(tiny_dir):
    """No reference cycle holds an engine: with the collector off, `del llm` frees its runner, its
    weights and KV cache, and its compiled graphs' code (most of its memory maps) at once."""
    gc.collect()
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        before = memory_maps()
        llm = LLM(str(tiny_dir[0]), progress=False, **ENGINE)
        llm.generate(["Hello there"], GREEDY, use_tqdm=False)
        added = memory_maps() - before
        runner = llm.engine.runner
        held = [weakref.ref(x) for x in (runner, llm.model, *runner._weights, *runner.cache.values())]
        del llm, runner
        kept = memory_maps() - before
        alive = [r() for r in held if r() is not None]
    finally:
        if was_enabled:
            gc.enable()
    assert not alive, f"{len(alive)} of the engine's objects and arrays outlived it: {[type(x) for x in alive][:5]}"
    assert added > 0 and kept <= 0.25 * added, f"{kept} of the {added} memory maps the engine added were kept"


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
    gc.collect()
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        copy = nnx.merge(*nnx.split(model))
        nnx.update(copy, nnx.from_flat_state(nnx.to_flat_state(nnx.state(model, nnx.Param))))
        assert gc.collect() == 0
    finally:
        if was_enabled:
            gc.enable()
