"""A bounded schemathesis run against a live `jlora serve` (tiny model, 127.0.0.1).

Every operation in the served /openapi.json gets cases that follow the schema and cases that break
it, from a fixed seed. Every answer must be documented, no 5xx, no 200 whose choices ended in
"abort" (a request the engine dropped), no hang; afterwards nothing is running or waiting and every
KV block is free. The schema itself caps n and max_tokens (the server's --max-n and context), so
the run takes about a minute.
"""

from __future__ import annotations

import json

import hypothesis
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis.checks import not_a_server_error
from schemathesis.generation import GenerationMode
from schemathesis.specs.openapi.checks import content_type_conformance, status_code_conformance

from jlora import LLM
from jlora.server.app import build_app
from live import KEY, serve_live

ENGINE = dict(max_model_len=64, max_num_seqs=4, max_num_batched_tokens=32, max_loras=2, max_lora_rank=8,
              token_buckets=(16, 32), max_n=2, max_waiting_seqs=64)
EXAMPLES = {GenerationMode.POSITIVE: 40, GenerationMode.NEGATIVE: 25}
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance]


@pytest.fixture(scope="module")
def live(tiny_dir, tiny_adapters, tmp_path_factory):
    root = tmp_path_factory.mktemp("fuzz_lora_root")
    llm = LLM(str(tiny_dir[0]), progress=False, **ENGINE)
    app = build_app(llm, "tiny", lora_modules={"a0": str(tiny_adapters[0])}, api_key=KEY, default_max_tokens=8,
                    enable_runtime_lora_updating=True, lora_root=root, max_request_bytes=256 * 1024)
    with serve_live(llm, app) as live:
        yield live


def _no_abort(response) -> None:
    """A 200 must carry a real answer: no choice the engine dropped (finish_reason "abort")."""
    if response.status_code != 200 or not response.request.url.endswith(("/completions",)):
        return
    text = response.text
    if text.startswith("data: "):
        bodies = [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: {")]
    else:
        bodies = [json.loads(text)]
    for body in bodies:
        assert "error" not in body, body
        for choice in body.get("choices", []):
            assert choice.get("finish_reason") not in ("abort", "error"), body


@pytest.mark.slow  # schemathesis, ~50 s
@pytest.mark.parametrize("mode", list(EXAMPLES), ids=lambda m: m.value)
def test_the_served_schema_fuzzed_finds_no_server_error_and_leaves_the_engine_idle(live, mode):
    schema = schemathesis.openapi.from_url(live.base_url + "/openapi.json")
    operations = [r.ok() for r in schema.get_all_operations()]
    paths = {op.path for op in operations}
    assert {"/v1/completions", "/v1/chat/completions", "/v1/models", "/v1/load_lora_adapter"} <= paths
    headers = {"Authorization": f"Bearer {KEY}"}
    ok_generations = 0
    for op in operations:
        if mode is GenerationMode.NEGATIVE and not list(op.body):
            continue  # nothing to break in a GET without parameters
        @settings(max_examples=EXAMPLES[mode], derandomize=True, database=None, deadline=None,
                  suppress_health_check=list(HealthCheck), phases=[hypothesis.Phase.generate])
        @given(case=op.as_strategy(generation_mode=mode))
        def run(case) -> None:
            nonlocal ok_generations
            body = case.body if isinstance(case.body, dict) else {}
            if case.path == "/v1/unload_lora_adapter" and body.get("lora_name") == "a0":
                body["lora_name"] = "not-a0"  # keep the adapter the generation cases use
            if case.path.endswith("completions") and isinstance(body.get("model"), str):
                body["model"] = ("tiny", "a0")[len(json.dumps(body, default=str)) % 2]  # served models, not 404s
            response = case.call_and_validate(base_url=live.base_url, headers=headers, checks=CHECKS, timeout=60)
            _no_abort(response)
            ok_generations += case.path.endswith("completions") and response.status_code == 200

        run()
    print(f"fuzz ({mode.value}): {ok_generations} generation cases answered 200")
    if mode is GenerationMode.POSITIVE:  # the run reached the engine, not only the validators
        assert ok_generations >= 10, ok_generations
    live.wait_idle(timeout=30)
    eng = live.llm.engine
    assert live.on_engine(lambda: (len(eng.running), len(eng.waiting))) == (0, 0)
