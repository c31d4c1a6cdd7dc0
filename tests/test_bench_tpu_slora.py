"""`jlora bench tpu --sections slora` (jlora/bench/tpu/slora.py) on the CPU at the tiny shape: the
adapters it writes are real PEFT adapters, the section's rows end to end (each engine checked
against the CPU first), and no timed row when an engine fails its check."""

from __future__ import annotations

import json

import ml_dtypes
import numpy as np
import pytest

from jlora.bench.tpu import cli, shapes as tpu_shapes, slora
from jlora.models.config import LlamaConfig
from jlora.models.random_checkpoint import bench_config

SMALL = ["--shape", "tiny", "--slora-adapters", "16", "--slora-rows", "4", "--slora-requests", "10",
         "--slora-prompt-len", "8,40", "--slora-new-tokens", "4,10", "--slora-load-samples", "3",
         "--slora-workers", "2"]


def tiny_cfg() -> LlamaConfig:
    return LlamaConfig.from_hf_dict(bench_config(tpu_shapes.SHAPES["tiny"]))


def test_adapters_are_distinct_peft_adapters_of_their_rank(tmp_path):
    from jlora.adapters.peft import read_peft_config, read_peft_tensors

    cfg = tiny_cfg()
    info = slora.write_slora_adapters(cfg, 12, tmp_path, ranks=(8, 16), workers=3)
    assert not info["reused"] and len(info["ranks"]) == 12
    assert set(info["ranks"]) <= set(range(8, 17)) and len(set(info["ranks"])) > 1
    firsts = set()
    for a, rank in enumerate(info["ranks"]):
        path = tmp_path / f"a{a:04d}"
        conf = read_peft_config(path)
        assert conf["r"] == rank and conf["target_modules"] == ["q_proj", "v_proj"]
        tensors, _ = read_peft_tensors(path)
        assert len(tensors) == 2 * 2 * cfg.num_hidden_layers
        q_a = tensors["base_model.model.model.layers.1.self_attn.q_proj.lora_A.weight"]
        v_b = tensors["base_model.model.model.layers.0.self_attn.v_proj.lora_B.weight"]
        assert q_a.shape == (rank, cfg.hidden_size) and v_b.shape == (cfg.num_key_value_heads * cfg.head_dim, rank)
        assert 0.01 < np.std(q_a) < 0.03 and np.array_equal(q_a, q_a.astype(ml_dtypes.bfloat16).astype(np.float32))
        raw = (path / "adapter_model.safetensors").read_bytes()
        header = json.loads(raw[8:8 + int.from_bytes(raw[:8], "little")])
        assert {v["dtype"] for k, v in header.items() if k != "__metadata__"} == {"BF16"}
        assert (path / "adapter_model.safetensors").stat().st_size >= slora.adapter_bytes(tpu_shapes.SHAPES["tiny"], rank)
        firsts.add(q_a.astype(np.float32).tobytes())
    assert len(firsts) == 12  # each adapter its own values
    again = slora.write_slora_adapters(cfg, 12, tmp_path, ranks=(8, 16))
    assert again["reused"] and again["ranks"] == info["ranks"]
    assert not slora.write_slora_adapters(cfg, 13, tmp_path, ranks=(8, 16))["reused"]  # another count: rewritten


def test_power_law_draws_fewer_adapters_than_uniform():
    uni, pl = slora.draw(1024, 512, "uniform", 1), slora.draw(1024, 512, "power-law", 1)
    assert 350 < len(set(uni)) < 460 and len(set(pl)) < 0.7 * len(set(uni))
    assert pl.count(0) > 30  # the most popular adapter: p = 1 / H(1024) ~ 0.13


def test_flags_and_sizes():
    args = cli.parse_args(["--sections", "slora"])
    assert args.slora_slots == (16, 64) and args.slora_adapters == 1024 and args.slora_rows == 64
    s = slora.slora_sizes(args)
    assert s["max_model_len"] == 512 and s["token_buckets"] == (256, 512) and s["decode_row_buckets"] == (64,)
    for bad in (["--slora-popularity", "zipf"], ["--slora-ranks", "16,8"], ["--slora-slots", "0"]):
        with pytest.raises(SystemExit):
            cli.parse_args(["--sections", "slora", *bad])
    assert cli.plan_processes(["checkpoint", "kernel", "slora", "engine"]) == \
        [["checkpoint"], ["kernel"], ["slora"], ["engine"]]


@pytest.mark.slow  # two tiny engines, each checked against a CPU reference process: ~60 s on 2 busy cores
def test_slora_section_end_to_end(tmp_path):
    out = tmp_path / "out"
    assert cli.main([*SMALL, "--dir", str(tmp_path / "d"), "--out", str(out), "--sections", "checkpoint,slora",
                     "--slora-slots", "2,4", "--in-process"]) == 0
    r = json.loads((out / "results.json").read_text())["tiny/none"]["slora"]
    assert r["adapters_written"]["spec"]["n"] == 16 and r["requests"] == 10
    for slots in ("2", "4"):
        eng = r["engines"][slots]
        assert eng["check"]["passed"] and "withheld" not in eng
        assert eng["compiles_after_warmup"] == 0
        assert eng["load_s"]["n"] == 3 and 0 < eng["load_s"]["p50"] <= eng["load_s"]["p99"]
    rows = r["rows"]
    assert [(x["slots"], x["popularity"]) for x in rows] == \
        [(s, p) for s in (2, 4) for p in ("one", "uniform", "power-law")]
    for x in rows:
        one = next(y for y in rows if y["slots"] == x["slots"] and y["popularity"] == "one")
        assert x["generated"] == one["generated"] == r["new_tokens"]  # the same requests, every token
        assert x["vs_one_adapter"] == pytest.approx(x["tok_s"] / one["tok_s"])
        assert 0 < x["ttft_p50"] <= x["ttft_p99"]
        if x["popularity"] == "one":
            assert x["distinct_adapters"] == 1 and x["slot_writes"] == 1
        else:  # every adapter a run uses goes into a slot at least once, converted before the run
            assert x["slot_writes"] >= x["distinct_adapters"] > 1 and x["conversion_s"]["n"] == x["distinct_adapters"]
            assert x["slot_write_host_s"] > 0
    # the 2-slot engine swaps more than the 4-slot one over the same uniform draws
    uni = {x["slots"]: x for x in rows if x["popularity"] == "uniform"}
    assert uni[2]["evictions"] >= uni[4]["evictions"]


@pytest.mark.slow  # one tiny engine (its check faked): ~50 s on 2 busy cores with a cold compile cache
def test_an_engine_that_fails_its_check_gets_no_timed_rows(tmp_path, monkeypatch):
    from jlora.bench import chip_check

    seen = []

    def failing(llm, path, workdir, quantization=None, reference=None):
        seen.append(llm.config.max_loras)
        return {"passed": False, "seconds": 0.0, "rows": 0, "equal": 0}

    monkeypatch.setattr(chip_check, "check_engine", failing)
    monkeypatch.setattr(chip_check, "summary_line", lambda v: "FAILED (faked)")
    out = tmp_path / "out"
    assert cli.main([*SMALL, "--dir", str(tmp_path / "d"), "--out", str(out), "--sections", "checkpoint,slora",
                     "--slora-slots", "2", "--in-process"]) == 0
    r = json.loads((out / "results.json").read_text())["tiny/none"]["slora"]
    assert seen == [2]
    assert r["engines"]["2"]["withheld"] == "the engine failed its check against the CPU"
    assert r["rows"] == [] and "load_s" not in r["engines"]["2"]
