"""`jlora bench`: the reference workload, side by side with transformers(+peft), in one run.

The workload: SmolLM2-135M, 16 requests of 16-64 prompt tokens, 64 new tokens, greedy, EOS ignored,
4 PEFT adapters of ranks 8/16/8/32 assigned round-robin; jlora with the adapters mixed and with none,
against transformers and transformers+peft on the same machine, with the machine's roofline.

Needs the test extras (torch CPU, transformers, peft): `make bench`. Results go to stdout and,
with --write, into docs/benchmarks.md and its throughput chart docs/benchmarks.svg.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np

from jlora.bench import start
from jlora.bench.docs import ANALYSIS_MARKER, DOCS
from jlora.plot import bar_chart_svg

RANKS = (8, 16, 8, 32)
ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
MLP = ["gate_proj", "up_proj", "down_proj"]
# --adapters: (rank, peft target_modules) of each of the 4 adapters. "reference" is issue 18's shape
# (ranks 4/16/8/24, mixed targets), where peft's per-adapter loop does less work than on all-linear.
ADAPTER_SETS = {
    "all-linear": tuple((r, "all-linear") for r in RANKS),
    "reference": ((4, ["q_proj", "v_proj"]), (16, "all-linear"), (8, ATTENTION), (24, MLP)),
}
# jlora modes: name -> LLM keyword arguments. "float32" is the reference every ratio is taken against.
MODES = {"float32": {}, "bfloat16": {"dtype": "bfloat16"}, "int8": {"quantization": "int8"},
         "int8-weight-only": {"quantization": "int8-weight-only"}}
VERSION_PACKAGES = ("jax", "jaxlib", "flax", "torch", "transformers", "peft")
TEXT = ("The history of science is the study of the development of science and scientific knowledge, "
        "including both the natural and social sciences. Science is a body of empirical, theoretical, and "
        "practical knowledge about the natural world, produced by scientists who emphasize the observation, "
        "explanation, and prediction of real-world phenomena. ") * 20


CHAT_QUESTIONS = ["What is the capital of France, and why is it famous?", "Give me three tips for writing clean code.",
                  "Explain photosynthesis to a ten-year-old.", "Write a haiku about the sea at night.",
                  "What is the difference between a list and a tuple in Python?",
                  "Suggest a name for a small bakery and explain it.", "How do vaccines train the immune system?",
                  "Summarize the plot of Romeo and Juliet in two sentences."]


def make_prompts(tokenizer: Any, n: int, lo: int, hi: int, seed: int = 0) -> list[list[int]]:
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        length = int(rng.integers(lo, hi + 1))
        start = int(rng.integers(0, len(ids) - length))
        out.append(ids[start: start + length])
    return out


def describe_adapters(name: str) -> str:
    """'rank 4 on q_proj/v_proj, rank 16 on all-linear, ...' for an ADAPTER_SETS entry."""
    return ", ".join(f"rank {r} on {t if isinstance(t, str) else '/'.join(t)}" for r, t in ADAPTER_SETS[name])


def make_peft_adapters(hf_model: Any, root: Path, adapters=ADAPTER_SETS["all-linear"]) -> list[Path]:
    import torch
    from peft import LoraConfig, get_peft_model

    paths = []
    for i, (r, targets) in enumerate(adapters):
        torch.manual_seed(i)
        name = f"bench{i}-r{r}"
        pm = get_peft_model(hf_model, LoraConfig(r=r, lora_alpha=2 * r, target_modules=targets,
                                                 init_lora_weights=False), adapter_name=name)
        pm.save_pretrained(root, selected_adapters=[name])
        pm.unload()
        paths.append(root / name)
    return paths


def measure_roofline() -> dict[str, float]:
    """Memory bandwidth (GB/s, a reduction over 512 MB) and f32 matmul GFLOP/s, through XLA."""
    import jax
    import jax.numpy as jnp

    big = jnp.ones((128 * 1024 * 1024,), jnp.float32)
    red = jax.jit(lambda x: jnp.sum(x))
    red(big).block_until_ready()
    t = min(_timeit(lambda: red(big).block_until_ready()) for _ in range(3))
    bw = big.nbytes / t / 1e9
    a = jnp.ones((2048, 2048), jnp.float32)
    mm = jax.jit(lambda a: a @ a)
    mm(a).block_until_ready()
    t = min(_timeit(lambda: mm(a).block_until_ready()) for _ in range(3))
    return {"mem_gbps": bw, "matmul_gflops": 2 * 2048**3 / t / 1e9}


def _timeit(fn: Callable[[], Any]) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def hf_generate(model: Any, prompts: list[list[int]], new_tokens: int, adapter_names: list[str] | None = None) -> int:
    import torch

    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), 2, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):  # left padding, as transformers expects for batched generation
        ids[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1
    kw = {"adapter_names": adapter_names} if adapter_names else {}
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens,
                             min_new_tokens=new_tokens, do_sample=False, pad_token_id=2, **kw)
    return int((out.shape[1] - width) * len(prompts))


def versions() -> dict[str, str]:
    from importlib import metadata

    out = {}
    for p in VERSION_PACKAGES:
        try:
            out[p] = metadata.version(p)
        except metadata.PackageNotFoundError:
            out[p] = "not installed"
    return out


def mode_row(name: str) -> str:
    return "jlora, 4 adapters mixed" if name == "float32" else f"jlora {name}, 4 adapters mixed"


def run(args: argparse.Namespace) -> dict[str, Any]:
    import jax
    import torch
    import transformers
    from peft import PeftModel

    from jlora import LLM, LoRARequest, SamplingParams, compile_stats
    from jlora.models import default_model_path

    torch.set_num_threads(args.threads)
    path = default_model_path()
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                           dtype=torch.float32).eval()
    tmp = Path(tempfile.mkdtemp(prefix="jlora-bench-"))
    adapter_set = ADAPTER_SETS[args.adapters]
    adapter_paths = make_peft_adapters(hf, tmp, adapter_set)
    ranks = [r for r, _ in adapter_set]
    # --slot-ranks: each slot as wide as one adapter's rank (LLM(lora_slot_ranks=)), else max_lora_rank each
    slots = dict(max_loras=4, max_lora_rank=max(ranks), lora_slot_ranks=tuple(ranks) if args.slot_ranks else None)
    llm = LLM(max_model_len=args.max_model_len, max_num_seqs=16, max_num_batched_tokens=512,
              lora_impl=args.lora_impl, progress=True, **slots)
    prompts = make_prompts(llm.tokenizer, args.requests, 16, 64)
    reqs = [LoRARequest(p.name, i + 1, str(p)) for i, p in enumerate(adapter_paths)]
    per_prompt = [reqs[i % 4] for i in range(len(prompts))]
    params = SamplingParams(temperature=0.0, max_tokens=args.new_tokens, ignore_eos=True)

    peft_model = PeftModel.from_pretrained(hf, str(adapter_paths[0]), adapter_name=reqs[0].lora_name)
    for r, p in zip(reqs[1:], adapter_paths[1:]):
        peft_model.load_adapter(str(p), adapter_name=r.lora_name)
    peft_model.eval()
    names = [r.lora_name for r in per_prompt]
    # transformers+peft in bfloat16 (torch computes bf16 matmuls natively, AMX where the CPU has it).
    hf16 = transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                             dtype=torch.bfloat16).eval()
    peft16 = PeftModel.from_pretrained(hf16, str(adapter_paths[0]), adapter_name=reqs[0].lora_name)
    for r, p in zip(reqs[1:], adapter_paths[1:]):
        peft16.load_adapter(str(p), adapter_name=r.lora_name)
    peft16.eval()
    # The other jlora modes: same sizes, one engine each.
    modes = [m for m in args.modes if m != "float32"]
    mode_llms = {m: LLM(max_model_len=args.max_model_len, max_num_seqs=16, max_num_batched_tokens=512,
                        lora_impl=args.lora_impl, progress=True, **slots, **MODES[m])
                 for m in modes}

    chat_prompts = [llm.apply_chat_template([{"role": "user", "content": q}])
                    for q in (CHAT_QUESTIONS * args.requests)[: args.requests]]

    def jlora_run(loras, ids=prompts, engine=llm):
        def go() -> int:
            outs = engine.generate([{"prompt_token_ids": p} for p in ids], params, lora_request=loras, use_tqdm=False)
            return sum(len(o.outputs[0].token_ids) for o in outs)
        return go

    def greedy_tokens(engine) -> list[list[int]]:
        outs = engine.generate([{"prompt_token_ids": p} for p in prompts], params, lora_request=per_prompt,
                               use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]

    def hf_base() -> int:
        with peft_model.disable_adapter():
            return hf_generate(peft_model, prompts, args.new_tokens)

    def hf_peft(ids=prompts):
        return lambda: hf_generate(peft_model, ids, args.new_tokens, adapter_names=names)

    systems: dict[str, Callable[[], int]] = {
        "jlora, 4 adapters mixed": jlora_run(per_prompt),
        "jlora, no adapters": jlora_run(None),
        "transformers, no adapters": hf_base,
        "transformers+peft, 4 adapters mixed": hf_peft(),
        "jlora, 4 adapters mixed, chat prompts": jlora_run(per_prompt, chat_prompts),
        "transformers+peft, 4 adapters mixed, chat prompts": hf_peft(chat_prompts),
        "transformers+peft bfloat16, 4 adapters mixed":
            lambda: hf_generate(peft16, prompts, args.new_tokens, adapter_names=names),
        **{mode_row(m): jlora_run(per_prompt, engine=e) for m, e in mode_llms.items()},
    }
    # Adapters into slots once (not timed); each mode's greedy tokens against float32's.
    ref_tokens = greedy_tokens(llm)
    agreement = {}
    for m, e in mode_llms.items():
        got = greedy_tokens(e)
        agreement[m] = {"greedy_token_agreement": float(np.mean([np.mean(np.array(a) == np.array(b))
                                                                 for a, b in zip(got, ref_tokens)])),
                        "first_token_agreement": float(np.mean([a[0] == b[0] for a, b in zip(got, ref_tokens)]))}
    compiles_before = compile_stats.compile_count()
    times: dict[str, list[float]] = {k: [] for k in systems}
    tokens: dict[str, int] = {}
    for _ in range(args.rounds):  # interleaved rounds, so drift hits every system alike
        for name, fn in systems.items():
            t = time.perf_counter()
            tokens[name] = fn()
            times[name].append(time.perf_counter() - t)
    result: dict[str, Any] = {"throughput": {k: tokens[k] / statistics.median(v) for k, v in times.items()}}
    result["compiles_after_warmup"] = compile_stats.compile_count() - compiles_before
    result["versions"] = versions()
    result["modes"] = {m: {"tok_s": result["throughput"][mode_row(m)], **agreement.get(m, {}),
                           "memory": (mode_llms.get(m) or llm).memory_report()} for m in ["float32", *modes]}
    del mode_llms, peft16, hf16

    # Prefill-heavy: 8 requests of 512 prompt tokens, 8 new tokens; time to first token.
    long_prompts = make_prompts(llm.tokenizer, 8, 512, 512, seed=1)
    outs = llm.generate([{"prompt_token_ids": p} for p in long_prompts],
                        SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True),
                        lora_request=[reqs[i % 4] for i in range(8)], use_tqdm=False)
    ttft = [o.metrics.time_to_first_token for o in outs]
    result["prefill_heavy"] = {"ttft_median_s": statistics.median(ttft), "ttft_max_s": max(ttft)}
    t = time.perf_counter()
    hf_generate(peft_model, long_prompts, 1, adapter_names=[reqs[i % 4].lora_name for i in range(8)])
    result["prefill_heavy"]["transformers_peft_first_token_s"] = time.perf_counter() - t

    # Adapter churn: 32 distinct adapters through 4 slots, 4 requests at a time.
    churn = [LoRARequest(f"churn{k}", 100 + k, str(adapter_paths[k % 4])) for k in range(32)]
    t = time.perf_counter()
    n_tok = 0
    for k in range(0, 32, 4):
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts[:4]],
                            SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True),
                            lora_request=churn[k:k + 4], use_tqdm=False)
        n_tok += sum(len(o.outputs[0].token_ids) for o in outs)
    result["churn"] = {"seconds": time.perf_counter() - t, "tokens_per_s": n_tok / (time.perf_counter() - t)}
    result["compiles_after_warmup_total"] = compile_stats.compile_count() - compiles_before

    roof = measure_roofline()
    weight_bytes = sum(x.nbytes for x in jax.tree.leaves(llm.engine.runner.state))
    lora_bytes = sum(x.nbytes for x in jax.tree.leaves(llm.engine.runner.lora_state))
    flops_per_token = 2 * weight_bytes / 4
    steps_per_s = roof["mem_gbps"] * 1e9 / (weight_bytes + lora_bytes)
    result["roofline"] = {**roof, "weight_mb": weight_bytes / 1e6, "lora_state_mb": lora_bytes / 1e6,
                          "best_tok_s_memory": steps_per_s * args.requests,
                          "best_tok_s_compute": roof["matmul_gflops"] * 1e9 / flops_per_token}
    result["compile_report"] = compile_stats.stage_table()

    # Larger batches: the same workload shape with B requests running at once (B = max_num_seqs).
    result["batch_sizes"] = {}
    for b in args.batch_sizes:
        big = LLM(max_model_len=args.max_model_len, max_num_seqs=b, max_num_batched_tokens=512,
                  lora_impl=args.lora_impl, progress=False, **slots)
        ids = make_prompts(big.tokenizer, b, 16, 64, seed=2)
        loras = [reqs[i % 4] for i in range(b)]
        run_b = lambda: sum(len(o.outputs[0].token_ids) for o in big.generate(  # noqa: E731
            [{"prompt_token_ids": p} for p in ids], params, lora_request=loras, use_tqdm=False))
        run_b()  # adapters into slots
        secs = []
        for _ in range(args.rounds):
            t = time.perf_counter()
            n = run_b()
            secs.append(time.perf_counter() - t)
        tok_s = n / statistics.median(secs)
        roof_b = min(steps_per_s * b, result["roofline"]["best_tok_s_compute"])  # memory or compute bound
        result["batch_sizes"][b] = {"tok_s": tok_s, "roofline_tok_s": roof_b, "fraction_of_roofline": tok_s / roof_b}
        del big
    return result


def to_markdown(r: dict[str, Any], args: argparse.Namespace) -> str:
    th = r["throughput"]
    base = th["jlora, no adapters"]
    peft = th["transformers+peft, 4 adapters mixed"]
    lines = [
        f"Reference workload: SmolLM2-135M-Instruct float32, {args.requests} requests, 16-64 prompt tokens, "
        f"{args.new_tokens} new tokens, greedy, EOS ignored, 4 peft adapters "
        f"({describe_adapters(args.adapters)}) "
        f"{'in slots of those ranks ' if args.slot_ranks else ''}"
        f"round-robin; median of {args.rounds} interleaved rounds; torch threads={args.threads}.",
        "",
        "| system | output tok/s | vs transformers+peft | vs jlora without adapters |",
        "|---|---:|---:|---:|",
    ]
    for k, v in th.items():  # chat-prompt rows against the chat-prompt baseline
        ref = th.get("transformers+peft, 4 adapters mixed, chat prompts", peft) if k.endswith("chat prompts") else peft
        lines.append(f"| {k} | {v:.1f} | {v / ref:.2f}x | {v / base:.2f}x |")
    lines += ["", "![Reference workload throughput](benchmarks.svg)"]
    if r.get("modes"):
        hf32, hf16 = peft, th.get("transformers+peft bfloat16, 4 adapters mixed")
        f32 = r["modes"]["float32"]["tok_s"]
        lines += ["", "jlora modes, same workload and run (bfloat16: weights, KV cache and LoRA slots stored in "
                  "bfloat16, computed in float32 on CPU; int8: int8 projections and lm head, per-token int8 "
                  "activations on CPU):", "",
                  "| jlora mode | output tok/s | vs jlora float32 | vs transformers+peft float32 | "
                  "vs transformers+peft bfloat16 | greedy tokens = float32 | weights MB | KV cache MB | LoRA slots MB |",
                  "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for m, v in r["modes"].items():
            mem = v["memory"]
            agree = "-" if m == "float32" else f"{v['greedy_token_agreement']:.0%}"
            vs16 = f"{v['tok_s'] / hf16:.2f}x" if hf16 else "-"
            lines.append(f"| {m} | {v['tok_s']:.1f} | {v['tok_s'] / f32:.2f}x | {v['tok_s'] / hf32:.2f}x | {vs16} | "
                         f"{agree} | {mem['weights']['bytes'] / 1e6:.0f} | {mem['kv_cache']['bytes'] / 1e6:.0f} | "
                         f"{mem['lora_slots']['bytes'] / 1e6:.0f} |")
    if r.get("versions"):
        lines += ["", "Versions: " + ", ".join(f"{k} {v}" for k, v in r["versions"].items()) + "."]
    ro = r["roofline"]
    ph = r["prefill_heavy"]
    lines += [
        "",
        f"Roofline of this machine: {ro['mem_gbps']:.1f} GB/s memory (XLA reduction), {ro['matmul_gflops']:.0f} "
        f"GFLOP/s f32 matmul. Weights {ro['weight_mb']:.0f} MB + LoRA slots {ro['lora_state_mb']:.0f} MB per decode "
        f"step gives at best {ro['best_tok_s_memory']:.0f} tok/s (memory) and {ro['best_tok_s_compute']:.0f} tok/s "
        f"(compute) for {args.requests} sequences.",
        "",
        f"Prefill-heavy (8 x 512 prompt tokens, 8 new, 4 adapters): jlora time to first token median "
        f"{ph['ttft_median_s']:.2f}s, max {ph['ttft_max_s']:.2f}s; transformers+peft first token for the batch "
        f"{ph['transformers_peft_first_token_s']:.2f}s.",
        f"Adapter churn (32 adapters through 4 slots, 4 requests x 16 tokens each): {r['churn']['seconds']:.1f}s, "
        f"{r['churn']['tokens_per_s']:.1f} tok/s.",
        f"XLA compilations after warm-up during all of the above: {r['compiles_after_warmup_total']}.",
        "",
        f"Fraction of the roofline (the lower of the memory and compute bounds), reference workload: "
        f"{th['jlora, 4 adapters mixed'] / min(ro['best_tok_s_memory'], ro['best_tok_s_compute']):.0%} "
        f"(4 adapters), {base / min(ro['best_tok_s_memory'], ro['best_tok_s_compute']):.0%} (no adapters). "
        f"Larger batches (B requests running at once, max_num_seqs=B, same prompt and adapter mix):",
        "",
        "| B | jlora tok/s, 4 adapters mixed | roofline tok/s | fraction |",
        "|---:|---:|---:|---:|",
    ]
    lines += [f"| {b} | {v['tok_s']:.1f} | {v['roofline_tok_s']:.0f} | {v['fraction_of_roofline']:.0%} |"
              for b, v in r.get("batch_sizes", {}).items()]
    return "\n".join(lines)


def write_plot(result: dict[str, Any], path: Path) -> None:
    """The throughput bar chart, against the 3x transformers+peft target. Works on a saved `--json` dump too:
    `write_plot(json.loads(Path("bench.json").read_text()), Path("docs/benchmarks.svg"))`."""
    th = result["throughput"]
    svg = bar_chart_svg("Reference workload: output tokens/s (higher is better)", list(th), list(th.values()), "tok/s",
                        reference=3 * th["transformers+peft, 4 adapters mixed"],
                        reference_label="3x transformers+peft (target)")
    path.write_text(svg)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="jlora bench")
    p.add_argument("--requests", type=int, default=16)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=2, help="torch threads for the transformers baselines")
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--lora-impl", default="auto")
    p.add_argument("--modes", type=lambda t: [x for x in t.split(",") if x], default=["float32", "bfloat16", "int8"],
                   help=f"jlora modes to measure, comma-separated, from {list(MODES)} (float32 always runs)")
    p.add_argument("--batch-sizes", type=lambda t: [int(x) for x in t.split(",") if x], default=[32, 64],
                   help="also run B requests at once with max_num_seqs=B, for each B (comma-separated; '' for none)")
    p.add_argument("--adapters", default="all-linear", choices=list(ADAPTER_SETS),
                   help="the 4 adapters' ranks and targets: all-linear (8/16/8/32) or reference (issue 18: "
                        "4 on q/v, 16 all-linear, 8 attention, 24 MLP)")
    p.add_argument("--slot-ranks", action="store_true",
                   help="jlora's 4 slots as wide as the 4 adapters' ranks (lora_slot_ranks) instead of the largest each")
    p.add_argument("--write", action="store_true",
                   help="write the table into docs/benchmarks.md and the chart into docs/benchmarks.svg")
    p.add_argument("--json", default=None, help="also dump raw results to this file")
    args = p.parse_args(argv)
    bad = [m for m in args.modes if m not in MODES]
    if bad:
        p.error(f"--modes: unknown {bad}; choose from {list(MODES)}")
    result = run(args)
    md = to_markdown(result, args)
    print(md)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2, default=str))
    if args.write:
        DOCS.mkdir(exist_ok=True)
        out = DOCS / "benchmarks.md"
        old = out.read_text() if out.exists() else ""
        kept = old.partition(ANALYSIS_MARKER)[2]
        header = "# End-to-end benchmark\n\nGenerated by `jlora bench --write`.\n\n"
        # `jlora bench start --write`'s block stays too, just above the marker.
        out.write_text(header + md + "\n\n" + start.kept_block(old) + ANALYSIS_MARKER + (kept or "\n"))
        write_plot(result, DOCS / "benchmarks.svg")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
