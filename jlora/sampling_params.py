"""SamplingParams (vLLM-shaped) and the bounds every request field is held to.

This is the one place the bounds live: `SamplingParams` checks them, the CLI builds a
`SamplingParams` from its flags, and the server's request schema (`jlora.server.protocol`) takes
its `ge`/`le` constraints from `BOUNDS`, so `/openapi.json` states exactly what is accepted.
A value is bounded by what its array row can hold (int32 ids and counts, float32 scales) and by
what the sampler computes without overflow; `check_for_engine` adds the bounds that depend on
the model and the engine (vocabulary size, `max_n`). Light to import: no JAX.
"""

from __future__ import annotations

import dataclasses
import math

INT32_MAX = 2**31 - 1
MAX_LOGPROBS = 20  # top-n logprobs per token: n is per request, the array width is static
MAX_BANNED = 8  # EOS plus stop_token_ids suppressed before min_tokens
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 256  # a stream holds back up to this much text per stop string, checked every token
DEFAULT_MAX_N = 128  # OpenAI's own limit for n; EngineConfig.max_n / --max-n change it
MAX_LOGIT_BIAS = 300  # entries per request (OpenAI's limit); the sampler's bias arrays are this wide
LOGIT_BIAS_RANGE = (-100.0, 100.0)  # OpenAI's range: -100 bans a token, 100 all but forces it


@dataclasses.dataclass
class StructuredOutputsParams:
    """Constrain a sample to a grammar (vLLM's StructuredOutputsParams): exactly one of a JSON
    schema (`json`, a dict or its JSON text), any JSON object (`json_object=True`), a `regex`, a
    `choice` of strings, or a Lark `grammar`. Compiled by llguidance into a per-token mask applied
    inside the step's sampler; the sample stops when the grammar is complete."""

    json: dict | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool = False

    def __post_init__(self) -> None:
        given = [k for k in ("json", "regex", "choice", "grammar") if getattr(self, k) is not None]
        given += ["json_object"] if self.json_object is True else []
        if len(given) != 1:
            raise ValueError(f"StructuredOutputsParams needs exactly one of json, regex, choice, grammar, "
                             f"json_object; got {given or 'none'}")
        if self.json is not None and not isinstance(self.json, (dict, str)):
            raise ValueError("StructuredOutputsParams.json must be a JSON schema (a dict or its JSON text)")
        if self.choice is not None and (not isinstance(self.choice, list) or not self.choice
                                        or not all(isinstance(c, str) and c and _utf8(c) for c in self.choice)):
            raise ValueError("StructuredOutputsParams.choice must be a non-empty list of non-empty strings")
        for name in ("regex", "grammar"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, str) or not v or not _utf8(v)):
                raise ValueError(f"StructuredOutputsParams.{name} must be a non-empty string")

# field -> (lowest, highest) accepted, inclusive unless named in OPEN_LOW. Temperatures above 100
# make every distribution uniform to float32 precision; penalties outside [0.01, 100] overflow
# float32 logits (a logit of 30 divided by 1e-38 is inf).
BOUNDS: dict[str, tuple[float, float]] = {
    "temperature": (0.0, 100.0),
    "top_p": (0.0, 1.0),
    "top_k": (-1, INT32_MAX),
    "min_p": (0.0, 1.0),
    "repetition_penalty": (0.01, 100.0),
    "presence_penalty": (-2.0, 2.0),
    "frequency_penalty": (-2.0, 2.0),
    "max_tokens": (1, INT32_MAX),
    "min_tokens": (0, INT32_MAX),
    "seed": (0, 2**32 - 1),
    "logprobs": (0, MAX_LOGPROBS),
    "prompt_logprobs": (0, MAX_LOGPROBS),
    "n": (1, INT32_MAX),
}
OPEN_LOW = {"top_p"}  # top_p = 0 would keep no token


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v: object) -> bool:
    return (isinstance(v, (int, float)) and not isinstance(v, bool)) and math.isfinite(v)


def _utf8(s: str) -> bool:
    try:
        s.encode("utf-8")
        return True
    except UnicodeEncodeError:  # a lone surrogate such as "\ud800"
        return False


@dataclasses.dataclass
class SamplingParams:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 (or 0) = no top-k
    min_p: float = 0.0
    repetition_penalty: float = 1.0  # >1 discourages tokens seen in the prompt or output
    presence_penalty: float = 0.0  # subtracted once from tokens already generated
    frequency_penalty: float = 0.0  # subtracted per occurrence in the generated tokens
    max_tokens: int | None = 16
    min_tokens: int = 0
    ignore_eos: bool = False
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    logprobs: int | None = None  # top-n logprobs per generated token (plus the sampled one)
    prompt_logprobs: int | None = None  # top-n logprobs per prompt token (plus the prompt's own), vLLM's
    n: int = 1
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit, in [-100, 100]
    structured_outputs: StructuredOutputsParams | None = None

    def __post_init__(self) -> None:
        for name, (lo, hi) in BOUNDS.items():
            v = getattr(self, name)
            if v is None and name in ("max_tokens", "seed", "logprobs", "prompt_logprobs"):
                continue
            integral = isinstance(lo, int) and isinstance(hi, int)
            ok = _is_int(v) if integral else _is_num(v)
            low_ok = ok and (v > lo if name in OPEN_LOW else v >= lo)
            if not (low_ok and v <= hi):
                kind = "an int" if integral else "a finite number"
                low = f"({lo}" if name in OPEN_LOW else f"[{lo}"
                raise self._bad(name, f"must be {kind} in {low}, {hi}]" + _HINTS.get(name, ""))
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise self._bad("min_tokens", f"must not exceed max_tokens={self.max_tokens}")
        if not isinstance(self.ignore_eos, bool):
            raise self._bad("ignore_eos", "must be a bool")
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        if any(not isinstance(s, str) or not s or len(s) > MAX_STOP_CHARS or not _utf8(s) for s in self.stop):
            raise self._bad("stop", f"must be a non-empty string of at most {MAX_STOP_CHARS} characters "
                                    f"(valid UTF-8), or a list of them")
        if len(self.stop) > MAX_STOP_STRINGS:
            raise self._bad("stop", f"at most {MAX_STOP_STRINGS} stop strings are supported")
        self.stop_token_ids = list(self.stop_token_ids or [])
        if any(not _is_int(t) or not 0 <= t <= INT32_MAX for t in self.stop_token_ids):
            raise self._bad("stop_token_ids", "must be a list of token ids (ints in [0, 2**31))")
        if len(self.stop_token_ids) >= MAX_BANNED:
            raise self._bad("stop_token_ids", f"at most {MAX_BANNED - 1} ids are supported")
        if self.logit_bias is not None:
            lo, hi = LOGIT_BIAS_RANGE
            if (not isinstance(self.logit_bias, dict) or len(self.logit_bias) > MAX_LOGIT_BIAS
                    or any(not _is_int(t) or not 0 <= t <= INT32_MAX for t in self.logit_bias)
                    or any(not _is_num(v) or not lo <= v <= hi for v in self.logit_bias.values())):
                raise self._bad("logit_bias", f"must map at most {MAX_LOGIT_BIAS} token ids to numbers in [{lo}, {hi}]")
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputsParams):
            raise self._bad("structured_outputs", "must be a StructuredOutputsParams or None")

    def _bad(self, name: str, why: str) -> ValueError:
        return ValueError(f"SamplingParams.{name}={getattr(self, name)!r}: {why}")

    def check_for_engine(self, vocab_size: int, max_n: int) -> None:
        """The bounds that depend on the model and the engine; ValueError in the same form."""
        if self.top_k > vocab_size:
            raise self._bad("top_k", f"must be at most the vocabulary size {vocab_size} (-1 or 0 = off)")
        if self.n > max_n:
            raise self._bad("n", f"must be at most max_n={max_n} (the engine's limit on samples per request)")
        if any(t >= vocab_size for t in self.stop_token_ids):
            raise self._bad("stop_token_ids", f"must be token ids below the vocabulary size {vocab_size}")
        if self.logit_bias and any(t >= vocab_size for t in self.logit_bias):
            raise self._bad("logit_bias", f"must have token ids below the vocabulary size {vocab_size}")

    @property
    def uses_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0


_HINTS = {"temperature": " (0 = greedy)", "top_k": " (-1 or 0 disables top-k)", "repetition_penalty": " (1 = off)",
          "max_tokens": " or None", "seed": " or None", "logprobs": " or None",
          "prompt_logprobs": " or None"}
