"""Adapter-aware prefix caching (jlora/engine/prefix_cache.py): blocks keyed by tokens and adapter
version, reference counted and evicted least recently used; a hit changes which blocks a request
starts from, never its tokens or logprobs, and never crosses adapters or adapter versions."""

from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pytest
from safetensors.numpy import load_file

from jlora import LLM, LoRARequest, SamplingParams, compile_stats
from jlora.engine.blocks import BlockAllocator
from jlora.engine.prefix_cache import PrefixCache, extend_hashes, root_hash

ENGINE = dict(max_model_len=128, max_num_seqs=4, max_num_batched_tokens=32, max_loras=2, max_lora_rank=8,
              token_buckets=(16, 32), block_size=16, progress=False)


def greedy(n: int = 8, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, **kw)


def tokens(seed: int, n: int) -> list[int]:
    return np.random.default_rng(seed).integers(3, 49152, n).tolist()


@pytest.fixture(scope="module")
def on(tiny_dir):
    return LLM(str(tiny_dir[0]), **ENGINE)


@pytest.fixture(scope="module")
def off(tiny_dir):
    return LLM(str(tiny_dir[0]), enable_prefix_caching=False, **ENGINE)


def run(llm, prompts, params, loras=None):
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, loras, use_tqdm=False)
    return outs


def same_outputs(a, b, atol: float = 1e-4) -> None:
    for x, y in zip(a, b):
        for ox, oy in zip(x.outputs, y.outputs):
            assert ox.token_ids == oy.token_ids
            if ox.logprobs is not None:
                for lx, ly in zip(ox.logprobs, oy.logprobs):
                    assert set(lx) == set(ly)
                    np.testing.assert_allclose([lx[t] for t in ly], list(ly.values()), atol=atol)


# ---- hashing and the allocator (host only) ----------------------------------------------------------


def test_block_hash_depends_on_adapter_version_tokens_and_parent():
    ids = tokens(0, 48)
    base, v1, v2 = root_hash(None), root_hash(("a", 1, "/p", (("f", 1, 2),))), root_hash(("a", 1, "/p", (("f", 3, 2),)))
    assert len({base, v1, v2, root_hash(("b", 1, "/p", (("f", 1, 2),)))}) == 4
    chains = {}
    for name, root in [("base", base), ("v1", v1), ("v2", v2)]:
        h: list[bytes] = []
        extend_hashes(h, root, ids, 16, 3)
        chains[name] = h
    assert all(len(set(col)) == 3 for col in zip(*chains.values()))  # every block differs by adapter version
    again: list[bytes] = []
    extend_hashes(again, base, ids, 16, 1)
    extend_hashes(again, base, ids, 16, 3)  # extended later: the same chain
    assert again == chains["base"]
    # The same block of tokens after another parent is another block.
    other: list[bytes] = []
    extend_hashes(other, base, tokens(1, 16) + ids[16:], 16, 3)
    assert other[1] != chains["base"][1] and other[0] != chains["base"][0]
    with pytest.raises(ValueError, match="not full"):
        extend_hashes([], base, ids[:40], 16, 3)


def test_allocator_refcounts_park_and_evict_least_recently_used():
    pc = PrefixCache()
    kv = BlockAllocator(6, pc)
    a = kv.allocate(3)
    for i, b in enumerate(a):
        assert pc.register(bytes([i]), b)
    assert not pc.register(bytes([0]), 5)  # already held by another block: stays private
    kv.share(a[:2])  # a second sequence shares the first two
    assert [kv.refs(b) for b in a] == [2, 2, 1] and kv.num_free == 3
    kv.free(a)  # the first sequence finishes: block a[2] is parked (cached, unreferenced)
    assert kv.num_free == 4 and kv.num_cached_free == 1
    kv.free(a[:2])  # the second: all three parked, its later block older than its first
    assert kv.num_free == 6 and kv.num_cached_free == 3
    assert pc.lookup([bytes([0]), bytes([1]), bytes([2])]) == a
    fresh = kv.allocate(3)  # never-cached blocks go first
    assert set(fresh).isdisjoint(a) and pc.lookup([bytes([0])]) == [a[0]]
    got = kv.allocate(1)  # then the least recently used parked one: the chain's tail
    assert got == [a[2]] and pc.lookup([bytes([0]), bytes([1]), bytes([2])]) == a[:2]
    kv.share([a[0]])
    assert kv.num_parked_among(a[:2]) == 1 and kv.num_free == 1
    with pytest.raises(RuntimeError, match="asked for 2"):
        kv.allocate(2)
    kv.free([a[0]])
    kv.drop_cache()  # the device cache was lost: nothing is cached any more
    assert len(pc) == 0 and kv.num_free == 2 and pc.lookup([bytes([0])]) == []
    with pytest.raises(RuntimeError, match="freed while not in use"):
        kv.free([a[0]])


# ---- the engine -------------------------------------------------------------------------------------


def test_hit_skips_the_cached_prefix_and_keeps_outputs(on, off):
    prompt = tokens(2, 70)  # 4 full blocks + 6 tokens
    want = run(off, [prompt], greedy(10, logprobs=2))
    pc = on.engine.scheduler.prefix_cache
    q0, h0 = pc.queries, pc.hits
    first = run(on, [prompt], greedy(10, logprobs=2))
    assert first[0].num_cached_tokens == 0
    second = run(on, [prompt], greedy(10, logprobs=2))
    assert second[0].num_cached_tokens == 64
    longer = run(on, [prompt + tokens(3, 20)], greedy(4))  # shares 4 blocks, then its own
    assert longer[0].num_cached_tokens == 64
    exact = run(on, [prompt[:64]], greedy(4))  # ends on a block boundary: its last block is its own
    assert exact[0].num_cached_tokens == 48
    same_outputs(first, want)
    same_outputs(second, want)
    st = on.engine.stats()
    assert st.prefix_cache_queries - q0 == 70 + 70 + 90 + 64 and st.prefix_cache_hits - h0 == 64 + 64 + 48
    assert st.kv_blocks_used == 0 and st.kv_blocks_cached > 0
    assert on.engine.kv.num_free == on.config.num_kv_blocks
    assert off.engine.stats().prefix_cache_queries == 0


def test_reset_prefix_cache_forgets_cached_prompts_between_runs(on):
    prompt = tokens(90, 70)
    run(on, [prompt], greedy(4))
    assert run(on, [prompt], greedy(4))[0].num_cached_tokens == 64
    assert on.reset_prefix_cache() is True
    assert on.engine.stats().kv_blocks_cached == 0
    assert run(on, [prompt], greedy(4))[0].num_cached_tokens == 0  # recomputed from scratch
    rid = on.engine.add_request({"prompt_token_ids": prompt}, greedy(4))
    assert on.reset_prefix_cache() is False  # a request is unfinished: nothing is forgotten
    while on.engine.has_unfinished():
        on.engine.step()
    on.engine.pop_finished(rid)
    assert run(on, [prompt], greedy(4))[0].num_cached_tokens == 64
    assert on.reset_prefix_cache() is True  # the shared engine leaves as it came: nothing cached


def test_no_leak_across_adapters_or_the_base(on, off, tiny_adapters):
    prompt = tokens(4, 50)
    a = LoRARequest("leakA", 701, str(tiny_adapters[1]))
    b = LoRARequest("leakB", 702, str(tiny_adapters[2]))
    order = [a, b, None, a]
    want = [run(off, [prompt], greedy(8, logprobs=1), [lr])[0] for lr in order]
    got = [run(on, [prompt], greedy(8, logprobs=1), [lr])[0] for lr in order]
    # B and the base compute their own blocks; A's second request hits A's.
    assert [g.num_cached_tokens for g in got] == [0, 0, 0, 48]
    same_outputs(got, want)
    assert len({tuple(w.outputs[0].token_ids) for w in want[:3]}) == 3  # the adapters do change the answer


def test_prompt_logprobs_requests_skip_the_cache(on, off):
    prompt = tokens(5, 40)
    run(on, [prompt], greedy(2))
    p = greedy(3, prompt_logprobs=2)
    got, want = run(on, [prompt], p)[0], run(off, [prompt], p)[0]
    assert got.num_cached_tokens == 0 and len(got.prompt_logprobs) == 40
    for g, w in zip(got.prompt_logprobs[1:], want.prompt_logprobs[1:]):
        np.testing.assert_allclose([g[t] for t in w], list(w.values()), atol=1e-4)
    assert run(on, [prompt], greedy(2))[0].num_cached_tokens == 32


def test_config_and_flag_checks(tiny_dir):
    with pytest.raises(ValueError, match="enable_prefix_caching must be a bool"):
        LLM(str(tiny_dir[0]), enable_prefix_caching="yes", warmup=False, **ENGINE)


# ---- adapter versions ---------------------------------------------------------------------------------


def _adapter_files(src, dst) -> None:
    dst.mkdir(exist_ok=True)
    for f in src.iterdir():
        shutil.copy(f, dst / f.name)


def test_reloaded_adapter_never_hits_the_old_versions_blocks(on, off, tiny_adapters, tmp_path):
    """A reloaded under the same name (its files changed) computes its own blocks, while a request
    started on the old version keeps its blocks and its answer."""
    path = tmp_path / "reload"
    _adapter_files(tiny_adapters[1], path)
    prompt = tokens(6, 60)
    want_v1 = run(off, [prompt], greedy(30), [LoRARequest("v1only", 811, str(tiny_adapters[1]))])[0]
    want_v2 = run(off, [prompt], greedy(30), [LoRARequest("v2only", 812, str(tiny_adapters[3]))])[0]
    assert want_v1.outputs[0].token_ids != want_v2.outputs[0].token_ids
    eng = on.engine
    lr = LoRARequest("reloaded", 810, str(path))
    assert run(on, [prompt], greedy(2), [lr])[0].num_cached_tokens == 0  # version 1's blocks are cached now
    old = eng.add_request({"prompt_token_ids": prompt}, greedy(30), lr)
    while eng.requests[old].seqs[0].state.value != "decode":
        eng.step()
    assert eng.requests[old].seqs[0].num_cached_tokens == 48
    _adapter_files(tiny_adapters[3], path)  # other weights under the same name and path
    new = eng.add_request({"prompt_token_ids": prompt}, greedy(30), LoRARequest("reloaded", 810, str(path)))
    while eng.has_unfinished():
        eng.step()
    got_old, got_new = eng.pop_finished(old), eng.pop_finished(new)
    assert got_new.num_cached_tokens == 0
    assert got_old.outputs[0].token_ids == want_v1.outputs[0].token_ids
    assert got_new.outputs[0].token_ids == want_v2.outputs[0].token_ids
    # Version 2 is cached under its own identity now.
    again = run(on, [prompt], greedy(30), [LoRARequest("reloaded", 810, str(path))])[0]
    assert again.num_cached_tokens == 48 and again.outputs[0].token_ids == want_v2.outputs[0].token_ids


def test_in_memory_versions_are_keyed_by_content(on, off, tiny_adapters):
    def mem(i: int) -> LoRARequest:
        d = tiny_adapters[i]
        return LoRARequest("mem", 820, tensors=load_file(str(d / "adapter_model.safetensors")),
                           config=json.loads((d / "adapter_config.json").read_text()))

    prompt = tokens(7, 40)
    v1, v2 = mem(2), mem(0)
    assert run(on, [prompt], greedy(6), [v1])[0].num_cached_tokens == 0
    got2 = run(on, [prompt], greedy(6), [v2])[0]  # new content under the same name and id: no hit
    assert got2.num_cached_tokens == 0
    assert got2.outputs[0].token_ids == run(off, [prompt], greedy(6), [v2])[0].outputs[0].token_ids
    back = run(on, [prompt], greedy(6), [mem(2)])[0]  # the first content again: its own blocks are valid
    assert back.num_cached_tokens == 32
    assert back.outputs[0].token_ids == run(off, [prompt], greedy(6), [v1])[0].outputs[0].token_ids


# ---- randomized: shared prefixes, adapters, eviction and preemption -------------------------------------

SMALL = dict(ENGINE, num_kv_blocks=12)  # 192 positions: sequences of up to 128 overflow it
ROUNDS = int(os.environ.get("JLORA_EXACTNESS_ROUNDS", "1"))  # seeds of the randomized test


def shared_prefix_jobs(rng: np.random.Generator, ref, loras: list, n_jobs: int) -> list:
    """Prompts built from a few shared prefixes (whole, extended, or cut short), over several adapters
    and the base, with the exactness harness's random sampling settings, arrivals and aborts."""
    from test_exactness import Job, _random_params

    prefixes = [tokens(100 + i, int(rng.integers(17, 90))) for i in range(3)]
    jobs = []
    for i in range(n_jobs):
        prefix = prefixes[int(rng.integers(0, len(prefixes)))]
        kind = rng.choice(["same", "extend", "cut"])
        if kind == "same":
            prompt = list(prefix)
        elif kind == "extend":
            prompt = prefix + rng.integers(3, 49152, int(rng.integers(1, 25))).tolist()
        else:
            prompt = prefix[: int(rng.integers(1, len(prefix) + 1))]
        prompt = [int(t) for t in prompt[:110]]
        lora = loras[int(rng.integers(0, len(loras)))]
        kw = _random_params(rng, seed=int(rng.integers(0, 2**32)))
        abort_after = int(rng.integers(0, 8)) if rng.random() < 0.1 else None
        jobs.append(Job(f"pj{i}", prompt, SamplingParams(**kw), lora, int(rng.integers(0, 30)), abort_after))
    for j in jobs:
        j.expected = ref.generate(j.prompt, j.params, j.params.seed, j.lora and j.lora.lora_path)
    return jobs


@pytest.fixture(scope="module")
def small(tiny_dir):
    """Cache on (steps one at a time, and async: the next decode step launched before this one's
    tokens reach the host) and off over a 12-block KV cache, and the reference generator."""
    from reference import ReferenceGenerator

    engines = {"sync": LLM(str(tiny_dir[0]), async_scheduling=False, **SMALL),
               "async": LLM(str(tiny_dir[0]), async_scheduling=True, **SMALL),
               "off": LLM(str(tiny_dir[0]), enable_prefix_caching=False, async_scheduling=False, **SMALL)}
    on_ = engines["sync"]
    ref = ReferenceGenerator(on_.model, on_.tokenizer, SMALL["max_model_len"], on_.engine.eos_token_id,
                             SMALL["max_lora_rank"])
    return engines, ref


@pytest.mark.slow  # three engines (`small`) and randomized workloads against the reference, ~20 s a case
@pytest.mark.parametrize("seed", range(ROUNDS))
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_randomized_shared_prefixes_equal_cache_off_and_reference(small, tiny_adapters, mode, seed, monkeypatch):
    from test_exactness import check_sample, drive

    engines, ref = small
    small_on, small_off = engines[mode], engines["off"]
    loras = [None] + [LoRARequest(f"r{i}", 900 + i, str(tiny_adapters[i])) for i in (1, 2, 3)]
    jobs = shared_prefix_jobs(np.random.default_rng(seed), ref, loras, n_jobs=20)
    compiles, hits = compile_stats.compile_count(), small_on.engine.stats().prefix_cache_hits
    evictions, preemptions = small_on.engine.scheduler.prefix_cache.evictions, small_on.engine.num_preemptions
    launched, ahead = small_on.engine.runner.launch, []

    def launch(batch, prev=None):  # async: count the steps launched before their tokens were read
        ahead.append(prev is not None and bool((batch["prev_rows"] >= 0).any()))
        return launched(batch, prev=prev)

    # (monkeypatch deletes the attribute after: restoring the bound method would make a reference cycle)
    monkeypatch.setattr(small_on.engine.runner, "launch", launch)
    got_on, streams = drive(small_on.engine, jobs)
    monkeypatch.undo()
    assert (sum(ahead) > 0) == (mode == "async"), f"{sum(ahead)} of {len(ahead)} steps launched ahead"
    got_off, _ = drive(small_off.engine, jobs)
    assert compile_stats.compile_count() == compiles, "prefix caching compiled a graph"
    assert small_on.engine.stats().prefix_cache_hits > hits, "the workload should hit"
    assert small_on.engine.scheduler.prefix_cache.evictions > evictions, "the workload should evict"
    assert small_on.engine.num_preemptions > preemptions, "the workload should preempt"
    for eng in (small_on.engine, small_off.engine):
        assert eng.kv.num_free == SMALL["num_kv_blocks"] and not eng.has_unfinished()
        assert all(eng.kv.refs(b) == 0 for b in range(SMALL["num_kv_blocks"]))
    for j in jobs:
        aborted = j.abort_after is not None
        for g_on, g_off, exp, streamed in zip(got_on[j.rid].outputs, got_off[j.rid].outputs, j.expected,
                                              streams[j.rid]):
            assert streamed == g_on.text
            check_sample(g_on, exp, aborted, small_on.tokenizer)
            check_sample(g_off, exp, aborted, small_off.tokenizer)
            if not aborted:
                assert g_on.token_ids == g_off.token_ids


# ---- data parallel --------------------------------------------------------------------------------------


@pytest.mark.slow  # two more engines, ~30 s of CPU
def test_data_parallel_routes_to_the_replica_holding_the_prefix(on, tiny_adapters):
    """Two replicas (both on the one CPU device: routing is host logic): a request follows the
    replica that holds its prompt's prefix under its adapter, unless that one is a batch busier."""
    from jlora.engine.data_parallel import DataParallelEngine
    from jlora.engine.llm_engine import LLMEngine

    dp = DataParallelEngine([LLMEngine(on.model, on.tokenizer, on.config, on.engine.eos_token_id) for _ in range(2)])
    a = LoRARequest("dpA", 950, str(tiny_adapters[1]))
    shared = tokens(8, 40)
    first = dp.add_request({"prompt_token_ids": shared + [5]}, greedy(4), a)
    other = dp.add_request({"prompt_token_ids": tokens(9, 40)}, greedy(4))  # least loaded: replica 1
    follow = dp.add_request({"prompt_token_ids": shared + [6, 7]}, greedy(4), a)  # queued with `first`
    base = dp.add_request({"prompt_token_ids": shared + [6]}, greedy(4))  # same tokens, base model: no prefix held
    assert [dp.replica_of(r) for r in (first, other, follow, base)] == [0, 1, 0, 1]
    while dp.has_unfinished():
        dp.step()
    outs = {r: dp.pop_finished(r) for r in (first, other, follow, base)}
    assert outs[follow].num_cached_tokens == 32 and outs[base].num_cached_tokens == 0
    assert outs[follow].outputs[0].token_ids == run(on, [shared + [6, 7]], greedy(4), [a])[0].outputs[0].token_ids
    later = dp.add_request({"prompt_token_ids": shared + [9]}, greedy(4), a)  # from the cache this time
    assert dp.replica_of(later) == 0
    # A replica a full batch (max_num_seqs) busier loses its prefix's requests to the least loaded.
    busy = [dp.add_request({"prompt_token_ids": shared + [i]}, greedy(4), a) for i in range(4)]
    assert {dp.replica_of(r) for r in busy} == {0, 1}
    while dp.has_unfinished():
        dp.step()
    st = dp.stats()
    assert st.prefix_cache_hits > 0 and st.prefix_cache_queries >= st.prefix_cache_hits


# ---- families ---------------------------------------------------------------------------------------------


@pytest.mark.slow  # a checkpoint and two engines per family
@pytest.mark.parametrize("name", ["mistral", "qwen2"])
def test_sliding_window_families_hit_and_keep_outputs(name, tmp_path):
    """Prefixes longer than the window (24 on every layer; 20 on Qwen2's second): cached blocks
    outside every window are simply not read, and the answers do not change."""
    from test_families import ENGINE as FAMILY_ENGINE, make_checkpoint

    path, _ = make_checkpoint(tmp_path, name)
    kw = {**FAMILY_ENGINE, "weights_cache": False}
    on_, off_ = LLM(str(path), **kw), LLM(str(path), enable_prefix_caching=False, **kw)
    shared = tokens(10, 70)
    prompts = [shared + tokens(11 + i, 5 + 7 * i) for i in range(3)] + [shared]
    p = greedy(12, logprobs=2)
    got = [run(on_, [q], p)[0] for q in prompts]  # one at a time: each after the last one's blocks are cached
    want = run(off_, prompts, p)
    assert [g.num_cached_tokens for g in got] == [0, 64, 64, 64]
    same_outputs(got, want)


@pytest.mark.slow  # two engines with the interpreted attention kernel in every graph, ~35 s
def test_prefix_hits_through_the_pallas_kernel_change_nothing(tiny_dir):
    """The TPU attention kernel (interpreted here, float32) reading cached prefix blocks: a request
    whose first 48 tokens are cached starts its queries mid-sequence, at another page and chunk,
    and must produce what it does from scratch."""
    kw = {**ENGINE, "attn_impl": "pallas", "max_num_seqs": 2}
    pal_on = LLM(str(tiny_dir[0]), **kw)
    pal_off = LLM(str(tiny_dir[0]), enable_prefix_caching=False, **kw)
    shared = tokens(40, 48)
    prompts = [shared + tokens(41 + i, 5 + 7 * i) for i in range(3)]
    p = greedy(6, logprobs=2)
    got = [run(pal_on, [q], p)[0] for q in prompts]
    want = run(pal_off, prompts, p)
    assert [g.num_cached_tokens for g in got] == [0, 48, 48]
    same_outputs(got, want)


def test_token_agreement_counts_requests_and_first_differences():
    from jlora.bench.prefix import token_agreement

    a = [[1, 2, 3], [4, 5, 6], [7, 8, 9], [1, 1, 1]]
    b = [[1, 2, 3], [4, 0, 6], [0, 8, 9], [1, 1, 2]]
    assert token_agreement(a, b) == {"requests": 4, "identical": 1, "first_difference_median": 1,
                                     "first_difference_min": 0}
    assert token_agreement(a, a) == {"requests": 4, "identical": 4, "first_difference_median": None,
                                     "first_difference_min": None}


@pytest.mark.slow  # a checkpoint and the bench's two engines
def test_bench_prefix_runs_on_a_small_checkpoint(tmp_path, capsys):
    """As on a TPU machine: no model hub, a random checkpoint written by the bench (word-level
    tokenizer), results in --out."""
    from jlora.bench import run as bench

    ckpt, out_dir = tmp_path / "tiny", tmp_path / "out"
    assert bench("prefix", ["--model", str(ckpt), "--shape", "tiny", "--requests", "8", "--system-tokens", "64",
                            "--user-tokens", "4,8", "--new-tokens", "4", "--max-model-len", "128",
                            "--max-num-seqs", "4", "--max-num-batched-tokens", "32", "--adapters", "2",
                            "--out", str(out_dir)]) == 0
    assert (ckpt / "config.json").is_file() and (ckpt / "tokenizer.json").is_file()
    out = capsys.readouterr().out
    res = json.loads(out[out.index("\n{") + 1: out.index("\n|")])
    assert res == json.loads((out_dir / "prefix.json").read_text())
    assert res["same_tokens"] and res["on"]["compiles_after_warmup"] == 0 == res["off"]["compiles_after_warmup"]
    assert res["token_agreement"] == {"requests": 8, "identical": 8, "first_difference_median": None,
                                      "first_difference_min": None}
    # 8 prompts of 68-72 tokens; with the cache each adapter computes the 64 shared tokens once.
    assert res["off"]["prompt_tokens_computed"] == res["off"]["prompt_tokens"]
    assert res["on"]["prompt_tokens_computed"] < res["off"]["prompt_tokens_computed"] / 2
    assert res["on"]["prefix_cache_hits"] > 0 == res["off"]["prefix_cache_hits"]
    assert "| prompt tokens computed |" in out
    md = (out_dir / "prefix.md").read_text()
    assert "| prompt tokens computed |" in md and "max_num_seqs=4" in md
    assert "Same tokens in both modes: True (8 of 8 requests identical" in md


def test_no_enable_prefix_caching_flag_reaches_llm_from_generate_and_serve(cli_llm_kwargs):
    generate, serve = cli_llm_kwargs
    seen = [generate(flags)["enable_prefix_caching"]
            for flags in ([], ["--no-enable-prefix-caching"], ["--enable-prefix-caching"])]
    assert seen == [True, False, True]
    for flags, want in (([], True), (["--no-enable-prefix-caching"], False)):
        assert serve(flags)["enable_prefix_caching"] is want


@pytest.mark.slow  # an engine with a KV cache of its own shape, ~30 s of CPU
def test_eviction_is_least_recently_used_and_loses_nothing(tiny_dir, off):
    """9 blocks of 16. A 33-token prompt leaves 2 cached blocks; a 97-token one needs 7 blocks,
    so it evicts the least recently used cached prefix and keeps the one used since."""
    tight = LLM(str(tiny_dir[0]), **{**ENGINE, "num_kv_blocks": 9})
    p1, p2, p3 = tokens(20, 33), tokens(21, 33), tokens(22, 97)
    one = greedy(1, logprobs=1)
    assert [run(tight, [p], one)[0].num_cached_tokens for p in (p1, p2, p1)] == [0, 0, 32]
    assert tight.engine.stats().kv_blocks_cached == 4
    assert run(tight, [p3], one)[0].num_cached_tokens == 0  # took the free blocks, then p2's two
    pc = tight.engine.scheduler.prefix_cache
    assert pc.evictions == 2
    got = [run(tight, [p], one)[0] for p in (p1, p2)]
    assert [g.num_cached_tokens for g in got] == [32, 0]
    same_outputs(got, [run(off, [p], one)[0] for p in (p1, p2)])
    # Under pressure: six sequences sharing prefixes grow past the 9 blocks (preempted, recomputed).
    prompts = [p3[:40 + 7 * i] for i in range(6)]
    params = greedy(30, logprobs=1)
    got = run(tight, prompts, params)
    assert [len(o.outputs[0].token_ids) for o in got] == [30] * 6
    same_outputs(got, run(off, prompts, params))
    assert tight.engine.num_preemptions > 0
    assert tight.engine.kv.num_free == 9 and all(tight.engine.kv.refs(b) == 0 for b in range(9))


def test_a_lost_kv_cache_forgets_every_cached_prefix(on, off, monkeypatch):
    """A failed step that took the donated KV cache with it leaves zeros where the cached blocks
    were: the prefix cache must forget them (a hit now would read zeros)."""
    eng = on.engine
    prompt = tokens(30, 50)
    want = run(off, [prompt], greedy(6))[0].outputs[0].token_ids
    assert run(on, [prompt], greedy(6))[0].outputs[0].token_ids == want
    real, failed = eng.runner.step, []

    def step(batch):
        if not failed:
            failed.append(True)
            for x in eng.runner.cache.values():
                x.delete()
            raise RuntimeError("injected device failure")
        return real(batch)

    monkeypatch.setattr(eng.runner, "step", step)
    other = run(on, [tokens(31, 20)], greedy(3))[0]  # fails alone, is failed
    assert other.outputs[0].finish_reason == "error" and failed
    assert eng.stats().kv_blocks_cached == 0
    again = run(on, [prompt], greedy(6))[0]
    assert again.num_cached_tokens == 0 and again.outputs[0].token_ids == want


@pytest.mark.slow  # the three engines of `small`
def test_async_drain_that_loses_the_cache_forgets_cached_prefixes(small, monkeypatch):
    """Async scheduling: a step launched ahead that fails after its sequences finished (drained)
    and takes the KV cache with it must take the cached prefixes too."""
    engines, _ = small
    llm = engines["async"]
    eng = llm.engine
    prompt = tokens(40, 50)
    want = run(engines["off"], [prompt], greedy(12))[0].outputs[0].token_ids
    run(llm, [prompt], greedy(12))
    assert eng.stats().kv_blocks_cached > 0
    other = tokens(41, 20)
    free = run(engines["off"], [other], greedy(30))[0].outputs[0].token_ids
    stop = next(t for i, t in enumerate(free) if i >= 4 and t not in free[:i])  # ends it while a step is ahead
    real_collect, real_drain, drained = eng.runner.collect, eng._drain, []

    def collect(handle):
        if drained:
            for x in eng.runner.cache.values():
                x.delete()
            raise RuntimeError("injected failure of a drained step")
        return real_collect(handle)

    monkeypatch.setattr(eng.runner, "collect", collect)
    monkeypatch.setattr(eng, "_drain", lambda: drained.append(1) or real_drain())
    out = run(llm, [other], greedy(30, stop_token_ids=[stop]))[0]
    monkeypatch.setattr(eng.runner, "collect", real_collect)
    assert out.outputs[0].finish_reason == "stop"
    assert drained, "no step was drained"
    assert eng.stats().kv_blocks_cached == 0
    again = run(llm, [prompt], greedy(12))[0]
    assert again.num_cached_tokens == 0 and again.outputs[0].token_ids == want
