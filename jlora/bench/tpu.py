"""`jlora bench tpu`: jlora on a TPU chip against the chip's own limits (docs/tpu.md).

    jlora bench tpu --shape llama-3.2-1b --dir /tmp/ckpt --out results/ [--sections ...]

Runs where no model hub or default-model package is: it writes a random-weight checkpoint of a
named shape (HF layout: config.json, safetensors in bfloat16, a word-level tokenizer.json) and
feeds token-id prompts. Sections (`--sections`, in order):

  checkpoint  write the checkpoint (skipped when it is there)
  kernel      paged attention alone, the Pallas kernel and the XLA loop inside one jit each,
              against the reference: GB/s of KV read and the fraction of the HBM roofline
  engine      LLM() on the checkpoint: start-up, the compiled step's HLO checked for whole-cache
              copies, the workloads of `WORKLOADS` (tok/s, decode ms per step and its fraction of the
              HBM roofline, prefill's fraction of the MXU peak, TTFT), LoRA overhead, compiles after
              warm-up, and a profile's top device ops
  warm        a second process starting the same engine (persistent compile and weights caches)

Roofline arithmetic: a decode step must read every weight once, the KV of every row's context and
the LoRA slots its rows use; bytes / step time / HBM bandwidth is the fraction. A prefill step
must do 2 x (matmul parameters) x tokens flops; flops / step time / MXU peak.
Everything is written to --out as it is measured (results.json, tpu.md, profile.txt).
"""

from __future__ import annotations

import argparse
import collections
import glob
import inspect
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

HBM_BYTES_PER_S = 819e9  # TPU v5e
MXU_FLOPS = 197e12  # TPU v5e, bf16

SHAPES: dict[str, dict[str, Any]] = {  # HF config fields; vocabularies as in the measurements
    "llama-3.2-1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                         num_key_value_heads=8, head_dim=64, vocab_size=49152, tie_word_embeddings=True),
    "llama-3.2-3b": dict(hidden_size=3072, intermediate_size=8192, num_hidden_layers=28, num_attention_heads=24,
                         num_key_value_heads=8, head_dim=128, vocab_size=49152, tie_word_embeddings=True),
    "llama-3.1-8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                         num_key_value_heads=8, head_dim=128, vocab_size=128256, tie_word_embeddings=False),
    "tiny": dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=32, vocab_size=512, tie_word_embeddings=True),  # a CPU dry run
}

# (name, requests, prompt tokens, new tokens, adapters: 0 = none, k = k adapters round robin)
WORKLOADS = (
    ("64x(1024 in, 256 out), no adapter", 64, 1024, 256, 0),
    ("64x(1024 in, 256 out), 1 adapter", 64, 1024, 256, 1),
    ("64x(1024 in, 256 out), 4 mixed adapters", 64, 1024, 256, 4),
    ("64x(32 in, 256 out), no adapter", 64, 32, 256, 0),
    ("64x(32 in, 256 out), 4 mixed adapters", 64, 32, 256, 4),
    ("1x(32 in, 256 out), no adapter", 1, 32, 256, 0),
    ("seed: 64x(1024 in, 1024 out), 1 adapter", 64, 1024, 1024, 1),
)


# ---- the checkpoint ---------------------------------------------------------------------------------


def write_checkpoint(path: Path, shape: str, seed: int = 0) -> float:
    """A random bf16 Llama of `shape` at `path` (HF names, one safetensors file per few layers) and a
    word-level tokenizer; returns seconds. Weights are slices of one random pool (N(0, 0.02)):
    writing 8B fresh normal draws would take minutes, and their values do not matter here."""
    import ml_dtypes
    from safetensors.numpy import save_file

    t0 = time.perf_counter()
    cfg = dict(SHAPES[shape])
    path.mkdir(parents=True, exist_ok=True)
    d, f, L = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]
    h, kvh, dh, v = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"], cfg["vocab_size"]
    rng = np.random.default_rng(seed)
    pool = (rng.standard_normal(1 << 24, dtype=np.float32) * 0.02).astype(ml_dtypes.bfloat16)

    def rand(*dims: int) -> np.ndarray:
        n = int(np.prod(dims))
        reps = -(-n // pool.size)
        start = int(rng.integers(0, pool.size))
        flat = np.roll(pool, -start)
        return (np.tile(flat, reps)[:n] if reps > 1 else flat[:n]).reshape(dims)

    ones = lambda n: np.ones((n,), ml_dtypes.bfloat16)  # noqa: E731
    index: dict[str, str] = {}
    files: list[tuple[str, dict[str, np.ndarray]]] = [("model-embed.safetensors", {
        "model.embed_tokens.weight": rand(v, d), "model.norm.weight": ones(d),
        **({} if cfg["tie_word_embeddings"] else {"lm_head.weight": rand(v, d)})})]
    per_file = 4
    for first in range(0, L, per_file):
        t: dict[str, np.ndarray] = {}
        for i in range(first, min(L, first + per_file)):
            p = f"model.layers.{i}."
            t.update({p + "self_attn.q_proj.weight": rand(h * dh, d), p + "self_attn.k_proj.weight": rand(kvh * dh, d),
                      p + "self_attn.v_proj.weight": rand(kvh * dh, d), p + "self_attn.o_proj.weight": rand(d, h * dh),
                      p + "mlp.gate_proj.weight": rand(f, d), p + "mlp.up_proj.weight": rand(f, d),
                      p + "mlp.down_proj.weight": rand(d, f), p + "input_layernorm.weight": ones(d),
                      p + "post_attention_layernorm.weight": ones(d)})
        files.append((f"model-layers-{first:03d}.safetensors", t))
    for name, tensors in files:
        save_file(tensors, str(path / name))
        index.update({k: name for k in tensors})
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": index}))
    (path / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
        "max_position_embeddings": 4096, "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "bfloat16",
        "hidden_act": "silu", **cfg}))
    _write_tokenizer(path, v)
    return time.perf_counter() - t0


def _write_tokenizer(path: Path, vocab: int) -> None:
    """A word-level tokenizer over `vocab` words w0..w{V-1} (prompts here are token ids; this only
    gives the engine something to detokenize with)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, decoders

    words = {f"w{i}": i for i in range(vocab)}
    tok = Tokenizer(models.WordLevel(words, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "w1", "eos_token": "w2", "unk_token": "w0"}))


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


def bench_kernel(cfg: dict[str, Any], rows: int, context: int, nq: int, reps: int = 20,
                 block_size: int = 16, chunk: int = 128, impls: tuple[str, ...] = ("pallas", "xla")) -> list[dict]:
    """Each implementation repeated `reps` times inside one jit (its output feeds the next query, so
    nothing is hoisted); KV bytes a call must read / its time = GB/s. Also its error against the
    reference on the first call."""
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
    fns = {"pallas": lambda q_: paged_attention_tpu(q_, ck, cv, layer, pos, tables, chunk=chunk),
           "xla": lambda q_: paged_attention(q_, ck, cv, layer, pos, tables, chunk=chunk)}
    want = paged_attention_reference(q, ck, cv, layer, pos, tables)
    kv_bytes = rows * context * kvh * dh * 2 * 2  # K and V, bf16
    out = []
    for impl in impls:
        fn = fns[impl]
        try:
            err = float(jnp.abs(fn(q) - want).max())
        except Exception as e:  # a kernel Mosaic refuses: say so and measure the rest
            print(f"  kernel {impl} rows={rows} ctx={context} q={nq}: FAILED {type(e).__name__}: {str(e)[:1500]}")
            out.append(dict(impl=impl, rows=rows, context=context, q=nq, error=f"{type(e).__name__}: {str(e)[:1500]}"))
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
        out.append(dict(impl=impl, rows=rows, context=context, q=nq, us=dt * 1e6, gb_s=kv_bytes / dt / 1e9,
                        hbm_fraction=kv_bytes / dt / HBM_BYTES_PER_S, max_err=err))
        print(f"  kernel {impl:6s} rows={rows} ctx={context} q={nq}: {dt * 1e6:8.1f} us, "
              f"{kv_bytes / dt / 1e9:6.1f} GB/s ({kv_bytes / dt / HBM_BYTES_PER_S:.0%} of HBM), max err {err:.1e}",
              flush=True)
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
                 seed: int, phases: HostPhases | None = None) -> dict[str, Any]:
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
               prefill_steps=len(pre), prefill_s=pre_s, prefill_mxu_fraction=flops / pre_s / MXU_FLOPS if pre_s else 0.0,
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


def profile_top(trace_dir: str, n: int = 20) -> str:
    """Device time per XLA module and the top device ops of the newest trace under trace_dir."""
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
            if not total or line.name not in ("XLA Modules", "XLA Ops"):
                continue
            lines.append(f"== {plane.name} | {line.name}: {sum(total.values()) / 1e6:.1f} ms")
            for name, ns in total.most_common(n):
                lines.append(f"  {ns / 1e6:9.2f} ms  x{count[name]:<6d} {ns / count[name] / 1e3:9.1f} us  {name[:140]}")
    return "\n".join(lines) or "no device plane"


def bench_engine(ckpt: Path, out: Path, args: argparse.Namespace, results: dict[str, Any]) -> None:
    import jax

    from jlora import LLM, LoRARequest, compile_stats

    def start(attn_impl: str) -> Any:
        extra = {} if attn_impl == "auto" else dict(attn_impl=attn_impl)  # an older jlora has neither of these
        if args.async_scheduling != "auto":
            extra["async_scheduling"] = args.async_scheduling == "on"
        if args.attn_chunk is not None:
            extra["attn_chunk"] = args.attn_chunk
        return LLM(str(ckpt), dtype=args.dtype, max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
                   max_num_batched_tokens=args.max_num_batched_tokens, token_buckets=args.token_buckets,
                   decode_row_buckets=args.decode_row_buckets, max_loras=4, max_lora_rank=args.rank,
                   lora_impl=args.lora_impl, block_size=args.block_size,
                   progress=False, **extra)

    t0 = time.perf_counter()
    try:
        llm = start(args.attn_impl)
    except Exception as e:  # say why, and measure the rest with the XLA attention
        print(f"engine with attn_impl={args.attn_impl} FAILED: {type(e).__name__}: {str(e)[:3000]}", flush=True)
        results["engine_error"] = f"{type(e).__name__}: {str(e)[:3000]}"
        t0 = time.perf_counter()
        llm = start("xla")
    start_s = time.perf_counter() - t0
    runner = llm.engine.runner
    cfg = runner.cfg
    weight_bytes = sum(int(w.nbytes) for w in runner._weights)
    kv_per_token = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * runner.cache["k"].dtype.itemsize
    slot_bytes = sum(int(x.nbytes) for x in jax.tree.leaves(runner.lora.state)) // llm.config.max_loras
    eng = dict(shape=args.shape, start_s=start_s, startup_breakdown_s=getattr(llm, "startup_seconds", None), attn_impl=getattr(runner, "attn_impl", "xla (before)"),
               async_default=getattr(llm.engine, "_async", None), attn_chunk=getattr(runner, "attn_chunk", None),
               lora_impl=args.lora_impl,
               graphs=llm.config.num_step_graphs, weight_bytes=weight_bytes, config=str(llm.config),
               devices=str(jax.devices()), jax=jax.__version__)
    eng.update(whole_cache_copies(llm))
    print(f"engine: started in {start_s:.1f} s, attn {eng['attn_impl']}, {eng['graphs']} step graphs, "
          f"whole-cache copies in the decode step: {len(eng['whole_cache_copies'])}", flush=True)
    results["engine"] = eng
    _save(out, results)

    log = StepLog(runner, weight_bytes, kv_per_token, slot_bytes)
    phases = HostPhases(llm.engine) if hasattr(runner, "launch") else None  # an older jlora: no phases
    adapters = make_adapters(cfg, 4, args.rank, Path(args.dir) / "adapters")
    loras = [LoRARequest(f"a{i}", i + 1, str(p)) for i, p in enumerate(adapters)]
    compiles_before = compile_stats.compile_count()
    rows = results.setdefault("workloads", [])
    names = set(args.workloads.split(",")) if args.workloads else None
    for i, (name, n, plen, new, k) in enumerate(WORKLOADS):
        if names is not None and str(i) not in names:
            continue
        if plen + new > args.max_model_len:
            continue
        rows.append(run_workload(llm, log, name, n, plen, new, loras[:k], seed=i, phases=phases))
        _save(out, results)
    eng["compiles_after_warmup"] = compile_stats.compile_count() - compiles_before
    print(f"compiles after warm-up: {eng['compiles_after_warmup']}", flush=True)
    if hasattr(llm.engine, "_async"):  # the same greedy requests with and without async scheduling
        from jlora import SamplingParams as SP

        rng = np.random.default_rng(7)
        prompts = [{"prompt_token_ids": rng.integers(3, cfg.vocab_size, 100 + 13 * i).tolist()} for i in range(8)]
        got = {}
        for mode in (True, False):
            llm.engine._async = mode
            got[mode] = [o.outputs[0].token_ids for o in llm.generate(
                prompts, SP(temperature=0.0, max_tokens=32, ignore_eos=True), lora_request=[loras[i % 4] for i in range(8)],
                use_tqdm=False)]
        llm.engine._async = eng["async_default"]
        eng["async_equals_sync"] = got[True] == got[False]
        print(f"async scheduling gives the same tokens as sync: {eng['async_equals_sync']}", flush=True)

    # A profile of decode-heavy steps: 64 rows at ~1K context.
    trace = tempfile.mkdtemp(prefix="jlora-trace-")
    from jlora import SamplingParams

    # Long enough that every row still decodes in the traced steps: the first rows start decoding
    # while the last prompts are prefilled (one ~1K-token chunk a step).
    params = SamplingParams(temperature=0.0, max_tokens=args.max_num_seqs + 40, ignore_eos=True)
    rng = np.random.default_rng(99)
    plen = min(1000, args.max_model_len - 32)
    ids = [llm.engine.add_request({"prompt_token_ids": rng.integers(3, cfg.vocab_size, plen).tolist()}, params,
                                  loras[i % 4]) for i in range(args.max_num_seqs)]
    # The prefill steps get a trace of their own (where a 1,024-token chunk's time goes).
    prefill_trace = tempfile.mkdtemp(prefix="jlora-trace-prefill-")
    jax.profiler.start_trace(prefill_trace)
    while llm.engine.has_unfinished() and any(not llm.engine.get_output(r).outputs[0].token_ids for r in ids):
        llm.engine.step()
    jax.profiler.stop_trace()
    top = profile_top(prefill_trace)
    (out / "profile_prefill.txt").write_text(top)
    print("== prefill steps\n" + top, flush=True)
    jax.profiler.start_trace(trace)
    for _ in range(20):
        llm.engine.step()
    jax.profiler.stop_trace()
    results["profile_rows"] = len(llm.engine.running)
    while llm.engine.has_unfinished():
        llm.engine.step()
    top = profile_top(trace)
    (out / "profile.txt").write_text(top)
    print(top, flush=True)
    _save(out, results)


def _save(out: Path, results: dict[str, Any]) -> None:
    (out / "results.json").write_text(json.dumps(results, indent=1, default=str))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="jlora bench tpu", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="llama-3.2-1b", choices=list(SHAPES))
    p.add_argument("--dir", default="/tmp/jlora-tpu-bench", help="where the random checkpoint and adapters go")
    p.add_argument("--out", default="tpu-results", help="results folder")
    p.add_argument("--sections", default="checkpoint,kernel,engine")
    p.add_argument("--workloads", default="", help="comma-separated indices into WORKLOADS (default: all)")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=1024)
    p.add_argument("--token-buckets", type=lambda s: tuple(int(x) for x in s.split(",")), default=(32, 128, 1024))
    p.add_argument("--decode-row-buckets", type=lambda s: tuple(int(x) for x in s.split(",")), default=None)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--lora-impl", default="auto")
    p.add_argument("--attn-impl", default="auto")
    p.add_argument("--attn-chunk", type=int, default=None, help="default: the engine's (128 XLA, 512 Pallas)")
    p.add_argument("--async-scheduling", default="auto", choices=["auto", "on", "off"])
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--kernel-variants", default="", type=lambda s: [tuple(int(x) for x in v.split("x")) for v in s.split(",") if v],
                   help="extra (block size)x(chunk) pairs for the kernel section, e.g. 16x256,32x256")
    args = p.parse_args(argv)
    if args.decode_row_buckets is None:
        args.decode_row_buckets = tuple(sorted({1, args.max_num_seqs}))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    ckpt = Path(args.dir) / args.shape
    results: dict[str, Any] = json.loads((out / "results.json").read_text()) if (out / "results.json").is_file() else {}
    sections = args.sections.split(",")
    if "checkpoint" in sections and not (ckpt / "config.json").is_file():
        s = write_checkpoint(ckpt, args.shape)
        results["checkpoint_write_s"] = s
        print(f"checkpoint {args.shape} written in {s:.1f} s", flush=True)
    if "kernel" in sections:
        cfg = SHAPES[args.shape]
        rows = results.setdefault("kernel", [])
        for r, ctx, nq in ((64, 1024, 1), (64, 256, 1), (1, 1024, 1), (1, 1024, 256)):
            for impl, chunk in (("pallas", args.attn_chunk or 512), ("xla", args.attn_chunk or 128)):
                rows += bench_kernel(cfg, r, ctx, nq, block_size=args.block_size, chunk=chunk, impls=(impl,))
            _save(out, results)
        for bs, chunk in args.kernel_variants:  # other page and chunk sizes, the Pallas kernel only
            rows += bench_kernel(cfg, 64, 1024, 1, block_size=bs, chunk=chunk, impls=("pallas",))
            rows += bench_kernel(cfg, 1, 1024, 256, block_size=bs, chunk=chunk, impls=("pallas",))
            _save(out, results)
    if "engine" in sections:
        bench_engine(ckpt, out, args, results)
    if "warm" in sections:  # its own process, after the one that compiled (one process holds the chip)
        t0 = time.perf_counter()
        import jax

        jax.devices()  # the TPU runtime's own start, apart from jlora's
        results["warm_runtime_start_s"] = time.perf_counter() - t0
        from jlora import LLM, compile_stats

        extra = {} if args.async_scheduling == "auto" else dict(async_scheduling=args.async_scheduling == "on")
        llm = LLM(str(ckpt), dtype=args.dtype, max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
                  max_num_batched_tokens=args.max_num_batched_tokens, token_buckets=args.token_buckets,
                  decode_row_buckets=args.decode_row_buckets, max_loras=4, max_lora_rank=args.rank,
                  lora_impl=args.lora_impl, attn_impl=args.attn_impl, block_size=args.block_size, progress=False,
                  **extra)
        results["warm_start_s"] = time.perf_counter() - t0
        results["warm_start_breakdown_s"] = dict(getattr(llm, "startup_seconds", {}),
                                                 runtime_start=results["warm_runtime_start_s"],
                                                 compile_cache_hits=compile_stats.cache_hit_count(),
                                                 compiles=compile_stats.compile_count())
        print(f"warm start (LLM(), compile and weights caches filled by an earlier process): "
              f"{results['warm_start_s']:.1f} s: {results['warm_start_breakdown_s']}", flush=True)
        _save(out, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
