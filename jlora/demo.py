"""The README's main job: one batch where different prompts use different adapters and the base model."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

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


def run_demo(args: argparse.Namespace) -> int:
    from jlora.cli import check_adapter, check_max_tokens, engine_kwargs, make_llm, startup_summary

    # Everything that needs no model first: a bad flag or a missing adapter costs no compile.
    check_max_tokens(args.max_tokens)
    names = sorted({name for name, _ in DEMO_BATCH if name})
    missing = [n for n in names if not (DEMO_ADAPTERS / n / "adapter_config.json").is_file()]
    if missing:
        raise FileNotFoundError(f"demo adapters {missing} not found under {DEMO_ADAPTERS}")
    for n in names:
        check_adapter(str(DEMO_ADAPTERS / n), flag=f"demo adapter {n!r}")
    kwargs = engine_kwargs(args)

    from jlora import LoRARequest, SamplingParams
    from jlora import compile_stats

    requests = {n: LoRARequest(n, i + 1, str(DEMO_ADAPTERS / n)) for i, n in enumerate(names)}
    t0 = time.time()
    llm = make_llm(args, kwargs)
    print(f"loaded and {'set up (lazy: graphs compile on first use)' if args.lazy else 'warmed up'} "
          f"in {time.time() - t0:.1f}s")
    if args.verbose:
        print(f"[jlora demo: {startup_summary(llm, time.time() - t0)}]", file=sys.stderr)
    conversations = [[{"role": "user", "content": msg}] for _, msg in DEMO_BATCH]
    loras = [requests[name] if name else None for name, _ in DEMO_BATCH]
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    compiles_before = compile_stats.compile_count()
    t0 = time.time()
    outs = llm.chat(conversations, params, lora_request=loras)
    secs = time.time() - t0
    for (name, msg), out in zip(DEMO_BATCH, outs):
        print(f"[{name or 'base model':>12}] {msg}\n{'':>15}-> {out.outputs[0].text.strip()!r}")
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    print(f"\n{len(outs)} requests, {tokens} tokens in {secs:.1f}s ({tokens / secs:.1f} tok/s), "
          f"{compile_stats.compile_count() - compiles_before} compiles after {'start-up' if args.lazy else 'warm-up'}")
    llm.compile_report()
    return 0
