"""`jlora serve` over HTTP: a live uvicorn server on loopback, the real `openai` client, the tiny model."""

from __future__ import annotations

import asyncio
import json
import os
import queue
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import openai
import numpy as np
import pytest

from jlora import LLM, SamplingParams, compile_stats
from jlora.server.app import build_app
from jlora.server.serve import bind
from live import KEY, serve_live

# Only sizes every engine version takes (the tiny model compiles its graphs in a second or two).
ENGINE = dict(max_model_len=128, max_num_seqs=4, max_num_batched_tokens=32, max_loras=2, max_lora_rank=8,
              token_buckets=(16, 32))
ADAPTERS = [f"a{i}" for i in range(8)]  # served from the start; 8 adapters through 2 slots
PROMPTS = ["Hello there", "Once upon a time", "1 2 3 4", "The quick brown fox", "Dear diary,", "In the beginning",
           "Roses are red", "Knock knock"]
REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def lora_root(tiny_dir, tiny_adapters, tmp_path_factory) -> Path:
    from jlora.bench.chip_check import write_dora_adapter
    from jlora.models.loading import read_model_config

    root = tmp_path_factory.mktemp("lora_root")
    shutil.copytree(tiny_adapters[8], root / "good")
    write_dora_adapter(read_model_config(tiny_dir[0]), root)  # root / "dora-qv-r8": the server has no enable_dora
    (root / "broken").mkdir()
    (root / "broken" / "adapter_config.json").write_text("{not json")
    (root / "broken" / "adapter_model.safetensors").write_bytes(b"\x00" * 16)
    (root / "escape").symlink_to(tiny_adapters[9], target_is_directory=True)  # resolves outside the root
    (root / "pickled").mkdir()
    shutil.copy(tiny_adapters[10] / "adapter_config.json", root / "pickled")
    (root / "pickled" / "adapter_model.bin").write_bytes(b"not loaded")
    return root


@pytest.fixture(scope="module")
def live(tiny_dir, tiny_adapters, lora_root):
    llm = LLM(str(tiny_dir[0]), progress=False, **ENGINE)
    app = build_app(llm, "tiny", lora_modules={n: str(tiny_adapters[i]) for i, n in enumerate(ADAPTERS)},
                    api_key=KEY, enable_runtime_lora_updating=True, lora_root=lora_root)
    with serve_live(llm, app) as live:
        yield live


def test_models_list(live):
    models = {m.id: m.to_dict() for m in live.client().models.list().data}
    assert list(models) == ["tiny"] + ADAPTERS
    assert models["tiny"]["parent"] is None
    for name in ADAPTERS:
        assert models[name]["parent"] == "tiny"
        assert models[name]["root"] == live.srv.adapters[name].lora_path


@pytest.mark.parametrize("model", ["tiny", "a3"])
def test_completion_stream_equals_whole_equals_offline(live, model):
    client = live.client()
    kw = dict(model=model, prompt=PROMPTS[0], max_tokens=12, temperature=0.0, logprobs=0,
              extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True})
    whole = client.completions.create(**kw)
    ref = live.offline([PROMPTS[0]], model if model != "tiny" else None, 12)[0]
    tokens = [int(t.split(":")[1]) for t in whole.choices[0].logprobs.tokens]
    assert tokens == ref.outputs[0].token_ids
    assert whole.choices[0].text == ref.outputs[0].text
    assert whole.choices[0].finish_reason == "length"
    assert whole.usage.prompt_tokens == len(ref.prompt_token_ids) and whole.usage.completion_tokens == 12

    chunks = list(client.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
    assert [int(t.split(":")[1]) for c in chunks if c.choices and c.choices[0].logprobs
            for t in c.choices[0].logprobs.tokens] == tokens
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12


def test_several_prompts_and_n_samples_stream_and_whole(live):
    client = live.client()
    kw = dict(model="a4", prompt=PROMPTS[:2], max_tokens=6, temperature=0.0, n=2, extra_body={"ignore_eos": True})
    whole = client.completions.create(**kw)
    refs = [o.outputs[0].text for o in live.offline(PROMPTS[:2], "a4", 6)]
    assert [c.index for c in whole.choices] == [0, 1, 2, 3]
    assert [c.text for c in whole.choices] == [refs[0], refs[0], refs[1], refs[1]]
    assert whole.usage.completion_tokens == 24
    streamed = ["", "", "", ""]
    for chunk in client.completions.create(**kw, stream=True):
        for c in chunk.choices:
            streamed[c.index] += c.text
    assert streamed == [c.text for c in whole.choices]


def test_chat_stream_equals_whole_equals_offline(live):
    client = live.client()
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    kw = dict(model="a5", messages=messages, max_tokens=10, temperature=0.0, extra_body={"ignore_eos": True})
    whole = client.chat.completions.create(**kw)
    ref = live.offline([messages], "a5", 10, chat=True)[0]
    assert whole.choices[0].message.content == ref.outputs[0].text
    assert whole.choices[0].message.role == "assistant"
    assert whole.usage.completion_tokens == 10
    chunks = list(client.chat.completions.create(**kw, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == whole.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == "length"

    # chat logprobs and n > 1 with a seed
    lp = client.chat.completions.create(**{**kw, "max_tokens": 3}, logprobs=True, top_logprobs=2)
    assert len(lp.choices[0].logprobs.content) == 3
    assert all(len(t.top_logprobs) == 2 for t in lp.choices[0].logprobs.content)
    many = client.chat.completions.create(model="tiny", messages=messages, max_tokens=5, n=3, seed=7,
                                          temperature=1.0)
    assert [c.index for c in many.choices] == [0, 1, 2]


def test_64_concurrent_streams_over_8_adapters_through_2_slots(live):
    jobs = [(PROMPTS[i % 8], ADAPTERS[(i // 8 + i) % 8]) for i in range(64)]  # every prompt x adapter pair
    refs = {}
    for name in ADAPTERS:  # offline, before the traffic: one batch per adapter
        prompts = [p for p, a in jobs if a == name]
        for p, out in zip(prompts, live.offline(prompts, name, 10)):
            refs[(p, name)] = out.outputs[0].token_ids
    compiles = compile_stats.compile_count()
    stats_before = live.on_engine(lambda: dict(live.llm.engine.adapters.stats))

    async def one(client: openai.AsyncOpenAI, prompt: str, model: str) -> list[int]:
        stream = await client.completions.create(
            model=model, prompt=prompt, max_tokens=10, temperature=0.0, stream=True, logprobs=0,
            extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True})
        toks = []
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].logprobs:
                toks += [int(t.split(":")[1]) for t in chunk.choices[0].logprobs.tokens]
        return toks

    async def run_all() -> list[list[int]]:
        client = openai.AsyncOpenAI(base_url=live.base_url + "/v1", api_key=KEY, max_retries=0, timeout=120,
                                    http_client=httpx.AsyncClient(trust_env=False,
                                                                  limits=httpx.Limits(max_connections=100)))
        async with client:
            return await asyncio.wait_for(asyncio.gather(*(one(client, p, a) for p, a in jobs)), timeout=150)

    t0 = time.monotonic()
    got = asyncio.run(run_all())
    elapsed = time.monotonic() - t0
    assert [g for g in got] == [refs[j] for j in jobs]
    assert compile_stats.compile_count() == compiles
    stats = live.on_engine(lambda: dict(live.llm.engine.adapters.stats))
    assert stats.get("evictions", 0) > stats_before.get("evictions", 0)  # 8 adapters really cycled through 2 slots
    assert live.on_engine(lambda: live.llm.engine.kv.num_free) == live.llm.config.num_kv_blocks
    print(f"64 streams in {elapsed:.1f}s")


def _error(resp: httpx.Response, status: int) -> dict:
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    return err


def test_bad_requests_are_refused_and_the_others_carry_on(live, tiny_adapters):
    http = live.http()
    ok = {"model": "a1", "prompt": PROMPTS[1], "max_tokens": 40, "temperature": 0.0, "ignore_eos": True}
    ref = live.offline([PROMPTS[1]], "a1", 40)[0].outputs[0].text
    # A long request streams while the bad ones are refused.
    with http.stream("POST", "/v1/completions", json={**ok, "stream": True}) as bystander:
        err = _error(http.post("/v1/completions", json={**ok, "model": "nope"}), 404)
        assert err["code"] == "model_not_found" and err["param"] == "model"
        err = _error(http.post("/v1/completions", json={**ok, "temperature": -0.5}), 400)
        assert err["param"] == "temperature" and "temperature" in err["message"]
        err = _error(http.post("/v1/chat/completions", json={"model": "tiny", "messages": [{"role": "user", "content": "hi"}],
                                                             "max_tokens": 1000}), 400)
        assert err["param"] == "max_tokens"
        err = _error(http.post("/v1/completions", content=b'{"model": "tiny", "prompt": ',
                               headers={"Content-Type": "application/json"}), 400)
        assert "JSON" in err["message"] and err["param"] == "body"
        vocab = live.llm.model.cfg.vocab_size
        err = _error(http.post("/v1/completions", json={"model": "tiny", "prompt": [1, vocab]}), 400)
        assert err["param"] == "prompt" and str(vocab) in err["message"]
        err = _error(http.post("/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": "many"}), 400)
        assert err["param"] == "max_tokens"
        err = _error(http.post("/v1/chat/completions", json={"model": "tiny", "messages": []}), 400)
        assert err["param"] == "messages"
        err = _error(http.post("/v1/completions", json={**ok, "n": 0}), 400)
        assert err["param"] == "n"
        _error(http.post("/v1/completions", json=ok, headers={"Authorization": "Bearer wrong"}), 401)
        _error(httpx.post(live.base_url + "/v1/models", trust_env=False), 401)  # no key at all
        assert httpx.get(live.base_url + "/health", trust_env=False).status_code == 200  # no key needed
        with pytest.raises(openai.AuthenticationError):
            live.client(key="wrong").models.list()
        with pytest.raises(openai.NotFoundError):
            live.client().completions.create(model="nope", prompt="x")
        with pytest.raises(openai.BadRequestError):
            live.client().completions.create(model="tiny", prompt="x", temperature=-1)
        # Values past what the sampler's arrays hold (these used to crash the step for everyone).
        vocab = live.llm.model.cfg.vocab_size
        for field, value in [("top_k", 2**31), ("top_k", 2**33), ("top_k", vocab + 1), ("temperature", 1e308),
                             ("repetition_penalty", 1e308), ("n", 10_000), ("n", 2**40), ("seed", 2**64),
                             ("stop_token_ids", [2**33]), ("stop_token_ids", [vocab]), ("min_tokens", 2**40),
                             ("logprobs", 21), ("best_of", 2**40), ("top_p", 0.0), ("stream", 1)]:
            err = _error(http.post("/v1/completions", json={**ok, field: value}), 400)
            assert err["param"].split(".")[0] == field, (field, value, err)
        raw = b'{"model": "tiny", "prompt": "\\ud800", "max_tokens": 2}'  # a lone surrogate, as JSON escapes it
        err = _error(http.post("/v1/completions", content=raw, headers={"Content-Type": "application/json"}), 400)
        assert err["param"] == "prompt" and "UTF-8" in err["message"]
        raw = b'{"model": "tiny", "messages": [{"role": "user", "content": "\\udfff"}]}'
        err = _error(http.post("/v1/chat/completions", content=raw, headers={"Content-Type": "application/json"}), 400)
        assert err["param"].startswith("messages")
        chat = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        err = _error(http.post("/v1/chat/completions", json={**chat, "logprobs": 0}), 400)  # a bool in the API
        assert err["param"] == "logprobs"
        err = _error(http.post("/v1/chat/completions", json={**chat, "response_format": {"type": "json_schema"}}), 400)
        assert err["param"] == "response_format"
        bad_schema = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "no-such-type"}}}
        err = _error(http.post("/v1/chat/completions", json={**chat, "response_format": bad_schema}), 400)
        assert err["param"] == "response_format" and "no-such-type" in err["message"]
        err = _error(http.post("/v1/completions", json={**ok, "guided_regex": "[a-", "max_tokens": 2}), 400)
        assert err["param"] == "guided_regex"
        err = _error(http.post("/v1/completions", json={**ok, "guided_regex": "a", "guided_choice": ["b"]}), 400)
        assert err["param"] == "guided_regex" and "give one of ['guided_choice', 'guided_regex']" in err["message"]
        err = _error(http.post("/v1/completions", json={**ok, "logit_bias": {"x": 1}}), 400)
        assert err["param"] == "logit_bias"
        err = _error(http.post("/v1/completions", json={**ok, "logit_bias": {str(vocab): 1}}), 400)
        assert err["param"] == "logit_bias"
        assert http.post("/v1/chat/completions", json={**chat, "response_format": {"type": "text"}}).status_code == 200
        wrong_method = http.get("/v1/completions")
        assert wrong_method.status_code == 405 and wrong_method.headers["allow"] == "POST"
        text = "".join(json.loads(line[6:])["choices"][0]["text"] for line in bystander.iter_lines()
                       if line.startswith("data: {"))
    assert text == ref
    assert live.client().completions.create(**{k: v for k, v in ok.items() if k != "ignore_eos"},
                                            extra_body={"ignore_eos": True}).choices[0].text == ref


def test_runtime_adapter_loading_is_confined_to_the_lora_root(live, lora_root, tiny_adapters):
    http = live.http()

    def load(name: str, path: str) -> httpx.Response:
        return http.post("/v1/load_lora_adapter", json={"lora_name": name, "lora_path": path})

    for path in [str(tiny_adapters[9]), "../" + tiny_adapters[9].name, "good/../../" + lora_root.name + "x",
                 "escape", str(lora_root / "escape"), "pickled", "missing", str(lora_root)]:
        err = _error(load("x", path), 400)
        assert err["param"] == "lora_path", (path, err)
    err = _error(load("x", "broken"), 400)
    assert "broken" in err["message"] or "malformed" in err["message"]
    err = _error(load("d", "dora-qv-r8"), 400)  # a DoRA adapter, on a server started without --enable-dora
    assert err["param"] == "lora_path" and "enable_dora=True" in err["message"] and "--enable-dora" in err["message"]
    _error(load("../x", "good"), 400)  # names are plain too
    assert "x" not in {m.id for m in live.client().models.list().data}

    assert load("x", "good").status_code == 200
    _error(load("x", "good"), 400)  # already loaded
    card = next(m.to_dict() for m in live.client().models.list().data if m.id == "x")
    assert card["parent"] == "tiny" and card["root"] == str(lora_root / "good")
    ref = live.offline([PROMPTS[2]], "x", 60)[0].outputs[0].text
    whole = live.client().completions.create(model="x", prompt=PROMPTS[2], max_tokens=60, temperature=0.0,
                                             extra_body={"ignore_eos": True})
    assert whole.choices[0].text == ref

    # Unloading lets a running request finish with its weights; new requests get 404.
    with http.stream("POST", "/v1/completions", json={"model": "x", "prompt": PROMPTS[2], "max_tokens": 60,
                                                      "temperature": 0.0, "ignore_eos": True, "stream": True}) as r:
        lines = r.iter_lines()
        first = next(line for line in lines if line.startswith("data: {"))
        assert http.post("/v1/unload_lora_adapter", json={"lora_name": "x"}).status_code == 200
        _error(http.post("/v1/completions", json={"model": "x", "prompt": "hi"}), 404)
        rest = [line for line in lines if line.startswith("data: {")]
    text = "".join(json.loads(line[6:])["choices"][0]["text"] for line in [first] + rest)
    assert text == ref
    _error(http.post("/v1/unload_lora_adapter", json={"lora_name": "x"}), 404)
    assert "x" not in {m.id for m in live.client().models.list().data}
    assert live.on_engine(lambda: "x" not in live.llm.engine.adapters.resident().values())


def test_a_converting_adapter_does_not_stall_running_streams(live, monkeypatch):
    """Adapters convert on a worker thread, not the engine's: while one is held mid-conversion, streams on
    the base model and on an already converted adapter run to the end."""
    client = live.client()
    client.completions.create(model="a5", prompt=PROMPTS[1], max_tokens=2)  # a5 converted before the hold
    gate, started = threading.Event(), threading.Event()
    mgr = live.llm.engine.adapters
    real = mgr.host.read_source  # conversion or a disk-cache read: every way an adapter reaches the host cache

    def held_read(*args, **kwargs):
        started.set()
        assert gate.wait(60)
        return real(*args, **kwargs)

    monkeypatch.setattr(mgr.host, "read_source", held_read)
    loaded: queue.Queue = queue.Queue()
    loader = threading.Thread(target=lambda: loaded.put(live.http().post(
        "/v1/load_lora_adapter", json={"lora_name": "held", "lora_path": "good"})))
    loader.start()
    try:
        assert started.wait(30)
        for model in ("tiny", "a5"):
            ref = live.offline([PROMPTS[3]], None if model == "tiny" else model, 8)[0].outputs[0].text
            chunks = client.completions.create(model=model, prompt=PROMPTS[3], max_tokens=8, temperature=0.0,
                                               stream=True, extra_body={"ignore_eos": True})
            assert "".join(c.choices[0].text for c in chunks if c.choices) == ref
        assert loader.is_alive() and loaded.empty()  # the load is still held, and nothing waited for it
    finally:
        gate.set()
        loader.join(60)
    assert loaded.get_nowait().status_code == 200
    got = client.completions.create(model="held", prompt=PROMPTS[3], max_tokens=2, temperature=0.0,
                                    extra_body={"ignore_eos": True}).choices[0].text
    assert got == live.offline([PROMPTS[3]], "held", 2)[0].outputs[0].text
    assert live.http().post("/v1/unload_lora_adapter", json={"lora_name": "held"}).status_code == 200


def _wait_idle(live, timeout: float = 20.0) -> None:
    live.wait_idle(timeout)


def _metric(live, name: str) -> float:
    text = live.http().get("/metrics").text
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(name))


SCHEMAS = [
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer"}},
     "required": ["name", "age"], "additionalProperties": False},
    {"type": "object", "properties": {"tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
                                      "ok": {"type": "boolean"}}, "required": ["tags", "ok"], "additionalProperties": False},
    {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}}, "required": ["n"],
     "additionalProperties": False},
]


def test_structured_output_obeys_its_schema_beside_free_text_rows_with_no_new_graphs(live):
    import jsonschema

    client = live.client()
    compiles = compile_stats.compile_count()

    def schema_chat(i):
        return client.chat.completions.create(
            model=ADAPTERS[i % 3], messages=[{"role": "user", "content": f"Person {i} as JSON"}], max_tokens=80,
            temperature=0.0 if i % 2 else 0.9, seed=i,
            response_format={"type": "json_schema", "json_schema": {"name": f"s{i}", "schema": SCHEMAS[i % 3]}})

    def free(i):
        return client.completions.create(model="tiny", prompt=PROMPTS[i], max_tokens=12, temperature=0.0,
                                         extra_body={"ignore_eos": True})

    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(9) as pool:
        structured = [pool.submit(schema_chat, i) for i in range(6)]
        texts = [pool.submit(free, i) for i in range(3)]
        choice = pool.submit(client.completions.create, model="a1", prompt="Pick", max_tokens=8,
                             extra_body={"guided_choice": ["red", "green", "dark blue"]})
        regex = pool.submit(client.completions.create, model="tiny", prompt="Code:", max_tokens=12,
                            extra_body={"guided_regex": r"[A-Z]{2}-[0-9]{3}"})
        obj = pool.submit(client.chat.completions.create, model="a2", max_tokens=40,
                          messages=[{"role": "user", "content": "Any JSON object"}], response_format={"type": "json_object"})
    for i, f in enumerate(structured):
        choice_ = f.result().choices[0]
        assert choice_.finish_reason == "stop", choice_
        jsonschema.validate(json.loads(choice_.message.content), SCHEMAS[i % 3])
    refs = live.offline(PROMPTS[:3], None, 12)
    assert [t.result().choices[0].text for t in texts] == [r.outputs[0].text for r in refs]
    assert choice.result().choices[0].text in ("red", "green", "dark blue")
    import re
    assert re.fullmatch(r"[A-Z]{2}-[0-9]{3}", regex.result().choices[0].text)
    obj_choice = obj.result().choices[0]  # any object: the tiny model may not close it within max_tokens
    assert obj_choice.message.content.startswith("{")
    if obj_choice.finish_reason == "stop":
        assert isinstance(json.loads(obj_choice.message.content), dict)
    biased = client.completions.create(model="tiny", prompt="x", max_tokens=4, temperature=0.0, logit_bias={"42": 100},
                                       extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True}, logprobs=0)
    assert biased.choices[0].logprobs.tokens == ["token_id:42"] * 4
    assert compile_stats.compile_count() == compiles


def test_echo_with_prompt_logprobs_as_lm_eval_asks(live):
    """lm-eval's loglikelihood request: echo, max_tokens=0, logprobs=1, token-id prompts."""
    ids = live.llm.tokenizer.encode(PROMPTS[2] + " 5 6 7")
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=1)
    ref = live.on_engine(lambda: live.llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False))[0]
    http = live.http()
    r = http.post("/v1/completions", json={"model": "tiny", "prompt": [ids, ids[:3]], "echo": True, "max_tokens": 0,
                                           "logprobs": 1, "temperature": 0.0})
    assert r.status_code == 200, r.text
    body = r.json()
    c = body["choices"][0]
    assert c["text"] == live.llm.tokenizer.decode(ids)
    lp = c["logprobs"]
    assert len(lp["tokens"]) == len(ids) and lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    want = [e[t] for e, t in zip(ref.prompt_logprobs[1:], ids[1:])]
    np.testing.assert_allclose(lp["token_logprobs"][1:], want, atol=1e-6)
    assert all(1 <= len(top) <= 2 for top in lp["top_logprobs"][1:])
    assert lp["text_offset"][0] == 0 and lp["text_offset"] == sorted(lp["text_offset"])
    assert len(body["choices"][1]["logprobs"]["tokens"]) == 3
    assert body["usage"]["completion_tokens"] == 0
    r = http.post("/v1/completions", json={"model": "a1", "prompt": PROMPTS[0], "echo": True, "max_tokens": 3,
                                           "temperature": 0.0, "ignore_eos": True}).json()
    assert r["choices"][0]["text"] == PROMPTS[0] + live.offline([PROMPTS[0]], "a1", 3)[0].outputs[0].text
    chunks = [json.loads(line[6:]) for line in http.post("/v1/completions", json={
        "model": "a1", "prompt": PROMPTS[0], "echo": True, "max_tokens": 3, "temperature": 0.0, "ignore_eos": True,
        "stream": True}).text.splitlines() if line.startswith("data: {")]
    assert "".join(c["choices"][0]["text"] for c in chunks) == r["choices"][0]["text"]
    assert _error(http.post("/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": 0}), 400)["param"] == "max_tokens"
    # What lm-eval 0.4.13 sends (max_tokens=1) and then drops as the generated token
    # (`token_logprobs[ctxlen:-1]`): an entry even when that token is an EOS or stop token that
    # ended the sample, as vLLM returns it, so no prompt token's logprob is dropped instead.
    nxt = ref.outputs[0].token_ids[0]
    r = http.post("/v1/completions", json={"model": "tiny", "prompt": ids, "echo": True, "max_tokens": 1, "logprobs": 1,
                                           "temperature": 0.0, "stop_token_ids": [nxt],
                                           "return_tokens_as_token_ids": True}).json()
    c = r["choices"][0]
    assert c["finish_reason"] == "stop" and c["stop_reason"] == nxt and c["text"] == live.llm.tokenizer.decode(ids)
    assert c["logprobs"]["tokens"] == [f"token_id:{t}" for t in ids + [nxt]]
    np.testing.assert_allclose(c["logprobs"]["token_logprobs"][1:-1], want, atol=1e-6)


def test_tokenize_detokenize_version_and_one_model(live):
    http, tok = live.http(), live.llm.tokenizer
    r = http.post("/tokenize", json={"model": "a1", "prompt": "Hello there"}).json()
    assert r == {"count": len(tok.encode("Hello there")), "max_model_len": 128, "tokens": tok.encode("Hello there"),
                 "token_strs": None}
    msgs = [{"role": "user", "content": "hi"}]
    r = http.post("/tokenize", json={"messages": msgs}).json()
    assert r["tokens"] == live.llm.apply_chat_template(msgs)
    assert http.post("/detokenize", json={"tokens": r["tokens"]}).json() == {"prompt": tok.decode(r["tokens"])}
    _error(http.post("/detokenize", json={"tokens": [live.llm.model.cfg.vocab_size]}), 400)
    _error(http.post("/tokenize", json={"prompt": "x", "messages": msgs}), 400)
    _error(http.post("/tokenize", json={"model": "nope", "prompt": "x"}), 404)
    assert http.get("/version").json()["version"] == live.app.version
    assert http.get("/v1/models/a1").json()["parent"] == "tiny"
    assert http.get("/v1/models/tiny").json()["id"] == "tiny"
    assert _error(http.get("/v1/models/nope"), 404)["param"] == "model"
    assert live.client().models.retrieve("a2").id == "a2"


def test_model_defaults_to_the_base_and_an_unknown_role_is_refused(live):
    """As vLLM: a request without `model` is the base model's, and the reply names it; a role that is
    not OpenAI's (a typo such as "usr") is a 400 naming it, not a turn the template renders silently."""
    http = live.http()
    body = {"prompt": PROMPTS[0], "max_tokens": 6, "temperature": 0.0, "ignore_eos": True}
    got = http.post("/v1/completions", json=body).json()
    assert got["model"] == "tiny"
    assert got["choices"][0]["text"] == live.offline([PROMPTS[0]], None, 6)[0].outputs[0].text
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    assert http.post("/v1/chat/completions", json=chat).json()["model"] == "tiny"
    err = _error(http.post("/v1/chat/completions", json={**chat, "messages": [{"role": "usr", "content": "hi"}]}), 400)
    assert err["param"] == "messages.0.role" and "'user'" in err["message"]


def test_every_request_gets_a_log_line(live, caplog):
    """One INFO line per request on `jlora.server` (as vLLM logs each): client, method, path, status, the
    completion's id when there is one, seconds; refused requests too."""
    http = live.http()
    with caplog.at_level("INFO", logger="jlora.server"):
        got = http.post("/v1/chat/completions", json={"model": "a1", "messages": [{"role": "user", "content": "hi"}],
                                                      "max_tokens": 2}).json()
        _error(http.post("/v1/completions", json={"model": "nope", "prompt": "x"}), 404)
        with http.stream("POST", "/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": 3,
                                                           "stream": True}) as stream:
            stream_id = json.loads(next(ln for ln in list(stream.iter_lines()) if ln.startswith("data: {"))[6:])["id"]
        http.get("/health")
        deadline = time.monotonic() + 10  # a line is written once its response has been sent
        while sum(r.name == "jlora.server" for r in caplog.records) < 4:
            assert time.monotonic() < deadline, caplog.text
            time.sleep(0.02)
    lines = [r.getMessage() for r in caplog.records if r.name == "jlora.server"]
    assert len(lines) == 4, lines  # a stream's line may come after a later request's: it ends after its body
    for want in (f'"POST /v1/chat/completions" 200 {got["id"]} ', '"POST /v1/completions" 404 - ',
                 f'"POST /v1/completions" 200 {stream_id} ', '"GET /health" 200 - '):
        assert sum(want in ln for ln in lines) == 1, (want, lines)
    assert all(re.fullmatch(r'127\.0\.0\.1:\d+ ".+" \d{3} \S+ \d+\.\d\d s', ln) for ln in lines), lines


def test_client_disconnect_aborts_and_frees_resources(live):
    _wait_idle(live)
    aborted = _metric(live, 'jlora_requests_total{status="abort"}')
    body = {"model": "a6", "prompt": PROMPTS[3], "max_tokens": 120, "temperature": 0.0, "ignore_eos": True}
    with live.http() as http:  # streaming: read one chunk, hang up
        with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
            next(line for line in r.iter_lines() if line.startswith("data: {"))
    _wait_idle(live)
    with live.http(timeout=httpx.Timeout(60, read=0.05)) as http:  # whole reply: give up waiting
        with pytest.raises(httpx.ReadTimeout):
            http.post("/v1/completions", json=body)
    _wait_idle(live)
    deadline = time.monotonic() + 10
    while _metric(live, 'jlora_requests_total{status="abort"}') < aborted + 2:
        assert time.monotonic() < deadline
        time.sleep(0.05)


def test_metrics(live):
    # Each counter moves by exactly this test's own traffic, whichever tests ran before it.
    counters = ['jlora_requests_total{status="length"}', 'jlora_requests_total{status="rejected"}',
                "jlora_lora_evictions_total"]
    client, http = live.client(), live.http()

    def complete(model: str) -> None:
        out = client.completions.create(model=model, prompt="Hi", max_tokens=2, extra_body={"ignore_eos": True})
        assert out.choices[0].finish_reason == "length"

    _wait_idle(live)
    for model in ("a5", "a6"):  # the two slots now hold a5 and a6, whatever was resident before
        complete(model)
    _wait_idle(live)
    before = {c: _metric(live, c) for c in counters}
    for model in ("a7", "a5", "a6", "a7"):  # a cycle of three adapters through two LRU slots: each evicts one
        complete(model)
    for _ in range(3):
        _error(http.post("/v1/completions", json={"model": "no-such-adapter", "prompt": "hi"}), 404)
    want = {counters[0]: 4, counters[1]: 3, counters[2]: 4}
    deadline = time.monotonic() + 10  # a finished request is counted just after its reply
    while (got := {c: _metric(live, c) - before[c] for c in counters}) != want and time.monotonic() < deadline:
        time.sleep(0.05)
    assert got == want
    assert _metric(live, "jlora_xla_compiles_after_warmup_total") == 0
    # Open by default, as vLLM's (`--metrics-auth` puts it behind the key: tests/test_server_limits.py).
    text = httpx.get(live.base_url + "/metrics", trust_env=False).text
    for name in ["jlora_requests_total", "jlora_prompt_tokens_total", "jlora_generation_tokens_total",
                 "jlora_time_to_first_token_seconds_bucket", "jlora_time_per_output_token_seconds_bucket",
                 "jlora_num_requests_running", "jlora_num_requests_waiting", "jlora_kv_blocks_used",
                 "jlora_lora_slot_hits_total", "jlora_lora_disk_loads_total", "jlora_lora_evictions_total",
                 "jlora_num_preemptions_total", "jlora_xla_compiles_after_warmup_total"]:
        assert f"\n{name}" in text, name


def test_shutdown_deadline_aborts_running_streams_cleanly(tiny_dir, tiny_adapters):
    """What SIGTERM does once --shutdown-timeout has passed; on a server of its own, since it stops
    the engine (the module's server keeps serving whichever tests run after this one)."""
    llm = LLM(str(tiny_dir[0]), progress=False, **ENGINE)
    app = build_app(llm, "tiny", lora_modules={"a2": str(tiny_adapters[2])}, api_key=KEY)
    with serve_live(llm, app) as live, live.http() as http:
        with http.stream("POST", "/v1/completions", json={"model": "a2", "prompt": PROMPTS[4], "max_tokens": 120,
                                                          "ignore_eos": True, "stream": True}) as r:
            lines = r.iter_lines()
            next(line for line in lines if line.startswith("data: {"))
            live.srv.engine.begin_stop(0.0)
            rest = [line for line in lines if line]
        assert rest[-1] == "data: [DONE]"
        assert json.loads(rest[-2][6:])["choices"][0]["finish_reason"] == "abort"
        deadline = time.monotonic() + 10
        while live.srv.engine.alive:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        eng = live.llm.engine  # the engine thread is gone: safe to look from here
        assert eng.kv.num_free == eng.config.num_kv_blocks and not eng.requests
        assert http.get("/health").status_code == 503
        err = _error(http.post("/v1/completions", json={"model": "tiny", "prompt": "hi"}), 503)
        assert "shutting down" in err["message"] or "not running" in err["message"]


def test_cli_serve_sigterm_finishes_the_running_request_and_exits_0(tiny_dir, tiny_adapters):
    env = {**os.environ, "PYTHONPATH": str(REPO), "JAX_PLATFORMS": "cpu"}
    cmd = [sys.executable, "-m", "jlora.cli", "serve", "--model", str(tiny_dir[0]), "--port", "0",
           "--max-model-len", "128", "--max-num-seqs", "4", "--max-num-batched-tokens", "32", "--max-loras", "2",
           "--max-lora-rank", "8", "--token-buckets", "16,32",
           "--lora-modules", f"ad={tiny_adapters[0]}", "--api-key", KEY, "--log-level", "warning"]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        lines: queue.Queue = queue.Queue()  # read in a thread, so a silent hang cannot block the test
        threading.Thread(target=lambda: [lines.put(line) for line in proc.stdout], daemon=True).start()
        deadline = time.monotonic() + 120
        url = None
        while url is None:  # "jlora serve: ... on http://127.0.0.1:PORT/v1"
            line = lines.get(timeout=max(deadline - time.monotonic(), 0.01))
            if line.startswith("jlora serve:"):
                url = line.split(" on ")[-1].strip()
        client = openai.OpenAI(base_url=url, api_key=KEY, max_retries=0, timeout=60,
                               http_client=httpx.Client(trust_env=False))
        assert [m.id for m in client.models.list().data] == [str(tiny_dir[0]), "ad"]
        load = httpx.post(url + "/load_lora_adapter", json={"lora_name": "b", "lora_path": str(tiny_adapters[1])},
                          headers={"Authorization": f"Bearer {KEY}"}, trust_env=False)
        assert load.status_code == 404  # no runtime loading without --enable-runtime-lora-updating
        stream = client.completions.create(model="ad", prompt="Hello", max_tokens=100, temperature=0.0,
                                           stream=True, extra_body={"ignore_eos": True})
        chunks = [next(iter(stream))]
        proc.send_signal(signal.SIGTERM)  # mid-stream: the request is allowed to finish
        chunks += list(stream)
        assert chunks[-1].choices[0].finish_reason == "length"
        assert proc.wait(60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _serve_cli(args: list[str], env: dict | None = None) -> tuple[subprocess.CompletedProcess, float]:
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "jlora.cli", "serve", *args], capture_output=True, text=True,
                          timeout=120, env={**os.environ, "PYTHONPATH": str(REPO), "JAX_PLATFORMS": "cpu", **(env or {})})
    return proc, time.monotonic() - t0


def test_serve_checks_paths_and_the_port_before_loading_and_never_prints_the_key(tiny_dir):
    proc, _ = _serve_cli(["--help"], {"JLORA_API_KEY": "sk-secret-do-not-print"})
    assert proc.returncode == 0 and "sk-secret-do-not-print" not in proc.stdout + proc.stderr
    assert "(default: 127.0.0.1)" in proc.stdout and "(default: 8000)" in proc.stdout
    proc, elapsed = _serve_cli(["--model", str(tiny_dir[0]), "--lora-modules", "x=/no/such/adapter"])
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and "--lora-modules x=/no/such/adapter" in proc.stderr
    # Loading and warming up the tiny model takes tens of seconds here; a check before it, about one.
    assert elapsed < 10, elapsed
    busy = bind("127.0.0.1", 0)
    try:
        proc, elapsed = _serve_cli(["--model", str(tiny_dir[0]), "--port", str(busy.getsockname()[1])])
    finally:
        busy.close()
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and "cannot listen" in proc.stderr, proc.stderr
    assert elapsed < 10, elapsed


def test_cli_flags_are_checked_before_the_model_loads(capsys):
    from jlora.cli import main
    from jlora.server.serve import parse_lora_modules

    assert main(["serve", "--enable-runtime-lora-updating"]) == 2
    assert "--lora-root" in capsys.readouterr().err
    assert main(["serve", "--lora-modules", "no-equals-sign"]) == 2
    assert parse_lora_modules(["a=x/y", '{"name": "b", "path": "/z"}']) == {"a": "x/y", "b": "/z"}


def test_usage_counts_the_eos_or_stop_token_that_ended_a_sample():
    from jlora.outputs import CompletionOutput, RequestOutput
    from jlora.server.engine_thread import Update
    from jlora.server.openai_responses import Formatter

    fmt = Formatter(False, "tiny", 3, None, None, False)
    outs = [CompletionOutput(0, "", [], "stop", None), CompletionOutput(1, "ab", [5, 6], "stop", 99),
            CompletionOutput(2, "ab", [5, 6], "stop", "b")]  # EOS only; a stop token; a stop string
    fmt.whole({0: Update(0, ["", "", ""], RequestOutput("r", "x", [1, 2], outs, True), True)})
    assert fmt.usage() == {"prompt_tokens": 2, "completion_tokens": 1 + 3 + 2, "total_tokens": 8}


def test_prefix_cache_metrics(live):
    """The same long prompt twice under one adapter: the second reads its prefix from the cache,
    and /metrics counts the tokens looked up and found (vLLM's prefix_cache_queries / _hits)."""
    client = live.client()
    prompt = "prefix caching metrics " + " ".join(f"w{i}" for i in range(40))
    n = len(live.llm.tokenizer.encode(prompt, add_special_tokens=True))
    names = ["jlora_prefix_cache_queries_total", "jlora_prefix_cache_hits_total"]
    _wait_idle(live)
    before = {c: _metric(live, c) for c in names}
    texts = [client.completions.create(model="a4", prompt=prompt, max_tokens=4, temperature=0.0,
                                       extra_body={"ignore_eos": True}).choices[0].text for _ in range(2)]
    assert texts[0] == texts[1]
    want = {names[0]: 2 * n, names[1]: (n - 1) // 16 * 16}
    deadline = time.monotonic() + 10
    while (got := {c: _metric(live, c) - before[c] for c in names}) != want and time.monotonic() < deadline:
        time.sleep(0.05)
    assert got == want
    assert "\njlora_kv_blocks_cached" in live.http().get("/metrics").text
