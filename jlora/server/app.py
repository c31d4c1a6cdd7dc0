"""The OpenAI-compatible ASGI app: routes, auth, errors, the adapter registry and the engine thread's life.

`build_app(llm, ...)` returns a FastAPI app; `jlora serve` runs it under uvicorn. When an api key is
set, the /v1 routes need `Authorization: Bearer <api_key>` (and /metrics too with metrics_auth);
/health, /openapi.json and /docs stay open, as in vLLM.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import dataclasses
import contextlib
import hmac
import itertools
import json
import logging
import os
import re
import time
from pathlib import Path
from typing import Any, AsyncIterator

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.background import BackgroundTask
from starlette.exceptions import HTTPException as StarletteHTTPException

from jlora.adapters.peft import JLORA_ADAPTER_META, SAFETENSORS_FILE
from jlora.adapters.request import LoRACombination, LoRARequest
from jlora.server.engine_thread import EngineThread
from jlora.server.openai_requests import (
    Generation, check_text_size, chat_prompt, check_lengths, completion_prompts, sampling_params,
)
from jlora.server.openai_responses import Formatter
from jlora.server.tools import ToolCalls
from jlora.server.limits import (DEFAULT_MAX_MESSAGES, DEFAULT_MAX_PROMPTS, DEFAULT_MAX_REQUEST_BYTES,
                                 DEFAULT_MAX_TOKENS, DEFAULT_STALL_S, PREP_THREADS, RETRY_AFTER_S, max_prompt_bytes)
from jlora.server.metrics import CONTENT_TYPE, ServerMetrics
from jlora.server.protocol import (
    APIError, ChatCompletionRequest, CompletionRequest, DetokenizeRequest, DetokenizeResponse, ErrorResponse,
    LoadLoRAAdapterRequest, TokenizeRequest, TokenizeResponse, UnloadLoRAAdapterRequest, VersionResponse,
    error_body,
)

log = logging.getLogger("jlora.server")

# Adapter names are only keys (never paths), but stay plain anyway: no leading dot or slash, no "..".
_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:/-]{0,127}")
_GENERATION_PATHS = ("/v1/completions", "/v1/chat/completions")


class OpenAIServer:
    """State shared by the routes: the engine thread, the base model's id and the served adapters."""

    def __init__(self, llm: Any, model_id: str, lora_modules: dict[str, str] | None = None,
                 enable_runtime_lora_updating: bool = False, lora_root: str | os.PathLike | None = None,
                 shutdown_grace_s: float = 0.0, default_max_tokens: int = DEFAULT_MAX_TOKENS,
                 max_prompts: int = DEFAULT_MAX_PROMPTS, max_messages: int = DEFAULT_MAX_MESSAGES,
                 health_stall_timeout: float = DEFAULT_STALL_S):
        if enable_runtime_lora_updating and lora_root is None:
            raise ValueError("runtime adapter loading needs lora_root (--lora-root): paths are confined to it")
        self.llm = llm
        self.model_id = model_id
        self.max_model_len: int = llm.config.max_model_len
        self.max_n: int = llm.config.max_n
        self.vocab_size: int = llm.model.cfg.vocab_size
        self.default_max_tokens = default_max_tokens
        self.max_prompts = max_prompts
        self.max_messages = max_messages
        self.health_stall_timeout = health_stall_timeout  # /health: 503 after this long without progress
        # Templating and tokenizing run here, off the event loop (the streams of others keep flowing).
        self.prep = concurrent.futures.ThreadPoolExecutor(PREP_THREADS, thread_name_prefix="jlora-prep")
        self.preparing = 0  # sequences of requests being prepared: counted against the waiting queue
        self.max_prompt_bytes = max_prompt_bytes(self.max_model_len, llm.tokenizer)
        self.metrics = ServerMetrics()
        self.engine = EngineThread(llm, self.metrics)
        self.runtime_lora = enable_runtime_lora_updating
        self.lora_root = Path(lora_root).resolve(strict=True) if lora_root is not None else None
        self.shutdown_grace_s = shutdown_grace_s
        self.adapters: dict[str, LoRARequest] = {}
        self._lora_ids = itertools.count(1)  # never reused, so a reloaded name is a new version
        # One load of a name at a time (as vLLM's per-name lock): a second load of a name that is
        # converting waits, then sees it loaded (400), instead of converting a second version.
        self._load_locks: collections.defaultdict[str, asyncio.Lock] = collections.defaultdict(asyncio.Lock)
        self.created = int(time.time())
        for name, path in (lora_modules or {}).items():  # operator-given: not confined to lora_root
            self._check_name(name)
            _no_pickles(Path(path).resolve(), path)
            lr = LoRARequest(name, next(self._lora_ids), str(Path(path).resolve()))
            llm.engine.adapters.prepare(lr)  # fail at start-up, not on the first request
            self.adapters[name] = lr

    # ---- models and adapters ------------------------------------------------------------------------

    def lora_for(self, model: str) -> LoRARequest | None:
        if model == self.model_id:
            return None
        if model in self.adapters:
            return self.adapters[model]
        raise APIError(404, f"The model `{model}` does not exist.", param="model", code="model_not_found")

    def _card(self, mid: str, root: str, parent: str | None) -> dict[str, Any]:
        return {"id": mid, "object": "model", "created": self.created, "owned_by": "jlora", "root": root,
                "parent": parent, "max_model_len": self.max_model_len, "permission": []}

    def models(self) -> dict[str, Any]:
        data = [self._card(self.model_id, str(self.llm.model_path), None)]
        data += [self._card(n, lr.lora_path, self.model_id) for n, lr in self.adapters.items()]
        return {"object": "list", "data": data}

    def model(self, model_id: str) -> dict[str, Any]:
        lora = self.lora_for(model_id)  # 404 naming it when unknown
        return (self._card(model_id, str(self.llm.model_path), None) if lora is None
                else self._card(model_id, lora.lora_path, self.model_id))

    def tokenize(self, body: TokenizeRequest) -> dict[str, Any]:
        if body.model is not None:
            self.lora_for(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise APIError(400, "give exactly one of prompt and messages", param="prompt")
        if body.prompt is not None:
            check_text_size(body.prompt, self.max_prompt_bytes, "prompt")
            ids = self.llm.tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens)
        else:
            self.check_messages(body.messages)
            chat = ChatCompletionRequest.model_construct(model=body.model or self.model_id, messages=body.messages)
            ids = chat_prompt(chat, self.llm, self.max_prompt_bytes,
                              add_generation_prompt=body.add_generation_prompt)["prompt_token_ids"]
        return {"count": len(ids), "max_model_len": self.max_model_len, "tokens": ids, "token_strs": None}

    def detokenize(self, body: DetokenizeRequest) -> dict[str, Any]:
        if body.model is not None:
            self.lora_for(body.model)
        if any(t >= self.vocab_size for t in body.tokens):
            raise APIError(400, f"tokens must be below the vocabulary size {self.vocab_size}", param="tokens")
        return {"prompt": self.llm.tokenizer.decode(body.tokens)}

    def _check_name(self, name: str) -> None:
        if not _NAME_RE.fullmatch(name) or ".." in name or name == self.model_id:
            raise APIError(400, f"lora_name {name!r} must match {_NAME_RE.pattern} and differ from the base "
                                f"model's id", param="lora_name")

    def confined_path(self, raw: str) -> Path:
        """The adapter directory `raw` names, resolved (symlinks too); 400 unless it lies in lora_root."""
        assert self.lora_root is not None
        p = Path(raw).expanduser()
        resolved = (p if p.is_absolute() else self.lora_root / p).resolve()
        if resolved == self.lora_root or not resolved.is_relative_to(self.lora_root):
            raise APIError(400, f"lora_path {raw!r} is outside the adapter root (--lora-root)", param="lora_path")
        if not resolved.is_dir():
            raise APIError(400, f"lora_path {raw!r} is not an adapter directory", param="lora_path")
        for f in resolved.rglob("*"):  # a symlinked file inside must not point out either
            if not f.resolve().is_relative_to(self.lora_root):
                raise APIError(400, f"lora_path {raw!r} holds {f.name!r}, which points outside the adapter root",
                               param="lora_path")
        _no_pickles(resolved, raw)
        return resolved

    async def load_adapter(self, body: LoadLoRAAdapterRequest) -> str:
        name = body.lora_name
        self._check_name(name)
        async with self._load_locks[name]:
            if name in self.adapters:
                raise APIError(400, f"The lora adapter '{name}' has already been loaded.", param="lora_name")
            path = self.confined_path(body.lora_path)
            adapters = self.llm.engine.adapters
            try:
                lr = LoRARequest(name, next(self._lora_ids), str(path))  # checks the directory
                await asyncio.wrap_future(adapters.prepare_async(lr))  # off the engine thread
            except (ValueError, FileNotFoundError, ImportError, OSError) as e:
                raise APIError(400, f"could not load adapter {name!r}: {e}", param="lora_path") from e
            self.adapters[name] = lr
        return f"Success: LoRA adapter '{name}' added successfully."

    async def unload_adapter(self, body: UnloadLoRAAdapterRequest) -> str:
        name = body.lora_name
        if name not in self.adapters:
            raise APIError(404, f"The lora adapter '{name}' cannot be found.", param="lora_name",
                           code="model_not_found")
        del self.adapters[name]  # new requests get 404 from now on
        adapters = self.llm.engine.adapters
        # Running requests keep their slot (pinned); it is freed when the last one ends.
        await asyncio.wrap_future(self.engine.call(lambda: adapters.unload(name)))
        return f"Success: LoRA adapter '{name}' removed successfully."

    # ---- generation -----------------------------------------------------------------------------------

    def lora_of(self, req: CompletionRequest | ChatCompletionRequest) -> LoRARequest | LoRACombination | None:
        """The adapter(s) a request uses: `model`, scaled by `lora_scale`, or the `lora_combine` adapters."""
        lora = self.lora_for(req.model)
        if req.lora_combine is not None:
            if lora is not None or req.lora_scale is not None:
                raise APIError(400, f"lora_combine names the adapters and their weights: model must be the base "
                                    f"model {self.model_id!r} and lora_scale unset (got model={req.model!r}, "
                                    f"lora_scale={req.lora_scale!r})", param="lora_combine")
            unknown = [n for n in req.lora_combine if n not in self.adapters]
            if unknown:
                raise APIError(400, f"lora_combine names adapters that are not loaded: {unknown}; loaded: "
                                    f"{sorted(self.adapters)}", param="lora_combine")
            slots = self.llm.config.max_loras
            if len(req.lora_combine) > slots:
                raise APIError(400, f"lora_combine has {len(req.lora_combine)} adapters; the server has "
                                    f"max_loras={slots} slots and a combination needs all its adapters in slots "
                                    f"at once", param="lora_combine")
            try:
                return LoRARequest.combine(*(self.adapters[n] for n in req.lora_combine),
                                           weights=tuple(req.lora_combine.values()))
            except ValueError as e:
                raise APIError(400, str(e), param="lora_combine") from e
        if req.lora_scale is not None:
            if lora is None:
                raise APIError(400, f"lora_scale scales an adapter, but model={req.model!r} is the base model",
                               param="lora_scale")
            return dataclasses.replace(lora, scale=req.lora_scale)
        return lora

    async def complete(self, req: CompletionRequest | ChatCompletionRequest, request: Request) -> Response:
        received = time.time()
        chat = isinstance(req, ChatCompletionRequest)
        if req.model is None:  # as vLLM: no model means the base model, and the reply names it
            req.model = self.model_id
        lora = self.lora_of(req)
        if req.stream_options is not None and not req.stream:
            raise APIError(400, "stream_options is only allowed with stream=true", param="stream_options")
        seqs = self._check_work(req, chat)  # before anything is templated or tokenized
        self.preparing += seqs
        try:
            loop = asyncio.get_running_loop()
            prompts, params, fmt = await loop.run_in_executor(self.prep, self._prepare, req, chat)
            request.state.request_id = fmt.id  # for the access log line
            gen = Generation(self.engine, fmt.id, len(prompts), received)
            await gen.start(prompts, params, lora)
        finally:
            self.preparing -= seqs
        if req.stream:
            # The stream's finally aborts on a disconnect; the background close also covers a client
            # that leaves before the first chunk (the generator never started, so no finally runs).
            return StreamingResponse(_stream(gen, fmt, len(prompts)), media_type="text/event-stream",
                                     background=BackgroundTask(gen.close))
        return await _unless_disconnected(request, _whole(gen, fmt))

    def _check_work(self, req: CompletionRequest | ChatCompletionRequest, chat: bool) -> int:
        """The sequences `req` would queue, counted from its parsed body alone: 400 naming the field
        when it has more prompts than --max-prompts-per-request or more sequences than the queue
        ever holds, 429 when the queue (with the requests still being tokenized) has no room now."""
        if chat:
            count, field = 1, "messages"
            self.check_messages(req.messages)
        else:
            p = req.prompt
            count = 1 if isinstance(p, str) or (p and all(isinstance(x, int) for x in p)) else len(p)
            field = "prompt"
            if count > self.max_prompts:
                raise APIError(400, f"prompt holds {count} prompts; at most {self.max_prompts} are accepted in one "
                                    f"request (--max-prompts-per-request)", param="prompt")
        seqs = count * req.n
        cap = self.llm.config.max_waiting_seqs
        if cap is not None and seqs > cap:
            raise APIError(400, f"{count} prompts x n={req.n} is more sequences than the server ever "
                                f"queues (--max-waiting-seqs={cap})", param="n" if req.n > 1 else field)
        queued = self.engine.waiting + self.preparing
        if cap is not None and queued + seqs > cap:
            raise APIError(429, f"the server is busy: {queued} sequences are waiting or being prepared and this "
                                f"request adds {seqs}; max_waiting_seqs={cap}; retry later", code="queue_full",
                           headers={"Retry-After": str(RETRY_AFTER_S)})
        return seqs

    def check_messages(self, messages: list[Any]) -> None:
        """400 naming `messages` when the list is longer than --max-messages-per-request: checked
        before the chat template renders it (its time grows with the list)."""
        if len(messages) > self.max_messages:
            raise APIError(400, f"messages holds {len(messages)} messages; at most {self.max_messages} are accepted "
                                f"in one request (--max-messages-per-request)", param="messages")

    def _prepare(self, req: CompletionRequest | ChatCompletionRequest,
                 chat: bool) -> tuple[list[dict[str, Any]], Any, Formatter]:
        """Template and tokenize `req`, check it against the context, build its SamplingParams and
        its reply's formatter. Runs on the prep threads: nothing here touches the event loop."""
        if chat:
            if req.top_logprobs is not None and not req.logprobs:
                raise APIError(400, "top_logprobs needs logprobs=true", param="top_logprobs")
            num_logprobs = (req.top_logprobs or 0) if req.logprobs else None
            tools = ToolCalls.from_request(req, getattr(self.llm.tokenizer, "chat_template", None))
            prompts = [chat_prompt(req, self.llm, self.max_prompt_bytes, tools=tools)]
            max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
            field = "messages"
        else:
            if req.suffix:
                raise APIError(400, "suffix is not supported", param="suffix")
            if req.best_of is not None and req.best_of != req.n:
                raise APIError(400, "best_of other than n is not supported", param="best_of")
            num_logprobs = req.logprobs
            tools = None
            prompts = completion_prompts(req, self.llm.tokenizer, self.max_prompt_bytes, self.vocab_size)
            max_tokens = req.max_tokens
            field = "prompt"
        prompt_only = not chat and req.echo and max_tokens == 0  # lm-eval's loglikelihood requests
        if max_tokens == 0 and not prompt_only:
            raise APIError(400, "max_tokens=0 is only allowed with echo=true", param="max_tokens")
        if prompt_only:
            max_tokens = 1  # the prompt's logprobs come with its prefill; the one token is not returned
        max_tokens = check_lengths(prompts, max_tokens, self.max_model_len, field)

        if (req.max_completion_tokens if chat else None) is None and req.max_tokens is None:
            max_tokens = min(max_tokens, self.default_max_tokens)  # unset: the server's default, not the context
        params = sampling_params(req, max_tokens, num_logprobs, self.vocab_size, self.max_n,
                                 prompt_logprobs=num_logprobs if not chat and req.echo else None, tools=tools)
        include_usage = bool(req.stream and req.stream_options and req.stream_options.include_usage)
        echo_texts = None
        if not chat and req.echo:
            echo_texts = [p["prompt"] if p["prompt"] is not None else self.llm.tokenizer.decode(p["prompt_token_ids"])
                          for p in prompts]
        fmt = Formatter(chat, req.model, req.n, self.llm.tokenizer, num_logprobs, include_usage,
                        req.return_tokens_as_token_ids, echo_texts, prompt_only, tools, self.llm.engine.eos_token_id)
        return prompts, params, fmt


async def _whole(gen: Generation, fmt: Formatter) -> Response:
    finals = {}
    try:
        async for u in gen.updates():
            if u.finished:
                finals[u.index] = u
    finally:
        gen.close()
    failed = [u.output.error for u in finals.values() if u.output.error]
    if failed:
        raise APIError(500, f"generation failed: {failed[0]}", code="engine_error")
    return JSONResponse(fmt.whole(finals))


async def _stream(gen: Generation, fmt: Formatter, num_prompts: int) -> AsyncIterator[str]:
    """The event stream of one response (a module function: a cancelled stream's frames outlive it in
    a reference cycle, and must not hold the server)."""
    try:  # the finally runs when the client disconnects (the response task is cancelled) too
        for c in fmt.role_chunks(num_prompts):
            yield c
        async for u in gen.updates():
            for c in fmt.update_chunks(u) + fmt.error_chunk(u):
                yield c
        for c in fmt.final_chunks():
            yield c
    finally:
        gen.close()


def _no_pickles(path: Path, raw: str) -> None:
    """The server never unpickles: a PEFT directory must hold safetensors (or be a converted one)."""
    if path.is_dir() and not (path / SAFETENSORS_FILE).is_file() and not (path / JLORA_ADAPTER_META).is_file():
        raise APIError(400, f"lora_path {raw!r} has no {SAFETENSORS_FILE} (pickled adapter_model.bin files are "
                            f"not loaded by the server; re-save with safetensors)", param="lora_path")


async def _unless_disconnected(request: Request, work: Any) -> Response:
    """Run `work`; if the client disconnects first, cancel it (its finally aborts the engine requests)."""
    task = asyncio.ensure_future(work)

    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watch = asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
    if task.done():
        return task.result()
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    return Response(status_code=499)  # nobody is listening


def _field_path(loc: tuple) -> str:
    """'messages.0.content' from pydantic's loc, without 'body' and union-member tags like 'list[int]'."""
    parts = [str(x) for x in loc if x != "body" and not (isinstance(x, str) and ("[" in x or x in _TYPE_TAGS))]
    return ".".join(parts) or "body"


_TYPE_TAGS = {"str", "int", "float", "bool", "dict", "list", "none", "ChatMessage", "StreamOptions",
              "NamedToolChoice"}


# ---- auth ----------------------------------------------------------------------------------------------


class _BearerAuth:
    """Pure ASGI (no BaseHTTPMiddleware), so streaming responses and disconnects pass through untouched."""

    def __init__(self, app: Any, api_key: str, metrics_auth: bool = False):
        self.app = app
        self.expected = f"Bearer {api_key}".encode()
        self.metrics_auth = metrics_auth

    def _guarded(self, path: str) -> bool:
        return path.startswith("/v1/") or (self.metrics_auth and path == "/metrics")

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and self._guarded(scope["path"]):
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(given, self.expected):
                resp = ErrorJSON(error_body(401, "Invalid or missing API key (Authorization: Bearer <key>).",
                                               code="invalid_api_key"), status_code=401)
                await resp(scope, receive, send)
                return
        await self.app(scope, receive, send)


class _BodySizeLimit:
    """413 as an OpenAI error object for a body over the limit: at once for a Content-Length over
    it, and for a chunked body as soon as the bytes read pass it (the route's body read raises an
    HTTPException, which FastAPI hands to the app's error handler), so nothing large is buffered."""

    def __init__(self, app: Any, max_bytes: int):
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = dict(scope["headers"]).get(b"content-length", b"")
        if length.isdigit() and int(length) > self.max_bytes:
            resp = ErrorJSON(error_body(413, f"request body of {int(length)} bytes is over the limit of "
                                             f"{self.max_bytes} (--max-request-bytes)", param="body"),
                             status_code=413, headers={"Connection": "close"})
            return await resp(scope, receive, send)
        seen = 0

        async def counted() -> dict:
            nonlocal seen
            message = await receive()
            seen += len(message.get("body", b"")) if message["type"] == "http.request" else 0
            if seen > self.max_bytes:
                raise StarletteHTTPException(413, f"request body over the limit of {self.max_bytes} bytes "
                                                  f"(--max-request-bytes)", headers={"Connection": "close"})
            return message

        await self.app(scope, counted, send)


class _AccessLog:
    """One INFO line per request on the `jlora.server` logger once its response has been sent (a
    stream: when it ends): client, method, path, status, the completion's id when it has one, and
    seconds taken, e.g. `127.0.0.1:50112 "POST /v1/chat/completions" 200 chatcmpl-3f2a... 0.84 s`."""

    def __init__(self, app: Any):
        self.app = app

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        start, status = time.perf_counter(), 0
        state = scope.setdefault("state", {})  # what Starlette's request.state writes into

        async def send_and_see(message: dict) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_and_see)
        finally:
            client = scope.get("client")
            where = f"{client[0]}:{client[1]}" if client else "-"
            query = f"?{scope['query_string'].decode('latin-1')}" if scope.get("query_string") else ""
            log.info('%s "%s %s%s" %s %s %.2f s', where, scope["method"], scope["path"], query, status or "-",
                     state.get("request_id", "-"), time.perf_counter() - start)


# ---- the app -------------------------------------------------------------------------------------------


class ErrorJSON(JSONResponse):
    """JSON with non-ASCII escaped: an error that quotes a client's text (even a lone surrogate) renders."""

    def render(self, content: Any) -> bytes:
        return json.dumps(content, ensure_ascii=True, separators=(",", ":")).encode()


_ERRORS = {status: {"model": ErrorResponse, "description": why} for status, why in (
    (400, "A field is invalid (error.param names it)"), (401, "Missing or wrong API key"),
    (404, "Unknown model or adapter"), (413, "Request body too large"),
    (429, "Too many sequences waiting (see Retry-After)"), (500, "Generation failed"),
    (503, "Shutting down"))}


def build_app(llm: Any, model_id: str, *, lora_modules: dict[str, str] | None = None, api_key: str | None = None,
              enable_runtime_lora_updating: bool = False, lora_root: str | os.PathLike | None = None,
              shutdown_grace_s: float = 0.0, default_max_tokens: int = DEFAULT_MAX_TOKENS,
              max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES, metrics_auth: bool = False,
              health_stall_timeout: float = DEFAULT_STALL_S, max_prompts: int = DEFAULT_MAX_PROMPTS,
              max_messages: int = DEFAULT_MAX_MESSAGES) -> FastAPI:
    """The server for a warmed-up `LLM`. The engine thread starts and stops with the app's lifespan.

    The engine thread gets `shutdown_grace_s` to finish running requests and 5 s more to end; if it
    is wedged in a step the app stops without it (`stopped_cleanly` is False), so a SIGTERM always
    ends the server. When the lifespan ends the app lets go of its server (`app.state.server`, and
    with it the LLM): the caller's own reference is then the LLM's last one.

    The routes, handlers and lifespan reach the server only through `request.app.state` (they are
    module functions): FastAPI 0.165 keeps every route function in a module-level cache, and a
    FastAPI app sits in reference cycles of its own, so anything closing over the server would keep
    the LLM (weights, KV cache, compiled code) alive after the app is dropped."""
    server = OpenAIServer(llm, model_id, lora_modules, enable_runtime_lora_updating, lora_root, shutdown_grace_s,
                          default_max_tokens, max_prompts, max_messages, health_stall_timeout)
    app = FastAPI(title="jlora", version=_version(), lifespan=_lifespan,
                  description="OpenAI-compatible multi-LoRA server (vLLM's routes and fields).")
    app.state.server = server
    app.state.stopped_cleanly = True
    app.add_exception_handler(APIError, _api_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)

    app.get("/health", response_class=Response, name="health",
            responses={200: {"description": "Serving", "content": None},
                       503: {"description": "The engine thread has stopped or is stuck", "content": None}})(_health)
    app.get("/metrics", response_class=PlainTextResponse,
            responses={200: {"description": "Prometheus metrics", "content": {CONTENT_TYPE.split(";")[0]: {}}},
                       401: _ERRORS[401]}, name="metrics")(_metrics)
    app.get("/v1/models", responses={401: _ERRORS[401]}, name="models")(_models)
    app.get("/v1/models/{model_id:path}", responses={k: _ERRORS[k] for k in (401, 404)}, name="model")(_model)
    app.get("/version", response_model=VersionResponse, name="version")(_version_route)
    app.post("/tokenize", response_model=TokenizeResponse,
             responses={k: _ERRORS[k] for k in (400, 404, 413)}, name="tokenize")(_tokenize)
    app.post("/detokenize", response_model=DetokenizeResponse,
             responses={k: _ERRORS[k] for k in (400, 404, 413)}, name="detokenize")(_detokenize)
    generation = {k: _ERRORS[k] for k in (400, 401, 404, 413, 429, 500, 503)}
    generation[200] = {"description": "The completion, or with stream=true an event stream of chunks",
                       "content": {"text/event-stream": {}}}
    app.post("/v1/completions", responses=generation, name="completions")(_completions)
    app.post("/v1/chat/completions", responses=generation, name="chat_completions")(_chat_completions)
    if enable_runtime_lora_updating:
        adapter_errors = {k: _ERRORS[k] for k in (400, 401, 404, 413)}
        app.post("/v1/load_lora_adapter", response_class=PlainTextResponse,
                 responses=adapter_errors, name="load_lora_adapter")(_load_lora_adapter)
        app.post("/v1/unload_lora_adapter", response_class=PlainTextResponse,
                 responses=adapter_errors, name="unload_lora_adapter")(_unload_lora_adapter)

    limits = _schema_limits(server)  # plain numbers: the schema outlives the server
    app.openapi = lambda: _openapi(app, limits)  # type: ignore[method-assign]
    if api_key:
        app.add_middleware(_BearerAuth, api_key=api_key, metrics_auth=metrics_auth)
    app.add_middleware(_BodySizeLimit, max_bytes=max_request_bytes)  # before auth reads anything
    app.add_middleware(_AccessLog)  # outermost: every request gets its line, refused ones too
    return app


# ---- lifespan, handlers and routes: module functions that reach the server through the request --------


def _server(request: Request) -> OpenAIServer:
    return request.app.state.server


@contextlib.asynccontextmanager
async def _lifespan(app: FastAPI) -> AsyncIterator[None]:
    server: OpenAIServer | None = getattr(app.state, "server", None)
    if server is None:  # the engine thread starts once, and the server was let go at the end of the first
        raise RuntimeError("this app has already run and let go of its LLM: serve a new build_app(llm, ...)")
    server.engine.start()
    try:
        yield
        app.state.stopped_cleanly = await asyncio.to_thread(server.engine.stop, server.shutdown_grace_s,
                                                            server.shutdown_grace_s + 5.0)
        server.prep.shutdown(wait=False, cancel_futures=True)
        if not app.state.stopped_cleanly:
            log.error("the engine thread did not stop within %.0f s; leaving it", server.shutdown_grace_s + 5.0)
    finally:
        del app.state.server  # the app (cyclic, possibly long-lived) no longer holds the LLM


async def _api_error(request: Request, e: APIError) -> JSONResponse:
    if request.url.path in _GENERATION_PATHS and e.status < 500:
        _server(request).metrics.requests.labels(status="rejected").inc()
    return ErrorJSON(e.body(), status_code=e.status, headers=e.headers)


async def _validation_error(request: Request, e: RequestValidationError) -> JSONResponse:
    errors = e.errors()
    if errors and errors[0].get("type") == "json_invalid":
        ctx = errors[0].get("ctx") or {}
        return await _api_error(request, APIError(400, f"malformed JSON body: {ctx.get('error', errors[0]['msg'])}",
                                                  param="body"))
    by_field: dict[str, str] = {}  # one message per field (a union type yields one error per member)
    for err in errors:
        by_field.setdefault(_field_path(err.get("loc", ())), err.get("msg", "invalid"))
    message = "; ".join(f"{f}: {m}" for f, m in by_field.items()) or "invalid request body"
    return await _api_error(request, APIError(400, message, param=next(iter(by_field), None)))


async def _http_error(request: Request, e: StarletteHTTPException) -> JSONResponse:
    param = "body" if e.status_code == 413 else None
    return ErrorJSON(error_body(e.status_code, str(e.detail), param=param), status_code=e.status_code,
                     headers=e.headers)


async def _health(request: Request) -> Response:
    server = _server(request)
    ok = server.engine.alive and server.engine.seconds_since_progress() <= server.health_stall_timeout
    return Response(status_code=200 if ok else 503)


async def _metrics(request: Request) -> Response:
    return Response(_server(request).metrics.render(), media_type=CONTENT_TYPE)


async def _models(request: Request) -> dict[str, Any]:
    return _server(request).models()


async def _model(model_id: str, request: Request) -> dict[str, Any]:
    return _server(request).model(model_id)


async def _version_route(request: Request) -> dict[str, str]:
    return {"version": request.app.version}


async def _tokenize(body: TokenizeRequest, request: Request) -> dict[str, Any]:
    server = _server(request)
    return await asyncio.get_running_loop().run_in_executor(server.prep, server.tokenize, body)


async def _detokenize(body: DetokenizeRequest, request: Request) -> dict[str, Any]:
    server = _server(request)
    return await asyncio.get_running_loop().run_in_executor(server.prep, server.detokenize, body)


async def _completions(body: CompletionRequest, request: Request) -> Response:
    return await _server(request).complete(body, request)


async def _chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
    return await _server(request).complete(body, request)


async def _load_lora_adapter(body: LoadLoRAAdapterRequest, request: Request) -> Response:
    return PlainTextResponse(await _server(request).load_adapter(body))


async def _unload_lora_adapter(body: UnloadLoRAAdapterRequest, request: Request) -> Response:
    return PlainTextResponse(await _server(request).unload_adapter(body))


def _schema_limits(server: OpenAIServer) -> dict[str, int]:
    return {"max_n": server.max_n, "max_model_len": server.max_model_len, "vocab_size": server.vocab_size,
            "max_messages": server.max_messages}


def _openapi(app: FastAPI, limits: dict[str, int]) -> dict[str, Any]:
    """FastAPI's schema with what this server adds: its own maxima (n up to --max-n, max_tokens up
    to the context, token ids below the vocabulary, messages up to --max-messages-per-request), and 400 in place of FastAPI's 422 (errors
    here are OpenAI error objects, always JSON)."""
    if app.openapi_schema:
        return app.openapi_schema
    schema = get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes)
    for path in schema.get("paths", {}).values():
        for op in path.values():
            responses = op.get("responses", {})
            responses.pop("422", None)
            for status, resp in responses.items():  # errors are JSON whatever the route's own type
                if int(status) >= 400 and resp.get("content"):
                    resp["content"] = {"application/json": next(iter(resp["content"].values()))}
    max_n, max_len, vocab = limits["max_n"], limits["max_model_len"], limits["vocab_size"]
    maxima = {"n": max_n, "best_of": max_n, "max_tokens": max_len - 1, "max_completion_tokens": max_len - 1,
              "top_k": vocab}
    token_max = vocab - 1
    comps = schema.get("components", {}).get("schemas", {})
    for name in ("CompletionRequest", "ChatCompletionRequest"):
        props = comps.get(name, {}).get("properties", {})
        for field, hi in maxima.items():
            if field in props:
                _set_maximum(props[field], hi)
        for field in ("prompt", "stop_token_ids"):
            if field in props:
                _set_maximum(props[field], token_max)
    for name in ("ChatCompletionRequest", "TokenizeRequest"):
        props = comps.get(name, {}).get("properties", {})
        if "messages" in props:
            _set_max_items(props["messages"], limits["max_messages"])
    for name in ("HTTPValidationError", "ValidationError"):
        comps.pop(name, None)
    app.openapi_schema = schema
    return schema


def _set_max_items(node: dict[str, Any], hi: int) -> None:
    """`maxItems: hi` on the array schema `node` (or on each array inside its anyOf)."""
    for v in [node, *node.get("anyOf", [])]:
        if v.get("type") == "array":
            v["maxItems"] = min(hi, v.get("maxItems", hi))


def _set_maximum(node: Any, hi: int) -> None:
    """Lower the `maximum` of every integer schema inside `node` (through anyOf / items) to `hi`."""
    if isinstance(node, list):
        for v in node:
            _set_maximum(v, hi)
    elif isinstance(node, dict):
        if node.get("type") == "integer":
            node["maximum"] = min(hi, node.get("maximum", hi))
        for v in node.values():
            _set_maximum(v, hi)


def _version() -> str:
    try:
        from importlib.metadata import version

        return version("jlora")
    except Exception:  # running from a source tree without installing
        return "0"
