"""EngineConfig: capacities and the static bucket sets every compiled graph is drawn from."""

from __future__ import annotations

import dataclasses
from typing import Any

from jlora.sampling_params import DEFAULT_MAX_N
from jlora.tuning import TuningOptions


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


SCHEDULING_POLICIES = ("adapter_aware", "fcfs")
# Paged attention: "xla" (kernels/attention.py, every backend), "pallas" (kernels/paged_attention_tpu.py,
# a TPU kernel; interpreted elsewhere, for tests), "auto" = pallas on a single TPU device, else xla.
ATTN_IMPLS = ("auto", "xla", "pallas")
# What the KV cache stores: "auto" = the model's dtype; "int8" = int8 keys and values with a float32
# scale a position and KV head (jlora.kernels.kv_quant): about half the bytes a token of bf16.
KV_CACHE_DTYPES = ("auto", "int8")


def check_kv_cache_dtype(value: object) -> str:
    """`kv_cache_dtype` as stored ("auto" for None); ValueError naming the option otherwise."""
    if value is None:
        return "auto"
    if not isinstance(value, str) or value not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {list(KV_CACHE_DTYPES)} (None = 'auto', the model's "
                         f"dtype), got {value!r}")
    return value


def default_max_cpu_loras(max_loras: int) -> int:
    """The host cache's default size (the one default, for EngineConfig and AdapterManager): four
    converted adapters per device slot, at least 8, so a working set a few times the slots swaps
    in without reconverting."""
    return max(4 * max_loras, 8)


BASE_GRAPHS = ("none", "decode", "all")  # EngineConfig.base_graphs


def check_lora_target_modules(value: Any, where: str = "EngineConfig.lora_target_modules") -> tuple[str, ...] | None:
    """EngineConfig.lora_target_modules checked: None, or decoder module names (PEFT's) as a tuple in
    LORA_MODULES order; None also when they name every packed projection (the default's slots).
    ValueError listing the known names."""
    if value is None:
        return None
    from jlora.models.config import LORA_MODULES, PACKED_MODULES, VOCAB_MODULES  # imports JAX: only when set

    if isinstance(value, (str, bytes)) or not all(isinstance(m, str) for m in value):
        raise ValueError(f"{where} must be None or a sequence of module names, got {value!r}; "
                         f"known: {list(LORA_MODULES)}")
    names = set(value)
    vocab = sorted(names & set(VOCAB_MODULES))
    if vocab:
        raise ValueError(f"{where} names {vocab}: embedding / output-head LoRA slots come with "
                         f"enable_embedding_lora=True, not {where}; known: {list(LORA_MODULES)}")
    unknown = sorted(names - set(LORA_MODULES))
    if unknown or not names:
        raise ValueError(f"{where}: " + (f"unknown modules {unknown}" if unknown else "no module named")
                         + f"; known: {list(LORA_MODULES)}")
    if all(names & set(subs) for subs in PACKED_MODULES.values()):
        return None
    return tuple(m for m in LORA_MODULES if m in names)


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """Engine sizes. Every step is one graph keyed only by the shape of its prefill part
    (`prefill_shapes()`: sequences x chunk length) or, for a decode-only step, by its row bucket;
    attention loops over the keys it needs, so no graph is keyed by span (`step_shapes()`)."""

    max_model_len: int = 2048  # prompt + generated tokens per sequence
    max_num_seqs: int = 16  # sequences running at once: the decode rows of every step
    max_num_batched_tokens: int = 512  # the longest prefill chunk in one step
    max_loras: int = 4  # device slots
    max_lora_rank: int = 64
    # Each slot's rank, for slots of several sizes: an adapter of rank r takes the smallest free
    # slot of rank >= r, and the LoRA math reads each slot's own lanes only (its cost grows with
    # the sum of the slot ranks, not max_loras x max_lora_rank). None: every slot max_lora_rank.
    # Sorted ascending; the largest must be max_lora_rank.
    lora_slot_ranks: tuple[int, ...] | None = None
    # LoRA on embed_tokens / lm_head (jlora.models.vocab_lora): every slot gets vocabulary-sized room
    # ([V, R] + [R, V] per slot: 102 MB more for SmolLM2's 4 slots of rank 64 in float32), and steps
    # whose rows have such an adapter add the per-row deltas. Off: such adapters are refused by name.
    enable_embedding_lora: bool = False
    # DoRA adapters (use_dora; jlora.adapters.dora): every slot pool gets a float32 factor per output
    # column ("M", [L, N, out]) and every LoRA projection of every step multiplies by it, DoRA rows
    # or not. Off (as vLLM's opt-in LoRA features): no "M", no factor in any graph, and DoRA adapters
    # are refused by name. On a v5e chip LoRA's cost in a plain mixed batch rose from 3.2-6.2% to
    # 10.6-10.7% when every engine carried the factor; likely the factor, not isolated (docs/tpu.md).
    enable_dora: bool = False
    # The decoder modules (PEFT names: q_proj, ..., down_proj) the slots hold LoRA for; a packed
    # projection (q|k|v, gate|up) with any of them named keeps lanes for all its sub-modules. The
    # other projections run without LoRA math and read no slot: q_proj, v_proj slots are qkv only,
    # a fifth of every decoder module's bytes at the Llama-3.2-1B shape. Adapters targeting a module
    # outside them are refused by name. None: every decoder module.
    lora_target_modules: tuple[str, ...] | None = None
    max_cpu_loras: int | None = None  # host cache of converted adapters; None = default_max_cpu_loras(max_loras)
    lora_impl: str = "auto"
    block_size: int = 16  # KV cache positions per block
    num_kv_blocks: int | None = None  # KV capacity; None = max_num_seqs full-length sequences
    token_buckets: tuple[int, ...] | None = None  # prefill chunk lengths; None = 32, 128, ... (x4) up to the chunk
    # Key positions attention reads per loop iteration; None = 128 for the XLA loop, and for the
    # Pallas kernel `paged_attention_tpu.default_chunk`: 1,024 where a chunk's K and V buffers fit
    # 4 MiB of VMEM (rows of 1 KB or less, as at the 1B shape), else 512 (docs/tpu.md).
    attn_chunk: int | None = None
    attn_impl: str = "auto"  # ATTN_IMPLS
    # Plan and launch step n+1 before step n's tokens reach the host (vLLM's --async-scheduling);
    # None = on for a TPU backend, off elsewhere. Outputs do not change (LLMEngine.step).
    async_scheduling: bool | None = None
    # Decode rows of a decode-only step; None = 1, 4, 16, ... (x4) up to max_num_seqs. Measured
    # (SmolLM2, 2 cores): 36 ms with 1 row, 48 ms with 4, 85 ms with 16, so light loads get small
    # steps for one graph per bucket. A step with a prefill part has max_num_seqs rows.
    decode_row_buckets: tuple[int, ...] | None = None
    scheduling_policy: str = "adapter_aware"  # or "fcfs": see LLMEngine._admit
    max_overtakes: int = 16  # adapter_aware: how often a waiting sequence may be passed over
    max_n: int = DEFAULT_MAX_N  # samples per request (SamplingParams.n): n sequences are queued at once
    # Sequences waiting for admission; past it add_request raises QueueFullError. None: unbounded
    # (an offline LLM.generate queues its whole list); the server sets a bound.
    max_waiting_seqs: int | None = None
    # Reuse the KV blocks of prompt prefixes already computed under the same adapter version
    # (jlora.engine.prefix_cache); changes block tables only, never a graph.
    enable_prefix_caching: bool = True
    # Which step shapes also get a graph without LoRA, run when no row of the step has an adapter:
    # "none", "decode" (the decode-only shapes) or "all". A shape with such a twin computes LoRA
    # for every row of its LoRA graph (rows without an adapter read zeros); one without skips the
    # LoRA math of an adapter-free step with conditionals, which on a v5e chip cost more than the
    # math (a one-row layer pass: 2.80 ms without slots, 4.42 with them and no adapter token, 3.19
    # computing LoRA for every row; v5e, 2026-12-06). Outputs do not change.
    base_graphs: str = "none"
    # How the step graphs are built and prefill shapes chosen (jlora.tuning): performance only,
    # outputs do not change. Part of the stored executables' key.
    tuning: TuningOptions = TuningOptions()
    # Size the KV cache to this share of the device's memory (its allocator's bytes_limit) once the
    # weights are placed, less the LoRA slots: num_kv_blocks is what is left (vLLM's
    # gpu_memory_utilization); the rest of the memory is the steps' temporaries. None: num_kv_blocks
    # (default max_num_seqs full-length sequences). A backend without a memory limit (XLA:CPU) keeps
    # that default. LLM() does the sizing (jlora.engine.kv_plan.size_kv_cache).
    kv_cache_memory_fraction: float | None = None
    # KV_CACHE_DTYPES: "auto" (the model's dtype) or "int8" (jlora.kernels.kv_quant).
    kv_cache_dtype: str = "auto"

    def __post_init__(self) -> None:
        object.__setattr__(self, "kv_cache_dtype", check_kv_cache_dtype(self.kv_cache_dtype))
        f = self.kv_cache_memory_fraction
        if f is not None and (isinstance(f, bool) or not isinstance(f, (int, float)) or not 0 < f <= 1):
            raise ValueError(f"EngineConfig.kv_cache_memory_fraction must be None or in (0, 1], got {f!r}")
        if not isinstance(self.tuning, TuningOptions):
            raise ValueError(f"EngineConfig.tuning must be a jlora.tuning.TuningOptions, got {self.tuning!r}")
        if self.max_cpu_loras is None and isinstance(self.max_loras, int):
            object.__setattr__(self, "max_cpu_loras", default_max_cpu_loras(self.max_loras))
        for name in ("max_model_len", "max_num_seqs", "max_num_batched_tokens", "max_loras",
                     "max_lora_rank", "max_cpu_loras", "block_size"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"EngineConfig.{name} must be a positive int, got {getattr(self, name)!r}")
        if self.attn_chunk is not None and (not isinstance(self.attn_chunk, int) or isinstance(self.attn_chunk, bool)
                                            or self.attn_chunk < 1):
            raise ValueError(f"EngineConfig.attn_chunk must be None or a positive int, got {self.attn_chunk!r}")
        if self.async_scheduling not in (None, True, False):
            raise ValueError(f"EngineConfig.async_scheduling must be None, True or False, got {self.async_scheduling!r}")
        if self.attn_impl not in ATTN_IMPLS:
            raise ValueError(f"EngineConfig.attn_impl must be one of {ATTN_IMPLS}, got {self.attn_impl!r}")
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(f"EngineConfig.scheduling_policy must be one of {SCHEDULING_POLICIES}, "
                             f"got {self.scheduling_policy!r}")
        if not isinstance(self.max_n, int) or isinstance(self.max_n, bool) or self.max_n < 1:
            raise ValueError(f"EngineConfig.max_n must be a positive int, got {self.max_n!r}")
        w = self.max_waiting_seqs
        if w is not None and (not isinstance(w, int) or isinstance(w, bool) or w < self.max_n):
            raise ValueError(f"EngineConfig.max_waiting_seqs must be None or an int >= max_n={self.max_n} "
                             f"(one request of n samples must fit), got {w!r}")
        if self.base_graphs not in BASE_GRAPHS:
            raise ValueError(f"EngineConfig.base_graphs must be one of {BASE_GRAPHS}, got {self.base_graphs!r}")
        if not isinstance(self.enable_embedding_lora, bool):
            raise ValueError(f"EngineConfig.enable_embedding_lora must be a bool, got {self.enable_embedding_lora!r}")
        if not isinstance(self.enable_dora, bool):
            raise ValueError(f"EngineConfig.enable_dora must be a bool, got {self.enable_dora!r}")
        object.__setattr__(self, "lora_target_modules", check_lora_target_modules(self.lora_target_modules))
        if not isinstance(self.enable_prefix_caching, bool):
            raise ValueError(f"EngineConfig.enable_prefix_caching must be a bool, got {self.enable_prefix_caching!r}")
        if not isinstance(self.max_overtakes, int) or self.max_overtakes < 0:
            raise ValueError(f"EngineConfig.max_overtakes must be an int >= 0, got {self.max_overtakes!r}")
        ranks = self.lora_slot_ranks
        if ranks is not None:
            if (isinstance(ranks, (str, bytes)) or not all(isinstance(r, int) and not isinstance(r, bool) and r >= 1
                                                           for r in ranks)):
                raise ValueError(f"EngineConfig.lora_slot_ranks must be None or positive ints, got {ranks!r}")
            ranks = tuple(sorted(ranks))
            if len(ranks) != self.max_loras:
                raise ValueError(f"EngineConfig.lora_slot_ranks has {len(ranks)} entries but max_loras={self.max_loras} "
                                 f"(one rank per slot)")
            if ranks[-1] != self.max_lora_rank:
                raise ValueError(f"EngineConfig.lora_slot_ranks={ranks}: the largest must equal "
                                 f"max_lora_rank={self.max_lora_rank}")
            object.__setattr__(self, "lora_slot_ranks", None if len(set(ranks)) == 1 else ranks)
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
            object.__setattr__(self, "token_buckets", geometric_buckets(min(32, chunk), chunk, factor=4))
        rows = (geometric_buckets(1, self.max_num_seqs, factor=4) if self.decode_row_buckets is None
                else tuple(self.decode_row_buckets))
        object.__setattr__(self, "decode_row_buckets", tuple(sorted(set(rows))))
        if self.decode_row_buckets[0] < 1 or self.decode_row_buckets[-1] != self.max_num_seqs:
            raise ValueError(f"EngineConfig.decode_row_buckets={rows} must be positive and end at "
                             f"max_num_seqs={self.max_num_seqs}")
        b = tuple(self.token_buckets)
        object.__setattr__(self, "token_buckets", b)
        if list(b) != sorted(set(b)) or b[-1] != chunk or b[0] < 1 or not all(isinstance(x, int) for x in b):
            raise ValueError(f"EngineConfig.token_buckets={b} must be increasing positive ints ending at "
                             f"min(max_num_batched_tokens, max_model_len)={chunk}")

    @property
    def lora_modules(self) -> tuple[str, ...]:
        """The PEFT modules the engine's LoRA state holds: the decoder's linear layers (those of the
        packed projections `lora_target_modules` names, all with None), and embed_tokens / lm_head
        with enable_embedding_lora."""
        # here: importing this file loads no model code
        from jlora.models.config import LORA_MODULES, PACKED_MODULES, VOCAB_MODULES

        named = self.lora_target_modules or LORA_MODULES
        held = tuple(m for subs in PACKED_MODULES.values() if set(subs) & set(named) for m in subs)
        return held + (VOCAB_MODULES if self.enable_embedding_lora else ())

    @property
    def slot_ranks(self) -> tuple[int, ...]:
        """Every slot's rank, ascending."""
        return self.lora_slot_ranks or (self.max_lora_rank,) * self.max_loras

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    @property
    def kv_capacity_tokens(self) -> int:
        return self.num_kv_blocks * self.block_size

    @property
    def prefill_chunk(self) -> int:
        return self.token_buckets[-1]

    @property
    def blocks_per_seq(self) -> int:  # width of a block table
        return self.blocks_for(self.max_model_len)

    def prefill_shapes(self) -> tuple[tuple[int, int], ...]:
        """(sequences, chunk length) of every prefill part a step can carry: one sequence at each
        chunk bucket, and as many sequences as fit the token budget at each bucket below it (a
        burst of short prompts goes in one step)."""
        shapes = []
        for q in self.token_buckets:
            p = min(self.max_num_seqs, max(1, self.max_num_batched_tokens // q))
            shapes += [(p, q), (1, q)] if p > 1 else [(1, q)]
        return tuple(shapes)

    def step_shapes(self) -> tuple[tuple[int, int, int], ...]:
        """Every step graph as (decode rows, prefill sequences, prefill chunk): the decode-only steps
        (R, 0, 0) for each row bucket, then (max_num_seqs, P, Q) for each of `prefill_shapes()`."""
        return (tuple((r, 0, 0) for r in self.decode_row_buckets)
                + tuple((self.max_num_seqs, p, q) for p, q in self.prefill_shapes()))

    def base_graph_shapes(self) -> tuple[tuple[int, int, int], ...]:
        """The step shapes that also get a graph without LoRA (`base_graphs`)."""
        if self.base_graphs == "all":
            return self.step_shapes()
        return tuple((r, 0, 0) for r in self.decode_row_buckets) if self.base_graphs == "decode" else ()

    def step_graphs(self) -> tuple[tuple[tuple[int, int, int], bool], ...]:
        """Every step graph as (shape, with LoRA): each of `step_shapes()` with LoRA, then the
        `base_graph_shapes()` without."""
        return (tuple((s, True) for s in self.step_shapes())
                + tuple((s, False) for s in self.base_graph_shapes()))

    def first_graphs(self) -> tuple[tuple[tuple[int, int, int], bool], ...]:
        """The two step graphs that can run every step on their own: the most decode rows, and one
        prompt's full chunk beside them, both with LoRA (padding rows and tokens cost compute, never
        correctness). A background warm-up compiles these before serving and the rest after."""
        return ((self.max_num_seqs, 0, 0), True), ((self.max_num_seqs, 1, self.prefill_chunk), True)

    @property
    def num_step_graphs(self) -> int:
        return len(self.step_graphs())


def bucket_for(n: int, buckets: tuple[int, ...]) -> int:
    for b in buckets:
        if b >= n:
            return b
    raise ValueError(f"{n} exceeds the largest bucket {buckets[-1]}")
