"""Races and pressure under `jlora serve`, live on 127.0.0.1 with the tiny model and the real clients:
two concurrent runtime loads of one adapter name, a client that leaves while its adapter converts, KV
exhaustion with preemption, and an exception inside a step."""

from __future__ import annotations

import json
import os
import queue
import shutil
import threading
import time
from pathlib import Path

import httpx
import pytest

from jlora import LLM
from jlora.server.app import build_app
from live import KEY, serve_live

# num_kv_blocks=9: 144 positions, while one sequence may take 128 (8 blocks), so two long ones cannot
# both run to their end without a preemption.
ENGINE = dict(max_model_len=128, max_num_seqs=4, max_num_batched_tokens=32, max_loras=2, max_lora_rank=8,
              token_buckets=(16, 32), num_kv_blocks=9)
PROMPTS = ["Hello there", "Once upon a time", "1 2 3 4", "The quick brown fox"]


@pytest.fixture(scope="module")
def lora_root(tiny_adapters, tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("race_root")
    for name, i in (("dup", 8), ("conv", 9), ("boom", 10)):
        shutil.copytree(tiny_adapters[i], root / name)
    return root


@pytest.fixture(scope="module")
def live(tiny_dir, tiny_adapters, lora_root):
    llm = LLM(str(tiny_dir[0]), progress=False, adapter_cache=False, **ENGINE)
    app = build_app(llm, "tiny", lora_modules={"a0": str(tiny_adapters[0])}, api_key=KEY,
                    enable_runtime_lora_updating=True, lora_root=lora_root)
    with serve_live(llm, app) as live:
        yield live


def _metric(live, name: str) -> float:
    text = live.http().get("/metrics").text
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name))


def _hold_conversions(live, monkeypatch) -> tuple[threading.Event, threading.Event, list[str]]:
    """Every adapter read (conversion or disk-cache read) waits for `gate`; `started` is set by the first."""
    gate, started, names = threading.Event(), threading.Event(), []
    mgr = live.llm.engine.adapters
    real = mgr.host.read_source

    def held_read(version, req):
        names.append(req.lora_name)
        started.set()
        assert gate.wait(60)
        return real(version, req)

    monkeypatch.setattr(mgr.host, "read_source", held_read)
    return gate, started, names


def _greedy(model: str, prompt: str, max_tokens: int) -> dict:
    return {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True}


def test_two_concurrent_loads_of_one_name_one_wins_and_the_adapter_is_served_once(live, monkeypatch):
    """As vLLM: loading a name that is loaded is a 400 ("has already been loaded"). Two loads that overlap
    are serialized per name: one converts and wins, the other gets that 400 and changes nothing (it
    converts nothing, so the winner's converted copy is the one requests use)."""
    gate, started, names = _hold_conversions(live, monkeypatch)
    mgr = live.llm.engine.adapters
    loads_before = mgr.stats["disk_loads"]
    results: queue.Queue = queue.Queue()

    def load() -> None:
        with live.http() as http:
            results.put(http.post("/v1/load_lora_adapter", json={"lora_name": "dup", "lora_path": "dup"}))

    threads = [threading.Thread(target=load) for _ in range(2)]
    for t in threads:
        t.start()
    try:
        assert started.wait(30)
        time.sleep(0.5)  # both requests are at the server now
        assert all(t.is_alive() for t in threads) and results.empty()  # neither answered while converting
    finally:
        gate.set()
        for t in threads:
            t.join(60)
    got = sorted((r.status_code, r.text) for r in (results.get_nowait(), results.get_nowait()))
    assert got[0] == (200, "Success: LoRA adapter 'dup' added successfully.")
    assert got[1][0] == 400 and json.loads(got[1][1])["error"]["message"] == \
        "The lora adapter 'dup' has already been loaded."
    assert names == ["dup"]  # the loser converted nothing
    assert [m.id for m in live.client().models.list().data].count("dup") == 1

    ref = live.offline([PROMPTS[1]], "dup", 12)[0].outputs[0].text
    with live.http() as http:
        assert http.post("/v1/completions", json=_greedy("dup", PROMPTS[1], 12)).json()["choices"][0]["text"] == ref
        assert http.post("/v1/unload_lora_adapter", json={"lora_name": "dup"}).status_code == 200
    assert mgr.stats["disk_loads"] - loads_before == 1  # one conversion, used by every request since
    live.wait_idle()


@pytest.mark.parametrize("stream", [False, True])
def test_a_client_that_leaves_while_its_adapter_converts_is_aborted_and_leaks_nothing(live, monkeypatch, lora_root,
                                                                                      stream):
    """The adapter's files changed, so the request's new version converts (held here); the client gives
    up meanwhile. Its request never runs to its end, nothing stays in the engine, the next one is served."""
    with live.http() as http:
        assert http.post("/v1/load_lora_adapter", json={"lora_name": "conv", "lora_path": "conv"}).status_code == 200
    weights = lora_root / "conv" / "adapter_model.safetensors"
    st = os.stat(weights)
    os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))  # a new version: converts on the next request
    live.wait_idle()
    done_before = _metric(live, 'jlora_requests_total{status="length"}')
    aborted_before = _metric(live, 'jlora_requests_total{status="abort"}')
    tokens_before = _metric(live, "jlora_generation_tokens_total")
    gate, started, names = _hold_conversions(live, monkeypatch)
    body = {**_greedy("conv", PROMPTS[2], 100), "stream": stream}
    try:
        with live.http(timeout=httpx.Timeout(60, read=1.0)) as http:  # hangs up after 1 s without a byte
            with pytest.raises(httpx.ReadTimeout):
                http.post("/v1/completions", json=body)
        assert started.is_set() and names == ["conv"]
        assert live.on_engine(lambda: not live.llm.engine.requests)  # nothing queued while it converts
    finally:
        gate.set()
    time.sleep(1.0)  # the conversion ends; the server finds its client gone
    live.wait_idle()
    st = live.on_engine(lambda: live.llm.engine.stats())
    assert (st.running, st.waiting) == (0, 0)
    assert _metric(live, 'jlora_requests_total{status="length"}') == done_before  # it did not run to its end
    assert _metric(live, 'jlora_requests_total{status="abort"}') == aborted_before + 1
    assert _metric(live, "jlora_generation_tokens_total") - tokens_before < 100
    ref = live.offline([PROMPTS[2]], "conv", 8)[0].outputs[0].text
    with live.http() as http:
        assert http.post("/v1/completions", json=_greedy("conv", PROMPTS[2], 8)).json()["choices"][0]["text"] == ref
        assert http.post("/v1/unload_lora_adapter", json={"lora_name": "conv"}).status_code == 200
    live.wait_idle()


def test_kv_exhaustion_preempts_and_every_request_completes_exactly(live):
    """Four requests of 100 new tokens each in 9 KV blocks (one alone needs 7): the engine preempts
    (the metric counts it) and every reply has its 100 tokens, equal to the request run alone."""
    jobs = [(PROMPTS[i], "a0" if i % 2 else "tiny") for i in range(4)]
    refs = [live.offline([p], None if m == "tiny" else m, 100)[0].outputs[0].text for p, m in jobs]
    live.wait_idle()
    preempted = _metric(live, "jlora_num_preemptions_total")
    results: dict[int, object] = {}

    def run(i: int) -> None:
        p, m = jobs[i]
        results[i] = live.client().completions.create(model=m, prompt=p, max_tokens=100, temperature=0.0,
                                                      extra_body={"ignore_eos": True})

    threads = [threading.Thread(target=run, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert sorted(results) == [0, 1, 2, 3]
    for i, ref in enumerate(refs):
        c = results[i]
        assert (c.usage.completion_tokens, c.choices[0].finish_reason) == (100, "length"), i
        assert c.choices[0].text == ref, i
    assert _metric(live, "jlora_num_preemptions_total") > preempted
    live.wait_idle()


def test_an_exception_inside_a_step_fails_every_request_in_flight_and_the_server_goes_on(live, monkeypatch):
    """A step that raises outside the engine's own isolation (here: once, in `LLMEngine.step`): every
    request then in flight, whole or streamed, gets an error reply; later requests are served."""
    eng = live.llm.engine
    real, armed, raised = eng.step, threading.Event(), threading.Event()

    def step(*args, **kwargs):  # LLMEngine.step's own arguments (finished_only) pass through
        if armed.is_set() and eng.stats().running >= 3:
            armed.clear()
            raised.set()
            raise RuntimeError("injected step failure")
        return real(*args, **kwargs)

    monkeypatch.setattr(eng, "step", step)
    live.wait_idle()
    armed.set()
    whole: dict[int, httpx.Response] = {}

    def post(i: int) -> None:
        with live.http() as http:
            whole[i] = http.post("/v1/completions", json=_greedy("a0" if i else "tiny", PROMPTS[i], 100))

    threads = [threading.Thread(target=post, args=(i,)) for i in range(2)]
    with live.http() as http:
        with http.stream("POST", "/v1/completions", json={**_greedy("tiny", PROMPTS[3], 100), "stream": True}) as r:
            for t in threads:
                t.start()
            events = [line for line in r.iter_lines() if line.startswith("data: ")]
        for t in threads:
            t.join(60)
    assert raised.is_set()
    for i, resp in whole.items():
        assert resp.status_code == 500, (i, resp.text)
        err = resp.json()["error"]
        assert err["code"] == "engine_error" and "injected step failure" in err["message"], err
    assert sorted(whole) == [0, 1]
    assert events[-1] == "data: [DONE]"
    assert "injected step failure" in json.loads(events[-2][6:])["error"]["message"]
    assert json.loads(events[-3][6:])["choices"][0]["finish_reason"] == "error"
    live.wait_idle()
    ref = live.offline([PROMPTS[0]], "a0", 10)[0].outputs[0].text
    with live.http() as http:
        assert http.post("/v1/completions", json=_greedy("a0", PROMPTS[0], 10)).json()["choices"][0]["text"] == ref
