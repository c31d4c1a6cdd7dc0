"""`jlora bench tpu-compile`: jlora's step graphs compiled for a TPU v5e chip on a machine without one.

    python -m jlora.bench.tpu_compile --shape tiny [--out report.json] [--hlo-dir DIR]
                                      [--enable-dora] [--enable-embedding-lora]

libtpu compiles for a described chip without the chip (JAX's compile-only topologies), so what
XLA:TPU makes of the serving step can be checked on a CPU machine, in CI too: per step graph, the
instructions that copy the whole KV cache (`whole_cache_copies`), the ones that copy a layer's
weight out of the stacked weights (`weight_copies`, what a LoRA conditional taking its weight from
outside its branches costs), and the seconds to lower and to compile. It does not run anything:
timings need the chip (`jlora bench tpu`).

It needs the `libtpu` wheel JAX pins (`make install-test` puts it in .venv/libtpu, off the
default path: with libtpu importable, every JAX process would look for a TPU first). Run it with
that folder on PYTHONPATH; `run_isolated` does so in a child process and returns its report.
The model and kernels choose their TPU paths by `jax.default_backend()` at trace time, so the
graphs are traced as on a chip (`tracing_as_tpu`).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Iterator

# libtpu reads these at start-up; defaults for one v5e chip on a machine that is not a TPU VM.
COMPILE_ONLY_ENV = {"TPU_ACCELERATOR_TYPE": "v5litepod-1", "TPU_WORKER_HOSTNAMES": "localhost",
                    "TPU_SKIP_MDS_QUERY": "1"}
LIBTPU_DIR = Path(sys.prefix) / "libtpu"  # where `make install-test` puts the wheel
OPT_IN_OPTIONS = ("enable_dora", "enable_embedding_lora")  # LLM() options that add to the step graphs


def compile_only_device(topology: str = "v5e:1x1") -> Any:
    """A device of a described TPU chip that XLA compiles for but cannot run on."""
    for k, v in COMPILE_ONLY_ENV.items():
        os.environ.setdefault(k, v)
    from jax.experimental import topologies

    return topologies.get_topology_desc(platform="tpu", topology_name=topology, chips_per_host_bounds=(1, 1, 1),
                                        num_slices=1).devices[0]


@contextlib.contextmanager
def tracing_as_tpu() -> Iterator[None]:
    """jax.default_backend() answers "tpu" inside: the model picks the Pallas kernel, bf16 arrays
    (not XLA:CPU's bits) and its TPU defaults while it is built and traced."""
    import jax

    real = jax.default_backend
    jax.default_backend = lambda: "tpu"
    try:
        yield
    finally:
        jax.default_backend = real


def weight_copies(hlo_text: str, weight_shapes: set[tuple[int, ...]]) -> list[str]:
    """Instructions that write out an array of a layer weight's shape by a copy or a dynamic-slice
    fusion: a weight XLA could not read in place (a projection reads its layer's slice of the
    stacked [L, in, out] weights inside its matmul's fusion when nothing stands between them)."""
    out = []
    for line in hlo_text.splitlines():
        m = re.search(r"%?([\w.-]+) = \w+\[([\d,]+)\](\{[^}]*\})? ([\w-]+)\(", line)
        if not m or tuple(int(d) for d in m.group(2).split(",")) not in weight_shapes:
            continue
        name, op = m.group(1), m.group(4)
        if op == "copy" or (op == "fusion" and "dynamic-slice" in name):
            out.append(line.strip()[:240])
    return out


def compile_step_graphs(llm: Any, device: Any, only: set[str] | None = None,
                        hlo_dir: Path | None = None) -> list[dict[str, Any]]:
    """Lower and compile each of the engine's step graphs for `device`; a report row per graph."""
    import jax
    from jax.sharding import SingleDeviceSharding

    from jlora.engine.hlo import whole_cache_copies

    runner = llm.engine.runner
    sharding = SingleDeviceSharding(device)

    def spec(a: Any) -> Any:
        return jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding) if hasattr(a, "shape") else a

    weight_shapes = {tuple(w.shape[1:]) for w in jax.tree.leaves(llm.model.layers.weights())
                     if getattr(w, "ndim", 0) == 3}
    rows = []
    for key in runner.config.step_graphs():
        shape, with_lora = key
        name = f"{shape[0]}-{shape[1]}-{shape[2]}-{'lora' if with_lora else 'base'}"
        if only and name not in only:
            continue
        args, static = runner.step_inputs(key)
        t0 = time.perf_counter()
        with tracing_as_tpu():
            lowered = runner._step.trace(*jax.tree.map(spec, args), **static).lower()
        t1 = time.perf_counter()
        text = lowered.compile().as_text()
        t2 = time.perf_counter()
        if hlo_dir is not None:
            hlo_dir.mkdir(parents=True, exist_ok=True)
            (hlo_dir / f"{name}.hlo").write_text(text)
        rows.append(dict(graph=name, lower_s=round(t1 - t0, 2), compile_s=round(t2 - t1, 2),
                         whole_cache_copies=whole_cache_copies(text, tuple(runner.cache["k"].shape)),
                         weight_copies=weight_copies(text, weight_shapes)))
        print(f"{name}: lowered in {t1 - t0:.2f} s, compiled in {t2 - t1:.2f} s, whole-cache copies "
              f"{len(rows[-1]['whole_cache_copies'])}, weight copies {len(rows[-1]['weight_copies'])}", flush=True)
    return rows


def build_llm(shape: str, ckpt_dir: Path, lora_cond: str = "auto", **engine: Any) -> Any:
    """LLM() on a random checkpoint of `shape`, built as on a TPU (the bench's TPU engine sizes),
    without warm-up: nothing is compiled for the CPU."""
    from jlora import LLM
    from jlora.bench.tpu.shapes import SHAPES, write_checkpoint
    from jlora.tuning import TuningOptions

    if not (ckpt_dir / "config.json").exists():
        write_checkpoint(ckpt_dir, shape)
    elif json.loads((ckpt_dir / "config.json").read_text()).get("hidden_size") != SHAPES[shape]["hidden_size"]:
        raise ValueError(f"{ckpt_dir} holds a checkpoint of another shape than {shape}")
    kw = dict(tuning=TuningOptions(lora_cond=None if lora_cond == "auto" else lora_cond),
              dtype="bfloat16", max_model_len=2048, max_num_seqs=64, max_num_batched_tokens=1024,
              token_buckets=(32, 128, 1024), decode_row_buckets=(1, 64), max_loras=4, max_lora_rank=16,
              block_size=128, attn_impl="pallas", attn_chunk=1024, base_graphs="decode", num_kv_blocks=1024)
    kw.update(engine)
    with tracing_as_tpu():
        return LLM(str(ckpt_dir), warmup=False, progress=False, **kw)


def run_isolated(args: list[str], timeout: float = 1800) -> dict[str, Any]:
    """This module's main in a child process with libtpu on its path; its JSON report."""
    env = child_env()
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "report.json"
        proc = subprocess.run([sys.executable, "-m", "jlora.bench.tpu_compile", *args, "--out", str(out)],
                              env=env, capture_output=True, text=True, timeout=timeout)
        if proc.returncode:
            raise RuntimeError(f"tpu_compile failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
        return json.loads(out.read_text())


def child_env() -> dict[str, str]:
    """This process's environment with libtpu's folder on PYTHONPATH and the compile-only settings."""
    if not (LIBTPU_DIR / "libtpu").is_dir():
        raise FileNotFoundError(f"libtpu is not installed in {LIBTPU_DIR} (make install-test)")
    return {**os.environ, **COMPILE_ONLY_ENV,
            "PYTHONPATH": os.pathsep.join([str(LIBTPU_DIR), *filter(None, [os.environ.get("PYTHONPATH")])])}


def main(argv: list[str] | None = None) -> int:
    import importlib.util

    argv = sys.argv[1:] if argv is None else argv
    if importlib.util.find_spec("libtpu") is None:  # (`jlora bench tpu-compile`): again, with libtpu
        return subprocess.run([sys.executable, "-m", "jlora.bench.tpu_compile", *argv], env=child_env()).returncode
    p = argparse.ArgumentParser(prog="jlora bench tpu-compile", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="tiny",
                   help="a shape of `jlora bench tpu` (tiny, smollm2-135m, llama-3.2-1b, ...)")
    p.add_argument("--shape-overrides", default=None, help='JSON of config fields over the shape\'s, e.g. '
                   '\'{"num_key_value_heads": 4}\'')
    p.add_argument("--dir", default=None, help="where the random checkpoint goes (default: a temporary folder)")
    p.add_argument("--out", default=None, help="JSON report")
    p.add_argument("--hlo-dir", default=None, help="write each compiled graph's HLO here")
    p.add_argument("--graphs", default=None, help="comma-separated graph names (R-P-Q-lora|base); default all")
    p.add_argument("--lora-cond", default="auto", choices=["auto", "pass", "inside"])
    for option in OPT_IN_OPTIONS:
        p.add_argument("--" + option.replace("_", "-"), action="store_true", help=f"an engine with {option}=True")
    p.add_argument("--topology", default="v5e:1x1")
    args = p.parse_args(argv)
    import tempfile

    import jax

    from jlora.bench.tpu.shapes import SHAPES

    device = compile_only_device(args.topology)
    shape = args.shape
    if args.shape_overrides:
        shape = f"{args.shape}+overrides"
        SHAPES[shape] = {**SHAPES[args.shape], **json.loads(args.shape_overrides)}
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = Path(args.dir or tmp) / f"ckpt-{shape}"
        llm = build_llm(shape, ckpt, args.lora_cond, **{o: getattr(args, o) for o in OPT_IN_OPTIONS})
        options = {o: getattr(llm.config, o) for o in OPT_IN_OPTIONS}  # as the engine holds them
        cond = llm.config.tuning.resolved_lora_cond("tpu")
        rows = compile_step_graphs(llm, device, set(args.graphs.split(",")) if args.graphs else None,
                                   Path(args.hlo_dir) if args.hlo_dir else None)
    report = dict(jax=jax.__version__, device=str(device), shape=shape, config=SHAPES[shape], lora_cond=cond,
                  options=options,
                  cache_shape=list(llm.engine.runner.cache["k"].shape), graphs=rows)
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
