"""Kernel micro-benchmark: gather vs laned vs grouped (and pallas on an accelerator).

Every shape compiles each implementation once, then times them interleaved (one call of each
per round, so drifting load on a shared machine hits all of them alike) and keeps the median
per implementation. `auto` is what `choose_impl` picks for the shape; it is the same compiled
code as the picked implementation, so its time is that implementation's time.

Slot ids: decode shapes (T <= 64) give every token its own uniformly random id in [-1, N);
prefill shapes give each 64-token sequence one uniformly random id in [-1, N).

    jlora bench kernels            # the documented grid, writes docs/kernels.md
    jlora bench kernels --quick    # a few tiny shapes, prints only
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jlora.bench.docs import DOCS
from jlora.kernels.dispatch import choose_impl
from jlora.kernels.gather import lora_delta_gather
from jlora.kernels.grouped import lora_delta_grouped
from jlora.kernels.laned_dense import lora_delta_laned
from jlora.kernels.pallas import lora_delta_pallas

BEGIN, END = "<!-- bench:begin -->", "<!-- bench:end -->"
SEQ_LEN = 64  # prefill: tokens per sequence (one slot each)


class Shape(NamedTuple):
    t: int  # tokens
    d: int  # in features
    o: int  # out features
    n: int  # slots
    r: int  # rank

    @property
    def regime(self) -> str:
        return "decode" if self.t <= 64 else "prefill"


def full_grid() -> list[Shape]:
    """The documented subset of T x D=O x N x R (the full product is 180 shapes, too slow here).

    decode  T in {8, 16, 64},  D=O in {576, 4096},        N in {1, 4, 16, 64}, R in {8, 16, 64}
    prefill T = 512,           D=O in {576, 2048, 4096},  N in {1, 4, 16, 64}, R in {8, 16, 64}
    prefill T = 2048,          D=O in {576, 2048},        N in {1, 4, 16, 64}, R in {8, 64}
    prefill T = 2048,          D=O = 4096,                N in {4, 64},        R = 8
    (T=2048 at D=O=4096 is sampled only: gather alone takes 10-20 s per call there at R=64.)
    """
    out = []
    for t in (8, 16, 64):
        out += [Shape(t, d, d, n, r) for d in (576, 4096) for n in (1, 4, 16, 64) for r in (8, 16, 64)]
    out += [Shape(512, d, d, n, r) for d in (576, 2048, 4096) for n in (1, 4, 16, 64) for r in (8, 16, 64)]
    out += [Shape(2048, d, d, n, r) for d in (576, 2048) for n in (1, 4, 16, 64) for r in (8, 64)]
    out += [Shape(2048, 4096, 4096, n, 8) for n in (4, 64)]
    return out


def quick_grid() -> list[Shape]:
    return [Shape(8, 576, 576, 1, 8), Shape(8, 576, 576, 16, 16), Shape(512, 576, 576, 4, 16)]


def make_inputs(s: Shape, dtype, seed: int = 0):
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal((s.t, s.d)), dtype)
    a = jnp.asarray(rng.standard_normal((s.n, s.d, s.r)) / math.sqrt(s.d), dtype)
    b = jnp.asarray(rng.standard_normal((s.n, s.r, s.o)) / math.sqrt(s.r), dtype)
    if s.regime == "decode":
        ids = rng.integers(-1, s.n, s.t)
    else:
        ids = np.repeat(rng.integers(-1, s.n, -(-s.t // SEQ_LEN)), SEQ_LEN)[: s.t]
    return x, a, b, jnp.asarray(ids, jnp.int32)


def impls_for(backend: str, names: list[str] | None) -> dict[str, Callable]:
    fns: dict[str, Callable] = {"gather": lora_delta_gather, "laned": lora_delta_laned, "grouped": lora_delta_grouped}
    if backend != "cpu":  # interpret mode on CPU measures the interpreter, not the kernel
        fns["pallas"] = lambda x, a, b, s: lora_delta_pallas(x, a, b, s, interpret=False)
    if names:
        unknown = sorted(set(names) - set(fns))
        if unknown:
            raise ValueError(f"--impls: unknown or unavailable on {backend}: {unknown} (have {sorted(fns)})")
        fns = {k: v for k, v in fns.items() if k in names}
    return fns


def time_shape(fns: dict[str, Callable], args, *, min_reps: int, max_reps: int, budget_s: float) -> dict[str, float]:
    """Median seconds per implementation over interleaved rounds; reps sized to the budget.

    Within a round each implementation runs once untimed, then once timed: the untimed call
    absorbs what the previous implementation left behind (gather frees hundreds of MB at large
    shapes, and the next call's first touch of fresh pages measured up to 10x slower here).
    """
    for f in fns.values():  # compile + warm up
        jax.block_until_ready(f(*args))
    times: dict[str, list[float]] = {k: [] for k in fns}

    def one_round():
        for k, f in fns.items():
            jax.block_until_ready(f(*args))
            t0 = time.perf_counter()
            jax.block_until_ready(f(*args))
            times[k].append(time.perf_counter() - t0)

    one_round()
    per_round = 2 * sum(v[0] for v in times.values())
    reps = max(min_reps, min(max_reps, int(budget_s / max(per_round, 1e-6))))
    for _ in range(reps - 1):
        one_round()
    return {k: statistics.median(v) for k, v in times.items()}


def _fmt_ms(sec: float | None) -> str:
    if sec is None:
        return "-"
    ms = sec * 1e3
    return f"{ms:.3f}" if ms < 1 else f"{ms:.2f}" if ms < 100 else f"{ms:.0f}"


def summarize(rows: list[dict]) -> dict:
    """Target checks and crossovers from the measured rows."""
    ratio = [r["gather"] / r["auto"] for r in rows if r.get("gather")]
    prefill = [r for r in rows if r["t"] > 64 and r.get("gather")]
    small = [r for r in prefill if r["n"] * r["r"] <= 256]
    out = {
        "shapes": len(rows),
        "auto_vs_gather_min": min(ratio) if ratio else None,
        "prefill_min_speedup": min((r["gather"] / r["auto"] for r in prefill), default=None),
        "prefill_small_nr_min_speedup": min((r["gather"] / r["auto"] for r in small), default=None),
        "auto_is_best": sum(r["auto_impl"] == r["best"] for r in rows),
        "auto_within_5pct_of_best": sum(r["auto"] <= 1.05 * r[r["best"]] for r in rows),
    }
    # laned -> grouped crossover: per T, the N*R values where each of them measured faster.
    cross = {}
    for t in sorted({r["t"] for r in rows}):
        lw = sorted({r["n"] * r["r"] for r in rows if r["t"] == t and "laned" in r and r["laned"] <= r.get("grouped", math.inf)})
        gw = sorted({r["n"] * r["r"] for r in rows if r["t"] == t and "grouped" in r and r["grouped"] < r.get("laned", math.inf)})
        cross[t] = {"laned_wins_at_NR": lw, "grouped_wins_at_NR": gw}
    out["crossover"] = cross
    return out


def markdown(rows: list[dict], impls: list[str], meta: dict, summary: dict) -> str:
    lines = [
        f"Measured {meta['date']} on `{meta['backend']}` ({meta['device']}), dtype {meta['dtype']}, "
        f"{meta['seconds']:.0f} s total. Times in ms (median of interleaved rounds); `x gather` is "
        "gather's time over auto's."
        + (" The auto columns were re-derived from these timings with the current `choose_impl` "
           "(`--from-json`)." if meta.get("rerendered") else ""),
        "",
        "| regime | T | D=O | N | R | N*R | " + " | ".join(impls) + " | best | auto | x gather |",
        "|---|---:|---:|---:|---:|---:|" + "---:|" * len(impls) + "---|---|---:|",
    ]
    for r in rows:
        cells = " | ".join(_fmt_ms(r.get(k)) for k in impls)
        speed = f"{r['gather'] / r['auto']:.1f}" if r.get("gather") else "-"
        lines.append(
            f"| {r['regime']} | {r['t']} | {r['d']} | {r['n']} | {r['r']} | {r['n'] * r['r']} | {cells} "
            f"| {r['best']} | {r['auto_impl']} | {speed} |"
        )
    s = summary
    lines.append("")
    if s["auto_vs_gather_min"] is not None:
        lines.append(f"- auto vs gather, worst shape: {s['auto_vs_gather_min']:.2f}x (target >= 0.95x)")
    if s["prefill_min_speedup"] is not None:
        lines.append(f"- prefill, worst shape: {s['prefill_min_speedup']:.1f}x (target >= 3x)")
    if s["prefill_small_nr_min_speedup"] is not None:
        lines.append(f"- prefill with N*R <= 256, worst shape: {s['prefill_small_nr_min_speedup']:.1f}x (target >= 10x)")
    lines.append(
        f"- auto picked the measured best at {s['auto_is_best']}/{s['shapes']} shapes, "
        f"within 5% of it at {s['auto_within_5pct_of_best']}/{s['shapes']}"
    )
    return "\n".join(lines) + "\n"


def write_section(path: Path, body: str) -> None:
    """Replace the text between the bench markers in `path` (create the file if needed)."""
    text = path.read_text() if path.exists() else "# Kernels\n\n## Measurements\n\n" + BEGIN + "\n" + END + "\n"
    if BEGIN not in text or END not in text:
        text = text.rstrip() + "\n\n## Measurements\n\n" + BEGIN + "\n" + END + "\n"
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(head + BEGIN + "\n" + body + END + tail)


def plot(rows: list[dict], impls: list[str], path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, ax = plt.subplots(figsize=(max(8, len(rows) * 0.12), 4))
    xs = np.arange(len(rows))
    for k in impls:
        ax.plot(xs, [r["gather"] / r[k] if r.get(k) else np.nan for r in rows], ".", label=k)
    ax.plot(xs, [r["gather"] / r["auto"] for r in rows], "k_", label="auto")
    ax.set_yscale("log")
    ax.axhline(1.0, color="gray", lw=0.5)
    ax.set_ylabel("speedup over gather")
    ax.set_xlabel("shape (table order)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return True


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="jlora bench kernels", description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="a few tiny shapes; prints, writes nothing unless --out")
    p.add_argument("--out", default=None, help="markdown file to update (default docs/kernels.md; none with --quick)")
    p.add_argument("--plot", default=None, help="PNG plot path (default docs/kernels.png; skipped without matplotlib)")
    p.add_argument("--json", default=None, help="also write the raw rows as JSON here")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--impls", default=None, help="comma-separated subset of gather,laned,grouped,pallas")
    p.add_argument("--max-reps", type=int, default=25)
    p.add_argument("--min-reps", type=int, default=3)
    p.add_argument("--budget", type=float, default=1.0, help="target seconds of timing per shape")
    p.add_argument("--max-seconds", type=float, default=900, help="stop starting new shapes after this long")
    p.add_argument("--from-json", default=None, help="re-render a --json run with the current choose_impl; no timing")
    args = p.parse_args(argv)
    if args.from_json:
        return _rerender(args)

    backend = jax.default_backend()
    fns = impls_for(backend, args.impls.split(",") if args.impls else None)
    if "gather" not in fns:
        raise ValueError("--impls must include gather (every ratio is against it)")
    names = list(fns)
    dtype = jnp.dtype(args.dtype)
    grid = quick_grid() if args.quick else full_grid()
    out = Path(args.out) if args.out else (None if args.quick else DOCS / "kernels.md")
    plot_path = Path(args.plot) if args.plot else (None if out is None else out.with_suffix(".png"))

    start = time.perf_counter()
    rows: list[dict] = []
    for i, s in enumerate(grid):
        if time.perf_counter() - start > args.max_seconds:
            print(f"stopping: --max-seconds {args.max_seconds:.0f} reached, {len(grid) - i} shapes not run", file=sys.stderr)
            break
        inputs = make_inputs(s, dtype, seed=i)
        med = time_shape(fns, inputs, min_reps=args.min_reps, max_reps=args.max_reps, budget_s=args.budget)
        row = _with_auto({"regime": s.regime, **s._asdict(), **med, "best": min(med, key=med.get)}, backend)
        auto_impl = row["auto_impl"]
        if row["auto"] is None:  # auto picked an impl that was not timed (e.g. --impls subset)
            row["auto"] = time_shape({"auto": _auto_fn(auto_impl)}, inputs, min_reps=3, max_reps=3, budget_s=0)["auto"]
        rows.append(row)
        cells = "  ".join(f"{k}={_fmt_ms(med[k])}" for k in names)
        print(f"[{i + 1}/{len(grid)}] {s.regime:7s} T={s.t:<5d} D=O={s.d:<5d} N={s.n:<3d} R={s.r:<3d} {cells}  "
              f"auto={auto_impl} x{row['gather'] / row['auto']:.2f}", flush=True)

    summary = summarize(rows)
    meta = {
        "date": time.strftime("%Y-%m-%d"),
        "backend": backend,
        "device": str(jax.devices()[0].device_kind),
        "dtype": args.dtype,
        "seconds": time.perf_counter() - start,
    }
    text = markdown(rows, names, meta, summary)
    print()
    print(text)
    print("crossovers (N*R where each measured faster, per T):")
    for t, c in summary["crossover"].items():
        print(f"  T={t}: laned {c['laned_wins_at_NR']}  grouped {c['grouped_wins_at_NR']}")
    if out is not None:
        write_section(out, text)
        print(f"wrote {out}")
    if plot_path is not None:
        print(f"wrote {plot_path}" if plot(rows, names, plot_path) else "matplotlib not installed: no plot")
    if args.json:
        Path(args.json).write_text(json.dumps({"meta": meta, "summary": summary, "rows": rows}, indent=1, default=str))
    return 0


def _with_auto(row: dict, backend: str) -> dict:
    """`auto` columns for a timed row: choose_impl's pick and that impl's measured time."""
    impl = choose_impl(row["t"], row["d"], row["o"], row["n"], row["r"], backend)
    return {**row, "auto_impl": impl, "auto": row.get(impl)}


def _rerender(args) -> int:
    """Rebuild the table of a previous --json run with the current choose_impl (no timing).

    auto is the same compiled code as the impl it picks, so its time is that impl's measured
    time; this lets the crossovers be tuned from one measurement without rerunning it.
    """
    data = json.loads(Path(args.from_json).read_text())
    meta = {**data["meta"], "rerendered": True}
    names = [k for k in ("gather", "laned", "grouped", "pallas") if k in data["rows"][0]]
    rows = [_with_auto(r, meta["backend"]) for r in data["rows"]]
    missing = sorted({r["auto_impl"] for r in rows if r["auto"] is None})
    if missing:
        raise ValueError(f"--from-json: choose_impl picks {missing}, which that run did not time")
    summary = summarize(rows)
    text = markdown(rows, names, meta, summary)
    print(text)
    out = Path(args.out) if args.out else DOCS / "kernels.md"
    write_section(out, text)
    print(f"wrote {out}")
    if args.json:
        Path(args.json).write_text(json.dumps({"meta": meta, "summary": summary, "rows": rows}, indent=1, default=str))
    return 0


def _auto_fn(impl: str) -> Callable:
    from jlora.kernels.dispatch import lora_delta

    return lambda x, a, b, s: lora_delta(x, a, b, s, impl=impl)


if __name__ == "__main__":
    raise SystemExit(main())
