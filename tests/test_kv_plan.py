"""jlora.engine.kv_plan: what fits a device's memory, and LLM(kv_cache_memory_fraction=...)."""

from __future__ import annotations

import pytest

from jlora.engine import kv_plan


def test_fit_kv_blocks_takes_the_fraction_less_what_is_placed():
    # 16 GB x 0.9 - 9 GB in use - 0.4 GB of slots = 5 GB: 5e9 // 1 MB blocks
    assert kv_plan.fit_kv_blocks(16 * 10**9, 9 * 10**9, 0.9, 4 * 10**8, 10**6, 16) == 5000
    with pytest.raises(ValueError, match="kv_cache_memory_fraction=0.5.*one max_model_len sequence needs 16"):
        kv_plan.fit_kv_blocks(16 * 10**9, 9 * 10**9, 0.5, 0, 10**6, 16)


def test_llm_sizes_its_kv_cache_to_the_device_memory(tiny_dir, monkeypatch):
    """A device that reports its memory (as a TPU does; faked here): num_kv_blocks is what the fraction
    leaves after the placed weights and the slots, said at start-up. XLA:CPU reports none: the cache
    keeps max_num_seqs full-length sequences."""
    from jlora import LLM

    kw = dict(max_model_len=64, max_num_seqs=2, max_num_batched_tokens=32, max_loras=2, max_lora_rank=8,
              warmup=False, progress=False, use_compilation_cache=False, executable_cache=False, weights_cache=False)
    with LLM(str(tiny_dir[0]), kv_cache_memory_fraction=0.9, **kw) as llm:
        assert llm.kv_cache_plan["sized"] is False and llm.config.num_kv_blocks == 2 * 4  # 2 x 64 / 16
    monkeypatch.setattr(kv_plan, "device_memory", lambda device: {"bytes_limit": 10**8, "bytes_in_use": 2 * 10**7})
    with LLM(str(tiny_dir[0]), kv_cache_memory_fraction=0.5, **kw) as llm:
        plan = llm.kv_cache_plan
        # tiny model: 2 layers x 16 positions x 2 KV heads x 16 lanes x 4 bytes (float32), K and V
        assert plan["sized"] and plan["block_bytes"] == 2 * 2 * 16 * 32 * 4
        want = (5 * 10**7 - 2 * 10**7 - plan["lora_slots"]) // plan["block_bytes"]
        assert llm.config.num_kv_blocks == plan["num_kv_blocks"] == want
        assert llm.engine.runner.kv_cache_bytes == want * plan["block_bytes"]
        assert llm.engine.kv.num_free == want
    with pytest.raises(ValueError, match="num_kv_blocks or kv_cache_memory_fraction"):
        LLM(str(tiny_dir[0]), kv_cache_memory_fraction=0.5, num_kv_blocks=8, **kw)
    with pytest.raises(ValueError, match="kv_cache_memory_fraction"):
        LLM(str(tiny_dir[0]), kv_cache_memory_fraction=1.5, **kw)


def test_auto_sizes_the_cache_to_one_tpu_and_keeps_num_kv_blocks_elsewhere():
    from jlora.engine_args import TPU_KV_CACHE_MEMORY_FRACTION, engine_config

    assert engine_config(backend="tpu").kv_cache_memory_fraction == TPU_KV_CACHE_MEMORY_FRACTION == 0.8
    assert engine_config(backend="cpu").kv_cache_memory_fraction is None
    assert engine_config().kv_cache_memory_fraction is None  # no backend named: not a TPU
    # what the user sized, or several devices (the sizing reads one device's memory), keep num_kv_blocks
    assert engine_config(backend="tpu", num_kv_blocks=64).kv_cache_memory_fraction is None
    assert engine_config(backend="tpu", devices=4).kv_cache_memory_fraction is None
    assert engine_config(backend="cpu", kv_cache_memory_fraction=0.5).kv_cache_memory_fraction == 0.5
    assert engine_config(backend="tpu", kv_cache_memory_fraction=None).kv_cache_memory_fraction is None
    with pytest.raises(ValueError, match="kv_cache_memory_fraction must be None or in"):
        engine_config(backend="tpu", kv_cache_memory_fraction="most")


def test_the_cli_takes_auto_or_a_fraction_and_names_a_bad_one(capsys):
    from jlora.cli import build_parser, engine_kwargs

    parser = build_parser()
    args = parser.parse_args(["generate", "--kv-cache-memory-fraction", "0.7", "hi"])
    assert engine_kwargs(args)["kv_cache_memory_fraction"] == 0.7
    assert engine_kwargs(parser.parse_args(["generate", "hi"]))["kv_cache_memory_fraction"] == "auto"
    with pytest.raises(SystemExit):
        parser.parse_args(["serve", "--kv-cache-memory-fraction", "most"])
    assert "--kv-cache-memory-fraction: must be 'auto' or a number" in capsys.readouterr().err
