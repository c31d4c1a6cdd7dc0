"""Tokenizers: rebuilt from GGUF metadata, or loaded from a Hugging Face checkpoint directory.

A GGUF file has no `tokenizer.json`; it stores the vocabulary, merges, token types, special token
ids and chat template as metadata under llama.cpp's key names. We rebuild a byte-level BPE from
those with the `tokenizers` library, the way transformers' GGUF integration does
(`transformers/integrations/gguf/gguf_tokenizer_mapping.py`), but without going through
`AutoTokenizer.from_pretrained(gguf_file=...)`, which imports torch.

    tok = load_gguf_tokenizer(default_model_path())
    tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False)
"""

from __future__ import annotations

import logging
from functools import lru_cache
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Regex, Tokenizer, decoders, pre_tokenizers, processors
from tokenizers.models import BPE

from jlora.formats import read_gguf_fields


class _NoTorchBanner(logging.Filter):
    """transformers warns "PyTorch was not found" on import; jlora needs only its tokenizer classes."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("PyTorch was not found")


logging.getLogger("transformers").addFilter(_NoTorchBanner())  # that logger alone: its other warnings stay
from transformers import PreTrainedTokenizerFast  # noqa: E402  (after the filter, which must come first)

logger = logging.getLogger(__name__)

# llama.cpp's `llama_token_type` values in `tokenizer.ggml.token_type`.
TOKEN_TYPE_CONTROL = 3  # special tokens such as <|im_start|>: matched whole, skipped by skip_special_tokens
TOKEN_TYPE_USER_DEFINED = 4  # added tokens that are not special, such as <think>: matched whole

# Split regexes for `tokenizer.ggml.pre` values whose pre-tokenizer is not GPT-2's.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_LLAMA3_PRE = ("llama3", "llama-v3", "llama-bpe", "smaug-bpe", "dbrx", "falcon3", "pixtral")
# Qwen2/2.5/3 (llama.cpp's "qwen2" pre type): Llama 3's regex with single digits (\p{N}, not {1,3}),
# as in Qwen2's own tokenizer.json.
_QWEN2_SPLIT = _LLAMA3_SPLIT.replace(r"\p{N}{1,3}", r"\p{N}")
_QWEN2_PRE = ("qwen2", "deepseek-r1-qwen")
# Pre names that use GPT-2's own regex (ByteLevel with use_regex=True); anything else warns.
_GPT2_PRE = ("gpt2", "default", "smollm", "starcoder", "refact", "codeshell")
# These split every numeric character off first: llama.cpp's "\p{N}" pass for these names, and the
# `Digits(individual_digits=True)` step in SmolLM2's own tokenizer.json. transformers' GGUF loader
# leaves it out, so it differs (only) where " " + the first byte of a numeric character like "½" is
# a token: " ½" is ["Ġ", "Â½"] here and in the original tokenizer, ["ĠÂ", "½"] there.
_DIGIT_PRE = ("smollm", "starcoder", "refact", "codeshell")


@lru_cache(maxsize=1)
def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table, in which byte-level vocabularies are spelled."""
    bs = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    cs = list(bs)
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


# ---- GGUF -------------------------------------------------------------------------------------


def load_gguf_tokenizer(path: str | Path, fields: dict[str, Any] | None = None) -> PreTrainedTokenizerFast:
    """The tokenizer and chat template stored in a GGUF file's metadata.

    `fields` (as returned by `jlora.formats.read_gguf_fields`) avoids reading the file again.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"GGUF file {str(path)!r} does not exist")
    if fields is None:
        fields = read_gguf_fields(path)

    model = fields.get("tokenizer.ggml.model")
    if model != "gpt2":
        raise ValueError(
            f"{path.name}: tokenizer.ggml.model is {model!r}; only byte-level BPE ('gpt2') GGUF tokenizers "
            "are supported; use a Hugging Face checkpoint directory with a tokenizer.json instead"
        )
    tokens = _list_field(fields, "tokenizer.ggml.tokens", path)
    merges = _list_field(fields, "tokenizer.ggml.merges", path)
    token_types = list(fields.get("tokenizer.ggml.token_type") or [])
    if token_types and len(token_types) != len(tokens):
        raise ValueError(
            f"{path.name}: tokenizer.ggml.token_type has {len(token_types)} entries for {len(tokens)} tokens"
        )

    pre = str(fields.get("tokenizer.ggml.pre", "gpt2"))
    vocab = _byte_level_vocab(tokens)
    # Llama 3's tokenizer.json (and llama.cpp for these pre names) take a whole word found in the vocab
    # as is before trying merges; transformers' GGUF loader does not.
    backend = Tokenizer(BPE(vocab=vocab, merges=_merge_pairs(merges, vocab, path), dropout=None,
                            continuing_subword_prefix="", end_of_word_suffix="", fuse_unk=False,
                            ignore_merges=pre in _LLAMA3_PRE))
    backend.pre_tokenizer = _pre_tokenizer(pre)
    backend.decoder = decoders.ByteLevel()

    # Control tokens become special added tokens and user-defined ones plain added tokens, so both are
    # matched whole in text instead of being cut into bytes. A control token spelled outside the byte
    # alphabet is a llama.cpp mislabel (transformers skips it too); its vocab entry was respelled above.
    alphabet = set(bytes_to_unicode().values())
    control = [t for t, ty in zip(tokens, token_types) if ty == TOKEN_TYPE_CONTROL and set(t) <= alphabet]
    user_defined = [t for t, ty in zip(tokens, token_types) if ty == TOKEN_TYPE_USER_DEFINED]
    backend.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in control])
    backend.add_tokens([AddedToken(t, normalized=False, special=False) for t in user_defined])

    special = {name: _special_token(fields, key, tokens, path) for name, key in
               (("bos_token", "bos_token_id"), ("eos_token", "eos_token_id"),
                ("unk_token", "unknown_token_id"), ("pad_token", "padding_token_id"))}
    add_bos = bool(fields.get("tokenizer.ggml.add_bos_token", False))
    add_eos = bool(fields.get("tokenizer.ggml.add_eos_token", False))
    backend.post_processor = _post_processor(special["bos_token"] if add_bos else None,
                                             special["eos_token"] if add_eos else None, backend)

    kwargs: dict[str, Any] = {k: v for k, v in special.items() if v is not None}
    chat_template = fields.get("tokenizer.chat_template")
    if chat_template:
        kwargs["chat_template"] = str(chat_template)
    extra = [t for t in control if t not in kwargs.values()]
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        name_or_path=str(path),
        additional_special_tokens=extra,
        add_bos_token=add_bos,
        add_eos_token=add_eos,
        clean_up_tokenization_spaces=False,
        **kwargs,
    )


def _list_field(fields: dict[str, Any], key: str, path: Path) -> list[str]:
    value = fields.get(key)
    if not value:
        raise ValueError(f"{path.name}: GGUF metadata has no {key}; cannot build a tokenizer")
    return [str(v) for v in value]


def _byte_level_vocab(tokens: list[str]) -> dict[str, int]:
    """Tokens spelled in GPT-2's byte alphabet as is; any other spelled through their UTF-8 bytes."""
    spelling = bytes_to_unicode()
    alphabet = set(spelling.values())
    vocab: dict[str, int] = {}
    for i, t in enumerate(tokens):
        key = t if set(t) <= alphabet else "".join(spelling[b] for b in t.encode("utf-8"))
        vocab.setdefault(key, i)  # a duplicate spelling keeps its first id
    return vocab


def _merge_pairs(merges: list[str], vocab: dict[str, int], path: Path) -> list[tuple[str, str]]:
    """`"a b"` -> `("a", "b")`, checked here: `tokenizers` panics (not raises) on a merge outside the vocab."""
    pairs = []
    for rank, merge in enumerate(merges):
        parts = merge.split(" ")
        if len(parts) != 2 or not all(p in vocab for p in parts) or parts[0] + parts[1] not in vocab:
            raise ValueError(f"{path.name}: tokenizer.ggml.merges[{rank}]={merge!r} is not two tokens "
                             "whose concatenation is also in the vocabulary")
        pairs.append((parts[0], parts[1]))
    return pairs


def _pre_tokenizer(pre: str) -> pre_tokenizers.PreTokenizer:
    if pre in _LLAMA3_PRE or pre in _QWEN2_PRE:
        return pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(_LLAMA3_SPLIT if pre in _LLAMA3_PRE else _QWEN2_SPLIT), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])
    if pre not in _GPT2_PRE:
        logger.warning("unknown tokenizer.ggml.pre %r; splitting text with GPT-2's regex", pre)
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in _DIGIT_PRE:
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    return byte_level


def _special_token(fields: dict[str, Any], key: str, tokens: list[str], path: Path) -> str | None:
    token_id = fields.get(f"tokenizer.ggml.{key}")
    if token_id is None:
        return None
    token_id = int(token_id)
    if not 0 <= token_id < len(tokens):
        raise ValueError(f"{path.name}: tokenizer.ggml.{key}={token_id} is outside the vocabulary of {len(tokens)}")
    return tokens[token_id]


def _post_processor(bos: str | None, eos: str | None, backend: Tokenizer) -> processors.TemplateProcessing:
    """BOS/EOS around each sequence as `tokenizer.ggml.add_bos_token`/`add_eos_token` ask."""
    pre = f"{bos}:0 " if bos else ""
    post = f" {eos}:0" if eos else ""
    pre_b = f"{bos}:1 " if bos else ""
    post_b = f" {eos}:1" if eos else ""
    specials = [(t, backend.token_to_id(t)) for t in dict.fromkeys(x for x in (bos, eos) if x)]
    return processors.TemplateProcessing(single=f"{pre}$A:0{post}", pair=f"{pre}$A:0{post} {pre_b}$B:1{post_b}",
                                         special_tokens=specials)


# ---- Hugging Face checkpoints -----------------------------------------------------------------


def load_hf_tokenizer(path: str | Path) -> PreTrainedTokenizerFast:
    """The tokenizer of a Hugging Face checkpoint directory (tokenizer.json and/or tokenizer_config.json).

    A `tokenizer.json` is used exactly as serialized; without one, transformers' AutoTokenizer
    converts the slow tokenizer that `tokenizer_config.json` names.
    """
    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"checkpoint directory {str(path)!r} does not exist")
    if (path / "tokenizer.json").is_file():
        return PreTrainedTokenizerFast.from_pretrained(str(path), local_files_only=True)
    if (path / "tokenizer_config.json").is_file():
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(str(path), local_files_only=True, use_fast=True)
    raise FileNotFoundError(f"no tokenizer.json or tokenizer_config.json in {path}; cannot load a tokenizer")
