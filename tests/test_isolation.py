"""No request can hurt another: bounds checked before queuing, a step that fails for one row fails
that request alone, and abort stays linear in a request's sequences (tiny random Llama)."""

from __future__ import annotations

import dataclasses
import time

import pytest

import jlora.engine.runner as runner_module
from jlora import LLM, LoRARequest, SamplingParams, compile_stats
from jlora.engine.llm_engine import QueueFullError
from jlora.sampling_params import StructuredOutputsParams
from jlora.engine.sequence import SeqState

ENGINE = dict(max_model_len=128, max_num_seqs=4, max_num_batched_tokens=32, max_loras=2, max_lora_rank=8,
              token_buckets=(16, 32))
PROMPTS = ["Hello there", "Once upon a time", "1 2 3 4", "The quick brown fox"]
CULPRIT_SEED = 424242


@pytest.fixture(scope="module")
def llm(tiny_dir):
    return LLM(str(tiny_dir[0]), progress=False, **ENGINE)


def greedy(max_tokens: int = 16, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kw)


@pytest.mark.parametrize("field,value", [
    ("top_k", 2**31), ("top_k", 2**33), ("top_k", -2), ("temperature", 1e308), ("temperature", float("inf")),
    ("temperature", float("nan")), ("repetition_penalty", 1e308), ("repetition_penalty", 0.0),
    ("presence_penalty", 3.0), ("top_p", 0.0), ("min_p", 1.5), ("n", 0), ("seed", 2**40), ("seed", -1),
    ("max_tokens", 2**31), ("logprobs", 21), ("stop", "\ud800"), ("stop", ["ok"] * 17),
    ("stop_token_ids", [2**33]), ("ignore_eos", 1), ("n", True), ("logit_bias", {1: 101.0}),
    ("logit_bias", {-1: 1.0}), ("logit_bias", {i: 1.0 for i in range(301)}), ("structured_outputs", {"json": {}}),
])
def test_sampling_params_refuse_what_the_arrays_cannot_hold(field, value):
    with pytest.raises(ValueError, match=rf"^SamplingParams\.{field}="):
        SamplingParams(**{field: value})


def test_structured_outputs_params_take_exactly_one_grammar():
    from jlora.sampling_params import StructuredOutputsParams

    for kw in [{}, {"regex": "a", "choice": ["b"]}, {"choice": []}, {"json": 3}, {"json_object": True, "regex": "x"}]:
        with pytest.raises(ValueError, match="StructuredOutputsParams"):
            StructuredOutputsParams(**kw)


def test_the_engine_refuses_model_and_engine_bounds_and_queues_nothing(llm):
    eng, vocab = llm.engine, llm.model.cfg.vocab_size
    for params, field in [(SamplingParams(top_k=vocab + 1), "top_k"), (SamplingParams(n=eng.config.max_n + 1), "n"),
                          (SamplingParams(stop_token_ids=[vocab]), "stop_token_ids"),
                          (SamplingParams(logit_bias={vocab: 1.0}), "logit_bias"),
                          (SamplingParams(structured_outputs=StructuredOutputsParams(regex="[a-")), "structured_outputs")]:
        with pytest.raises(ValueError, match=rf"SamplingParams\.{field}[=:]"):
            eng.add_request("Hello", params)
    assert not eng.requests and not eng.waiting
    assert llm.generate(["Hello"], greedy(4, top_k=vocab))[0].outputs[0].finish_reason == "length"  # the edge is fine


def test_a_full_queue_refuses_new_requests_and_keeps_the_queued_ones(llm, monkeypatch):
    eng = llm.engine
    monkeypatch.setattr(eng, "config", dataclasses.replace(eng.config, max_n=4, max_waiting_seqs=6))
    first = eng.add_request("Hello", greedy(2, n=4))
    with pytest.raises(QueueFullError, match="max_waiting_seqs=6"):
        eng.add_request("Hello", greedy(2, n=3))
    assert list(eng.requests) == [first] and len(eng.waiting) == 4
    while eng.has_unfinished():
        eng.step()
    assert eng.pop_finished(first).outputs[3].finish_reason == "length"


def _run(eng, requests: list[tuple[str, SamplingParams, LoRARequest | None]]) -> dict[str, object]:
    ids = [eng.add_request(p, sp, lr) for p, sp, lr in requests]
    steps = 0
    while eng.has_unfinished():
        eng.step()
        steps += 1
        assert steps < 500, "the engine stopped making progress"
    return {rid: eng.pop_finished(rid) for rid in ids}


def _solo(llm, prompt: str, params: SamplingParams, lora: LoRARequest | None) -> list[int]:
    return llm.generate([prompt], params, lora, use_tqdm=False)[0].outputs[0].token_ids


def _bystanders(tiny_adapters) -> list[tuple[str, SamplingParams, LoRARequest | None]]:
    return [(PROMPTS[0], greedy(20), None), (PROMPTS[1], greedy(20), LoRARequest("i1", 901, str(tiny_adapters[1]))),
            (PROMPTS[2], SamplingParams(temperature=0.8, top_k=40, seed=7, max_tokens=20, ignore_eos=True), None)]


def test_a_row_that_fails_on_the_host_fails_only_its_request(llm, tiny_adapters, monkeypatch):
    """The culprit fails after 3 tokens, mid-stream for everyone; the others' tokens are their solo runs'."""
    bystanders = _bystanders(tiny_adapters)
    refs = [_solo(llm, *b) for b in bystanders]
    real = runner_module.fill_sampling_row

    def fill(batch, b, row):
        if row.seed == CULPRIT_SEED and len(row.output_ids) >= 3:
            raise OverflowError("Python integer out of bounds for int32 (injected)")
        return real(batch, b, row)

    monkeypatch.setattr(runner_module, "fill_sampling_row", fill)
    compiles = compile_stats.compile_count()
    culprit = (PROMPTS[3], greedy(20, seed=CULPRIT_SEED), None)
    outs = list(_run(llm.engine, [bystanders[0], culprit, bystanders[1], bystanders[2]]).values())
    assert [o.outputs[0].token_ids for o in (outs[0], outs[2], outs[3])] == refs
    assert all(o.outputs[0].finish_reason == "length" for o in (outs[0], outs[2], outs[3]))
    bad = outs[1]
    assert bad.outputs[0].finish_reason == "error" and "OverflowError" in bad.error
    assert len(bad.outputs[0].token_ids) == 3 and bad.finished
    assert compile_stats.compile_count() == compiles
    assert llm.engine.kv.num_free == llm.config.num_kv_blocks


@pytest.mark.parametrize("lose_cache", [False, True])
def test_a_device_step_that_raises_is_retried_without_its_culprit(llm, tiny_adapters, monkeypatch, lose_cache):
    """A step raises whenever the culprit's row is in it (and may take the donated KV cache with it):
    the step's requests run one at a time, the culprit fails alone, the rest give their solo tokens."""
    eng = llm.engine
    bystanders = _bystanders(tiny_adapters)
    refs = [_solo(llm, *b) for b in bystanders]
    real = eng.runner.step

    def step(batch):
        if CULPRIT_SEED in batch["sampling"]["seeds"] and batch["sampling"]["counters"].max() >= 2:
            if lose_cache:
                for x in eng.runner.cache.values():
                    x.delete()
            raise RuntimeError("XlaRuntimeError: INTERNAL: injected device failure")
        return real(batch)

    monkeypatch.setattr(eng.runner, "step", step)
    failed, preempted = eng.num_failed_steps, eng.num_preemptions
    compiles = compile_stats.compile_count()
    culprit = (PROMPTS[3], SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, seed=CULPRIT_SEED, n=2), None)
    outs = list(_run(eng, [bystanders[0], bystanders[1], culprit, bystanders[2]]).values())
    assert [o.outputs[0].token_ids for o in (outs[0], outs[1], outs[3])] == refs
    bad = outs[2]
    assert all(o.finish_reason == "error" for o in bad.outputs) and "injected device failure" in bad.error
    assert eng.num_failed_steps - failed >= 2  # once among the others, once alone
    assert (eng.num_preemptions > preempted) == lose_cache  # a lost cache is rebuilt by recomputing
    assert compile_stats.compile_count() == compiles
    assert eng.kv.num_free == llm.config.num_kv_blocks and not eng.requests
    assert llm.generate(["Hello there"], greedy(20))[0].outputs[0].token_ids == refs[0]  # and it goes on serving


def test_a_step_that_always_raises_fails_every_request_and_the_engine_serves_the_next(llm, tiny_adapters, monkeypatch):
    """A device failure tied to no request (every step raises while it lasts): each request is tried
    alone, then fails with the error; the KV blocks and slot pins come back, and once the device is
    well again the next requests get their solo tokens with nothing recompiled."""
    eng = llm.engine
    bystanders = _bystanders(tiny_adapters)
    refs = [_solo(llm, *b) for b in bystanders]
    real, broken = eng.runner.step, [True]

    def step(batch):
        if broken[0]:
            raise RuntimeError("XlaRuntimeError: INTERNAL: injected device failure for everyone")
        return real(batch)

    monkeypatch.setattr(eng.runner, "step", step)
    failed = eng.num_failed_steps
    compiles = compile_stats.compile_count()
    outs = list(_run(eng, bystanders).values())
    assert all(o.finished and o.outputs[0].finish_reason == "error" and "for everyone" in o.error for o in outs)
    assert all(o.outputs[0].token_ids == [] for o in outs)
    assert eng.num_failed_steps - failed == len(bystanders) + 1  # once together, then once each alone
    assert eng.kv.num_free == llm.config.num_kv_blocks and not eng.requests
    assert all(eng.adapters.pins(s) == 0 for s in range(llm.config.max_loras))
    broken[0] = False
    assert [o.outputs[0].token_ids for o in _run(eng, bystanders).values()] == refs
    assert compile_stats.compile_count() == compiles


def test_abort_of_a_request_with_many_samples_is_linear(llm, monkeypatch):
    """n=50,000 waiting samples: abort used to remove them one by one from the queue and check the
    whole request after each (quadratic: minutes); it is one pass now."""
    eng = llm.engine
    monkeypatch.setattr(eng, "config", dataclasses.replace(eng.config, max_n=50_000))
    keep = eng.add_request("Hello there", greedy(4))
    rid = eng.add_request("Hello", SamplingParams(max_tokens=1, n=50_000))
    eng.step()  # some samples are admitted and running, the rest wait
    assert any(s.state is not SeqState.WAITING for s in eng.requests[rid].seqs)
    t0 = time.perf_counter()
    eng.abort(rid)
    elapsed = time.perf_counter() - t0
    assert elapsed < 5.0, f"abort took {elapsed:.1f}s"
    out = eng.pop_finished(rid)
    assert out.finished and {o.finish_reason for o in out.outputs} <= {"abort", "length"}
    assert [s.request_id for s in eng.waiting] == [] and all(s.request_id == keep for s in eng.running)
    while eng.has_unfinished():
        eng.step()
    assert eng.pop_finished(keep).outputs[0].finish_reason == "length"
    assert eng.kv.num_free == llm.config.num_kv_blocks
