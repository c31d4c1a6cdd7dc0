"""Adapters on the real default model: a mixed batch against peft, zero recompiles, bad input."""

import json
import shutil

import numpy as np
import pytest
import torch

from jlora import LoRARequest, SamplingParams, compile_stats

pytestmark = pytest.mark.slow  # the real default model

PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Name a fruit that is yellow.",
    "How many legs does a spider have?",
]

# Four adapters exercising every scaling field peft has (ranks 8/16/8/32 like the reference workload).
ADAPTER_SPECS = {
    "qv-r8": dict(r=8, lora_alpha=16, target_modules=r".*\.(q_proj|v_proj)"),
    "all-r16-rslora": dict(r=16, lora_alpha=8, target_modules="all-linear", use_rslora=True),
    "mlp-patterns": dict(r=8, lora_alpha=16, target_modules=["gate_proj", "up_proj", "down_proj", "o_proj"],
                         rank_pattern={"down_proj": 4}, alpha_pattern={"o_proj": 32}),
    "regex-layers-r32": dict(r=32, lora_alpha=128, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
                             layers_to_transform=list(range(0, 30, 2))),
}


def make_peft_adapters(model, specs: dict, root, seed: int, b_scale: float) -> dict:
    """PEFT adapters made by the real peft library on `model`, saved under `root`; B scaled so
    every adapter visibly changes the output."""
    from peft import LoraConfig, get_peft_model

    paths = {}
    for i, (name, spec) in enumerate(specs.items()):
        torch.manual_seed(seed + i)
        pm = get_peft_model(model, LoraConfig(init_lora_weights=False, lora_dropout=0.0, **spec), adapter_name=name)
        with torch.no_grad():
            for n, p in pm.named_parameters():
                if "lora_B" in n:
                    p.mul_(b_scale)
        pm.save_pretrained(root, selected_adapters=[name])
        paths[name] = root / name if (root / name).exists() else root
        pm.unload()  # restore the plain base model for the next adapter
    return paths


@pytest.fixture(scope="module")
def peft_adapters(hf_real, tmp_path_factory):
    return make_peft_adapters(hf_real[0], ADAPTER_SPECS, tmp_path_factory.mktemp("peft_real"), 100, 0.3)


def peft_greedy_and_logits(hf_real, path, ids, n):
    from peft import PeftModel

    model, _ = hf_real
    pm = PeftModel.from_pretrained(model, str(path)).eval()
    try:
        with torch.no_grad():
            logits = pm(torch.tensor([ids])).logits[0, -1].numpy()
            out = pm.generate(input_ids=torch.tensor([ids]), max_new_tokens=n, do_sample=False,
                              eos_token_id=2, pad_token_id=2)
    finally:
        pm.unload()
    gen = out[0, len(ids):].tolist()
    return (gen[:-1] if gen and gen[-1] == 2 else gen), logits


def test_mixed_batch_matches_peft_per_adapter(real_llm, hf_real, peft_adapters):
    import jax.numpy as jnp

    from jlora.models import init_cache

    _, tok = hf_real
    names = list(ADAPTER_SPECS)
    reqs = {n: LoRARequest(n, i + 1, str(peft_adapters[n])) for i, n in enumerate(names)}
    # 8 rows: each adapter twice, interleaved with base rows.
    rows = [(PROMPTS[i % 4], reqs[names[i % 4]] if i % 3 else None) for i in range(8)]
    convs = [[{"role": "user", "content": p}] for p, _ in rows]
    outs = real_llm.chat(convs, SamplingParams(temperature=0.0, max_tokens=24), [r for _, r in rows])
    for (prompt, req), out in zip(rows, outs):
        ids = real_llm.apply_chat_template([{"role": "user", "content": prompt}])
        if req is None:
            continue  # base rows are covered by test_real_model; here they share the batch
        ref_tokens, ref_logits = peft_greedy_and_logits(hf_real, peft_adapters[req.lora_name], ids, 24)
        assert out.outputs[0].token_ids == ref_tokens, (req.lora_name, prompt)
        # Last-prompt-position logits with this adapter in its slot, through the jitted engine weights.
        eng = real_llm.engine
        slot = eng.adapters.acquire(eng.adapters.prepare(req))
        eng.runner.write_slots(eng.adapters.take_writes())  # as before a step
        try:
            t = len(ids)
            logits, _ = real_llm.model(
                jnp.asarray([ids], jnp.int32), jnp.arange(t, dtype=jnp.int32)[None], init_cache(real_llm.model.cfg, 1, t),
                eng.runner.lora_state, jnp.array([slot], jnp.int32), jnp.array([t - 1]))
        finally:
            eng.adapters.release(slot)
        np.testing.assert_allclose(np.asarray(logits[0]), ref_logits, rtol=0, atol=2e-3)


def test_every_adapter_changes_the_output(real_llm, peft_adapters):
    convs = [[{"role": "user", "content": PROMPTS[1]}]] * 5
    reqs = [None] + [LoRARequest(n, i + 1, str(peft_adapters[n])) for i, n in enumerate(ADAPTER_SPECS)]
    outs = real_llm.chat(convs, SamplingParams(temperature=0.0, max_tokens=16), reqs)
    base = outs[0].outputs[0].token_ids
    for req, out in zip(reqs[1:], outs[1:]):
        assert out.outputs[0].token_ids != base, req.lora_name


def test_zero_compiles_loading_12_adapters_through_4_slots(real_llm, peft_adapters, tmp_path):
    # 12 distinct adapters: copies of the four under new names and ids, so each is a fresh load.
    reqs = []
    for k in range(12):
        src = peft_adapters[list(ADAPTER_SPECS)[k % 4]]
        dst = tmp_path / f"copy{k}"
        shutil.copytree(src, dst)
        reqs.append(LoRARequest(f"copy{k}", 100 + k, str(dst)))
    before = compile_stats.compile_count()
    params = SamplingParams(temperature=0.0, max_tokens=3)
    for k in range(0, 12, 4):
        outs = real_llm.generate(["Hello"] * 5, params, lora_request=reqs[k:k + 4] + [None], use_tqdm=False)
        assert all(len(o.outputs[0].token_ids) == 3 for o in outs)
    assert compile_stats.compile_count() == before
    assert len(real_llm.engine.adapters.resident()) <= 4


def test_bad_adapters_raise_and_engine_keeps_serving(real_llm, peft_adapters, tmp_path):
    params = SamplingParams(temperature=0.0, max_tokens=4)
    expected = real_llm.generate(["Hello"], params)[0].outputs[0].token_ids

    with pytest.raises(FileNotFoundError):  # raised by LoRARequest itself, before generate runs
        real_llm.generate(["Hello", "Hi"], params,
                          lora_request=[None, LoRARequest("missing", 201, str(tmp_path / "does-not-exist"))])

    broken = tmp_path / "broken"
    shutil.copytree(peft_adapters["qv-r8"], broken)
    (broken / "adapter_model.safetensors").write_bytes(b"\x00garbage")
    with pytest.raises(ValueError):
        real_llm.generate(["Hello"], params, lora_request=LoRARequest("broken", 202, str(broken)))

    too_big = tmp_path / "too-big"
    shutil.copytree(peft_adapters["regex-layers-r32"], too_big)
    cfg = json.loads((too_big / "adapter_config.json").read_text())
    cfg["r"] = 64  # above the fixture's max_lora_rank=32 (tensors disagree too; either is a clear error)
    (too_big / "adapter_config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError):
        real_llm.generate(["Hello"], params, lora_request=LoRARequest("too-big", 203, str(too_big)))

    dora = tmp_path / "dora"
    shutil.copytree(peft_adapters["qv-r8"], dora)
    cfg = json.loads((dora / "adapter_config.json").read_text())
    cfg["use_dora"] = True
    (dora / "adapter_config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="use_dora"):
        real_llm.generate(["Hello"], params, lora_request=LoRARequest("dora", 204, str(dora)))

    with pytest.raises(ValueError, match="LoRARequest"):
        real_llm.generate(["Hello"], params, lora_request="qv-r8")

    # Nothing was queued by the failed calls, and the engine still answers correctly.
    assert not real_llm.engine.has_unfinished()
    assert real_llm.generate(["Hello"], params)[0].outputs[0].token_ids == expected


# Sub-modules of the packed modules (q/k/v as one GEMM, gate/up as one) in every combination.
PACKED_SPECS = {
    "q-r8": dict(r=8, lora_alpha=16, target_modules=["q_proj"]),
    "qv-r16": dict(r=16, lora_alpha=16, target_modules=["q_proj", "v_proj"]),
    "qkv-ranks": dict(r=8, lora_alpha=16, target_modules=["q_proj", "k_proj", "v_proj"],
                      rank_pattern={"q_proj": 4, "v_proj": 32}),
    "gate-r8": dict(r=8, lora_alpha=16, target_modules=["gate_proj"]),
    "up-r16": dict(r=16, lora_alpha=32, target_modules=["up_proj"], use_rslora=True),
    "gate-up-ranks": dict(r=8, lora_alpha=16, target_modules=["gate_proj", "up_proj"], rank_pattern={"up_proj": 24}),
}


@pytest.fixture(scope="module")
def packed_adapters(hf_real, tmp_path_factory):
    return make_peft_adapters(hf_real[0], PACKED_SPECS, tmp_path_factory.mktemp("peft_real_packed"), 200, 0.5)


@pytest.mark.parametrize("group", [["q-r8", "qv-r16", "qkv-ranks"], ["gate-r8", "up-r16", "gate-up-ranks"]],
                         ids=["qkv", "gate_up"])
def test_packed_sub_modules_greedy_match_peft(real_llm, hf_real, packed_adapters, group):
    """Each combination's greedy tokens in one mixed batch (with a base row) equal peft's."""
    reqs = [LoRARequest(n, 300 + list(PACKED_SPECS).index(n), str(packed_adapters[n])) for n in group]
    rows = [(PROMPTS[i], r) for i, r in enumerate(reqs)] + [(PROMPTS[3], None)]
    outs = real_llm.chat([[{"role": "user", "content": p}] for p, _ in rows],
                         SamplingParams(temperature=0.0, max_tokens=16), [r for _, r in rows])
    for (prompt, req), out in zip(rows, outs):
        if req is None:
            continue
        ids = real_llm.apply_chat_template([{"role": "user", "content": prompt}])
        ref_tokens, _ = peft_greedy_and_logits(hf_real, packed_adapters[req.lora_name], ids, 16)
        assert out.outputs[0].token_ids == ref_tokens, (req.lora_name, prompt)
