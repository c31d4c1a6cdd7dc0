"""Micro benchmarks of `jlora bench tpu`, each op alone inside one jit: the attention kernel
(`kernel`), the quantized projections (`qmatmul`) and the decoder's layer stack (`layers`)."""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np

from jlora.bench.tpu.common import (HBM_BYTES_PER_S, MXU_FLOPS, MXU_INT8_OPS, profile_top, save_results,
                                    tuning_options)
from jlora.bench.tpu.shapes import SHAPES, matmul_params


def parse_kernel_variants(spec: str) -> list[tuple[int, int, dict[str, Any]]]:
    """`--kernel-variants`: comma-separated BSxCHUNK, each optionally followed by +nobc (the
    kernel's DMA bounds checks off), +vmemN (its scoped VMEM limit, N MiB), +subN (N positions
    a compute step, `sub_block`; +subCHUNK computes whole chunks, as before the steps), +seqsN
    (N decode sequences a program, `seqs_per_program`), +roundN (a prefill program's partial
    chunk as one block rounded up to N positions, `prefill_round`; +round0: whole chunks),
    +rowsN (at most N query rows a program, `max_block_rows`) and +regions (the kernel's named trace
    regions, for `--kernel-profile`)."""
    out = []
    for item in filter(None, spec.split(",")):
        size, *flags = item.split("+")
        try:
            bs, chunk = (int(x) for x in size.split("x"))
            opts: dict[str, Any] = {}
            for f in flags:
                if f == "nobc":
                    opts["bounds_checks"] = False
                elif f.startswith("vmem"):
                    opts["vmem_limit"] = int(f[4:]) * 2**20
                elif f.startswith("sub"):
                    opts["sub_block"] = int(f[3:])
                elif f.startswith("seqs"):
                    opts["seqs_per_program"] = int(f[4:])
                elif f.startswith("round"):
                    opts["prefill_round"] = int(f[5:])
                elif f.startswith("rows"):
                    opts["max_block_rows"] = int(f[4:])
                elif f == "regions":
                    opts["trace_regions"] = True
                else:
                    raise ValueError(f)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"{item!r}: want BSxCHUNK[+nobc][+vmemN][+subN][+seqsN][+roundN][+rowsN][+regions], e.g. 128x1024+nobc+vmem64")
        out.append((bs, chunk, opts))
    return out


# The cases a kernel variant runs: long rows, short rows (the short workload's mean context too), a
# second chunk mostly empty, prefill, and a whole 1,024-token prompt from position 0 (causal: early
# query blocks reach few pages).
KERNEL_VARIANT_CASES = ((64, 1024, 1), (64, 256, 1), (64, 160, 1), (64, 1152, 1), (1, 1024, 256), (1, 1024, 1024))


def parse_kernel_cases(spec: str) -> tuple[tuple[int, int, int], ...]:
    """`--kernel-cases`: comma-separated ROWSxCONTEXTxQUERIES, queries <= context."""
    out = []
    for item in filter(None, spec.split(",")):
        try:
            r, ctx, nq = (int(x) for x in item.split("x"))
        except ValueError:
            raise argparse.ArgumentTypeError(f"{item!r}: want ROWSxCONTEXTxQUERIES, e.g. 1x1024x1024")
        if min(r, ctx, nq) < 1 or nq > ctx:
            raise argparse.ArgumentTypeError(f"{item!r}: rows, context and queries must be >= 1, queries <= context")
        out.append((r, ctx, nq))
    return tuple(out)


def bench_kernel(cfg: dict[str, Any], rows: int, context: int, nq: int, reps: int = 20,
                 block_size: int = 16, chunk: int = 128, impls: tuple[str, ...] = ("pallas", "xla"),
                 kernel_opts: dict[str, Any] | None = None, profile: bool = False) -> list[dict]:
    """Each implementation repeated `reps` times inside one jit (its output feeds the next query, so
    nothing is hoisted); KV bytes a call must read / its time = GB/s. Also its error against the
    reference on the first call. `kernel_opts`: fields of the kernel's `AttentionOptions`.
    `profile`: one more timed loop under `jax.profiler`, its device ops (the kernel apart from the
    query and output re-layouts around it) printed and kept as the row's `profile`."""
    import jax
    import jax.numpy as jnp

    from jlora.kernels.attention import paged_attention, paged_attention_reference
    from jlora.kernels.paged_attention_tpu import paged_attention_tpu
    from jlora.tuning import AttentionOptions

    h, kvh, dh, L = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"], 4
    mb = -(-context // block_size)
    nb = rows * mb + 8
    key = jax.random.PRNGKey(0)
    k1, k2, k3 = jax.random.split(key, 3)
    ck = jax.random.normal(k1, (L, nb, block_size, kvh * dh), jnp.bfloat16)
    cv = jax.random.normal(k2, (L, nb, block_size, kvh * dh), jnp.bfloat16)
    q = jax.random.normal(k3, (rows, nq, h, dh), jnp.float32)
    tables = jnp.asarray(np.random.default_rng(0).permutation(nb)[: rows * mb].reshape(rows, mb), jnp.int32)
    pos = jnp.broadcast_to(jnp.arange(context - nq, context, dtype=jnp.int32), (rows, nq))
    layer = jnp.int32(2)
    opts = dict(kernel_opts or {})
    options = AttentionOptions(**opts)
    fns = {"pallas": lambda q_: paged_attention_tpu(q_, ck, cv, layer, pos, tables, chunk=chunk, options=options),
           "xla": lambda q_: paged_attention(q_, ck, cv, layer, pos, tables, chunk=chunk)}
    want = paged_attention_reference(q, ck, cv, layer, pos, tables)
    kv_bytes = rows * context * kvh * dh * 2 * 2  # K and V, bf16
    out = []
    for impl in impls:
        fn = fns[impl]
        what = dict(impl=impl, rows=rows, context=context, q=nq, block_size=block_size, chunk=chunk,
                    **({"kernel_opts": opts} if impl == "pallas" and opts else {}))
        label = (f"{impl:6s} rows={rows} ctx={context} q={nq} bs={block_size} chunk={chunk}"
                 + (f" {opts}" if impl == "pallas" and opts else ""))
        try:
            err = float(jnp.abs(fn(q) - want).max())
        except Exception as e:  # a kernel Mosaic refuses: say so and measure the rest
            print(f"  kernel {label}: FAILED {type(e).__name__}: {str(e)[:1500]}")
            out.append(dict(what, error=f"{type(e).__name__}: {str(e)[:1500]}"))
            continue

        @jax.jit
        def loop(q0):
            def body(_, qc):
                return qc + 1e-3 * fn(qc)
            return jax.lax.fori_loop(0, reps, body, q0)

        loop(q).block_until_ready()
        t0 = time.perf_counter()
        loop(q).block_until_ready()
        dt = (time.perf_counter() - t0) / reps
        out.append(dict(what, us=dt * 1e6, gb_s=kv_bytes / dt / 1e9, hbm_fraction=kv_bytes / dt / HBM_BYTES_PER_S,
                        max_err=err))
        print(f"  kernel {label}: {dt * 1e6:8.1f} us, "
              f"{kv_bytes / dt / 1e9:6.1f} GB/s ({kv_bytes / dt / HBM_BYTES_PER_S:.0%} of HBM), max err {err:.1e}",
              flush=True)
        if profile:
            trace = tempfile.mkdtemp(prefix="jlora-trace-kernel-")
            jax.profiler.start_trace(trace)
            loop(q).block_until_ready()
            jax.profiler.stop_trace()
            out[-1]["profile"] = top = profile_top(trace, n=8, all_lines=True)
            shutil.rmtree(trace, ignore_errors=True)
            print(f"== kernel profile {label} ({reps} calls)\n{top}", flush=True)
    return out


def bench_layers(cfg: dict[str, Any], tokens: tuple[int, ...] = (1, 64, 1088), reps: int = 10, rank: int = 16,
                 max_loras: int = 4, dtype: str = "bfloat16", out: list | None = None,
                 on_row: Callable[[], None] | None = None, profile: tuple[tuple[int, str, str], ...] = (),
                 trace_out: Path | None = None, tuning: Any = None) -> list[dict]:
    """The decoder's layer stack alone (the model's own `_decoder`, attention replaced by its query),
    `reps` passes in one jit, at each token count: without LoRA slots (a base graph), with them and
    no adapter token ("off"), and 4 mixed adapters, LoRA skipped by conditionals when no token has an
    adapter or computed for all (`lora_skip`: with a base graph beside it, EngineConfig.base_graphs).
    What LoRA adds to the projections and which variant costs least, without an engine's compile per
    variant, built with `tuning` (a `TuningOptions`; None: the defaults). `profile`: (tokens,
    "off"|"mixed", "skip"|"all") cases whose passes are traced; the top device
    ops go to `trace_out`/layers-profile-*.txt and stdout."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from jlora.models import llama
    from jlora.models.config import LlamaConfig
    from jlora.tuning import TuningOptions

    tuning = TuningOptions() if tuning is None else tuning
    c = LlamaConfig.from_hf_dict({**cfg, "max_position_embeddings": 4096})
    model = llama.Llama(c, dtype=jnp.dtype(dtype), rngs=nnx.Rngs(0))
    graphdef, state = nnx.split(model)
    keys = iter(jax.random.split(jax.random.PRNGKey(1), 64))
    slots = jax.tree.map(lambda z: (0.02 * jax.random.normal(next(keys), z.shape, jnp.float32)).astype(z.dtype),
                         llama.init_lora_state(c, max_loras, rank, jnp.dtype(dtype)))
    h, dh = c.num_attention_heads, c.head_dim
    matmul_bytes = matmul_params(c) * jnp.dtype(dtype).itemsize
    out = [] if out is None else out

    def attend(q, k, v, i, win, st):  # no KV cache: the query stands in for attention's output
        return q.reshape(q.shape[0], h * dh), st

    # "skip": a conditional per projection skips LoRA when no token has an adapter (a LoRA graph
    # without a twin); "all": LoRA for every token (a LoRA graph whose shape has a base graph).
    cases = [("none", None), ("off", "skip"), ("mixed", "skip"), ("mixed", "all")]
    for t in tokens:
        x0 = (0.1 * jax.random.normal(next(keys), (t, c.hidden_size), jnp.float32)).astype(dtype)
        positions = jnp.arange(t, dtype=jnp.int32)
        for what, cond in cases:
            ids = (jnp.arange(t, dtype=jnp.int32) % max_loras) if what == "mixed" else jnp.full((t,), -1, jnp.int32)
            lora = None if what == "none" else slots

            @jax.jit
            def run(state, lora, ids, x):
                m = nnx.merge(graphdef, state)

                def body(_, xc):
                    y, _ = m._decoder(xc, positions, ids, lora, "auto", attend, (), lora_skip=cond != "all",
                                      tuning=tuning)
                    return (xc + 1e-3 * y).astype(xc.dtype)
                return jax.lax.fori_loop(0, reps, body, x)

            run(state, lora, ids, x0).block_until_ready()
            t0 = time.perf_counter()
            run(state, lora, ids, x0).block_until_ready()
            us = (time.perf_counter() - t0) / reps * 1e6
            row = dict(tokens=t, lora=what, cond=cond, lora_cond=tuning.resolved_lora_cond(jax.default_backend()),
                       us=us,
                       matmul_fraction_of_hbm=matmul_bytes / (us * 1e-6) / HBM_BYTES_PER_S,
                       matmul_fraction_of_mxu=2 * matmul_params(c) * t / (us * 1e-6) / MXU_FLOPS)
            out.append(row)
            print(f"  layers T={t:5d} lora={what:5s} cond={cond or '-':6s} ({row['lora_cond']}): {us:9.1f} us a pass "
                  f"({row['matmul_fraction_of_hbm']:.0%} of HBM for the weights, "
                  f"{row['matmul_fraction_of_mxu']:.0%} of MXU)", flush=True)
            if (t, what, cond) in profile:
                trace = tempfile.mkdtemp(prefix="jlora-trace-layers-")
                jax.profiler.start_trace(trace)
                run(state, lora, ids, x0).block_until_ready()
                jax.profiler.stop_trace()
                top = profile_top(trace)
                if trace_out is not None:
                    (trace_out / f"layers-profile-{t}-{what}-{cond}.txt").write_text(top)
                print(f"== layers profile T={t} {what} {cond} ({reps} passes)\n{top}", flush=True)
            if on_row:
                on_row()
    return out


# ---- the engine -----------------------------------------------------------------------------------------


QMATMUL_MODES = ("bf16", "w8a16", "w8a16-mixed", "w8a8")


def bench_qmatmul(cfg: dict[str, Any], rows: tuple[int, ...], reps: int = 20,
                  modes: tuple[str, ...] = QMATMUL_MODES, out: list[dict[str, Any]] | None = None,
                  on_row: Callable[[], None] | None = None) -> list[dict[str, Any]]:
    """Each projection of `cfg` (qkv, gate_up, down, and the lm head) at each row count, as the model
    multiplies it (`quant.linear`, `quant.lm_head`): bf16 weights, int8 weights widened in the matmul
    (W8A16: jlora's form, `q.astype(bf16)` then the dot), the same as one mixed bf16 x int8
    `dot_general` (w8a16-mixed: XLA widens where it likes; not jlora's form yet, measured to decide),
    and int8 x int8 (W8A8), `reps` calls inside one jit. A projection's weight is sliced from a
    stack of 2 by the loop index (as the layer scan does), so XLA cannot hoist its conversion out of
    the loop; the whole output feeds the next input. Weight bytes / time against the HBM roofline,
    flops / time against the MXU peak (int8's for W8A8). Rows go into `out` as measured, and
    `on_row()` runs after each (the caller saves: at the 8B's shapes the 32 compiles take minutes)."""
    import jax
    import jax.numpy as jnp

    from jlora.models import quant

    d, f = cfg["hidden_size"], cfg["intermediate_size"]
    h, kvh, dh, v = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"], cfg["vocab_size"]
    projs = {"qkv_proj": (d, (h + 2 * kvh) * dh), "gate_up_proj": (d, 2 * f), "down_proj": (f, d), "lm_head": (d, v)}
    out = [] if out is None else out
    key = jax.random.PRNGKey(0)
    for name, (din, dout) in projs.items():
        head = name == "lm_head"
        stack = 1 if head else 2
        k1, k2, key = jax.random.split(key, 3)
        for mode in modes:
            if mode == "bf16":  # float weights: [in, out] (the head as rows [V, D])
                shape = (stack, dout, din) if head else (stack, din, dout)
                w = jax.random.normal(k1, shape, jnp.bfloat16) * jnp.bfloat16(0.02)
                wbytes = din * dout * 2
            else:
                q = jax.random.randint(k1, (stack, dout, din), -127, 128, jnp.int8)
                w = quant.QArray(q, jnp.full((stack, dout), 1e-3, jnp.float32), "int8" if mode == "w8a8" else "float")
                wbytes = din * dout + 4 * dout

            def call(x, w, i, mode=mode):
                wi = jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, i % stack, 0, keepdims=False), w)
                if mode == "w8a16-mixed":  # x bf16 [T, in] . q int8 [out, in]: one mixed-dtype dot
                    y = jax.lax.dot_general(x, wi.q, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
                    return (y * wi.scale).astype(jnp.float32 if head else x.dtype)
                return quant.lm_head(x, wi) if head else quant.linear(x, wi)

            for t in rows:
                x0 = jax.random.normal(k2, (t, din), jnp.bfloat16)

                @jax.jit
                def loop(x, w):
                    def body(i, xc):
                        y = call(xc, w, i)
                        return xc + (jnp.sum(y.astype(jnp.float32)) * 1e-12).astype(xc.dtype)
                    return jax.lax.fori_loop(0, reps, body, x)

                try:
                    loop(x0, w).block_until_ready()
                    t0 = time.perf_counter()
                    loop(x0, w).block_until_ready()
                    dt = (time.perf_counter() - t0) / reps
                except Exception as e:  # noqa: BLE001 (a mode the chip refuses: say so, measure the rest)
                    print(f"  qmatmul {name} {mode} T={t}: FAILED {type(e).__name__}: {str(e)[:1500]}", flush=True)
                    out.append(dict(proj=name, mode=mode, rows=t, error=f"{type(e).__name__}: {str(e)[:1500]}"))
                    if on_row:
                        on_row()
                    continue
                flops = 2 * t * din * dout
                peak = MXU_INT8_OPS if mode == "w8a8" else MXU_FLOPS
                row = dict(proj=name, mode=mode, rows=t, din=din, dout=dout, us=dt * 1e6, weight_bytes=wbytes,
                           gb_s=wbytes / dt / 1e9, hbm_fraction=wbytes / dt / HBM_BYTES_PER_S,
                           tflops=flops / dt / 1e12, mxu_fraction=flops / dt / peak)
                out.append(row)
                if on_row:
                    on_row()
                print(f"  qmatmul {name:12s} {mode:11s} T={t:5d}: {dt * 1e6:9.1f} us, {row['gb_s']:6.1f} GB/s of weights "
                      f"({row['hbm_fraction']:.0%} of HBM), {row['tflops']:6.1f} TFLOP/s ({row['mxu_fraction']:.0%} of "
                      f"{'int8' if mode == 'w8a8' else 'bf16'} MXU)", flush=True)
            del w
    return out


# ---- int8 against bf16 ---------------------------------------------------------------------------------


def kernel_section(args: argparse.Namespace, out: Path, results: dict[str, Any]) -> None:
    """The attention kernel and the XLA loop at four decode and prefill cases, then each
    `--kernel-variants` variant at each `--kernel-cases` case (the Pallas kernel only)."""
    cfg = SHAPES[args.shape]
    rows = results.setdefault("kernel", [])
    for r, ctx, nq in ((64, 1024, 1), (64, 256, 1), (1, 1024, 1), (1, 1024, 256)):
        for impl, chunk in (("pallas", args.attn_chunk or 512), ("xla", args.attn_chunk or 128)):
            if impl not in args.kernel_impls:
                continue
            rows += bench_kernel(cfg, r, ctx, nq, block_size=args.block_size, chunk=chunk, impls=(impl,))
        save_results(out, results)
    for bs, chunk, opts in args.kernel_variants:  # other page and chunk sizes, the Pallas kernel only
        for r, ctx, nq in args.kernel_cases:
            rows += bench_kernel(cfg, r, ctx, nq, block_size=bs, chunk=chunk, impls=("pallas",), kernel_opts=opts,
                                 profile=args.kernel_profile)
        save_results(out, results)


def qmatmul_section(args: argparse.Namespace, out: Path, results: dict[str, Any]) -> None:
    measured: list[dict[str, Any]] = []
    results.setdefault("qmatmul", {})[args.shape] = measured
    bench_qmatmul(SHAPES[args.shape], args.qmatmul_rows, out=measured, on_row=lambda: save_results(out, results))
    save_results(out, results)


def layers_section(args: argparse.Namespace, out: Path, results: dict[str, Any]) -> None:
    measured: list[dict[str, Any]] = []
    results.setdefault("layers", {})[args.shape] = measured
    profile = () if args.quick else ((1, "off", "skip"), (1088, "mixed", "all"))
    bench_layers(SHAPES[args.shape], rank=args.rank, dtype=args.dtype, out=measured,
                 on_row=lambda: save_results(out, results), profile=profile, trace_out=out, tuning=tuning_options(args))
    save_results(out, results)
