"""EngineConfig: capacities and the static bucket sets every compiled graph is drawn from."""

from __future__ import annotations

import dataclasses


def geometric_buckets(lo: int, hi: int, factor: int = 4) -> tuple[int, ...]:
    """lo, lo*factor, ... below hi, then hi itself: few graphs, bounded padding."""
    if lo >= hi:
        return (hi,)
    out = []
    b = lo
    while b < hi:
        out.append(b)
        b *= factor
    return tuple(out) + (hi,)


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    max_model_len: int = 2048  # prompt + generated tokens per sequence
    max_num_seqs: int = 16  # sequences running at once
    max_num_batched_tokens: int = 512  # prefill token budget per step (padded)
    max_loras: int = 4  # device slots
    max_lora_rank: int = 64
    max_cpu_loras: int = 32  # host cache of converted adapters
    lora_impl: str = "auto"
    block_size: int = 16  # KV cache positions per block
    num_kv_blocks: int | None = None  # KV capacity; None = max_num_seqs full-length sequences
    # Buckets; None = derived below.
    token_buckets: tuple[int, ...] | None = None  # prefill chunk lengths
    batch_buckets: tuple[int, ...] | None = None  # sequences per step
    span_buckets: tuple[int, ...] | None = None  # attention spans (cache positions read)

    def __post_init__(self) -> None:
        for name in ("max_model_len", "max_num_seqs", "max_num_batched_tokens", "max_loras",
                     "max_lora_rank", "max_cpu_loras", "block_size"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"EngineConfig.{name} must be a positive int, got {getattr(self, name)!r}")
        if self.max_cpu_loras < self.max_loras:
            raise ValueError(f"max_cpu_loras={self.max_cpu_loras} must be >= max_loras={self.max_loras}")
        if self.num_kv_blocks is None:
            object.__setattr__(self, "num_kv_blocks", self.max_num_seqs * self.blocks_for(self.max_model_len))
        if not isinstance(self.num_kv_blocks, int) or self.num_kv_blocks < self.blocks_for(self.max_model_len):
            raise ValueError(f"EngineConfig.num_kv_blocks={self.num_kv_blocks!r} must hold at least one "
                             f"max_model_len={self.max_model_len} sequence: >= {self.blocks_for(self.max_model_len)} "
                             f"blocks of {self.block_size}")
        chunk = min(self.max_num_batched_tokens, self.max_model_len)
        if self.token_buckets is None:
            object.__setattr__(self, "token_buckets", geometric_buckets(min(32, chunk), chunk))
        if self.batch_buckets is None:
            object.__setattr__(self, "batch_buckets", geometric_buckets(1, self.max_num_seqs))
        if self.span_buckets is None:
            object.__setattr__(self, "span_buckets", geometric_buckets(min(128, self.max_model_len), self.max_model_len))
        for name, top in (("token_buckets", chunk), ("batch_buckets", self.max_num_seqs),
                          ("span_buckets", self.max_model_len)):
            b = getattr(self, name)
            if list(b) != sorted(set(b)) or b[-1] != top or b[0] < 1:
                raise ValueError(f"EngineConfig.{name}={b} must be increasing, positive and end at {top}")

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    @property
    def kv_capacity_tokens(self) -> int:
        return self.num_kv_blocks * self.block_size

    @property
    def prefill_chunk(self) -> int:
        return self.token_buckets[-1]

    def prefill_shapes(self) -> list[tuple[int, int, int]]:
        """Every (sequences, tokens, span) prefill graph: B*T within the token budget, span >= T."""
        shapes = []
        for t in self.token_buckets:
            for b in self.batch_buckets:
                if b * t > max(self.max_num_batched_tokens, t):
                    continue
                shapes += [(b, t, s) for s in self.span_buckets if s >= t]
        return shapes

    def decode_shapes(self) -> list[tuple[int, int]]:
        return [(b, s) for b in self.batch_buckets for s in self.span_buckets]

    def max_prefill_seqs(self, t: int) -> int:
        return max(b for b in self.batch_buckets if b * t <= max(self.max_num_batched_tokens, t))


def bucket_for(n: int, buckets: tuple[int, ...]) -> int:
    for b in buckets:
        if b >= n:
            return b
    raise ValueError(f"{n} exceeds the largest bucket {buckets[-1]}")
