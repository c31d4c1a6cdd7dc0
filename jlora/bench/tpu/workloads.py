"""The engine section of `jlora bench tpu`: LLM() on a random checkpoint, checked against the CPU
(jlora.bench.chip_check) before any timed row, then `WORKLOADS` through the engine's step loop,
measured by step listeners (`LLMEngine.add_step_listener`): tok/s, decode steps against the HBM
roofline, prefill against the MXU, TTFT, LoRA's cost, the host's share of a step, a profile."""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from jlora.bench.tpu.common import (HBM_BYTES, HBM_BYTES_PER_S, MXU_FLOPS, MXU_INT8_OPS, device_memory, is_oom,
                                    profile_top, run_tag, save_results, tuning_options)
from jlora.bench.tpu.shapes import SHAPE_ENGINE, SHAPES, kv_plan, make_adapters, matmul_params
from jlora.engine.step_listener import PHASES, StepListener

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


class StepLog(StepListener):
    """Each step's shape, device time and the bytes it must read (an engine's step listener). A
    step's time is from the later of its launch and the previous step's completion to its own
    completion: with async scheduling steps overlap the host, and this is the device's pace."""

    def __init__(self, weight_bytes: int, kv_bytes_per_token: int, slot_bytes: int):
        self.records: list[dict[str, Any]] = []
        self._pending: dict[int, tuple[float, dict[str, Any]]] = {}
        self.weight_bytes, self.kv_bytes_per_token, self.slot_bytes = weight_bytes, kv_bytes_per_token, slot_bytes
        self._last_done = 0.0

    def launched(self, batch: dict[str, Any], handle: Any, prev: Any, started: float) -> None:
        dec, pre = batch["dec_positions"], batch["pre_positions"]
        self._pending[id(handle)] = (started, dict(
            prefill=bool(pre.shape[0]), rows=int((dec >= 0).sum()), prefill_tokens=int((pre >= 0).sum()),
            kv_tokens=int((dec[dec >= 0] + 1).sum()), slots=len(set(int(x) for x in batch["slot_ids"] if x >= 0))))

    def collected(self, handle: Any, started: float, done: float) -> None:
        t0, rec = self._pending.pop(id(handle))
        rec["seconds"] = done - max(t0, self._last_done)
        self._last_done = done
        self.records.append(rec)

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


class HostPhases(StepListener):
    """Where an engine step's wall time goes on the host, per `engine.step()` call (an engine's step
    listener, `jlora.engine.step_listener.PHASES`): planning, building the batch, launching,
    waiting for the device, reading its outputs, booking and processing them, and the rest. Only
    the steps without a prefill count (`summary`): the decode pace the roofline is about."""

    PHASES = PHASES

    def __init__(self) -> None:
        self.calls: list[dict[str, Any]] = []
        self._cur: dict[str, Any] | None = None

    def step_started(self) -> None:
        self._cur = dict.fromkeys(self.PHASES, 0.0) | dict(prefill=False, launches=0, ahead=0)

    def step_finished(self, seconds: float) -> None:
        if self._cur is not None:
            self._cur["total"] = seconds
            self.calls.append(self._cur)
            self._cur = None

    def phase(self, name: str, seconds: float) -> None:
        if self._cur is not None:
            self._cur[name] += seconds

    def launched(self, batch: dict[str, Any], handle: Any, prev: Any, started: float) -> None:
        if self._cur is not None:
            self._cur["prefill"] |= bool(batch["pre_positions"].shape[0])
            self._cur["launches"] += 1
            self._cur["ahead"] += prev is not None

    def summary(self, first: int = 0) -> dict[str, Any]:
        calls = [c for c in self.calls[first:] if not c["prefill"] and c["launches"]]
        if not calls:
            return {}
        ms = {k: float(np.mean([c[k] for c in calls]) * 1e3) for k in self.PHASES + ("total",)}
        ms["other"] = ms["total"] - sum(ms[k] for k in self.PHASES)
        ms["host"] = ms["total"] - ms["wait_device"]
        return dict(host_ms_per_decode_step=ms, decode_calls=len(calls),
                    launched_ahead_fraction=float(np.mean([c["ahead"] > 0 for c in calls])))


def run_workload(llm: Any, log: StepLog, name: str, n: int, prompt_len: int, new: int, loras: list[Any],
                 seed: int, mxu_peak: float = MXU_FLOPS, phases: HostPhases | None = None) -> dict[str, Any]:
    """`n` requests of `prompt_len` random token ids and `new` greedy tokens (EOS ignored), adapters
    round robin, through the engine's step loop: tok/s, TTFT, and from the engine's step listeners
    (`log`, `phases`) the decode steps against the HBM roofline and prefill against the MXU."""
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
    while engine.has_unfinished():
        engine.step(finished_only=True)
    wall = time.perf_counter() - t0
    outs = [engine.pop_finished(r) for r in ids]
    generated = sum(len(o.outputs[0].token_ids) for o in outs)
    ttft = sorted(o.metrics.time_to_first_token for o in outs)
    recs = log.records[first:]
    pre = [r for r in recs if r["prefill"]]
    cfg = engine.runner.cfg
    flops = sum(2 * matmul_params(cfg) * (r["prefill_tokens"] + r["rows"]) for r in pre)
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
    from jlora.engine.hlo import whole_cache_copies as find_copies

    runner = llm.engine.runner
    graphs = runner.compiled_graphs
    shapes = {tuple(x.shape) for x in runner.cache.values()}  # K/V and an int8 cache's scales
    found = {str(shape): [c for s in shapes for c in find_copies(exe.as_text(), s)] for shape, exe in graphs.items()}
    return dict(cache_shape=list(runner.cache["k"].shape), whole_cache_copies=[c for v in found.values() for c in v],
                step_graphs_checked=len(found))


def whole_weight_copies(llm: Any) -> list[str]:
    """Copies, transposes and copy fusions in the compiled step graphs that produce a whole stacked
    weight ([L, ...]) or the embedding/head: XLA:TPU re-laying out a weight it was handed (an int8
    [L, out, in] stack, say) would cost a full read and write of it, and its memory, every step."""
    from jlora.engine.hlo import whole_cache_copies as find_copies

    runner = llm.engine.runner
    shapes = {tuple(w.shape) for w in runner.weights if w.ndim >= 2 and w.shape[0] > 1}
    return [c for exe in runner.compiled_graphs.values() for text in [exe.as_text()] for shape in shapes
            for c in find_copies(text, shape)]


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
                       int(args.kv_headroom_gb * 1e9), cap=args.max_seqs_cap,
                       kv_cache_dtype=getattr(args, "kv_cache_dtype", "auto"))
        n = plan["max_num_seqs"]
    else:
        n = int(args.max_num_seqs)
    rows = args.decode_row_buckets or ((n,) if eng.get("one_row_bucket") else tuple(sorted({1, n})))
    return dict(max_num_seqs=n, num_kv_blocks=args.num_kv_blocks, max_num_batched_tokens=batched,
                token_buckets=tuple(buckets), decode_row_buckets=tuple(rows), plan=plan)


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
    if args.base_graphs is not None:
        extra["base_graphs"] = args.base_graphs
    if args.warmup != "auto":
        extra["warmup"] = args.warmup
    if args.executable_cache != "auto":
        extra["executable_cache"] = args.executable_cache == "on"
    if getattr(args, "kv_cache_dtype", "auto") != "auto":
        extra["kv_cache_dtype"] = args.kv_cache_dtype
    return LLM(str(ckpt), dtype=args.dtype, quantization=args.quantization, max_model_len=args.max_model_len,
               max_num_seqs=sizes["max_num_seqs"], max_num_batched_tokens=sizes["max_num_batched_tokens"],
               token_buckets=sizes["token_buckets"], decode_row_buckets=sizes["decode_row_buckets"], max_loras=4,
               max_lora_rank=args.rank, lora_impl=args.lora_impl, block_size=args.block_size,
               weights_cache=str(weights_cache_dir(args)), progress=False, tuning=tuning_options(args), **extra)


def check_workdir(args: argparse.Namespace) -> Path:
    return Path(args.dir) / f"check-engine-{args.shape}"


def quantization_of(args: argparse.Namespace) -> str | None:
    return None if args.quantization == "none" else args.quantization


def start_reference_for(ckpt: Path, args: argparse.Namespace, sizes: dict[str, Any]) -> Any:
    """The chip check's CPU reference (`chip_check.start_engine_reference`) for the engine
    `make_llm(ckpt, args, sizes)` is about to build, planned from the EngineConfig LLM() derives
    from the same arguments."""
    import jax

    from jlora.bench import chip_check
    from jlora.engine_args import engine_config
    from jlora.models.loading import read_model_config, resolve_model_path

    config = engine_config(dtype=args.dtype, max_model_len=args.max_model_len, max_num_seqs=sizes["max_num_seqs"],
                           max_num_batched_tokens=sizes["max_num_batched_tokens"],
                           token_buckets=sizes["token_buckets"], decode_row_buckets=sizes["decode_row_buckets"],
                           max_loras=4, max_lora_rank=args.rank, lora_impl=args.lora_impl,
                           block_size=args.block_size, backend=jax.default_backend(),
                           kv_cache_dtype=getattr(args, "kv_cache_dtype", "auto"))
    model_cfg = read_model_config(resolve_model_path(str(ckpt)))
    return chip_check.start_engine_reference(config, model_cfg, ckpt, check_workdir(args), quantization_of(args))


def ready_then_all(llm: Any, t0: float) -> dict[str, Any]:
    """Start-up after LLM() returned, ready to serve: one short request's seconds, then the seconds
    since `t0` until a background warm-up has compiled the other graphs (at once for an eager one)."""
    from jlora import SamplingParams

    t = time.perf_counter()
    llm.generate([{"prompt_token_ids": [3, 4, 5, 6]}], SamplingParams(max_tokens=8, ignore_eos=True),
                 use_tqdm=False)
    out: dict[str, Any] = dict(warmup_mode=llm.warmup_mode, first_request_s=time.perf_counter() - t)
    llm.wait_for_warmup()
    out["all_graphs_s"] = time.perf_counter() - t0
    return out


def weights_cache_dir(args: argparse.Namespace) -> Path:
    return Path(args.dir) / "weights"


def step_memory(llm: Any) -> dict[str, dict[str, int]]:
    """Each compiled step graph's memory as XLA planned it (temporaries, arguments, outputs, aliased)."""
    out = {}
    for shape, exe in llm.engine.runner.compiled_graphs.items():
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
        save_results(out, results)
        return
    print(f"engine {tag}: block size {args.block_size}, max_num_seqs {sizes['max_num_seqs']}, token buckets "
          f"{sizes['token_buckets']}, decode row "
          f"buckets {sizes['decode_row_buckets']}" + (f", KV plan {json.dumps(sizes['plan'])}" if sizes["plan"] else ""),
          flush=True)
    # The check's CPU reference starts now, planned from the config LLM() will build, so it runs
    # while the chip engine loads and compiles (check_engine starts it again if the plan missed).
    from jlora.bench import chip_check

    reference = start_reference_for(ckpt, args, sizes)
    t0 = time.perf_counter()
    llm, failed = None, None
    for attempt in range(3):
        try:
            llm = make_llm(ckpt, args, sizes, attn_impl=None if failed is None else "xla")
            break
        except Exception as e:  # noqa: BLE001 (say why, then try smaller, or the XLA attention)
            failed = f"{type(e).__name__}: {str(e)[:3000]}"
            oom = is_oom(e)
        gc.collect()  # the failed engine's arrays go before the next try
        print(f"engine {tag} (max_num_seqs {sizes['max_num_seqs']}, attn_impl {args.attn_impl}) FAILED: {failed}",
              flush=True)
        res.setdefault("engine_errors", []).append(failed)
        save_results(out, results)
        if oom:  # a quarter fewer sequences; the XLA attention only for a non-memory failure
            failed = None
            sizes["max_num_seqs"] = max(1, sizes["max_num_seqs"] * 3 // 4)
            sizes["decode_row_buckets"] = tuple(sorted({min(r, sizes["max_num_seqs"]) for r in sizes["decode_row_buckets"]}))
            sizes["num_kv_blocks"] = None
        elif args.attn_impl == "xla":
            reference.proc.kill()
            raise RuntimeError(f"engine {tag} failed: {failed}")
        t0 = time.perf_counter()
    if llm is None:
        reference.proc.kill()
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
    weight_bytes = sum(int(w.nbytes) for w in runner.weights)
    embed_bytes = sum(int(w.nbytes) for path, w in leaves if "embed_tokens" in jax.tree_util.keystr(path))
    # A decode step reads the whole of every weight but an untied embedding table (only its rows).
    step_weight_bytes = weight_bytes - (0 if cfg.tie_word_embeddings else embed_bytes)
    # What a step reads a token of context: K and V rows (and an int8 cache's float32 scale a KV head).
    kv_per_token = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * (
        cfg.head_dim * runner.cache["k"].dtype.itemsize + (4 if "k_scale" in runner.cache else 0))
    slot_bytes = sum(int(x.nbytes) for x in jax.tree.leaves(runner.lora.state)) // llm.config.max_loras
    report = llm.memory_report()
    eng = dict(shape=args.shape, quantization=args.quantization, activations=report["weights"].get("activations"),
               start_s=start_s, **started, startup_seconds=llm.startup_seconds,
               weights_cache_hit=llm.weights_cache_hit, attn_impl=runner.attn_impl,
               async_default=llm.engine.async_scheduling, attn_chunk=runner.attn_chunk,
               lora_impl=args.lora_impl, tuning=dataclasses.asdict(llm.config.tuning),
               lora_slices=llm.config.tuning.lora_slices,
               lora_cond=llm.config.tuning.resolved_lora_cond(jax.default_backend()),
               base_graphs=llm.config.base_graphs, max_num_seqs=n,
               block_size=llm.config.block_size,
               num_kv_blocks=llm.config.num_kv_blocks,
               kv_cache_tokens=llm.config.kv_capacity_tokens, token_buckets=list(llm.config.token_buckets),
               decode_row_buckets=list(llm.config.decode_row_buckets), max_num_batched_tokens=llm.config.max_num_batched_tokens,
               kv_plan=sizes["plan"], kv_cache_dtype=llm.config.kv_cache_dtype, graphs=llm.config.num_step_graphs, weight_bytes=weight_bytes,
               weight_bytes_per_step=step_weight_bytes, memory_report=report,
               compile_seconds=runner.compile_seconds, device_memory=device_memory(),
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
    save_results(out, results)

    # No figure without its tokens checked: this engine against the CPU on the same checkpoint,
    # every step graph it compiled (jlora.bench.chip_check); a failure withholds every timed row.
    eng["check"] = chip_check.check_engine(llm, ckpt, check_workdir(args), quantization_of(args), reference)
    print(f"engine {tag}: check against the CPU: {chip_check.summary_line(eng['check'])} "
          f"({eng['check']['seconds']:.0f} s)", flush=True)
    save_results(out, results)
    if not eng["check"]["passed"]:
        print(f"engine {tag}: no timed rows: this configuration failed its check", flush=True)
        res["engine_withheld"] = "the engine failed its check against the CPU"
        save_results(out, results)
        return

    mxu = MXU_INT8_OPS if eng["activations"] == "int8" else MXU_FLOPS
    log, phases = StepLog(step_weight_bytes, kv_per_token, slot_bytes), HostPhases()
    llm.engine.add_step_listener(log)
    llm.engine.add_step_listener(phases)
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
    first_row = len(rows)
    for slack, round_ in [(s, r) for s in args.prefill_slack or [llm.config.tuning.prefill_slack]
                          for r in range(args.repeats)]:
        if args.prefill_slack:  # several scheduler policies on one engine: the same graphs
            llm.engine.scheduler.prefill_slack = slack
        for i, (name, count, plen, new, k) in enumerate(WORKLOADS):
            if picked is not None and str(i) not in picked:
                continue
            if plen + new > args.max_model_len:
                continue
            count = n if count is None else count
            label = name.replace("Nx", f"{count}x") + (f" [prefill slack {slack}]" if args.prefill_slack else "")
            llm.reset_prefix_cache()  # a policy's rerun must not hit the last one's blocks
            row = run_workload(llm, log, label, count, plen, new, loras[:k], seed=i, mxu_peak=mxu, phases=phases)
            rows.append({**row, "quantization": args.quantization, "max_num_seqs": n, "prefill_slack": slack,
                         "round": round_})
            save_results(out, results)
    if args.repeats > 1:
        eng["repeat_summary"] = summary = repeat_summary(rows[first_row:])
        print("over " + f"{args.repeats} rounds (median [min, max]):\n" + format_repeat_summary(summary), flush=True)
    eng["compiles_after_warmup"] = compile_stats.compile_count() - compiles_before
    eng["device_memory_after_workloads"] = device_memory()  # its peak: what the steps' temporaries took
    print(f"compiles after warm-up: {eng['compiles_after_warmup']}; device memory {eng['device_memory_after_workloads']}",
          flush=True)
    if not args.quick:  # the same greedy requests with and without async scheduling
        rng = np.random.default_rng(7)
        prompts = [{"prompt_token_ids": rng.integers(3, cfg.vocab_size, 100 + 13 * i).tolist()} for i in range(8)]
        got = {}
        for mode in (True, False):
            llm.engine.async_scheduling = mode
            llm.reset_prefix_cache()  # else the second mode reuses the first's blocks: other steps
            got[mode] = [o.outputs[0].token_ids for o in llm.generate(
                prompts, SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True),
                lora_request=[loras[i % 4] for i in range(8)], use_tqdm=False)]
        llm.engine.async_scheduling = eng["async_default"]
        eng["async_equals_sync"] = got[True] == got[False]
        print(f"async scheduling gives the same tokens as sync: {eng['async_equals_sync']}", flush=True)
    save_results(out, results)
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
    save_results(out, results)


# ---- the loader alone, each load in a process of its own ----------------------------------------------


