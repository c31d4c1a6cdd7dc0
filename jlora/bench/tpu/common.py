"""What every section of `jlora bench tpu` shares: the chip's peaks, the results file, device memory,
the host, and a profile's top device ops."""

from __future__ import annotations

import argparse
import collections
import glob
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

HBM_BYTES_PER_S = 819e9  # TPU v5e
MXU_FLOPS = 197e12  # TPU v5e, bf16
MXU_INT8_OPS = 394e12  # TPU v5e, int8
HBM_BYTES = int(15.75 * 2**30)  # TPU v5e; the chip's own `memory_stats()["bytes_limit"]` wins where there is one


def run_tag(args: argparse.Namespace) -> str:
    """The key results of one shape and quantization live under in results.json."""
    return f"{args.shape}/{args.quantization}"


def is_oom(e: BaseException) -> bool:
    """Out of HBM (fewer sequences may fit). A kernel out of its scoped VMEM at compile time is not:
    fewer sequences do not shrink a kernel's blocks (the 8B's first run retried three times so)."""
    text = f"{type(e).__name__}: {e}"
    if "vmem" in text.lower():
        return False
    return any(k in text for k in ("RESOURCE_EXHAUSTED", "Ran out of memory", "out of memory", "OOM"))


def device_memory() -> dict[str, int]:
    """The first device's allocator stats (bytes_in_use, peak_bytes_in_use, bytes_limit, ...); {} on
    backends without them (XLA:CPU)."""
    import jax

    try:
        stats = jax.devices()[0].memory_stats() or {}
    except Exception:  # noqa: BLE001 (a backend without memory stats)
        stats = {}
    return {k: int(v) for k, v in stats.items() if isinstance(v, (int, float))}


def machine() -> dict[str, Any]:
    """What the host has (cores, memory, free disk where the checkpoints go): a run's context."""
    info: dict[str, Any] = {"cpu_count": os.cpu_count()}
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                key = line.split(":", 1)[0]
                if key in ("MemTotal", "MemAvailable"):
                    info[key] = int(line.split()[1]) * 1024
    except OSError:
        pass
    for where in ("/tmp", "/dev/shm"):
        try:
            info[f"disk_free_{where}"] = shutil.disk_usage(where).free
        except OSError:
            pass
    return info


def load_results(out: Path) -> dict[str, Any]:
    """results.json under `out` ({} when there is none yet)."""
    f = out / "results.json"
    return json.loads(f.read_text()) if f.is_file() else {}


def save_results(out: Path, results: dict[str, Any]) -> None:
    """results.json under `out`, replaced atomically (a run cut off keeps what it measured)."""
    tmp = out / "results.json.tmp"
    tmp.write_text(json.dumps(results, indent=1, default=str))
    os.replace(tmp, out / "results.json")


def profile_top(trace_dir: str, n: int = 20, all_lines: bool = False) -> str:
    """Device time per XLA module and the top device ops of the newest trace under trace_dir (with
    `all_lines`, every line of the device planes: a Pallas kernel's trace regions among them)."""
    from jax.profiler import ProfileData

    files = sorted(glob.glob(os.path.join(trace_dir, "**", "*.xplane.pb"), recursive=True), key=os.path.getmtime)
    if not files:
        return "no trace"
    lines = []
    for plane in ProfileData.from_file(files[-1]).planes:
        if not plane.name.startswith("/device:"):
            continue
        for line in plane.lines:
            total, count = collections.Counter(), collections.Counter()
            for e in line.events:
                total[e.name] += e.duration_ns
                count[e.name] += 1
            if not total or not all_lines and line.name not in ("XLA Modules", "XLA Ops"):
                continue
            lines.append(f"== {plane.name} | {line.name}: {sum(total.values()) / 1e6:.1f} ms")
            for name, ns in total.most_common(n):
                lines.append(f"  {ns / 1e6:9.2f} ms  x{count[name]:<6d} {ns / count[name] / 1e3:9.1f} us  {name[:140]}")
    return "\n".join(lines) or "no device plane"


def np_dtype(name: str) -> Any:
    """NumPy's dtype for "bfloat16" (ml_dtypes') or "float32"."""
    import ml_dtypes

    return {"bfloat16": ml_dtypes.bfloat16, "float32": np.float32}[name]


def tuning_options(args: argparse.Namespace) -> Any:
    """The engine's `TuningOptions` from the flags (`--lora-slices`, `--lora-cond`, `--attn-*`), for
    the engine, warm and layers sections; "auto" keeps the library's default."""
    from jlora.tuning import TuningOptions

    base = TuningOptions()
    changes: dict[str, Any] = dict(lora_slices=args.lora_slices,
                                   lora_cond=None if args.lora_cond == "auto" else args.lora_cond,
                                   seqs_per_program=args.attn_seqs_per_program)
    for flag, field in (("attn_prefill_step", "prefill_step"), ("attn_prefill_round", "prefill_round"),
                        ("attn_block_rows", "max_block_rows")):
        if getattr(args, flag) != "auto":
            changes[field] = getattr(args, flag)
    try:
        return base.replace(**changes)
    except ValueError as e:
        raise SystemExit(f"jlora bench tpu: {e}")


def run_child(argv: list[str], tag: str, retries: int = 1) -> tuple[int, list[str]]:
    """`python -m jlora.bench.tpu ARGV` in a fresh process, its output echoed with `tag`; (rc, its last
    lines). A start refused because the chip is still held (it can be, just after another process
    ends) is tried again after 5 s."""
    cmd = [sys.executable, "-m", "jlora.bench.tpu", *argv]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    for attempt in range(retries + 1):
        time.sleep(1.0)  # the previous process's hold on the chip goes first
        print(f"[{tag}] {' '.join(cmd)}", flush=True)
        t0 = time.perf_counter()
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
        tail: collections.deque[str] = collections.deque(maxlen=400)
        assert proc.stdout is not None
        for line in proc.stdout:
            print(f"[{tag}] {line}", end="", flush=True)
            tail.append(line.rstrip("\n"))
        rc = proc.wait()
        print(f"[{tag}] exit {rc} after {time.perf_counter() - t0:.1f} s", flush=True)
        busy = any(k in ln for ln in tail for k in ("lockfile", "TPU in use", "already in use", "Unable to initialize backend 'tpu'"))
        if rc == 0 or attempt == retries or not busy:
            return rc, list(tail)
        time.sleep(5.0)
    return rc, list(tail)
