"""The cost of LoRA inside the engine: jlora with 4 mixed adapters against jlora without adapters.

The reference workload (docs/benchmarks.md) without the transformers baselines (so it needs no torch and
runs against any jlora checkout): SmolLM2-135M float32, 16 requests of 16-64 prompt tokens, 64
new tokens, greedy, EOS ignored, 4 PEFT adapters of ranks 8/16/8/32 on all linear layers,
round-robin; one engine (max_loras=4, max_lora_rank=32); both systems timed in interleaved
rounds in one process, median (and best) per system. The number to compare across versions is the ratio
mixed / base (absolute tok/s move with the machine's load).

    jlora bench lora-cost [--rounds 3] [--lora-impl auto] [--slot-ranks uniform,8/8/16/32]

`--slot-ranks` times engines whose 4 slots have these ranks (`LLM(lora_slot_ranks=...)`; "uniform":
every slot rank 32) side by side, each with and without adapters.

`--packages jlora,jlora_old` runs several copies of jlora in one process, rounds interleaved
(an older checkout copied under another package name, every `jlora` import renamed), so a
before/after comparison shares the machine's load.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

from jlora.bench.peft_adapters import ALL_LINEAR, write_peft_adapter

RANKS = (8, 16, 8, 32)


def write_adapters(root: Path, cfg, ranks=RANKS, dora: bool = False) -> list[Path]:
    """PEFT directories, one per rank, every linear layer targeted (see `peft_adapters`); `dora`: DoRA ones."""
    kind = "dora" if dora else "cost"
    return [write_peft_adapter(root / f"{kind}{i}-r{r}", cfg, r, ALL_LINEAR, np.random.default_rng(i), dora=dora)
            for i, r in enumerate(ranks)]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="jlora bench lora-cost", description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--requests", type=int, default=16)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--lora-impl", default="auto")
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--packages", default="jlora", help="comma-separated jlora copies to time side by side")
    p.add_argument("--slot-ranks", default="uniform",
                   help="comma-separated slot configurations: 'uniform' or ranks joined by '/' (e.g. 8/8/16/32)")
    args = p.parse_args(argv)
    configs = [None if c == "uniform" else tuple(int(r) for r in c.split("/")) for c in args.slot_ranks.split(",")]

    import importlib

    from jlora.bench.workload import make_prompts

    root = Path(tempfile.mkdtemp(prefix="jlora-lora-cost-"))
    params, prompts, paths, runs = None, None, None, []  # runs: (package, system, fn)
    systems = [(pkg, ranks) for pkg in args.packages.split(",") for ranks in configs]
    names = [pkg if ranks is None else f"{pkg}[{'/'.join(map(str, ranks))}]" for pkg, ranks in systems]
    for (pkg, ranks), sysname in zip(systems, names):
        mod = importlib.import_module(pkg)
        extra = {} if ranks is None else {"lora_slot_ranks": ranks}
        llm = mod.LLM(max_model_len=args.max_model_len, max_num_seqs=16, max_num_batched_tokens=512, max_loras=4,
                      max_lora_rank=max(RANKS), lora_impl=args.lora_impl, progress=False, **extra)
        paths = paths or write_adapters(root, llm.engine.adapters.model_cfg)
        reqs = [mod.LoRARequest(p.name, i + 1, str(p)) for i, p in enumerate(paths)]
        prompts = prompts or [{"prompt_token_ids": ids} for ids in make_prompts(llm.tokenizer, args.requests, 16, 64)]
        params = mod.SamplingParams(temperature=0.0, max_tokens=args.new_tokens, ignore_eos=True)
        per_prompt = [reqs[i % len(reqs)] for i in range(len(prompts))]

        def run(loras, llm=llm, params=params) -> int:
            outs = llm.generate(prompts, params, lora_request=loras, use_tqdm=False)
            return sum(len(o.outputs[0].token_ids) for o in outs)

        run(per_prompt)  # adapters into their slots (not timed)
        runs += [(sysname, "mixed", lambda run=run, p=per_prompt: run(p)), (sysname, "base", lambda run=run: run(None))]
    counters = {n: importlib.import_module(f"{pkg}.compile_stats") for (pkg, _), n in zip(systems, names)}
    before = {pkg: c.compile_count() for pkg, c in counters.items()}
    secs: dict[tuple[str, str], list[float]] = {(pkg, name): [] for pkg, name, _ in runs}
    tokens: dict[tuple[str, str], int] = {}
    for _ in range(args.rounds):  # interleaved, so drifting load hits every system alike
        for pkg, name, fn in runs:
            t = time.perf_counter()
            tokens[pkg, name] = fn()
            secs[pkg, name].append(time.perf_counter() - t)
    out: dict = {"lora_impl": args.lora_impl, "rounds": args.rounds}
    for pkg in names:
        tok_s = {n: tokens[pkg, n] / statistics.median(secs[pkg, n]) for n in ("mixed", "base")}
        best = {n: tokens[pkg, n] / min(secs[pkg, n]) for n in ("mixed", "base")}  # least disturbed round
        out[pkg] = {"tok_s": tok_s, "mixed_over_base": tok_s["mixed"] / tok_s["base"], "best_tok_s": best,
                    "best_mixed_over_base": best["mixed"] / best["base"],
                    "seconds": {n: secs[pkg, n] for n in ("mixed", "base")},
                    "compiles_after_warmup": counters[pkg].compile_count() - before[pkg]}
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
