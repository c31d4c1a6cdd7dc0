import os

# Tests run on the CPU; keep XLA from grabbing both cores for its own thread pool twice.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest

# Small bucket sets keep warm-up short on a 2-core CI machine; the graphs are the same kind.
TEST_ENGINE = dict(max_model_len=256, max_num_seqs=4, max_num_batched_tokens=128, max_loras=4, max_lora_rank=32,
                   token_buckets=(32, 128), batch_buckets=(1, 4), span_buckets=(128, 256))


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
