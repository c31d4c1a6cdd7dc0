"""`tools` / `tool_choice` on /v1/chat/completions, as vLLM serves them.

- "none" (or no tools): tools are not shown to the template; plain chat.
- named function: the output is constrained (llguidance) to that function's `parameters` schema and
  returned as one tool call whose `arguments` is the generated JSON.
- "required": the output is constrained to a JSON list of one or more `{"name", "arguments"}`
  objects, one schema branch per tool (vLLM's shape, with SmolLM2's key `arguments`).
- "auto": free text, parsed for the tool-call syntax of `<tool_call>...</tool_call>` templates
  (Hermes: one object per block; SmolLM2: a list per block); calls found give `tool_calls` and
  `finish_reason: "tool_calls"`, otherwise the text is the content.

Tools reach the model through the chat template only, so a template that never reads `tools`
gets a 400 naming `tools` (unless tool_choice is "none").
"""

from __future__ import annotations

import dataclasses
import functools
import json
import re
import uuid
from typing import Any

from jlora.engine.structured import GrammarCompiler
from jlora.sampling_params import StructuredOutputsParams
from jlora.server.protocol import APIError, ChatCompletionRequest

TAG, END_TAG = "<tool_call>", "</tool_call>"
_BLOCK = re.compile(re.escape(TAG) + r"(.*?)(?:" + re.escape(END_TAG) + r"|$)", re.S)


@functools.lru_cache(maxsize=8)
def template_reads_tools(template: str | None) -> bool:
    """Whether a Jinja chat template uses the `tools` variable."""
    if not template:
        return False
    import jinja2
    import jinja2.meta

    try:
        ast = jinja2.Environment(extensions=["jinja2.ext.loopcontrols"]).parse(template)
        return "tools" in jinja2.meta.find_undeclared_variables(ast)
    except jinja2.TemplateSyntaxError:  # a tag only transformers knows ({% generation %}): read the text
        return re.search(r"\btools\b", template) is not None


def _parameters(tool: Any) -> dict[str, Any]:
    return tool.function.parameters if tool.function.parameters is not None else {"type": "object",
                                                                                  "properties": {}}


@dataclasses.dataclass
class ToolCalls:
    """The tool mode of one chat request, and the per-choice state of its streamed reply."""

    kind: str  # "named" | "required" | "auto"
    tools: list[dict[str, Any]]  # the request's tools as dicts, for the chat template
    name: str | None = None  # the named function
    _stream: dict[int, dict[str, Any]] = dataclasses.field(default_factory=dict)

    # ---- the request ----------------------------------------------------------------------------------

    @classmethod
    def from_request(cls, req: ChatCompletionRequest, template: str | None) -> "ToolCalls | None":
        """None when no tools take part; 400 naming the field for a bad combination."""
        choice = req.tool_choice
        if (req.model_extra or {}).get("functions"):
            raise APIError(400, "functions (the legacy form) is not supported; use tools", param="functions")
        if not req.tools:
            if choice not in (None, "none"):
                raise APIError(400, "tool_choice needs tools", param="tool_choice")
            return None
        if choice == "none":
            return None
        if not template_reads_tools(template):
            raise APIError(400, "tools: this model's chat template does not render tools, so the model would never "
                                "see them (start the server with a --chat-template that reads `tools`, such as "
                                "smollm2-tools, or send tool_choice=\"none\")", param="tools")
        names = [t.function.name for t in req.tools]
        for i, t in enumerate(req.tools):
            if names.index(t.function.name) != i:
                raise APIError(400, f"tools[{i}].function.name {t.function.name!r} is given twice",
                               param=f"tools.{i}.function.name")
            p = t.function.parameters
            if p is not None and p.get("type", "object") != "object":
                raise APIError(400, f"tools[{i}].function.parameters must be a JSON schema of type object, got "
                                    f"type {p.get('type')!r}", param=f"tools.{i}.function.parameters")
            if p is not None:
                try:
                    GrammarCompiler.check(StructuredOutputsParams(json=p))
                except ValueError as e:
                    raise APIError(400, f"tools[{i}].function.parameters: {str(e).split(': ', 1)[-1]}",
                                   param=f"tools.{i}.function.parameters") from None
        tools = [t.model_dump(exclude_none=True) for t in req.tools]
        if choice is None or choice == "auto":
            return cls("auto", tools)
        if choice == "required":
            return cls("required", tools)
        if choice.function.name not in names:
            raise APIError(400, f"tool_choice names function {choice.function.name!r}, which is not among the "
                                f"tools ({names})", param="tool_choice")
        return cls("named", tools, choice.function.name)

    def structured(self, req: ChatCompletionRequest) -> StructuredOutputsParams | None:
        """The grammar the output must follow (named and required choice)."""
        if self.kind == "auto":
            return None
        by_name = {t.function.name: t for t in req.tools}
        if self.kind == "named":
            schema = _parameters(by_name[self.name])
        else:
            schema = {"type": "array", "minItems": 1, "items": {"anyOf": [
                {"type": "object", "properties": {"name": {"const": n}, "arguments": _parameters(t)},
                 "required": ["name", "arguments"], "additionalProperties": False} for n, t in by_name.items()]}}
            if req.parallel_tool_calls is False:
                schema["maxItems"] = 1
        return StructuredOutputsParams(json=schema)

    # ---- the reply --------------------------------------------------------------------------------------

    def parse(self, text: str) -> tuple[str | None, list[dict[str, str]]]:
        """(content, calls as {"name", "arguments" (JSON text)}) of one generated text."""
        if self.kind == "named":
            return None, [{"name": self.name, "arguments": text}]
        if self.kind == "required":
            try:
                items = json.loads(text)
            except ValueError:  # cut short by max_tokens: nothing to call
                return text, []
            return None, [_call(c) for c in items]
        if TAG not in text:
            return text, []
        calls = []
        for block in _BLOCK.findall(text):
            try:
                obj = json.loads(block)
            except ValueError:  # not a tool call after all: all of it is content (as vLLM's hermes parser)
                return text, []
            items = obj if isinstance(obj, list) else [obj]
            if not all(isinstance(c, dict) and isinstance(c.get("name"), str) for c in items):
                return text, []
            calls += [_call(c) for c in items]
        return text[: text.index(TAG)].rstrip() or None, calls

    def finish_reason(self, calls: list, finish_reason: str | None) -> str | None:
        """vLLM's: "tool_calls" when auto or required calls were made and the model stopped itself."""
        return "tool_calls" if calls and self.kind != "named" and finish_reason == "stop" else finish_reason

    def message(self, text: str, finish_reason: str | None) -> tuple[dict[str, Any], str | None]:
        content, calls = self.parse(text)
        msg: dict[str, Any] = {"role": "assistant", "content": content}
        if calls:
            msg["tool_calls"] = [_tool_call(c) for c in calls]
        return msg, self.finish_reason(calls, finish_reason)

    def delta(self, i: int, text: str, done: bool, finish_reason: str | None) -> tuple[list[dict], str | None]:
        """Stream deltas for choice i given its whole text so far: content as it can be told from a
        tool call, a named call's arguments as they come, other calls whole when the choice ends."""
        st = self._stream.setdefault(i, {"sent": 0, "named_started": False})
        out: list[dict[str, Any]] = []
        if self.kind == "named":
            if not st["named_started"]:
                st["named_started"] = True
                out.append({"tool_calls": [{**_tool_call({"name": self.name, "arguments": ""}), "index": 0}]})
            if len(text) > st["sent"]:
                out.append({"tool_calls": [{"index": 0, "function": {"arguments": text[st["sent"]:]}}]})
                st["sent"] = len(text)
            return out, finish_reason if done else None
        if not done:
            if self.kind == "auto" and TAG not in text:
                safe = len(text.rstrip())  # trailing space may turn out to precede a tag (stripped then)
                for k in range(min(len(TAG) - 1, safe), 0, -1):  # hold back a tag's possible beginning
                    if text[:safe].endswith(TAG[:k]):
                        safe = len(text[:safe - k].rstrip())
                        break
                if safe > st["sent"]:
                    out.append({"content": text[st["sent"]:safe]})
                    st["sent"] = safe
            return out, None
        content, calls = self.parse(text)
        if content and len(content) > st["sent"]:
            out.append({"content": content[st["sent"]:]})
        for k, c in enumerate(calls):
            out.append({"tool_calls": [{**_tool_call(c), "index": k}]})
        return out, self.finish_reason(calls, finish_reason)


def _call(c: Any) -> dict[str, str]:
    args = c.get("arguments", c.get("parameters", {})) if isinstance(c, dict) else {}
    return {"name": c.get("name") if isinstance(c, dict) else None,
            "arguments": args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)}


def _tool_call(c: dict[str, str]) -> dict[str, Any]:
    return {"id": f"chatcmpl-tool-{uuid.uuid4().hex}", "type": "function",
            "function": {"name": c["name"], "arguments": c["arguments"]}}
