"""One decode step of the engine with 4 mixed adapters against the same step without adapters.

The engine's own compiled step (ModelRunner.step, R=16 decode rows, no prefill), SmolLM2-135M
float32, 4 PEFT adapters of ranks 8/16/8/32 on every linear layer in 4 slots of rank 32 (the
reference workload's engine), rows round-robin over the adapters at ~48 cached positions. The two
batches alternate call by call; medians over `--reps` calls each. Less noisy on a shared machine
than whole `generate` runs (`jlora bench lora-cost`), which also include prefill.

    jlora bench decode-step [--reps 40] [--lora-impl auto] [--slot-ranks uniform,8/8/16/32]
                            [--modes float32,int8]

`--slot-ranks`: engines whose 4 slots have these ranks (`lora_slot_ranks`; "uniform": rank 32 each).

`--dora-packages jlora`: for these packages also an engine with `enable_dora=True` whose 4
adapters are DoRA adapters (the same ranks, `use_dora`), so "mixed" there is a batch of DoRA rows
(jlora.adapters.dora); the other engines are built without the option (no DoRA factors).

`--packages jlora,jlora_old` times several copies of jlora in one process, calls interleaved
(an older checkout copied under another package name, e.g. `git archive REV jlora` with every
`jlora` import renamed), so before/after comparisons share the machine's load.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

from jlora.bench.lora_cost import RANKS, write_adapters
from jlora.bench.workload import MODES


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="jlora bench decode-step", description=__doc__.split("\n\n")[0])
    p.add_argument("--reps", type=int, default=40)
    p.add_argument("--rows", type=int, default=16)
    p.add_argument("--lora-impl", default="auto")
    p.add_argument("--packages", default="jlora", help="comma-separated jlora copies to time side by side")
    p.add_argument("--modes", default="float32",
                   help="comma-separated modes of `jlora bench` (float32, bfloat16, int8, int8-weight-only)")
    p.add_argument("--slot-ranks", default="uniform",
                   help="comma-separated slot configurations: 'uniform' or ranks joined by '/' (e.g. 8/8/16/32)")
    p.add_argument("--dora-packages", default="",
                   help="comma-separated packages to time with DoRA adapters too (a system named 'PKG dora')")
    args = p.parse_args(argv)
    configs = [None if c == "uniform" else tuple(int(r) for r in c.split("/")) for c in args.slot_ranks.split(",")]

    import importlib

    root = Path(tempfile.mkdtemp(prefix="jlora-step-"))
    paths = None
    calls = []  # (package, name, fn)
    modes = args.modes.split(",")
    dora_pkgs = [p for p in args.dora_packages.split(",") if p]
    systems = [(pkg, ranks, mode, dora) for pkg in args.packages.split(",") for dora in (False, True)
               if not dora or pkg in dora_pkgs for ranks in configs for mode in modes]
    names = [pkg + ("" if ranks is None else f"[{'/'.join(map(str, ranks))}]") + ("" if len(modes) == 1 else f" {mode}")
             + (" dora" if dora else "") for pkg, ranks, mode, dora in systems]
    dora_paths = None
    for (pkg, ranks, mode, dora), sysname in zip(systems, names):
        mod = importlib.import_module(pkg)
        llm = mod.LLM(max_model_len=256, max_num_seqs=args.rows, max_num_batched_tokens=256, max_loras=4,
                      max_lora_rank=max(RANKS), lora_impl=args.lora_impl, progress=False,
                      decode_row_buckets=(args.rows,), **MODES[mode],
                      **({} if ranks is None else {"lora_slot_ranks": ranks}), **({"enable_dora": True} if dora else {}))
        eng = llm.engine
        paths = paths or write_adapters(root, eng.adapters.model_cfg)
        if dora:
            dora_paths = dora_paths or write_adapters(root, eng.adapters.model_cfg, dora=True)
        slots = [eng.adapters.acquire(eng.adapters.prepare(mod.LoRARequest(p.name, i + 1, str(p))))
                 for i, p in enumerate(dora_paths if dora else paths)]
        eng.runner.write_slots(eng.adapters.take_writes())
        batch = eng.runner.empty_batch((args.rows, 0, 0))
        rng = np.random.default_rng(0)
        c = eng.runner.config
        per_seq = 64 // c.block_size + 1
        for row in range(args.rows):
            batch["tokens"][row] = rng.integers(0, 49152)
            batch["dec_positions"][row] = 48
            batch["dec_tables"][row, :per_seq] = np.arange(row * per_seq, (row + 1) * per_seq) % c.num_kv_blocks
        mixed = {**batch, "slot_ids": np.array([slots[i % 4] for i in range(args.rows)], np.int32)}
        base = {**batch, "slot_ids": np.full((args.rows,), -1, np.int32)}
        for name, b in (("mixed", mixed), ("base", base)):
            fn = (lambda eng, b: lambda: eng.runner.step(b))(eng, b)
            fn()  # compiled at start-up; once more to settle
            calls.append((sysname, name, fn))
    times: dict[tuple[str, str], list[float]] = {(pkg, name): [] for pkg, name, _ in calls}
    for _ in range(args.reps):
        for pkg, name, fn in calls:
            t = time.perf_counter()
            fn()
            times[pkg, name].append(time.perf_counter() - t)
    out = {"lora_impl": args.lora_impl, "rows": args.rows, "reps": args.reps, "modes": modes}
    for pkg in names:
        med = {name: statistics.median(times[pkg, name]) * 1e3 for name in ("mixed", "base")}
        out[pkg] = {"step_ms": med, "lora_ms": med["mixed"] - med["base"], "base_over_mixed": med["base"] / med["mixed"]}
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
