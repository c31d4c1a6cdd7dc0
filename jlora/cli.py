"""Command line: `jlora generate`, `jlora demo`, `jlora convert`, `jlora bench`, `jlora serve`."""

from __future__ import annotations

import argparse
import sys
import time


def _buckets(text: str | None) -> tuple[int, ...] | None:
    return tuple(int(x) for x in text.split(",")) if text else None


def _add_engine_args(p: argparse.ArgumentParser, max_model_len: int = 1024, max_num_seqs: int = 8, max_lora_rank: int = 64,
                     token_buckets: str | None = None) -> None:
    p.add_argument("--model", default=None, help="GGUF file or HF checkpoint dir (default: SmolLM2-135M-Instruct)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--max-model-len", type=int, default=max_model_len)
    p.add_argument("--max-num-seqs", type=int, default=max_num_seqs)
    p.add_argument("--max-loras", type=int, default=4)
    p.add_argument("--max-lora-rank", type=int, default=max_lora_rank)
    p.add_argument("--token-buckets", default=token_buckets, help="comma-separated prefill chunk buckets")


def make_llm(args: argparse.Namespace):
    from jlora import LLM

    return LLM(args.model, dtype=args.dtype, max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
               max_loras=args.max_loras, max_lora_rank=args.max_lora_rank,
               token_buckets=_buckets(args.token_buckets))


def cmd_generate(args: argparse.Namespace) -> int:
    from jlora import LoRARequest, SamplingParams

    llm = make_llm(args)
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
    from jlora.adapters.peft import convert_main

    return convert_main(args.rest)


def cmd_serve(args: argparse.Namespace) -> int:
    from jlora.server.serve import serve_main

    return serve_main(args)


def cmd_bench(args: argparse.Namespace) -> int:
    if args.what == "serve":
        from jlora.server.bench import main as serve_bench_main

        return serve_bench_main(args.rest)
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
    # A small graph set: the demo's 8 short chats need no more, and warm-up stays about a minute.
    _add_engine_args(d, max_model_len=256, max_num_seqs=8, max_lora_rank=16, token_buckets="32,256")
    d.add_argument("--max-tokens", type=int, default=24)
    d.set_defaults(fn=cmd_demo)

    c = sub.add_parser("convert", help="convert a PEFT adapter: jlora convert SRC DST [--model M] "
                                       "[--max-lora-rank R]", add_help=False)
    c.add_argument("rest", nargs=argparse.REMAINDER)
    c.set_defaults(fn=cmd_convert)

    s = sub.add_parser("serve", help="OpenAI-compatible HTTP server (adapters are models)")
    _add_engine_args(s, max_model_len=2048, max_num_seqs=16)
    from jlora.server.serve import add_server_args

    add_server_args(s)
    s.set_defaults(fn=cmd_serve)

    b = sub.add_parser("bench", help="benchmarks: `jlora bench` (end to end), `jlora bench kernels` or "
                                     "`jlora bench serve`")
    b.add_argument("what", nargs="?", default="e2e", choices=["e2e", "kernels", "serve"])
    b.add_argument("rest", nargs=argparse.REMAINDER)
    b.set_defaults(fn=cmd_bench)

    argv = list(sys.argv[1:] if argv is None else argv)
    # convert and bench keep their own parsers (and --help) beside their code.
    if argv[:1] == ["convert"]:
        argv = ["convert", "--"] + argv[1:]
    if argv[:1] == ["bench"]:
        what = argv[1] if argv[1:2] in (["kernels"], ["serve"]) else "e2e"
        argv = ["bench", what, "--"] + argv[1 + (what != "e2e"):]
    args = parser.parse_args(argv)
    if args.cmd in ("convert", "bench") and args.rest[:1] == ["--"]:
        args.rest = args.rest[1:]
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
