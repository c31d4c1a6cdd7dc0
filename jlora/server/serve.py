"""`jlora serve`: flags, engine start-up, and uvicorn with a clean SIGTERM (stop accepting, finish or abort, exit 0)."""

from __future__ import annotations

import argparse
import contextlib
import inspect
import json
import os
import signal
import socket
import sys
import threading
from typing import Any, Iterator

from jlora.sampling_params import DEFAULT_MAX_N
from jlora.server.limits import (DEFAULT_MAX_MESSAGES, DEFAULT_MAX_PROMPTS, DEFAULT_MAX_REQUEST_BYTES, DEFAULT_MAX_TOKENS,
                                 DEFAULT_MAX_WAITING, DEFAULT_STALL_S)


def add_server_args(p: argparse.ArgumentParser) -> None:
    """Server flags (the engine's shared flags come from jlora.cli's `add_engine_args`)."""
    p.add_argument("--host", default="127.0.0.1", help="address to listen on")
    p.add_argument("--port", type=int, default=8000, help="port to listen on (0: any free one)")
    p.add_argument("--max-cpu-loras", type=int, default=None, help="host cache of converted adapters")
    p.add_argument("--num-kv-blocks", type=int, default=None)
    p.add_argument("--served-model-name", default=None, help="the base model's id (default: --model, or the "
                                                             "default model's name)")
    p.add_argument("--lora-modules", nargs="*", default=[], metavar="NAME=PATH",
                   help="adapters served from the start, each as its own model (or JSON {\"name\", \"path\"})")
    # No default shown: the key is read from the environment at start, never printed.
    p.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' on the /v1 routes (default: env JLORA_API_KEY)")
    p.add_argument("--chat-template", default=None,
                   help="a Jinja chat template (a file, the template itself, or a name shipped with jlora: "
                        "smollm2-tools, the default model's template with tools) in place of the model's "
                        "(default: smollm2-tools for the default model)")
    p.add_argument("--enable-runtime-lora-updating", action="store_true",
                   help="add /v1/load_lora_adapter and /v1/unload_lora_adapter (paths confined to --lora-root)")
    p.add_argument("--lora-root", default=None, help="directory every runtime-loaded adapter must lie in")
    p.add_argument("--max-n", type=int, default=DEFAULT_MAX_N, help="most samples (n, best_of) one request may ask for")
    p.add_argument("--max-waiting-seqs", type=int, default=DEFAULT_MAX_WAITING,
                   help="sequences queued for admission; past it requests get 429 with Retry-After")
    p.add_argument("--default-max-tokens", type=int, default=DEFAULT_MAX_TOKENS,
                   help="max_tokens of a chat request that sets none (capped by what the prompt leaves)")
    p.add_argument("--max-request-bytes", type=int, default=DEFAULT_MAX_REQUEST_BYTES,
                   help="largest HTTP request body accepted (413 above it)")
    p.add_argument("--max-prompts-per-request", type=int, default=DEFAULT_MAX_PROMPTS,
                   help="most prompts one completion request may list (400 above it, before any is tokenized)")
    p.add_argument("--max-messages-per-request", type=int, default=DEFAULT_MAX_MESSAGES,
                   help="most messages one chat (or /tokenize) request may list (400 above it, before the chat "
                        "template renders them)")
    p.add_argument("--metrics-auth", action="store_true",
                   help="require the API key on /metrics too (default: open, as vLLM)")
    p.add_argument("--health-stall-timeout", type=float, default=DEFAULT_STALL_S,
                   help="/health answers 503 when the engine thread has made no progress for this many seconds")
    p.add_argument("--shutdown-timeout", type=float, default=30.0,
                   help="on SIGTERM, seconds running requests get to finish before they are aborted")
    p.add_argument("--log-level", default="info", choices=("critical", "error", "warning", "info", "debug", "trace"),
                   help="uvicorn's and jlora's log level; at info every request gets a line (method, path, "
                        "status, request id, seconds), as in vLLM")


def parse_lora_modules(items: list[str]) -> dict[str, str]:
    """NAME=PATH items, or vLLM's JSON form {"name": ..., "path": ...}."""
    out = {}
    for item in items:
        if item.lstrip().startswith("{"):
            try:
                obj = json.loads(item)
                name, path, sep = obj["name"], obj["path"], "="
            except (ValueError, KeyError, TypeError) as e:
                raise ValueError(f"--lora-modules: {item!r} is not {{\"name\": ..., \"path\": ...}}: {e}") from e
        else:
            name, sep, path = item.partition("=")
        if not sep or not name or not path:
            raise ValueError(f"--lora-modules expects NAME=PATH, got {item!r}")
        if name in out:
            raise ValueError(f"--lora-modules names {name!r} twice")
        out[name] = path
    return out


def make_server(app: Any, host: str, port: int, shutdown_timeout: float = 30.0, log_level: str = "info") -> Any:
    """A uvicorn.Server for `app` (uvicorn is imported here so the rest of the CLI does not need it).

    On shutdown the engine thread of a `build_app` app gets `shutdown_timeout` seconds to finish
    what runs, then aborts the rest, so every stream still ends with a final chunk and [DONE];
    uvicorn's own cancellation of open responses is only a backstop after that.
    """
    import uvicorn

    class Server(uvicorn.Server):
        async def shutdown(self, sockets: Any = None) -> None:
            # Looked up now, not closed over: a class is in reference cycles, so a captured engine
            # thread would keep the LLM alive after the server is dropped (until a full collection).
            engine = getattr(getattr(getattr(app, "state", None), "server", None), "engine", None)
            if engine is not None:
                engine.begin_stop(shutdown_timeout)
            await super().shutdown(sockets)

        # uvicorn re-raises a captured SIGTERM after its graceful shutdown, which would end the
        # process with -15; here SIGTERM/SIGINT only start that shutdown, so a clean stop exits 0.
        @contextlib.contextmanager
        def capture_signals(self) -> Iterator[None]:
            if threading.current_thread() is not threading.main_thread():
                yield
                return
            old = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
            try:
                yield
            finally:
                for sig, handler in old.items():
                    signal.signal(sig, handler)

    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, access_log=False,
                            timeout_graceful_shutdown=shutdown_timeout + 5.0, lifespan="on")
    return Server(config)


def bind(host: str, port: int = 0) -> socket.socket:
    """A listening socket (port 0 = any free one), handed to uvicorn so the port is known before it starts."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def log_requests(level: str) -> None:
    """jlora's own log lines (one per request from `jlora.server`) on stderr, as uvicorn writes its own."""
    import logging

    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(levelname)s %(asctime)s %(name)s: %(message)s", "%H:%M:%S"))
    root = logging.getLogger("jlora")
    root.addHandler(handler)
    root.setLevel("DEBUG" if level == "trace" else level.upper())


def engine_kwargs(flags: dict[str, Any]) -> dict[str, Any]:
    """LLM keyword arguments from parsed flags: those `LLM` takes, bucket flags ("32,64,...") as tuples."""
    from jlora import LLM

    accepted = inspect.signature(LLM).parameters
    kw: dict[str, Any] = {}
    for name, value in flags.items():
        if name not in accepted or name == "model" or value is None:
            continue
        if name.endswith("_buckets") or name == "lora_slot_ranks":
            value = tuple(int(x) for x in str(value).split(","))
        kw[name] = value
    return kw


def check_serve_args(args: argparse.Namespace) -> tuple[dict[str, str], socket.socket, str | None]:
    """Everything about the command line that needs no model, in well under a second (no JAX):
    sizes, adapter directories, the adapter root, the chat template, and the port (bound here, so
    a busy port fails now, not after the weights load). Returns the adapters, the bound socket
    and the chat template text. ValueError / FileNotFoundError name the flag."""
    from jlora.adapters.peft import check_adapter_dir
    from jlora.engine_args import engine_config

    lora_modules = parse_lora_modules(args.lora_modules)
    for flag in ("default_max_tokens", "max_request_bytes", "max_prompts_per_request", "max_messages_per_request"):
        if getattr(args, flag) < 1:
            raise ValueError(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}")
    if not args.health_stall_timeout > 0:
        raise ValueError(f"--health-stall-timeout must be > 0, got {args.health_stall_timeout}")
    if not args.shutdown_timeout >= 0:
        raise ValueError(f"--shutdown-timeout must be >= 0, got {args.shutdown_timeout}")
    if args.enable_runtime_lora_updating and not args.lora_root:
        raise ValueError("--enable-runtime-lora-updating needs --lora-root (runtime paths are confined to it)")
    if args.lora_root is not None and not os.path.isdir(args.lora_root):
        raise ValueError(f"--lora-root: {args.lora_root!r} is not a directory")
    if args.model is not None and not os.path.exists(args.model):
        raise ValueError(f"--model: {args.model!r} does not exist (a GGUF file or a checkpoint directory)")
    for name, path in lora_modules.items():
        try:
            check_adapter_dir(path)
        except (ValueError, FileNotFoundError) as e:
            raise ValueError(f"--lora-modules {name}={path}: {e}") from None
    from jlora.chat_templates import CHAT_TEMPLATES

    template = None
    if args.chat_template is None and args.model is None:
        # The default model's GGUF template ignores `tools`; this one renders them in the format
        # SmolLM2 was tuned on, and renders everything else exactly as the GGUF's does.
        template = CHAT_TEMPLATES["smollm2-tools"]
    elif args.chat_template in CHAT_TEMPLATES:
        template = CHAT_TEMPLATES[args.chat_template]
    elif args.chat_template is not None:
        if os.path.isfile(args.chat_template):
            with open(args.chat_template, encoding="utf-8") as f:
                template = f.read()
        elif "{" in args.chat_template:
            template = args.chat_template
        else:
            raise ValueError(f"--chat-template: {args.chat_template!r} is neither a file, a Jinja template nor "
                             f"one of {sorted(CHAT_TEMPLATES)}")
    sizes = {k: v for k, v in engine_flags(vars(args)).items() if k not in ("warmup", "weights_cache")}
    engine_config(**sizes)  # the sizes' own checks, still before anything loads
    try:
        sock = bind(args.host, args.port)
    except OSError as e:
        raise ValueError(f"--host {args.host} --port {args.port}: cannot listen there: {e.strerror or e}") from None
    return lora_modules, sock, template


def engine_flags(flags: dict[str, Any]) -> dict[str, Any]:
    """`engine_config` keyword arguments among the parsed flags, without importing JAX."""
    from jlora.engine_args import ENGINE_DEFAULTS

    names = set(ENGINE_DEFAULTS) | {"dtype", "max_cpu_loras"}
    out = {}
    for name, value in flags.items():
        if name in names and value is not None:
            out[name] = (tuple(int(x) for x in str(value).split(","))
                         if name.endswith("_buckets") or name == "lora_slot_ranks" else value)
    return out


def serve_main(args: argparse.Namespace) -> int:
    lora_modules, sock, template = check_serve_args(args)
    api_key = args.api_key or os.environ.get("JLORA_API_KEY") or None
    from jlora import LLM
    from jlora.engine_args import warmup_flag
    from jlora.models.loading import DEFAULT_MODEL
    from jlora.server.app import build_app

    log_requests(args.log_level)
    kwargs = engine_kwargs(vars(args))
    kwargs.update(warmup=warmup_flag(args), weights_cache=not getattr(args, "no_weights_cache", False))
    llm = LLM(args.model, **kwargs)
    if template is not None:
        llm.tokenizer.chat_template = template
    model_id = args.served_model_name or args.model or DEFAULT_MODEL
    app = build_app(llm, model_id, lora_modules=lora_modules, api_key=api_key,
                    enable_runtime_lora_updating=args.enable_runtime_lora_updating, lora_root=args.lora_root,
                    default_max_tokens=args.default_max_tokens, max_request_bytes=args.max_request_bytes,
                    metrics_auth=args.metrics_auth, health_stall_timeout=args.health_stall_timeout,
                    max_prompts=args.max_prompts_per_request, max_messages=args.max_messages_per_request)
    print(f"jlora serve: {model_id} with adapters {sorted(lora_modules) or '[]'} on "
          f"http://{args.host}:{sock.getsockname()[1]}/v1", flush=True)
    server = make_server(app, args.host, args.port, args.shutdown_timeout, args.log_level)
    server.run(sockets=[sock])
    if not app.state.stopped_cleanly:  # the engine thread is wedged in a step: do not wait on it at exit
        print("jlora serve: the engine thread did not stop in time; exiting without it", file=sys.stderr, flush=True)
        os._exit(1)
    return 0
