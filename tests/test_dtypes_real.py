"""bfloat16 and int8 engines on the real default model against the float32 engine (and int8 with bfloat16
compute, the TPU's configuration, against the bfloat16 engine), with adapters.

For each mode: greedy outputs of a fixed prompt set (base rows and two adapters mixed in one batch)
agree with float32's at a stated rate, teacher-forced logits stay within a stated bound of float32's
(top-1 agreement at a stated rate), no compile happens after warm-up, and memory_report() shows the
smaller weights. The numbers the bounds were set from (2-core CPU) are in each assertion's comment and
in README.md.
"""

import json

import jax.numpy as jnp
import numpy as np
import pytest

from conftest import TEST_ENGINE
from jlora import LLM, LoRARequest, SamplingParams, compile_stats
from jlora.models import init_cache

pytestmark = pytest.mark.slow

PROMPTS = ["What is the capital of France?", "Write a haiku about the sea.", "Name a fruit that is yellow.",
           "How many legs does a spider have?"]
NEW_TOKENS = 24


def write_peft_adapter(path, cfg, r, alpha, targets, seed, scale=0.05):
    """A PEFT-format LoRA adapter (adapter_config.json + adapter_model.safetensors) with random A and B."""
    from safetensors.numpy import save_file

    rng = np.random.default_rng(seed)
    shapes = cfg.module_shapes()
    t = {}
    for i in range(cfg.num_hidden_layers):
        for m in targets:
            sub = "self_attn" if m in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
            d_in, d_out = shapes[m]
            pre = f"base_model.model.model.layers.{i}.{sub}.{m}"
            t[pre + ".lora_A.weight"] = (rng.standard_normal((r, d_in)) / np.sqrt(d_in)).astype(np.float32)
            t[pre + ".lora_B.weight"] = (rng.standard_normal((d_out, r)) * scale / np.sqrt(r)).astype(np.float32)
    path.mkdir(parents=True, exist_ok=True)
    save_file(t, str(path / "adapter_model.safetensors"))
    (path / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": r, "lora_alpha": alpha, "target_modules": list(targets), "bias": "none",
         "base_model_name_or_path": "SmolLM2-135M-Instruct"}))
    return path


@pytest.fixture(scope="module")
def adapters(real_llm, tmp_path_factory):
    root = tmp_path_factory.mktemp("dtype_adapters")
    cfg = real_llm.model.cfg
    a = write_peft_adapter(root / "qv", cfg, 8, 16, ["q_proj", "v_proj"], seed=1)
    b = write_peft_adapter(root / "all", cfg, 16, 32, list(cfg.module_shapes()), seed=2)
    return [LoRARequest("qv", 901, str(a)), LoRARequest("all", 902, str(b))]  # ids no other test uses (shared real_llm)


def rows(adapters):
    """12 rows: every prompt as the base model and with each adapter, interleaved in one batch."""
    return [(p, [None, *adapters][k]) for p in PROMPTS for k in range(3)]


def run(llm, adapters):
    batch = rows(adapters)
    convs = [[{"role": "user", "content": p}] for p, _ in batch]
    outs = llm.chat(convs, SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True),
                    [r for _, r in batch], use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs], [llm.apply_chat_template(c) for c in convs]


def teacher_forced_logits(llm, ids_rows, adapters):
    """Logits f32[B, T, V] of `llm`'s model over the given token rows with each row's adapter."""
    batch = rows(adapters)
    width = max(len(r) for r in ids_rows)
    ids = np.zeros((len(ids_rows), width), np.int32)
    pos = np.full((len(ids_rows), width), -1, np.int32)
    for i, r in enumerate(ids_rows):
        ids[i, :len(r)] = r
        pos[i, :len(r)] = np.arange(len(r))
    mgr = llm.engine.adapters
    slots = np.array([-1 if r is None else mgr.slot_of(r.lora_name) for _, r in batch], np.int32)
    assert (slots[[i for i, (_, r) in enumerate(batch) if r is not None]] >= 0).all()
    dtype = llm.engine.runner.kv_dtype
    logits, _ = llm.model(jnp.asarray(ids), jnp.asarray(pos), init_cache(llm.model.cfg, len(ids_rows), width, dtype),
                          llm.engine.runner.lora_state, jnp.asarray(slots))
    return np.asarray(logits), pos >= 0


def reference_of(llm, adapters):
    """One side of a comparison, computed once: its tokens, the prompts, its teacher-forced logits
    over prompt + its greedy continuation, and the compiles its run caused (added to each
    comparison's count)."""
    before = compile_stats.compile_count()
    tokens, prompts = run(llm, adapters)
    compiles = compile_stats.compile_count() - before
    seqs = [p + t for p, t in zip(prompts, tokens)]
    logits, valid = teacher_forced_logits(llm, seqs, adapters)
    return dict(tokens=tokens, compiles=compiles, seqs=seqs, logits=logits, valid=valid)


@pytest.fixture(scope="module")
def reference(real_llm, adapters):
    """float32's side of every comparison (the shared engine gives the same greedy tokens and logits
    each time)."""
    return reference_of(real_llm, adapters)


def compare(reference, llm, adapters):
    ref_tokens = reference["tokens"]
    before = compile_stats.compile_count()
    got_tokens, _ = run(llm, adapters)
    compiles = reference["compiles"] + compile_stats.compile_count() - before
    greedy = np.mean([np.mean(np.array(a) == np.array(b)) for a, b in zip(got_tokens, ref_tokens)])
    first = np.mean([a[0] == b[0] for a, b in zip(got_tokens, ref_tokens)])
    # Teacher-forced over prompt + float32's greedy continuation: every position's logits.
    seqs = reference["seqs"]
    ref_logits, valid = reference["logits"], reference["valid"]
    logits, _ = teacher_forced_logits(llm, seqs, adapters)
    top1 = np.mean((logits.argmax(-1) == ref_logits.argmax(-1))[valid])
    dmax = np.abs(logits - ref_logits)[valid].max()
    return dict(greedy=greedy, first=first, top1=top1, dlogit_max=dmax, compiles=compiles,
                adapters_change_output=any(ref_tokens[3 * i] != ref_tokens[3 * i + k] for i in range(4) for k in (1, 2)))


@pytest.fixture(scope="module")
def bf16_llm():
    return LLM(dtype="bfloat16", progress=False, **TEST_ENGINE)


@pytest.fixture(scope="module")
def int8_llm():
    return LLM(quantization="int8", progress=False, **TEST_ENGINE)


def test_bf16_engine_agrees_with_float32(real_llm, reference, bf16_llm, adapters):
    r = compare(reference, bf16_llm, adapters)
    print("bf16 vs float32:", r)
    assert r["adapters_change_output"]
    assert r["compiles"] == 0
    # Measured: top-1 0.996, |dlogit| max 0.41, greedy 0.94, first tokens 1.00 (bf16 storage, f32 compute on CPU).
    assert r["top1"] >= 0.99 and r["dlogit_max"] < 1.0
    assert r["greedy"] >= 0.90 and r["first"] == 1.0
    mem, ref = bf16_llm.memory_report(), real_llm.memory_report()
    assert mem["weights"]["dtype"] == "bfloat16" and mem["kv_cache"]["dtype"] == "bfloat16"
    assert abs(mem["weights"]["bytes"] * 2 - ref["weights"]["bytes"]) < 1024  # but the f32 rotary table
    assert mem["kv_cache"]["bytes"] * 2 == ref["kv_cache"]["bytes"]
    assert all("M" not in s for s in real_llm.engine.runner.lora_state.values())  # no DoRA factors (enable_dora)
    assert mem["lora_slots"]["bytes"] * 2 == ref["lora_slots"]["bytes"]


def test_int8_engine_agrees_with_float32(real_llm, reference, int8_llm, adapters):
    r = compare(reference, int8_llm, adapters)
    print("int8 (W8A8) vs float32:", r)
    assert r["compiles"] == 0
    # Measured (2026-12-04, this test alone, also at 119f460): teacher-forced top-1 0.84, |dlogit| max
    # 7.8, greedy 0.18, first tokens 0.67; an earlier session recorded 0.86 / 7.8 / 0.35 / 1.00. The
    # teacher-forced numbers are the stable measure; greedy and first-token agreement over 12 rows
    # swing with near-tied first tokens (prompt 0's first token is 504 in float32 and 60 in W8A8,
    # and the adapters, which move float32 from 504 to 60, move W8A8 back). See README.
    assert r["top1"] >= 0.80 and r["dlogit_max"] < 15.0
    assert r["greedy"] >= 0.12 and r["first"] >= 0.5
    mem, ref = int8_llm.memory_report(), real_llm.memory_report()
    assert mem["weights"]["quantization"] == "int8" and mem["weights"]["activations"] == "int8"
    assert mem["weights"]["bytes"] < 0.3 * ref["weights"]["bytes"]
    assert mem["lora_slots"]["bytes"] == ref["lora_slots"]["bytes"]  # adapters stay float32


def test_int8_weight_only_agrees_closer(reference, adapters):
    llm = LLM(quantization="int8-weight-only", progress=False, **TEST_ENGINE)
    r = compare(reference, llm, adapters)
    print("int8-weight-only vs float32:", r)
    assert r["compiles"] == 0
    # Measured: top-1 0.96, |dlogit| max 2.4, greedy 0.58, first tokens 0.92.
    assert r["top1"] >= 0.93 and r["dlogit_max"] < 5.0
    assert r["greedy"] >= 0.4 and r["first"] >= 0.8
    assert llm.memory_report()["weights"]["activations"] == "float"


@pytest.mark.parametrize("quantization", ["int8-weight-only", "int8"])
def test_int8_with_bf16_compute_agrees_with_the_bf16_engine(bf16_llm, adapters, quantization):
    """The TPU's configuration (dtype=bfloat16 with int8 weights; W8A8 for `int8` on CPU and TPU alike)
    against the bfloat16 engine, the reference an 8B on one chip has (its bf16 weights do not fit)."""
    llm = LLM(dtype="bfloat16", quantization=quantization, progress=False, **TEST_ENGINE)
    r = compare(reference_of(bf16_llm, adapters), llm, adapters)
    print(f"{quantization} (bf16 compute) vs bfloat16:", r)
    assert r["compiles"] == 0
    # Measured 2026-12-07 (2-core CPU): int8-weight-only top-1 0.96, |dlogit| max 2.8, greedy 0.57, first
    # tokens 0.92; int8 (W8A8) 0.84, 8.2, 0.24, 0.75: as against float32 (above), the same bounds.
    if quantization == "int8-weight-only":
        assert r["top1"] >= 0.93 and r["dlogit_max"] < 5.0
        assert r["greedy"] >= 0.4 and r["first"] >= 0.8
    else:
        assert r["top1"] >= 0.80 and r["dlogit_max"] < 15.0
        assert r["greedy"] >= 0.12 and r["first"] >= 0.5
