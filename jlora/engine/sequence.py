"""Per-request state on the host: a request's samples (sequences), their tokens, text and state."""

from __future__ import annotations

import dataclasses
import enum
import time
from typing import Any

from jlora.adapters.host_store import AdapterHandle
from jlora.adapters.request import LoRACombination, LoRARequest
from jlora.outputs import CompletionOutput, RequestMetrics, RequestOutput
from jlora.sampling_params import SamplingParams


class SeqState(enum.Enum):
    WAITING = "waiting"
    PREFILL = "prefill"
    DECODE = "decode"
    FINISHED = "finished"


@dataclasses.dataclass(eq=False)
class Sequence:
    request_id: str
    index: int  # which of the request's n samples
    prompt_token_ids: list[int]
    params: SamplingParams
    seed: int
    lora: LoRARequest | LoRACombination | None
    # The adapter version converted at add_request; a combination's: one per part, in order.
    lora_handle: AdapterHandle | tuple[AdapterHandle, ...] | None = None
    state: SeqState = SeqState.WAITING
    blocks: list[int] = dataclasses.field(default_factory=list)  # KV cache blocks, in position order
    slot: int = -1  # adapter slot, -1 = base model (and a combination, which holds `slots`)
    slots: tuple[int, ...] = ()  # a combination's slots while admitted, one per part
    num_computed: int = 0  # tokens already in the KV cache
    # Prefix caching (jlora.engine.prefix_cache): the chain hashes of this sequence's full blocks
    # (computed as needed), how many of `blocks` are registered in the cache (shared or computed
    # here), and the prompt tokens found cached at its first admission (RequestOutput.num_cached_tokens).
    block_hashes: list[bytes] = dataclasses.field(default_factory=list)
    num_cached_blocks: int = 0
    num_cached_tokens: int | None = None
    num_preemptions: int = 0
    num_overtaken: int = 0  # later sequences admitted while this one waited for an adapter slot
    output_ids: list[int] = dataclasses.field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    logprobs: list[dict[int, float]] = dataclasses.field(default_factory=list)
    detok: Any = None  # IncrementalDetokenizer of output_ids (text = its text, cut at a stop string)
    # The request's prompt logprobs (one list shared by its samples; entry 0 is None), or None.
    prompt_logprobs: list[dict[int, float] | None] | None = None
    matcher: Any = None  # llguidance matcher of the sample's grammar (structured output), or None

    @property
    def handles(self) -> tuple[AdapterHandle, ...]:
        """The adapter versions this sequence needs in slots (none for the base model)."""
        h = self.lora_handle
        return () if h is None else h if isinstance(h, tuple) else (h,)

    @property
    def lora_key(self) -> tuple | None:
        """What its KV cache entries depend on besides the tokens (the prefix cache's root): the
        adapter version, with the scale when not 1, or each part's version and weight."""
        if self.lora is None:
            return None
        if isinstance(self.lora, LoRACombination):
            return ("mix",) + tuple(zip((h.version for h in self.handles), self.lora.slot_weights))
        return self.lora_handle.version if self.lora.scale == 1.0 else ("scaled", self.lora_handle.version,
                                                                        self.lora.scale)

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_ids

    @property
    def total_len(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_ids)

    def to_output(self) -> CompletionOutput:
        logprobs = list(self.logprobs) if self.params.logprobs is not None else None
        # Over the tokens returned: a dropped EOS / stop token is not counted.
        cumulative = sum(lp[t] for t, lp in zip(self.output_ids, logprobs)) if logprobs is not None else None
        return CompletionOutput(self.index, self.text, list(self.output_ids), self.finish_reason, self.stop_reason,
                                self.lora.lora_name if self.lora else None, logprobs, cumulative)


@dataclasses.dataclass(eq=False)
class Request:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    lora: LoRARequest | LoRACombination | None
    seqs: list[Sequence]
    metrics: RequestMetrics = dataclasses.field(default_factory=lambda: RequestMetrics(time.time()))
    streamed_chars: list[int] = dataclasses.field(default_factory=list)  # per sample: characters already streamed
    error: str | None = None  # why the engine failed it (finish_reason "error")
    num_unfinished: int = -1  # kept by the engine, so `finished` is O(1) however large n is

    def __post_init__(self) -> None:
        if self.num_unfinished < 0:
            self.num_unfinished = sum(s.state is not SeqState.FINISHED for s in self.seqs)

    @property
    def finished(self) -> bool:
        return self.num_unfinished == 0

    def to_output(self) -> RequestOutput:
        pl = self.seqs[0].prompt_logprobs
        return RequestOutput(self.request_id, self.prompt, list(self.prompt_token_ids),
                             [s.to_output() for s in self.seqs], self.finished, self.metrics,
                             self.lora.lora_name if self.lora else None, self.error,
                             None if pl is None else list(pl), self.seqs[0].num_cached_tokens)
