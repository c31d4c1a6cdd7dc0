"""Output objects, shaped like vLLM's so user code carries over."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass
class RequestMetrics:
    arrival_time: float
    first_token_time: float | None = None
    finished_time: float | None = None
    num_prompt_tokens: int = 0
    num_generated_tokens: int = 0

    @property
    def time_to_first_token(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time


@dataclasses.dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # "stop", "length", "abort", "error" (RequestOutput.error says why)
    stop_reason: str | int | None = None  # the stop string or token id that ended it
    lora_name: str | None = None
    # Per generated token: top-n ids -> logprob, plus the chosen one; when an EOS or stop token ended
    # the sample, one entry more for that token (not in token_ids), as vLLM returns its logprob.
    logprobs: list[dict[int, float]] | None = None
    cumulative_logprob: float | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclasses.dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics | None = None
    lora_name: str | None = None
    error: str | None = None  # set when the engine failed this request (finish_reason "error")
    # With SamplingParams.prompt_logprobs: per prompt token, its logprob and the top-n there
    # (None for the first token, which has no context), as vLLM's RequestOutput.prompt_logprobs.
    prompt_logprobs: list[dict[int, float] | None] | None = None
    # Prompt tokens whose keys and values came from the prefix cache (the first sample's first
    # admission; None before it is admitted), as vLLM's RequestOutput.num_cached_tokens.
    num_cached_tokens: int | None = None
