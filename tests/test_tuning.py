"""TuningOptions (jlora.tuning): checked when made, held by EngineConfig, and read by each engine's
own step graph, so two engines in one process with other options build other graphs."""

from __future__ import annotations

import dataclasses

import pytest

from jlora.tuning import AttentionOptions, TuningOptions


def test_bad_options_are_named():
    for bad, match in ((dict(lora_slices="after"), "lora_slices"), (dict(lora_cond="outside"), "lora_cond"),
                       (dict(prefill_slack=1.5), "prefill_slack"), (dict(prefill_slack=True), "prefill_slack"),
                       (dict(attention={"prefill_round": 4}), "attention")):
        with pytest.raises(ValueError, match=match):
            TuningOptions(**bad)
    for bad, match in ((dict(max_block_rows=0), "max_block_rows"), (dict(seqs_per_program=None), "seqs_per_program"),
                       (dict(prefill_step=-1), "prefill_step"), (dict(bounds_checks=1), "bounds_checks")):
        with pytest.raises(ValueError, match=match):
            AttentionOptions(**bad)
    with pytest.raises(dataclasses.FrozenInstanceError):
        TuningOptions().lora_cond = "inside"  # type: ignore[misc]


def test_replace_routes_kernel_fields_and_cond_resolves_per_backend():
    t = TuningOptions().replace(lora_cond="inside", prefill_round=256, seqs_per_program=4)
    assert t.lora_cond == "inside" and t.attention == AttentionOptions(prefill_round=256, seqs_per_program=4)
    assert TuningOptions().resolved_lora_cond("tpu") == "inside" and TuningOptions().resolved_lora_cond("cpu") == "pass"
    assert t.resolved_lora_cond("cpu") == "inside"
    hash(t)  # a static argument of the kernel's jit


def test_engine_config_rejects_other_things_as_tuning():
    from jlora.engine.config import EngineConfig

    with pytest.raises(ValueError, match="EngineConfig.tuning"):
        EngineConfig(tuning={"lora_cond": "pass"})  # type: ignore[arg-type]


@pytest.mark.slow  # two engines that compile without the compile cache, ~30 s
def test_a_second_engine_with_other_options_builds_its_own_graph(tiny_dir):
    """Not a module global read at trace time: an engine made after another, in the same process,
    with other options, traces them (its step graph differs), its store key differs, and both serve
    the same tokens (the options change how the graph is built, not what it computes)."""
    from jlora import LLM, SamplingParams

    kw = dict(max_model_len=64, max_num_seqs=2, max_num_batched_tokens=32, max_loras=2, max_lora_rank=8,
              warmup=False, progress=False, use_compilation_cache=False, executable_cache=False, weights_cache=False)
    key = ((2, 1, 32), True)
    texts, tokens = {}, {}
    prompts = [{"prompt_token_ids": [5, 6, 7, 8, 9]}, {"prompt_token_ids": [11, 12, 13]}]
    for name, tuning in (("default", None), ("other", TuningOptions(lora_cond="inside", lora_slices="before"))):
        with LLM(str(tiny_dir[0]), tuning=tuning, **kw) as llm:
            assert llm.config.tuning == (tuning or TuningOptions())
            texts[name] = llm.engine.runner.lower(key).as_text()
            tokens[name] = [o.outputs[0].token_ids for o in
                            llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True),
                                         use_tqdm=False)]
    assert texts["default"] != texts["other"]
    # "inside": the base projection is computed in both branches of each LoRA conditional, so the
    # other graph holds more dot products.
    assert texts["other"].count("dot_general") > texts["default"].count("dot_general")
    assert tokens["default"] == tokens["other"]
