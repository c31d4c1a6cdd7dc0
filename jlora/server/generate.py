"""Completions and chat completions: request -> engine requests -> OpenAI-shaped replies and SSE chunks."""

from __future__ import annotations

import asyncio
import json
import re
import time
import uuid
from typing import Any, AsyncIterator

from jlora.adapters.request import LoRARequest
from jlora.engine.structured import GrammarCompiler
from jlora.sampling_params import SamplingParams, StructuredOutputsParams
from jlora.engine.llm_engine import QueueFullError
from jlora.server.engine_thread import EngineThread, ShuttingDown, Update
from jlora.server.limits import RETRY_AFTER_S
from jlora.server.protocol import APIError, ChatCompletionRequest, CompletionRequest, error_body

Prompt = dict[str, Any]  # {"prompt_token_ids": [...], "prompt": text or None}


# ---- request -> engine inputs ------------------------------------------------------------------------


def structured_outputs(req: CompletionRequest | ChatCompletionRequest) -> tuple[StructuredOutputsParams | None, str]:
    """The request's grammar, from `response_format` or vLLM's fields (at most one), and the field
    that gave it (for error messages)."""
    rf = req.response_format
    given = {}
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
    try:
        return StructuredOutputsParams(**kw), field
    except (TypeError, ValueError) as e:
        raise APIError(400, f"{field}: {e}", param=field) from None


def sampling_params(req: CompletionRequest | ChatCompletionRequest, max_tokens: int,
                    logprobs: int | None, vocab_size: int, max_n: int,
                    prompt_logprobs: int | None = None) -> SamplingParams:
    """SamplingParams from the request, checked against the engine (vocabulary, `--max-n`); its
    ValueError becomes a 400 naming the field."""
    structured, structured_field = structured_outputs(req)
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


def chat_prompt(req: ChatCompletionRequest, llm: Any, max_bytes: int, add_generation_prompt: bool = True) -> Prompt:
    for field in ("tools", "functions"):
        if (req.model_extra or {}).get(field):
            raise APIError(400, f"{field} is not supported", param=field)
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
        messages.append({"role": m.role, "content": content or ""})
    check_text_size("".join(m["content"] for m in messages), max_bytes, "messages")
    try:
        ids = llm.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
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
    """The engine requests behind one HTTP request, and their updates as an async stream."""

    def __init__(self, engine: EngineThread, prefix: str, num_prompts: int, received: float):
        self.engine = engine
        self.request_ids = [f"{prefix}-{i}" for i in range(num_prompts)]
        self.pending = set(range(num_prompts))
        self.queue: asyncio.Queue[Update] = asyncio.Queue()
        self.received = received  # time.time() when the HTTP request arrived

    async def start(self, prompts: list[Prompt], params: SamplingParams, lora: LoRARequest | None) -> None:
        loop = asyncio.get_running_loop()

        def callback(u: Update) -> None:  # runs on the engine thread
            loop.call_soon_threadsafe(self.queue.put_nowait, u)

        handle = None
        if lora is not None:  # converted off the engine thread, so running requests never wait for it
            try:
                handle = await asyncio.wrap_future(self.engine.engine.adapters.prepare_async(lora))
            except (ValueError, FileNotFoundError, OSError) as e:  # nothing was queued
                self.pending.clear()
                raise APIError(400, f"could not load adapter {lora.lora_name!r}: {e}", param="model") from e
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
        if self.pending:
            self.engine.abort([self.request_ids[i] for i in sorted(self.pending)])
            self.pending.clear()


# ---- reply formatting ----------------------------------------------------------------------------------


class Formatter:
    """Builds the OpenAI objects for one request (completion or chat), streamed or whole."""

    def __init__(self, chat: bool, model: str, n: int, tokenizer: Any, num_logprobs: int | None,
                 include_usage: bool, tokens_as_ids: bool = False, echo_texts: list[str] | None = None,
                 prompt_only: bool = False):
        """echo_texts: per prompt, its text, put before each of its choices (completions' `echo`);
        prompt_only: `max_tokens=0` with echo, so the one token generated is not returned."""
        self.chat, self.model, self.n = chat, model, n
        self.echo_texts = echo_texts
        self.prompt_only = prompt_only
        self.echoed: set[int] = set()
        self.tokenizer = tokenizer
        self.num_logprobs = num_logprobs
        self.include_usage = include_usage
        self.tokens_as_ids = tokens_as_ids
        self.id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.object = "chat.completion" if chat else "text_completion"
        self.prompt_tokens: dict[int, int] = {}  # prompt index -> its prompt length
        self.tokens_sent: dict[int, int] = {}  # choice index -> tokens whose logprobs went out
        self.text_offset: dict[int, int] = {}
        self.finished: set[int] = set()
        self.completion_tokens: dict[int, int] = {}

    def _token(self, tid: int) -> str:
        return f"token_id:{tid}" if self.tokens_as_ids else self.tokenizer.decode([tid])

    def logprobs(self, choice: int, token_ids: list[int], logprobs: list[dict[int, float]] | None) -> Any:
        """Logprobs for the tokens of `choice` not sent yet (all of them in a whole reply)."""
        if self.num_logprobs is None or logprobs is None:
            return None
        start = self.tokens_sent.get(choice, 0)
        self.tokens_sent[choice] = len(token_ids)
        pairs = list(zip(token_ids[start:], logprobs[start:]))
        if self.chat:
            content = []
            for tid, lp in pairs:
                s = self._token(tid)
                top = sorted(lp.items(), key=lambda kv: -kv[1])[: self.num_logprobs]
                content.append({"token": s, "logprob": lp[tid], "bytes": list(s.encode()),
                                "top_logprobs": [{"token": self._token(t), "logprob": v,
                                                  "bytes": list(self._token(t).encode())} for t, v in top]})
            return {"content": content}
        out: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        offset = self.text_offset.get(choice, 0)
        for tid, lp in pairs:
            s = self._token(tid)
            out["tokens"].append(s)
            out["token_logprobs"].append(lp[tid])
            out["top_logprobs"].append({self._token(t): v for t, v in sorted(lp.items(), key=lambda kv: -kv[1])})
            out["text_offset"].append(offset)
            offset += len(s)
        self.text_offset[choice] = offset
        return out

    def _echo(self, i: int, u: Update) -> tuple[str, dict[str, list] | None]:
        """Choice i's prompt part, once: its text and, with logprobs, each prompt token's logprob
        (None for the first) and top logprobs, as vLLM echoes them."""
        if self.echo_texts is None or i in self.echoed:
            return "", None
        self.echoed.add(i)
        text = self.echo_texts[u.index]
        if self.num_logprobs is None:
            return text, None
        out: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        offset = self.text_offset.get(i, 0)
        lps = u.output.prompt_logprobs or [None] * len(u.output.prompt_token_ids)
        for tid, lp in zip(u.output.prompt_token_ids, lps):
            s = self._token(tid)
            out["tokens"].append(s)
            out["token_logprobs"].append(None if lp is None else lp[tid])
            out["top_logprobs"].append(None if lp is None else
                                       {self._token(t): v for t, v in sorted(lp.items(), key=lambda kv: -kv[1])})
            out["text_offset"].append(offset)
            offset += len(s)
        self.text_offset[i] = offset
        return text, out

    def _generated(self, i: int, o: Any, delta: str) -> tuple[str, dict[str, list] | None]:
        if self.prompt_only:
            return "", None
        return delta, self.logprobs(i, o.token_ids, o.logprobs)

    @staticmethod
    def _join(a: dict[str, list] | None, b: dict[str, list] | None) -> dict[str, list] | None:
        if a is None or b is None:
            return a or b
        return {k: a[k] + b[k] for k in a}

    def usage(self) -> dict[str, int]:
        p, c = sum(self.prompt_tokens.values()), sum(self.completion_tokens.values())
        return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}

    def _track(self, u: Update) -> None:
        self.prompt_tokens[u.index] = len(u.output.prompt_token_ids)
        for o in u.output.outputs:
            # The EOS or stop token that ended a sample is generated (and counted, as vLLM and
            # OpenAI do) though not returned; a stop string's tokens are in token_ids.
            dropped = o.finish_reason == "stop" and not isinstance(o.stop_reason, str)
            count = 0 if self.prompt_only else len(o.token_ids) + dropped
            self.completion_tokens[u.index * self.n + o.index] = count

    # whole replies

    def whole(self, finals: dict[int, Update]) -> dict[str, Any]:
        choices = []
        for idx in sorted(finals):
            u = finals[idx]
            self._track(u)
            for o in u.output.outputs:
                i = idx * self.n + o.index
                echo_text, echo_lp = self._echo(i, u)
                text, lp = self._generated(i, o, o.text)
                lp = self._join(echo_lp, lp)
                choice: dict[str, Any] = {"index": i, "logprobs": lp, "finish_reason": o.finish_reason,
                                          "stop_reason": o.stop_reason}
                if self.chat:
                    choice["message"] = {"role": "assistant", "content": o.text}
                else:
                    choice["text"] = echo_text + text
                choices.append(choice)
        return {"id": self.id, "object": self.object, "created": self.created, "model": self.model,
                "choices": choices, "usage": self.usage()}

    # streamed replies

    def _chunk(self, choices: list[dict[str, Any]], usage: dict[str, int] | None = None) -> str:
        body = {"id": self.id, "object": "chat.completion.chunk" if self.chat else "text_completion",
                "created": self.created, "model": self.model, "choices": choices}
        if self.include_usage:
            body["usage"] = usage
        return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"

    def role_chunks(self, num_prompts: int) -> list[str]:
        if not self.chat:
            return []
        return [self._chunk([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                              "finish_reason": None}]) for i in range(num_prompts * self.n)]

    def update_chunks(self, u: Update) -> list[str]:
        self._track(u)
        chunks = []
        for o, delta in zip(u.output.outputs, u.deltas):
            i = u.index * self.n + o.index
            if i in self.finished:
                continue
            done = o.finish_reason is not None
            echo_text, echo_lp = self._echo(i, u)
            delta, lp = self._generated(i, o, delta)
            delta, lp = echo_text + delta, self._join(echo_lp, lp)
            if not delta and not done and not (lp and (lp.get("content") or lp.get("tokens"))):
                continue
            choice: dict[str, Any] = {"index": i, "logprobs": lp, "finish_reason": o.finish_reason if done else None}
            if self.chat:
                choice["delta"] = {"content": delta} if delta else {}
            else:
                choice["text"] = delta
                choice["stop_reason"] = o.stop_reason if done else None
            if done:
                self.finished.add(i)
            chunks.append(self._chunk([choice]))
        return chunks

    def error_chunk(self, u: Update) -> list[str]:
        """The engine failed this prompt's request: one error event (as vLLM streams it); the
        stream then ends as usual."""
        if not (u.finished and u.output.error):
            return []
        body = error_body(500, f"generation failed: {u.output.error}", code="engine_error")
        return [f"data: {json.dumps(body, ensure_ascii=True)}\n\n"]

    def final_chunks(self) -> list[str]:
        out = [self._chunk([], self.usage())] if self.include_usage else []
        return out + ["data: [DONE]\n\n"]
