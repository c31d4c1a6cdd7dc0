"""Start-up a person sees: one set of default sizes, checks before loading, lazy mode, no torch banner."""

import dataclasses
import gc
import inspect
import shutil
import subprocess
import sys
import weakref

import jax
import numpy as np
import pytest

from jlora import compile_stats
from jlora.engine_args import ENGINE_DEFAULTS, LORA_IMPLS, engine_config
from jlora.engine.config import EngineConfig

# Two step graphs (decode-only and one prefill chunk bucket) and set_slot: enough to see lazy
# compiles, cheap to warm up eagerly.
SMALL = dict(max_model_len=128, max_num_seqs=2, max_num_batched_tokens=32, max_loras=2, max_lora_rank=24,
             token_buckets=(32,))
STEP_STAGES = ("step", "set_slot")


def test_llm_defaults_are_engine_config_defaults():
    from jlora import LLM

    params = inspect.signature(LLM.__init__).parameters
    for f in dataclasses.fields(EngineConfig):
        # max_cpu_loras (host cache, no graph depends on it) follows max_loras unless given.
        if f.name in params and f.default is not None and f.name != "max_cpu_loras":
            assert params[f.name].default == ENGINE_DEFAULTS[f.name], f.name
            assert f.name in ("block_size", "base_graphs") or f.default == ENGINE_DEFAULTS[f.name], f.name
    assert ENGINE_DEFAULTS["block_size"] is None and ENGINE_DEFAULTS["base_graphs"] is None  # auto, per backend


def test_base_graphs_auto_follows_the_backend():
    assert engine_config().base_graphs == "none" == engine_config(backend="cpu").base_graphs
    tpu = engine_config(backend="tpu", max_num_seqs=64, decode_row_buckets=(1, 64))
    assert tpu.base_graphs == "decode" and tpu.base_graph_shapes() == ((1, 0, 0), (64, 0, 0))
    assert tpu.num_step_graphs == len(tpu.step_shapes()) + 2
    every = engine_config(backend="tpu", base_graphs="all")
    assert every.num_step_graphs == 2 * len(every.step_shapes())
    with pytest.raises(ValueError, match="base_graphs must be one of"):
        engine_config(base_graphs="decoded")


def test_block_size_auto_follows_the_backend():
    from jlora.engine_args import default_block_size

    assert engine_config().block_size == 16 == engine_config(backend="cpu").block_size
    assert engine_config(backend="tpu").block_size == 128  # max_model_len 2048 / 16
    assert engine_config(backend="tpu", max_model_len=1024).block_size == 64
    assert engine_config(backend="tpu", max_model_len=100).block_size == 16
    assert engine_config(backend="tpu", max_model_len=32768).block_size == 128
    assert engine_config(backend="tpu", block_size=16).block_size == 16  # given: kept
    assert [default_block_size(n, "tpu") for n in (256, 257, 2048, 2049)] == [16, 32, 128, 128]
    cfg = engine_config(backend="tpu", max_num_seqs=4)
    assert cfg.num_kv_blocks == 4 * 2048 // 128  # capacity counted in the resolved blocks
    with pytest.raises(ValueError, match="block_size"):
        engine_config(block_size=0)


def test_cli_and_demo_defaults_are_llm_defaults():
    from jlora.cli import build_parser

    parser = build_parser()
    for cmd in (["generate", "x"], ["demo"]):
        args = parser.parse_args(cmd)
        for name in ("max_model_len", "max_num_seqs", "max_num_batched_tokens", "max_loras", "max_lora_rank",
                     "lora_impl", "block_size"):
            assert getattr(args, name) == ENGINE_DEFAULTS[name], (cmd, name)
        assert args.token_buckets is None


def test_lora_impl_choices_match_the_kernels():
    from jlora.kernels import CHOICES

    assert tuple(CHOICES) == LORA_IMPLS


def test_engine_config_checks_arguments_alone():
    with pytest.raises(ValueError, match="dtype"):
        engine_config(dtype="float64")
    with pytest.raises(ValueError, match="lora_impl"):
        engine_config(lora_impl="magic")
    with pytest.raises(ValueError, match="max_num_seqs"):
        engine_config(max_num_seqs=0)
    with pytest.raises(ValueError, match="token_buckets"):
        engine_config(token_buckets="32,64")
    assert engine_config(max_model_len=256, token_buckets=[128, 256]).token_buckets == (128, 256)


def test_llm_rejects_bad_sizes_before_loading(monkeypatch):
    import jlora.llm
    import jlora.models.loading

    def no_load(*a, **k):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(jlora.models.loading, "load_model", no_load)  # LLM() imports it when called
    for kwargs, word in [(dict(max_model_len=0), "max_model_len"), (dict(lora_impl="x"), "lora_impl"),
                         (dict(dtype="int8"), "dtype"), (dict(token_buckets=(1, 3)), "token_buckets"),
                         (dict(model="/no/such/model.gguf"), "does not exist")]:
        with pytest.raises((ValueError, FileNotFoundError), match=word):
            jlora.llm.LLM(**kwargs)


@pytest.fixture
def no_compile_cache():
    """The persistent compile cache off (an earlier test may have turned it on for the process): to
    count real compiles, and because a background warm-up's cache loads beside other XLA work once
    crashed XLA:CPU (docs/engine.md)."""
    prev = jax.config.jax_enable_compilation_cache
    jax.config.update("jax_enable_compilation_cache", False)
    yield
    jax.config.update("jax_enable_compilation_cache", prev)


def _step_compiles() -> dict[str, int]:
    table = compile_stats.stage_table()
    return {s: table.get(s, (0, 0.0))[0] for s in STEP_STAGES}


@pytest.mark.slow  # two engines without the compile cache, ~40 s
def test_lazy_compiles_on_first_use_and_matches_eager(tiny_dir, tiny_adapters, no_compile_cache):
    """(Real compiles are counted: a persistent-cache hit compiles nothing and would hide them.)"""
    from jlora import LLM, LoRARequest, SamplingParams

    path, _ = tiny_dir
    prompts = ["The sea is", "One two three"]
    loras = [LoRARequest("a1", 1, str(tiny_adapters[1])), None]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    before = _step_compiles()
    lazy = LLM(path, warmup=False, progress=False, use_compilation_cache=False, **SMALL)
    assert _step_compiles() == before, "lazy mode compiled a step graph at construction"
    got = lazy.generate(prompts, params, lora_request=loras)
    after = _step_compiles()
    for stage in STEP_STAGES:
        assert after[stage] > before[stage], f"no {stage} compile shown in the report"
    assert set(lazy.compile_report(print_table=False)) >= set(STEP_STAGES)
    eager = LLM(path, progress=False, use_compilation_cache=False, **SMALL)
    n = compile_stats.compile_count()
    want = eager.generate(prompts, params, lora_request=loras)
    assert compile_stats.compile_count() - n == 0  # eager: everything was compiled at start
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    assert [o.outputs[0].text for o in got] == [o.outputs[0].text for o in want]
    assert lazy.startup_seconds["warmup"] < eager.startup_seconds["warmup"]


def test_no_pytorch_banner_at_import(tmp_path):
    code = ("import sys; sys.modules['torch'] = None\n"  # as in an install without torch
            "import jlora.tokenizer, jlora.cli\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "PyTorch was not found" not in out.stderr + out.stdout


def test_llm_weights_cache_option_and_env(tiny_dir, tmp_path, monkeypatch):
    from jlora import LLM

    path, _ = tiny_dir
    kw = dict(warmup=False, progress=False, use_compilation_cache=False, **SMALL)
    root = tmp_path / "weights"
    assert LLM(path, weights_cache=root, **kw).weights_cache_hit is False  # converted, then cached
    second = LLM(path, weights_cache=root, **kw)
    assert second.weights_cache_hit is True
    assert second.startup_seconds.keys() >= {"load_weights", "tokenizer", "engine_init", "warmup"}
    assert LLM(path, weights_cache=False, **kw).weights_cache_hit is None
    monkeypatch.setenv("JLORA_WEIGHTS_CACHE", "0")
    assert LLM(path, weights_cache=root, **kw).weights_cache_hit is None


def test_building_the_model_compiles_only_the_loaders_graphs():
    """Weights go to the device with device_put: jnp.asarray of a NumPy array compiled one identity graph
    per parameter shape (8 of the 17 graphs of a default start). What compiles now is the streaming
    loader's own few graphs (the stacks' zeros and the donated layer write), under the "load" stage,
    however many layers. Shapes no other test uses, so a graph compiled earlier in the run cannot
    hide one here."""
    import numpy as np

    from jlora.models import build_model
    from jlora.models.config import LlamaConfig

    cfg = LlamaConfig(vocab_size=41, hidden_size=20, intermediate_size=44, num_hidden_layers=3, num_attention_heads=2,
                      num_key_value_heads=1, head_dim=10)
    rng = np.random.default_rng(0)
    d = cfg.hidden_size
    t = {"model.embed_tokens.weight": rng.standard_normal((cfg.vocab_size, d)), "model.norm.weight": np.ones(d),
         "lm_head.weight": rng.standard_normal((cfg.vocab_size, d))}
    for i in range(cfg.num_hidden_layers):
        for m, (d_in, d_out) in cfg.module_shapes().items():
            sub = "self_attn" if m in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
            t[f"model.layers.{i}.{sub}.{m}.weight"] = rng.standard_normal((d_out, d_in))
        t[f"model.layers.{i}.input_layernorm.weight"] = np.ones(d)
        t[f"model.layers.{i}.post_attention_layernorm.weight"] = np.ones(d)
    t = {k: v.astype(np.float32) for k, v in t.items()}
    before, stages = compile_stats.compile_count(), compile_stats.stage_table()
    model = build_model(cfg, t)
    after = compile_stats.stage_table()
    grew = {k: after[k][0] - stages.get(k, (0, 0.0))[0] for k in after if after[k][0] != stages.get(k, (0, 0.0))[0]}
    assert set(grew) <= {"load"} and compile_stats.compile_count() - before == sum(grew.values()) <= 4, grew
    np.testing.assert_array_equal(np.asarray(model.embed_tokens.get_value()), t["model.embed_tokens.weight"])


@pytest.mark.slow  # three engines, one warmed up without the compile cache, ~20 s
def test_start_says_what_it_is_doing(tiny_dir, tmp_path, capsys):
    """One line each: where the weights come from (hit or miss), the graphs about to compile and what
    the compile cache holds, then the bar; nothing with progress=False."""
    from jlora import LLM

    path, _ = tiny_dir
    root = tmp_path / "weights"
    kw = dict(use_compilation_cache=False, weights_cache=root, **SMALL)
    LLM(path, progress=False, warmup=False, **kw)  # writes the weights cache entry, silently
    quiet = capsys.readouterr()
    assert "jlora:" not in quiet.err + quiet.out
    LLM(path, **kw)
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.startswith("jlora: ")]
    assert lines[0].startswith(f"jlora: loading weights from {path}: weights cache hit ({root}"), lines
    steps = engine_config(**SMALL).num_step_graphs
    assert lines[1].startswith(f"jlora: compiling {steps + 1} graphs ({steps} step graphs, 1 set_slot); "), lines
    assert lines[2].startswith("jlora: warm-up done in "), lines
    # A graph identical to one compiled earlier in this process is reused, not compiled (nor counted).
    built = int(lines[2].split(": ")[2].split(" graphs compiled")[0])
    assert 1 <= built <= steps + 1, lines
    assert err.index(lines[1]) < err.index("jlora warm-up (compiling step graphs)") < err.index(lines[2])
    LLM(path, warmup=False, **{**kw, "weights_cache": tmp_path / "other"})
    err = capsys.readouterr().err
    assert f"weights cache miss, converting the checkpoint and caching it in {tmp_path / 'other'}" in err
    assert "lazy start (warmup=False)" in err


# Seven step graphs: decode rows 1 and 2 (each with and without LoRA) and three prefill shapes; the
# two of `first_graphs()` run every step.
BACKGROUND = dict(max_model_len=128, max_num_seqs=2, max_num_batched_tokens=32, max_loras=2, max_lora_rank=24,
                  token_buckets=(16, 32), decode_row_buckets=(1, 2), base_graphs="decode")


def test_warmup_mode_resolves_by_backend_and_rejects_bad_values(monkeypatch):
    from jlora.llm import resolve_warmup

    assert resolve_warmup(None) == "eager"  # this CPU
    assert (resolve_warmup(True), resolve_warmup(False)) == ("eager", "lazy")
    assert resolve_warmup("background") == "background"
    monkeypatch.setattr(jax, "default_backend", lambda: "tpu")
    assert resolve_warmup(None) == "background"
    for bad in ("sometimes", 1, ["eager"]):
        with pytest.raises(ValueError, match="warmup must be"):
            resolve_warmup(bad)


def test_llm_rejects_a_bad_warmup_before_loading(tmp_path):
    from jlora import LLM

    # The model path does not exist: the warm-up mode is checked before it is looked at.
    with pytest.raises(ValueError, match="warmup must be"):
        LLM(str(tmp_path / "missing"), warmup="sometimes", progress=False)


def test_first_graphs_are_step_graphs_that_cover_every_step():
    c = EngineConfig(**{k: v for k, v in BACKGROUND.items() if k not in ("max_loras", "max_lora_rank")},
                     max_loras=2, max_lora_rank=24)
    first = c.first_graphs()
    assert set(first) <= set(c.step_graphs()) and len(c.step_graphs()) == 7
    (dec, _), (pre, _) = first
    # Every decode-only shape has no more rows, and every prefill part fits one prompt's full chunk.
    assert all(r <= dec[0] for r in c.decode_row_buckets)
    assert pre == (c.max_num_seqs, 1, max(q for _, q in c.prefill_shapes()))


def test_compile_count_can_leave_out_a_stage():
    @jax.jit
    def f(x):
        return x * 3 + 1

    x = jax.device_put(np.arange(7.0))  # a shape no other test compiles
    before, before_fg = compile_stats.compile_count(), compile_stats.compile_count(exclude=(compile_stats.BACKGROUND,))
    with compile_stats.stage(compile_stats.BACKGROUND):
        f(x)
    assert compile_stats.compile_count() == before + 1
    assert compile_stats.compile_count(exclude=(compile_stats.BACKGROUND,)) == before_fg


@pytest.mark.slow  # seven step graphs compiled without the compile cache, ~25 s
def test_background_warmup_serves_from_the_first_graphs_then_all(tiny_dir, tiny_adapters, monkeypatch,
                                                                 no_compile_cache):
    """Held back, the background warm-up has compiled nothing: requests (a burst of short prompts,
    adapters mixed) run on `first_graphs()` alone, compile nothing, and give the tokens they give
    once every graph is compiled."""
    import threading

    from jlora import LLM, LoRARequest, SamplingParams
    from jlora.engine.runner import ModelRunner

    gate = threading.Event()
    real = ModelRunner._compile_pending

    def held(self, keys):
        gate.wait()
        real(self, keys)

    monkeypatch.setattr(ModelRunner, "_compile_pending", held)
    path, _ = tiny_dir
    llm = LLM(path, warmup="background", progress=False, use_compilation_cache=False, **BACKGROUND)
    runner = llm.engine.runner
    assert set(runner._executables) == set(llm.config.first_graphs())
    assert not llm.wait_for_warmup(timeout=0.01)
    ran = []
    launch = runner.launch
    monkeypatch.setattr(runner, "launch", lambda batch, prev=None: ran.append(runner.graph_of(batch)) or launch(batch, prev))
    prompts = ["The sea is", "One two", "Red green blue", "A"]
    loras = [LoRARequest("a1", 1, str(tiny_adapters[1])), None, None, LoRARequest("a1", 1, str(tiny_adapters[1]))]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    n = compile_stats.compile_count()
    during = llm.generate(prompts, params, lora_request=loras, use_tqdm=False)
    alone = llm.generate(prompts[1:2], params, use_tqdm=False)  # one row, no adapter
    assert compile_stats.compile_count() == n, "a step compiled while the background warm-up was held"
    assert ran and set(ran) <= set(llm.config.first_graphs()), set(ran)
    gate.set()
    assert llm.wait_for_warmup(timeout=600)
    assert set(runner._executables) == set(llm.config.step_graphs())
    assert runner.compile_seconds["background"] > 0
    ran.clear()
    n = compile_stats.compile_count()
    after = llm.generate(prompts, params, lora_request=loras, use_tqdm=False)
    alone_after = llm.generate(prompts[1:2], params, use_tqdm=False)
    assert compile_stats.compile_count() == n
    assert ((1, 0, 0), False) in ran and any(k[0][1] == 2 for k in ran), ran  # the exact shapes now
    assert [o.outputs[0].token_ids for o in during] == [o.outputs[0].token_ids for o in after]
    assert alone[0].outputs[0].token_ids == alone_after[0].outputs[0].token_ids


def test_background_warmup_failure_is_reported_and_serving_goes_on(tiny_dir, monkeypatch, capsys, no_compile_cache):
    from jlora import LLM, SamplingParams
    from jlora.engine.runner import ModelRunner

    real = ModelRunner._compile

    def failing(self, keys, progress=False, stage="step", stop=None):
        if stage == compile_stats.BACKGROUND:
            raise MemoryError("no room for this graph")
        return real(self, keys, progress, stage, stop)

    monkeypatch.setattr(ModelRunner, "_compile", failing)
    path, _ = tiny_dir
    llm = LLM(path, warmup="background", progress=False, use_compilation_cache=False, **BACKGROUND)
    with pytest.raises(RuntimeError, match="background warm-up failed") as e:
        llm.wait_for_warmup(timeout=600)
    assert isinstance(e.value.__cause__, MemoryError)
    assert "background warm-up failed" in capsys.readouterr().err
    out = llm.generate(["The sea is", "One two"], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True),
                       use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in out] == [4, 4]
    # The failure it keeps holds no frame of the runner: dropped, the engine is freed without the
    # cyclic collector (its traceback's frames once kept the runner in a reference cycle).
    runner = weakref.ref(llm.engine.runner)
    gc.collect()
    gc.disable()
    try:
        del llm, e
        assert runner() is None, "a runner whose background warm-up failed outlived its LLM"
    finally:
        gc.enable()


def test_warmup_flag_of_generate_and_serve():
    from jlora import cli

    def flag(*argv):
        return cli.warmup_flag(cli.build_parser().parse_args(list(argv)))

    assert flag("generate", "hi") is None  # LLM's default: background on a TPU, eager elsewhere
    assert flag("generate", "hi", "--warmup", "background") == "background"
    assert flag("serve", "--warmup", "eager") == "eager"
    assert flag("generate", "hi", "--lazy") == flag("demo", "--warmup", "lazy") == "lazy"
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["serve", "--warmup", "sometimes"])


# ---- stored executables (jlora.engine.executables) ---------------------------------------------------


# One fresh process starting an engine with its own compile cache and executable store: in the
# test process an earlier test's graphs would come from JAX's cache (and such graphs are not stored).
_STORE_CHILD = """
import json, sys
from pathlib import Path
from jlora import LLM, LoRARequest, SamplingParams, compile_stats
from jlora.engine.runner import wait_for_stored_executables
path, xla, store, engine, opts = sys.argv[1], sys.argv[2], sys.argv[3], json.loads(sys.argv[4]), json.loads(sys.argv[5])
if opts.get("damage"):
    for f in sorted(Path(store).glob("*/*.pkl"))[:1]:
        f.write_bytes(f.read_bytes()[:100])
llm = LLM(path, warmup=False, progress=False, compilation_cache_dir=xla, executable_cache=store, **engine)
runner = llm.runners[0]
if opts.get("no_trace"):
    class NotTraced:
        def lower(self, *a, **k):
            raise AssertionError("a step graph was traced")
    runner._step = NotTraced()
loras = [LoRARequest("a1", 1, opts["adapter"]), None] if opts.get("adapter") else None
out = llm.generate(["The sea is", "One two three"], SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True),
                   lora_request=loras)
wait_for_stored_executables()
print("RESULT", json.dumps(dict(tokens=[o.outputs[0].token_ids for o in out],
                                used=sorted(map(str, runner._executables)), loaded=sorted(map(str, runner.loaded_graphs)),
                                cache_hits=compile_stats.cache_hit_count(), **llm.executable_store.stats)))
"""


def _start_in_a_fresh_process(path, tmp_path, xla=None, **opts) -> dict:
    """The child's result; its compile cache in `xla` (default tmp_path / "xla"), its store in tmp_path."""
    import json

    out = subprocess.run([sys.executable, "-c", _STORE_CHILD, str(path), str(xla or tmp_path / "xla"),
                          str(tmp_path / "executables"), json.dumps(SMALL), json.dumps(opts)],
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.split("RESULT", 1)[1])


@pytest.fixture(scope="module")
def first_start(tiny_dir, tiny_adapters, tmp_path_factory):
    """One first start in a fresh process (empty compile cache, empty executable store, an adapter in
    the batch), shared by the tests that start again from what it left: each copies its caches."""
    root = tmp_path_factory.mktemp("first_start")
    return root, _start_in_a_fresh_process(tiny_dir[0], root, adapter=str(tiny_adapters[1]))


def _after_first_start(first_start, tmp_path) -> dict:
    """The first start's executable store copied into tmp_path (the store's key holds no path)."""
    root, first = first_start
    shutil.copytree(root / "executables", tmp_path / "executables")
    return first


@pytest.mark.slow  # two fresh processes that start an engine (one shared), ~25 s
def test_stored_executables_skip_tracing_and_give_the_same_tokens(tiny_dir, tiny_adapters, tmp_path, first_start):
    """A second start of the same engine (fresh processes, the same caches) takes every step graph it
    needs from the store: no step graph traced (its lowering fails if called), none stored again,
    the same tokens."""
    from jlora import LLM

    path, _ = tiny_dir
    first = _after_first_start(first_start, tmp_path)
    assert first["writes"] == len(first["used"]) > 0 and first["hits"] == 0
    second = _start_in_a_fresh_process(path, tmp_path, adapter=str(tiny_adapters[1]), no_trace=True)
    assert second["loaded"] == second["used"] == first["used"]  # every graph the run needed, from the store
    assert second["writes"] == 0  # (and no step graph traced: NotTraced would have raised)
    assert second["tokens"] == first["tokens"]
    # Another engine config is another fingerprint.
    kw = dict(warmup=False, progress=False, use_compilation_cache=False, executable_cache=tmp_path / "executables")
    assert (LLM(path, **kw, **SMALL).executable_store.key
            != LLM(path, **kw, **{**SMALL, "max_num_seqs": 3}).executable_store.key)


def test_executable_fingerprint_covers_tuning_version_sources_and_configs(tiny_dir, monkeypatch):
    import jlora
    from jlora.engine import executables
    from jlora.llm import open_executable_store
    from jlora.tuning import TuningOptions

    devices = jax.devices()[:1]
    cfg = engine_config(**SMALL)
    key = executables.fingerprint(devices, "model=a", f"engine={cfg!r}")
    assert key == executables.fingerprint(devices, "model=a", f"engine={cfg!r}")  # stable
    assert key != executables.fingerprint(devices, "model=b", f"engine={cfg!r}")
    # Each tuning option is part of the engine config's key, a kernel option too.
    for tuning in (TuningOptions(lora_cond="pass"), TuningOptions(lora_slices="before"),
                   TuningOptions(prefill_slack=None), TuningOptions().replace(prefill_round=256)):
        other = engine_config(**SMALL, tuning=tuning)
        assert key != executables.fingerprint(devices, "model=a", f"engine={other!r}"), tuning
    assert key == executables.fingerprint(devices, "model=a", f"engine={engine_config(**SMALL, tuning=TuningOptions())!r}")
    with monkeypatch.context() as m:
        m.setattr(jlora, "__version__", "9.9.9")  # another release
        assert key != executables.fingerprint(devices, "model=a", f"engine={cfg!r}")
    monkeypatch.setenv("XLA_FLAGS", "--xla_dump_to=/nowhere")
    monkeypatch.undo()
    assert key == executables.fingerprint(devices, "model=a", f"engine={cfg!r}")
    with monkeypatch.context() as m:
        m.setenv("XLA_FLAGS", "--xla_cpu_enable_fast_math=false")
        assert key != executables.fingerprint(devices, "model=a", f"engine={cfg!r}")
    with monkeypatch.context() as m:
        m.setattr(executables, "_source_digest", "0" * 64)  # edited code
        assert key != executables.fingerprint(devices, "model=a", f"engine={cfg!r}")
    # Off by the environment, and by default off the TPU.
    with monkeypatch.context() as m:
        m.setenv("JLORA_EXECUTABLE_CACHE", "0")
        assert open_executable_store(True, devices, "cfg", "float32", "none", cfg) is None


def test_executable_cache_option_resolution_and_bad_values(tmp_path):
    from jlora import LLM
    from jlora.llm import executable_cache_wanted

    assert executable_cache_wanted(None, True, 1, 1) is False  # the CPU: off unless asked
    assert executable_cache_wanted(True, False, 1, 1) is True
    assert executable_cache_wanted(tmp_path, True, 1, 1) is True
    assert executable_cache_wanted(True, True, 2, 1) is False  # data parallel: one engine only
    assert executable_cache_wanted(True, True, 1, 2) is False  # tensor parallel: one device only
    assert executable_cache_wanted(False, True, 1, 1) is False
    with pytest.raises(ValueError, match="executable_cache"):
        LLM(executable_cache=3)


@pytest.mark.slow  # two fresh processes that start an engine (one shared), ~20 s
def test_a_damaged_or_mismatched_stored_executable_is_a_miss(tiny_dir, tiny_adapters, tmp_path, first_start):
    """A truncated file is a miss (a warning, counted as an error) and the graph compiles; a stored
    graph whose arguments are not the runner's is not installed (`executables.matches`)."""
    from jlora import LLM, SamplingParams
    from jlora.engine import executables

    path, _ = tiny_dir
    first = _after_first_start(first_start, tmp_path)
    assert first["writes"] > 0
    damaged = _start_in_a_fresh_process(path, tmp_path, adapter=str(tiny_adapters[1]), damage=True)
    assert damaged["tokens"] == first["tokens"]
    assert damaged["errors"] == 1 and damaged["hits"] == len(first["used"]) - 1
    assert len(damaged["loaded"]) == len(first["used"]) - 1

    llm = LLM(path, warmup=False, progress=False, executable_cache=False, **SMALL)
    llm.generate(["The sea is"], SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True))
    runner = llm.runners[0]
    key = next(iter(runner._executables))
    compiled = runner._executables[key]
    args, _ = runner.step_inputs(key)
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
                            if isinstance(x, jax.Array) else x, args)
    assert executables.matches(compiled, abstract)
    wrong = list(abstract)
    wrong[3] = jax.ShapeDtypeStruct((wrong[3].shape[0] + 1,), wrong[3].dtype, sharding=wrong[3].sharding)
    assert not executables.matches(compiled, tuple(wrong))


def test_backend_start_runs_beside_the_imports():
    from jlora.llm import start_backend

    jax.devices()
    assert start_backend()() == 0.0  # already up: nothing to wait for
    code = ("import jax\nfrom jlora.llm import start_backend\n"
            "wait = start_backend()\nimport jlora.engine.llm_engine\nprint('took', wait())\n"
            "print(jax.default_backend())\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    took = float(out.stdout.split("took")[1].split()[0])
    assert took > 0 and out.stdout.split()[-1] == "cpu"


@pytest.mark.slow  # two fresh processes that start an engine (one shared), ~15 s
def test_a_compile_cache_load_is_not_stored(tiny_dir, tiny_adapters, tmp_path, first_start):
    """XLA:CPU re-serializes an executable loaded from the persistent compile cache without its
    kernels ("Function wrapped_iota not found" when it runs), so only graphs compiled in this
    process are stored. Fresh processes: JAX keeps the first compile cache directory it opened."""
    path, _ = tiny_dir
    root, fresh = first_start
    assert fresh["writes"] > 0 and fresh["cache_hits"] == 0
    # The first start's compile cache where it was (a copy under another path missed every step
    # graph), and an empty store.
    loaded = _start_in_a_fresh_process(path, tmp_path, xla=root / "xla", adapter=str(tiny_adapters[1]))
    assert loaded["cache_hits"] > 0  # its graphs came from the compile cache...
    assert loaded["writes"] == 0  # ...so none was stored
    assert loaded["tokens"] == fresh["tokens"]


@pytest.mark.slow  # two engines that compile every graph, ~35 s
def test_stored_executables_are_read_beside_the_weights_on_the_cpu_too(tiny_dir, tmp_path, monkeypatch,
                                                                       empty_compile_cache):
    """An eager start from stored executables starts reading them before the weights load, on XLA:CPU
    as on a TPU, and serves the tokens of the start that compiled them."""
    from jlora import LLM, SamplingParams
    from jlora.engine import executables
    from jlora.engine.runner import wait_for_stored_executables
    from jlora.models import loading

    path, _ = tiny_dir
    kw = dict(progress=False, use_compilation_cache=False, executable_cache=tmp_path / "executables", **SMALL)
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    with LLM(path, **kw) as first:  # compiles its graphs (`empty_compile_cache`), so it stores them
        want = [o.outputs[0].token_ids for o in first.generate(["The sea is", "One two three"], params)]
        graphs = set(first.config.step_graphs())
        wait_for_stored_executables()
    events, prefetch, load_model = [], executables.ExecutableStore.prefetch, loading.load_model
    monkeypatch.setattr(executables.ExecutableStore, "prefetch",
                        lambda self, names: (events.append("prefetch"), prefetch(self, names))[1])
    monkeypatch.setattr(loading, "load_model", lambda *a, **k: (events.append("weights"), load_model(*a, **k))[1])
    with LLM(path, **kw) as second:
        assert jax.default_backend() == "cpu" and events[:2] == ["prefetch", "weights"]
        assert second.runners[0].loaded_graphs == graphs and second.executable_store.stats["hits"] == len(graphs)
        assert [o.outputs[0].token_ids for o in second.generate(["The sea is", "One two three"], params)] == want


def test_fingerprint_reads_the_sources_bytes_without_parsing_them(monkeypatch):
    """The stored executables' key hashes the sources' bytes; it parses none of them (the switches
    it once read from the syntax trees are TuningOptions in the engine config now)."""
    import ast

    from jlora.engine import executables

    monkeypatch.setattr(ast, "parse", lambda *a, **kw: (_ for _ in ()).throw(AssertionError("parsed a source")))
    monkeypatch.setattr(executables, "_source_digest", None)  # hashed again, here
    assert len(executables.fingerprint(jax.devices()[:1], "model=a")) == 32
    assert executables._source_digest is not None
