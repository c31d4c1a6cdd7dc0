"""The command line: errors that need no model come before loading it, in the CLI's own words, on their own
line; --version; defaults in --help; --chat streams; no stray timing line."""

import json
import time

import pytest

import jlora
from jlora import cli


@pytest.fixture
def no_model(monkeypatch):
    """Fails the test if the CLI gets as far as building an LLM."""
    def make_llm(*a, **k):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(cli, "make_llm", make_llm)


def _error(argv, capsys) -> str:
    t = time.perf_counter()
    assert cli.main(argv) == 2
    elapsed = time.perf_counter() - t
    out, err = capsys.readouterr()
    assert out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert elapsed < 10  # no model load, no compile (< 2 s on a quiet machine; slack for a shared CI box)
    return lines[0]


@pytest.mark.parametrize("argv, message", [
    (["generate", "hi", "--max-tokens", "-1"], "--max-tokens must be >= 1, got -1"),
    (["generate", "hi", "--tensor-parallel-size", "0"], "--tensor-parallel-size must be >= 1, got 0"),
    (["generate", "hi", "--data-parallel-size", "0"], "--data-parallel-size must be >= 1, got 0"),
    (["generate", "hi", "--tensor-parallel-size", "2"],
     "--tensor-parallel-size=2 does not divide the model's 9 attention heads; this model can use --tensor-parallel-size in [1, 3]"),
    (["generate", "hi", "--max-tokens", "0"], "--max-tokens must be >= 1, got 0"),
    (["generate", "hi", "--temperature", "-0.5"], "--temperature=-0.5: must be a finite number in [0.0, 100.0]"),
    (["generate", "hi", "--temperature", "1e308"], "--temperature=1e+308: must be a finite number in [0.0, 100.0]"),
    (["generate", "hi", "--top-p", "0"], "--top-p=0.0: must be a finite number in (0.0, 1.0]"),
    (["generate", "hi", "--top-k", "-2"], "--top-k=-2: must be an int in [-1, 2147483647]"),
    (["generate", "hi", "--top-k", str(2**33)], "--top-k=8589934592: must be an int in [-1, 2147483647]"),
    (["generate", "hi", "--seed", "-1"], "--seed=-1: must be an int in [0, 4294967295]"),
    (["generate", ""], "the prompt is empty"),
    (["generate", "a", "  "], "prompt 2 is empty"),
    (["generate", "hi", "--max-model-len", "0"], "--max-model-len must be a positive int"),
    (["generate", "hi", "--max-num-seqs", "-3"], "--max-num-seqs must be a positive int"),
    (["generate", "hi", "--token-buckets", "1,3"], "--token-buckets="),
    (["generate", "hi", "--token-buckets", "a,b"], "--token-buckets must be comma-separated integers"),
    (["generate", "hi", "--model", "/no/such/model.gguf"], "--model: '/no/such/model.gguf' does not exist"),
    (["generate", "hi", "--model", "HuggingFaceTB/SmolLM2-135M-Instruct"], "hub names are not supported"),
    (["generate", "hi", "--lora", "/no/such/adapter"], "--lora: adapter directory '/no/such/adapter' does not exist"),
    (["demo", "--max-tokens", "0"], "--max-tokens must be >= 1, got 0"),
    (["demo", "--max-loras", "0"], "--max-loras must be a positive int"),
])
def test_errors_before_loading_in_cli_words(argv, message, capsys, no_model):
    line = _error(argv, capsys)
    assert line.startswith(f"jlora {argv[0]}: error: "), line
    assert message in line, line
    assert "SamplingParams" not in line and "EngineConfig" not in line and "max_tokens" not in line


def test_malformed_adapter_config_before_loading(tmp_path, capsys, no_model):
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "adapter_config.json").write_text("{not json")
    (bad / "adapter_model.safetensors").write_bytes(b"")
    line = _error(["generate", "hi", "--lora", str(bad)], capsys)
    assert "--lora: malformed" in line and "adapter_config.json" in line

    (bad / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 8, "lora_bias": True}))
    assert "lora_bias" in _error(["generate", "hi", "--lora", str(bad)], capsys)

    (bad / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 0}))
    assert "r=0 must be a positive integer" in _error(["generate", "hi", "--lora", str(bad)], capsys)

    (bad / "adapter_config.json").unlink()
    assert "no adapter_config.json" in _error(["generate", "hi", "--lora", str(bad)], capsys)


def test_adapter_without_weights_before_loading(tmp_path, capsys, no_model):
    d = tmp_path / "noweights"
    d.mkdir()
    (d / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 8, "target_modules": ["q_proj"]}))
    assert "no adapter_model.safetensors" in _error(["generate", "hi", "--lora", str(d)], capsys)


def test_version(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["--version"])
    assert e.value.code == 0
    assert capsys.readouterr().out.strip() == f"jlora {jlora.__version__}"


def test_help_shows_defaults_and_no_timing_line(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["generate", "--help"])
    assert e.value.code == 0
    out, err = capsys.readouterr()
    assert "(default: 2048)" in out and "(default: 16)" in out and "(default: 64)" in out
    assert "--lazy" in out and "--chat" in out and "streams" in out
    assert err == ""
    with pytest.raises(SystemExit):
        cli.main(["demo", "--help"])
    out, err = capsys.readouterr()
    assert "(default: 40)" in out and err == ""


class FakeLLM:
    """Streams canned deltas; records what it was asked."""

    def __init__(self, deltas=("Hello", " world"), fail_after=None, reject=False):
        self.deltas, self.fail_after, self.reject = deltas, fail_after, reject
        self.calls = []
        self.startup_seconds = {"load_weights": 0.1, "warmup": 0.2}
        self.weights_cache_hit = True

    def apply_chat_template(self, messages):
        self.calls.append(("template", messages))
        return [1, 2, 3]

    def generate_stream(self, prompt, params, lora):
        self.calls.append(("stream", prompt, params.max_tokens, lora))
        if self.reject:
            raise ValueError("prompt has 5000 tokens; max_model_len=2048 leaves no room to generate")
        for i, d in enumerate(self.deltas):
            if self.fail_after is not None and i == self.fail_after:
                raise ValueError("something broke")
            yield d


def _with_fake(monkeypatch, fake):
    monkeypatch.setattr(cli, "make_llm", lambda args, kwargs=None: fake)


def test_generate_streams_prompt_then_text(capsys, monkeypatch):
    _with_fake(monkeypatch, FakeLLM())
    assert cli.main(["generate", "Say:", "--max-tokens", "5"]) == 0
    out, err = capsys.readouterr()
    assert out == "Say:Hello world\n" and err == ""  # no timing line without --verbose


def test_chat_streams_the_template_ids(capsys, monkeypatch):
    fake = FakeLLM()
    _with_fake(monkeypatch, fake)
    assert cli.main(["generate", "Hi there", "--chat", "--max-tokens", "7"]) == 0
    out, err = capsys.readouterr()
    assert out == "Hello world\n" and err == ""
    assert fake.calls[0] == ("template", [{"role": "user", "content": "Hi there"}])
    assert fake.calls[1] == ("stream", {"prompt_token_ids": [1, 2, 3]}, 7, None)


def test_rejected_prompt_is_not_echoed(capsys, monkeypatch):
    _with_fake(monkeypatch, FakeLLM(reject=True))
    assert cli.main(["generate", "a very long prompt"]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert err.strip() == ("jlora generate: error: prompt has 5000 tokens; --max-model-len=2048 leaves no room "
                           "to generate")


def test_error_after_streaming_starts_on_its_own_line(capsys, monkeypatch):
    _with_fake(monkeypatch, FakeLLM(fail_after=1))
    assert cli.main(["generate", "Say:"]) == 2
    out, err = capsys.readouterr()
    assert out == "Say:Hello\n"  # the open line is closed before the error
    assert err == "jlora generate: error: something broke\n"


def test_verbose_prints_timings(capsys, monkeypatch):
    _with_fake(monkeypatch, FakeLLM())
    assert cli.main(["generate", "x", "--verbose"]) == 0
    err = capsys.readouterr().err
    assert err.startswith("[jlora generate: start-up") and "cache hit" in err


@pytest.mark.parametrize("argv,module,rest", [
    (["bench", "start", "--write"], "start", ["--write"]),
    (["bench", "--write", "--rounds", "1"], "workload", ["--write", "--rounds", "1"]),
    (["bench"], "workload", []),
    (["bench", "kernels", "--quick"], "kernels", ["--quick"]),
    (["bench", "serve", "--rates", "inf"], "serve", ["--rates", "inf"]),
    (["bench", "adapters", "--write"], "adapters", ["--write"]),
    (["bench", "lora-cost", "--rounds", "2"], "lora_cost", ["--rounds", "2"]),
    (["bench", "decode-step"], "decode_step", []),
    (["bench", "adapter-load", "--ranks", "8"], "adapter_load", ["--ranks", "8"]),
    (["bench", "parallel", "--sizes", "1x1,3x1"], "parallel", ["--sizes", "1x1,3x1"]),
    (["bench", "prefix", "--requests", "8"], "prefix", ["--requests", "8"]),
    (["bench", "tpu-compile", "--shape", "tiny"], "tpu_compile", ["--shape", "tiny"]),
    (["bench", "soak", "--rate", "1"], "soak", ["--rate", "1"]),
    (["bench", "dora-cost", "--reps", "3"], "dora_cost", ["--reps", "3"]),
    (["bench", "embed-cost", "--vocab"], "embed_cost", ["--vocab"]),
])
def test_bench_dispatch_reaches_each_benchmark(monkeypatch, argv, module, rest):
    import importlib

    import jlora.bench

    assert sorted(jlora.bench.BENCHMARKS.values()) == sorted(
        ["workload", "start", "kernels", "serve", "adapters", "lora_cost", "decode_step", "adapter_load",
         "parallel", "tpu", "tpu_compile", "prefix", "soak", "dora_cost", "embed_cost"])
    seen = []
    for name in jlora.bench.BENCHMARKS.values():
        mod = importlib.import_module(f"jlora.bench.{name}")
        monkeypatch.setattr(mod, "main", lambda rest, name=name: seen.append((name, rest)) or 0)
    assert cli.main(argv) == 0
    assert seen == [(module, rest)]


def _fake_start_result():
    run = {"first_token_s": 9.5, "interpreter_s": 0.05, "imports_s": 2.0, "llm_s": 7.0, "generate_s": 0.5,
           "startup": {"validate": 0.0, "load_weights": 1.5, "tokenizer": 0.3, "engine_init": 0.2, "warmup": 5.0},
           "weights_cache_hit": True, "graphs_compiled": 3, "compile_s": 1.2, "stages": {}, "cache_hits": 38,
           "cache_misses": 0, "process_s": 10.0}
    return {"runs": {"cold": {**run, "weights_cache_hit": False}, "warm": run}, "lazy": False, "model": "m",
            "version": "0.1.0", "cpus": 2, "date": "2026-12-02"}


def test_bench_start_write_keeps_the_rest_of_benchmarks_md(tmp_path):
    from jlora.bench.docs import ANALYSIS_MARKER
    from jlora.bench.start import BEGIN, END, kept_block, to_markdown, write_block

    md = to_markdown(_fake_start_result())
    assert "## Start-up (`jlora bench start`)" in md and "| cold | 9.5 |" in md and "| miss |" in md
    doc = tmp_path / "benchmarks.md"
    doc.write_text("# End-to-end\n\ntable\n\n" + ANALYSIS_MARKER + "\n## hand-written\nkeep me\n")
    write_block(doc, md)
    text = doc.read_text()
    assert text.index("table") < text.index(BEGIN) < text.index(END) < text.index(ANALYSIS_MARKER)
    assert text.endswith("## hand-written\nkeep me\n")
    write_block(doc, md.replace("9.5", "8.5"))  # rewritten in place, not added twice
    text = doc.read_text()
    assert text.count(BEGIN) == 1 and "| cold | 8.5 |" in text and "| cold | 9.5 |" not in text
    assert kept_block(text).startswith(BEGIN) and kept_block("no block") == ""
