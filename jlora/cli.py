"""Command line: `jlora generate`, `jlora demo`, `jlora convert`, `jlora bench`."""

from __future__ import annotations

import argparse
import sys
import time


def _add_engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="GGUF file or HF checkpoint dir (default: SmolLM2-135M-Instruct)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--max-num-seqs", type=int, default=8)
    p.add_argument("--max-loras", type=int, default=4)
    p.add_argument("--max-lora-rank", type=int, default=64)


def _llm(args: argparse.Namespace):
    from jlora import LLM

    return LLM(args.model, dtype=args.dtype, max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
               max_loras=args.max_loras, max_lora_rank=args.max_lora_rank)


def cmd_generate(args: argparse.Namespace) -> int:
    from jlora import LoRARequest, SamplingParams

    llm = _llm(args)
    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                            max_tokens=args.max_tokens, seed=args.seed)
    lora = LoRARequest(args.lora_name or args.lora, 1, args.lora) if args.lora else None
    for prompt in args.prompt:
        if args.chat:
            text = llm.chat([{"role": "user", "content": prompt}], params, lora)[0].outputs[0].text
            print(text)
        else:
            sys.stdout.write(prompt)
            for delta in llm.generate_stream(prompt, params, lora):
                sys.stdout.write(delta)
                sys.stdout.flush()
            print()
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from jlora.demo import run_demo

    return run_demo(args)


def cmd_convert(args: argparse.Namespace) -> int:
    from jlora.adapters.peft import convert
    from jlora.models.loading import read_model_config

    cfg = read_model_config(args.model)
    adapter = convert(args.src, args.dst, cfg, max_lora_rank=args.max_lora_rank)
    ranks = sorted(set(adapter.ranks.values())) if hasattr(adapter, "ranks") else "?"
    print(f"converted {args.src} -> {args.dst} (modules: {sorted(adapter.weights)}, ranks: {ranks})")
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    if args.what == "kernels":
        from jlora.kernels.bench import main as kernels_main

        return kernels_main(args.rest)
    from jlora.bench import main as bench_main

    return bench_main(args.rest)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="jlora", description="multi-LoRA serving in JAX")
    sub = parser.add_subparsers(dest="cmd", required=True)

    g = sub.add_parser("generate", help="generate text for prompts (streams to stdout)")
    g.add_argument("prompt", nargs="+")
    _add_engine_args(g)
    g.add_argument("--chat", action="store_true", help="wrap each prompt in the model's chat template")
    g.add_argument("--lora", default=None, help="PEFT adapter directory")
    g.add_argument("--lora-name", default=None)
    g.add_argument("--max-tokens", type=int, default=64)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=-1)
    g.add_argument("--seed", type=int, default=None)
    g.set_defaults(fn=cmd_generate)

    d = sub.add_parser("demo", help="one batch mixing several adapters and the base model")
    _add_engine_args(d)
    d.add_argument("--max-tokens", type=int, default=24)
    d.set_defaults(fn=cmd_demo)

    c = sub.add_parser("convert", help="convert a PEFT adapter directory to a jlora (orbax) adapter")
    c.add_argument("src")
    c.add_argument("dst")
    c.add_argument("--model", default=None, help="base model the adapter is for (default: SmolLM2-135M)")
    c.add_argument("--max-lora-rank", type=int, default=64)
    c.set_defaults(fn=cmd_convert)

    b = sub.add_parser("bench", help="benchmarks: `jlora bench` (end to end) or `jlora bench kernels`")
    b.add_argument("what", nargs="?", default="e2e", choices=["e2e", "kernels"])
    b.add_argument("rest", nargs=argparse.REMAINDER)
    b.set_defaults(fn=cmd_bench)

    args = parser.parse_args(argv)
    t0 = time.time()
    try:
        return args.fn(args)
    except (ValueError, FileNotFoundError) as e:
        print(f"jlora {args.cmd}: error: {e}", file=sys.stderr)
        return 2
    finally:
        if args.cmd != "bench":
            print(f"[jlora {args.cmd}: {time.time() - t0:.1f}s]", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
