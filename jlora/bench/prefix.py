"""Prefix caching on a shared system prompt: the same workload with the cache on and off.

The workload (issue 35): `--requests` requests (64) share one `--system-tokens`-token system
prompt (1,024) followed by a short distinct user turn (`--user-tokens`, 16-32 tokens), over
`--adapters` PEFT adapters (4, random, rank `--lora-rank` on every linear layer) round robin, each
generating `--new-tokens` (64) greedy tokens with EOS ignored, all queued at once. Prompts are
random token ids, so any checkpoint serves: the default model, or a random-weight one
(`--shape NAME` writes `jlora.bench.tpu`'s checkpoint of that shape at `--model` when none is
there: a TPU machine needs no model hub). Each mode gets a fresh engine (the first is freed
before the second is built), warmed up, its adapters in their slots, and its cache cold: the
warm-up prompts share nothing with the timed ones.

Every request has a decode row by default (`--max-num-seqs` = `--requests`), so TTFT measures
what a prefix cache changes: the prefill a request waits for. With fewer rows than requests
most requests wait for a row instead, behind whole earlier requests' decodes (64 steps each),
which no cache shortens: at 16 rows for 64 requests that wait is most of the TTFT either way
(docs/benchmarks.md).

Reported per mode: prompt tokens computed (prefill tokens, recomputation included), prefix cache
queries and hits, TTFT p50/p99 (from queueing to the first token), generated tok/s over the
whole run, wall seconds, engine start seconds, step graphs and compiles during the timed run;
then the on/off ratios and whether both modes gave the same tokens. `--out DIR` also writes
them to DIR/prefix.json and DIR/prefix.md.

    jlora bench prefix [--model PATH] [--shape NAME] [--dtype float32] [--requests 64]
                       [--system-tokens 1024] [--new-tokens 64] [--max-num-seqs N] [--out DIR] ...

On the CPU at smaller sizes, e.g. `--requests 32 --system-tokens 512 --new-tokens 32`; on a TPU
chip, `--model /tmp/b/llama-3.2-1b --shape llama-3.2-1b --dtype bfloat16 --out results/`.
"""

from __future__ import annotations

import argparse
import gc
import json
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from jlora.bench.peft_adapters import ALL_LINEAR, write_peft_adapter


def workload(vocab: int, args: argparse.Namespace, seed: int) -> list[list[int]]:
    """Prompts: one shared system prompt, then a distinct user turn each (random ids above the specials)."""
    rng = np.random.default_rng(seed)
    system = rng.integers(3, vocab, args.system_tokens).tolist()
    lo, hi = args.user_tokens
    return [system + rng.integers(3, vocab, int(rng.integers(lo, hi + 1))).tolist() for _ in range(args.requests)]


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    kw = dict(dtype=args.dtype, max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
              max_num_batched_tokens=args.max_num_batched_tokens, max_loras=max(args.adapters, 1),
              max_lora_rank=args.lora_rank, num_kv_blocks=args.num_kv_blocks, token_buckets=args.token_buckets,
              decode_row_buckets=args.decode_row_buckets, progress=False)
    if args.async_scheduling != "auto":
        kw["async_scheduling"] = args.async_scheduling == "on"
    return kw


def run_mode(enabled: bool, args: argparse.Namespace, root: Path) -> dict[str, Any]:
    from jlora import LLM, LoRARequest, SamplingParams, compile_stats

    compiles, t0 = compile_stats.compile_count(), time.perf_counter()
    llm = LLM(args.model, enable_prefix_caching=enabled, **engine_kwargs(args))
    start_s, start_compiles = time.perf_counter() - t0, compile_stats.compile_count() - compiles
    cfg = llm.engine.adapters.model_cfg
    paths = sorted(root.glob("prefix*"))
    if len(paths) < args.adapters:
        paths = [write_peft_adapter(root / f"prefix{i}", cfg, args.lora_rank, ALL_LINEAR, np.random.default_rng(i))
                 for i in range(args.adapters)]
    loras = [LoRARequest(p.name, i + 1, str(p)) for i, p in enumerate(paths)] or [None]
    params = SamplingParams(temperature=0.0, max_tokens=args.new_tokens, ignore_eos=True)
    prompts = workload(cfg.vocab_size, args, seed=0)
    per_prompt = [loras[i % len(loras)] for i in range(len(prompts))]
    # Warm-up: adapters converted and in their slots, every graph run; other tokens, so the cache starts cold.
    warm = workload(cfg.vocab_size, argparse.Namespace(**{**vars(args), "requests": len(loras)}), seed=1)
    llm.generate([{"prompt_token_ids": p} for p in warm], params, loras, use_tqdm=False)
    before, compiles = llm.engine.stats(), compile_stats.compile_count()
    t0 = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, per_prompt, use_tqdm=False)
    wall = time.perf_counter() - t0
    after = llm.engine.stats()
    ttft = np.array([o.metrics.time_to_first_token for o in outs])
    generated = sum(len(o.outputs[0].token_ids) for o in outs)
    result = {
        "prompt_tokens": sum(len(p) for p in prompts),
        "prompt_tokens_computed": after.prefill_tokens - before.prefill_tokens,
        "prefix_cache_queries": after.prefix_cache_queries - before.prefix_cache_queries,
        "prefix_cache_hits": after.prefix_cache_hits - before.prefix_cache_hits,
        "ttft_p50_s": float(np.percentile(ttft, 50)), "ttft_p99_s": float(np.percentile(ttft, 99)),
        "tok_s": generated / wall, "wall_s": wall, "generated_tokens": generated,
        "preemptions": after.num_preemptions - before.num_preemptions,
        "start_s": start_s, "start_compiles": start_compiles,
        "step_graphs": llm.config.num_step_graphs,
        "compiles_after_warmup": compile_stats.compile_count() - compiles,
        "tokens": [o.outputs[0].token_ids for o in outs],
    }
    del llm, outs
    gc.collect()
    return result


ROWS = (("prompt tokens computed", "prompt_tokens_computed", "{:,}"),
        ("prefix cache hits (tokens)", "prefix_cache_hits", "{:,}"), ("TTFT p50 (s)", "ttft_p50_s", "{:.3g}"),
        ("TTFT p99 (s)", "ttft_p99_s", "{:.3g}"), ("generated tok/s", "tok_s", "{:.1f}"),
        ("wall (s)", "wall_s", "{:.3g}"), ("engine start (s)", "start_s", "{:.1f}"),
        ("step graphs", "step_graphs", "{}"), ("compiles after warm-up", "compiles_after_warmup", "{}"))


def table(res: dict[str, dict[str, Any]]) -> str:
    modes = list(res)
    out = ["| | " + " | ".join(f"cache {m}" for m in modes) + " |", "|---" * (len(modes) + 1) + "|"]
    out += [f"| {label} | " + " | ".join(fmt.format(res[m][key]) for m in modes) + " |" for label, key, fmt in ROWS]
    return "\n".join(out)


def markdown(out: dict[str, Any]) -> str:
    a, modes = out["args"], [m for m in ("off", "on") if m in out]
    lines = [f"# jlora bench prefix ({out['device']}, jax {out['jax']})", "",
             f"{a['requests']} requests, a {a['system_tokens']:,}-token shared system prompt, "
             f"{a['user_tokens'][0]}-{a['user_tokens'][1]}-token user turns, {a['adapters']} adapters (rank "
             f"{a['lora_rank']}, every linear layer) round robin, {a['new_tokens']} new tokens (greedy, EOS "
             f"ignored), all queued at once; {a['model'] or 'SmolLM2-135M-Instruct'} in {a['dtype']}, "
             f"max_num_seqs={a['max_num_seqs']}, max_num_batched_tokens={a['max_num_batched_tokens']}, "
             f"max_model_len={a['max_model_len']}.", "", table({m: out[m] for m in modes})]
    if "ratios" in out:
        r = out["ratios"]
        t = out["token_agreement"]
        lines += ["", f"Same tokens in both modes: {out['same_tokens']} ({t['identical']} of {t['requests']} requests "
                  f"identical; the others first differ at generated token {t['first_difference_min']} or later, "
                  f"median {t['first_difference_median']}). Prompt tokens computed "
                  f"-{r['prompt_tokens_computed_drop']:.1%}, TTFT p50 {r['ttft_p50_speedup']:.2f}x, "
                  f"p99 {r['ttft_p99_speedup']:.2f}x, throughput {r['tok_s_speedup']:.2f}x."]
    return "\n".join(lines) + "\n"


def token_agreement(a: list[list[int]], b: list[list[int]]) -> dict[str, Any]:
    """How far two runs' outputs agree, request by request: how many are identical, and where the
    others first differ (a bf16 engine may flip a near-tie when a prompt's KV was computed in other
    chunks; float32 on the CPU must agree exactly, tests/test_prefix_cache.py)."""
    first = sorted(next((i for i, (x, y) in enumerate(zip(p, q)) if x != y), min(len(p), len(q)))
                   for p, q in zip(a, b) if p != q)
    return {"requests": len(a), "identical": len(a) - len(first),
            "first_difference_median": first[len(first) // 2] if first else None,
            "first_difference_min": first[0] if first else None}


def parse_ints(s: str) -> tuple[int, ...]:
    return tuple(int(x) for x in s.split(","))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="jlora bench prefix", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="checkpoint (default: SmolLM2-135M-Instruct)")
    p.add_argument("--shape", default=None, help="write jlora.bench.tpu's random checkpoint of this shape "
                   "(llama-3.2-1b, tiny, ...) at --model when it has none")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--system-tokens", type=int, default=1024)
    p.add_argument("--user-tokens", default="16,32", help="lo,hi: each user turn's length")
    p.add_argument("--adapters", type=int, default=4, help="adapters round robin (0: base model only)")
    p.add_argument("--lora-rank", type=int, default=8)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--max-num-seqs", type=int, default=None, help="decode rows (default: --requests, all in flight)")
    p.add_argument("--max-model-len", type=int, default=None,
                   help="default: the longest prompt + --new-tokens, rounded up to a multiple of 128")
    p.add_argument("--max-num-batched-tokens", type=int, default=512)
    p.add_argument("--num-kv-blocks", type=int, default=None)
    p.add_argument("--token-buckets", type=parse_ints, default=None, help="e.g. 32,128,512 (default: the engine's)")
    p.add_argument("--decode-row-buckets", type=parse_ints, default=None, help="default: the engine's")
    p.add_argument("--async-scheduling", default="auto", choices=["auto", "on", "off"])
    p.add_argument("--modes", default="off,on", help="comma-separated: on, off (each a fresh engine, in this order)")
    p.add_argument("--out", default=None, help="also write prefix.json and prefix.md to this folder")
    args = p.parse_args(argv)
    args.user_tokens = parse_ints(args.user_tokens)
    modes = args.modes.split(",")
    if not set(modes) <= {"on", "off"} or len(args.user_tokens) != 2:
        p.error("--modes takes on/off; --user-tokens takes lo,hi")
    longest = args.system_tokens + args.user_tokens[1] + args.new_tokens
    if args.max_model_len is None:
        args.max_model_len = -(-longest // 128) * 128
    if args.max_num_seqs is None:
        args.max_num_seqs = args.requests
    if longest > args.max_model_len:
        p.error("--system-tokens + the longest user turn + --new-tokens exceed --max-model-len")
    if args.shape is not None:
        if args.model is None:
            p.error("--shape needs --model: where the checkpoint is (or goes)")
        if not (Path(args.model) / "config.json").is_file():
            from jlora.bench.tpu.shapes import write_checkpoint

            print(f"writing a random {args.shape} checkpoint at {args.model}: "
                  f"{write_checkpoint(Path(args.model), args.shape):.1f} s", flush=True)
    import jax

    root = Path(tempfile.mkdtemp(prefix="jlora-prefix-"))
    try:
        res = {m: run_mode(m == "on", args, root) for m in modes}
    finally:
        shutil.rmtree(root, ignore_errors=True)
    tokens = {m: res[m].pop("tokens") for m in modes}
    out: dict[str, Any] = {"args": vars(args), "device": str(jax.devices()[0].device_kind), "jax": jax.__version__,
                           **res}
    if {"on", "off"} <= set(modes):
        on, off = res["on"], res["off"]
        out["same_tokens"] = tokens["on"] == tokens["off"]
        out["token_agreement"] = token_agreement(tokens["off"], tokens["on"])
        out["ratios"] = {
            "prompt_tokens_computed_drop": 1 - on["prompt_tokens_computed"] / off["prompt_tokens_computed"],
            "ttft_p50_speedup": off["ttft_p50_s"] / on["ttft_p50_s"],
            "ttft_p99_speedup": off["ttft_p99_s"] / on["ttft_p99_s"],
            "tok_s_speedup": on["tok_s"] / off["tok_s"]}
    print(json.dumps(out, indent=1))
    print(table(res))
    if args.out is not None:
        d = Path(args.out)
        d.mkdir(parents=True, exist_ok=True)
        (d / "prefix.json").write_text(json.dumps(out, indent=1))
        (d / "prefix.md").write_text(markdown(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
