"""The TPU decode-step bug, reproduced on the CPU, and the chip check that gates every chip figure.

On a TPU v5e (JAX 0.10.2) a step's sampled ids came back as 0 on every decode-only step of a
small row bucket: the step packed its int32 outputs into a float32 vector as bit patterns, an id
below 2^23 is a subnormal float32, and XLA:TPU flushed those to zero (a plain concatenate of such
bits returned zeros on the chip). Here the flush is applied where the chip applied it, to the
float32 data that leaves the step, so the bug shows on the CPU.
"""

from __future__ import annotations

import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jlora import LLM, SamplingParams
from jlora.bench import chip_check
from jlora.engine import runner as runner_module
from jlora.models import quant

TINY_ENGINE = dict(max_model_len=96, max_num_seqs=1, max_num_batched_tokens=32, token_buckets=(32,), max_loras=2,
                   max_lora_rank=8)


def flush_subnormals(tree):
    """Device arrays to NumPy with float32 subnormals flushed to zero, as XLA:TPU does to float32
    data; int32 data is untouched."""
    def flush(x):
        x = np.asarray(x)
        if x.dtype == np.float32:
            x = np.where(np.abs(x) < np.finfo(np.float32).tiny, np.float32(0), x).astype(np.float32)
        return x
    return jax.tree.map(flush, jax.device_get(tree))


def float_bits_pack_outputs(out):
    """The step's output packing before the fix: int32 ids bit-cast into a float32 vector."""
    leaves, treedef = jax.tree_util.tree_flatten(out)
    parts, entries, offset = [], [], 0
    for x in leaves:
        parts.append((jax.lax.bitcast_convert_type(x, jnp.float32) if x.dtype == jnp.int32 else
                      x.astype(jnp.float32)).reshape(-1))
        entries.append((offset, x.shape, "int32" if x.dtype == jnp.int32 else "float32"))
        offset += x.size
    return jnp.concatenate(parts), (treedef, tuple(entries))


def float_bits_unpack_outputs(packed, layout):
    treedef, entries = layout
    packed = np.asarray(packed)
    leaves = [(packed[o: o + int(np.prod(s))].view(np.int32) if dt == "int32" else
               packed[o: o + int(np.prod(s))]).reshape(s) for o, s, dt in entries]
    return jax.tree_util.tree_unflatten(treedef, leaves)


def test_packed_outputs_keep_ids_and_float_bits():
    tiny = np.finfo(np.float32).tiny
    out = {"tokens": jnp.array([0, 1, 5, 31788, 49151, 2**23 - 1], jnp.int32),
           "logprob": jnp.array([-0.0, tiny / 4, np.nan, np.inf, -3.25, 1e-30], jnp.float32)}
    packed, layout = jax.jit(lambda o: runner_module.pack_outputs(o)[0])(out), runner_module.pack_outputs(out)[1]
    assert packed.dtype == jnp.int32  # nothing in it is float data a backend may flush
    got = runner_module.unpack_outputs(flush_subnormals(packed), layout)
    np.testing.assert_array_equal(got["tokens"], np.asarray(out["tokens"]))
    assert got["logprob"].view(np.int32).tolist() == np.asarray(out["logprob"]).view(np.int32).tolist()
    with pytest.raises(ValueError, match="int32"):
        runner_module.unpack_outputs(np.zeros(12, np.float32), layout)


def test_decode_tokens_survive_a_subnormal_flush(tiny_dir, monkeypatch):
    """One row, greedy, as on the chip: the first token comes from a prefill step, the rest from
    decode-only steps. With the host's copy of the outputs flushed as XLA:TPU flushes float32
    data, the tokens must not change (before the fix: the first token, then id 0 on every step)."""
    llm = LLM(str(tiny_dir[0]), progress=False, **TINY_ENGINE)
    prompts = [{"prompt_token_ids": [5, 17, 300, 4000, 12]}, {"prompt_token_ids": [9, 8, 7]}]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert all(len(set(t)) > 1 for t in want), want  # the tiny model's greedy text is not one id
    monkeypatch.setattr(runner_module, "fetch", flush_subnormals)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert got == want


@pytest.mark.slow  # an engine of its own with the old packing, ~15 s
def test_the_bug_reproduced_with_the_old_packing(tiny_dir, monkeypatch):
    """The same flush over the old float32 packing gives what the chip gave: id 0 (here from every
    step; the chip's prefill steps came through, its fusions there kept the bits)."""
    monkeypatch.setattr(runner_module, "pack_outputs", float_bits_pack_outputs)
    monkeypatch.setattr(runner_module, "unpack_outputs", float_bits_unpack_outputs)
    monkeypatch.setattr(runner_module, "fetch", flush_subnormals)
    llm = LLM(str(tiny_dir[0]), progress=False, **TINY_ENGINE)
    out = llm.generate([{"prompt_token_ids": [5, 17, 300, 4000, 12]}],
                       SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True), use_tqdm=False)
    tokens = out[0].outputs[0].token_ids
    assert tokens == [0] * 12


def test_coverage_phases_plan_every_graph_kind():
    from jlora.engine_args import engine_config

    config = engine_config(backend="tpu", **chip_check.SMOLLM2_SIZES)
    phases = chip_check.coverage_phases(config, vocab=49152, n_adapters=5)
    names = [p.name for p in phases]
    for r in config.decode_row_buckets:
        assert f"decode {r} rows, base" in names and f"decode {r} rows, adapters" in names
    for p, q in config.prefill_shapes():
        assert f"prefill {p}x{q}" in names
    for ph in phases:
        assert len(ph.prompts) == len(ph.adapters) == len(ph.max_tokens)
        assert all(len(p) + m <= config.max_model_len for p, m in zip(ph.prompts, ph.max_tokens))
    assert chip_check.Phase.from_json(json.loads(json.dumps(phases[0].to_json()))) == phases[0]


def test_check_adapters_are_peft_adapters_and_reproducible(tmp_path):
    from jlora.models.loading import read_model_config, resolve_model_path
    from jlora.models import default_model_path

    cfg = read_model_config(resolve_model_path(str(default_model_path())))
    a = chip_check.write_check_adapters(cfg, tmp_path / "a")
    b = chip_check.write_check_adapters(cfg, tmp_path / "b")
    assert [p.name for p in a] == ["qv-r8", "all-r16-rslora", "mlp-patterns", "regex-attn", "even-layers-r16"]
    for x, y in zip(a, b):
        assert (x / "adapter_model.safetensors").read_bytes() == (y / "adapter_model.safetensors").read_bytes()
    from safetensors.numpy import load_file

    regex = load_file(str(a[3] / "adapter_model.safetensors"))
    assert {k.split(".")[-3] for k in regex} == {"k_proj", "o_proj"}
    even = load_file(str(a[4] / "adapter_model.safetensors"))
    assert {int(k.split(".")[4]) for k in even} == set(range(0, cfg.num_hidden_layers, 2))


@pytest.mark.slow  # the whole check: its engines and a reference process, ~60 s
def test_chip_check_passes_the_cpu_against_itself(tmp_path):
    res = chip_check.run_check(["tiny"], tmp_path / "out", tmp_path, only=["tiny float32"])
    case = res["cases"]["tiny float32"]
    assert res["passed"], case
    assert case["rows_equal"] == case["rows"] > 20 and case["graphs_not_run"] == []
    assert case["teacher_forced_logprob_max_diff"] < 1e-4 and case["positions"] > 300


def test_feature_requests_are_scales_a_combination_and_dora(tmp_path):
    from jlora import LoRARequest
    from jlora.adapters.request import LoRACombination
    from jlora.models.loading import read_model_config, resolve_model_path
    from jlora.models import default_model_path

    cfg = read_model_config(resolve_model_path(str(default_model_path())))
    case = {c["name"]: c for c in chip_check.default_cases(["smollm2"])}["smollm2 float32, adapter features"]
    paths, specs = chip_check.case_adapters(case, cfg, tmp_path)
    loras = chip_check._loras(paths, specs)
    assert len(loras) == len(chip_check.FEATURE_SPECS) == 9
    assert [loras[i].scale for i in (0, 2, 3, 4, 5, 6, 7, 8)] == [0.5, 1.0, -0.75] + [1.0] * 5
    assert loras[0].lora_name == loras[4].lora_name  # one adapter, two scales: one slot
    assert isinstance(loras[1], LoRACombination) and loras[1].weights == (0.7, 0.5)
    assert [p.lora_name for p in loras[1].parts] == [loras[4].lora_name, loras[6].lora_name]
    dora = json.loads((Path(paths[5]) / "adapter_config.json").read_text())
    assert dora["use_dora"] is True and isinstance(loras[2], LoRARequest) and loras[2].lora_path == paths[5]
    from safetensors.numpy import load_file

    mags = [v for k, v in load_file(str(Path(paths[5]) / "adapter_model.safetensors")).items()
            if k.endswith("lora_magnitude_vector")]
    assert len(mags) == 2 * cfg.num_hidden_layers and all(0.5 <= m.min() and m.max() <= 2.0 for m in mags)
    # planned like the other cases, with a reference of its own
    plain_case = {c["name"]: c for c in chip_check.default_cases(["smollm2"])}["smollm2 float32"]
    assert chip_check.reference_key(case) != chip_check.reference_key(plain_case)
    # its engines (the chip's, and the reference's, built from the case with kwargs={}) serve DoRA
    assert chip_check.case_engine_kwargs(dict(case, kwargs={}))["enable_dora"] is True
    assert "enable_dora" not in chip_check.case_engine_kwargs(plain_case)


@pytest.mark.slow  # two tiny engines and a CPU reference process: ~60 s on 2 cores
def test_chip_check_holds_adapter_features_and_fails_an_ignored_scale(tmp_path, monkeypatch):
    """Scales, a combination and DoRA rows pass the CPU against itself; an engine that drops the
    per-request scale (every row at 1.0) fails against the unpatched reference process."""
    name = "tiny float32, adapter features"
    res = chip_check.run_check(["tiny"], tmp_path / "out", tmp_path, only=[name])
    case = res["cases"][name]
    assert res["passed"] and case["rows_equal"] == case["rows"] and case["graphs_not_run"] == [], case
    real = runner_module.fill_slots

    def scale_ignored(batch, rows, s):
        real(batch, rows, s)
        batch["slot_scale"][rows] = 1.0

    monkeypatch.setattr(runner_module, "fill_slots", scale_ignored)
    res = chip_check.run_check(["tiny"], tmp_path / "out2", tmp_path, only=[name])
    broken = res["cases"][name]
    assert not res["passed"] and broken["rows_diverged"] > 0, broken


def test_w8a8_ops_are_held_bit_for_bit(monkeypatch):
    """The W8A8 check: the integer dot against NumPy's int64 product on any backend, and (on a
    chip) every step of quant.linear against the CPU device. A quantizer that rounds differently on
    the device under test fails it."""
    res = chip_check.w8a8_ops()
    assert res["passed"] and res["dot_differ_from_int64"] == 0, res
    real = quant.quantize
    calls = []

    def other_rounding(x, axis=-1):  # floor for the first device's call, the real one for the CPU's
        calls.append(1)
        if len(calls) > 1:
            return real(x, axis)
        q, s = real(x, axis)
        xf = x.astype(jnp.float32) / jnp.expand_dims(jnp.where(s > 0, s, 1.0), axis)
        return jnp.clip(jnp.floor(xf), -quant.QMAX, quant.QMAX).astype(jnp.int8), s

    monkeypatch.setattr(quant, "quantize", other_rounding)
    broken = chip_check.w8a8_ops()
    assert not broken["passed"] and broken["quantize_codes_differ"] > 0, broken


def test_the_smollm2_cases_hold_int8_weights_but_w8a8_op_by_op():
    cases = {c["name"]: c for c in chip_check.default_cases(["smollm2"])}
    w8a16 = cases["smollm2 int8-weight-only"]
    assert w8a16["quantization"] == "int8-weight-only" and chip_check.target_for(w8a16) == chip_check.TARGETS["float32"]
    assert not any(c.get("quantization") == "int8" for c in cases.values())


@pytest.mark.slow  # the whole check: its engines and a reference process, ~40 s
def test_chip_check_fails_the_broken_step(tmp_path, monkeypatch):
    """The chip's bug on the CPU (the old packing and the flush) fails the check: the reference
    runs in its own process, unpatched."""
    monkeypatch.setattr(runner_module, "pack_outputs", float_bits_pack_outputs)
    monkeypatch.setattr(runner_module, "unpack_outputs", float_bits_unpack_outputs)
    monkeypatch.setattr(runner_module, "fetch", flush_subnormals)
    res = chip_check.run_check(["tiny"], tmp_path / "out", tmp_path, only=["tiny float32"])
    case = res["cases"]["tiny float32"]
    assert not res["passed"] and not case["passed"]
    assert case["rows_diverged"] == case["rows"] and case["rows_equal"] == 0, case


@pytest.mark.slow  # the real default model
def test_the_peft_reference_file_is_the_cpu_engines_output(real_llm, tmp_path):
    """The chip check's transformers + peft tokens (written by `chip_check peft-reference`) are what
    the CPU engine gives for the same batch, so the file still describes this code."""
    ref = json.loads(chip_check.REFERENCE_FILE.read_text())
    adapters = chip_check.write_check_adapters(real_llm.model.cfg, tmp_path)
    assert ref["rows"] == [None if a is None else adapters[a].name for a in chip_check.PEFT_ROWS]
    tokens = chip_check.run_peft_batch(real_llm, chip_check._loras([str(p) for p in adapters]))
    verdict = chip_check.compare_peft(ref, tokens)
    assert verdict["passed"], verdict
    assert len({tuple(t) for t in tokens}) == len(tokens)  # every row its own text


def test_the_int8_kv_cases_run_only_when_named():
    """The int8-KV cases are out of the default run (its length) and in `--only`'s choices; their CPU
    reference runs the same int8 cache (its own reference key), and SmolLM2's is held to bfloat16's targets."""
    default = {c["name"] for c in chip_check.default_cases(["smollm2", "tiny"])}
    optional = {c["name"]: c for c in chip_check.default_cases(["smollm2", "tiny"], optional=True)}
    assert set(optional) - default == {"smollm2 bfloat16, int8 KV", "tiny float32, int8 KV"}
    kv = optional["smollm2 bfloat16, int8 KV"]
    assert kv["kv_cache_dtype"] == "int8" and chip_check.target_for(kv) == chip_check.TARGETS["bfloat16"]
    assert chip_check.reference_key(kv) != chip_check.reference_key(optional["smollm2 bfloat16"])


@pytest.mark.slow  # two tiny engines and a CPU reference process
def test_chip_check_runs_an_int8_kv_case_against_its_int8_reference(tmp_path):
    res = chip_check.run_check(["tiny"], tmp_path / "out", tmp_path, only=["tiny float32, int8 KV"])
    case = res["cases"]["tiny float32, int8 KV"]
    assert res["passed"], case
    assert case["kv_cache_dtype"] == "int8" and case["rows_equal"] == case["rows"] > 20
    assert case["teacher_forced_logprob_max_diff"] < 1e-4 and case["graphs_not_run"] == []


def _one_row_results(ref_tokens: list[int], got_tokens: list[int], margin_at: dict[int, float]) -> tuple[dict, dict]:
    """run_case-shaped results of one phase with one row; `margin_at[j]`: the reference's top-two
    margin at position j (1.0 elsewhere)."""
    def dist(t: int, j: int) -> dict[int, float]:
        other = 1 if t != 1 else 2
        return {t: -0.1, other: -0.1 - margin_at.get(j, 1.0)}

    forced = [[dist(t, j) for j, t in enumerate(ref_tokens)]]
    ref = dict(greedy=[dict(name="decode", tokens=[ref_tokens], logprobs=forced)], forced=[forced])
    got = dict(greedy=[dict(name="decode", tokens=[got_tokens], logprobs=forced)], forced=[forced],
               graphs_compiled=["g"], graphs_run={"g": 1})
    return ref, got


def test_a_repeat_after_a_near_tie_is_reported_and_a_collapse_elsewhere_fails():
    target = chip_check.TARGETS["bfloat16"]
    ref_tokens = [5, 6, 7, 8, 9, 10, 11, 12]
    looping = [5, 6, 40, 40, 40, 40, 40, 40]
    # The row leaves the reference at position 2, where the reference's two best are 0.1 apart.
    ref, got = _one_row_results(ref_tokens, looping, {2: 0.1})
    v = chip_check.compare(ref, got, target)
    assert v["passed"] and v["collapsed"] == [] and v["rows_near_tie"] == 1
    assert v["repeats_after_near_tie"] == ["decode row 0: (40, 6)"]
    # The same row leaving it where the reference was sure (margin 1.0): collapsed, failed.
    ref, got = _one_row_results(ref_tokens, looping, {})
    v = chip_check.compare(ref, got, target)
    assert not v["passed"] and v["collapsed"] == ["decode row 0: (40, 6)"] and v["rows_diverged"] == 1
    assert "collapsed 1" in chip_check.summary_line(v)
