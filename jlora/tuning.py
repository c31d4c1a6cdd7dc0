"""Tuning options: the engine's performance switches, in one frozen object.

`EngineConfig.tuning` holds a `TuningOptions`; `LLM(..., tuning=TuningOptions(...))` sets it. The
runner binds it into the step graph it jits (each engine its own jit), the scheduler reads it from
its config, and the stored executables' fingerprint includes it (jlora.engine.executables): an
engine built with other options traces, compiles and stores its own graphs. None of these change
what the engine computes, only how fast; the defaults are the measured best on a v5e chip
(docs/tpu.md) and on CPU. `jlora bench tpu` sets them from its flags (`--lora-cond`, ...).

Light to import (no JAX), like `jlora.engine.config`.
"""

from __future__ import annotations

import dataclasses

LORA_SLICES = ("inside", "before")
LORA_CONDS = ("inside", "pass")


def _check_int(name: str, value: object, lo: int, optional: bool = True) -> None:
    if optional and value is None:
        return
    if not isinstance(value, int) or isinstance(value, bool) or value < lo:
        raise ValueError(f"{name} must be {'None or ' if optional else ''}an int >= {lo}, got {value!r}")


@dataclasses.dataclass(frozen=True)
class AttentionOptions:
    """How the Pallas paged-attention kernel (jlora.kernels.paged_attention_tpu) splits its work.
    Hashable: the kernel takes it as a static argument."""

    # Query rows (queries x heads sharing a lane tile) a program takes at most. At the 1B shape's
    # 1,024-token prefill (a v5e chip) 256 rows (the VMEM budget's cap) took 254 us, 128 rows 284
    # and 512 (with a raised VMEM limit) 633.
    max_block_rows: int = 512
    # Decode sequences a program walks one after the other (the largest divisor of B up to this):
    # fewer, longer programs at short contexts. 1 was not beaten on the chip.
    seqs_per_program: int = 1
    # Positions a prefill program computes a step where its chunk is partial, as decode programs
    # do; None or 0: whole chunks. 128-position steps took a 1,024-token prefill step from 46% to
    # 43% of a v5e's MXU (the rescaling outweighed the causal half they skip).
    prefill_step: int | None = None
    # A prefill program's partial chunk is computed as one block of the smallest multiple of this
    # many positions (whole pages) covering the pages it copied; None or 0: the whole chunk. On a
    # v5e chip a 1,024-token prompt took 278 us whole, 253-255 us with 128 or 256.
    prefill_round: int | None = 128
    # Mosaic's scoped VMEM limit in bytes (None: its default, 16 MiB on a v5e; the query-block
    # budget scales with it).
    vmem_limit: int | None = None
    bounds_checks: bool = True  # Mosaic's DMA bounds checks
    sub_block: int | None = None  # positions a skippable compute step covers (None: `compute_block`)
    # Named scopes around each block's wait, scores, softmax, values and finish, which Mosaic lowers
    # to trace regions of a profile (`jlora bench tpu --kernel-profile`).
    trace_regions: bool = False

    def __post_init__(self) -> None:
        _check_int("AttentionOptions.max_block_rows", self.max_block_rows, 1, optional=False)
        _check_int("AttentionOptions.seqs_per_program", self.seqs_per_program, 1, optional=False)
        _check_int("AttentionOptions.prefill_step", self.prefill_step, 0)
        _check_int("AttentionOptions.prefill_round", self.prefill_round, 0)
        _check_int("AttentionOptions.vmem_limit", self.vmem_limit, 1)
        _check_int("AttentionOptions.sub_block", self.sub_block, 1)
        for name in ("bounds_checks", "trace_regions"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"AttentionOptions.{name} must be a bool, got {getattr(self, name)!r}")


@dataclasses.dataclass(frozen=True)
class TuningOptions:
    """The engine's tuning switches (vLLM's CompilationConfig plays this part there)."""

    # Where a LoRA projection slices a layer's slots out of the stacked [L, ...] arrays: "inside" the
    # LoRA conditional (a step without adapter tokens never reads them) or "before" it. On a v5e chip
    # the one-row step graph prefetched the whole stacked gate_up A into VMEM every layer with
    # "inside" (37.6 us a layer, 0.6 ms of a 4.9 ms step); "before" reads one layer's slots a layer.
    lora_slices: str = "inside"
    # What the LoRA conditional (a step without adapter tokens skips LoRA) returns: "pass" computes
    # the base projection before it and passes it through the branch without adapters; "inside"
    # computes it inside both branches, so no [T, out] array passes through (XLA:TPU copies a
    # conditional's pass-through operand). On a v5e chip "inside" made 1,024-token prefill steps 47%
    # / 44% of the MXU without / with 4 adapters against 46% / 41%. None: "inside" on a TPU, "pass"
    # elsewhere (`resolved_lora_cond`).
    lora_cond: str | None = None
    # A prefill shape with fewer sequences wins when it carries at least (1 - this) of the best
    # shape's prompt tokens per token computed: its prompts finish, and start decoding, sooner (64
    # prompts of 1,024 tokens: one a step, not 32 x 32 tokens each of 32 steps). None: the best
    # yield only (jlora.engine.scheduler).
    prefill_slack: float | None = 0.05
    attention: AttentionOptions = AttentionOptions()

    def __post_init__(self) -> None:
        if self.lora_slices not in LORA_SLICES:
            raise ValueError(f"TuningOptions.lora_slices must be one of {LORA_SLICES}, got {self.lora_slices!r}")
        if self.lora_cond is not None and self.lora_cond not in LORA_CONDS:
            raise ValueError(f"TuningOptions.lora_cond must be None or one of {LORA_CONDS}, got {self.lora_cond!r}")
        s = self.prefill_slack
        if s is not None and (isinstance(s, bool) or not isinstance(s, (int, float)) or not 0 <= s < 1):
            raise ValueError(f"TuningOptions.prefill_slack must be None or in [0, 1), got {s!r}")
        if not isinstance(self.attention, AttentionOptions):
            raise ValueError(f"TuningOptions.attention must be an AttentionOptions, got {self.attention!r}")

    def resolved_lora_cond(self, backend: str) -> str:
        """`lora_cond` for this backend: None is "inside" on a TPU, "pass" elsewhere."""
        return self.lora_cond or ("inside" if backend == "tpu" else "pass")

    def replace(self, **changes: object) -> "TuningOptions":
        """A copy with `changes`; keys of `AttentionOptions` go to `attention`."""
        attn_fields = {f.name for f in dataclasses.fields(AttentionOptions)}
        attn = {k: changes.pop(k) for k in list(changes) if k in attn_fields}
        out = dataclasses.replace(self, **changes)
        return dataclasses.replace(out, attention=dataclasses.replace(out.attention, **attn)) if attn else out
