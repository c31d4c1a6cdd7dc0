"""Structured output: a grammar per sample, compiled by llguidance into a token mask per step.

vLLM and SGLang offer xgrammar, llguidance and outlines-core. llguidance is chosen here: one
3 MB wheel with no dependencies (xgrammar pulls in torch and triton), JSON schemas, regexes and
Lark grammars, and it fills a NumPy bitmask directly (`fill_next_token_bitmask`, about 0.1-7 ms a
row on this CPU), which the step carries as an int32 [R, V/32] array, so no graph changes.
"""

from __future__ import annotations

import json
from typing import Any

from jlora.sampling_params import StructuredOutputsParams


JSON_FORMAT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class GrammarCompiler:
    """Matchers for one tokenizer. Building llguidance's view of the vocabulary takes about a
    second, so it happens on the first structured request, not at start-up."""

    def __init__(self, tokenizer: Any, vocab_size: int):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._ll_tokenizer = None

    def _tokenizer(self) -> Any:
        if self._ll_tokenizer is None:
            import llguidance.hf

            self._ll_tokenizer = llguidance.hf.from_tokenizer(self.tokenizer, n_vocab=self.vocab_size)
        return self._ll_tokenizer

    @staticmethod
    def grammar(p: StructuredOutputsParams) -> str:
        import llguidance

        if p.json is not None or p.json_object:
            schema = {"type": "object"} if p.json_object else json.loads(p.json) if isinstance(p.json, str) else p.json
            # Compact JSON (", " and ": " between items): a free choice of whitespace lets a weak
            # model loop on newlines until max_tokens, as it does on the tiny test model.
            return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_FORMAT)
        if p.regex is not None:
            return llguidance.LLMatcher.grammar_from_regex(p.regex)
        if p.choice is not None:  # Lark string literals are JSON strings
            return llguidance.LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in p.choice))
        return llguidance.LLMatcher.grammar_from_lark(p.grammar)

    @classmethod
    def check(cls, p: StructuredOutputsParams) -> None:
        """ValueError if the grammar does not compile (needs no tokenizer, so a server checks first)."""
        import llguidance

        try:
            error = llguidance.LLMatcher.validate_grammar(cls.grammar(p))
        except (ValueError, TypeError) as e:
            error = str(e)
        if error:
            raise ValueError(f"SamplingParams.structured_outputs: the grammar does not compile: {error}")

    def matcher(self, p: StructuredOutputsParams) -> Any:
        """A fresh matcher; ValueError naming what is wrong with the grammar."""
        import llguidance

        try:
            grammar = self.grammar(p)
        except (ValueError, TypeError) as e:  # a JSON schema that is not JSON, or not an object
            raise ValueError(f"SamplingParams.structured_outputs: {e}") from None
        m = llguidance.LLMatcher(self._tokenizer(), grammar)
        if m.is_error():
            raise ValueError(f"SamplingParams.structured_outputs: the grammar does not compile: {m.get_error()}")
        return m


def fill_mask(matcher: Any, allowed: Any, row: int) -> None:
    """Row `row` of the int32 bitmask `allowed` from the matcher's state."""
    import llguidance.numpy

    llguidance.numpy.fill_next_token_bitmask(matcher, allowed, row)
