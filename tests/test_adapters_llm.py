"""Adapters from memory and the converted-adapter disk cache, end to end through `LLM.generate` on the tiny
model with real peft adapters."""

from __future__ import annotations

import json

import jax.numpy as jnp
import pytest
from safetensors.numpy import load_file

from jlora import LLM, LoRARequest, SamplingParams

ENGINE = dict(max_model_len=128, max_num_seqs=4, max_num_batched_tokens=32, max_loras=2, max_lora_rank=8,
              token_buckets=(16, 32))
PROMPTS = ["Hello there", "Once upon a time", "1 2 3 4"]
GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("adapter_cache")


@pytest.fixture(scope="module")
def llm(tiny_dir, cache_dir):
    return LLM(str(tiny_dir[0]), progress=False, adapter_cache=cache_dir, **ENGINE)


def state_dict(path):
    return load_file(str(path / "adapter_model.safetensors")), json.loads((path / "adapter_config.json").read_text())


def tokens(llm, lora):
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, lora_request=lora)]


def test_in_memory_adapter_gives_the_same_tokens_as_its_files(llm, tiny_adapters):
    for i in (1, 2):  # all-linear rank 4; gate/down rank 6
        t, cfg = state_dict(tiny_adapters[i])
        from_files = tokens(llm, LoRARequest(f"file{i}", 100 + i, str(tiny_adapters[i])))
        assert from_files != tokens(llm, None)
        assert tokens(llm, LoRARequest(f"np{i}", 200 + i, tensors=t, config=cfg)) == from_files
        jt = {k: jnp.asarray(v) for k, v in t.items()}
        assert tokens(llm, LoRARequest(f"jax{i}", 300 + i, tensors=jt, config=cfg)) == from_files
    # a mixed batch: files, memory and the base model side by side
    t, cfg = state_dict(tiny_adapters[1])
    mixed = [LoRARequest("file1", 101, str(tiny_adapters[1])), None, LoRARequest("np1", 201, tensors=t, config=cfg)]
    outs = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, lora_request=mixed)]
    assert outs[0] == tokens(llm, mixed[0])[0] and outs[2] == tokens(llm, mixed[2])[2]


def test_updating_tensors_under_one_name_is_a_new_version(llm, tiny_adapters):
    t0, c0 = state_dict(tiny_adapters[0])
    t4, c4 = state_dict(tiny_adapters[4])  # same targets and rank as a0, other weights
    want0 = tokens(llm, LoRARequest("f0", 400, str(tiny_adapters[0])))
    want4 = tokens(llm, LoRARequest("f4", 404, str(tiny_adapters[4])))
    assert want0 != want4
    assert tokens(llm, LoRARequest("trained", 410, tensors=t0, config=c0)) == want0
    assert tokens(llm, LoRARequest("trained", 410, tensors=t4, config=c4)) == want4  # new weights seen
    # a request made before the update, still queued, keeps the weights it was made with
    eng = llm.engine
    old = eng.add_request(PROMPTS[0], GREEDY, LoRARequest("trained", 410, tensors=t0, config=c0))
    new = eng.add_request(PROMPTS[0], GREEDY, LoRARequest("trained", 410, tensors=t4, config=c4))
    while not (eng.requests[old].finished and eng.requests[new].finished):
        eng.step()
    assert eng.pop_finished(old).outputs[0].token_ids == want0[0]
    assert eng.pop_finished(new).outputs[0].token_ids == want4[0]


def test_bad_in_memory_adapter_is_rejected_and_engine_keeps_serving(llm, tiny_adapters):
    t, cfg = state_dict(tiny_adapters[0])
    with pytest.raises(ValueError, match="use_dora"):
        llm.generate(PROMPTS[:1], GREEDY,
                     lora_request=LoRARequest("dora", 500, tensors=t, config={**cfg, "use_dora": True}))
    with pytest.raises(ValueError, match="max_lora_rank=8"):
        big = {k: v.repeat(5, axis=0 if ".lora_A." in k else 1) for k, v in t.items()}  # rank 2 -> 10
        llm.generate(PROMPTS[:1], GREEDY, lora_request=LoRARequest("big", 501, tensors=big, config={**cfg, "r": 10}))
    k = next(iter(t))
    with pytest.raises(ValueError, match="has shape"):
        llm.generate(PROMPTS[:1], GREEDY,
                     lora_request=LoRARequest("shape", 502, tensors={**t, k: t[k][:, :5]}, config=cfg))
    assert len(tokens(llm, None)) == len(PROMPTS)


def test_second_engine_reads_converted_adapters_from_disk(llm, tiny_dir, tiny_adapters, cache_dir):
    reqs = [LoRARequest("c3", 603, str(tiny_adapters[3]))]
    t, cfg = state_dict(tiny_adapters[5])
    reqs.append(LoRARequest("c5", 605, tensors=t, config=cfg))
    first = [tokens(llm, r) for r in reqs]
    assert llm.engine.adapters.disk_cache_dir == cache_dir
    second = LLM(str(tiny_dir[0]), progress=False, adapter_cache=cache_dir, max_cpu_lora_bytes=10**6, **ENGINE)
    assert second.engine.adapters.max_cpu_lora_bytes == 10**6
    assert [tokens(second, r) for r in reqs] == first
    st = second.engine.adapters.stats
    assert st["disk_cache_hits"] == 2 and st["conversions"] == 0, dict(st)
    with pytest.raises(ValueError, match="max_cpu_lora_bytes"):
        LLM(str(tiny_dir[0]), progress=False, max_cpu_lora_bytes=-1, **ENGINE)


def test_add_request_with_a_prepared_handle_converts_nothing(llm, tiny_adapters):
    eng = llm.engine
    lora = LoRARequest("handled", 401, str(tiny_adapters[3]))
    handle = eng.adapters.prepare_async(lora).result(30)
    conversions, loads = eng.adapters.stats["conversions"], eng.adapters.stats["disk_loads"]
    other = LoRARequest("other-name", 402, str(tiny_adapters[3]))
    with pytest.raises(ValueError, match="lora_handle is for adapter 'handled'"):
        eng.add_request(PROMPTS[0], GREEDY, other, lora_handle=handle)
    assert not eng.has_unfinished()
    rid = eng.add_request(PROMPTS[0], GREEDY, lora, lora_handle=handle)
    while not eng.requests[rid].finished:
        eng.step()
    out = eng.pop_finished(rid)
    assert (eng.adapters.stats["conversions"], eng.adapters.stats["disk_loads"]) == (conversions, loads)
    assert out.outputs[0].token_ids == tokens(llm, lora)[0]
