"""tools / tool_choice on /v1/chat/completions: a live server (tiny model, smollm2-tools template), the
real `openai` client, and the tool-call parser on its own."""

from __future__ import annotations

import json
import shutil
from typing import Literal

import jsonschema
import pytest

from jlora import LLM, compile_stats
from jlora.chat_templates import CHAT_TEMPLATES
from jlora.server.app import build_app
from jlora.server.tools import ToolCalls
from live import KEY, serve_live

# Tools make long prompts (about 300 tokens for the two below): a longer context than the tiny
# checkpoint states, which its RoPE does not mind.
ENGINE = dict(max_model_len=512, max_num_seqs=4, max_num_batched_tokens=128, max_loras=1, max_lora_rank=8,
              token_buckets=(32, 128))
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10},
                                            "unit": {"enum": ["C", "F"]}},
           "required": ["city", "unit"], "additionalProperties": False}
SUM = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99},
                                        "b": {"type": "integer", "minimum": 0, "maximum": 99}},
       "required": ["a", "b"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "add", "description": "Add two numbers", "parameters": SUM}}]
SCHEMA = {"get_weather": WEATHER, "add": SUM}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def live(tiny_dir, tiny_adapters, tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_long")
    for f in tiny_dir[0].iterdir():
        shutil.copy(f, path)
    cfg = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**cfg, "max_position_embeddings": 512}))
    llm = LLM(str(path), progress=False, **ENGINE)
    llm.tokenizer.chat_template = CHAT_TEMPLATES["smollm2-tools"]
    app = build_app(llm, "tiny", lora_modules={"a0": str(tiny_adapters[0])}, api_key=KEY)
    with serve_live(llm, app) as live:
        yield live


def test_the_tools_template_renders_plain_chats_as_the_gguf_template_does():
    from jlora.models import default_model_path
    from jlora.tokenizer import load_gguf_tokenizer

    tok = load_gguf_tokenizer(default_model_path())
    chats = [ASK, [{"role": "system", "content": "Be brief."}, *ASK, {"role": "assistant", "content": "Sunny."},
                   {"role": "user", "content": "And Rome?"}]]
    for chat in chats:
        for gen in (True, False):
            assert (tok.apply_chat_template(chat, add_generation_prompt=gen, tokenize=False,
                                            chat_template=CHAT_TEMPLATES["smollm2-tools"])
                    == tok.apply_chat_template(chat, add_generation_prompt=gen, tokenize=False))


def _stream(client, **kw) -> tuple[str, dict[int, dict], str]:
    """(content, tool calls by index with their arguments joined, finish_reason) of a stream."""
    content, calls, finish = "", {}, None
    for chunk in client.chat.completions.create(**kw, stream=True):
        c = chunk.choices[0]
        content += c.delta.content or ""
        for tc in c.delta.tool_calls or []:
            call = calls.setdefault(tc.index, {"id": None, "name": None, "arguments": ""})
            call["id"] = tc.id or call["id"]
            call["name"] = (tc.function.name if tc.function else None) or call["name"]
            call["arguments"] += (tc.function.arguments or "") if tc.function else ""
        finish = c.finish_reason or finish
    return content, calls, finish


@pytest.mark.parametrize("model", ["tiny", "a0"])
def test_named_tool_choice_gives_arguments_that_obey_the_schema(live, model):
    client = live.client()
    kw = dict(model=model, messages=ASK, tools=TOOLS, max_tokens=60, temperature=0.0,
              tool_choice={"type": "function", "function": {"name": "get_weather"}})
    r = client.chat.completions.create(**kw)
    msg = r.choices[0].message
    assert r.choices[0].finish_reason == "stop" and msg.content is None
    (call,) = msg.tool_calls
    assert call.type == "function" and call.id.startswith("chatcmpl-tool-") and call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER)
    # the model saw the tools: the prompt is the template's rendering with them
    assert r.usage.prompt_tokens == len(live.llm.apply_chat_template(ASK, tools=TOOLS))
    assert r.usage.prompt_tokens > len(live.llm.apply_chat_template(ASK)) + 50
    content, calls, finish = _stream(client, **kw)
    assert content == "" and finish == "stop"
    assert [(c["name"], c["arguments"]) for c in calls.values()] == [("get_weather", call.function.arguments)]


def test_required_tool_choice_gives_calls_among_the_tools(live):
    client = live.client()
    for seed in range(3):
        # parallel_tool_calls=False: one call (left free, the tiny model lists calls until max_tokens)
        kw = dict(model="tiny", messages=ASK, tools=TOOLS, tool_choice="required", max_tokens=80, temperature=0.8,
                  seed=seed, parallel_tool_calls=False)
        r = client.chat.completions.create(**kw)
        choice = r.choices[0]
        assert choice.finish_reason == "tool_calls", choice.message.content
        assert len(choice.message.tool_calls) == 1 and choice.message.content is None
        for call in choice.message.tool_calls:
            jsonschema.validate(json.loads(call.function.arguments), SCHEMA[call.function.name])
        content, calls, finish = _stream(client, **kw)
        assert finish == "tool_calls" and content == ""
        assert [(c["name"], c["arguments"]) for c in calls.values()] == [
            (c.function.name, c.function.arguments) for c in choice.message.tool_calls]


def test_auto_parses_the_models_tool_call_syntax(live):
    client = live.client()
    # The tiny model never writes a tool call by itself; a regex makes it write one, in the SmolLM2
    # format, after some text: what the auto parser must find.
    forced = 'Let me check. <tool_call>[{"name": "get_weather", "arguments": {"city": "Paris", "unit": "C"}}]</tool_call>'
    kw = dict(model="tiny", messages=ASK, tools=TOOLS, max_tokens=60, temperature=0.0,
              extra_body={"guided_regex": forced.replace("[", r"\[").replace("]", r"\]")
                          .replace("{", r"\{").replace("}", r"\}").replace(".", r"\.")})
    r = client.chat.completions.create(**kw)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Let me check."
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris", "unit": "C"}
    content, calls, finish = _stream(client, **kw)
    assert (content, finish) == ("Let me check.", "tool_calls")
    assert [(c["name"], json.loads(c["arguments"])) for c in calls.values()] == [
        ("get_weather", {"city": "Paris", "unit": "C"})]

    # Left alone, it answers in text: the content is all of it, streamed the same.
    free = dict(model="tiny", messages=ASK, tools=TOOLS, tool_choice="auto", max_tokens=12, temperature=0.0,
                extra_body={"ignore_eos": True})
    r = client.chat.completions.create(**free)
    assert r.choices[0].message.tool_calls is None and r.choices[0].finish_reason == "length"
    ids = live.llm.apply_chat_template(ASK, tools=TOOLS)
    ref = live.on_engine(lambda: live.llm.generate([{"prompt_token_ids": ids}], _greedy(12), use_tqdm=False))[0]
    assert r.choices[0].message.content == ref.outputs[0].text
    assert _stream(client, **free) == (ref.outputs[0].text, {}, "length")


def _greedy(n):
    from jlora import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


def test_tool_calls_and_tool_results_in_the_history_render(live):
    history = [*ASK, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                          "arguments": '{"city": "Paris", "unit": "C"}'}}]},
               {"role": "tool", "tool_call_id": "call_1", "content": "21 degrees, sunny"}]
    r = live.client().chat.completions.create(model="tiny", messages=history, tools=TOOLS, max_tokens=4,
                                              temperature=0.0)
    ids = live.llm.apply_chat_template(history, tools=TOOLS)
    assert r.usage.prompt_tokens == len(ids)
    text = live.llm.tokenizer.decode(ids)
    assert ('<tool_call>[{"name": "get_weather", "arguments": {"city": "Paris", "unit": "C"}}]</tool_call>' in text
            and "<tool_response>\n21 degrees, sunny\n</tool_response>" in text)


def _error(resp, status=400) -> dict:
    assert resp.status_code == status, resp.text
    return resp.json()["error"]


def test_bad_tools_are_400s_naming_the_field(live):
    http = live.http()
    body = dict(model="tiny", messages=ASK, max_tokens=4)
    no_name = [{"type": "function", "function": {"parameters": WEATHER}}]
    assert _error(http.post("/v1/chat/completions", json={**body, "tools": no_name}))["param"] == "tools.0.function.name"
    not_object = [TOOLS[0], {"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}]
    assert (_error(http.post("/v1/chat/completions", json={**body, "tools": not_object}))["param"]
            == "tools.1.function.parameters")
    not_a_dict = [{"type": "function", "function": {"name": "f", "parameters": ["x"]}}]
    assert (_error(http.post("/v1/chat/completions", json={**body, "tools": not_a_dict}))["param"]
            == "tools.0.function.parameters")
    bad_schema = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": 3}}}]
    assert (_error(http.post("/v1/chat/completions", json={**body, "tools": bad_schema}))["param"]
            == "tools.0.function.parameters")
    twice = [TOOLS[0], TOOLS[0]]
    assert _error(http.post("/v1/chat/completions", json={**body, "tools": twice}))["param"] == "tools.1.function.name"
    named = {"type": "function", "function": {"name": "nope"}}
    err = _error(http.post("/v1/chat/completions", json={**body, "tools": TOOLS, "tool_choice": named}))
    assert err["param"] == "tool_choice" and "nope" in err["message"]
    assert _error(http.post("/v1/chat/completions", json={**body, "tool_choice": "required"}))["param"] == "tool_choice"
    assert _error(http.post("/v1/chat/completions", json={**body, "tools": TOOLS, "tool_choice": "sometimes"}))[
        "param"] == "tool_choice"
    both = {**body, "tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}
    assert _error(http.post("/v1/chat/completions", json=both))["param"] in ("response_format", "tool_choice")
    # a template that never reads `tools`: 400 naming tools, unless tool_choice is "none"
    tok = live.llm.tokenizer
    tok.chat_template, saved = "{% for m in messages %}{{ m['content'] }}{% endfor %}", tok.chat_template
    try:
        err = _error(http.post("/v1/chat/completions", json={**body, "tools": TOOLS}))
        assert err["param"] == "tools" and "chat template" in err["message"]
        assert http.post("/v1/chat/completions", json={**body, "tools": TOOLS, "tool_choice": "none"}).status_code == 200
    finally:
        tok.chat_template = saved
    assert http.post("/v1/chat/completions", json={**body, "tools": TOOLS}).status_code == 200  # still serving


def test_no_graph_is_compiled_for_tool_requests(live):
    client = live.client()
    client.chat.completions.create(model="tiny", messages=ASK, tools=TOOLS, tool_choice="required", max_tokens=8)
    before = compile_stats.compile_count()
    client.chat.completions.create(model="a0", messages=ASK, tools=TOOLS, max_tokens=8,
                                   tool_choice={"type": "function", "function": {"name": "add"}})
    client.chat.completions.create(model="tiny", messages=ASK, tools=TOOLS, max_tokens=8)
    assert compile_stats.compile_count() == before


@pytest.mark.parametrize("text,content,calls", [
    ('<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>', None, [("f", {"x": 1})]),  # Hermes
    ('Sure.\n<tool_call>[{"name": "f", "arguments": {}}, {"name": "g", "arguments": {"y": "z"}}]</tool_call>', "Sure.",
     [("f", {}), ("g", {"y": "z"})]),  # SmolLM2: a list
    ('<tool_call>{"name": "f", "arguments": {"x": 1}}</tool_call><tool_call>{"name": "g", "parameters": {}}',
     None, [("f", {"x": 1}), ("g", {})]),  # two blocks, the last unclosed; "parameters" as some models write
    ("no calls here", "no calls here", []),
    ("<tool_call>not json</tool_call>", "<tool_call>not json</tool_call>", []),
    ('<tool_call>[{"arguments": {}}]</tool_call>', '<tool_call>[{"arguments": {}}]</tool_call>', []),  # no name
    ("<tool_call>[]</tool_call>", None, []),
])
def test_auto_parser(text, content, calls):
    tc = ToolCalls("auto", [])
    got_content, got = tc.parse(text)
    assert got_content == content
    assert [(c["name"], json.loads(c["arguments"])) for c in got] == calls
    # streamed a character at a time: the same content, and no piece of a tag leaks into it
    streamed, deltas = "", []
    for k in range(1, len(text) + 1):
        out, finish = tc.delta(0, text[:k], k == len(text), "stop")
        deltas += out
    streamed = "".join(d.get("content", "") for d in deltas)
    assert streamed == (content or "")
    assert [(d["tool_calls"][0]["function"]["name"]) for d in deltas if "tool_calls" in d] == [c[0] for c in calls]
    assert finish == ("tool_calls" if calls else "stop")


def test_required_and_named_replies_parse_into_calls():
    required = ToolCalls("required", [])
    text = '[{"name": "f", "arguments": {}}, {"name": "g", "arguments": {"a": 1}}]'
    assert required.parse(text) == (None, [{"name": "f", "arguments": "{}"}, {"name": "g", "arguments": '{"a": 1}'}])
    msg, finish = required.message(text, "stop")
    assert finish == "tool_calls" and [c["function"]["name"] for c in msg["tool_calls"]] == ["f", "g"]
    msg, finish = required.message(text[:20], "length")  # cut short: the text, no calls
    assert (msg, finish) == ({"role": "assistant", "content": text[:20]}, "length")
    msg, finish = ToolCalls("named", [], "f").message('{"x": 1}', "stop")
    assert finish == "stop" and msg["content"] is None and msg["tool_calls"][0]["function"] == {
        "name": "f", "arguments": '{"x": 1}'}


def test_serve_uses_the_tools_template_for_the_default_model_and_takes_names(tiny_dir):
    from jlora.cli import build_parser
    from jlora.server.serve import check_serve_args

    def template(*flags):
        _, sock, text = check_serve_args(build_parser().parse_args(["serve", "--port", "0", *flags]))
        sock.close()
        return text

    assert template() == CHAT_TEMPLATES["smollm2-tools"]
    assert template("--model", str(tiny_dir[0])) is None  # another model keeps its own template
    assert template("--model", str(tiny_dir[0]), "--chat-template", "smollm2-tools") == CHAT_TEMPLATES["smollm2-tools"]
    with pytest.raises(ValueError, match="smollm2-tools"):
        template("--chat-template", "no-such-template")


def test_langchain_structured_output_and_bind_tools(live):
    import httpx
    from langchain_openai import ChatOpenAI
    from pydantic import BaseModel, Field

    class Person(BaseModel):
        name: str = Field(max_length=12)
        age: int = Field(ge=0, le=120)

    class get_weather(BaseModel):  # a tool as LangChain takes it; bounded, so the tiny model finishes it
        """Weather in a city."""

        city: str = Field(max_length=10)
        unit: Literal["C", "F"]

    llm = ChatOpenAI(base_url=live.base_url + "/v1", api_key=KEY, model="a0", temperature=0.0, max_tokens=60,
                     max_retries=0, http_client=httpx.Client(trust_env=False))
    for method in ("json_schema", "function_calling"):  # response_format; a named tool_choice
        person = llm.with_structured_output(Person, method=method).invoke("Describe a person.")
        assert isinstance(person, Person), (method, person)
    # strict: LangChain adds additionalProperties: false (else the tiny model adds keys until max_tokens)
    msg = llm.bind_tools([get_weather], tool_choice="get_weather", strict=True).invoke("What is the weather in Paris?")
    (call,) = msg.tool_calls
    assert call["name"] == "get_weather" and set(call["args"]) == {"city", "unit"}
    msg = llm.bind_tools([get_weather], tool_choice="any", strict=True, parallel_tool_calls=False).invoke("What is the weather in Paris?")  # "required"
    assert msg.tool_calls and all(c["name"] == "get_weather" for c in msg.tool_calls)
