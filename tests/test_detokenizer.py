"""Incremental detokenization gives exactly the text of one full decode, token by token."""

from __future__ import annotations

import random

import pytest

from jlora.engine.detokenizer import IncrementalDetokenizer
from jlora.models import default_model_path
from jlora.tokenizer import load_gguf_tokenizer


@pytest.fixture(scope="module")
def tok():
    return load_gguf_tokenizer(default_model_path())


@pytest.mark.parametrize("text", ["Once upon a time, in a land far away.", "Héllo wörld: 日本語のテキスト 🎉🧪 done",
                                  "ünïcödé ßtraße Ωμέγα — “quotes” …", "  leading spaces\n\ttabs\n\nand lines  "])
def test_every_prefix_equals_a_full_decode(tok, text):
    ids = tok.encode(text, add_special_tokens=False)
    d = IncrementalDetokenizer(tok)
    for k, i in enumerate(ids, 1):
        d.append(i)
        full = tok.decode(ids[:k], skip_special_tokens=True)
        assert d.text == full  # a trailing incomplete character shows as U+FFFD, as in the full decode
        assert full.startswith(d.stable) and "\ufffd" not in d.stable
    assert d.text == d.stable == text


def test_random_tokens_and_special_tokens(tok):
    rng = random.Random(0)
    specials = [tok.eos_token_id, tok.bos_token_id]
    for _ in range(200):
        ids = [rng.choice(specials) if rng.random() < 0.05 else rng.randrange(tok.vocab_size)
               for _ in range(rng.randrange(1, 80))]
        d = IncrementalDetokenizer(tok)
        for i in ids:
            d.append(i)
        assert d.text == tok.decode(ids, skip_special_tokens=True)


def test_the_rust_decode_is_used_only_where_it_equals_the_wrapper(tok):
    """The fast path calls the `tokenizers` backend directly (no space clean-up to apply); a tokenizer
    that cleans up spaces keeps the transformers wrapper, whose output differs."""
    assert IncrementalDetokenizer(tok)._decode_ids == tok.backend_tokenizer.decode
    ids = tok.encode("a , b . c ! héllo 🎉 <|im_start|> x")
    for skip in (True, False):
        assert tok.backend_tokenizer.decode(ids, skip_special_tokens=skip) == tok.decode(ids, skip_special_tokens=skip)
    tok.clean_up_tokenization_spaces = True
    try:
        assert IncrementalDetokenizer(tok)._decode_ids == tok.decode
    finally:
        tok.clean_up_tokenization_spaces = False
