"""The server under requests that are large or that break something, live on 127.0.0.1 with the tiny
model: work bounded before it is done (413 for a body, 400 for a prompt list, both before any
tokenizing), templating and tokenizing off the event loop (a slow one does not stall a stream
beside it), and an exception on the engine thread outside a step's own isolation failing only the
request it was handling while the engine thread keeps serving."""

from __future__ import annotations

import json
import threading
import time
import types

import httpx
import openai
import pytest

from jlora import LLM
from jlora.server.app import build_app
from live import KEY, serve_live

ENGINE = dict(max_model_len=128, max_num_seqs=4, max_num_batched_tokens=32, max_loras=2, max_lora_rank=8,
              token_buckets=(16, 32), max_n=4, max_waiting_seqs=64)
MAX_BYTES = 64 * 1024
MAX_PROMPTS = 8
MAX_MESSAGES = 8  # (a conversation of 8 short turns fits max_model_len=128 with the default system prompt)
CULPRIT_SEED = 424242
SLOW_S = 0.3  # per prompt marked SLOW


@pytest.fixture(scope="module")
def live(tiny_dir, tiny_adapters):
    llm = LLM(str(tiny_dir[0]), progress=False, **ENGINE)
    app = build_app(llm, "tiny", lora_modules={"a0": str(tiny_adapters[0])}, api_key=KEY,
                    max_request_bytes=MAX_BYTES, max_prompts=MAX_PROMPTS, max_messages=MAX_MESSAGES)
    with serve_live(llm, app) as live:
        yield live


@pytest.fixture
def encodes(live, monkeypatch):
    """Each tokenizer.encode call's (start, end, text); a prompt starting with SLOW takes SLOW_S more."""
    tok = live.llm.tokenizer
    real, calls = tok.encode, []

    def encode(text, *a, **kw):
        t0 = time.monotonic()
        if isinstance(text, str) and text.startswith("SLOW"):
            time.sleep(SLOW_S)
        ids = real(text, *a, **kw)
        calls.append((t0, time.monotonic(), text))
        return ids

    monkeypatch.setattr(tok, "encode", encode)
    return calls


def _error(resp: httpx.Response, status: int, param: str | None) -> dict:
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["param"] == param
    return err


def test_a_body_over_the_limit_is_413_naming_the_body(live):
    big = json.dumps({"model": "tiny", "prompt": ["word " * 1000] * 20}).encode()
    assert len(big) > MAX_BYTES
    with live.http() as http:
        err = _error(http.post("/v1/completions", content=big, headers={"Content-Type": "application/json"}),
                     413, "body")
        assert f"{MAX_BYTES}" in err["message"] and "--max-request-bytes" in err["message"]
        assert http.post("/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": 1}).status_code == 200


def test_too_many_prompts_is_400_naming_the_field_before_any_is_tokenized(live, encodes):
    body = {"model": "tiny", "prompt": [f"SLOW prompt {i}" for i in range(MAX_PROMPTS + 1)], "max_tokens": 1}
    with live.http() as http:
        t0 = time.monotonic()
        err = _error(http.post("/v1/completions", json=body), 400, "prompt")
        assert time.monotonic() - t0 < MAX_PROMPTS * SLOW_S
        assert f"{MAX_PROMPTS + 1} prompts" in err["message"] and "--max-prompts-per-request" in err["message"]
        token_lists = {**body, "prompt": [[1, 2, 3]] * (MAX_PROMPTS + 1)}
        _error(http.post("/v1/completions", json=token_lists), 400, "prompt")
        assert encodes == []
        ok = http.post("/v1/completions", json={**body, "prompt": body["prompt"][:2]})
        assert ok.status_code == 200 and len(ok.json()["choices"]) == 2
    live.wait_idle()


@pytest.fixture
def templated(live, monkeypatch):
    """The message lists the chat template rendered (LLM.apply_chat_template's calls)."""
    llm, calls = live.llm, []
    real = llm.apply_chat_template

    def apply_chat_template(messages, *a, **kw):
        calls.append(len(messages))
        return real(messages, *a, **kw)

    monkeypatch.setattr(llm, "apply_chat_template", apply_chat_template)
    return calls


def _conversation(n: int) -> list[dict]:
    return [{"role": "user" if i % 2 == 0 else "assistant", "content": str(i)} for i in range(n)]


def test_too_many_chat_messages_is_400_naming_the_field_before_templating(live, templated):
    client = live.client()
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="a0", messages=_conversation(MAX_MESSAGES + 1), max_tokens=2)
    err = e.value.body
    assert err["param"] == "messages", err
    assert f"{MAX_MESSAGES + 1} messages" in err["message"] and "--max-messages-per-request" in err["message"]
    with pytest.raises(openai.BadRequestError) as e:  # streaming: refused before the stream starts
        client.chat.completions.create(model="tiny", messages=_conversation(1000), max_tokens=2, stream=True)
    assert e.value.body["param"] == "messages" and "1000 messages" in e.value.body["message"]
    with live.http() as http:  # /tokenize renders messages through the same template
        _error(http.post("/tokenize", json={"model": "tiny", "messages": _conversation(MAX_MESSAGES + 1)}),
               400, "messages")
    assert templated == []
    # At the limit: served, and the template saw every message.
    ok = client.chat.completions.create(model="a0", messages=_conversation(MAX_MESSAGES), max_tokens=2,
                                        temperature=0.0)
    assert ok.choices[0].finish_reason == "length" and ok.usage.completion_tokens == 2
    assert templated == [MAX_MESSAGES]
    with live.http() as http:
        schema = http.get("/openapi.json").json()["components"]["schemas"]
    assert schema["ChatCompletionRequest"]["properties"]["messages"]["maxItems"] == MAX_MESSAGES
    assert [v.get("maxItems") for v in schema["TokenizeRequest"]["properties"]["messages"]["anyOf"]
            if v.get("type") == "array"] == [MAX_MESSAGES]
    live.wait_idle()


def test_serve_takes_the_message_limit_as_a_flag(monkeypatch, capsys):
    import jlora
    from jlora.cli import main
    from jlora.server import app as app_module

    assert main(["serve", "--max-messages-per-request", "0", "--port", "0"]) == 2
    assert "--max-messages-per-request must be >= 1" in capsys.readouterr().err
    seen = {}

    class Built(Exception):
        pass

    def build_app(llm, model_id, **kw):
        seen.update(kw)
        raise Built

    monkeypatch.setattr(jlora, "LLM", lambda *a, **kw: types.SimpleNamespace(tokenizer=types.SimpleNamespace()))
    monkeypatch.setattr(app_module, "build_app", build_app)
    with pytest.raises(Built):
        main(["serve", "--max-messages-per-request", "7", "--port", "0"])
    assert seen["max_messages"] == 7


def test_a_slow_tokenization_does_not_stall_a_stream_beside_it(live, encodes):
    """8 prompts that take SLOW_S each to tokenize (2.4 s) while a stream runs: on the event loop
    they would hold every chunk of the stream for that long."""
    slow = {"model": "tiny", "prompt": [f"SLOW {i} once upon a time" for i in range(MAX_PROMPTS)], "max_tokens": 2,
            "temperature": 0.0}
    stream = {"model": "a0", "prompt": "Once upon a time", "max_tokens": 40, "temperature": 0.0, "ignore_eos": True,
              "stream": True}
    result = {}

    def send_slow() -> None:
        with live.http() as http:
            result["slow"] = http.post("/v1/completions", json=slow)

    big = threading.Thread(target=send_slow)
    with live.http() as http:
        big.start()
        deadline = time.monotonic() + 10
        while not any(t.startswith("SLOW") for _, _, t in encodes):  # the first slow prompt is done
            assert time.monotonic() < deadline
            time.sleep(0.01)
        arrivals = []
        t_sent = time.monotonic()
        with http.stream("POST", "/v1/completions", json=stream) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    arrivals.append(time.monotonic())
    big.join(60)
    assert result["slow"].status_code == 200 and len(result["slow"].json()["choices"]) == MAX_PROMPTS
    slow_done = max(end for _, end, t in encodes if t.startswith("SLOW"))
    gaps = [b - a for a, b in zip([t_sent, *arrivals], arrivals)]
    assert len(arrivals) >= 10
    assert arrivals[0] < slow_done, "the stream's first chunk waited for the other request's tokenization"
    assert max(gaps) < 1.0, f"a {max(gaps):.2f} s gap between chunks (tokenizing takes {MAX_PROMPTS * SLOW_S} s)"
    live.wait_idle()


def _reference(live) -> tuple[dict, str]:
    ok = {"model": "a0", "prompt": "Once upon a time", "max_tokens": 30, "temperature": 0.0, "ignore_eos": True}
    with live.http() as http:
        return ok, http.post("/v1/completions", json=ok).json()["choices"][0]["text"]


def _bystander_and_culprit(live, ok: dict, bad: dict) -> tuple[str, httpx.Response]:
    """A stream of `ok` running while `bad` is sent whole: the stream's text and `bad`'s reply."""
    with live.http() as http, live.http() as other:
        with http.stream("POST", "/v1/completions", json={**ok, "stream": True}) as bystander:
            lines = bystander.iter_lines()
            first = next(line for line in lines if line.startswith("data: {"))
            culprit = other.post("/v1/completions", json=bad)
            text = "".join(json.loads(line[6:])["choices"][0]["text"] for line in [first, *lines]
                           if line.startswith("data: {"))
    return text, culprit


def _still_serving(live) -> None:
    assert live.srv.engine.alive
    with live.http() as http:
        r = http.post("/v1/completions", json={"model": "tiny", "prompt": "Hello", "max_tokens": 3})
    assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "length"
    assert httpx.get(live.base_url + "/health", trust_env=False).status_code == 200
    live.wait_idle()


def test_a_failure_handing_one_request_its_output_fails_it_alone(live, monkeypatch):
    ok, ref = _reference(live)
    eng = live.llm.engine
    real = eng.stream_deltas

    def stream_deltas(rid):  # on the engine thread, after the step
        if eng.requests[rid].params.seed == CULPRIT_SEED:
            raise KeyError("injected delivery failure")
        return real(rid)

    monkeypatch.setattr(eng, "stream_deltas", stream_deltas)
    bad = {"model": "tiny", "prompt": "Hello", "max_tokens": 20, "seed": CULPRIT_SEED, "ignore_eos": True}
    text, culprit = _bystander_and_culprit(live, ok, bad)
    assert text == ref
    err = _error(culprit, 500, None)
    assert err["code"] == "engine_error" and "injected delivery failure" in err["message"]
    monkeypatch.undo()
    _still_serving(live)


def test_a_step_that_raises_in_the_scheduler_fails_the_request_it_was_admitting(live, monkeypatch):
    ok, ref = _reference(live)
    sched = live.llm.engine.scheduler
    real = sched._cached_prefix

    def cached_prefix(seq):  # inside LLMEngine.step, outside its isolation (admission)
        if seq.params.seed == CULPRIT_SEED:
            raise RuntimeError("injected scheduler failure")
        return real(seq)

    monkeypatch.setattr(sched, "_cached_prefix", cached_prefix)
    bad = {"model": "tiny", "prompt": "Hello", "max_tokens": 20, "seed": CULPRIT_SEED, "ignore_eos": True}
    text, culprit = _bystander_and_culprit(live, ok, bad)
    assert text == ref
    err = _error(culprit, 500, None)
    assert err["code"] == "engine_error" and "injected scheduler failure" in err["message"]
    with live.http() as http:  # streamed, the failure ends the stream with an error event and [DONE]
        with http.stream("POST", "/v1/completions", json={**bad, "stream": True}) as r:
            events = [line for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]" and "injected scheduler failure" in events[-2]
    monkeypatch.undo()
    _still_serving(live)


def test_steps_that_keep_raising_with_no_culprit_fail_the_running_requests_and_the_thread_goes_on(live, monkeypatch):
    eng = live.llm.engine
    real, raised = eng.step, []

    def step(*a, **kw):
        if len(raised) < 2:
            raised.append(1)
            raise RuntimeError("injected step failure")
        return real(*a, **kw)

    monkeypatch.setattr(eng, "step", step)
    with live.http() as http:
        err = _error(http.post("/v1/completions", json={"model": "tiny", "prompt": "Hi", "max_tokens": 4}), 500, None)
    assert "injected step failure" in err["message"]
    monkeypatch.undo()
    _still_serving(live)
