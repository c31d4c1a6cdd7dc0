"""End to end on the real default model: jlora against Hugging Face transformers (same GGUF, float32)."""

import jax.numpy as jnp
import numpy as np
import pytest
import torch

from jlora import SamplingParams
from jlora.models import init_cache

pytestmark = pytest.mark.slow  # the real default model

CHATS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain in one sentence what a neural network is.",
    "List three prime numbers.",
]


def hf_chat_ids(tok, msg: str) -> list[int]:
    out = tok.apply_chat_template([{"role": "user", "content": msg}], add_generation_prompt=True, tokenize=True)
    return list(out["input_ids"] if hasattr(out, "keys") else out)


def hf_greedy(model, ids: list[int], n: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False, eos_token_id=2, pad_token_id=2)
    gen = out[0, len(ids):].tolist()
    return gen[:-1] if gen and gen[-1] == 2 else gen  # jlora does not return the EOS token


def test_chat_template_ids_match_transformers(real_llm, hf_real):
    _, tok = hf_real
    for msg in CHATS:
        assert real_llm.apply_chat_template([{"role": "user", "content": msg}]) == hf_chat_ids(tok, msg)


def test_greedy_tokens_match_transformers_in_one_batch(real_llm, hf_real):
    model, tok = hf_real
    params = SamplingParams(temperature=0.0, max_tokens=32)
    outs = real_llm.chat([[{"role": "user", "content": m}] for m in CHATS], params)
    for msg, out in zip(CHATS, outs):
        ref = hf_greedy(model, hf_chat_ids(tok, msg), 32)
        assert out.outputs[0].token_ids == ref, msg
        assert out.outputs[0].text == tok.decode(ref, skip_special_tokens=True)
        assert out.outputs[0].finish_reason == ("length" if len(ref) == 32 else "stop")


def test_last_position_logits_match_transformers(real_llm, hf_real):
    model, tok = hf_real
    for msg in CHATS[:2]:
        ids = hf_chat_ids(tok, msg)
        with torch.no_grad():
            ref = model(torch.tensor([ids])).logits[0, -1].numpy()
        t = len(ids)
        logits, _ = real_llm.model(jnp.asarray([ids], jnp.int32), jnp.arange(t, dtype=jnp.int32)[None],
                                   init_cache(real_llm.model.cfg, 1, t), logits_index=jnp.array([t - 1]))
        np.testing.assert_allclose(np.asarray(logits[0]), ref, rtol=0, atol=2e-3)
        assert np.argmax(logits[0]) == np.argmax(ref)


def test_prompt_too_long_is_rejected_and_engine_keeps_serving(real_llm):
    with pytest.raises(ValueError, match="max_model_len=256"):
        real_llm.generate([{"prompt_token_ids": [1] * 300}], SamplingParams(max_tokens=4))
    with pytest.raises(ValueError, match="empty"):
        real_llm.generate([{"prompt_token_ids": []}])
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0.0)
    out = real_llm.generate(["The sky is"], SamplingParams(temperature=0.0, max_tokens=4))
    assert len(out[0].outputs[0].token_ids) == 4


def test_a_1500_token_prompt_matches_transformers(hf_real):
    """Twelve 128-token prefill chunks, then decoding over ~1,500 cached positions: attention runs
    across a dozen key chunks (the default max_model_len is 2048)."""
    from jlora import LLM

    model, tok = hf_real
    text = " ".join(f"Item {i}: the {['red', 'green', 'blue'][i % 3]} box holds {i * 7 % 13} stones." for i in range(120))
    ids = tok(text + "\nHow many stones does the box of item 5 hold?")["input_ids"]
    assert 1400 <= len(ids) <= 1700, len(ids)
    llm = LLM(max_model_len=2048, max_num_seqs=1, max_num_batched_tokens=128, token_buckets=(128,), max_loras=1,
              max_lora_rank=8, warmup=False, progress=False)
    out = llm.generate([{"prompt_token_ids": ids}], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))
    want, past, cur = [], None, torch.tensor([ids])
    with torch.no_grad():  # greedy through EOS, as ignore_eos does
        for _ in range(12):
            r = model(cur, past_key_values=past, use_cache=True)
            past = r.past_key_values
            want.append(int(r.logits[0, -1].argmax()))
            cur = torch.tensor([[want[-1]]])
    assert out[0].outputs[0].token_ids == want
