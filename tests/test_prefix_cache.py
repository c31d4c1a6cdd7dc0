"""Adapter-aware prefix caching (jlora/engine/prefix_cache.py): blocks keyed by tokens and adapter
version, reference counted and evicted least recently used; a hit changes which blocks a request
starts from, never its tokens or logprobs, and never crosses adapters or adapter versions."""

from __future__ import annotations

import json
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
