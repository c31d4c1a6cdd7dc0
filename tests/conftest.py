import os

# Tests run on the CPU; keep XLA from grabbing both cores for its own thread pool twice.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# torch (the transformers/peft references; also in the notebook kernels and worker processes, which
# inherit this) on one thread: its two OpenMP threads wait on each other at every op when anything else
# wants the 2 cores (measured on a busy 2-core machine: 32 greedy tokens of SmolLM2 in 30-90 s on two
# threads, 1.7 s on one). The references are small; XLA's own thread pool does not read this.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest


def memory_maps() -> int:
    """This process's memory mappings (0 where /proc is not there). Each engine holds its XLA:CPU
    executables' code mapped (~2,900 maps for the tiny model's); past Linux's vm.max_map_count
    (65,530) XLA segfaults in the next executable it loads or serializes, so a dropped engine or
    server app must free its maps without the cyclic collector (tests/test_lifecycle.py). A test
    that spies on an engine's method sets it with monkeypatch, which deletes it after (assigning
    the bound method back would make a reference cycle that keeps the engine's maps until a full
    collection)."""
    try:
        with open("/proc/self/maps", "rb") as f:
            return f.read().count(b"\n")
    except OSError:
        return 0


@pytest.fixture
def empty_compile_cache(tmp_path):
    """JAX's persistent compile cache pointed at an empty folder for one test, and JAX's in-memory
    caches cleared: the test's engine compiles its graphs (an earlier test of the process may have
    turned the process-wide persistent cache on, and graphs it loads are not stored as executables)."""
    import jax
    from jax._src import compilation_cache

    jax.clear_caches()
    old = jax.config.jax_compilation_cache_dir
    jax.config.update("jax_compilation_cache_dir", str(tmp_path / "empty-xla-cache"))
    compilation_cache.reset_cache()
    yield
    jax.config.update("jax_compilation_cache_dir", old)
    compilation_cache.reset_cache()


# Small bucket sets keep warm-up short on a 2-core CI machine; the graphs are the same kind.
TEST_ENGINE = dict(max_model_len=256, max_num_seqs=4, max_num_batched_tokens=128, max_loras=4, max_lora_rank=32,
                   token_buckets=(32, 128))


@pytest.fixture(scope="session")
def real_llm():
    """The real default model (SmolLM2-135M-Instruct, float32), warmed up once for the whole run."""
    from jlora import LLM

    return LLM(progress=False, **TEST_ENGINE)


@pytest.fixture(scope="session")
def hf_real():
    """transformers' model and tokenizer from the same GGUF file: the reference."""
    import torch
    import transformers

    from jlora.models import default_model_path

    path = default_model_path()
    tok = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
    return model, tok


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    """A tiny random Llama checkpoint (full SmolLM2 vocabulary) plus the GGUF tokenizer, in HF format."""
    import torch
    import transformers

    from jlora.models import default_model_path
    from jlora.tokenizer import load_gguf_tokenizer

    cfg = transformers.LlamaConfig(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                   max_position_embeddings=256, tie_word_embeddings=False, bos_token_id=1,
                                   eos_token_id=2)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():  # sharper than uniform, so greedy runs repeat themselves and penalties show
        model.lm_head.weight.mul_(8.0)
    path = tmp_path_factory.mktemp("tiny_engine")
    model.save_pretrained(path, safe_serialization=True)
    load_gguf_tokenizer(default_model_path()).save_pretrained(path)
    return path, model


@pytest.fixture(scope="session")
def tiny_adapters(tiny_dir, tmp_path_factory):
    """16 peft adapters (ranks 2-8, varied targets) for the tiny model."""
    import torch
    from peft import LoraConfig, get_peft_model

    _, model = tiny_dir
    root = tmp_path_factory.mktemp("tiny_adapters")
    targets = [["q_proj", "v_proj"], "all-linear", ["gate_proj", "down_proj"], ["o_proj", "k_proj", "up_proj"]]
    paths = []
    for i in range(16):
        torch.manual_seed(i)
        name = f"a{i}"
        pm = get_peft_model(model, LoraConfig(r=2 + (i % 4) * 2, lora_alpha=8, target_modules=targets[i % 4],
                                              init_lora_weights=False), adapter_name=name)
        pm.save_pretrained(root, selected_adapters=[name])
        pm.unload()
        paths.append(root / name)
    return paths


@pytest.fixture
def cli_llm_kwargs(monkeypatch):
    """(generate, serve): the `LLM(...)` keyword arguments `jlora generate hi ARGV` and
    `jlora serve ARGV` would build from their flags, checked as the CLI checks them, with nothing loaded."""
    from jlora import cli
    from jlora.server.serve import engine_kwargs as serve_kwargs

    def generate(argv: list[str]) -> dict:
        seen: dict = {}

        def make_llm(args, kwargs=None):
            seen.update(kwargs or cli.engine_kwargs(args))
            raise SystemExit(0)

        monkeypatch.setattr(cli, "make_llm", make_llm)
        with pytest.raises(SystemExit):
            cli.main(["generate", "hi", *argv])
        return seen

    def serve(argv: list[str]) -> dict:
        return serve_kwargs(vars(cli.build_parser().parse_args(["serve", *argv])))

    return generate, serve
