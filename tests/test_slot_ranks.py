"""Adapter slots of several ranks (`lora_slot_ranks`): the LoRA math reads each slot's own lanes,
an adapter only takes a slot it fits, and the outputs equal uniform slots'."""

from __future__ import annotations

import numpy as np
import pytest

from jlora import LLM, LoRARequest, SamplingParams, compile_stats
from jlora.adapters.manager import AdapterManager, LoRASlots, NoFreeSlotError, SlotWrite
from jlora.engine.config import EngineConfig

SIZES = dict(max_model_len=128, max_num_seqs=4, max_num_batched_tokens=64, token_buckets=(32, 64), progress=False,
             weights_cache=False, adapter_cache=False)
PROMPTS = ["Hello there, how", "The capital of France is", "1 2 3 4", "Once upon a time",
           "def add(a, b):", "Water boils at", "The quick brown fox", "In 1969 the first"]


def run(llm: LLM, adapters) -> tuple[list, list, int]:
    # tiny_adapters[i] has rank 2 + (i % 4) * 2: ranks 2, 4, 6, 8; six adapters over four slots churn.
    loras = [None if i == 7 else LoRARequest(f"a{i % 6}", 1 + i % 6, str(adapters[i % 6])) for i in range(len(PROMPTS))]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=2)
    before = compile_stats.compile_count()
    outs = llm.generate(PROMPTS, params, loras) + llm.generate(PROMPTS[::-1], params, loras[::-1])
    return ([o.outputs[0].token_ids for o in outs], [o.outputs[0].logprobs for o in outs],
            compile_stats.compile_count() - before)


@pytest.fixture(scope="module")
def uniform_and_mixed(tiny_dir, tiny_adapters):
    path, _ = tiny_dir
    uniform = LLM(path, max_loras=4, max_lora_rank=8, **SIZES)
    mixed = LLM(path, max_loras=4, max_lora_rank=8, lora_slot_ranks=(8, 2, 4, 8), **SIZES)
    return uniform, mixed, run(uniform, tiny_adapters), run(mixed, tiny_adapters)


@pytest.mark.slow  # two engines, ~60 s
def test_mixed_slot_ranks_give_the_uniform_slots_tokens_and_logprobs(uniform_and_mixed):
    _, _, (tok_u, lp_u, _), (tok_m, lp_m, _) = uniform_and_mixed
    assert tok_m == tok_u and all(len(t) == 8 for t in tok_m)
    worst = max(abs(a[t] - b[t]) for sa, sb in zip(lp_m, lp_u) for a, b in zip(sa, sb) for t in a.keys() & b.keys())
    assert worst <= 1e-5


def test_mixed_slot_ranks_compile_nothing_after_warm_up(uniform_and_mixed):
    assert uniform_and_mixed[3][2] == 0


def test_mixed_slot_ranks_hold_fewer_lanes(uniform_and_mixed):
    uniform, mixed, _, _ = uniform_and_mixed
    lanes_u = uniform.memory_report()["lora_slots"]
    lanes_m = mixed.memory_report()["lora_slots"]
    assert lanes_m["slot_ranks"] == [2, 4, 8, 8] and lanes_u["slot_ranks"] == [8, 8, 8, 8]
    # the lanes: 2 + 4 + 8 + 8 against 4 x 8 (no DoRA factors without enable_dora)
    assert lanes_m["bytes"] * 32 == lanes_u["bytes"] * 22
    state = mixed.engine.runner.lora_state
    assert isinstance(state, tuple) and [p["qkv_proj"]["B"].shape[1:3] for p in state] == [(1, 2), (1, 4), (2, 8)]


def test_each_resident_adapter_sits_in_a_slot_of_its_rank_or_more(uniform_and_mixed, tiny_adapters):
    _, mixed, _, _ = uniform_and_mixed
    mgr = mixed.engine.adapters
    resident = mgr.resident()
    assert any(slot in (0, 1) for slot in resident)  # the rank-2 and rank-4 pools were used
    for slot, name in resident.items():
        rank = 2 + (int(name[1:]) % 4) * 2
        assert mgr.slot_ranks[slot] >= rank, (slot, name)


def _manager(tiny_dir, ranks):
    from jlora.models.loading import read_model_config

    cfg = read_model_config(tiny_dir[0])
    return AdapterManager(cfg, max_loras=len(ranks), max_lora_rank=max(ranks), slot_ranks=ranks)


def test_an_adapter_only_takes_a_slot_it_fits(tiny_dir, tiny_adapters):
    mgr = _manager(tiny_dir, (2, 8))
    big = mgr.prepare(LoRARequest("a3", 4, str(tiny_adapters[3])))  # rank 8
    small = mgr.prepare(LoRARequest("a0", 1, str(tiny_adapters[0])))  # rank 2
    assert mgr.acquire(big) == 1  # the rank-2 slot is free, but too small
    with pytest.raises(NoFreeSlotError, match="all 1 adapter slots of rank >= 8 are pinned"):
        mgr.acquire(mgr.prepare(LoRARequest("a7", 8, str(tiny_adapters[7]))))  # rank 8 again
    assert mgr.acquire(small) == 0
    mgr.release(1)
    other = mgr.prepare(LoRARequest("a5", 6, str(tiny_adapters[5])))  # rank 4: only slot 1 fits, unpinned now
    assert mgr.acquire(other) == 1


def test_a_small_adapter_prefers_the_smallest_free_slot(tiny_dir, tiny_adapters):
    mgr = _manager(tiny_dir, (2, 4, 8))
    assert mgr.acquire(mgr.prepare(LoRARequest("a1", 2, str(tiny_adapters[1])))) == 1  # rank 4 -> the rank-4 slot
    assert mgr.acquire(mgr.prepare(LoRARequest("a0", 1, str(tiny_adapters[0])))) == 0  # rank 2 -> the rank-2 slot


def test_a_write_into_a_smaller_pool_keeps_the_adapter(tiny_dir, tiny_adapters):
    """The update is padded to max_lora_rank and narrowed to its pool's rank on the way in; what the
    slot then holds is the adapter itself."""
    from jlora.models.loading import read_model_config

    cfg = read_model_config(tiny_dir[0])
    mgr = _manager(tiny_dir, (2, 8))
    slots = LoRASlots(cfg, 2, 8, slot_ranks=(2, 8))
    h = mgr.prepare(LoRARequest("a0", 1, str(tiny_adapters[0])))  # rank 2: q_proj, v_proj
    assert mgr.acquire(h) == 0
    slots.write(mgr.take_writes())
    small, big = slots.state
    wa, wb = h.adapter.weights["q_proj"]  # [L, in, 2], [L, 2, out]
    np.testing.assert_array_equal(np.asarray(small["qkv_proj"]["A"][:, 0, :, 0:2]), wa)
    np.testing.assert_array_equal(np.asarray(small["qkv_proj"]["B"][:, 0, :, :wb.shape[-1]]), wb)
    assert not np.any(np.asarray(big["qkv_proj"]["A"]))
    with pytest.raises(ValueError, match="must be an int in \\[0, 2\\)"):
        slots.write([SlotWrite(2, h.update)])


@pytest.mark.parametrize("ranks,msg", [
    ((8, 8, 8), "has 3 entries but max_loras=4"),
    ((2, 4, 4, 4), "the largest must equal max_lora_rank=8"),
    ((2, 0, 4, 8), "positive ints"),
    ("2,4", "positive ints"),
])
def test_bad_slot_ranks_are_refused(ranks, msg):
    with pytest.raises(ValueError, match=msg):
        EngineConfig(max_loras=4, max_lora_rank=8, lora_slot_ranks=ranks)


def test_equal_slot_ranks_are_one_pool():
    assert EngineConfig(max_loras=2, max_lora_rank=8, lora_slot_ranks=(8, 8)).lora_slot_ranks is None
    assert EngineConfig(max_loras=3, max_lora_rank=8, lora_slot_ranks=(8, 2, 4)).slot_ranks == (2, 4, 8)


def test_slot_ranks_flag_reaches_llm(cli_llm_kwargs):
    generate, serve = cli_llm_kwargs
    assert generate(["--max-lora-rank", "32", "--lora-slot-ranks", "8,16,32,32"])["lora_slot_ranks"] == (8, 16, 32, 32)
    assert serve(["--max-lora-rank", "32", "--lora-slot-ranks", "8,16,32,32"])["lora_slot_ranks"] == (8, 16, 32, 32)
