"""The serving step compiled for a TPU v5e chip on this CPU machine (libtpu's compile-only
topology, `jlora.bench.tpu_compile`): XLA:TPU's own layouts and fusions, checked without the chip.

The compiles run in a child process with libtpu on its path (`make install-test` puts it in
.venv/libtpu); where it is missing these tests are skipped, and say so."""

from __future__ import annotations

import json

import pytest

from jlora.bench import tpu_compile

needs_libtpu = pytest.mark.skipif(not (tpu_compile.LIBTPU_DIR / "libtpu").is_dir(),
                                  reason=f"libtpu is not installed in {tpu_compile.LIBTPU_DIR} (make install-test)")
# The tiny shape with 4 KV heads of 32: a cache row of 128 lanes, as at the 1B and 8B shapes.
LANE_ALIGNED = json.dumps({"num_attention_heads": 8, "num_key_value_heads": 4})


def test_weight_copies_are_found_in_hlo_text():
    shapes = {(128, 512), (256, 128)}
    hlo = "\n".join([
        "  %dynamic-slice_bitcast_fusion.14 = bf16[128,512]{1,0:T(8,128)(2,1)S(1)} fusion(bf16[2,128,512] %p, s32[] %i)",
        "  %copy.3 = bf16[256,128]{0,1:T(8,128)(2,1)} copy(bf16[256,128]{1,0} %w)",
        "  %convolution_fusion.2 = bf16[128,512]{1,0} fusion(bf16[64,128] %x, bf16[2,128,512] %p)",  # a matmul reading it
        "  %copy.4 = bf16[64,128]{1,0} copy(bf16[64,128]{0,1} %x)",  # not a weight's shape
    ])
    found = tpu_compile.weight_copies(hlo, shapes)
    assert [line.split(" =")[0] for line in found] == ["%dynamic-slice_bitcast_fusion.14", "%copy.3"]


@needs_libtpu
@pytest.mark.slow  # ~40 s on 2 cores: three step graphs compiled by XLA:TPU
def test_step_graphs_for_v5e_copy_neither_the_cache_nor_a_weight():
    """The TPU default (LoRA conditionals with the base projection inside their branches) in a
    prefill graph with adapters and in the decode graphs: no instruction copies the KV cache or a
    layer's weight."""
    report = tpu_compile.run_isolated(["--shape", "tiny", "--shape-overrides", LANE_ALIGNED,
                                       "--graphs", "64-1-1024-lora,64-0-0-lora,1-0-0-base"])
    assert report["lora_cond"] == "inside" and report["device"].startswith("TPU")
    assert sorted(g["graph"] for g in report["graphs"]) == ["1-0-0-base", "64-0-0-lora", "64-1-1024-lora"]
    for g in report["graphs"]:
        assert g["compile_s"] > 0
        assert g["whole_cache_copies"] == [], g["graph"]
        assert g["weight_copies"] == [], g["graph"]


@needs_libtpu
@pytest.mark.slow  # ~2.5 min on 2 cores: two LoRA step graphs compiled by XLA:TPU
@pytest.mark.parametrize("option", ["enable_dora", "enable_embedding_lora"])
def test_opt_in_lora_options_copy_neither_the_cache_nor_a_weight(option):
    """An engine with DoRA's factors (a multiply of every LoRA projection) or with the embedding /
    head LoRA conditionals: its LoRA graphs, prefill and decode, copy no KV cache and no weight."""
    report = tpu_compile.run_isolated(["--shape", "tiny", "--shape-overrides", LANE_ALIGNED,
                                       "--" + option.replace("_", "-"), "--graphs", "64-1-1024-lora,64-0-0-lora"])
    assert report["options"] == {o: o == option for o in tpu_compile.OPT_IN_OPTIONS}
    assert sorted(g["graph"] for g in report["graphs"]) == ["64-0-0-lora", "64-1-1024-lora"]
    for g in report["graphs"]:
        assert g["whole_cache_copies"] == [], g["graph"]
        assert g["weight_copies"] == [], g["graph"]


@needs_libtpu
@pytest.mark.slow
def test_default_model_shape_keeps_its_cache_layout_on_a_tpu():
    """SmolLM2-135M's cache rows are 3 KV heads x 64 = 192 lanes: XLA:TPU copied the whole cache
    into another layout around the step until the rows were padded to 256 (`cache_lanes`)."""
    report = tpu_compile.run_isolated(["--shape", "smollm2-135m", "--graphs", "1-0-0-base,64-1-32-lora"])
    assert report["cache_shape"][-1] == 256
    for g in report["graphs"]:
        assert g["whole_cache_copies"] == [], g["graph"]
        assert g["weight_copies"] == [], g["graph"]


def test_run_isolated_names_a_missing_libtpu(monkeypatch, tmp_path):
    monkeypatch.setattr(tpu_compile, "LIBTPU_DIR", tmp_path / "nowhere")
    with pytest.raises(FileNotFoundError, match="make install-test"):
        tpu_compile.run_isolated(["--shape", "tiny"])
