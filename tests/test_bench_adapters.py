"""`jlora bench adapters`: its workload pieces (the full run is a benchmark, not a test)."""

from __future__ import annotations

import numpy as np
import pytest

from jlora.adapters.peft import read_peft_adapter
from jlora.bench.adapters import BEGIN, END, MODULES, draw_adapters, main, write_docs, write_peft_adapters
from jlora.models import LlamaConfig

CFG = LlamaConfig.preset("tiny")


def test_written_adapters_are_peft_files_the_converter_reads(tmp_path):
    paths = write_peft_adapters(tmp_path, CFG, 3, rank=4)
    assert [p.name for p in paths] == ["adapter0000", "adapter0001", "adapter0002"]
    a, b = (read_peft_adapter(p, CFG, max_lora_rank=8) for p in paths[:2])
    assert sorted(a.weights) == sorted(MODULES) and a.rank == 4
    assert not np.allclose(a.weights["q_proj"][0], b.weights["q_proj"][0])  # distinct adapters


def test_popularity_draws():
    rng = np.random.default_rng(0)
    uniform = draw_adapters(64, 20000, "uniform", rng)
    power = draw_adapters(64, 20000, "power-law", rng)
    assert min(uniform) == 0 and max(uniform) == 63 and max(power) <= 63
    counts = np.bincount(power, minlength=64)
    # alpha = 1: adapter 0 is twice as popular as adapter 1 and ten times adapter 9
    assert 1.8 < counts[0] / counts[1] < 2.2 and 8 < counts[0] / counts[9] < 12
    assert np.bincount(uniform, minlength=64).min() > 200


def test_docs_block_is_replaced_in_place(tmp_path):
    doc = tmp_path / "benchmarks.md"
    doc.write_text("# head\n\nkept above\n")
    write_docs("first", tmp_path)
    doc.write_text(doc.read_text() + "\nkept below\n")
    write_docs("second", tmp_path)
    text = doc.read_text()
    assert "first" not in text and text.count(BEGIN) == 1 and "kept above" in text and "kept below" in text
    assert text.index("second") < text.index("kept below")


def test_ks_must_include_the_reference(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--ks", "8,64"])
    assert e.value.code == 2 and "--ks must include 1" in capsys.readouterr().err


def test_markdown_has_cpu_time_ratio_and_skips_unrun_sections():
    from jlora.bench.adapters import to_markdown

    runs = [{"slots": 16, "k": k, "popularity": "uniform", "tok_s": t, "vs_k1": t / 40.0, "tok_cpu_s": c,
             "vs_k1_cpu": c / 20.0, "slot_writes": w, "conversions": w, "disk_cache_hits": 0}
            for k, t, c, w in ((1, 40.0, 20.0, 1), (1024, 30.0, 19.0, 94))]
    r = {"runs": runs, "step_ms": {}, "compiles_after_warmup": 0, "poisson_rate": 0.0, "poisson_slots": 16,
         "args": {"requests": 96, "new_tokens": 24, "max_num_seqs": 16, "load": 0.0}}
    md = to_markdown(r)
    assert "| 1024 | uniform | 16 | 30.0 | 0.75x | 19.0 | 0.95x | 94 | 94 | 0 | - | - |" in md
    assert "No TTFT runs" in md and "Decode step time" not in md
