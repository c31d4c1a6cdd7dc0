"""Start-up and load sections of `jlora bench tpu`: the streaming loader alone in fresh processes
(`load`), the TPU runtime's start (`runtime`), and a warm second start of the engine (`warm`)."""

from __future__ import annotations

import argparse
import collections
import json
import os
import shutil
import subprocess
import sys
import threading
import time
import tracemalloc
from pathlib import Path
from typing import Any

import numpy as np

from jlora.bench.tpu.common import (HBM_BYTES, device_memory, load_results, np_dtype, run_child, run_tag,
                                    save_results)
from jlora.bench.tpu.shapes import SHAPES, shape_bytes
from jlora.bench.tpu.workloads import engine_sizes, make_llm, ready_then_all, weights_cache_dir


class RssSampler:
    """This process's resident set sampled every few ms in a thread (Linux /proc/self/status): the peak
    of VmRSS and of its anonymous part (RssAnon: what is not file or shared pages) above where it
    started. Fields a kernel (or gVisor) does not report stay None."""

    FIELDS = ("VmRSS", "RssAnon", "RssFile", "RssShmem")

    def __init__(self, every_s: float = 0.005):
        self.every_s = every_s
        self.start_values = self._read()
        self.peak = dict(self.start_values)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    @classmethod
    def _read(cls) -> dict[str, int | None]:
        got: dict[str, int | None] = {k: None for k in cls.FIELDS}
        try:
            with open("/proc/self/status") as f:
                for line in f:
                    key = line.split(":", 1)[0]
                    if key in got:
                        got[key] = int(line.split()[1]) * 1024
        except OSError:
            pass
        return got

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            for k, v in self._read().items():
                if v is not None:
                    self.peak[k] = max(self.peak[k] or 0, v)

    def __enter__(self) -> "RssSampler":
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join()

    def result(self) -> dict[str, int | None]:
        out: dict[str, int | None] = {}
        for k in self.FIELDS:
            s, p = self.start_values[k], self.peak[k]
            out[f"sampled_peak_{k}"] = p
            out[f"sampled_peak_added_{k}"] = None if s is None or p is None else p - s
        return out


def load_child(args: argparse.Namespace) -> int:
    """One load of the checkpoint (`--load-child cold|warm|direct`) in this fresh process; prints
    `RESULT {json}` (see `bench_load`)."""
    t0 = time.perf_counter()
    import jax
    from flax import nnx

    from jlora.models import weights_cache as wc
    from jlora.models.random_checkpoint import measure_load

    jax.devices()
    init_s = time.perf_counter() - t0
    ckpt = Path(args.dir) / args.shape
    mode = args.load_child
    q = None if args.quantization == "none" else args.quantization
    cache_dir = weights_cache_dir(args) if mode in ("cold", "warm") else False
    hash_s = 0.0
    if cache_dir:  # the sources' digests (memoized under the cache): a cold load's first step, timed apart
        th = time.perf_counter()
        wc.model_key(ckpt, np.dtype(np_dtype(args.dtype)), wc.open_cache(cache_dir), q)
        hash_s = time.perf_counter() - th
    # NumPy reports its buffers to tracemalloc: the host heap's peak without the mmapped file, a
    # bound VmRSS cannot give where the kernel (gVisor) splits no RssAnon out (XLA's own host
    # buffers are not counted).
    tracemalloc.start()
    heap_start = tracemalloc.get_traced_memory()[0]
    with RssSampler() as rss:
        model, stats = measure_load(ckpt, args.dtype, q, weights_cache=cache_dir)
    heap_peak_added = tracemalloc.get_traced_memory()[1] - heap_start
    tracemalloc.stop()
    mem = device_memory()
    by_dtype: dict[str, int] = collections.Counter()
    largest_float = 0
    for x in jax.tree.leaves(nnx.state(model, nnx.Param)):
        by_dtype[str(x.dtype)] += int(x.nbytes)
        if x.dtype not in (np.int8,):
            largest_float = max(largest_float, int(x.nbytes))
    res = dict(mode=mode, shape=args.shape, quantization=args.quantization, dtype=args.dtype,
               seconds_with_hash=stats["seconds"] + hash_s, hash_s=hash_s, jax_init_s=init_s, **stats,
               **rss.result(), numpy_heap_peak_added_bytes=heap_peak_added, device_bytes_by_dtype=dict(by_dtype),
               largest_float_array_bytes=largest_float,
               device_memory=mem,
               device_peak_over_final_bytes=(mem["peak_bytes_in_use"] - mem["bytes_in_use"]
                                             if "peak_bytes_in_use" in mem and "bytes_in_use" in mem else None),
               cpu_count=os.cpu_count())
    print("RESULT " + json.dumps(res), flush=True)
    return 0


# One fresh process of the runtime section: "runtime" times JAX's TPU start and a 512 MB transfer
# each way; "imports" the modules LLM() imports (the engine, the loader, the tokenizer) without a
# backend; "both" the two side by side, as LLM() does (`jlora.engine.startup.start_backend`).
_RUNTIME_CHILD = r"""
import json, os, sys, time
mode = sys.argv[1]
t0 = time.perf_counter()
import jax, numpy as np
t1 = time.perf_counter()
r = dict(mode=mode, premapped=os.environ.get("TPU_PREMAPPED_BUFFER_SIZE", "default"), import_jax_s=t1 - t0)
if mode == "runtime":
    jax.devices()
    r["runtime_s"] = time.perf_counter() - t1
    x = np.ones((512 << 20) // 2, np.float16)
    puts = []
    for _ in range(3):
        t = time.perf_counter()
        jax.device_put(x).block_until_ready()
        puts.append(time.perf_counter() - t)
    y = jax.device_put(x).block_until_ready()
    t = time.perf_counter()
    np.asarray(y)
    r.update(put_512mb_s=puts, get_512mb_s=time.perf_counter() - t)
elif mode == "imports":
    import jlora.engine.llm_engine, jlora.models.loading, jlora.tokenizer
    r["imports_s"] = time.perf_counter() - t1
else:
    from jlora.llm import start_backend
    wait = start_backend()
    import jlora.engine.llm_engine, jlora.models.loading, jlora.tokenizer
    r["imports_s"] = time.perf_counter() - t1
    r["runtime_s"] = wait()
    r["both_s"] = time.perf_counter() - t1
print("RUNTIME " + json.dumps(r), flush=True)
"""


def bench_runtime(args: argparse.Namespace, out: Path, results: dict[str, Any]) -> dict[str, Any]:
    """The TPU runtime's start in fresh processes, for each `--premapped-sizes` value of
    TPU_PREMAPPED_BUFFER_SIZE (the host buffer libtpu pins at its start; "default": unset), with a
    512 MB transfer each way (a transfer larger than the buffer takes a slower path); then LLM()'s
    imports alone and beside the runtime's start."""
    rows = results.setdefault("runtime", [])
    runs = [("runtime", size) for size in args.premapped_sizes.split(",")] + [("imports", "default"),
                                                                             ("both", "default")]
    for mode, size in runs:
        env = {k: v for k, v in os.environ.items() if k != "TPU_PREMAPPED_BUFFER_SIZE"}
        if size != "default":
            env["TPU_PREMAPPED_BUFFER_SIZE"] = size
        proc = subprocess.run([sys.executable, "-c", _RUNTIME_CHILD, mode], env=env, capture_output=True, text=True,
                              timeout=300)
        got = [ln for ln in proc.stdout.splitlines() if ln.startswith("RUNTIME ")]
        if proc.returncode or not got:
            print(f"runtime {mode} (premapped {size}): FAILED {proc.returncode}: {proc.stderr[-1500:]}", flush=True)
            rows.append(dict(mode=mode, premapped=size, error=proc.stderr[-1500:]))
            continue
        row = json.loads(got[-1][len("RUNTIME "):])
        rows.append(row)
        print(f"runtime {mode} (premapped {size}): " + ", ".join(
            f"{k} {v:.2f}" if isinstance(v, float) else f"{k} {v}" for k, v in row.items() if k.endswith("_s")
            and not isinstance(v, list)) + (f", put 512 MB {min(row['put_512mb_s']):.2f} s" if "put_512mb_s" in row
                                            else ""), flush=True)
        save_results(out, results)
    return results


def bench_load(args: argparse.Namespace, out: Path, results: dict[str, Any]) -> dict[str, Any]:
    """Each of `--load-modes` in a fresh process (`load_child`): cold first (the weights cache
    emptied), then warm (filled by cold), direct (no cache)."""
    tag = run_tag(args)
    res = results.setdefault(tag, {}).setdefault("load", {})
    need = shape_bytes(SHAPES[args.shape], 2 if args.dtype == "bfloat16" else 4, args.quantization)["weights"]
    if need > HBM_BYTES:  # one v5e chip's memory
        res["skipped"] = f"{need / 1e9:.2f} GB of weights do not fit {HBM_BYTES / 1e9:.2f} GB of HBM"
        print(f"load {tag}: skipped: {res['skipped']}", flush=True)
        return results
    for mode in args.load_modes.split(","):
        if mode == "cold":
            shutil.rmtree(weights_cache_dir(args), ignore_errors=True)
        argv = ["--shape", args.shape, "--dir", args.dir, "--out", args.out, "--dtype", args.dtype,
                "--quantization", args.quantization, "--load-child", mode]
        rc, tail = run_child(argv, f"load {mode}")
        got = [json.loads(ln[len("RESULT "):]) for ln in tail if ln.startswith("RESULT ")]
        results = load_results(out)
        res = results.setdefault(tag, {}).setdefault("load", {})
        if rc or not got:
            res[mode] = {"error": f"rc {rc}", "tail": tail[-30:]}
        else:
            r = got[-1]
            res[mode] = r
            gb = lambda v: "n/a" if v is None else f"{v / 1e9:.2f} GB"  # noqa: E731
            print(f"load {tag} {mode}: {r['seconds']:.1f} s (+{r['hash_s']:.1f} s hashing the checkpoint), peak host "
                  f"RSS +{gb(r['peak_added_bytes'])} above the start (reset: {r['peak_reset']}; sampled: VmRSS "
                  f"+{gb(r['sampled_peak_added_VmRSS'])}, anonymous +{gb(r['sampled_peak_added_RssAnon'])}; "
                  f"Python and NumPy heap +{gb(r.get('numpy_heap_peak_added_bytes'))}), device "
                  f"{gb(r['device_bytes'])} {r['device_bytes_by_dtype']}, device peak over final "
                  f"{gb(r['device_peak_over_final_bytes'])}, JAX start {r['jax_init_s']:.1f} s", flush=True)
        save_results(out, results)
    return results


# ---- the quantized projections alone ------------------------------------------------------------------


def warm_section(args: argparse.Namespace, ckpt: Path, out: Path, results: dict[str, Any]) -> None:
    """A second start of the engine section's engine in a fresh process, its compile, weights and
    executable caches filled: seconds to ready and to every graph, what the caches gave."""
    tag = run_tag(args)
    eng = results.get(tag, {}).get("engine", {})
    from jax._src import xla_bridge

    # `--max-num-seqs auto` without an engine section's sizes asks the device for its memory: that
    # starts the TPU runtime here, before the timed LLM(), which then finds it started.
    t_sizes, started_before = time.perf_counter(), xla_bridge.backends_are_initialized()
    try:
        sizes = engine_sizes(args) if not eng else dict(
            max_num_seqs=eng["max_num_seqs"], num_kv_blocks=eng["num_kv_blocks"],
            max_num_batched_tokens=eng["max_num_batched_tokens"], token_buckets=tuple(eng["token_buckets"]),
            decode_row_buckets=tuple(eng["decode_row_buckets"]))
    except ValueError as e:  # the model does not fit this device at all
        print(f"warm {tag}: skipped: {e}", flush=True)
        return
    from jlora import compile_stats

    # From before the TPU runtime's start: LLM() starts it in a thread beside its imports.
    runtime_before_llm = (None if started_before or not xla_bridge.backends_are_initialized()
                          else time.perf_counter() - t_sizes)
    if runtime_before_llm is not None:
        print(f"warm {tag}: the runtime was started before LLM() to size the engine ({runtime_before_llm:.1f} s, "
              f"not in the start's seconds; give --max-num-seqs, --num-kv-blocks to keep it in)", flush=True)
    sampler = None
    if args.sample_stacks:
        from jlora.bench.stack_sampler import StackSampler

        sampler = StackSampler().start()
    t1, n0 = time.perf_counter(), compile_stats.compile_count()
    llm = make_llm(ckpt, args, sizes)
    res = results.setdefault(tag, {})
    res["warm_start_s"] = time.perf_counter() - t1
    store = llm.executable_store
    res["warm"] = dict(start_s=res["warm_start_s"], **ready_then_all(llm, t1),
                       runtime_start_s=llm.startup_seconds.get("runtime_start"), startup_seconds=llm.startup_seconds,
                       runtime_before_llm_s=runtime_before_llm, weights_cache_hit=llm.weights_cache_hit,
                       executable_store=None if store is None else dict(store.stats, loads=store.loads),
                       compiles=compile_stats.compile_count() - n0, cache_hits=compile_stats.cache_hit_count())
    print(f"warm start {tag} (LLM(), compile and weights caches filled by an earlier process): "
          f"{res['warm_start_s']:.1f} s {json.dumps(res['warm'])}", flush=True)
    if sampler is not None:
        sampler.stop()
        report = sampler.report()
        (out / f"warm_stacks_{tag.replace('/', '_')}.json").write_text(json.dumps(report, indent=1))
        print(f"warm start {tag}: GIL held elsewhere {report['gil_held_elsewhere_s']} s of {report['seconds']} s "
              f"sampled; longest gaps: {[(g['at_s'], g['gap_s']) for g in report['gaps'][:8]]}", flush=True)
    save_results(out, results)
