"""jlora.tokenizer against transformers' own GGUF tokenizer (which imports torch) on the default model."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from jlora.models.loading import default_model_path
from jlora.tokenizer import load_gguf_tokenizer, load_hf_tokenizer, read_gguf_fields

pytestmark = pytest.mark.slow

TEXTS = [
    "Hello, world!",
    "",
    " leading space",
    "trailing spaces   ",
    "café naïve résumé Ångström — “quotes” x½ 3²",
    "你好，世界！一个测试。日本語のテキスト 한국어",
    "emoji 😀👍🏽 👨‍👩‍👧 🇫🇷",
    "whitespace  runs    here\t\ttabs\n\nnewlines\r\n  \n\t end",
    "    indented\n        more",
    "digits 12345678 and 3.14159, 1,000,000 x2 2024-06-01 00:07",
    "def f(x: int) -> int:\n    return x ** 2  # square\n\nprint(f(12))\n",
    "for (int i = 0; i < n; ++i) { a[i] += b[i]; }",
    "it's we're they'll I'd you've CAN'T",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    "text <|endoftext|> more <jupyter_code>x=1<empty_output>",
    "<|im_start|> spaced <|im_end|>x<|im_end|><|im_end|>",
    "<|im_start", "|>", "<not_special>",
    "\u200b zero width \u00a0nbsp \ufeff bom",
    "a" * 100 + " " + "ab" * 50,
]

CHATS = [
    [{"role": "user", "content": "What is 2+2?"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Héllo 👋\n  bye"}],
    [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hello!"},
     {"role": "user", "content": "12345678 <|im_end|> tricky"}],
]


@pytest.fixture(scope="module")
def gguf_path() -> Path:
    return default_model_path()  # installed by `make test`; missing is a failure, not a skip


@pytest.fixture(scope="module")
def torch_free_check(gguf_path: Path) -> subprocess.Popen:
    """In a fresh interpreter: build a tokenizer from the path alone, check torch stays unimported, and
    check `read_gguf_fields` against `gguf.GGUFReader` (slow, hence here).

    Started before the (slow) reference so the two overlap; `test_no_torch` waits for it.
    """
    code = (
        "import sys\n"
        "import gguf\n"
        "from jlora.tokenizer import load_gguf_tokenizer, read_gguf_fields\n"
        f"path = {str(gguf_path)!r}\n"
        "tok = load_gguf_tokenizer(path)\n"
        "tok.apply_chat_template([{'role': 'user', 'content': 'hi'}], add_generation_prompt=True)\n"
        "assert 'torch' not in sys.modules, 'jlora.tokenizer imported torch'\n"
        "ours = read_gguf_fields(path)\n"
        "theirs = {k: f.contents() for k, f in gguf.GGUFReader(path).fields.items() if not k.startswith('GGUF.')}\n"
        "assert ours.keys() == theirs.keys(), set(ours) ^ set(theirs)\n"
        "bad = [k for k in ours if ours[k] != theirs[k] or type(ours[k]) is not type(theirs[k])]\n"
        "assert not bad, bad\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    yield proc
    if proc.poll() is None:
        proc.kill()
        proc.wait()


@pytest.fixture(scope="module")
def ref(gguf_path: Path, torch_free_check: subprocess.Popen):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)


@pytest.fixture(scope="module")
def fields(gguf_path: Path) -> dict:
    return read_gguf_fields(gguf_path)


@pytest.fixture(scope="module")
def ours(gguf_path: Path, fields: dict):
    return load_gguf_tokenizer(gguf_path, fields=fields)


def test_vocab_and_special_tokens(ours, ref) -> None:
    assert ours.get_vocab() == ref.get_vocab()
    assert len(ours) == len(ref)
    for name in ("bos_token", "eos_token", "unk_token", "pad_token"):
        assert getattr(ours, name) == getattr(ref, name), name
        assert getattr(ours, name + "_id") == getattr(ref, name + "_id"), name
    # The reference lists only the named tokens in all_special_ids; ours also lists the other
    # control tokens (<repo_name>, ...), which both mark special in the backend all the same.
    assert set(ref.all_special_ids) <= set(ours.all_special_ids)
    assert {i: str(t) for i, t in ours.added_tokens_decoder.items()} == \
        {i: str(t) for i, t in ref.added_tokens_decoder.items()}


@pytest.mark.parametrize("text", TEXTS)
def test_encode_matches_reference(ours, ref, text: str) -> None:
    for special in (True, False):
        ids = ours.encode(text, add_special_tokens=special)
        assert ids == ref.encode(text, add_special_tokens=special), (text, special)
    assert ours.tokenize(text) == ref.tokenize(text)


def test_numeric_split_follows_original_tokenizer(ours, ref) -> None:
    """SmolLM2's tokenizer.json (and llama.cpp's "smollm" pre-tokenizer) split numeric characters off
    before the byte-level regex; transformers' GGUF loader does not, which shows on " ½"."""
    from tokenizers import Tokenizer, pre_tokenizers

    original = Tokenizer.from_str(ref.backend_tokenizer.to_str())
    original.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)])
    assert ours.tokenize(" ½") == ["Ġ", "Â½"] and ref.tokenize(" ½") == ["ĠÂ", "½"]
    for text in [*TEXTS, "a ½ b ² c Ⅻ ١٢ ５ 7"]:
        assert ours.encode(text, add_special_tokens=False) == original.encode(text, add_special_tokens=False).ids


@pytest.mark.parametrize("text", TEXTS)
def test_decode_round_trip(ours, ref, text: str) -> None:
    ids = ours.encode(text, add_special_tokens=False)
    assert ours.decode(ids) == text
    assert ours.decode(ids) == ref.decode(ids)
    assert ours.decode(ids, skip_special_tokens=True) == ref.decode(ids, skip_special_tokens=True)


def test_batch_and_pairs(ours, ref) -> None:
    assert ours(TEXTS)["input_ids"] == ref(TEXTS)["input_ids"]
    assert ours("question?", "answer.")["input_ids"] == ref("question?", "answer.")["input_ids"]


@pytest.mark.parametrize("messages", CHATS)
def test_chat_template_matches_reference(ours, ref, messages: list[dict[str, str]]) -> None:
    assert ours.chat_template == ref.chat_template
    text = ours.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text == ref.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text.endswith("<|im_start|>assistant\n")
    ids = ours.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    assert ids == ref.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    assert ids == ours.encode(text, add_special_tokens=False)
    assert ours.decode(ids) == text


def test_hf_round_trip(ours, tmp_path: Path) -> None:
    ours.save_pretrained(tmp_path)
    tok = load_hf_tokenizer(tmp_path)
    for text in TEXTS:
        assert tok.encode(text) == ours.encode(text)
    messages = CHATS[1]
    assert tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False) == \
        ours.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert (tok.bos_token, tok.eos_token, tok.pad_token) == (ours.bos_token, ours.eos_token, ours.pad_token)


def test_add_bos_eos_flags(gguf_path: Path, fields: dict) -> None:
    fields = dict(fields, **{"tokenizer.ggml.add_bos_token": True,
                                                  "tokenizer.ggml.add_eos_token": True})
    tok = load_gguf_tokenizer(gguf_path, fields=fields)
    plain = tok.encode("hi there", add_special_tokens=False)
    assert tok.encode("hi there") == [tok.bos_token_id, *plain, tok.eos_token_id]


def test_missing_files_raise(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_gguf_tokenizer(tmp_path / "missing.gguf")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        read_gguf_fields(tmp_path / "missing.gguf")
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        load_hf_tokenizer(tmp_path)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_hf_tokenizer(tmp_path / "nope")


def test_bad_metadata_raises(gguf_path: Path, tmp_path: Path) -> None:
    tiny = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.tokens": ["a", "b"], "tokenizer.ggml.merges": ["a b"]}
    with pytest.raises(ValueError, match="tokenizer.ggml.model"):
        load_gguf_tokenizer(gguf_path, fields=dict(tiny, **{"tokenizer.ggml.model": "llama"}))
    with pytest.raises(ValueError, match="tokenizer.ggml.merges"):
        load_gguf_tokenizer(gguf_path, fields=dict(tiny, **{"tokenizer.ggml.merges": []}))
    with pytest.raises(ValueError, match=r"merges\[0\]"):  # "ab" is not a token
        load_gguf_tokenizer(gguf_path, fields=tiny)
    ok = dict(tiny, **{"tokenizer.ggml.tokens": ["a", "b", "ab"]})
    with pytest.raises(ValueError, match="outside the vocabulary"):
        load_gguf_tokenizer(gguf_path, fields=dict(ok, **{"tokenizer.ggml.bos_token_id": 7}))
    with pytest.raises(ValueError, match="token_type"):
        load_gguf_tokenizer(gguf_path, fields=dict(ok, **{"tokenizer.ggml.token_type": [1]}))
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"not a gguf file")
    with pytest.raises(ValueError, match="not a readable GGUF"):
        load_gguf_tokenizer(junk)


def test_llama3_pre_tokenizer(gguf_path: Path) -> None:
    fields = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "llama-bpe",
              "tokenizer.ggml.tokens": ["1", "2", "3", "12", "123"], "tokenizer.ggml.merges": ["1 2", "12 3"]}
    tok = load_gguf_tokenizer(gguf_path, fields=fields)
    pieces = [p for p, _ in tok.backend_tokenizer.pre_tokenizer.pre_tokenize_str("12312")]
    assert pieces == ["123", "12"]
    assert tok.encode("12312") == [4, 3]


def test_no_torch(torch_free_check: subprocess.Popen) -> None:
    """Last in the file: the check has run alongside everything above."""
    out, _ = torch_free_check.communicate(timeout=120)
    assert torch_free_check.returncode == 0, out
