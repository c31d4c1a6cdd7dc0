"""The executable cache: a warm start loads every step graph (no tracing, no compiling), serves the
same tokens and logprobs, keeps the KV cache donated; a damaged entry is compiled again; anything
that changes a graph (its config, jlora's code) changes its key; the switches turn it off."""

from __future__ import annotations

import pytest

from jlora import compile_stats
from jlora.engine import executable_cache

SMALL = dict(max_model_len=128, max_num_seqs=2, max_num_batched_tokens=32, max_loras=2, max_lora_rank=24,
             token_buckets=(32,))


def _llm(path, root, **kw):
    from jlora import LLM

    return LLM(path, progress=False, compilation_cache_dir=root / "xla", **{**SMALL, **kw})


def _run(llm, adapters):
    from jlora import LoRARequest, SamplingParams

    loras = [LoRARequest("a1", 1, str(adapters[1])), None, LoRARequest("a2", 2, str(adapters[2]))]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=2)
    outs = llm.generate(["The sea is", "One two three", "Hello"], params, lora_request=loras)
    return [(o.outputs[0].token_ids, [sorted(d.items()) for d in o.outputs[0].logprobs]) for o in outs]


def test_a_warm_start_loads_every_step_graph_and_serves_the_same(tiny_dir, tiny_adapters, tmp_path):
    path, _ = tiny_dir
    first = _llm(path, tmp_path)
    n = first.config.num_step_graphs
    runner = first.runners[0]
    assert runner.executable_cache.stats == {"hits": 0, "misses": n, "writes": n, "errors": 0}
    assert runner.executable_cache.root == tmp_path / "executables"  # beside the XLA cache
    assert len(list((tmp_path / "executables").glob("*.exe"))) == n and runner.compile_seconds["loaded"] == 0
    want = _run(first, tiny_adapters)

    second = _llm(path, tmp_path)
    runner = second.runners[0]
    assert runner.executable_cache.stats == {"hits": n, "misses": 0, "writes": 0, "errors": 0}
    assert runner.compile_seconds["loaded"] == n and runner.compile_seconds["graphs"] == {}  # none compiled
    old_cache = dict(runner.cache)
    before = compile_stats.compile_count()
    assert _run(second, tiny_adapters) == want
    assert compile_stats.compile_count() == before  # nothing compiled after warm-up
    assert all(x.is_deleted() for x in old_cache.values())  # a loaded graph still donates the KV cache

    # A damaged entry: logged, removed, compiled and written again; the start does not fail.
    victim = sorted((tmp_path / "executables").glob("*.exe"))[0]
    victim.write_bytes(victim.read_bytes()[:100])
    third = _llm(path, tmp_path)
    assert third.runners[0].executable_cache.stats == {"hits": n - 1, "misses": 1, "writes": 1, "errors": 1}
    assert _run(third, tiny_adapters) == want
    assert victim.stat().st_size > 100


def test_the_key_follows_what_the_graph_depends_on(tiny_dir, tmp_path, monkeypatch):
    path, _ = tiny_dir
    a = _llm(path, tmp_path, warmup=False).runners[0]
    graph = a.config.step_graphs()[0]
    key = a.executable_key(graph)
    assert _llm(path, tmp_path, warmup=False).runners[0].executable_key(graph) == key  # another engine, same graph
    assert len({a.executable_key(g) for g in a.config.step_graphs()}) == len(a.config.step_graphs())
    assert _llm(path, tmp_path, warmup=False, max_loras=3).runners[0].executable_key(graph) != key
    assert _llm(path, tmp_path, warmup=False, dtype="bfloat16").runners[0].executable_key(graph) != key
    with monkeypatch.context() as m:
        m.setattr(executable_cache, "source_digest", lambda: "edited")  # jlora's code changed
        assert a.executable_key(graph) != key
    assert a.executable_key(graph) == key
    monkeypatch.setenv("XLA_FLAGS", "--xla_cpu_enable_fast_math=true")
    assert a.executable_key(graph) != key


def test_switches_and_bad_values(tiny_dir, tmp_path, monkeypatch):
    path, _ = tiny_dir
    kw = dict(warmup=False)
    assert _llm(path, tmp_path, executable_cache=tmp_path / "elsewhere", **kw).runners[0].executable_cache.root == \
        tmp_path / "elsewhere"
    assert _llm(path, tmp_path, executable_cache=False, **kw).runners[0].executable_cache is None
    assert _llm(path, tmp_path, use_compilation_cache=False, **kw).runners[0].executable_cache is None
    monkeypatch.setenv("JLORA_EXECUTABLE_CACHE", "0")
    assert _llm(path, tmp_path, **kw).runners[0].executable_cache is None
    with pytest.raises(ValueError, match="executable_cache must be a bool or a directory"):
        _llm(path, tmp_path, executable_cache=3, **kw)


def test_an_unwritable_cache_still_starts(tiny_dir, tmp_path):
    """A cache directory that cannot be created (a file is in the way): each write is logged and
    counted, the graphs are compiled as without the cache."""
    path, _ = tiny_dir
    blocker = tmp_path / "blocked"
    blocker.write_text("not a directory")
    llm = _llm(path, tmp_path, executable_cache=blocker)
    n = llm.config.num_step_graphs
    assert llm.runners[0].executable_cache.stats == {"hits": 0, "misses": n, "writes": 0, "errors": n}
