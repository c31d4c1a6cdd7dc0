"""Tensor and data parallelism on forced CPU devices, and a two-process jax.distributed run.

JAX fixes its device count when it starts, so each case runs tests/parallel_worker.py in a
process of its own (XLA_FLAGS=--xla_force_host_platform_device_count=N) and these tests check
what it reports: greedy tokens equal to one device's with mixed adapters in every batch, logprobs
within 1e-4, 1/k of every sharded array per device, zero compiles while adapters churn through
the slots, requests routed to the replica holding their adapter, and clear errors.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

WORKER = Path(__file__).with_name("parallel_worker.py")
ROOT = Path(__file__).resolve().parents[1]
LOGPROB_TOL = 1e-4


def run_worker(*args: str, timeout: int = 900) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    proc = subprocess.run([sys.executable, str(WORKER), *args], capture_output=True, text=True, timeout=timeout,
                          env=env)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, f"worker {args[0]} failed (rc {proc.returncode}):\n{proc.stderr[-4000:]}"
    return json.loads(lines[-1][len("RESULT "):])


def max_logprob_diff(a: list, b: list) -> float:
    """Largest |logprob| difference over every generated position's shared top tokens."""
    worst = 0.0
    for seq_a, seq_b in zip(a, b, strict=True):
        for pos_a, pos_b in zip(seq_a, seq_b, strict=True):
            shared = set(pos_a) & set(pos_b)
            assert shared, "no top token in common"
            worst = max(worst, max(abs(pos_a[t] - pos_b[t]) for t in shared))
    return worst


@pytest.fixture(scope="module")
def tiny_result(tiny_dir, tiny_adapters):
    path, _ = tiny_dir
    return run_worker("tiny", str(path), *map(str, tiny_adapters[:4]))


TINY_RUNS = ["tp2_dp1", "tp4_dp1", "tp1_dp2", "tp2_dp2"]


@pytest.mark.slow  # the four-device worker: 11 engines in a process of their own, two step graphs each
def test_tiny_sees_four_devices(tiny_result):
    assert tiny_result["devices"] == 4


@pytest.mark.slow  # the four-device worker's result (its first use runs it)
@pytest.mark.parametrize("run", TINY_RUNS)
def test_tiny_parallel_tokens_and_logprobs_match_one_device(tiny_result, run):
    base, got = tiny_result["tp1_dp1"], tiny_result[run]
    assert len(got["tokens"]) == 16 and all(len(t) == 10 for t in got["tokens"])
    assert got["tokens"] == base["tokens"]
    assert max_logprob_diff(got["logprobs"], base["logprobs"]) <= LOGPROB_TOL


@pytest.mark.slow  # the four-device worker's result (its first use runs it)
@pytest.mark.parametrize("run", ["tp1_dp1", *TINY_RUNS])
def test_tiny_zero_compiles_while_adapters_churn(tiny_result, run):
    # 4 adapters (and the base model) over 2 slots: slots are rewritten throughout.
    assert tiny_result[run]["compiles_after_warmup"] == 0


@pytest.mark.slow  # the four-device worker's result (its first use runs it)
@pytest.mark.parametrize("run,tp", [("tp2_dp1", 2), ("tp4_dp1", 4), ("tp2_dp2", 2)])
def test_tiny_each_device_holds_its_shard(tiny_result, run, tp):
    shards = tiny_result[run]["shards"]
    sharded = {  # name suffix -> expected fraction on one device
        "w.layers.qkv_proj": 1 / tp, "w.layers.o_proj": 1 / tp, "w.layers.gate_up_proj": 1 / tp,
        "w.layers.down_proj": 1 / tp, "w.embed_tokens": 1 / tp, "w.lm_head": 1 / tp,
        "cache.k": 1 / tp, "cache.v": 1 / tp,
        "lora.qkv_proj.B": 1 / tp, "lora.gate_up_proj.B": 1 / tp, "lora.o_proj.A": 1 / tp, "lora.down_proj.A": 1 / tp,
        "lora.qkv_proj.A": 1.0, "lora.gate_up_proj.A": 1.0, "lora.o_proj.B": 1.0, "lora.down_proj.B": 1.0,
        "w.layers.input_layernorm": 1.0, "w.norm.weight": 1.0,
    }
    for replica in range(2 if run.endswith("dp2") else 1):
        for name, fraction in sharded.items():
            info = shards[f"{replica}:{name}"]
            assert info["fraction"] == pytest.approx(fraction), (replica, name, info)
            assert info["devices"] == tp and info["all_same_size"], (replica, name, info)


@pytest.mark.slow  # the four-device worker's result (its first use runs it)
@pytest.mark.parametrize("layout", ["int8", "bfloat16", "slot_ranks"])
def test_tiny_int8_bf16_and_ranked_slots_shard_too(tiny_result, layout):
    """int8 weights (q [L, out, in] + per-channel scales), bfloat16 (kept as bits on CPU) and slot
    pools of several ranks under TP = 2: the same tokens as their own one-device engine."""
    base, got = tiny_result[f"{layout}_tp1"], tiny_result[f"{layout}_tp2"]
    assert got["tokens"] == base["tokens"]
    assert got["compiles_after_warmup"] == 0
    # bf16 storage: different partial sums round differently. int8 (W8A8): the row-parallel
    # all-reduce adds f32 partial sums in another order, and an ulp of difference in a layer's
    # input can flip one activation's rounding to the int8 grid (a step of 1/127 of the row max),
    # measured up to 3e-3 in a logprob; float32 has no such amplifier and keeps 1e-4.
    tol = {"bfloat16": 2e-2, "int8": 1e-2}.get(layout, LOGPROB_TOL)
    assert max_logprob_diff(got["logprobs"], base["logprobs"]) <= tol
    shards = got["shards"]
    assert shards["0:w.layers.qkv_proj"]["fraction"] == pytest.approx(0.5)
    assert shards["0:cache.k"]["fraction"] == pytest.approx(0.5)
    if layout == "int8":
        assert shards["0:w.layers.qkv_proj_scale"]["fraction"] == pytest.approx(0.5)  # per output column
        assert shards["0:w.layers.down_proj_scale"]["fraction"] == 1.0  # row-parallel: whole
    if layout == "slot_ranks":
        for pool in range(3):  # every pool's B of a column-parallel module is split on its output
            assert shards[f"0:lora.{pool}.qkv_proj.B"]["fraction"] == pytest.approx(0.5)


@pytest.mark.slow  # the four-device worker's result (its first use runs it)
def test_tiny_memory_report_per_device(tiny_result):
    one = tiny_result["tp1_dp1"]["memory"]
    four = tiny_result["tp4_dp1"]["memory"]
    assert len(one["per_device"]) == 1 and len(four["per_device"]) == 4
    (single,) = one["per_device"].values()
    for row in four["per_device"].values():
        assert row["kv_cache"] * 2 == single["kv_cache"]  # 2 KV heads stored twice (4), one per device
        assert row["weights"] < single["weights"] / 3  # everything but the norms is split in 4
        assert row["total"] == row["weights"] + row["kv_cache"] + row["lora_slots"]
    two_replicas = tiny_result["tp1_dp2"]["memory"]["per_device"]
    assert len(two_replicas) == 2 and all(r["weights"] == single["weights"] for r in two_replicas.values())


@pytest.mark.slow  # the four-device worker's result (its first use runs it)
def test_tiny_data_parallel_routes_to_the_replica_holding_the_adapter(tiny_result):
    for run in ("tp1_dp2", "tp2_dp2"):
        routing = tiny_result[run]["routing"]
        assert routing, "no adapter resident after the run"
        assert {holder for holder, _ in routing} == {0, 1}  # both replicas served adapters
        for holder, chosen in routing:
            assert chosen == holder


@pytest.mark.slow  # the four-device worker's result (its first use runs it)
def test_tiny_bad_parallel_sizes_are_refused(tiny_result):
    assert "does not divide the model's 4 attention heads" in tiny_result["error_tp3_dp1"]
    assert "[1, 2, 4]" in tiny_result["error_tp3_dp1"]
    assert "needs 6 devices; JAX sees 4" in tiny_result["error_tp2_dp3"]
    assert "tensor_parallel_size must be a positive int" in tiny_result["error_tp0_dp1"]
    assert "data_parallel_size must be a positive int" in tiny_result["error_tp1_dp0"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow  # two worker processes, ~40 s
def test_two_processes_with_jax_distributed_match_one(tiny_dir, tiny_adapters, tiny_result):
    """TP = 2 across two processes (one CPU device each, gloo collectives) on localhost."""
    path, _ = tiny_dir
    port = str(free_port())
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    args = [str(path), *map(str, tiny_adapters[:4])]
    procs = [subprocess.Popen([sys.executable, str(WORKER), "distributed", port, str(pid), *args],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env) for pid in (0, 1)]
    results = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=600)
            lines = [ln for ln in out.splitlines() if ln.startswith("RESULT ")]
            assert p.returncode == 0 and lines, f"distributed worker failed (rc {p.returncode}):\n{err[-4000:]}"
            results.append(json.loads(lines[-1][len("RESULT "):]))
    finally:
        for p in procs:
            p.kill()
    base = tiny_result["tp1_dp1"]
    for pid, r in enumerate(results):
        assert (r["process"], r["devices"], r["local_devices"]) == (pid, 2, 1)
        assert r["tokens"] == base["tokens"]
        assert max_logprob_diff(r["logprobs"], base["logprobs"]) <= LOGPROB_TOL
        assert r["compiles_after_warmup"] == 0


@pytest.mark.slow  # a TP 2 x DP 2 engine and its server in a worker process
def test_openai_server_over_tensor_and_data_parallel_engines(tiny_dir, tiny_adapters):
    """The server over TP 2 x DP 2, live on 127.0.0.1: 16 concurrent openai-client completions with
    four adapters and the base model give the offline engine's text, and both replicas hold adapters."""
    path, _ = tiny_dir
    r = run_worker("serve", str(path), *map(str, tiny_adapters[:4]))
    assert len(r["texts"]) == 16 and all(r["texts"])
    assert r["texts"] == r["offline"]
    assert r["replicas_with_adapters"] == [0, 1]
    assert r["metrics_ok"]


def make_real_adapters(model, root: Path) -> list[Path]:
    """Three random peft adapters on the real default model (all-linear rank 8, q/v rank 4, k/gate rank 8)."""
    import torch
    from peft import LoraConfig, get_peft_model

    paths = []
    for i, (r, targets) in enumerate(((8, "all-linear"), (4, ["q_proj", "v_proj"]), (8, ["k_proj", "gate_proj"]))):
        torch.manual_seed(i)
        pm = get_peft_model(model, LoraConfig(r=r, lora_alpha=2 * r, target_modules=targets, init_lora_weights=False),
                            adapter_name=f"a{i}")
        for name, p in pm.named_parameters():
            if "lora_B" in name:
                torch.nn.init.normal_(p, std=0.02)
        pm.save_pretrained(root, selected_adapters=[f"a{i}"])
        pm.unload()  # the session's model again, as it was
        paths.append(root / f"a{i}")
    return paths


@pytest.fixture(scope="module")
def real_result(hf_real, tmp_path_factory):
    # The adapters come from the session's transformers model: the worker does not load the GGUF file again.
    adapters = make_real_adapters(hf_real[0], tmp_path_factory.mktemp("tp_real_adapters"))
    return run_worker("real", *map(str, adapters), timeout=1500)


@pytest.mark.slow  # the real default model at TP 1 and 3
def test_real_model_tp3_matches_one_device(real_result):
    """SmolLM2-135M: 9 query / 3 KV heads over 3 devices, three peft adapters and the base model mixed."""
    assert real_result["devices"] == 3
    base, got = real_result["tp1_dp1"], real_result["tp3_dp1"]
    assert got["tokens"] == base["tokens"]
    assert max_logprob_diff(got["logprobs"], base["logprobs"]) <= LOGPROB_TOL
    assert got["compiles_after_warmup"] == 0
    for name in ("w.layers.qkv_proj", "cache.k", "lora.qkv_proj.B", "lora.down_proj.A"):
        assert got["shards"][f"0:{name}"]["fraction"] == pytest.approx(1 / 3), name


@pytest.mark.slow  # shares the real-model worker above
def test_real_model_tp_that_does_not_divide_the_heads_is_refused(real_result):
    assert "tensor_parallel_size=2 does not divide the model's 9 attention heads" in real_result["error_tp2_dp1"]
    assert "[1, 3]" in real_result["error_tp2_dp1"]  # 9 query heads, 3 KV heads, intermediate 1536


# ---- the layout itself, in this process ---------------------------------------------------------------


def _cfg(heads: int, kv_heads: int, head_dim: int = 4, intermediate: int = 24):
    from jlora.models.config import LlamaConfig

    return LlamaConfig.from_hf_dict(dict(vocab_size=32, hidden_size=heads * head_dim, intermediate_size=intermediate,
                                         num_hidden_layers=1, num_attention_heads=heads,
                                         num_key_value_heads=kv_heads, head_dim=head_dim))


@pytest.mark.parametrize("heads,kv_heads,tp", [(4, 2, 1), (4, 2, 2), (4, 2, 4), (9, 3, 3), (8, 1, 4), (6, 6, 3)])
def test_shard_major_columns_split_back_to_the_logical_heads(heads, kv_heads, tp):
    """Columns stored shard-major, split per shard (`split_packed`), give each sub-module's logical
    columns, a KV head repeated where tp exceeds the KV heads; gate/up likewise."""
    import numpy as np

    from jlora.models.tensor_parallel import layout_config, packed_columns, split_packed

    cfg = _cfg(heads, kv_heads)
    lay = layout_config(cfg, tp)
    dh, kv = cfg.head_dim, max(kv_heads, tp)
    assert lay.num_key_value_heads == kv
    logical = np.arange(2 * 3 * (heads + 2 * kv_heads) * dh, dtype=np.float32).reshape(2 * 3, -1)  # [T, O]
    cols = packed_columns(cfg, tp, "qkv_proj")
    if tp == 1:
        assert (cols == np.arange(logical.shape[1])).all()
    q, k, v = split_packed(logical[:, cols], lay.packed_shapes()["qkv_proj"][1], tp)
    q_l, k_l, v_l = np.split(logical, [heads * dh, (heads + kv_heads) * dh], axis=1)
    assert (np.asarray(q) == q_l).all()
    repeat = np.arange(kv) * kv_heads // kv  # the logical KV head behind each stored one
    want_k = k_l.reshape(-1, kv_heads, dh)[:, repeat].reshape(k_l.shape[0], -1)
    assert (np.asarray(k) == want_k).all()
    assert (np.asarray(v) == v_l.reshape(-1, kv_heads, dh)[:, repeat].reshape(v_l.shape[0], -1)).all()
    # grouped-query attention: query head i reads stored KV head i // (H / KV), which repeats logical i // (H / KVH)
    assert all(repeat[i // (heads // kv)] == i // (heads // kv_heads) for i in range(heads))
    f = cfg.intermediate_size
    gu = np.arange(4 * 2 * f, dtype=np.float32).reshape(4, 2 * f)
    gate, up = split_packed(gu[:, packed_columns(cfg, tp, "gate_up_proj")], (f, f), tp)
    assert (np.asarray(gate) == gu[:, :f]).all() and (np.asarray(up) == gu[:, f:]).all()


@pytest.mark.parametrize("heads,kv_heads,intermediate,tp,msg", [
    (9, 3, 24, 2, "does not divide the model's 9 attention heads"),
    (8, 2, 24, 3, "does not divide the model's 8 attention heads"),
    (12, 4, 24, 6, "neither divides the model's 4 KV heads"),
    (4, 2, 30, 4, "does not divide the model's intermediate_size 30"),
    (4, 2, 24, 0, "must be a positive int"),
])
def test_tensor_parallel_sizes_that_cannot_shard_are_refused(heads, kv_heads, intermediate, tp, msg):
    from jlora.models.tensor_parallel import check_tensor_parallel

    with pytest.raises(ValueError, match=msg):
        check_tensor_parallel(_cfg(heads, kv_heads, intermediate=intermediate), tp)


def test_parallel_flags_reach_llm_from_generate_and_serve(cli_llm_kwargs):
    generate, serve = cli_llm_kwargs
    seen = generate(["--tensor-parallel-size", "3", "--data-parallel-size", "2"])
    assert seen["tensor_parallel_size"] == 3 and seen["data_parallel_size"] == 2
    kw = serve(["--tensor-parallel-size", "3", "--data-parallel-size", "2"])
    assert kw["tensor_parallel_size"] == 3 and kw["data_parallel_size"] == 2


# ---- the streaming loader onto the mesh (jlora.models.streaming) --------------------------------------

SHARDED_PARAMS = ("layers.qkv_proj", "layers.o_proj", "layers.gate_up_proj", "layers.down_proj", "embed_tokens",
                  "lm_head", "layers.qkv_proj_scale", "layers.gate_up_proj_scale", "lm_head_scale")


@pytest.mark.slow  # the four-device worker's result (its first use runs it)
@pytest.mark.parametrize("run", ["tp2_None", "tp4_None", "tp2_int8", "tp4_int8"])
def test_streaming_sends_each_device_only_its_shard(tiny_result, run):
    tp = int(run[2])
    got = tiny_result["stream"][run]
    seen = set()
    for key, layer_shape, read in got["reads"]:
        whole, part = int(np.prod(layer_shape)), int(np.prod(read))
        if key in SHARDED_PARAMS:
            assert part * tp == whole, (key, layer_shape, read)
            seen.add(key)
        else:  # norms, row-parallel scales: replicated, each device its own copy
            assert part == whole, (key, layer_shape, read)
    assert {"layers.qkv_proj", "layers.down_proj", "embed_tokens", "lm_head"} <= seen
    # Afterwards the mesh's devices hold the same bytes (no whole copy left on the first one), the
    # devices outside it nothing, and together the model's sharded bytes plus the replicated ones.
    held = list(got["held"].values())
    assert len(set(held[:tp])) == 1 and not any(held[tp:]), got["held"]
    assert got["model_bytes"] / tp < held[0] < got["model_bytes"] / tp * 1.2


@pytest.mark.slow  # the four-device worker's result (its first use runs it)
@pytest.mark.parametrize("run", ["tp2_dp1", "tp4_dp1"])
def test_one_engine_uses_the_arrays_streamed_onto_its_mesh(tiny_result, run):
    assert tiny_result[run]["preplaced"] == [True]
    # Data parallel: loaded onto the first device, which the first replica uses as it is; the others copy.
    assert tiny_result["tp1_dp2"]["preplaced"] == [True, False]
    assert tiny_result[run]["memory"]["host_load"]["peak_rss_bytes"] > 0
