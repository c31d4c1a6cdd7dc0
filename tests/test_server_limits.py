"""What `jlora serve` bounds, live on 127.0.0.1 with small limits: the waiting queue (429), the body
size (413), n, prompt bytes, a chat's default max_tokens, /metrics behind the key when asked, the
served OpenAPI schema, /health on a stuck engine thread, an engine failure in one request, and a
shutdown that ends even when the engine thread is wedged."""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest

import jlora.engine.runner as runner_module
from jlora import LLM
from jlora.server.app import build_app
from live import KEY, serve_live

ENGINE = dict(max_model_len=128, max_num_seqs=4, max_num_batched_tokens=32, max_loras=2, max_lora_rank=8,
              token_buckets=(16, 32), max_n=4, max_waiting_seqs=8)
MAX_BYTES = 64 * 1024
CULPRIT_SEED = 777777


@pytest.fixture(scope="module")
def live(tiny_dir, tiny_adapters):
    llm = LLM(str(tiny_dir[0]), progress=False, **ENGINE)
    app = build_app(llm, "tiny", lora_modules={"a0": str(tiny_adapters[0])}, api_key=KEY, metrics_auth=True,
                    default_max_tokens=5, max_request_bytes=MAX_BYTES, health_stall_timeout=1.0)
    with serve_live(llm, app) as live:
        yield live


def _error(resp: httpx.Response, status: int) -> dict:
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    return err


def test_a_full_queue_is_429_with_retry_after_and_health_sees_the_stuck_thread(live):
    body = {"model": "tiny", "prompt": "Hello", "max_tokens": 2, "n": 4, "temperature": 0.0}
    results: dict[int, httpx.Response] = {}

    def send(i: int) -> None:
        with live.http() as http:
            results[i] = http.post("/v1/completions", json=body)

    live.srv.engine.call(lambda: time.sleep(2.5))  # the engine thread is busy: requests pile up behind it
    threads = [threading.Thread(target=send, args=(i,)) for i in range(3)]
    for t in threads:
        t.start()
        time.sleep(0.2)  # in order, so the third finds 8 waiting
    time.sleep(1.2)
    assert httpx.get(live.base_url + "/health", trust_env=False).status_code == 503  # no progress for > 1 s
    for t in threads:
        t.join(60)
    assert [results[i].status_code for i in range(3)] == [200, 200, 429]
    err = _error(results[2], 429)
    assert err["code"] == "queue_full" and "max_waiting_seqs=8" in err["message"]
    assert results[2].headers["retry-after"] == "1"
    assert all(c["finish_reason"] == "length" for i in (0, 1) for c in results[i].json()["choices"])
    assert httpx.get(live.base_url + "/health", trust_env=False).status_code == 200
    live.wait_idle()


def test_requests_that_can_never_fit_are_400(live):
    with live.http() as http:
        err = _error(http.post("/v1/completions", json={"model": "tiny", "prompt": "x", "n": 5}), 400)
        assert err["param"] == "n" and "max_n=4" in err["message"]
        err = _error(http.post("/v1/completions", json={"model": "tiny", "prompt": ["a", "b", "c"], "n": 4}), 400)
        assert err["param"] == "n" and "--max-waiting-seqs=8" in err["message"]
        huge = "word " * (live.srv.max_prompt_bytes // 5 + 1)  # more bytes than 128 tokens can be
        assert len(huge.encode()) < MAX_BYTES
        t0 = time.monotonic()
        err = _error(http.post("/v1/completions", json={"model": "tiny", "prompt": huge}), 400)
        assert err["param"] == "prompt" and time.monotonic() - t0 < 5
        err = _error(http.post("/v1/chat/completions",
                               json={"model": "tiny", "messages": [{"role": "user", "content": huge}]}), 400)
        assert err["param"] == "messages"


def test_a_body_over_the_limit_is_413_by_length_or_by_chunks(live):
    big = json.dumps({"model": "tiny", "prompt": "x" * MAX_BYTES}).encode()
    with live.http() as http:
        err = _error(http.post("/v1/completions", content=big, headers={"Content-Type": "application/json"}), 413)
        assert "--max-request-bytes" in err["message"]

        def chunks():  # no Content-Length: counted as it arrives
            for i in range(0, len(big), 4096):
                yield big[i: i + 4096]

        _error(http.post("/v1/completions", content=chunks(), headers={"Content-Type": "application/json"}), 413)
        assert http.post("/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": 1}).status_code == 200


def test_chat_without_max_tokens_gets_the_server_default(live):
    with live.http() as http:
        r = http.post("/v1/chat/completions", json={"model": "tiny", "messages": [{"role": "user", "content": "hi"}],
                                                    "ignore_eos": True})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 5 and r.json()["choices"][0]["finish_reason"] == "length"


def test_metrics_need_the_key_with_metrics_auth_and_the_schema_is_served(live):
    _error(httpx.get(live.base_url + "/metrics", trust_env=False), 401)
    assert live.http().get("/metrics").status_code == 200
    assert httpx.get(live.base_url + "/health", trust_env=False).status_code == 200
    assert httpx.get(live.base_url + "/docs", trust_env=False).status_code == 200
    schema = httpx.get(live.base_url + "/openapi.json", trust_env=False).json()
    props = schema["components"]["schemas"]["CompletionRequest"]["properties"]
    chat = schema["components"]["schemas"]["ChatCompletionRequest"]["properties"]

    def maximum(prop: dict) -> int:
        return min(s["maximum"] for s in prop.get("anyOf", [prop]) if "maximum" in s)

    vocab = live.llm.model.cfg.vocab_size
    assert maximum(props["n"]) == 4 and maximum(chat["n"]) == 4
    assert maximum(props["max_tokens"]) == 127 and maximum(chat["max_completion_tokens"]) == 127
    assert maximum(props["top_k"]) == vocab
    assert props["temperature"]["anyOf"][0] == {"type": "number", "minimum": 0.0, "maximum": 100.0}
    assert chat["logprobs"]["type"] == "boolean"
    op = schema["paths"]["/v1/completions"]["post"]["responses"]
    assert {"200", "400", "404", "413", "429"} <= set(op) and "422" not in op


def test_an_engine_failure_fails_that_request_alone_and_the_stream_beside_it_is_exact(live, monkeypatch):
    ok = {"model": "a0", "prompt": "Once upon a time", "max_tokens": 30, "temperature": 0.0, "ignore_eos": True}
    with live.http() as http:
        ref = http.post("/v1/completions", json=ok).json()["choices"][0]["text"]
    real = runner_module.fill_sampling_row

    def fill(batch, b, row):  # runs on the engine thread
        if row.seed == CULPRIT_SEED and len(row.output_ids) >= 2:
            raise OverflowError("injected row failure")
        return real(batch, b, row)

    monkeypatch.setattr(runner_module, "fill_sampling_row", fill)
    bad = {"model": "tiny", "prompt": "Hello", "max_tokens": 20, "seed": CULPRIT_SEED, "ignore_eos": True}
    with live.http() as http, live.http() as other:
        with http.stream("POST", "/v1/completions", json={**ok, "stream": True}) as bystander:
            lines = bystander.iter_lines()
            first = next(line for line in lines if line.startswith("data: {"))
            err = _error(other.post("/v1/completions", json=bad), 500)
            assert err["code"] == "engine_error" and "injected row failure" in err["message"]
            with other.stream("POST", "/v1/completions", json={**bad, "stream": True}) as culprit:
                events = [line for line in culprit.iter_lines() if line.startswith("data: ")]
            text = "".join(json.loads(line[6:])["choices"][0]["text"] for line in [first, *lines]
                           if line.startswith("data: {"))
    assert text == ref
    assert events[-1] == "data: [DONE]" and "injected row failure" in json.loads(events[-2][6:])["error"]["message"]
    assert json.loads(events[-3][6:])["choices"][0]["finish_reason"] == "error"
    live.wait_idle()


def test_shutdown_ends_even_when_the_engine_thread_is_wedged(live):
    """Runs last: it stops this module's server. A step that never returns must not keep the process."""
    live.srv.engine.call(lambda: time.sleep(30))
    time.sleep(0.2)
    t0 = time.monotonic()
    live.server.should_exit = True
    live.thread.join(30)
    assert not live.thread.is_alive() and time.monotonic() - t0 < 5 + 5 + 3  # grace (5) + 5 s + a little
    assert live.app.state.stopped_cleanly is False
