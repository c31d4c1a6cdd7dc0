"""`jlora bench start`: what `LLM()` at default sizes costs from a fresh process to its first token.

Cold: empty persistent compile cache and empty weights cache (every cache under a new temporary
directory, through JLORA_CACHE_DIR). Warm: a second fresh process on the same
directories. Each run reports the seconds to the first generated token (from the parent's spawn,
so interpreter start and imports count), where they went (imports, weights, warm-up), and the
graphs compiled (`jlora.compile_stats`) and loaded from the persistent cache.

With --write the table goes into docs/benchmarks.md as its own block, which `jlora bench --write`
keeps (see `jlora.bench.workload`), as it keeps the hand-written analysis below its marker.
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
from typing import Any

from jlora.bench import docs

BEGIN = "<!-- jlora bench start: begin (rewritten by `jlora bench start --write`) -->"
END = "<!-- jlora bench start: end -->"
RESULT_TAG = "JLORA_BENCH_START "

# Runs in the fresh process. Timestamps are wall-clock so the parent's spawn time can be subtracted.
_CHILD = r"""
import json, sys, time
spawn = float(sys.argv[1])
t_start = time.time()
import jax
from jlora import LLM, SamplingParams, compile_stats

events = {"cache_hits": 0, "cache_misses": 0}
def _on_event(event, **_):
    name = event.rsplit("/", 1)[-1]
    if name in events:
        events[name] += 1
jax.monitoring.register_event_listener(_on_event)
t_imported = time.time()
llm = LLM(**json.loads(sys.argv[2]))
t_ready = time.time()
llm.generate(["Hello"], SamplingParams(temperature=0.0, max_tokens=1), use_tqdm=False)
t_first = time.time()
llm.wait_for_warmup()  # a background warm-up's other graphs (at once for the other modes)
t_all = time.time()
table = compile_stats.stage_table()
print("%s" + json.dumps({
    "first_token_s": t_first - spawn, "all_graphs_s": t_all - spawn, "interpreter_s": t_start - spawn, "imports_s": t_imported - t_start,
    "llm_s": t_ready - t_imported, "generate_s": t_first - t_ready, "startup": llm.startup_seconds,
    "weights_cache_hit": llm.weights_cache_hit, "graphs_compiled": sum(n for n, _ in table.values()),
    "compile_s": sum(s for _, s in table.values()), "stages": table, **events,
}), flush=True)
""" % RESULT_TAG


def run_once(root: Path, llm_kwargs: dict[str, Any], timeout: float) -> dict[str, Any]:
    """One fresh process building `LLM(**llm_kwargs)` with its caches under `root`, to its first token."""
    env = dict(os.environ, JLORA_CACHE_DIR=str(root))  # every cache in its folder under root (jlora.caches)
    for var in ("JLORA_WEIGHTS_CACHE", "JLORA_WEIGHTS_CACHE_DIR", "JLORA_ADAPTER_CACHE_DIR", "JLORA_EXECUTABLE_CACHE_DIR"):
        env.pop(var, None)  # the weights cache is part of what a warm start measures, in root
    spawn = time.time()
    proc = subprocess.run([sys.executable, "-c", _CHILD, repr(spawn), json.dumps(llm_kwargs)], env=env,
                          capture_output=True, text=True, timeout=timeout)
    wall = time.time() - spawn
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(RESULT_TAG)]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"the start-up process failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    result = json.loads(lines[-1][len(RESULT_TAG):])
    result["process_s"] = wall
    return result


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Cold then warm start of the eager `LLM()`, and with --lazy of `LLM(warmup=False)` too (own caches)."""
    base: dict[str, Any] = {"progress": False}
    if args.model:
        base["model"] = args.model
    modes = {"eager": {**base, "warmup": True}, **({"lazy": {**base, "warmup": False}} if args.lazy else {}),
             **({"background": {**base, "warmup": "background"}} if args.background else {})}
    runs: dict[str, dict[str, Any]] = {}
    for mode, llm_kwargs in modes.items():
        with tempfile.TemporaryDirectory(prefix="jlora-bench-start-") as tmp:
            for start in ("cold", "warm"):
                print(f"jlora bench start: {mode}, {start} start ...", file=sys.stderr, flush=True)
                runs[f"{mode}, {start}"] = run_once(Path(tmp), llm_kwargs, args.timeout)
    import jlora

    return {"runs": runs, "model": args.model or "default (SmolLM2-135M-Instruct)",
            "version": jlora.__version__, "cpus": os.cpu_count(), "date": time.strftime("%Y-%m-%d")}


def to_markdown(r: dict[str, Any]) -> str:
    lines = [
        "## Start-up (`jlora bench start`)",
        "",
        f"`LLM()` at the default sizes, model {r['model']}, from a fresh process to the first generated token "
        f"(1 token, greedy). Eager: `LLM()`, every graph compiled at start; lazy: `LLM(warmup=False)`, graphs "
        f"compiled on first use; background: `LLM(warmup=\"background\")`, two graphs before the first token, the "
        f"rest while serving (`all graphs`: until they are compiled). Cold: empty compile and weights caches; warm: a second fresh process on the same "
        f"caches. Measured {r['date']} on {r['cpus']} CPU cores, jlora {r['version']}.",
        "",
        "| start | to first token (s) | all graphs (s) | imports (s) | weights (s) | weights cache | warm-up (s) "
        "| graphs | XLA compile or cache load (s) | graphs from the compile cache |",
        "|---|---:|---:|---:|---:|---|---:|---:|---:|---:|",
    ]
    for name, x in r["runs"].items():
        s = x["startup"]
        cache = {True: "hit", False: "miss", None: "off"}[x["weights_cache_hit"]]
        lines.append(f"| {name} | {x['first_token_s']:.1f} | {x.get('all_graphs_s', x['first_token_s']):.1f} "
                     f"| {x['imports_s']:.1f} | {s['load_weights']:.1f} | {cache} "
                     f"| {s.get('warmup', 0.0):.1f} | {x['graphs_compiled']} | {x['compile_s']:.1f} "
                     f"| {x['cache_hits']} |")
    lines += ["", "`graphs` counts every XLA executable the process built or loaded (`jlora.compile_stats`, all "
              "stages); `XLA compile or cache load` is the time inside XLA's compile-or-load call (a compile, or "
              "a persistent-cache lookup and load); the rest of the warm-up is tracing and lowering to HLO, which "
              "a warm start pays in full, and running each graph once. A lazy start compiles inside its first `generate`, so only "
              "`to first token` shows it. Targets (issue 10): cold <= 60 s, "
              "warm <= 10 s, <= 8 graphs."]
    return "\n".join(lines)


def write_block(doc: Path, md: str) -> None:
    """This benchmark's block in `doc` (docs/benchmarks.md), just above the hand-written analysis."""
    docs.write_block(doc, BEGIN, END, md)


def kept_block(text: str) -> str:
    """The start-up block of an existing docs/benchmarks.md (with a blank line after), or ""."""
    return docs.kept_block(text, BEGIN, END)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="jlora bench start", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="model (default: SmolLM2-135M-Instruct)")
    p.add_argument("--lazy", action="store_true", help="also measure the lazy mode, LLM(warmup=False)")
    p.add_argument("--background", action="store_true",
                   help='also measure the background warm-up, LLM(warmup="background") (the default on a TPU)')
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds allowed per start-up process (default: 1800)")
    p.add_argument("--write", action="store_true", help="write the table into docs/benchmarks.md")
    p.add_argument("--json", default=None, help="also dump raw results to this file")
    args = p.parse_args(argv)
    result = run(args)
    md = to_markdown(result)
    print(md)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    if args.write:
        write_block(docs.DOCS / "benchmarks.md", md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
