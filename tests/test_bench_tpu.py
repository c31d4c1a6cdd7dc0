"""`jlora bench tpu` (jlora/bench/tpu/) on the CPU: the memory arithmetic that sizes the 8B's KV
cache against the arrays jlora really builds, the random checkpoint as a real HF checkpoint, how
sections are cut into processes, and (slow) a dry run of every section at the tiny shape."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jlora.bench.tpu import cli, common, micro, startup, workloads
from jlora.bench.tpu import shapes as tpu_shapes
from jlora.engine import kv_plan as kvp

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def shapes(monkeypatch):
    """The bench's shapes plus an untied tiny one (the 8B's head layout at the tiny size)."""
    monkeypatch.setitem(tpu_shapes.SHAPES, "tiny-untied", {**tpu_shapes.SHAPES["tiny"], "tie_word_embeddings": False,
                                                    "num_key_value_heads": 1, "vocab_size": 384})
    return tpu_shapes.SHAPES


@pytest.mark.parametrize("shape", ["tiny", "tiny-untied"])
@pytest.mark.parametrize("quantization", ["none", "int8-weight-only"])
def test_shape_bytes_are_what_the_loader_builds(shapes, tmp_path, shape, quantization):
    from jlora.models.llama import init_cache, init_lora_state
    from jlora.models.loading import load_model

    path = tmp_path / shape
    tpu_shapes.write_checkpoint(path, shape)
    model, _, _ = load_model(path, jnp.bfloat16, quantization=None if quantization == "none" else quantization)
    leaves = jax.tree_util.tree_flatten_with_path(nnx.state(model, nnx.Param))[0]
    got = sum(int(x.nbytes) for _, x in leaves) + int(model.inv_freq[...].nbytes)
    embed = sum(int(x.nbytes) for p, x in leaves if "embed_tokens" in jax.tree_util.keystr(p))
    want = tpu_shapes.shape_bytes(shapes[shape], 2, quantization, max_loras=3, rank=8)
    assert got == want["weights"]
    assert want["embedding"] == embed
    untied = not shapes[shape]["tie_word_embeddings"]
    assert want["weights_read_per_step"] == got - (embed if untied else 0)
    from jlora.models.config import LORA_MODULES, VOCAB_MODULES

    for dora, vocab in ((False, False), (True, False), (False, True), (True, True)):  # enable_dora, _embedding_lora
        lora = jax.eval_shape(lambda: init_lora_state(model.cfg, 3, 8, jnp.bfloat16, dora=dora,
                                                      modules=LORA_MODULES + (VOCAB_MODULES if vocab else ())))
        got_slots = tpu_shapes.shape_bytes(shapes[shape], 2, quantization, max_loras=3, rank=8, dora=dora,
                                           embedding_lora=vocab)["lora_slots"]
        assert got_slots == sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(lora)), (dora, vocab)
    assert want["lora_slots"] < got_slots  # the defaults count neither
    cache = jax.eval_shape(lambda: init_cache(model.cfg, 1, 1, jnp.bfloat16))
    assert want["kv_per_token"] == sum(x.size * x.dtype.itemsize for x in cache.values())


def test_kv_plan_sizes_the_8b_on_one_v5e():
    cfg = tpu_shapes.SHAPES["llama-3.1-8b"]
    b = tpu_shapes.shape_bytes(cfg, 2, "int8")
    assert 8.5e9 < b["weights"] < 8.6e9  # int8 projections and head, bf16 embedding (1.05 GB)
    assert 7.4e9 < b["weights_read_per_step"] < 7.6e9  # a decode step reads the embedding's rows only
    assert b["kv_per_token"] == 131072
    plan = kvp.kv_plan(cfg, "int8", 2048, 16, 4, 16, common.HBM_BYTES)
    # 16.91 GB - 8.56 GB of weights - 0.34 GB of slots - 2 GB headroom = 6.0 GB: 22 sequences of 2048.
    assert plan["max_num_seqs"] == 22 and plan["num_kv_blocks"] == 22 * 128
    assert plan["kv_bytes"] + b["weights"] + b["lora_slots"] + plan["headroom"] <= common.HBM_BYTES
    assert kvp.kv_plan(cfg, "int8", 2048, 16, 4, 16, common.HBM_BYTES, in_use=10**9)["max_num_seqs"] < 22
    with pytest.raises(ValueError, match=r"not one 2048-token sequence fits.*weights 16.06 GB \(none\)"):
        kvp.kv_plan(cfg, "none", 2048, 16, 4, 16, common.HBM_BYTES)  # bf16 8B: 16 GB of weights
    assert kvp.kv_plan(tpu_shapes.SHAPES["llama-3.2-1b"], "none", 2048, 16, 4, 16, common.HBM_BYTES)["max_num_seqs"] == 64


def test_random_checkpoint_is_a_real_bf16_hf_checkpoint(tmp_path):
    import ml_dtypes
    from safetensors.numpy import load_file

    from jlora.models.loading import open_hf_checkpoint
    from jlora.tokenizer import load_hf_tokenizer

    path = tmp_path / "ckpt"
    seconds = tpu_shapes.write_checkpoint(path, "tiny")
    assert seconds > 0 and not list(path.glob("*.tmp"))
    seen = {}
    for shard in sorted(path.glob("*.safetensors")):
        seen.update(load_file(str(shard)))  # the safetensors library itself reads every shard
    cfg, tensors = open_hf_checkpoint(path)
    assert set(seen) == set(tensors)
    assert cfg.num_hidden_layers == 2 and cfg.tie_word_embeddings
    for name, arr in seen.items():
        assert arr.dtype == ml_dtypes.bfloat16 and tuple(arr.shape) == tuple(tensors[name].shape)
    w = seen["model.layers.1.mlp.down_proj.weight"].astype(np.float32)
    assert 0.015 < w.std() < 0.025
    # fill="pool": runs of one pool of draws (the same values at another offset), not copies of one tensor
    q = seen["model.layers.1.self_attn.q_proj.weight"].astype(np.float32)
    assert not np.array_equal(q.reshape(-1)[:100], w.reshape(-1)[:100])
    np.testing.assert_array_equal(seen["model.norm.weight"].astype(np.float32), 1.0)
    assert load_hf_tokenizer(path).decode([5, 6]) == "w5 w6"


def test_sections_are_cut_into_processes():
    plan = cli.plan_processes
    assert plan(["checkpoint", "load", "qmatmul", "agree", "engine", "warm"]) == \
        [["checkpoint"], ["load"], ["qmatmul", "agree", "engine"], ["warm"]]
    # Nothing runs after the engine in its process; warm always alone.
    assert plan(["engine", "agree", "warm", "warm"]) == [["engine"], ["agree"], ["warm"], ["warm"]]
    assert plan(["kernel", "engine"]) == [["kernel", "engine"]]
    argv = ["--shape", "tiny", "--sections", "a,b", "--in-process", "--sections=x", "--out", "o"]
    assert cli._argv_without(argv, ("--sections",)) == ["--shape", "tiny", "--out", "o"]
    with pytest.raises(SystemExit):
        cli.parse_args(["--sections", "checkpoint,bogus"])


def test_engine_sizes_for_the_8b_compile_two_step_graphs():
    from jlora.engine.config import EngineConfig

    args = cli.parse_args(["--shape", "llama-3.1-8b", "--quantization", "int8", "--max-num-seqs", "22"])
    sizes = workloads.engine_sizes(args)
    assert sizes["token_buckets"] == (512,) and sizes["decode_row_buckets"] == (22,)
    cfg = EngineConfig(max_model_len=2048, max_num_seqs=22, max_num_batched_tokens=sizes["max_num_batched_tokens"],
                       token_buckets=sizes["token_buckets"], decode_row_buckets=sizes["decode_row_buckets"])
    assert cfg.step_shapes() == ((22, 0, 0), (22, 1, 512))
    one_b = workloads.engine_sizes(cli.parse_args(["--max-num-seqs", "64"]))
    assert one_b["token_buckets"] == (32, 128, 1024) and one_b["decode_row_buckets"] == (1, 64)


@pytest.mark.slow  # every section in fresh processes at the tiny shape: ~60 s on 2 cores
def test_dry_run_of_every_section_on_the_cpu(tmp_path):
    out = tmp_path / "out"
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "JLORA_CACHE_DIR": str(tmp_path / "xla"),
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    env.pop("XLA_FLAGS", None)
    cmd = [sys.executable, "-m", "jlora.bench.tpu", "--shape", "tiny", "--dir", str(tmp_path / "d"), "--out", str(out),
           "--sections", "checkpoint,load,qmatmul,agree,engine,warm", "--quantization", "int8",
           "--workloads", "11", "--max-num-seqs", "auto", "--max-seqs-cap", "3", "--token-buckets", "128",
           "--max-num-batched-tokens", "128", "--qmatmul-rows", "4", "--agree-shape", "tiny", "--quick",
           "--lora-slices", "before", "--base-graphs", "decode", "--prefill-slack", "off,0.05", "--sample-stacks",
           "--repeats", "2"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    r = json.loads((out / "results.json").read_text())
    run = r["tiny/int8"]
    for mode in ("cold", "warm"):
        load = run["load"][mode]
        assert load["source"] == "weights_cache" and load["peak_added_bytes"] > 0
        assert load["numpy_heap_peak_added_bytes"] > 0 or mode == "warm"  # cold quantizes on the host
        assert load["device_bytes"] == tpu_shapes.shape_bytes(tpu_shapes.SHAPES["tiny"], 2, "int8")["weights"] - 64
        assert set(load["device_bytes_by_dtype"]) == {"int8", "float32", "uint16"}  # no float copy of a projection
    eng = run["engine"]
    assert eng["quantization"] == "int8" and eng["activations"] == "int8" and eng["max_num_seqs"] == 3
    assert eng["block_size"] == 128  # the TPU's automatic size at max_model_len 2048, as the chip would run it
    assert eng["compiles_after_warmup"] == 0 and eng["whole_cache_copies"] == [] and eng["whole_weight_copies"] == []
    # The engine's own check against a CPU process came before its timed rows, every graph run.
    assert eng["check"]["passed"] and eng["check"]["graphs_not_run"] == [] and eng["check"]["rows_equal"] > 0
    assert eng["check"]["reference_started_early"]  # planned before LLM() from the config it then built
    assert eng["lora_slices"] == "before" and eng["adapter_first_load_s"] > 0  # adapters loaded before the timing
    # two rounds of the workload under each prefill policy, folded per workload (no adapter-free run: no cost)
    assert [w["rounds"] for w in eng["repeat_summary"]["workloads"].values()] == [2, 2]
    assert eng["repeat_summary"]["lora_cost"] == {}
    # Ready, a first request served, then every graph before the timed workloads (the CPU's eager
    # warm-up: the background one is tested without the compile cache, tests/test_startup.py).
    assert eng["warmup_mode"] == run["warm"]["warmup_mode"] == "eager"
    assert eng["first_request_s"] > 0 and eng["all_graphs_s"] >= eng["start_s"] > 0
    # decode rows 1 and 3, each with and without LoRA, and one prefill shape
    assert eng["base_graphs"] == "decode" and eng["graphs"] == 5
    assert set(eng["compile_seconds"]["graphs"]) == {"(1, 0, 0)", "(1, 0, 0) base", "(3, 0, 0)", "(3, 0, 0) base",
                                                     "(3, 1, 128)"}
    assert [(row["prefill_slack"], row["round"]) for row in run["workloads"]] == [
        (None, 0), (None, 1), (0.05, 0), (0.05, 1)]  # two rounds per policy
    for row in run["workloads"]:
        assert row["quantization"] == "int8" and row["requests"] == 3 and row["generated"] == 3 * 256
    assert run["warm"]["weights_cache_hit"] is True and run["warm"]["compiles"] == run["warm"]["cache_hits"]
    # The engine section's sizes were there: the timed LLM() started the backend itself. The warm
    # start's stacks were sampled (the MainThread through LLM()).
    assert run["warm"]["runtime_before_llm_s"] is None
    stacks = json.loads((out / "warm_stacks_tiny_int8.json").read_text())
    assert stacks["samples"] > 10 and any("llm.py" in f for f, _ in stacks["on_stack"]["MainThread"])
    assert {q["mode"] for q in r["qmatmul"]["tiny"]} == set(micro.QMATMUL_MODES) and "errors" not in r["qmatmul"]["tiny"][0]
    assert r["agree"]["tiny"]["int8"]["top1"] > 0.9 and r["agree"]["tiny"]["int8-weight-only"]["top1"] > 0.9
    assert "errors" not in r


@pytest.mark.slow  # a checkpoint and one warm LLM() at the tiny shape: ~20 s on 2 cores
def test_warm_section_says_when_sizing_started_the_runtime_before_llm(tmp_path):
    """Without an engine section's sizes, `--max-num-seqs auto` asks the device for its memory before
    the timed LLM(): the result records that start instead of hiding it."""
    out = tmp_path / "out"
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "JLORA_CACHE_DIR": str(tmp_path / "xla"),
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    env.pop("XLA_FLAGS", None)
    cmd = [sys.executable, "-m", "jlora.bench.tpu", "--shape", "tiny", "--dir", str(tmp_path / "d"), "--out", str(out),
           "--sections", "checkpoint,warm", "--max-num-seqs", "auto", "--max-seqs-cap", "2", "--token-buckets", "128",
           "--max-num-batched-tokens", "128"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-3000:]
    warm = json.loads((out / "results.json").read_text())["tiny/none"]["warm"]
    assert warm["runtime_before_llm_s"] > 0 and warm["runtime_start_s"] == 0.0
    assert "the runtime was started before LLM()" in proc.stdout


@pytest.mark.slow  # every LoRA variant of the layer stack compiled and timed, ~30 s
def test_layer_stack_bench_times_every_lora_variant():
    """`--sections layers`: each token count with no slots, slots without adapter tokens, and 4 mixed
    adapters with and without the LoRA conditionals (each a positive time)."""
    rows = micro.bench_layers(tpu_shapes.SHAPES["tiny"], tokens=(1, 70), reps=1)
    cases = {("none", None), ("off", "skip"), ("mixed", "skip"), ("mixed", "all")}
    assert {(r["tokens"], r["lora"], r["cond"]) for r in rows} == {(t, *c) for t in (1, 70) for c in cases}
    assert all(r["us"] > 0 for r in rows) and {r["lora_cond"] for r in rows} == {"pass"}


def test_tuning_flags_make_the_engines_options():
    """`--lora-slices` / `--lora-cond` / `--attn-*` become the engine's TuningOptions (passed to LLM(),
    no module global set); "auto" keeps the library's default; bad values are refused."""
    from jlora.tuning import AttentionOptions, TuningOptions

    got = common.tuning_options(cli.parse_args(["--lora-slices", "before", "--lora-cond", "inside",
                                             "--attn-seqs-per-program", "8", "--attn-prefill-step", "128",
                                             "--attn-prefill-round", "384", "--attn-block-rows", "128"]))
    assert got == TuningOptions(lora_slices="before", lora_cond="inside", attention=AttentionOptions(
        seqs_per_program=8, prefill_step=128, prefill_round=384, max_block_rows=128))
    assert common.tuning_options(cli.parse_args([])) == TuningOptions()
    assert common.tuning_options(cli.parse_args(["--attn-prefill-round", "0"])).attention.prefill_round == 0
    with pytest.raises(SystemExit, match="max_block_rows"):
        common.tuning_options(cli.parse_args(["--attn-block-rows", "0"]))
    with pytest.raises(SystemExit):
        cli.parse_args(["--lora-cond", "outside"])
    with pytest.raises(SystemExit):
        cli.parse_args(["--attn-prefill-step", "many"])
    with pytest.raises(SystemExit):
        cli.parse_args(["--attn-prefill-round", "some"])
    assert cli.parse_args(["--kernel-impls", "pallas"]).kernel_impls == ("pallas",)
    assert cli.parse_args(["--warmup", "eager"]).warmup == "eager"
    assert cli.parse_args(["--executable-cache", "off"]).executable_cache == "off"
    assert cli.parse_args([]).executable_cache == "auto"


def test_a_disk_too_small_for_the_run_moves_it_to_dev_shm(tmp_path, monkeypatch):
    import collections

    usage = collections.namedtuple("usage", "total used free")
    args = cli.parse_args(["--shape", "llama-3.1-8b", "--quantization", "int8", "--dir", str(tmp_path / "bench")])
    sections = ["checkpoint", "load", "engine", "agree"]
    need = cli.disk_needed(args, sections)
    assert 27.7e9 < need < 27.8e9  # 16.06 GB checkpoint + 8.56 GB int8 cache + 2.15 GB for the 1B + 1 GB spare
    free = {str(tmp_path / "bench"): 20e9, "/dev/shm": 30e9}
    monkeypatch.setattr(cli.shutil, "disk_usage", lambda p: usage(0, 0, free[str(p)]))
    assert cli.pick_dir(args, sections) == "/dev/shm/bench"
    free["/dev/shm"] = 1e9
    assert cli.pick_dir(args, sections) == str(tmp_path / "bench")  # nowhere better: a warning, the same dir


def test_a_kernel_out_of_vmem_is_not_an_hbm_oom():
    """The 8B's first chip run: the attention kernel ran out of scoped VMEM at compile time, and the
    bench took it for HBM and retried with fewer sequences three times. A VMEM failure goes to the
    XLA attention instead; an HBM one still shrinks the batch."""
    vmem = RuntimeError("RESOURCE_EXHAUSTED: E1001: CompileTimeScopedVmemOom: Ran out of memory in memory space vmem")
    hbm = RuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate 6.1G in memory space hbm")
    assert not common.is_oom(vmem) and common.is_oom(hbm)


@pytest.mark.slow  # eight matmul variants compiled and timed
def test_qmatmul_rows_are_kept_as_measured():
    """A chip call's limit can stop the section midway: each row is in `out` (and saved by
    `on_row`) as soon as it is measured."""
    saved: list[int] = []
    kept: list[dict] = []
    got = micro.bench_qmatmul(tpu_shapes.SHAPES["tiny"], (2,), reps=2, modes=("bf16", "w8a8"), out=kept,
                            on_row=lambda: saved.append(len(kept)))
    assert got is kept and saved == [1, 2, 3, 4, 5, 6, 7, 8]
    assert [(r["proj"], r["mode"]) for r in kept[:2]] == [("qkv_proj", "bf16"), ("qkv_proj", "w8a8")]
    assert all(r["us"] > 0 and "error" not in r for r in kept)


@pytest.mark.slow  # the interpreted attention kernel and the XLA one, compiled and timed
def test_kernel_rows_name_their_page_chunk_and_knobs():
    """Each kernel row says which page size, chunk and knobs it measured (results.json used to
    leave the variants to the order of the log)."""
    got = micro.bench_kernel(tpu_shapes.SHAPES["tiny"], 2, 64, 1, reps=2, block_size=16, chunk=32,
                           kernel_opts={"bounds_checks": False})
    assert [(r["impl"], r["block_size"], r["chunk"], r.get("kernel_opts")) for r in got] == [
        ("pallas", 16, 32, {"bounds_checks": False}), ("xla", 16, 32, None)]
    assert all(r["us"] > 0 and r["max_err"] < 1e-2 for r in got)


@pytest.mark.slow  # the interpreted attention kernel under the profiler
def test_kernel_profile_keeps_each_cases_device_ops(capsys):
    """`--kernel-profile`: one more loop per case under jax.profiler, its summary kept in the row and
    printed (XLA:CPU has no device plane, which the summary says; on a TPU it lists the ops)."""
    got = micro.bench_kernel(tpu_shapes.SHAPES["tiny"], 2, 64, 1, reps=2, block_size=16, chunk=32, impls=("pallas",),
                           profile=True)
    assert len(got) == 1
    summary = got[0]["profile"]  # not "no trace": the trace was written and read back
    assert summary == "no device plane" or "== /device:" in summary
    assert "== kernel profile pallas" in capsys.readouterr().out
    assert cli.parse_args(["--kernel-profile"]).kernel_profile and not cli.parse_args([]).kernel_profile


@pytest.mark.slow  # four fresh processes, 512 MB transfers
def test_runtime_section_times_the_backend_start_imports_and_transfers(tmp_path):
    """`--sections runtime` (here on the CPU): one fresh process per TPU_PREMAPPED_BUFFER_SIZE value
    with its start and a 512 MB transfer each way, then LLM()'s imports alone and beside the start."""
    args = cli.parse_args(["--sections", "runtime", "--premapped-sizes", "default,1073741824",
                           "--out", str(tmp_path)])
    rows = startup.bench_runtime(args, tmp_path, {})["runtime"]
    assert [(r["mode"], r["premapped"]) for r in rows] == [
        ("runtime", "default"), ("runtime", "1073741824"), ("imports", "default"), ("both", "default")]
    for r in rows[:2]:
        assert r["runtime_s"] > 0 and len(r["put_512mb_s"]) == 3 and r["get_512mb_s"] > 0
    assert rows[2]["imports_s"] > 0 and rows[3]["both_s"] >= rows[3]["imports_s"] > 0
    assert json.loads((tmp_path / "results.json").read_text())["runtime"] == rows
    assert cli.plan_processes(["checkpoint", "runtime", "engine"]) == [["checkpoint"], ["runtime"], ["engine"]]


def test_repeat_summary_pairs_each_round_with_its_own_adapter_free_run():
    """`--repeats`: per workload the median and range over rounds, and LoRA's cost taken round by
    round against the same round's adapter-free run (a slow round moves both sides)."""
    def row(adapters: int, tok_s: float, round_: int, new: int = 256) -> dict:
        name = f"64x(1024 in, {new} out), " + ("no adapter" if not adapters else f"{adapters} mixed adapters")
        return dict(workload=name, requests=64, prompt=1024, new=new, adapters=adapters, tok_s=tok_s, round=round_,
                    prefill_mxu_fraction=0.4 + round_ / 100, decode_ms_median=8.0 + round_, prefill_slack=0.05)

    rows = [row(0, 4400, 0), row(4, 4180, 0), row(0, 4000, 1), row(4, 3960, 1), row(0, 4500, 2), row(4, 4230, 2),
            row(4, 999, 0, new=512)]  # no adapter-free run of its own: no cost for it
    got = workloads.repeat_summary(rows)
    none = got["workloads"]["64x(1024 in, 256 out), no adapter"]
    assert (none["rounds"], none["tok_s_median"], none["tok_s_min"], none["tok_s_max"]) == (3, 4400, 4000, 4500)
    assert none["prefill_mxu_median"] == pytest.approx(0.41) and none["decode_ms_median"] == 9.0
    cost = got["lora_cost"]["64x(1024 in, 256 out), 4 mixed adapters"]
    assert cost["rounds"] == 3 and cost["median"] == pytest.approx(0.05)  # rounds: 5%, 1%, 6%
    assert cost["min"] == pytest.approx(0.01) and cost["max"] == pytest.approx(0.06)
    assert list(got["lora_cost"]) == ["64x(1024 in, 256 out), 4 mixed adapters"]
    text = workloads.format_repeat_summary(got)
    assert "LoRA's cost, 64x(1024 in, 256 out), 4 mixed adapters: 5.0% [1.0%, 6.0%]" in text
    assert cli.parse_args(["--repeats", "3"]).repeats == 3 and cli.parse_args([]).repeats == 1
    with pytest.raises(SystemExit):
        cli.parse_args(["--repeats", "0"])


def test_kv_cache_dtype_flag_sizes_and_builds_the_engine():
    """`--kv-cache-dtype int8`: --max-num-seqs auto sizes with int8's bytes a token (more sequences
    than the bf16 cache in the same memory), and the engine is built with it."""
    auto = workloads.engine_sizes(cli.parse_args(["--max-num-seqs", "auto", "--max-seqs-cap", "100000"]))
    args = cli.parse_args(["--max-num-seqs", "auto", "--max-seqs-cap", "100000", "--kv-cache-dtype", "int8"])
    int8 = workloads.engine_sizes(args)
    assert int8["plan"]["kv_per_token"] < 0.6 * auto["plan"]["kv_per_token"]
    assert int8["max_num_seqs"] > 1.7 * auto["max_num_seqs"]
    assert cli.parse_args([]).kv_cache_dtype == "auto"
    with pytest.raises(SystemExit):
        cli.parse_args(["--kv-cache-dtype", "int4"])
