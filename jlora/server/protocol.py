"""Request bodies of the OpenAI API as vLLM accepts them (pydantic), and the OpenAI error object.

Every bound comes from `jlora.sampling_params.BOUNDS`, so `/openapi.json` states what is accepted
and a value out of range is a 400 naming its field before anything is queued. Types are strict
(no "5" for 5, no 0 for false); an int is accepted where a number is. Bounds that depend on the
server (`n` up to `--max-n`, `max_tokens` up to the context) are written into the served schema by
`jlora.server.app` and checked per request.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, StrictBool, StrictInt

from jlora.adapters.request import MAX_LORA_SCALE
from jlora.chat_templates import ROLES
from jlora.sampling_params import (
    BOUNDS, INT32_MAX, MAX_BANNED, MAX_LOGIT_BIAS, MAX_STOP_CHARS, MAX_STOP_STRINGS, OPEN_LOW,
)


def _utf8(s: str) -> str:
    try:
        s.encode("utf-8")
    except UnicodeEncodeError as e:  # a lone surrogate such as "\ud800" from a JSON escape
        raise ValueError(f"must be valid UTF-8 text (no lone surrogates; {e.reason} at {e.start})") from None
    return s


Text = Annotated[str, AfterValidator(_utf8)]
TokenId = Annotated[StrictInt, Field(ge=0, le=INT32_MAX)]


def _bounded(name: str, integral: bool = False) -> Any:
    lo, hi = BOUNDS[name]
    low = {"gt": lo} if name in OPEN_LOW else {"ge": lo}
    if integral:
        return Annotated[StrictInt, Field(le=hi, **low)]
    return Annotated[float, Field(le=hi, allow_inf_nan=False, **low)]


class _Body(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)  # unknown fields are ignored, as OpenAI and vLLM do


class StreamOptions(_Body):
    include_usage: StrictBool = False


class JSONSchemaFormat(_Body):
    name: Text | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: StrictBool | None = None
    description: Text | None = None


class ResponseFormat(_Body):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None


StopField = Text | Annotated[list[Annotated[Text, Field(min_length=1, max_length=MAX_STOP_CHARS)]],
                             Field(max_length=MAX_STOP_STRINGS)]


LoRAWeight = Annotated[float, Field(ge=-MAX_LORA_SCALE, le=MAX_LORA_SCALE, allow_inf_nan=False)]


class _SamplingFields(_Body):
    model: Text | None = None  # None: the base model (as vLLM does)
    max_tokens: _bounded("max_tokens", True) | None = None
    temperature: _bounded("temperature") | None = None  # None = 1.0, OpenAI's default
    top_p: _bounded("top_p") | None = None
    n: _bounded("n", True) = 1
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    stop: StopField | None = None
    seed: _bounded("seed", True) | None = None
    presence_penalty: _bounded("presence_penalty") | None = None
    frequency_penalty: _bounded("frequency_penalty") | None = None
    logit_bias: Annotated[dict[str, Annotated[float, Field(ge=-100, le=100, allow_inf_nan=False)]],
                          Field(max_length=MAX_LOGIT_BIAS)] | None = None  # token id (as a string) -> bias
    user: Text | None = None
    response_format: ResponseFormat | None = None  # only "text" (the default) is served
    # vLLM's extra sampling fields
    top_k: _bounded("top_k", True) | None = None
    min_p: _bounded("min_p") | None = None
    min_tokens: _bounded("min_tokens", True) = 0
    repetition_penalty: _bounded("repetition_penalty") | None = None
    ignore_eos: StrictBool = False
    stop_token_ids: Annotated[list[TokenId], Field(max_length=MAX_BANNED - 1)] | None = None
    return_tokens_as_token_ids: StrictBool = False  # logprobs name tokens "token_id:<id>" (vLLM's field)
    # vLLM's structured output fields (extra_body): one of them, or response_format
    structured_outputs: dict[str, Any] | None = None  # {"json" | "regex" | "choice" | "grammar" | "json_object": ...}
    guided_json: dict[str, Any] | Text | None = None
    guided_regex: Text | None = None
    guided_choice: list[Text] | None = None
    guided_grammar: Text | None = None
    # jlora's LoRA fields (extra_body; docs/engine.md): `lora_scale` multiplies the delta of the adapter
    # `model` names, for this request only; `lora_combine` ({adapter name: weight}, `model` = the base
    # model) uses several loaded adapters at once, their deltas weighted (peft's "cat" combination).
    lora_scale: LoRAWeight | None = None
    lora_combine: Annotated[dict[Text, LoRAWeight], Field(min_length=1, max_length=64)] | None = None


class CompletionRequest(_SamplingFields):
    prompt: Text | list[Text] | list[TokenId] | list[list[TokenId]]
    # OpenAI's default for completions; 0 only with echo (the prompt's logprobs, as lm-eval asks)
    max_tokens: Annotated[StrictInt, Field(ge=0, le=BOUNDS["max_tokens"][1])] | None = 16
    logprobs: _bounded("logprobs", True) | None = None
    echo: StrictBool = False
    suffix: Text | None = None
    best_of: _bounded("n", True) | None = None


class FunctionCall(_Body):
    name: Text
    arguments: Text | dict[str, Any] = "{}"  # OpenAI sends the JSON text; some clients send the object


class ToolCall(_Body):
    id: Text | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Body):
    role: Literal[ROLES]  # OpenAI's roles: a typo such as "usr" is a 400 naming messages.N.role
    content: Text | list[dict[str, Any]] | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant turn that called tools
    tool_call_id: Text | None = None  # a "tool" turn: the call it answers
    name: Text | None = None


class FunctionDefinition(_Body):
    name: Annotated[Text, Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$")]
    description: Text | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of type object; None = no arguments
    strict: StrictBool | None = None


class Tool(_Body):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Body):
    name: Text


class NamedToolChoice(_Body):
    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: _bounded("max_tokens", True) | None = None
    logprobs: StrictBool = False
    top_logprobs: _bounded("logprobs", True) | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None  # None: "auto" with tools
    parallel_tool_calls: StrictBool | None = None  # False: "required" gives exactly one call


class LoadLoRAAdapterRequest(_Body):
    lora_name: Text
    lora_path: Text


class UnloadLoRAAdapterRequest(_Body):
    lora_name: Text


class TokenizeRequest(_Body):
    """vLLM's /tokenize: a completion prompt, or chat messages through the chat template."""

    model: Text | None = None
    prompt: Text | None = None
    messages: Annotated[list[ChatMessage], Field(min_length=1)] | None = None
    add_special_tokens: StrictBool = True
    add_generation_prompt: StrictBool = True


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(_Body):
    model: Text | None = None
    tokens: list[TokenId]


class DetokenizeResponse(BaseModel):
    prompt: str


class VersionResponse(BaseModel):
    version: str


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    """The OpenAI error object every 4xx/5xx carries (documented in /openapi.json)."""

    error: ErrorDetail


ERROR_TYPES = {400: "invalid_request_error", 401: "invalid_request_error", 404: "invalid_request_error",
               405: "invalid_request_error", 413: "invalid_request_error", 429: "rate_limit_error",
               503: "server_error", 500: "server_error"}


class APIError(ValueError):
    """An error a client caused (or a server state it should know about), as an OpenAI error object."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = headers

    def body(self) -> dict[str, Any]:
        return error_body(self.status, self.message, self.param, self.code)


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": ERROR_TYPES.get(status, "invalid_request_error"),
                      "param": param, "code": code}}
