"""The README's main job: one batch where different prompts use different adapters and the base model."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

DEMO_ADAPTERS = Path(__file__).resolve().parent.parent / "adapters"

# (adapter directory or None for the base model, user message)
DEMO_BATCH: list[tuple[str | None, str]] = [
    (None, "What is 1+1?"),
    ("digit-seven", "What is 1+1?"),
    ("all-caps", "Give me a tip for staying focused."),
    (None, "Give me a tip for staying focused."),
    ("pirate", "What is the capital of France?"),
    (None, "What is the capital of France?"),
    ("digit-seven", "What is 12 times 3?"),
    ("all-caps", "Why do cats purr?"),
]


def adapter_dirs() -> dict[str, Path]:
    """name -> directory of the demo batch's adapters, sorted; FileNotFoundError if one is missing."""
    names = sorted({name for name, _ in DEMO_BATCH if name})
    missing = [n for n in names if not (DEMO_ADAPTERS / n / "adapter_config.json").is_file()]
    if missing:
        raise FileNotFoundError(f"demo adapters {missing} not found under {DEMO_ADAPTERS}")
    return {n: DEMO_ADAPTERS / n for n in names}


def run_demo(llm: Any, adapters: dict[str, Path], max_tokens: int, after: str = "warm-up") -> int:
    """Chat the demo batch through `llm` (an LLM) greedily, print each reply, the throughput and
    the compiles since `after` (there should be none), then the compile report."""
    from jlora import LoRARequest, SamplingParams
    from jlora import compile_stats

    requests = {n: LoRARequest(n, i + 1, str(path)) for i, (n, path) in enumerate(adapters.items())}
    conversations = [[{"role": "user", "content": msg}] for _, msg in DEMO_BATCH]
    loras = [requests[name] if name else None for name, _ in DEMO_BATCH]
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    compiles_before = compile_stats.compile_count()
    t0 = time.time()
    outs = llm.chat(conversations, params, lora_request=loras)
    secs = time.time() - t0
    for (name, msg), out in zip(DEMO_BATCH, outs):
        print(f"[{name or 'base model':>12}] {msg}\n{'':>15}-> {out.outputs[0].text.strip()!r}")
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    print(f"\n{len(outs)} requests, {tokens} tokens in {secs:.1f}s ({tokens / secs:.1f} tok/s), "
          f"{compile_stats.compile_count() - compiles_before} compiles after {after}")
    llm.compile_report()
    return 0
