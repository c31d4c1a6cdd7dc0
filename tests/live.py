"""A live jlora server on 127.0.0.1 for tests: uvicorn in a thread, handles to the engine inside."""

from __future__ import annotations

import contextlib
import threading
import time
from typing import Any, Iterator

import httpx
import openai

from jlora import SamplingParams
from jlora.server.serve import bind, make_server

KEY = "sk-test-key"


class Live:
    """A running server and handles to its inside (engine calls go through the engine thread)."""

    def __init__(self, llm: Any, app: Any, base_url: str, server: Any = None, thread: threading.Thread | None = None):
        self.llm, self.app, self.base_url = llm, app, base_url
        self.server, self.thread = server, thread
        self.srv = app.state.server
        self.model_id = self.srv.model_id

    def on_engine(self, fn, timeout: float = 60.0):
        return self.srv.engine.call(fn).result(timeout)

    def offline(self, prompts, model: str | None, max_tokens: int, chat: bool = False) -> list:
        """LLM.generate / LLM.chat with the adapter's LoRARequest, run on the engine thread (greedy)."""
        lora = self.srv.adapters.get(model) if model else None
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        if chat:
            return self.on_engine(lambda: self.llm.chat(prompts, params, lora, use_tqdm=False))
        return self.on_engine(lambda: self.llm.generate(prompts, params, lora, use_tqdm=False))

    def client(self, key: str = KEY, **kw) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.base_url + "/v1", api_key=key, max_retries=0, timeout=60,
                             http_client=httpx.Client(trust_env=False), **kw)

    def http(self, timeout: httpx.Timeout | float = 60) -> httpx.Client:
        return httpx.Client(base_url=self.base_url, headers={"Authorization": f"Bearer {KEY}"}, timeout=timeout,
                            trust_env=False)

    def idle(self) -> bool:
        eng = self.llm.engine
        return self.on_engine(lambda: eng.kv.num_free == eng.config.num_kv_blocks and not eng.requests
                              and not eng.has_unfinished()
                              and all(eng.adapters.pins(s) == 0 for s in range(self.llm.config.max_loras)))

    def wait_idle(self, timeout: float = 20.0) -> None:
        deadline = time.monotonic() + timeout
        while not self.idle():
            assert time.monotonic() < deadline, "a finished or aborted request still holds resources"
            time.sleep(0.05)


@contextlib.contextmanager
def serve_live(llm: Any, app: Any, shutdown_timeout: float = 5) -> Iterator[Live]:
    """Run `app` on a free loopback port until the block ends (then stop it and check it stopped)."""
    sock = bind("127.0.0.1", 0)
    server = make_server(app, "127.0.0.1", 0, shutdown_timeout=shutdown_timeout, log_level="warning")
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "server did not start"
        time.sleep(0.02)
    yield Live(llm, app, f"http://127.0.0.1:{sock.getsockname()[1]}", server, thread)
    server.should_exit = True
    thread.join(30)
    assert not thread.is_alive()
