"""`jlora bench adapters`: S-LoRA's many-adapter experiment on this machine, side by side in one run.

K distinct rank-8 adapters on q/k/v/o (PEFT directories written here: `adapter_config.json` and
`adapter_model.safetensors` with PEFT's key names), requests drawn uniformly or with power-law
popularity (p(i) ~ 1 / (i + 1), alpha = 1). Two measurements per (K, popularity, slots):

- throughput: every request queued at once; output tokens/s, relative to K = 1 (all requests on
  one adapter) with the same slot count;
- latency: Poisson arrivals at a fixed rate (a fraction of the K = 1 throughput); time to first
  token p50 / p99, from each request's arrival.

Also the decode step's time against `max_loras` at a fixed batch (16 rows), so the cost of slots
that the batch does not use shows. Adapters are converted on first use into a temporary disk cache
(as `LLM(adapter_cache=...)` would), so conversion is part of what is measured.

`--write` puts the tables into docs/benchmarks.md (between this benchmark's own markers, below the
hand-written analysis that `jlora bench --write` keeps) and the chart into docs/bench_adapters.svg.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from jlora.bench.docs import DOCS, write_block
from jlora.bench.peft_adapters import ATTENTION, write_peft_adapter
from jlora.engine_args import target_modules_flag
from jlora.plot import bar_chart_svg

BEGIN = "<!-- jlora bench adapters: begin (rewritten by `jlora bench adapters --write`) -->"
END = "<!-- jlora bench adapters: end -->"
MODULES = ATTENTION
RANK = 8


def write_peft_adapters(root: Path, model_cfg: Any, k: int, rank: int = RANK, seed: int = 0,
                        modules: tuple[str, ...] = MODULES) -> list[Path]:
    """`k` PEFT LoRA directories `root/adapter0000`, ... of `rank` on `modules` (default q/k/v/o; see
    `peft_adapters`)."""
    rng = np.random.default_rng(seed)
    return [write_peft_adapter(root / f"adapter{a:04d}", model_cfg, rank, modules, rng) for a in range(k)]


def draw_adapters(k: int, n: int, popularity: str, rng: np.random.Generator) -> list[int]:
    """Adapter index of each of `n` requests: uniform over k, or power-law (alpha = 1) over k."""
    if popularity == "uniform":
        return rng.integers(0, k, n).tolist()
    p = 1.0 / np.arange(1, k + 1)
    return rng.choice(k, size=n, p=p / p.sum()).tolist()


def _stats_delta(llm: Any, before: dict[str, int]) -> dict[str, int]:
    """Adapter counters moved since `before`. Runs share one disk cache (as engines on one machine
    would), so an adapter converted in an earlier run is a disk-cache hit in a later one."""
    now = llm.engine.adapters.stats
    return {k: now[k] - before.get(k, 0) for k in ("conversions", "disk_cache_hits", "slot_writes", "evictions")}


def run_queued(llm: Any, prompts: list[list[int]], loras: list[Any], params: Any) -> dict[str, Any]:
    """All requests queued at once: output tokens/s over the whole run (conversion included), and
    output tokens per CPU second of this process (all its threads): on a machine shared with other
    work the wall-clock ratio moves with their load, the CPU-time one much less."""
    before = dict(llm.engine.adapters.stats)
    t, cpu = time.perf_counter(), time.process_time()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, lora_request=loras, use_tqdm=False)
    secs, cpu = time.perf_counter() - t, time.process_time() - cpu
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    return {"tok_s": tokens / secs, "seconds": secs, "tok_cpu_s": tokens / cpu, "cpu_seconds": cpu,
            **_stats_delta(llm, before)}


def run_poisson(llm: Any, prompts: list[list[int]], loras: list[Any], params: Any, rate: float,
                rng: np.random.Generator) -> dict[str, Any]:
    """Poisson arrivals at `rate` requests/s, driven through the engine: TTFT from each arrival."""
    engine = llm.engine
    arrivals = np.cumsum(rng.exponential(1.0 / rate, len(prompts)))
    t0 = time.perf_counter()
    arrived: dict[str, float] = {}
    ttft: dict[str, float] = {}
    nxt = 0
    while nxt < len(prompts) or engine.has_unfinished():
        now = time.perf_counter() - t0
        while nxt < len(prompts) and arrivals[nxt] <= now:
            rid = engine.add_request({"prompt_token_ids": prompts[nxt]}, params, loras[nxt])
            arrived[rid] = t0 + arrivals[nxt]
            nxt += 1
        if not engine.has_unfinished():
            time.sleep(max(0.0, arrivals[nxt] - (time.perf_counter() - t0)))
            continue
        for out in engine.step():
            if out.request_id not in ttft and out.outputs[0].token_ids:
                ttft[out.request_id] = time.perf_counter() - arrived[out.request_id]
            if out.finished:
                engine.pop_finished(out.request_id)
    lat = sorted(ttft.values())
    return {"ttft_p50_s": float(np.percentile(lat, 50)), "ttft_p99_s": float(np.percentile(lat, 99)),
            "requests": len(lat)}


def decode_step_ms(llm: Any, prompts: list[list[int]], loras: list[Any], steps: int = 20) -> float:
    """Median time of one decode step with len(prompts) rows, once every row is decoding."""
    from jlora import SamplingParams
    from jlora.engine.sequence import SeqState

    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=steps + 8, ignore_eos=True)
    ids = [engine.add_request({"prompt_token_ids": p}, params, lr) for p, lr in zip(prompts, loras)]
    while engine.waiting or any(s.state is not SeqState.DECODE for s in engine.running):
        engine.step()
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t)
    for rid in ids:
        engine.abort(rid)
        engine.pop_finished(rid)
    return 1000 * statistics.median(times)


def run(args: argparse.Namespace) -> dict[str, Any]:
    from jlora import LLM, LoRARequest, SamplingParams, compile_stats
    from jlora.bench.workload import make_prompts

    root = Path(tempfile.mkdtemp(prefix="jlora-bench-adapters-"))
    result: dict[str, Any] = {"runs": [], "step_ms": {}, "args": vars(args)}
    try:
        llms: dict[int, Any] = {}

        def get_llm(n: int) -> Any:
            if n not in llms:
                llms[n] = LLM(max_model_len=256, max_num_seqs=args.max_num_seqs, max_loras=n, max_lora_rank=RANK,
                              adapter_cache=root / "cache", progress=False,
                              decode_row_buckets=args.decode_row_buckets or None,
                              lora_target_modules=args.lora_target_modules)
            return llms[n]

        model_cfg = get_llm(args.slots[0]).model.cfg
        t = time.perf_counter()
        paths = write_peft_adapters(root / "adapters", model_cfg, max(*args.ks, args.max_num_seqs),
                                    modules=args.lora_target_modules or MODULES)
        result["write_adapters_s"] = time.perf_counter() - t
        tokenizer = get_llm(args.slots[0]).tokenizer
        prompts = make_prompts(tokenizer, args.requests, 16, 64)
        params = SamplingParams(temperature=0.0, max_tokens=args.new_tokens, ignore_eos=True)
        next_id = iter(range(1, 10**9))

        def requests_for(k: int, popularity: str, seed: int) -> list[Any]:
            # Fresh names and ids per run, so no run starts with another's adapters resident or cached.
            tag = f"k{k}-{popularity}-{seed}"
            idx = draw_adapters(k, args.requests, popularity, np.random.default_rng(seed))
            reqs = {i: LoRARequest(f"{tag}-a{i}", next(next_id), str(paths[i])) for i in set(idx)}
            return [reqs[i] for i in idx]

        for n in dict.fromkeys(args.slots + args.step_slots):  # build and warm every engine before counting
            llm = get_llm(n)
            llm.generate([{"prompt_token_ids": p} for p in prompts[:4]], params,
                         lora_request=requests_for(1, "uniform", 0)[:4], use_tqdm=False)
        compiles_before = compile_stats.compile_count()

        for n in args.slots:
            llm = get_llm(n)
            for k in args.ks:
                for popularity in (("uniform",) if k == 1 else ("uniform", "power-law")):
                    print(f"bench adapters: slots={n} K={k} {popularity}", flush=True)
                    row = {"slots": n, "k": k, "popularity": popularity}
                    row.update(run_queued(llm, prompts, requests_for(k, popularity, 1), params))
                    result["runs"].append(row)
        for row in result["runs"]:
            base = next(r for r in result["runs"] if r["slots"] == row["slots"] and r["k"] == 1)
            row["vs_k1"] = row["tok_s"] / base["tok_s"]
            row["vs_k1_cpu"] = row["tok_cpu_s"] / base["tok_cpu_s"]

        # Latency under Poisson arrivals, at the largest slot count (--load 0: none).
        n = max(args.slots)
        llm = get_llm(n)
        base = next(r for r in result["runs"] if r["slots"] == n and r["k"] == 1)
        rate = args.load * base["tok_s"] / args.new_tokens
        result["poisson_rate"] = rate
        result["poisson_slots"] = n
        for row in [r for r in result["runs"] if r["slots"] == n and rate > 0]:
            print(f"bench adapters: Poisson {rate:.2f} req/s K={row['k']} {row['popularity']}", flush=True)
            reqs = requests_for(row["k"], row["popularity"], 2)
            row.update(run_poisson(llm, prompts, reqs, params, rate, np.random.default_rng(3)))

        # Decode step time against max_loras at a fixed 16-row batch.
        rows = prompts[: args.max_num_seqs]
        for n in args.step_slots:
            print(f"bench adapters: decode step, max_loras={n}", flush=True)
            llm = get_llm(n)
            entry = {"lora_state_mb": sum(x.nbytes for leaf in llm.engine.runner.lora_state.values()
                                          for x in leaf.values()) / 1e6,
                     "none": decode_step_ms(llm, rows, [None] * len(rows))}
            for distinct in (1, 4, 16):
                if distinct <= min(n, len(rows)):
                    reqs = [LoRARequest(f"step{n}-{distinct}-a{i}", next(next_id), str(paths[i]))
                            for i in range(distinct)]
                    entry[f"{distinct} adapters"] = decode_step_ms(
                        llm, rows, [reqs[i % distinct] for i in range(len(rows))])
            result["step_ms"][n] = entry
            if n not in args.slots:
                del llms[n]
        result["compiles_after_warmup"] = compile_stats.compile_count() - compiles_before
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return result


def to_markdown(r: dict[str, Any]) -> str:
    a = r["args"]
    lines = [
        "## Many adapters (`jlora bench adapters`)",
        "",
        f"S-LoRA's experiment on this machine: K distinct rank-{RANK} adapters on q/k/v/o (PEFT files written by "
        f"the benchmark), {a['requests']} requests of 16-64 prompt tokens and {a['new_tokens']} new tokens "
        f"(greedy, EOS ignored), {a['max_num_seqs']} running sequences, adapters drawn uniformly or with power-law "
        f"popularity (alpha = 1). Throughput: all requests queued at once, relative to K = 1 (every request on one "
        f"adapter) at the same slot count; conversions (into a fresh disk cache) and slot writes are part of the "
        f"time. `tok/CPU-s`: output tokens per CPU second of the benchmark's process (all threads), the ratio "
        f"that moves least when other work shares the machine. "
        + (f"TTFT: Poisson arrivals at {r['poisson_rate']:.2f} requests/s ({a['load']:.0%} of the K = 1 "
           f"throughput) with {r['poisson_slots']} slots." if a["load"] > 0 else "No TTFT runs (--load 0)."),
        "",
        "Every run uses fresh adapter names, so each starts with nothing in its slots or host cache; all runs "
        "share one disk cache of converted adapters (as engines on one machine would), so an adapter "
        "converted in an earlier run is read from it later: `converted` and `from disk cache` count both.",
        "",
        "| K adapters | popularity | slots (max_loras) | tok/s | vs K = 1 | tok/CPU-s | vs K = 1 | slot writes | "
        "converted | from disk cache | TTFT p50 s | TTFT p99 s |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for x in r["runs"]:
        ttft = (f"{x['ttft_p50_s']:.2f} | {x['ttft_p99_s']:.2f}" if "ttft_p50_s" in x else "- | -")
        lines.append(f"| {x['k']} | {x['popularity']} | {x['slots']} | {x['tok_s']:.1f} | {x['vs_k1']:.2f}x | "
                     f"{x['tok_cpu_s']:.1f} | {x['vs_k1_cpu']:.2f}x | "
                     f"{x['slot_writes']} | {x['conversions']} | {x['disk_cache_hits']} | {ttft} |")
    lines += ["", "![Many adapters: throughput relative to one adapter](bench_adapters.svg)"]
    if not r["step_ms"]:
        return "\n".join(lines + ["", f"XLA compilations after warm-up: {r['compiles_after_warmup']}.",
                                   *([r["note"]] if r.get("note") else [])])
    lines += ["", f"Decode step time (ms, median of 20 steps) with {a['max_num_seqs']} rows against `max_loras` "
              f"(rank {RANK}, `lora_impl=\"auto\"`):", ""]
    kinds = ["none", "1 adapters", "4 adapters", "16 adapters"]
    lines += ["| max_loras | LoRA state MB | no adapter | 1 adapter | 4 adapters | 16 adapters |",
              "|---:|---:|---:|---:|---:|---:|"]
    for n, e in r["step_ms"].items():
        cells = [f"{e[k]:.1f}" if k in e else "-" for k in kinds]
        lines.append(f"| {n} | {e['lora_state_mb']:.0f} | " + " | ".join(cells) + " |")
    lines += ["", f"XLA compilations after warm-up during all of the above: {r['compiles_after_warmup']}.",
              *([r["note"]] if r.get("note") else [])]
    return "\n".join(lines)


def write_plot(r: dict[str, Any], path: Path) -> None:
    labels = [f"K={x['k']} {x['popularity']}, {x['slots']} slots" for x in r["runs"]]
    path.write_text(bar_chart_svg("Many adapters: throughput relative to K = 1 (higher is better)", labels,
                                  [x["vs_k1"] for x in r["runs"]], "x", reference=0.8,
                                  reference_label="0.8x (target)"))


def write_docs(md: str, docs: Path = DOCS) -> None:
    """This benchmark's block in docs/benchmarks.md, below the hand-written analysis."""
    write_block(docs / "benchmarks.md", BEGIN, END, md, above_analysis=False)


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="jlora bench adapters", description=__doc__.split("\n\n")[0])
    p.add_argument("--ks", type=_ints, default=[1, 8, 64, 256, 1024], help="adapter counts K (comma-separated)")
    p.add_argument("--slots", type=_ints, default=[4, 16], help="max_loras values for the throughput runs")
    p.add_argument("--step-slots", type=_ints, default=[4, 16, 64],
                   help="max_loras values for the step-time table ('': no table)")
    p.add_argument("--requests", type=int, default=96)
    p.add_argument("--new-tokens", type=int, default=24)
    p.add_argument("--max-num-seqs", type=int, default=16)
    p.add_argument("--decode-row-buckets", type=_ints, default=[],
                   help="LLM(decode_row_buckets=...), ending at --max-num-seqs (default: the engine's)")
    p.add_argument("--load", type=float, default=0.7,
                   help="Poisson rate as a fraction of the K = 1 throughput (0: no TTFT runs)")
    p.add_argument("--lora-target-modules", type=target_modules_flag, default=None,
                   help="comma-separated decoder modules the slots hold (LLM(lora_target_modules=...)); the "
                        "adapters then target exactly these (default: slots for every module, adapters on q/k/v/o)")
    p.add_argument("--write", action="store_true", help="write docs/benchmarks.md's block and docs/bench_adapters.svg")
    p.add_argument("--json", default=None, help="also dump raw results to this file")
    args = p.parse_args(argv)
    if 1 not in args.ks:
        p.error("--ks must include 1 (the reference every K is compared with)")
    result = run(args)
    md = to_markdown(result)
    print(md)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2, default=str))
    if args.write:
        write_docs(md)
        write_plot(result, DOCS / "bench_adapters.svg")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
