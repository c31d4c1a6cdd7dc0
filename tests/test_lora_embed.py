"""LoRA on embed_tokens and lm_head (`enable_embedding_lora`) against the real `peft`, in batches
that mix such adapters with plain adapters and base rows, on an untied and a tied tiny Llama.

Adapters are made by peft with every LoRA factor drawn at random (`_spread`): peft's own init
leaves lora_embedding_A at zero, and a zero factor would test nothing. The references run one row
at a time with a PeftModel holding that row's adapter only (a tied model's ensure_weight_tying
adapter is then built exactly as peft builds it), and peft's own mixed batch (`adapter_names=`)
where several adapters share one PeftModel.
"""

from __future__ import annotations

import functools
import shutil

import jax
import numpy as np
import peft
import pytest
import torch
import transformers
from flax import nnx

from jlora import LLM, LoRARequest, SamplingParams, compile_stats
from jlora.adapters import padded_update, read_peft_adapter, set_slot
from jlora.models import build_model, init_cache, init_lora_state, read_hf_checkpoint
from jlora.models.config import LORA_MODULES, VOCAB_MODULES
from adapter_edits import edited_adapter

MAX_RANK = 8
ADAPTERS = {
    "embed": dict(r=4, lora_alpha=8, target_modules=["embed_tokens", "q_proj"]),
    "head": dict(r=6, lora_alpha=6, target_modules=["lm_head", "v_proj"], use_rslora=True),
    "both": dict(r=8, lora_alpha=16, target_modules=["embed_tokens", "lm_head", "down_proj"],
                 rank_pattern={"lm_head": 3}, alpha_pattern={"embed_tokens": 4}),
    "plain": dict(r=4, lora_alpha=8, target_modules=["q_proj", "o_proj"]),
}
# A tied model only: peft ties the head's adapter to the embedding's (lora_A = lora_embedding_B^T, ...).
TIED_ADAPTERS = {"tied": dict(r=4, lora_alpha=8, target_modules=["embed_tokens", "gate_proj"],
                              ensure_weight_tying=True)}
IDS = {"embed": 1, "head": 2, "both": 3, "plain": 4, "tied": 5}  # one lora_int_id per name in a shared engine
ENGINE = dict(max_model_len=128, max_num_seqs=4, max_num_batched_tokens=32, max_loras=2, max_lora_rank=MAX_RANK,
              token_buckets=(16, 32))
STD = {"lora_embedding_A": 1.0, "lora_embedding_B": 0.05, "lm_head.lora_A": 0.1, "lm_head.lora_B": 0.3}


def _spread(pm: torch.nn.Module) -> None:
    """Draws the embedding's and the head's LoRA factors at random (peft zeroes lora_embedding_A)."""
    with torch.no_grad():
        for n, p in pm.named_parameters():
            std = next((s for k, s in STD.items() if k in n), None)
            if std is not None:
                p.normal_(0.0, std)


def _make(tmp_path_factory, tied: bool):
    """(checkpoint dir, adapter dirs) of a tiny random Llama (full SmolLM2 vocabulary) and its adapters."""
    from jlora.models import default_model_path
    from jlora.tokenizer import load_gguf_tokenizer

    cfg = transformers.LlamaConfig(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                   max_position_embeddings=256, tie_word_embeddings=tied, bos_token_id=1,
                                   eos_token_id=2)
    torch.manual_seed(5 if tied else 4)
    model = transformers.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():  # sharper logits (tied: the embedding is the head)
        model.lm_head.weight.mul_(8.0)
    root = tmp_path_factory.mktemp("tied" if tied else "untied")
    model.save_pretrained(root / "base", safe_serialization=True)
    load_gguf_tokenizer(default_model_path()).save_pretrained(root / "base")
    paths = {}
    for i, (name, kw) in enumerate({**ADAPTERS, **(TIED_ADAPTERS if tied else {})}.items()):
        torch.manual_seed(100 + i)
        fresh = transformers.LlamaForCausalLM.from_pretrained(root / "base")
        pm = peft.get_peft_model(fresh, peft.LoraConfig(init_lora_weights=False, **kw))
        _spread(pm)
        pm.save_pretrained(root / name)
        paths[name] = root / name
    return root / "base", paths


@pytest.fixture(scope="module")
def untied(tmp_path_factory):
    return _make(tmp_path_factory, tied=False)


@pytest.fixture(scope="module")
def tied(tmp_path_factory):
    return _make(tmp_path_factory, tied=True)


@pytest.fixture(scope="module")
def llm(untied):
    """An engine with embedding LoRA slots on the untied model: 3 slots for 4 adapters (churn)."""
    engine = LLM(str(untied[0]), progress=False, enable_embedding_lora=True, **{**ENGINE, "max_loras": 3})
    yield engine
    engine.close()


@functools.lru_cache(maxsize=None)
def _peft(base: str, adapter: str | None):
    """The base model alone (adapter None) or with one adapter, as peft loads it."""
    model = transformers.LlamaForCausalLM.from_pretrained(base).eval()
    return model if adapter is None else peft.PeftModel.from_pretrained(model, adapter).eval()


def _peft_logits(base, paths, name, ids: np.ndarray) -> np.ndarray:  # [T, V] of one row
    with torch.no_grad():
        m = _peft(str(base), None if name is None else str(paths[name]))
        return m(input_ids=torch.from_numpy(ids[None].astype(np.int64))).logits[0].float().numpy()


def _greedy(m, ids: list[int], n: int) -> list[int]:
    """n greedy tokens, EOS included like any other (jlora's ignore_eos; HF's min_new_tokens would ban it)."""
    out: list[int] = []
    with torch.no_grad():
        for _ in range(n):
            out.append(int(m(input_ids=torch.tensor([ids + out])).logits[0, -1].argmax()))
    return out


def _peft_greedy(base, paths, name, ids: list[int], n: int) -> list[int]:
    return _greedy(_peft(str(base), None if name is None else str(paths[name])), ids, n)


@functools.partial(jax.jit, static_argnums=(0,))
def _forward(graphdef, params, tokens, positions, cache, lora_state, slots):
    logits, _ = nnx.merge(graphdef, params)(tokens, positions, cache, lora_state, slots, lora_impl="laned")
    return logits


# ---- conversion ------------------------------------------------------------------------------------


def test_converter_maps_peft_factors_and_tying(untied, tied):
    base, paths = untied
    cfg, _ = read_hf_checkpoint(base)
    ad = read_peft_adapter(paths["both"], cfg, MAX_RANK)
    assert set(ad.weights) == {"embed_tokens", "lm_head", "down_proj"}
    assert ad.ranks["lm_head"] == 3 and ad.ranks["embed_tokens"] == 8
    pm = _peft(str(base), str(paths["both"]))
    emb = pm.base_model.model.model.embed_tokens
    a, b = ad.weights["embed_tokens"]  # [1, V, r], [1, r, D]: token t's delta = a[0, t] @ b[0]
    want = (emb.lora_embedding_B["default"] @ emb.lora_embedding_A["default"]).T * emb.scaling["default"]
    np.testing.assert_allclose(a[0] @ b[0], want.detach().numpy(), rtol=1e-5, atol=1e-6)
    assert emb.scaling["default"] == 4 / 8  # alpha_pattern
    head = pm.base_model.model.lm_head
    a, b = ad.weights["lm_head"]  # x A B = scale * x lora_A^T lora_B^T
    want = (head.lora_B["default"].weight @ head.lora_A["default"].weight).T * head.scaling["default"]
    np.testing.assert_allclose(a[0] @ b[0], want.detach().numpy(), rtol=1e-5, atol=1e-6)
    assert head.scaling["default"] == 16 / 3  # rank_pattern
    # ensure_weight_tying on a tied model: the head's factors are the embedding's, transposed.
    tbase, tpaths = tied
    tcfg, _ = read_hf_checkpoint(tbase)
    ad = read_peft_adapter(tpaths["tied"], tcfg, MAX_RANK)
    (ea, eb), (ha, hb) = ad.weights["embed_tokens"], ad.weights["lm_head"]
    np.testing.assert_allclose(ha[0], eb[0].T / 2.0, rtol=1e-6)  # scale 8/4 folded into B
    np.testing.assert_allclose(hb[0], ea[0].T * 2.0, rtol=1e-6)
    # Without ensure_weight_tying the head has no adapter of its own, tied base or not.
    assert "lm_head" not in read_peft_adapter(tpaths["embed"], tcfg, MAX_RANK).weights


def test_tied_head_is_made_from_the_embedding_when_the_file_lacks_it(tied, tmp_path):
    from safetensors.numpy import load_file, save_file

    base, paths = tied
    cfg, _ = read_hf_checkpoint(base)
    d = tmp_path / "no_head"
    shutil.copytree(paths["tied"], d)
    t = load_file(str(d / "adapter_model.safetensors"))
    save_file({k: v for k, v in t.items() if "lm_head" not in k}, str(d / "adapter_model.safetensors"))
    full, lean = read_peft_adapter(paths["tied"], cfg, MAX_RANK), read_peft_adapter(d, cfg, MAX_RANK)
    for m in ("embed_tokens", "lm_head"):
        for x, y in zip(full.weights[m], lean.weights[m]):
            np.testing.assert_array_equal(x, y)


# ---- the model's forward against peft ------------------------------------------------------------


@pytest.mark.parametrize("which", ["untied", "tied"])
def test_mixed_batch_logits_match_peft(which, request):
    base, paths = request.getfixturevalue(which)
    cfg, tensors = read_hf_checkpoint(base)
    jmodel = build_model(cfg, tensors)
    state = init_lora_state(cfg, 4, MAX_RANK, modules=LORA_MODULES + VOCAB_MODULES)
    names = list(paths)  # embed, head, both, plain (+ tied)
    slot_of = {n: i for i, n in enumerate(names[:4])}
    if "tied" in paths:  # the tied adapter replaces "plain"
        slot_of = {**{n: i for i, n in enumerate(["embed", "head", "both"])}, "tied": 3}
    for name, slot in slot_of.items():
        upd = padded_update(read_peft_adapter(paths[name], cfg, MAX_RANK), cfg, MAX_RANK, LORA_MODULES + VOCAB_MODULES)
        state = set_slot(state, slot, upd)
    rows = [*slot_of, None, *reversed(list(slot_of))]
    tokens = np.random.default_rng(1).integers(0, cfg.vocab_size, size=(len(rows), 10)).astype(np.int32)
    positions = np.broadcast_to(np.arange(10, dtype=np.int32), tokens.shape)
    slots = np.asarray([-1 if r is None else slot_of[r] for r in rows], np.int32)
    graphdef, params = nnx.split(jmodel)
    got = np.asarray(_forward(graphdef, params, tokens, positions, init_cache(cfg, len(rows), 10), state, slots))
    base_only = np.asarray(_forward(graphdef, params, tokens, positions, init_cache(cfg, len(rows), 10), None,
                                    np.full(len(rows), -1, np.int32)))
    for i, r in enumerate(rows):
        want = _peft_logits(base, paths, r, tokens[i])
        np.testing.assert_allclose(got[i], want, atol=3e-4, rtol=3e-4, err_msg=f"row {i} ({r})")
        assert (got[i].argmax(-1) == want.argmax(-1)).all()
        if r in ("embed", "head", "both", "tied"):  # the embedding / head LoRA moved the logits
            assert np.abs(got[i] - base_only[i]).max() > 0.5, r


def test_peft_mixed_batch_adapter_names(untied):
    """peft's own mixed batch (one PeftModel, adapter_names=) agrees with jlora's rows."""
    base, paths = untied
    model = transformers.LlamaForCausalLM.from_pretrained(base).eval()
    pm = peft.PeftModel.from_pretrained(model, paths["embed"], adapter_name="embed")
    for n in ("head", "both", "plain"):
        pm.load_adapter(paths[n], adapter_name=n)
    cfg, tensors = read_hf_checkpoint(base)
    state = init_lora_state(cfg, 4, MAX_RANK, modules=LORA_MODULES + VOCAB_MODULES)
    order = ["embed", "head", "both", "plain"]
    for slot, n in enumerate(order):
        state = set_slot(state, slot, padded_update(read_peft_adapter(paths[n], cfg, MAX_RANK), cfg, MAX_RANK,
                                                    LORA_MODULES + VOCAB_MODULES))
    rows = ["both", "__base__", "embed", "plain", "head"]
    tokens = np.random.default_rng(2).integers(0, cfg.vocab_size, size=(len(rows), 9)).astype(np.int32)
    with torch.no_grad():
        want = pm(input_ids=torch.from_numpy(tokens.astype(np.int64)), adapter_names=rows).logits.numpy()
    graphdef, params = nnx.split(build_model(cfg, tensors))
    slots = np.asarray([order.index(r) if r in order else -1 for r in rows], np.int32)
    got = np.asarray(_forward(graphdef, params, tokens, np.broadcast_to(np.arange(9, dtype=np.int32), tokens.shape),
                              init_cache(cfg, len(rows), 9), state, slots))
    np.testing.assert_allclose(got, want, atol=3e-4, rtol=3e-4)


# ---- the engine ------------------------------------------------------------------------------------


@pytest.mark.parametrize("which", ["untied", "tied"])
def test_engine_greedy_matches_peft_with_churn_and_no_recompiles(which, request):
    base, paths = request.getfixturevalue(which)
    if which == "untied":
        llm = request.getfixturevalue("llm")
    else:  # two slot pools (ranks 4 and 8): the deltas read each pool's own slots
        llm = LLM(str(base), progress=False, enable_embedding_lora=True, lora_slot_ranks=(4, 8), **ENGINE)
    reqs = {n: LoRARequest(n, IDS[n], str(p)) for n, p in paths.items()}
    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    prompts = ["Hello there", "Once upon a time", "1 2 3 4", "The cat"]
    names = list(paths)
    orders = [[names[0], None, names[1], names[3]], [names[2], names[-1], None, names[0]],
              [names[3], names[1], names[2], None]]
    llm.generate(prompts[:1], greedy, reqs[names[0]])  # the first request, outside the count
    before = compile_stats.compile_count()
    for order in orders:
        outs = llm.generate(prompts, greedy, [reqs[n] if n else None for n in order])
        for o, n in zip(outs, order):
            assert o.outputs[0].token_ids == _peft_greedy(base, paths, n, list(o.prompt_token_ids), 8), n
    assert compile_stats.compile_count() == before
    assert llm.engine.adapters.stats["evictions"] > 0
    if which == "tied":
        llm.close()


def test_scaled_and_combined_rows_match_peft_cat(untied, llm):
    """Per-request scale and LoRARequest.combine scale / mix the embedding and head deltas as peft's
    add_weighted_adapter(..., combination_type="cat") does."""
    base, paths = untied
    model = transformers.LlamaForCausalLM.from_pretrained(base).eval()
    pm = peft.PeftModel.from_pretrained(model, paths["both"], adapter_name="both")
    for n in ("embed", "head"):
        pm.load_adapter(paths[n], adapter_name=n)
    pm.add_weighted_adapter(["both"], [0.5], adapter_name="both_half", combination_type="cat")
    pm.add_weighted_adapter(["embed", "head"], [0.7, -0.5], adapter_name="mix", combination_type="cat")
    pm.eval()
    reqs = {n: LoRARequest(n, IDS[n], str(paths[n])) for n in ("both", "embed", "head")}
    rows = [(LoRARequest("both", IDS["both"], str(paths["both"]), scale=0.5), "both_half"),
            (LoRARequest.combine(reqs["embed"], reqs["head"], weights=(0.7, -0.5)), "mix"),
            (None, None), (reqs["both"], "both")]
    greedy = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    prompts = ["Hello there", "Once upon a time", "1 2 3 4", "The cat"]
    outs = llm.generate(prompts, greedy, [r for r, _ in rows])
    for o, (_, name) in zip(outs, rows):
        ids = list(o.prompt_token_ids)
        if name is None:
            with pm.disable_adapter():
                want = _greedy(pm, ids, 6)
        else:
            pm.set_adapter(name)
            want = _greedy(pm, ids, 6)
        assert o.outputs[0].token_ids == want, name


def test_prompt_logprobs_read_the_head_adapter(untied, llm):
    base, paths = untied
    ids = [1, 523, 1722, 314, 253, 1148, 30]
    out = llm.generate([{"prompt_token_ids": ids}], SamplingParams(max_tokens=1, prompt_logprobs=0),
                       LoRARequest("head", IDS["head"], str(paths["head"])))[0]
    want = torch.log_softmax(torch.from_numpy(_peft_logits(base, paths, "head", np.asarray(ids))).double(), -1)
    got = [lp[t] for t, lp in zip(ids[1:], out.prompt_logprobs[1:])]
    np.testing.assert_allclose(got, [float(want[i, t]) for i, t in enumerate(ids[1:])], atol=2e-4)


# ---- refusals ---------------------------------------------------------------------------------------


def test_bad_input_is_refused_and_the_engine_keeps_serving(untied, llm, tmp_path):
    base, paths = untied
    cfg, _ = read_hf_checkpoint(base)

    def variant(name, edit_tensors=None, edit_config=None, src="both"):
        return edited_adapter(paths[src], tmp_path / name, edit_tensors, edit_config)

    ea = "base_model.model.model.embed_tokens.lora_embedding_A"
    hb = "base_model.model.lm_head.lora_B.weight"
    cases = {
        "short_vocab": (lambda t: t.update({ea: t[ea][:, :-1]}), None, "do not fit the base model's embed_tokens"),
        "no_B": (lambda t: t.pop(hb), None, "has lora_A but no lora_B"),
        "nan": (lambda t: t[ea].__setitem__((0, 0), np.nan), None, "NaN"),
        "untargeted": (None, lambda c: c.update(target_modules=["down_proj", "embed_tokens"]),
                       "lm_head.*does not target"),
        "dora": (None, lambda c: c.update(use_dora=True), "DoRA.*embed_tokens|DoRA.*lm_head"),
        "missing": (lambda t: [t.pop(k) for k in list(t) if "embed_tokens" in k], None,
                    "no LoRA tensors for 'model.embed_tokens'"),
    }
    for name, (et, ec, msg) in cases.items():
        with pytest.raises(ValueError, match=msg):
            read_peft_adapter(variant(name, et, ec), cfg, MAX_RANK)
    with pytest.raises(ValueError, match="above max_lora_rank=4"):
        read_peft_adapter(paths["both"], cfg, 4)

    greedy = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    # An engine without the option names it, and serves on.
    plain_llm = LLM(str(base), progress=False, warmup="lazy", **ENGINE)
    plain = LoRARequest("plain", IDS["plain"], str(paths["plain"]))
    want = plain_llm.generate(["Hello"], greedy, plain)[0].outputs[0].token_ids
    for n in ("embed", "head"):
        with pytest.raises(ValueError, match=r"\['%s'\].*enable_embedding_lora=True" % ("embed_tokens" if n == "embed"
                                                                                         else "lm_head")):
            plain_llm.generate(["Hello"], greedy, LoRARequest(n, IDS[n], str(paths[n])))
    assert plain_llm.generate(["Hello"], greedy, plain)[0].outputs[0].token_ids == want
    plain_llm.close()
    # Tensor parallelism: refused before a model is loaded.
    with pytest.raises(ValueError, match="enable_embedding_lora.*tensor parallel"):
        LLM(str(base), progress=False, enable_embedding_lora=True, tensor_parallel_size=2, **ENGINE)
    with pytest.raises(ValueError, match="enable_embedding_lora must be a bool"):
        LLM(str(base), progress=False, enable_embedding_lora="yes", **ENGINE)
    # With the option: a bad adapter is refused by name, the others keep being served.
    good = LoRARequest("both", IDS["both"], str(paths["both"]))
    want = llm.generate(["Hello"], greedy, good)[0].outputs[0].token_ids
    with pytest.raises(ValueError, match="embed_tokens"):
        llm.generate(["Hello"], greedy, LoRARequest("bad", 99, str(tmp_path / "short_vocab")))
    assert llm.generate(["Hello"], greedy, good)[0].outputs[0].token_ids == want


def test_cli_flag_reaches_llm(cli_llm_kwargs):
    generate, serve = cli_llm_kwargs
    assert generate(["--enable-embedding-lora"])["enable_embedding_lora"] is True
    assert "enable_embedding_lora" not in generate([])  # LLM's default (off)
    assert serve(["--enable-embedding-lora"])["enable_embedding_lora"] is True
    assert serve([])["enable_embedding_lora"] is False


def test_training_refuses_vocab_slots(untied):
    base, _ = untied
    cfg, tensors = read_hf_checkpoint(base)
    state = init_lora_state(cfg, 1, MAX_RANK, modules=LORA_MODULES + VOCAB_MODULES)
    with pytest.raises(ValueError, match="embed_tokens / lm_head"):
        build_model(cfg, tensors).train_logits(np.zeros((1, 4), np.int32), state)


@pytest.mark.slow  # the real default model (SmolLM2-135M, tied embeddings): its own engine's warm-up
def test_real_tied_model_matches_peft(tmp_path, hf_real):
    import copy

    def fresh():  # a new HF model for each adapter and reference: peft injects its layers into the model it wraps
        return copy.deepcopy(hf_real[0])  # (the session's GGUF load, copied: tied weights stay tied)

    specs = {"tied_ewt": dict(r=8, lora_alpha=16, target_modules=["embed_tokens", "q_proj"],
                              ensure_weight_tying=True),
             "indep": dict(r=8, lora_alpha=16, target_modules=["embed_tokens", "lm_head", "v_proj"])}
    std = {"lora_embedding_A": 1.0, "lora_embedding_B": 0.01, "lm_head.lora_A": 0.05, "lm_head.lora_B": 0.1}
    for i, (name, spec) in enumerate(specs.items()):
        torch.manual_seed(400 + i)
        pm = peft.get_peft_model(fresh(), peft.LoraConfig(init_lora_weights=False, **spec))
        with torch.no_grad():
            for n, p in pm.named_parameters():
                s = next((v for k, v in std.items() if k in n), None)
                if s is not None:
                    p.normal_(0.0, s)
        pm.save_pretrained(tmp_path / name)
    reqs = {n: LoRARequest(f"real-{n}", 800 + i, str(tmp_path / n)) for i, n in enumerate(specs)}
    order = ["tied_ewt", None, "indep", "tied_ewt"]
    prompts = ["What is the capital of France?", "Name a fruit.", "Write a haiku.", "2 + 2 ="]
    # Two step graphs (4 decode rows; the same beside one 32-token prompt chunk): every prompt fits one chunk.
    llm = LLM(progress=False, enable_embedding_lora=True, max_model_len=256, max_num_seqs=4, max_num_batched_tokens=32,
              token_buckets=(32,), decode_row_buckets=(4,), max_loras=2, max_lora_rank=8)
    greedy = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    before = compile_stats.compile_count()
    outs = llm.generate(prompts, greedy, [reqs[n] if n else None for n in order])
    assert compile_stats.compile_count() == before
    llm.close()
    refs = {n: fresh() if n is None else peft.PeftModel.from_pretrained(fresh(), str(tmp_path / n)).eval()
            for n in (None, *specs)}
    for o, n in zip(outs, order):
        ids = list(o.prompt_token_ids)
        want = _greedy(refs[n], ids, 10)
        assert o.outputs[0].token_ids == want, n
        if n is not None:  # the adapter moves the logits (with it off, a row would read the base's)
            with torch.no_grad():
                moved = refs[n](input_ids=torch.tensor([ids])).logits - refs[None](input_ids=torch.tensor([ids])).logits
            assert float(moved.abs().max()) > 0.5, n
