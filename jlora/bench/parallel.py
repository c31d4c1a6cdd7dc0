"""Step time and tokens/s against tensor- and data-parallel sizes, each in a fresh process.

    jlora bench parallel [--sizes 1x1,3x1,1x3] [--devices 3]

Each size (TPxDP) runs in its own process with `--devices` forced CPU devices
(XLA_FLAGS=--xla_force_host_platform_device_count), on the default model with 4 mixed random
adapters (ranks 8/16/8/32, all-linear): 16 prompts x 64 greedy tokens, after warm-up. On one CPU
the "devices" share the same cores, so this is a correctness-shaped number (what partitioning
costs in collectives and per-device overhead), not a speed claim; on real devices the same
command measures scaling.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PROMPTS = 16
NEW_TOKENS = 64
RANKS = (8, 16, 8, 32)


def child(tp: int, dp: int) -> dict:
    import numpy as np

    from jlora import LLM, LoRARequest, SamplingParams
    from jlora.bench.peft_adapters import ALL_LINEAR, write_peft_adapter
    from jlora.models.loading import read_model_config

    cfg = read_model_config()
    root = Path(tempfile.mkdtemp())
    rng = np.random.default_rng(0)
    loras = [LoRARequest(f"a{i}", i + 1, str(write_peft_adapter(root / f"a{i}", cfg, r, ALL_LINEAR, rng)))
             for i, r in enumerate(RANKS)]
    t0 = time.perf_counter()
    llm = LLM(tensor_parallel_size=tp, data_parallel_size=dp, max_loras=4, max_lora_rank=32, progress=False)
    start = time.perf_counter() - t0
    prompts = [f"Write a short note number {i} about the sea." for i in range(PROMPTS)]
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    reqs = [loras[i % len(loras)] for i in range(PROMPTS)]
    llm.generate(prompts[:4], SamplingParams(max_tokens=4), reqs[:4], use_tqdm=False)  # adapters into the slots
    runner = llm.runners[0]
    steps = {"n": 0, "s": 0.0}
    step = runner.step

    def timed(batch):
        t = time.perf_counter()
        out = step(batch)
        steps["n"] += 1
        steps["s"] += time.perf_counter() - t
        return out

    runner.step = timed
    t = time.perf_counter()
    outs = llm.generate(prompts, params, reqs, use_tqdm=False)
    wall = time.perf_counter() - t
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    report = llm.memory_report()
    return {"tp": tp, "dp": dp, "tok_s": tokens / wall, "step_ms": 1e3 * steps["s"] / max(steps["n"], 1),
            "start_s": start, "per_device_mb": max(r["total"] for r in report["per_device"].values()) / 1e6}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="jlora bench parallel", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", default="1x1,3x1,1x3", help="comma-separated TPxDP sizes")
    p.add_argument("--devices", type=int, default=3, help="forced CPU devices per process")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        tp, dp = (int(x) for x in args.child.split("x"))
        print("RESULT " + json.dumps(child(tp, dp)), flush=True)
        return 0
    env = dict(os.environ, XLA_FLAGS=f"--xla_force_host_platform_device_count={args.devices}", JAX_PLATFORMS="cpu")
    rows = []
    for size in args.sizes.split(","):
        proc = subprocess.run([sys.executable, "-m", "jlora.bench.parallel", "--child", size,
                               "--devices", str(args.devices)], capture_output=True, text=True, env=env)
        lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
        if proc.returncode or not lines:
            print(f"{size}: failed\n{proc.stderr[-2000:]}", file=sys.stderr)
            return 1
        rows.append(json.loads(lines[-1][len("RESULT "):]))
    print(f"{'TP x DP':<8} {'tok/s':>7} {'step ms':>8} {'start s':>8} {'MB/device':>10}")
    for r in rows:
        print(f"{r['tp']} x {r['dp']:<4} {r['tok_s']:7.1f} {r['step_ms']:8.1f} {r['start_s']:8.1f} {r['per_device_mb']:10.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
