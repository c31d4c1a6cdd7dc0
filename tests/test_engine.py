"""Engine behaviour on a tiny random Llama with the real SmolLM2 tokenizer (fast to compile)."""

import numpy as np
import pytest
import torch
import transformers

from jlora import LLM, LoRARequest, SamplingParams, compile_stats

ENGINE = dict(max_model_len=128, max_num_seqs=4, max_num_batched_tokens=32, max_loras=4, max_lora_rank=8,
              token_buckets=(16, 32))


@pytest.fixture(scope="module")
def llm(tiny_dir):
    return LLM(str(tiny_dir[0]), progress=False, **ENGINE)


PROMPTS = ["Hello there", "The quick brown fox jumps over the lazy dog and keeps on running far away",
           "1 2 3 4", "Once upon a time"]


def greedy(n=12, **kw):
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, **kw)


def test_batch_invariance_together_vs_one_at_a_time(llm):
    together = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, greedy())]
    alone = [llm.generate([p], greedy())[0].outputs[0].token_ids for p in PROMPTS]
    assert together == alone
    assert all(len(t) == 12 for t in together)


def test_more_requests_than_max_num_seqs_all_complete_unchanged(llm):
    # 10 requests for 4 sequence places: the rest wait their turn and give the same tokens as alone.
    prompts = [f"Number {i} is" for i in range(10)]
    together = llm.generate(prompts, greedy(6))
    assert [o.outputs[0].token_ids for o in together] == [llm.generate([p], greedy(6))[0].outputs[0].token_ids
                                                          for p in prompts]
    # Default capacity: max_num_seqs full-length sequences, 128/16 = 8 blocks each.
    assert llm.config.num_kv_blocks == 4 * 8 and llm.engine.kv.num_free == 32
    assert llm.engine.runner.kv_cache_bytes == 2 * 2 * 32 * 16 * 2 * 16 * 4  # layers*kv*blocks*bs*heads*dh*f32


def test_preemption_under_a_small_kv_cache_keeps_greedy_outputs(tiny_dir, llm, tiny_adapters):
    # 9 blocks of 16 = 144 positions for 4 sequences that grow to ~75 each: decoding runs out of
    # blocks, the latest admitted sequences are preempted and recomputed, and nothing changes.
    small = LLM(str(tiny_dir[0]), progress=False, **{**ENGINE, "num_kv_blocks": 9})
    prompts = PROMPTS + [" ".join(f"w{i}" for i in range(30))]
    loras = [None, LoRARequest("p1", 601, str(tiny_adapters[1])), None,
             LoRARequest("p3", 603, str(tiny_adapters[3])), LoRARequest("p1", 601, str(tiny_adapters[1]))]
    params = [greedy(60), greedy(60), greedy(60, logprobs=2), greedy(60), greedy(40)]
    ref = llm.generate(prompts, params, loras)
    before = compile_stats.compile_count()
    got = small.generate(prompts, params, loras)
    assert small.engine.num_preemptions > 0
    assert compile_stats.compile_count() == before
    for r, g in zip(ref, got):
        assert g.outputs[0].token_ids == r.outputs[0].token_ids
        assert g.outputs[0].finish_reason == "length"
        np.testing.assert_allclose([lp[t] for lp, t in zip(g.outputs[0].logprobs or [], g.outputs[0].token_ids)],
                                   [lp[t] for lp, t in zip(r.outputs[0].logprobs or [], r.outputs[0].token_ids)],
                                   atol=1e-4)
    assert small.engine.kv.num_free == 9 and not small.engine.running

    # Aborting a preempted (waiting) request frees nothing twice; the others, n=2 included, finish unchanged.
    eng = small.engine
    rids = [eng.add_request(p, SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True, n=2) if i == 0 else greedy(60)) for i, p in enumerate(prompts[:4])]
    preempted = None
    while preempted is None and eng.has_unfinished():
        eng.step()
        preempted = next((s for s in eng.waiting if s.num_preemptions and s.request_id != rids[0]), None)
    assert preempted is not None
    eng.abort(preempted.request_id)
    while eng.has_unfinished():
        eng.step()
    outs = {r: eng.pop_finished(r) for r in rids}
    assert outs[preempted.request_id].outputs[0].finish_reason == "abort"
    assert [o.token_ids for o in outs[rids[0]].outputs] == [ref[0].outputs[0].token_ids] * 2
    for i, r in enumerate(rids[1:], 1):
        if r != preempted.request_id:
            assert outs[r].outputs[0].token_ids == llm.generate([prompts[i]], greedy(60))[0].outputs[0].token_ids
    assert eng.kv.num_free == 9 and all(eng.adapters.pins(s) == 0 for s in range(4))


def test_kv_cache_too_small_for_one_sequence_is_rejected(tiny_dir):
    with pytest.raises(ValueError, match="num_kv_blocks=7 must hold at least one max_model_len=128"):
        LLM(str(tiny_dir[0]), progress=False, warmup=False, **{**ENGINE, "num_kv_blocks": 7})


def test_arrivals_during_decode_and_chunked_prefill_do_not_change_outputs(llm):
    long_prompt = " ".join(f"word{i}" for i in range(40))  # > 32 tokens: prefilled in chunks
    prompts = PROMPTS[:2] + [long_prompt]
    ref = [llm.generate([p], greedy(10))[0].outputs[0].token_ids for p in prompts]
    assert len(llm.tokenizer.encode(long_prompt)) > ENGINE["max_num_batched_tokens"]
    eng = llm.engine
    first = eng.add_request(prompts[0], greedy(10))
    for _ in range(4):
        eng.step()  # the first request is decoding when the others arrive
    later = [eng.add_request(p, greedy(10)) for p in prompts[1:]]
    while eng.has_unfinished():
        eng.step()
    got = [eng.pop_finished(r).outputs[0].token_ids for r in [first] + later]
    assert got == ref


def test_seed_reproducible_and_independent_of_batch(llm):
    p = SamplingParams(temperature=1.0, seed=1234, max_tokens=12, ignore_eos=True)
    a = llm.generate(["Hello there"], p)[0].outputs[0].token_ids
    b = llm.generate(["Once upon a time", "Hello there", "1 2 3 4"], [greedy(), p, greedy()])[1].outputs[0].token_ids
    c = llm.generate(["Hello there"], SamplingParams(temperature=1.0, seed=99, max_tokens=12, ignore_eos=True))
    assert a == b
    assert a != c[0].outputs[0].token_ids
    assert a != llm.generate(["Hello there"], greedy())[0].outputs[0].token_ids


def test_top_k_one_equals_greedy_and_n_samples(llm):
    g = llm.generate(["Hello there"], greedy())[0].outputs[0].token_ids
    k1 = llm.generate(["Hello there"], SamplingParams(temperature=0.8, top_k=1, seed=3, max_tokens=12, ignore_eos=True))
    assert k1[0].outputs[0].token_ids == g
    out = llm.generate(["Hello there"], SamplingParams(temperature=1.0, n=3, seed=5, max_tokens=8, ignore_eos=True))[0]
    assert [o.index for o in out.outputs] == [0, 1, 2]
    assert len({tuple(o.token_ids) for o in out.outputs}) > 1


def test_stop_strings_and_stop_token_ids(llm):
    full = llm.generate(["Hello there"], greedy(12))[0].outputs[0]
    stop_tok = full.token_ids[5]
    out = llm.generate(["Hello there"], greedy(12, stop_token_ids=[stop_tok]))[0].outputs[0]
    first = full.token_ids.index(stop_tok)
    assert out.token_ids == full.token_ids[:first]
    assert out.finish_reason == "stop" and out.stop_reason == stop_tok
    stop_str = llm.tokenizer.decode(full.token_ids[4:6]).strip()
    assert stop_str and stop_str in full.text
    out = llm.generate(["Hello there"], greedy(12, stop=[stop_str]))[0].outputs[0]
    assert out.text == full.text[: full.text.find(stop_str)]
    assert out.finish_reason == "stop" and out.stop_reason == stop_str
    assert full.finish_reason == "length"


def test_min_tokens_and_eos(llm):
    full = llm.generate(["Hello there"], greedy(12))[0].outputs[0]
    eos_like = full.token_ids[2]
    # Treat that token as a stop token: min_tokens must suppress it until 6 tokens exist.
    out = llm.generate(["Hello there"], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, min_tokens=6,
                                                        stop_token_ids=[eos_like]))[0].outputs[0]
    assert len(out.token_ids) >= 6
    assert eos_like not in out.token_ids[:6]


def test_logprobs_match_log_softmax_of_model_logits(llm, tiny_dir):
    _, hf = tiny_dir
    out = llm.generate(["Hello there"], greedy(4, logprobs=5))[0]
    ids = out.prompt_token_ids + out.outputs[0].token_ids
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([ids])).logits[0], -1).numpy()
    n = len(out.prompt_token_ids)
    assert len(out.outputs[0].logprobs) == 4
    total = 0.0
    for j, (tok, lp) in enumerate(zip(out.outputs[0].token_ids, out.outputs[0].logprobs)):
        row = ref[n - 1 + j]
        top5 = np.argsort(-row)[:5]
        assert set(top5) <= set(lp) and tok in lp
        for t, v in lp.items():
            np.testing.assert_allclose(v, row[t], atol=2e-3)
        total += lp[tok]
    np.testing.assert_allclose(out.outputs[0].cumulative_logprob, total, rtol=1e-5)


def test_penalties_follow_vllm_semantics():
    import jax.numpy as jnp

    from jlora.sampling import SamplingRow, build_sampling_batch, sample

    logits = np.full((4, 16), -5.0, np.float32)
    logits[:, 5], logits[:, 7] = 3.0, 2.4
    rows = {
        0: SamplingRow(SamplingParams(temperature=0.0), 0, [1], [5], None),  # no penalty: 5 wins
        1: SamplingRow(SamplingParams(temperature=0.0, repetition_penalty=2.0), 0, [5], [], None),  # 3.0/2 < 2.4
        2: SamplingRow(SamplingParams(temperature=0.0, frequency_penalty=0.4), 0, [1], [5, 5], None),  # 3-0.8 < 2.4
        3: SamplingRow(SamplingParams(temperature=0.0, presence_penalty=0.4), 0, [5], [5, 5], None),  # 3-0.4 > 2.4
    }
    out = sample(jnp.asarray(logits), build_sampling_batch(rows, 4, 8))
    assert np.asarray(out["tokens"]).tolist() == [5, 7, 7, 5]
    # Presence counts generated tokens only: a prompt-only occurrence is not penalised.
    rows = {0: SamplingRow(SamplingParams(temperature=0.0, presence_penalty=2.0), 0, [5], [], None)}
    assert int(sample(jnp.asarray(logits[:1]), build_sampling_batch(rows, 1, 8))["tokens"][0]) == 5


def test_abort_frees_kv_blocks_and_slot(llm, tiny_adapters):
    eng = llm.engine
    free_blocks = eng.kv.num_free
    req = LoRARequest("abort-me", 500, str(tiny_adapters[0]))
    rid = eng.add_request("Hello there", greedy(50), req)
    eng.step()
    slot = eng.adapters.slot_of("abort-me")
    assert slot is not None and eng.adapters.pins(slot) == 1 and eng.kv.num_free == free_blocks - 1
    eng.abort(rid)
    out = eng.pop_finished(rid)
    assert out.outputs[0].finish_reason == "abort" and out.finished
    assert eng.adapters.pins(slot) == 0 and eng.kv.num_free == free_blocks
    assert not eng.has_unfinished()


def test_the_step_thread_never_pads_an_adapter(llm, tiny_adapters, monkeypatch):
    """Padding an adapter to the slot shape (padded_update: 78 MB of zeros per adapter at rank 64 on
    SmolLM2) happens where it is converted: on the prepare_async worker, as the server does, or in
    add_request's prepare; never inside a step. The writes a step applies are those padded copies."""
    import threading

    from jlora.adapters import host_store

    eng = llm.engine
    calls, in_step, applied = [], threading.Event(), []
    real_pad, real_step, real_write = host_store.padded_update, eng.step, eng.runner.write_slots

    def pad(*args, **kwargs):
        calls.append((threading.current_thread().name, in_step.is_set()))
        return real_pad(*args, **kwargs)

    def step():
        in_step.set()
        try:
            return real_step()
        finally:
            in_step.clear()

    def write_slots(writes):
        applied.extend(writes)
        return real_write(writes)

    monkeypatch.setattr(host_store, "padded_update", pad)
    monkeypatch.setattr(eng, "step", step)
    monkeypatch.setattr(eng.runner, "write_slots", write_slots)
    # Names no other test uses, so each is converted (and padded) here.
    served = LoRARequest("pad-async", 701, str(tiny_adapters[5]))
    handle = eng.adapters.prepare_async(served).result(60)
    offline = LoRARequest("pad-offline", 702, str(tiny_adapters[6]))
    before = compile_stats.compile_count()
    ids = [eng.add_request("Hello there", greedy(6), served, lora_handle=handle),
           eng.add_request("Once upon a time", greedy(6), offline)]
    while eng.has_unfinished():
        eng.step()
    outs = [eng.pop_finished(i) for i in ids]
    assert all(o.outputs[0].finish_reason == "length" for o in outs)
    assert [name.startswith("jlora-adapters") for name, _ in calls] == [True, False]  # worker, then add_request's
    assert not any(during for _, during in calls)
    assert any(w.update is handle.update for w in applied)  # the slot got the worker's padded copy as is
    assert compile_stats.compile_count() == before


def test_streaming_deltas_concatenate_to_the_text(llm):
    deltas = list(llm.generate_stream("Hello there", greedy(10)))
    full = llm.generate(["Hello there"], greedy(10))[0].outputs[0].text
    assert "".join(deltas) == full and len(deltas) > 1


def test_step_finished_only_returns_just_the_finished_requests(llm):
    """`step(finished_only=True)` (what LLM.generate uses) snapshots only requests that finished in
    that step; the same requests, stepped normally, give the same final outputs."""
    engine, params = llm.engine, SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    prompts = [[5, 6, 7], [8, 9, 10, 11, 12], [13]]
    want = {o.prompt_token_ids[0]: o.outputs[0].token_ids for o in llm.generate(
        [{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)}
    ids = [engine.add_request({"prompt_token_ids": p}, params) for p in prompts]
    got, steps = {}, 0
    while engine.has_unfinished():
        outs = engine.step(finished_only=True)
        steps += 1
        assert all(o.finished for o in outs)
        got.update({o.request_id: o for o in outs})
    assert sorted(got) == sorted(ids) and steps > len(ids)  # most steps returned nothing
    for rid in ids:
        out = engine.pop_finished(rid)
        assert out.outputs[0].token_ids == want[out.prompt_token_ids[0]] == got[rid].outputs[0].token_ids


def test_zero_compiles_after_warmup_randomized_workload(llm, tiny_adapters):
    rng = np.random.default_rng(0)
    reqs = [LoRARequest(f"mix{i}", 1000 + i, str(p)) for i, p in enumerate(tiny_adapters)]
    before = compile_stats.compile_count()
    for round_ in range(4):
        n = int(rng.integers(1, 7))
        prompts = [" ".join(["tok"] * int(rng.integers(1, 60))) for _ in range(n)]
        params = [SamplingParams(temperature=float(rng.choice([0.0, 0.7, 1.2])), top_p=float(rng.choice([1.0, 0.9])),
                                 top_k=int(rng.choice([-1, 5])), max_tokens=int(rng.integers(1, 20)),
                                 repetition_penalty=float(rng.choice([1.0, 1.3])), seed=int(rng.integers(0, 100)),
                                 logprobs=int(rng.choice([0, 3])) if rng.random() < 0.3 else None)
                  for _ in range(n)]
        loras = [reqs[int(rng.integers(0, 16))] if rng.random() < 0.8 else None for _ in range(n)]
        outs = llm.generate(prompts, params, loras, use_tqdm=False)
        assert all(1 <= len(o.outputs[0].token_ids) <= p.max_tokens or o.outputs[0].finish_reason == "stop"
                   for o, p in zip(outs, params))
    assert compile_stats.compile_count() == before


def test_bad_requests_raise_and_leave_engine_serving(llm, tmp_path):
    expected = llm.generate(["Hello there"], greedy(6))[0].outputs[0].token_ids
    with pytest.raises(ValueError, match="max_model_len=128"):
        llm.generate([{"prompt_token_ids": [5] * 200}])
    with pytest.raises(ValueError, match="empty"):
        llm.generate([""])
    with pytest.raises(FileNotFoundError):
        llm.generate(["Hello", "Hi"], greedy(), [None, LoRARequest("nope", 7, str(tmp_path / "nope"))])
    with pytest.raises(ValueError, match="prompt_token_ids"):
        llm.generate([{"prompt_token_ids": [10**6]}])
    for bad in (dict(temperature=-1), dict(top_p=1.5), dict(top_k=-3), dict(max_tokens=0), dict(n=0),
                dict(min_tokens=5, max_tokens=2), dict(logprobs=99), dict(stop=[""]), dict(presence_penalty=5)):
        with pytest.raises(ValueError, match="SamplingParams"):
            SamplingParams(**bad)
    assert not llm.engine.has_unfinished()
    assert llm.generate(["Hello there"], greedy(6))[0].outputs[0].token_ids == expected


def test_graph_count_is_what_the_config_predicts(tiny_dir):
    # One step graph per prefill chunk bucket plus one for decode-only steps, whatever the batch
    # or span; the count after warm-up does not move through a mixed workload.
    before = compile_stats.stage_table().get("step", (0, 0.0))[0]
    cfg = dict(ENGINE, token_buckets=(8, 16, 32), max_model_len=128)
    llm = LLM(str(tiny_dir[0]), progress=False, **cfg)
    compiled = compile_stats.stage_table()["step"][0] - before
    # decode-only with 1 or 4 rows; prefill parts (4, 8), (1, 8); (2, 16), (1, 16); (1, 32)
    assert compiled == llm.config.num_step_graphs == 7
    count = compile_stats.compile_count()
    rng = np.random.default_rng(1)
    prompts = [{"prompt_token_ids": rng.integers(0, 1000, int(n)).tolist()} for n in rng.integers(1, 100, 9)]
    llm.generate(prompts, [greedy(int(n)) for n in rng.integers(1, 20, 9)], use_tqdm=False)
    assert compile_stats.compile_count() == count


def test_warmup_again_compiles_nothing(llm):
    count = compile_stats.compile_count()
    llm.warmup()
    assert compile_stats.compile_count() == count


def test_chat_takes_one_message_dict_one_conversation_or_several(llm):
    msg = {"role": "user", "content": "Hello"}
    one = llm.chat(msg, greedy(4))
    assert len(one) == 1
    assert [o.outputs[0].token_ids for o in llm.chat([msg], greedy(4))] == [one[0].outputs[0].token_ids]
    assert len(llm.chat([[msg], [msg]], greedy(4))) == 2
    with pytest.raises(ValueError, match="messages"):
        llm.chat([], greedy(4))


def test_chat_refuses_an_unknown_role_by_name(llm):
    for bad, word in [({"role": "usr", "content": "Hello"}, r"messages\[0\]\.role is 'usr'"),
                      ({"content": "Hello"}, r"messages\[0\]\.role is None"), ("Hello", r"messages\[0\] must be a dict")]:
        with pytest.raises(ValueError, match=word):
            llm.chat([bad], greedy(4))
    with pytest.raises(ValueError, match=r"messages\[1\]\.role is 'System'"):
        llm.chat([{"role": "user", "content": "a"}, {"role": "System", "content": "b"}], greedy(4))
    assert not llm.engine.has_unfinished()


def test_prompt_logprobs_match_transformers_log_softmax(llm, tiny_dir):
    """Over a 50-token prompt (several prefill chunks), beside a request without them, with n=2."""
    hf = tiny_dir[1]
    prompt = "The quick brown fox jumps over the lazy dog and keeps on running far away " * 3
    ids = llm.tokenizer.encode(prompt)
    assert len(ids) > 40
    compiles = compile_stats.compile_count()
    out, other = llm.generate([prompt, "Hello"], [SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True, prompt_logprobs=3, n=2), greedy(2)])
    assert compile_stats.compile_count() == compiles
    assert other.prompt_logprobs is None
    lps = out.prompt_logprobs
    assert len(lps) == len(ids) and lps[0] is None
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([ids])).logits[0].double(), -1).numpy()
    for pos in range(1, len(ids)):
        entry = lps[pos]
        np.testing.assert_allclose(entry[ids[pos]], ref[pos - 1, ids[pos]], atol=1e-4)
        top3 = [int(t) for t in np.argsort(-ref[pos - 1])[:3]]
        assert set(top3) <= set(entry) and len(entry) <= 4
        for t in top3:
            np.testing.assert_allclose(entry[t], ref[pos - 1, t], atol=1e-4)


@pytest.mark.parametrize("base_graphs", ["decode", "all"])
def test_base_graphs_change_no_token_and_take_the_adapter_free_steps(tiny_dir, tiny_adapters, base_graphs,
                                                                     monkeypatch):
    """EngineConfig.base_graphs: shapes with a graph without LoRA run it for steps with no adapter
    row, and their LoRA graph computes LoRA for every row (no conditionals). Greedy tokens equal the
    engine without base graphs, whatever mix of adapter and base requests shares the steps; the
    graph count is the config's and nothing compiles after warm-up."""
    cfg = dict(ENGINE, token_buckets=(8, 32), max_model_len=128)
    loras = [None, LoRARequest("a0", 1, str(tiny_adapters[1])), None, LoRARequest("a1", 2, str(tiny_adapters[2]))]
    rng = np.random.default_rng(4)
    prompts = [{"prompt_token_ids": rng.integers(3, 1000, int(n)).tolist()} for n in (5, 40, 12, 3, 20, 9)]
    params = [greedy(int(n)) for n in (9, 4, 14, 6, 3, 11)]

    def run(llm):
        mixed = [o.outputs[0].token_ids for o in llm.generate(prompts, params, lora_request=loras + loras[:2],
                                                             use_tqdm=False)]
        base = [o.outputs[0].token_ids for o in llm.generate(prompts[:3], params[:3], use_tqdm=False)]
        return mixed, base

    want = run(LLM(str(tiny_dir[0]), progress=False, base_graphs="none", **cfg))
    llm = LLM(str(tiny_dir[0]), progress=False, base_graphs=base_graphs, **cfg)
    runner = llm.engine.runner
    shapes = llm.config.step_shapes()
    twins = [s for s in shapes if s[1] == 0] if base_graphs == "decode" else list(shapes)
    assert llm.config.base_graph_shapes() == tuple(twins)
    assert llm.config.num_step_graphs == len(shapes) + len(twins) == len(runner._executables)
    ran = []
    launch = runner.launch

    def spy(batch, prev=None):
        ran.append(runner.graph_of(batch))
        return launch(batch, prev)

    monkeypatch.setattr(runner, "launch", spy)  # undone after the test: no cycle keeps the engine
    count = compile_stats.compile_count()
    assert run(llm) == want
    assert compile_stats.compile_count() == count
    assert {key for key in ran if not key[1]}  # adapter-free steps ran without LoRA
    assert {key for key in ran if key[1]}  # and steps with adapters with it
    assert all(key[1] or key[0] in twins for key in ran)


def test_base_graphs_bad_value_is_named():
    with pytest.raises(ValueError, match="base_graphs must be one of"):
        LLM("unused", base_graphs="some")
