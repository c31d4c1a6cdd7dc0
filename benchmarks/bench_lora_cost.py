"""The cost of LoRA inside the engine: jlora with 4 mixed adapters against jlora without adapters.

The reference workload of DESIGN.md without the transformers baselines (so it needs no torch and
runs against any jlora checkout): SmolLM2-135M float32, 16 requests of 16-64 prompt tokens, 64
new tokens, greedy, EOS ignored, 4 PEFT adapters of ranks 8/16/8/32 on all linear layers,
round-robin; one engine (max_loras=4, max_lora_rank=32); both systems timed in interleaved
rounds in one process, median (and best) per system. The number to compare across versions is the ratio
mixed / base (absolute tok/s move with the machine's load).

    PYTHONPATH=. python benchmarks/bench_lora_cost.py [--rounds 3] [--lora-impl auto]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

RANKS = (8, 16, 8, 32)
MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def write_adapters(root: Path, cfg, ranks=RANKS) -> list[Path]:
    """PEFT directories (peft's key names), one per rank, every linear layer targeted."""
    from safetensors.numpy import save_file

    shapes = cfg.module_shapes()
    paths = []
    for i, r in enumerate(ranks):
        rng = np.random.default_rng(i)
        tensors = {}
        for layer in range(cfg.num_hidden_layers):
            for m in MODULES:
                d_in, d_out = shapes[m]
                parent = "mlp" if m in ("gate_proj", "up_proj", "down_proj") else "self_attn"
                key = f"base_model.model.model.layers.{layer}.{parent}.{m}"
                tensors[f"{key}.lora_A.weight"] = rng.normal(0, 1 / np.sqrt(d_in), (r, d_in)).astype(np.float32)
                tensors[f"{key}.lora_B.weight"] = rng.normal(0, 0.01, (d_out, r)).astype(np.float32)
        path = root / f"cost{i}-r{r}"
        path.mkdir(parents=True)
        save_file(tensors, str(path / "adapter_model.safetensors"))
        (path / "adapter_config.json").write_text(json.dumps({
            "peft_type": "LORA", "r": r, "lora_alpha": 2 * r, "target_modules": list(MODULES), "bias": "none",
            "task_type": "CAUSAL_LM"}))
        paths.append(path)
    return paths


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--requests", type=int, default=16)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--lora-impl", default="auto")
    p.add_argument("--max-model-len", type=int, default=1024)
    args = p.parse_args(argv)

    import jlora
    from jlora import LLM, LoRARequest, SamplingParams, compile_stats
    from jlora.bench import make_prompts

    llm = LLM(max_model_len=args.max_model_len, max_num_seqs=16, max_num_batched_tokens=512, max_loras=4,
              max_lora_rank=max(RANKS), lora_impl=args.lora_impl, progress=False)
    root = Path(tempfile.mkdtemp(prefix="jlora-lora-cost-"))
    paths = write_adapters(root, llm.engine.adapters.model_cfg)
    reqs = [LoRARequest(p.name, i + 1, str(p)) for i, p in enumerate(paths)]
    prompts = [{"prompt_token_ids": ids} for ids in make_prompts(llm.tokenizer, args.requests, 16, 64)]
    per_prompt = [reqs[i % len(reqs)] for i in range(len(prompts))]
    params = SamplingParams(temperature=0.0, max_tokens=args.new_tokens, ignore_eos=True)

    def run(loras) -> int:
        outs = llm.generate(prompts, params, lora_request=loras, use_tqdm=False)
        return sum(len(o.outputs[0].token_ids) for o in outs)

    run(per_prompt)  # adapters into their slots (not timed)
    before = compile_stats.compile_count()
    systems = {"mixed": per_prompt, "base": None}
    secs: dict[str, list[float]] = {k: [] for k in systems}
    tokens: dict[str, int] = {}
    for _ in range(args.rounds):
        for name, loras in systems.items():
            t = time.perf_counter()
            tokens[name] = run(loras)
            secs[name].append(time.perf_counter() - t)
    tok_s = {k: tokens[k] / statistics.median(v) for k, v in secs.items()}
    best = {k: tokens[k] / min(v) for k, v in secs.items()}  # the least disturbed round of each
    out = {"jlora": str(Path(jlora.__file__).parent), "lora_impl": args.lora_impl, "tok_s": tok_s,
           "mixed_over_base": tok_s["mixed"] / tok_s["base"], "best_tok_s": best,
           "best_mixed_over_base": best["mixed"] / best["base"], "seconds": secs,
           "compiles_after_warmup": compile_stats.compile_count() - before}
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
