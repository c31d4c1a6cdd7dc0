"""What the server bounds before a request reaches the engine: body size, prompts or chat messages
per request, prompt size, the queue.

A request's work is bounded before any of it is done: the body's size as it arrives (413), then,
once it is parsed and before anything is templated or tokenized, its prompt count or its chat's
message count (400) and its sequences against the waiting queue, counting those still being
tokenized (400 when it could never fit, 429 when it does not fit now). Templating and tokenizing then run on a small thread pool, off
the event loop, so a large request never stalls the streams of others.

The sampling fields' bounds live in `jlora.sampling_params.BOUNDS` (shared with `SamplingParams`
and the CLI); these are the HTTP-side ones, each a `jlora serve` flag. Light to import (no JAX).
"""

from __future__ import annotations

from typing import Any

DEFAULT_MAX_WAITING = 4096  # --max-waiting-seqs: sequences queued for admission (429 past it)
DEFAULT_MAX_TOKENS = 1024  # --default-max-tokens: a chat request without max_tokens
DEFAULT_MAX_REQUEST_BYTES = 16 * 2**20  # --max-request-bytes: 413 above it
DEFAULT_MAX_PROMPTS = 256  # --max-prompts-per-request: a completion's prompt list (400 above it)
# --max-messages-per-request: a chat's (or /tokenize's) messages list (400 above it). Long agent
# conversations run to a few hundred messages; a 16 MiB body can list hundreds of thousands.
DEFAULT_MAX_MESSAGES = 1024
PREP_THREADS = 2  # threads that template and tokenize requests, off the event loop
DEFAULT_STALL_S = 60.0  # --health-stall-timeout: /health is 503 when the engine thread is stuck this long
RETRY_AFTER_S = 1  # what a 429 tells the client to wait


def max_token_bytes(tokenizer: Any) -> int:
    """The most UTF-8 bytes one token of `tokenizer` can stand for (its longest vocabulary entry,
    counted generously: byte-level BPE writes each byte as a 1-2 byte character)."""
    vocab = tokenizer.get_vocab() if hasattr(tokenizer, "get_vocab") else {}
    return max((len(k.encode("utf-8", "surrogatepass")) for k in vocab), default=64)


def max_prompt_bytes(max_model_len: int, tokenizer: Any) -> int:
    """A text prompt longer than this many UTF-8 bytes is at least max_model_len tokens, so it is
    refused before the tokenizer spends time on it."""
    return max_model_len * max_token_bytes(tokenizer)
