"""Agreement: the chip check's cases against the CPU (`check`, jlora.bench.chip_check), and int8
weights against bf16 on one checkpoint (`agree`)."""

from __future__ import annotations

import argparse
import gc
import json
import time
from pathlib import Path
from typing import Any

import numpy as np

from jlora.bench.tpu.common import np_dtype, save_results
from jlora.bench.tpu.shapes import write_checkpoint


def teacher_forced_logits(model: Any, ids: np.ndarray) -> np.ndarray:
    """f32[B, T, V] logits of `model` over token rows `ids` i32[B, T] (one jitted forward)."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from jlora.models import init_cache, quant

    graphdef, state = nnx.split(model)
    b, t = ids.shape

    @jax.jit
    def fwd(state, ids):
        m = nnx.merge(graphdef, state)
        pos = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
        logits, _ = m(ids, pos, init_cache(m.cfg, b, t, quant.storage_dtype(m.dtype)))
        return logits

    return np.asarray(fwd(state, jnp.asarray(ids)))


def bench_agree(ckpt: Path, dtype: str = "bfloat16", batch: int = 4, length: int = 128,
                modes: tuple[str, ...] = ("int8-weight-only", "int8"), seed: int = 0) -> dict[str, Any]:
    """int8 modes against `dtype` on the same checkpoint: teacher-forced over `batch` random token-id
    prompts of `length` tokens, every position's top-1 agreement (what greedy decoding would pick
    next from the same prefix), max and mean |logit difference|, and the reference logits' spread and
    median margin between its two best (random weights give flat logits: near-ties make top-1
    agreement a hard measure here; tests/test_dtypes_real.py states it on a real model)."""
    import jax

    from jlora.models.loading import load_model

    dtypes = {"float32": np.float32, "bfloat16": np_dtype("bfloat16")}
    logits: dict[str, np.ndarray] = {}
    vocab = json.loads((ckpt / "config.json").read_text())["vocab_size"]
    ids = np.random.default_rng(seed).integers(3, vocab, (batch, length)).astype(np.int32)
    timing = {}
    for mode in ("none", *modes):
        t0 = time.perf_counter()
        model, _, _ = load_model(ckpt, dtypes[dtype], quantization=None if mode == "none" else mode)
        logits[mode] = teacher_forced_logits(model, ids)
        timing[mode] = time.perf_counter() - t0
        del model
        gc.collect()
    ref = logits["none"]
    top = ref.max(-1, keepdims=True)
    second = np.where(ref < top, ref, -np.inf).max(-1, keepdims=True)  # the best logit below the top one
    out: dict[str, Any] = dict(dtype=dtype, prompts=batch, tokens=length, devices=str(jax.devices()), seconds=timing,
                               ref_logit_std=float(ref.std()), ref_top2_margin_median=float(np.median(top - second)))
    for mode in modes:
        diff = np.abs(logits[mode] - ref)
        out[mode] = dict(top1=float(np.mean(logits[mode].argmax(-1) == ref.argmax(-1))), dlogit_max=float(diff.max()),
                         dlogit_mean=float(diff.mean()))
        print(f"  agree {mode} vs {dtype}: teacher-forced top-1 {out[mode]['top1']:.1%}, |dlogit| max "
              f"{out[mode]['dlogit_max']:.3f} mean {out[mode]['dlogit_mean']:.4f} (logit std {out['ref_logit_std']:.3f}, "
              f"median top-2 margin {out['ref_top2_margin_median']:.4f})", flush=True)
    return out


def agree_checkpoint(args: argparse.Namespace) -> Path:
    """The agree section's checkpoint: every value a fresh draw (`write_random_checkpoint`), since the
    pool the bench's writer slices repeats rows (a head of 49,152 x 2,048 from 2^24 values has each
    row 6 times), which would tie logits exactly."""
    return Path(args.dir) / f"{args.agree_shape}-agree"


def check_section(args: argparse.Namespace, out: Path, results: dict[str, Any]) -> None:
    """The chip check's cases (jlora.bench.chip_check) on this backend against the CPU: results["check"]."""
    from jlora.bench import chip_check

    models = [m for m in args.check_models.split(",") if m]
    if "smollm2" in models and args.check_model is None:
        from jlora.models.loading import default_model_path

        try:
            default_model_path()
        except Exception as e:  # noqa: BLE001 (no default-model package here: the random models still run)
            models.remove("smollm2")
            print(f"check: no default model here ({type(e).__name__}: {e}); pass --check-model", flush=True)
            results["check_skipped"] = "smollm2: no default model (--check-model)"

    def save(res: dict[str, Any]) -> None:
        results["check"] = res
        save_results(out, results)

    res = chip_check.run_check(models, out, Path(args.dir) / "check", args.check_model and Path(args.check_model),
                               args.check_only.split(";") if args.check_only else None, on_result=save)
    save(res)
    print(f"check: {'PASSED' if res['passed'] else 'FAILED'} ({sum(v['passed'] for v in res['cases'].values())} of "
          f"{len(res['cases'])} cases); same tokens across float32 configurations: {json.dumps(res['same_tokens'])}",
          flush=True)


def agree_section(args: argparse.Namespace, out: Path, results: dict[str, Any]) -> None:
    path = agree_checkpoint(args)
    if not (path / "config.json").is_file():
        seconds = write_checkpoint(path, args.agree_shape, fill="normal")
        print(f"checkpoint {path} (fresh N(0, 0.02) draws) written in {seconds:.1f} s", flush=True)
    results.setdefault("agree", {})[args.agree_shape] = bench_agree(path, args.dtype)
    save_results(out, results)
