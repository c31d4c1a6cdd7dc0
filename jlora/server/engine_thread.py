"""The one thread that owns the LLMEngine: it runs commands from the HTTP side and drives `step()`.

LLMEngine is not thread-safe, so every engine call happens here. The asyncio side talks to it
through a command queue (`call`, `submit`, `abort`) and gets each request's progress back through
a callback that this thread invokes after every step (the callback hands it to the event loop).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import queue
import threading
import time
from typing import Any, Callable

from jlora import compile_stats
from jlora.adapters.manager import AdapterHandle
from jlora.adapters.request import LoRARequest
from jlora.engine.llm_engine import QueueFullError
from jlora.outputs import RequestOutput
from jlora.sampling_params import SamplingParams
from jlora.server.metrics import ServerMetrics

log = logging.getLogger("jlora.server")

_IDLE_WAIT_S = 0.05  # how long an idle engine thread sleeps on the command queue before checking for stop


class ShuttingDown(RuntimeError):
    """The server is stopping and takes no new requests."""


@dataclasses.dataclass
class Update:
    """Progress of one engine request, sent after a step that changed it."""

    index: int  # which prompt of the HTTP request
    deltas: list[str]  # new text per sample since the previous update
    output: RequestOutput  # the state so far (final when `finished`)
    finished: bool


@dataclasses.dataclass
class _Sink:
    callback: Callable[[Update], None]
    index: int
    received: float  # when the HTTP request arrived, for TTFT / latency metrics


class EngineThread:
    def __init__(self, llm: Any, metrics: ServerMetrics):
        self.llm = llm
        self.engine = llm.engine
        self.metrics = metrics
        self._cmds: queue.SimpleQueue = queue.SimpleQueue()
        self._sinks: dict[str, _Sink] = {}
        self._stopping = False
        self._deadline = float("inf")
        self._compiles_at_start = compile_stats.compile_count(exclude=(compile_stats.BACKGROUND,))
        self.heartbeat = time.monotonic()  # the engine thread's last sign of progress (each loop turn)
        self._thread = threading.Thread(target=self._run, name="jlora-engine", daemon=True)

    # ---- called from any thread ---------------------------------------------------------------------

    def start(self) -> None:
        # warm-up is over by now, but for a background one's compiles (not counted: no step waits for them)
        self._compiles_at_start = compile_stats.compile_count(exclude=(compile_stats.BACKGROUND,))
        self._update_snapshot()
        self._thread.start()

    def call(self, fn: Callable[[], Any]) -> concurrent.futures.Future:
        """Run `fn()` on the engine thread between steps; the future holds its result or exception."""
        fut: concurrent.futures.Future = concurrent.futures.Future()
        if not self._thread.is_alive():
            fut.set_exception(ShuttingDown("the engine is not running"))
            return fut
        self._cmds.put((fn, fut))
        return fut

    def submit(self, request_ids: list[str], prompts: list[dict[str, Any]], params: SamplingParams,
               lora: LoRARequest | None, callback: Callable[[Update], None],
               received: float, lora_handle: AdapterHandle | None = None) -> concurrent.futures.Future:
        """Queue one engine request per prompt, all or none (ValueError names what was wrong).
        `lora_handle`: `lora` as converted off this thread (`adapters.prepare_async`)."""
        return self.call(lambda: self._submit(request_ids, prompts, params, lora, callback, received, lora_handle))

    def abort(self, request_ids: list[str]) -> None:
        """Abort and drop requests (a client went away); their KV blocks and slot pins are freed."""
        self.call(lambda: self._abort(request_ids, "abort"))

    def begin_stop(self, grace_s: float = 0.0) -> None:
        """Take no new requests; let running ones finish for up to `grace_s`, then abort the rest
        (their clients get a last update with finish_reason "abort") and end the thread."""
        if self._thread.is_alive():
            self._cmds.put((self._begin_stop(grace_s), None))

    def stop(self, grace_s: float = 0.0, timeout: float | None = None) -> bool:
        """`begin_stop(grace_s)` and wait up to `timeout` s (None: for ever) for the thread to end.
        False if it is still running (wedged in a step): the caller decides what to do."""
        self.begin_stop(grace_s)
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def seconds_since_progress(self) -> float:
        return time.monotonic() - self.heartbeat

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    @property
    def compiles_after_start(self) -> int:
        return compile_stats.compile_count(exclude=(compile_stats.BACKGROUND,)) - self._compiles_at_start

    # ---- the engine thread ----------------------------------------------------------------------------

    def _begin_stop(self, grace_s: float) -> Callable[[], None]:
        def begin() -> None:  # a second call can only bring the deadline closer
            self._stopping = True
            self._deadline = min(self._deadline, time.monotonic() + grace_s)
        return begin

    def _run(self) -> None:
        eng = self.engine
        stalled = False  # the last step changed nothing and nothing runs: don't spin on it
        while True:
            self.heartbeat = time.monotonic()
            busy = eng.has_unfinished() and not stalled
            if self._run_commands(timeout=None if busy else _IDLE_WAIT_S):
                # A command may have stepped the engine itself (an offline LLM.generate on this
                # thread): what it advanced of our requests is delivered now.
                self._deliver({rid: out for rid in list(self._sinks) if (out := eng.get_output(rid)) is not None})
            if self._stopping and (not eng.has_unfinished() or time.monotonic() >= self._deadline):
                self._finish_all("abort")
                self._update_snapshot()
                self._fail_pending_commands()
                return
            try:
                stalled = False
                if eng.has_unfinished():
                    changed = {o.request_id: o for o in eng.step()}
                    self._deliver(changed)
                    stalled = not changed and eng.stats().running == 0
                self._update_snapshot()
            except Exception as e:  # a bug outside the step's own isolation: end what is running, go on
                log.exception("engine scheduling failed; aborting the running requests")
                self._finish_all("error", f"the engine step failed: {type(e).__name__}: {e}")

    def _run_commands(self, timeout: float | None) -> bool:
        """Run the queued commands; wait up to `timeout` s for the first one (None: don't wait).
        True if any ran."""
        try:
            item = self._cmds.get(timeout=timeout) if timeout else self._cmds.get_nowait()
        except queue.Empty:
            return False
        while True:
            fn, fut = item
            if fut is None:
                fn()
            elif fut.set_running_or_notify_cancel():
                try:
                    fut.set_result(fn())
                except BaseException as e:  # handed to the caller
                    fut.set_exception(e)
            try:
                item = self._cmds.get_nowait()
            except queue.Empty:
                return True

    def _fail_pending_commands(self) -> None:
        while True:
            try:
                _, fut = self._cmds.get_nowait()
            except queue.Empty:
                return
            if fut is not None and fut.set_running_or_notify_cancel():
                fut.set_exception(ShuttingDown("the server is shutting down"))

    def _submit(self, request_ids: list[str], prompts: list[dict[str, Any]], params: SamplingParams,
                lora: LoRARequest | None, callback: Callable[[Update], None], received: float,
                lora_handle: AdapterHandle | None = None) -> None:
        if self._stopping:
            raise ShuttingDown("the server is shutting down")
        eng, added = self.engine, []
        cap, total, waiting = eng.config.max_waiting_seqs, len(prompts) * params.n, eng.stats().waiting
        if cap is not None and waiting + total > cap:  # all or none, so check before adding any
            raise QueueFullError(f"{waiting} sequences are waiting and this request adds {total}; "
                                 f"max_waiting_seqs={cap}")
        try:
            for rid, prompt in zip(request_ids, prompts):
                added.append(eng.add_request(prompt, params, lora, request_id=rid, lora_handle=lora_handle))
        except Exception:
            for rid in added:  # all or none: a bad prompt leaves the engine as it was
                eng.abort(rid)
                eng.pop_finished(rid)
            raise
        for i, rid in enumerate(added):
            self._sinks[rid] = _Sink(callback, i, received)

    def _abort(self, request_ids: list[str], status: str) -> None:
        for rid in request_ids:
            sink = self._sinks.pop(rid, None)
            if self.engine.abort(rid) is not None:
                out = self.engine.pop_finished(rid)
                if sink is not None:
                    self._record(out, sink, status)

    def _finish_all(self, status: str, error: str | None = None) -> None:
        """Abort everything still in flight and tell each client: its stream ends with `abort`, or,
        with an `error`, as a failed request (finish_reason "error"; a whole reply is a 500)."""
        changed = {rid: out for rid in list(self._sinks) if (out := self.engine.abort(rid)) is not None}
        self._deliver(changed, status, error)

    def _deliver(self, changed: dict[str, RequestOutput], abort_status: str = "abort",
                 error: str | None = None) -> None:
        """Send each changed request's update to its client; a finished one is popped and recorded
        (`error`: what ended the aborted ones, given to their clients as the engine's error)."""
        eng = self.engine
        for rid, out in changed.items():
            sink = self._sinks.get(rid)
            if sink is None:  # not ours (an offline call on this thread), or already aborted
                continue
            deltas = eng.stream_deltas(rid)
            if out.finished:
                out = eng.pop_finished(rid)
                del self._sinks[rid]
                if error is not None and out.error is None:
                    out.error = error
                    for o in out.outputs:
                        o.finish_reason = "error" if o.finish_reason == "abort" else o.finish_reason
                reason = out.outputs[0].finish_reason or "abort"
                self._record(out, sink, abort_status if reason == "abort" else reason)
            try:
                sink.callback(Update(sink.index, deltas, out, out.finished))
            except Exception:  # the event loop is gone (shutdown); the request is done anyway
                log.debug("could not deliver an update for %s", rid, exc_info=True)

    def _record(self, out: RequestOutput, sink: _Sink, status: str) -> None:
        m = out.metrics
        if m is None:
            return
        self.metrics.request_done(status, m.num_prompt_tokens, m.num_generated_tokens, sink.received,
                                  m.first_token_time, m.finished_time or time.time())

    def _update_snapshot(self) -> None:
        st = self.engine.stats()
        self.metrics.set_engine_snapshot({
            "running": st.running,
            "waiting": st.waiting,
            "kv_blocks_used": st.kv_blocks_used,
            "kv_blocks_total": st.kv_blocks_total,
            "lora_resident": st.lora_resident,
            "lora_slot_hits": st.lora.get("slot_hits", 0),
            "lora_disk_loads": st.lora.get("disk_loads", 0),
            "lora_host_hits": st.lora.get("host_hits", 0),
            "lora_slot_writes": st.lora.get("slot_writes", 0),
            "lora_evictions": st.lora.get("evictions", 0),
            "preemptions": st.num_preemptions,
            "prefix_cache_queries": st.prefix_cache_queries,
            "prefix_cache_hits": st.prefix_cache_hits,
            "kv_blocks_cached": st.kv_blocks_cached,
            "compiles_after_warmup": self.compiles_after_start,
        })
