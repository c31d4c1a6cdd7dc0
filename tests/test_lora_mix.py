"""Per-request LoRA scale and several adapters in one request (`LoRARequest(..., scale=)`,
`LoRARequest.combine`): every kernel against a NumPy reference, and the engine against peft
(`add_weighted_adapter(..., combination_type="cat")`) on the tiny random Llama, in a mixed batch
with base rows and plain adapters, with zero compiles after warm-up."""

from __future__ import annotations

import numpy as np
import pytest

import jax.numpy as jnp

from jlora.kernels import MIX_SLOT, lora_delta


def _reference(x, a, b, ids, scale, mix, splits=None):
    """sum_n w[t, n] * x[t] @ a[n] @ b[n] in float64, w from ids/scale/mix (packed: per sub-module)."""
    t, n = x.shape[0], a.shape[0]
    w = np.zeros((t, n))
    for i in range(t):
        if 0 <= ids[i] < n:
            w[i, ids[i]] = scale[i]
        elif ids[i] == MIX_SLOT:
            w[i] = mix[i]
    x, a, b = (np.asarray(v, np.float64) for v in (x, a, b))
    if splits is None:
        full = np.einsum("td,ndr,nro->tno", x, a, b)
    else:
        r, parts, start = b.shape[1], [], 0
        for s, width in enumerate(splits):
            parts.append(np.einsum("td,ndr,nro->tno", x, a[:, :, s * r:(s + 1) * r], b[:, :, start:start + width]))
            start += width
        full = np.concatenate(parts, axis=-1)
    return np.einsum("tn,tno->to", w, full)


@pytest.mark.parametrize("impl", ["gather", "laned", "grouped", "pallas"])
@pytest.mark.parametrize("t", [8, 80])  # decode and prefill shapes (laned changes formulation past 64)
@pytest.mark.parametrize("splits", [None, (16, 8)])
def test_every_impl_honours_scale_and_mix(impl, t, splits):
    rng = np.random.default_rng(t)
    n, d, r = 4, 32, 8
    o = 24
    lanes = r * (len(splits) if splits else 1)
    x = rng.standard_normal((t, d), np.float32)
    a = rng.standard_normal((n, d, lanes), np.float32) * 0.3
    b = rng.standard_normal((n, r, o), np.float32) * 0.3
    ids = rng.choice([-1, 0, 1, 2, 3, MIX_SLOT], size=t).astype(np.int32)
    ids[:6] = [0, 0, MIX_SLOT, -1, 3, MIX_SLOT]
    scale = rng.choice([1.0, 0.5, -1.5, 0.0], size=t).astype(np.float32)
    mix = np.zeros((t, n), np.float32)
    mix[ids == MIX_SLOT] = rng.standard_normal((int((ids == MIX_SLOT).sum()), n)).astype(np.float32)
    mix[ids == MIX_SLOT, 1] = 0.0  # a combination that leaves a slot out
    want = _reference(x, a, b, ids, scale, mix, splits)
    kw = dict(interpret=True) if impl == "pallas" else {}
    got = lora_delta(jnp.asarray(x), jnp.asarray(a), jnp.asarray(b), jnp.asarray(ids), impl=impl, splits=splits,
                     scale=jnp.asarray(scale), mix=jnp.asarray(mix), **kw)
    np.testing.assert_allclose(np.asarray(got), want, rtol=2e-5, atol=2e-5)
    # A batch without combination rows: the conditional's other branch.
    plain = np.where(ids == MIX_SLOT, -1, ids).astype(np.int32)
    got = lora_delta(jnp.asarray(x), jnp.asarray(a), jnp.asarray(b), jnp.asarray(plain), impl=impl, splits=splits,
                     scale=jnp.asarray(scale), mix=jnp.asarray(mix), **kw)
    np.testing.assert_allclose(np.asarray(got), _reference(x, a, b, plain, scale, mix, splits), rtol=2e-5, atol=2e-5)


def test_scale_and_mix_shapes_are_checked():
    x, a, b = jnp.ones((4, 8)), jnp.ones((2, 8, 2)), jnp.ones((2, 2, 8))
    ids = jnp.zeros((4,), jnp.int32)
    with pytest.raises(ValueError, match=r"scale must be float32\[4\]"):
        lora_delta(x, a, b, ids, scale=jnp.ones((3,)))
    with pytest.raises(ValueError, match=r"mix must be float32\[4, 2\]"):
        lora_delta(x, a, b, ids, mix=jnp.ones((4, 3)))
    with pytest.raises(ValueError, match="mix must be a float array"):
        lora_delta(x, a, b, ids, mix=jnp.ones((4, 2), jnp.int32))


# ---- the engine against peft ----------------------------------------------------------------------

from jlora import LLM, LoRARequest, SamplingParams, compile_stats  # noqa: E402

ENGINE = dict(max_model_len=128, max_num_seqs=8, max_num_batched_tokens=64, max_loras=4, max_lora_rank=8,
              token_buckets=(16, 64))
PROMPTS = ["Hello there", "Once upon a time", "1 2 3 4", "The quick brown fox", "A B C", "Why is the sky blue",
           "def main():", "Numbers: 5 6 7"]
NEW = 8


@pytest.fixture(scope="module")
def llm(tiny_dir, tmp_path_factory):
    return LLM(str(tiny_dir[0]), progress=False, **ENGINE)


@pytest.fixture(scope="module")
def peft_model(tiny_dir, tiny_adapters):
    """The tiny model with adapters a1..a3 loaded and their peft "cat" combinations added."""
    import peft
    import transformers

    model = transformers.LlamaForCausalLM.from_pretrained(tiny_dir[0]).eval()
    pm = peft.PeftModel.from_pretrained(model, tiny_adapters[1], adapter_name="a1")
    for i in (2, 3):
        pm.load_adapter(tiny_adapters[i], adapter_name=f"a{i}")
    # A scaled adapter is a one-adapter "cat" combination with that weight.
    pm.add_weighted_adapter(["a1"], [0.5], adapter_name="a1_half", combination_type="cat")
    pm.add_weighted_adapter(["a2"], [-1.5], adapter_name="a2_neg", combination_type="cat")
    pm.add_weighted_adapter(["a1", "a2"], [0.7, 0.5], adapter_name="a1_a2", combination_type="cat")
    # a3 at scale 2 inside a combination: its weight multiplies its scale.
    pm.add_weighted_adapter(["a3", "a1", "a2"], [0.8 * 2.0, -0.4, 1.2], adapter_name="a3_a1_a2",
                            combination_type="cat")
    pm.eval()
    return pm


def peft_greedy(pm, tok, prompt: str, adapter: str | None) -> tuple[list[int], list[float]]:
    """Greedy tokens and their logprobs from peft with one adapter active (None: base)."""
    import contextlib

    import torch

    ids = tok.encode(prompt, add_special_tokens=True)
    out, lps = [], []
    ctx = pm.disable_adapter() if adapter is None else contextlib.nullcontext()
    if adapter is not None:
        pm.set_adapter(adapter)
    with ctx, torch.no_grad():
        for _ in range(NEW):
            logits = pm(torch.tensor([ids + out])).logits[0, -1].double()
            t = int(logits.argmax())
            out.append(t)
            lps.append(float(torch.log_softmax(logits, -1)[t]))
    return out, lps


@pytest.mark.slow
def test_scaled_and_combined_rows_match_peft_in_a_mixed_batch_without_compiles(llm, peft_model, tiny_adapters):
    a = {i: LoRARequest(f"a{i}", 10 + i, str(tiny_adapters[i])) for i in (1, 2, 3)}
    rows = [  # (jlora request, peft adapter)
        (None, None),
        (a[1], "a1"),
        (LoRARequest("a1", 11, str(tiny_adapters[1]), scale=0.5), "a1_half"),
        (a[2], "a2"),
        (LoRARequest.combine(a[1], a[2], weights=(0.7, 0.5)), "a1_a2"),
        (LoRARequest("a2", 12, str(tiny_adapters[2]), scale=-1.5), "a2_neg"),
        (LoRARequest.combine(LoRARequest("a3", 13, str(tiny_adapters[3]), scale=2.0), a[1], a[2],
                             weights=(0.8, -0.4, 1.2)), "a3_a1_a2"),
        (None, None),
    ]
    params = SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True, logprobs=0)
    llm.generate(PROMPTS[:2], params, [a[1], None])  # the engine's first requests, outside the count
    before = compile_stats.compile_count()
    outs = llm.generate(PROMPTS, params, [r for r, _ in rows])
    assert compile_stats.compile_count() == before
    tok = llm.tokenizer
    for prompt, out, (req, name) in zip(PROMPTS, outs, rows):
        want, want_lps = peft_greedy(peft_model, tok, prompt, name)
        got = out.outputs[0]
        assert got.token_ids == want, (name, prompt)
        got_lps = [lp[t] for t, lp in zip(got.token_ids, got.logprobs)]
        np.testing.assert_allclose(got_lps, want_lps, atol=2e-4, err_msg=f"{name}: {prompt!r}")
    # The scaled rows shared their adapter's slot: three adapters, three slots.
    assert sorted(llm.engine.adapters.resident().values()) == ["a1", "a2", "a3"]
    # The scales and weights matter: peft with the plain adapter differs on those prompts.
    for i, plain in ((2, "a1"), (4, "a1"), (5, "a2"), (6, "a3")):
        assert np.max(np.abs(np.subtract(peft_greedy(peft_model, tok, PROMPTS[i], plain)[1],
                                         peft_greedy(peft_model, tok, PROMPTS[i], rows[i][1])[1]))) > 1e-2


def test_bad_scales_and_combinations_are_refused_and_the_engine_keeps_serving(llm, tiny_adapters):
    greedy = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    a = [LoRARequest(f"b{i}", 40 + i, str(tiny_adapters[i])) for i in range(5)]
    want = [o.outputs[0].token_ids for o in llm.generate(PROMPTS[:2], greedy, [a[0], None])]
    for bad, match in ((float("nan"), "got nan"), (float("inf"), "got inf"), (10.5, "got 10.5"),
                       ("0.5", "got str"), (True, "got bool"), (None, "got NoneType")):
        with pytest.raises(ValueError, match=rf"LoRARequest 'b0': scale must be a finite number in \[-10, 10\], {match}"):
            LoRARequest("b0", 40, str(tiny_adapters[0]), scale=bad)
    with pytest.raises(ValueError, match="needs at least one LoRARequest, got none"):
        LoRARequest.combine()
    with pytest.raises(ValueError, match="argument 1 must be a LoRARequest, got NoneType"):
        LoRARequest.combine(a[0], None)
    with pytest.raises(ValueError, match="cannot contain a combination"):
        LoRARequest.combine(a[0], LoRARequest.combine(a[1], a[2]))
    with pytest.raises(ValueError, match="adapter name 'b0' appears more than once"):
        LoRARequest.combine(a[0], LoRARequest("b0", 40, str(tiny_adapters[0]), scale=0.5))
    with pytest.raises(ValueError, match="adapter lora_int_id 40 appears more than once"):
        LoRARequest.combine(a[0], LoRARequest("other", 40, str(tiny_adapters[1])))
    with pytest.raises(ValueError, match=r"weights has 1 entries for 2 adapters \(b0, b1\)"):
        LoRARequest.combine(a[0], a[1], weights=(0.5,))
    with pytest.raises(ValueError, match=r"weights\[1\] \('b1'\) must be a finite number .*got nan"):
        LoRARequest.combine(a[0], a[1], weights=(0.5, float("nan")))
    with pytest.raises(ValueError, match="weights must be a sequence of 2 numbers, got float"):
        LoRARequest.combine(a[0], a[1], weights=0.5)
    with pytest.raises(ValueError, match=r"weights\[0\] \* scale of 'b0' must be .*got 12.0"):
        LoRARequest.combine(LoRARequest("b0", 40, str(tiny_adapters[0]), scale=4.0), a[1], weights=(3.0, 1.0))
    # More adapters than slots: refused at add, nothing queued.
    with pytest.raises(ValueError, match="combines 5 adapters .* max_loras=4 slots"):
        llm.generate(PROMPTS[:2], greedy, [None, LoRARequest.combine(*a)])
    # A part that does not load: refused at add, nothing queued.
    with pytest.raises(FileNotFoundError):
        llm.generate(PROMPTS[:1], greedy, LoRARequest.combine(a[0], LoRARequest("gone", 99, "/nonexistent/adapter")))
    assert not llm.engine.has_unfinished()
    assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS[:2], greedy, [a[0], None])] == want


def test_combinations_and_scales_churn_slots_without_compiles(llm, tiny_adapters):
    """Eight adapters through four slots: combinations of up to four (all slots) wait until all
    their parts fit, beside plain, scaled and base rows; each row's tokens are those it gets alone."""
    greedy = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    a = [LoRARequest(f"c{i}", 60 + i, str(tiny_adapters[4 + i])) for i in range(8)]
    rng = np.random.default_rng(0)
    reqs: list = []
    for k in range(12):
        kind = k % 4
        if kind == 0:
            reqs.append(None if k % 8 == 0 else a[int(rng.integers(8))])
        elif kind == 1:
            i = int(rng.integers(8))
            reqs.append(LoRARequest(a[i].lora_name, a[i].lora_int_id, a[i].lora_path,
                                    scale=float(rng.choice([0.25, 1.5, -0.5]))))
        else:
            parts = rng.choice(8, size=4 if k == 6 else 2, replace=False)
            reqs.append(LoRARequest.combine(*(a[int(i)] for i in parts),
                                            weights=tuple(float(w) for w in rng.uniform(-1, 1.5, len(parts)))))
    prompts = [PROMPTS[k % len(PROMPTS)] for k in range(12)]
    llm.generate(PROMPTS[:1], greedy)
    before = compile_stats.compile_count()
    writes = llm.engine.adapters.stats["slot_writes"]
    together = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy, reqs)]
    alone = [llm.generate([p], greedy, r)[0].outputs[0].token_ids for p, r in zip(prompts, reqs)]
    assert compile_stats.compile_count() == before
    assert llm.engine.adapters.stats["slot_writes"] - writes > 8  # the slots churned
    assert together == alone
    assert all(llm.engine.adapters.pins(s) == 0 for s in range(4))  # every pin released


# ---- the server's fields -------------------------------------------------------------------------


def test_server_lora_scale_and_lora_combine(llm, tiny_adapters):
    from live import KEY, serve_live

    from jlora.server.app import build_app

    app = build_app(llm, "tiny", lora_modules={f"s{i}": str(tiny_adapters[i]) for i in range(6)}, api_key=KEY)
    with serve_live(llm, app) as live:
        srv, http = live.srv, live.http()
        body = {"model": "s1", "prompt": PROMPTS[0], "max_tokens": 6, "temperature": 0.0, "ignore_eos": True,
                "logprobs": 0, "return_tokens_as_token_ids": True}

        def tokens(resp):
            assert resp.status_code == 200, resp.text
            return [int(t.split(":")[1]) for t in resp.json()["choices"][0]["logprobs"]["tokens"]]

        def offline(lora):
            params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
            return live.on_engine(lambda: llm.generate([PROMPTS[0]], params, lora, use_tqdm=False))[0]

        scaled = tokens(http.post("/v1/completions", json={**body, "lora_scale": -1.5}))
        assert scaled == offline(LoRARequest("s1", srv.adapters["s1"].lora_int_id, srv.adapters["s1"].lora_path,
                                             scale=-1.5)).outputs[0].token_ids
        assert scaled != tokens(http.post("/v1/completions", json=body))
        combined = tokens(http.post("/v1/completions", json={**body, "model": "tiny",
                                                              "lora_combine": {"s1": 0.7, "s2": 0.5}}))
        assert combined == offline(LoRARequest.combine(srv.adapters["s1"], srv.adapters["s2"],
                                                       weights=(0.7, 0.5))).outputs[0].token_ids
        chat = http.post("/v1/chat/completions", json={
            "model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3,
            "lora_combine": {"s3": 1.0, "s1": -0.5}})
        assert chat.status_code == 200, chat.text

        def refused(extra, param, match):
            resp = http.post("/v1/completions", json={**body, **extra})
            assert resp.status_code == 400, resp.text
            err = resp.json()["error"]
            assert err["param"] == param and re.search(match, err["message"]), err

        import re
        refused({"lora_scale": 11}, "lora_scale", "less than or equal to 10")
        refused({"lora_scale": "big"}, "lora_scale", "valid number|float")
        refused({"lora_scale": 0.5, "model": "tiny"}, "lora_scale", "is the base model")
        refused({"lora_combine": {"s1": 1.0}}, "lora_combine", "model must be the base model")
        refused({"model": "tiny", "lora_combine": {}}, "lora_combine", "at least 1")
        refused({"model": "tiny", "lora_combine": {"s1": 1.0, "nope": 1.0}}, "lora_combine", r"not loaded: \['nope'\]")
        refused({"model": "tiny", "lora_combine": {"s1": 1.0, "s2": -20}}, "lora_combine.s2", "greater than or equal to -10")
        refused({"model": "tiny", "lora_combine": {f"s{i}": 1.0 for i in range(5)}}, "lora_combine",
                "max_loras=4")
        assert tokens(http.post("/v1/completions", json={**body, "lora_scale": -1.5})) == scaled  # still serving


@pytest.mark.slow
def test_scales_and_combinations_across_slot_pools_of_several_ranks(llm, tiny_dir, tiny_adapters):
    """With slots of ranks 4/4/8/8 (two pools) a combination's parts sit in different pools; each
    pool reads its own columns of the slot weights. Tokens equal those of uniform slots."""
    pooled = LLM(str(tiny_dir[0]), progress=False, **{**ENGINE, "lora_slot_ranks": (4, 4, 8, 8)})
    greedy = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=0)
    a = {i: LoRARequest(f"p{i}", 80 + i, str(tiny_adapters[i])) for i in (0, 1, 2, 3)}  # ranks 2, 4, 6, 8
    reqs = [LoRARequest.combine(a[0], a[2], weights=(0.6, -0.8)), LoRARequest("p3", 83, str(tiny_adapters[3]), scale=0.3),
            None, LoRARequest.combine(a[1], a[3], a[0], weights=(1.2, 0.4, 0.9)), a[2]]
    want = llm.generate(PROMPTS[:5], greedy, reqs)
    got = pooled.generate(PROMPTS[:5], greedy, reqs)
    for w, g in zip(want, got):
        assert g.outputs[0].token_ids == w.outputs[0].token_ids
        np.testing.assert_allclose([lp[t] for t, lp in zip(g.outputs[0].token_ids, g.outputs[0].logprobs)],
                                   [lp[t] for t, lp in zip(w.outputs[0].token_ids, w.outputs[0].logprobs)], atol=1e-5)
    pooled.close()


def test_new_scales_and_mixes_do_not_recompile():
    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.standard_normal((8, 16), np.float32))
    a = jnp.asarray(rng.standard_normal((4, 16, 4), np.float32))
    b = jnp.asarray(rng.standard_normal((4, 4, 16), np.float32))
    for impl in ("gather", "laned", "grouped"):
        def call(ids, scale, mix):
            return lora_delta(x, a, b, jnp.asarray(ids, jnp.int32), impl=impl, scale=jnp.asarray(scale, jnp.float32),
                              mix=jnp.asarray(mix, jnp.float32)).block_until_ready()
        call([0] * 8, np.ones(8), np.zeros((8, 4)))
        before = compile_stats.compile_count()
        for _ in range(3):
            call(rng.choice([-1, 0, 1, 2, 3, MIX_SLOT], 8), rng.uniform(-2, 2, 8), rng.uniform(-1, 1, (8, 4)))
        call([MIX_SLOT] * 8, np.zeros(8), np.ones((8, 4)))
        call([-1] * 8, np.ones(8), np.zeros((8, 4)))
        assert compile_stats.compile_count() == before, impl


def test_prefix_cache_is_never_shared_across_scales_or_combinations(llm, tiny_adapters):
    greedy = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    prompt = " ".join(f"w{i}" for i in range(40))  # several full blocks of 16
    a, b = (LoRARequest(f"k{i}", 90 + i, str(tiny_adapters[i])) for i in (5, 6))

    def cached(lora) -> int:
        return llm.generate([prompt], greedy, lora)[0].num_cached_tokens

    variants = [a, LoRARequest("k5", 95, str(tiny_adapters[5]), scale=0.5), LoRARequest.combine(a, b),
                LoRARequest.combine(a, b, weights=(1.0, 0.5)), LoRARequest.combine(b, a)]
    assert [cached(v) for v in variants] == [0] * 5  # each its own KV: nothing found under another's key
    assert all(cached(v) >= 32 for v in variants)  # and its own blocks are found again
