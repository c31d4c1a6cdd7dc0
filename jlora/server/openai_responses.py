"""Engine outputs -> OpenAI-shaped replies: whole completion / chat completion objects and SSE chunks."""

from __future__ import annotations

import json
import time
import uuid
from typing import Any

from jlora.server.engine_thread import Update
from jlora.server.protocol import error_body
from jlora.server.tools import ToolCalls


class Formatter:
    """Builds the OpenAI objects for one request (completion or chat), streamed or whole."""

    def __init__(self, chat: bool, model: str, n: int, tokenizer: Any, num_logprobs: int | None,
                 include_usage: bool, tokens_as_ids: bool = False, echo_texts: list[str] | None = None,
                 prompt_only: bool = False, tools: ToolCalls | None = None, eos_token_id: int | None = None):
        """echo_texts: per prompt, its text, put before each of its choices (completions' `echo`);
        prompt_only: `max_tokens=0` with echo, so the one token generated is not returned;
        tools: a chat request's tool mode, which turns the text into content and tool_calls."""
        self.chat, self.model, self.n = chat, model, n
        self.tools = tools
        self.eos_token_id = eos_token_id
        self.streamed: dict[int, str] = {}  # choice index -> its text so far (tool modes)
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
        ids = o.token_ids
        if o.logprobs is not None and len(o.logprobs) == len(ids) + 1:  # the EOS / stop token that ended it
            ids = ids + [o.stop_reason if isinstance(o.stop_reason, int) else self.eos_token_id]
        return delta, self.logprobs(i, ids, o.logprobs)

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
                if self.tools is not None:
                    choice["message"], choice["finish_reason"] = self.tools.message(o.text, o.finish_reason)
                elif self.chat:
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
            if self.tools is not None:
                self.streamed[i] = self.streamed.get(i, "") + delta
                deltas, finish = self.tools.delta(i, self.streamed[i], done, o.finish_reason)
                if done:
                    self.finished.add(i)
                if not deltas and not done and not (lp and lp.get("content")):
                    continue
                for k, d in enumerate(deltas or [{}]):
                    last = k == max(len(deltas), 1) - 1
                    chunks.append(self._chunk([{"index": i, "delta": d, "logprobs": lp if k == 0 else None,
                                                "finish_reason": finish if done and last else None}]))
                continue
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
