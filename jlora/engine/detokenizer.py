"""Incremental detokenization: each new token costs a decode of a few tokens, not of the whole output.

A token's text can depend on its neighbours (a multi-byte character split over byte-level
tokens; a SentencePiece word whose leading space a standalone decode drops), so the new text is
read off a short window: decode(window) minus decode(window without the new tokens), where the
window starts a few tokens back. Text is only taken once it does not end in U+FFFD (a character
still incomplete), so the joined text equals one decode of all the tokens (tested against the
default tokenizer, multi-byte characters included). The approach is TGI's and vLLM's.
"""

from __future__ import annotations

from typing import Any

_REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    """The text of a growing token list, extended one token at a time in O(window) each.

    `text` always equals one decode of `ids` (a trailing incomplete character shows as U+FFFD, as
    in a full decode); `stable` is the part that later tokens cannot change."""

    def __init__(self, tokenizer: Any, skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self._decode_ids = _fast_decode(tokenizer) or tokenizer.decode
        self.ids: list[int] = []
        self.stable = ""
        self._tail = ""  # text of ids[_read:] while it still ends in an incomplete character
        self._prefix = 0  # window start: decode(ids[_prefix:_read]) is text already in `stable`
        self._read = 0  # tokens whose text is in `stable`

    @property
    def text(self) -> str:
        return self.stable + self._tail

    def _decode(self, ids: list[int]) -> str:
        return self._decode_ids(ids, skip_special_tokens=self.skip_special_tokens)

    def append(self, token_id: int) -> None:
        self.ids.append(token_id)
        prefix_text = self._decode(self.ids[self._prefix: self._read])
        new_text = self._decode(self.ids[self._prefix:])
        delta = new_text[len(prefix_text):]
        if not delta or delta.endswith(_REPLACEMENT):  # a partial character, or a special token skipped
            self._tail = delta
            return
        self.stable += delta
        self._tail = ""
        self._prefix, self._read = self._read, len(self.ids)


def _fast_decode(tokenizer: Any) -> Any:
    """The Rust tokenizer's own `decode` when it gives what the transformers wrapper would (a fast
    tokenizer that does no clean-up of spaces): a quarter of the wrapper's cost per call, which
    matters at two calls per token per row on the serving thread. None: use the wrapper."""
    backend = getattr(tokenizer, "backend_tokenizer", None) if getattr(tokenizer, "is_fast", False) else None
    if backend is None or getattr(tokenizer, "clean_up_tokenization_spaces", True):
        return None
    return backend.decode
