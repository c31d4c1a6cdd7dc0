"""OpenAI request bodies -> engine inputs (prompts, SamplingParams, structured outputs), and the engine
requests behind one HTTP request as an async stream. Replies are built in `openai_responses`."""

from __future__ import annotations

import asyncio
import json
import re
import weakref
from typing import Any, AsyncIterator

from jlora.adapters.request import LoRACombination, LoRARequest
from jlora.engine.structured import GrammarCompiler
from jlora.sampling_params import SamplingParams, StructuredOutputsParams
from jlora.engine.llm_engine import QueueFullError
from jlora.server.engine_thread import EngineThread, ShuttingDown, Update
from jlora.server.limits import RETRY_AFTER_S
from jlora.server.protocol import APIError, ChatCompletionRequest, CompletionRequest
from jlora.server.tools import ToolCalls

Prompt = dict[str, Any]  # {"prompt_token_ids": [...], "prompt": text or None}


# ---- request -> engine inputs ------------------------------------------------------------------------


def structured_outputs(req: CompletionRequest | ChatCompletionRequest,
                       tools: ToolCalls | None = None) -> tuple[StructuredOutputsParams | None, str]:
    """The request's grammar, from `response_format`, vLLM's fields or a named / required
    tool_choice (at most one), and the field that gave it (for error messages)."""
    rf = req.response_format
    given = {}
    tool_grammar = tools.structured(req) if tools is not None else None
    if tool_grammar is not None:
        given["tool_choice"] = tool_grammar
    if rf is not None and rf.type != "text":
        if rf.type == "json_object":
            given["response_format"] = {"json_object": True}
        elif rf.json_schema is None or rf.json_schema.schema_ is None:
            raise APIError(400, "response_format json_schema needs json_schema.schema", param="response_format")
        else:
            given["response_format"] = {"json": rf.json_schema.schema_}
    for name, key in (("guided_json", "json"), ("guided_regex", "regex"), ("guided_choice", "choice"),
                      ("guided_grammar", "grammar")):
        if getattr(req, name) is not None:
            given[name] = {key: getattr(req, name)}
    if req.structured_outputs is not None:
        given["structured_outputs"] = req.structured_outputs
    if not given:
        return None, ""
    if len(given) > 1:
        raise APIError(400, f"give one of {sorted(given)}, not several", param=sorted(given)[1])
    (field, kw), = given.items()
    if isinstance(kw, StructuredOutputsParams):
        return kw, field
    try:
        return StructuredOutputsParams(**kw), field
    except (TypeError, ValueError) as e:
        raise APIError(400, f"{field}: {e}", param=field) from None


def sampling_params(req: CompletionRequest | ChatCompletionRequest, max_tokens: int,
                    logprobs: int | None, vocab_size: int, max_n: int,
                    prompt_logprobs: int | None = None, tools: ToolCalls | None = None) -> SamplingParams:
    """SamplingParams from the request, checked against the engine (vocabulary, `--max-n`); its
    ValueError becomes a 400 naming the field."""
    structured, structured_field = structured_outputs(req, tools)
    bias = None
    if req.logit_bias:
        try:
            bias = {int(t): v for t, v in req.logit_bias.items()}
        except ValueError:
            raise APIError(400, "logit_bias keys must be token ids (integers as strings)", param="logit_bias") from None
    kw = dict(temperature=1.0 if req.temperature is None else req.temperature,
              top_p=1.0 if req.top_p is None else req.top_p,
              top_k=-1 if req.top_k is None else req.top_k,
              min_p=req.min_p or 0.0,
              repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
              presence_penalty=req.presence_penalty or 0.0, frequency_penalty=req.frequency_penalty or 0.0,
              max_tokens=max_tokens, min_tokens=req.min_tokens, ignore_eos=req.ignore_eos, seed=req.seed,
              stop=req.stop, stop_token_ids=req.stop_token_ids, logprobs=logprobs, n=req.n, logit_bias=bias,
              structured_outputs=structured, prompt_logprobs=prompt_logprobs)
    try:
        params = SamplingParams(**kw)
        params.check_for_engine(vocab_size, max_n)
    except ValueError as e:
        m = re.match(r"SamplingParams\.(\w+)=(.*)", str(e), re.S)
        if m is None:
            raise APIError(400, str(e)) from e
        field = m.group(1)
        if field == "logprobs" and isinstance(req, ChatCompletionRequest):
            field = "top_logprobs"  # the chat API's name for the count
        raise APIError(400, f"{field}={m.group(2)}", param=field) from e
    if structured is not None:
        try:
            GrammarCompiler.check(structured)
        except ValueError as e:
            why = str(e).split(": ", 1)[-1]
            raise APIError(400, f"{structured_field}: {why}", param=structured_field) from None
    return params


def check_text_size(text: str, max_bytes: int, field: str) -> None:
    if len(text) > max_bytes or len(text.encode("utf-8")) > max_bytes:  # chars <= bytes: cheap test first
        raise APIError(400, f"{field} is longer than any prompt the context can hold ({max_bytes} bytes of text "
                            f"would be more tokens than max_model_len)", param=field)


def completion_prompts(req: CompletionRequest, tokenizer: Any, max_bytes: int, vocab_size: int) -> list[Prompt]:
    p = req.prompt
    if isinstance(p, str):
        items: list[Any] = [p]
    elif p and all(isinstance(x, int) for x in p):
        items = [p]  # one token id list
    else:
        items = list(p)
    if not items:
        raise APIError(400, "prompt must not be empty", param="prompt")
    out = []
    for item in items:
        if isinstance(item, str):
            check_text_size(item, max_bytes, "prompt")
            out.append({"prompt_token_ids": tokenizer.encode(item, add_special_tokens=True), "prompt": item})
        else:
            if any(t >= vocab_size for t in item):
                raise APIError(400, f"prompt: token ids must be below the vocabulary size {vocab_size}", param="prompt")
            out.append({"prompt_token_ids": list(item), "prompt": None})
    return out


def chat_prompt(req: ChatCompletionRequest, llm: Any, max_bytes: int, add_generation_prompt: bool = True,
                tools: ToolCalls | None = None) -> Prompt:
    """The prompt's token ids through the chat template, with `tools` shown to it when a tool
    choice other than "none" is in play; assistant tool calls and tool results render too."""
    messages = []
    for i, m in enumerate(req.messages):
        content = m.content
        if isinstance(content, list):  # content parts: only text is understood
            parts = []
            for part in content:
                if part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise APIError(400, f"messages[{i}].content: only text parts are supported",
                                   param=f"messages.{i}.content")
                try:
                    part["text"].encode("utf-8")
                except UnicodeEncodeError:
                    raise APIError(400, f"messages[{i}].content: text must be valid UTF-8 (no lone surrogates)",
                                   param=f"messages.{i}.content") from None
                parts.append(part["text"])
            content = "\n".join(parts)
        msg: dict[str, Any] = {"role": m.role, "content": content or ""}
        if m.tool_calls:
            msg["tool_calls"] = [{"id": c.id, "type": "function",
                                  "function": {"name": c.function.name, "arguments": c.function.arguments}}
                                 for c in m.tool_calls]
        msg.update({k: getattr(m, k) for k in ("tool_call_id", "name") if getattr(m, k) is not None})
        messages.append(msg)
    calls = [m["tool_calls"] for m in messages if "tool_calls" in m]
    check_text_size("".join(m["content"] for m in messages) + (json.dumps(calls) if calls else ""), max_bytes,
                    "messages")
    if tools is not None:
        check_text_size(json.dumps(tools.tools), max_bytes, "tools")
    try:
        ids = llm.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                      tools=tools.tools if tools is not None else None)
    except Exception as e:  # jinja raises for roles or orders the template refuses
        raise APIError(400, f"messages: the chat template refused them: {e}", param="messages") from e
    return {"prompt_token_ids": ids, "prompt": None}


def check_lengths(prompts: list[Prompt], max_tokens: int | None, max_model_len: int, prompt_field: str) -> int:
    """The max_tokens to use (the rest of the context when None); 400 when the request cannot fit."""
    longest = max(len(p["prompt_token_ids"]) for p in prompts)
    if longest == 0:
        raise APIError(400, f"{prompt_field} is empty (0 tokens)", param=prompt_field)
    if longest >= max_model_len:
        raise APIError(400, f"This model's maximum context length is {max_model_len} tokens; the prompt has "
                            f"{longest} tokens and leaves no room for a completion.", param=prompt_field)
    if max_tokens is None:
        return max_model_len - longest
    if max_tokens + longest > max_model_len:
        raise APIError(400, f"This model's maximum context length is {max_model_len} tokens. However, you "
                            f"requested {max_tokens + longest} tokens ({longest} in the prompt, {max_tokens} in "
                            f"max_tokens). Please reduce the length of the prompt or max_tokens.",
                       param="max_tokens")
    return max_tokens


# ---- one HTTP request's engine requests ---------------------------------------------------------------


class Generation:
    """The engine requests behind one HTTP request, and their updates as an async stream.

    It holds the engine thread weakly: a response cancelled by a disconnect leaves a reference
    cycle (anyio's CancelledError, its traceback, the response's frames) that keeps this object
    until a full collection, and must not keep the LLM with it (the server holds the thread)."""

    def __init__(self, engine: EngineThread, prefix: str, num_prompts: int, received: float):
        self._engine = weakref.ref(engine)
        self.request_ids = [f"{prefix}-{i}" for i in range(num_prompts)]
        self.pending = set(range(num_prompts))
        self.queue: asyncio.Queue[Update] = asyncio.Queue()
        self.received = received  # time.time() when the HTTP request arrived

    @property
    def engine(self) -> EngineThread:
        engine = self._engine()
        if engine is None:
            raise ShuttingDown("the server has stopped")
        return engine

    async def start(self, prompts: list[Prompt], params: SamplingParams,
                    lora: LoRARequest | LoRACombination | None) -> None:
        loop = asyncio.get_running_loop()

        def callback(u: Update) -> None:  # runs on the engine thread
            loop.call_soon_threadsafe(self.queue.put_nowait, u)

        handle = None
        if lora is not None:  # converted off the engine thread, so running requests never wait for it
            combo = isinstance(lora, LoRACombination)
            try:
                futures = [self.engine.engine.adapters.prepare_async(p) for p in lora.parts]
                handles = tuple([await asyncio.wrap_future(f) for f in futures])
            except (ValueError, FileNotFoundError, OSError) as e:  # nothing was queued
                self.pending.clear()
                raise APIError(400, f"could not load adapter {lora.lora_name!r}: {e}",
                               param="lora_combine" if combo else "model") from e
            handle = handles if combo else handles[0]
        try:
            await asyncio.wrap_future(self.engine.submit(self.request_ids, prompts, params, lora, callback,
                                                         self.received, handle))
        except (ValueError, FileNotFoundError) as e:  # nothing was queued
            self.pending.clear()
            raise APIError(400, str(e)) from e
        except QueueFullError as e:
            self.pending.clear()
            raise APIError(429, f"the server is busy: {e}; retry later", code="queue_full",
                           headers={"Retry-After": str(RETRY_AFTER_S)}) from e
        except ShuttingDown as e:
            self.pending.clear()
            raise APIError(503, str(e)) from e
        except BaseException:
            # Cancelled while queued: the submit may still run, so abort whatever it added.
            self.close()
            raise

    async def updates(self) -> AsyncIterator[Update]:
        while self.pending:
            u = await self.queue.get()
            if u.finished:
                self.pending.discard(u.index)
            yield u

    def close(self) -> None:
        """Abort what has not finished (the client went away); frees KV blocks and slot pins."""
        engine = self._engine()
        if self.pending and engine is not None:  # a stopped server's engine thread aborted them itself
            engine.abort([self.request_ids[i] for i in sorted(self.pending)])
        self.pending.clear()
