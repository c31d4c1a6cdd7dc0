"""Slots that hold only the modules adapters target (`lora_target_modules`): q/v-only slots are the
q|k|v projection's alone, give peft's and the default engine's greedy tokens for q/v adapters in a
batch with base rows, refuse adapters on other modules by name, and compile nothing as adapters churn."""

from __future__ import annotations

import copy
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import peft
import pytest
import torch

from jlora import LLM, LoRARequest, SamplingParams, compile_stats
from jlora.adapters.slots import LoRASlots
from jlora.engine.config import EngineConfig
from jlora.engine.kv_plan import shape_bytes

QV = ("q_proj", "v_proj")
SIZES = dict(max_model_len=128, max_num_seqs=4, max_num_batched_tokens=32, token_buckets=(16, 32), max_loras=2,
             max_lora_rank=8, progress=False, weights_cache=False, adapter_cache=False)
PROMPTS = [[1, 520, 2136, 314], [1, 5093, 2474, 253, 655], [1, 33, 216, 34, 216, 35], [1, 378, 2365, 314, 1082]]
QV_ADAPTERS = (0, 4, 8, 12)  # tiny_adapters[i] with i % 4 == 0 target q_proj, v_proj
NEW = 8


@pytest.fixture(scope="module")
def qv_llm(tiny_dir):
    llm = LLM(str(tiny_dir[0]), lora_target_modules=QV, **SIZES)
    yield llm
    llm.close()


def _peft_greedy(model, adapters, ids: list[int], which: int | None) -> list[int]:
    """NEW greedy tokens from the torch model with peft adapter `which` (None: adapters off)."""
    out = list(ids)
    with torch.no_grad():
        for _ in range(NEW):
            x = torch.tensor([out])
            if which is None:
                with adapters.disable_adapter():
                    logits = adapters(input_ids=x).logits
            else:
                adapters.set_adapter(f"a{which}")
                logits = adapters(input_ids=x).logits
            out.append(int(logits[0, -1].argmax()))
    return out[len(ids):]


def test_qv_slots_give_peft_tokens_in_a_mixed_batch(qv_llm, tiny_dir, tiny_adapters):
    _, model = tiny_dir
    pm = peft.PeftModel.from_pretrained(copy.deepcopy(model), tiny_adapters[0], adapter_name="a0").eval()
    for i in QV_ADAPTERS[1:]:
        pm.load_adapter(tiny_adapters[i], adapter_name=f"a{i}")
    rows = [0, None, 4, 8, None, 12]  # adapters over two slots, with base rows
    prompts = [PROMPTS[k % len(PROMPTS)] for k in range(len(rows))]
    loras = [None if i is None else LoRARequest(f"a{i}", 1 + i, str(tiny_adapters[i])) for i in rows]
    greedy = SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True)
    got = [o.outputs[0].token_ids for o in qv_llm.generate(prompts, greedy, loras)]
    want = [_peft_greedy(model, pm, p, i) for p, i in zip(prompts, rows)]
    assert got == want
    assert len({tuple(t) for t in got}) > 2  # the adapters change the tokens


def test_slots_hold_only_the_qkv_projection_and_shrink_as_computed(qv_llm, tiny_dir):
    state = qv_llm.engine.runner.lora_state
    assert sorted(state) == ["qkv_proj"]
    assert state["qkv_proj"]["A"].shape == (2, 2, 64, 3 * 8) and state["qkv_proj"]["B"].shape == (2, 2, 8, 128)
    report = qv_llm.memory_report(print_table=False)["lora_slots"]
    assert report["modules"] == ["q_proj", "k_proj", "v_proj"]
    # per layer and slot, float32: qkv A 64 x 24 + B 8 x 128 (q 64 + k 32 + v 32) = 2,560 values
    hf = tiny_dir[1].config.to_dict()
    want = shape_bytes(hf, 4, max_loras=2, rank=8, target_modules=QV)["lora_slots"]
    assert report["bytes"] == 2 * 2 * 2560 * 4 == want
    # every module: + o 64x8 + 8x64, gate|up 64x16 + 8x256, down 128x8 + 8x64 = 8,192 values
    assert shape_bytes(hf, 4, max_loras=2, rank=8)["lora_slots"] == 2 * 2 * 8192 * 4
    assert shape_bytes(hf, 4, max_loras=2, rank=8, target_modules=("o_proj", "up_proj"), dora=True)["lora_slots"] \
        == 2 * 2 * ((1024 + 3072) * 4 + (64 + 256) * 4)


def test_an_adapter_on_other_modules_is_refused_and_the_engine_serves_on(qv_llm, tiny_adapters):
    greedy = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    ok = LoRARequest("a4", 5, str(tiny_adapters[4]))
    want = qv_llm.generate([PROMPTS[0]], greedy, ok)[0].outputs[0].token_ids
    for i, named in ((3, r"\['o_proj', 'up_proj'\]"), (1, r"\['down_proj', 'gate_proj', 'o_proj', 'up_proj'\]")):
        with pytest.raises(ValueError, match=rf"targets modules {named} that this engine's LoRA state does not hold "
                                             r"\(it holds \['q_proj', 'k_proj', 'v_proj'\]\): the engine option "
                                             r"lora_target_modules .*--lora-target-modules"):
            qv_llm.generate([PROMPTS[0]], greedy, LoRARequest(f"bad{i}", 100 + i, str(tiny_adapters[i])))
    assert not {"bad1", "bad3"} & set(qv_llm.engine.adapters.list_adapters())
    assert qv_llm.generate([PROMPTS[0], PROMPTS[1]], greedy, [ok, None])[0].outputs[0].token_ids == want


def test_adapter_churn_compiles_nothing_after_warm_up(qv_llm, tiny_adapters):
    loras = [LoRARequest(f"a{i}", 1 + i, str(tiny_adapters[i])) for i in QV_ADAPTERS]
    greedy = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    before = compile_stats.compile_count()
    for k in range(3):  # four adapters through two slots, three times over
        qv_llm.generate(PROMPTS, greedy, [loras[(j + k) % 4] for j in range(4)])
    assert compile_stats.compile_count() == before


@pytest.mark.parametrize("value, msg", [
    (("q_proj", "x_proj"), r"unknown modules \['x_proj'\]; known: \['q_proj', 'k_proj', 'v_proj', 'o_proj', "
                           r"'gate_proj', 'up_proj', 'down_proj'\]"),
    ("q_proj", r"must be None or a sequence of module names, got 'q_proj'; known: \['q_proj'"),
    ((), r"no module named; known: \['q_proj'"),
    (("lm_head",), r"names \['lm_head'\]: .*enable_embedding_lora=True"),
    ((1,), "must be None or a sequence of module names"),
])
def test_bad_option_values_are_refused(value, msg):
    with pytest.raises(ValueError, match=r"EngineConfig\.lora_target_modules.*" + msg):
        EngineConfig(lora_target_modules=value)


def test_option_values_normalize_and_compose_with_vocab_and_dora_slots():
    c = EngineConfig(lora_target_modules=["v_proj", "q_proj", "q_proj"])
    assert c.lora_target_modules == QV and c.lora_modules == ("q_proj", "k_proj", "v_proj")
    assert EngineConfig(lora_target_modules=("q_proj", "o_proj", "gate_proj", "down_proj")).lora_target_modules is None
    assert EngineConfig().lora_modules == EngineConfig(lora_target_modules=None).lora_modules
    both = EngineConfig(lora_target_modules=("up_proj",), enable_embedding_lora=True, enable_dora=True,
                        max_loras=2, max_lora_rank=8, lora_slot_ranks=(4, 8))
    assert both.lora_modules == ("gate_proj", "up_proj", "embed_tokens", "lm_head")
    from jlora.models.config import LlamaConfig

    cfg = LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=16)
    slots = LoRASlots(cfg, 2, 8, slot_ranks=both.slot_ranks, modules=both.lora_modules, dora=True)
    pools = slots.state if isinstance(slots.state, tuple) else (slots.state,)
    assert len(pools) == 2
    for pool in pools:
        assert sorted(pool) == ["embed_tokens", "gate_up_proj", "lm_head"]
        assert sorted(pool["gate_up_proj"]) == ["A", "B", "M"] and sorted(pool["lm_head"]) == ["A", "B"]


def test_cli_flag_reaches_llm_from_generate_and_serve(cli_llm_kwargs):
    from jlora import cli

    generate, serve = cli_llm_kwargs
    assert generate(["--lora-target-modules", "q_proj,v_proj"])["lora_target_modules"] == QV
    assert serve(["--lora-target-modules", "v_proj, q_proj"])["lora_target_modules"] == QV
    assert generate([])["lora_target_modules"] is None
    p = cli.build_parser()
    assert p.parse_args(["demo", "--lora-target-modules", "down_proj"]).lora_target_modules == ("down_proj",)
    with pytest.raises(SystemExit):
        p.parse_args(["serve", "--lora-target-modules", "q_proj,wq"])
    from jlora.bench import adapters as bench_adapters
    from jlora.bench.tpu.cli import parse_args as tpu_args

    assert tpu_args(["--sections", "slora", "--lora-target-modules", "q_proj,v_proj"]).lora_target_modules == QV
    for parse in (tpu_args, bench_adapters.main):  # refused before anything runs
        with pytest.raises(SystemExit):
            parse(["--lora-target-modules", "wq"])


def test_chip_check_holds_an_engine_to_the_check_adapters_it_serves(tiny_dir, tmp_path):
    from jlora.bench.chip_check import _engine_item
    from jlora.models.loading import read_model_config

    cfg = read_model_config(tiny_dir[0])
    every = _engine_item(EngineConfig(max_lora_rank=16), cfg, tiny_dir[0], tmp_path, None)[0]["adapters"]
    qv = _engine_item(EngineConfig(max_lora_rank=16, lora_target_modules=QV), cfg, tiny_dir[0], tmp_path, None)[0]
    assert len(every) == 5 and [Path(a).name for a in qv["adapters"]] == ["qv-r8"]


@pytest.mark.slow  # three engines in a subprocess with 2 forced CPU devices, ~2 min
def test_qv_slots_match_every_module_slots_with_dora_ranks_and_tensor_parallel(tiny_dir, tiny_adapters):
    worker = Path(__file__).with_name("targets_worker.py")
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).resolve().parents[1]), env.get("PYTHONPATH", "")])
    argv = [sys.executable, str(worker), str(tiny_dir[0]), *(str(tiny_adapters[i]) for i in QV_ADAPTERS)]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=900, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    assert r["default"]["modules"] == ["down_proj", "gate_up_proj", "o_proj", "qkv_proj"]
    assert r["qv"]["modules"] == r["qv_tp"]["modules"] == ["qkv_proj"]
    assert r["qv"]["tokens"] == r["default"]["tokens"] == r["qv_tp"]["tokens"]
    worst = max(abs(a[t] - b[t]) for name in ("qv", "qv_tp")
                for sa, sb in zip(r[name]["logprobs"], r["default"]["logprobs"])
                for a, b in zip(sa, sb) for t in a.keys() & b.keys())
    assert worst <= 1e-4
    assert r["qv"]["compiles"] == r["qv_tp"]["compiles"] == 0


def test_server_refuses_such_an_adapter_with_400_naming_lora_path(qv_llm, tiny_adapters, tmp_path):
    import httpx

    from jlora.server.app import build_app
    from live import serve_live

    for name in qv_llm.engine.adapters.list_adapters():  # the server numbers its adapters from 1
        qv_llm.engine.adapters.unload(name)
    for i in (3, 12):
        shutil.copytree(tiny_adapters[i], tmp_path / f"a{i}")
    app = build_app(qv_llm, "tiny", enable_runtime_lora_updating=True, lora_root=tmp_path)
    with serve_live(qv_llm, app) as live:
        with httpx.Client(base_url=live.base_url, timeout=60) as http:
            bad = http.post("/v1/load_lora_adapter", json={"lora_name": "o", "lora_path": "a3"})
            assert bad.status_code == 400, bad.text
            err = bad.json()["error"]
            assert err["param"] == "lora_path" and "lora_target_modules" in err["message"] \
                and "'o_proj'" in err["message"]
            assert http.post("/v1/load_lora_adapter", json={"lora_name": "qv", "lora_path": "a12"}).status_code == 200
            out = http.post("/v1/completions", json={"model": "qv", "prompt": "Hello", "max_tokens": 3,
                                                     "temperature": 0})
            assert out.status_code == 200, out.text
