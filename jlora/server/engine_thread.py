"""The one thread that owns the LLMEngine: it runs commands from the HTTP side and drives `step()`.

LLMEngine is not thread-safe, so every engine call happens here. The asyncio side talks to it
through a command queue (`call`, `submit`, `abort`) and gets each request's progress back through
a callback that this thread invokes after every step (the callback hands it to the event loop).

The engine isolates failures inside a step (a row that cannot be built or sampled, a device step
that raises) on its own. What raises here outside that isolation fails only the requests it must,
and the thread goes on serving: handing one request its update fails that request alone; a step
that raises in the scheduler or in the engine's bookkeeping fails the request the raising code was
handling (the `Sequence` or `Request` in the innermost frame of the traceback that holds one), or,
when none can be named or the same failure repeats, the requests that were running.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import queue
import threading
import time
import types
from typing import Any, Callable

from jlora import compile_stats
from jlora.adapters.host_store import AdapterHandle
from jlora.adapters.request import LoRARequest
from jlora.engine.llm_engine import QueueFullError
from jlora.engine.sequence import Request, Sequence
from jlora.outputs import CompletionOutput, RequestOutput
from jlora.sampling_params import SamplingParams
from jlora.server.metrics import ServerMetrics

log = logging.getLogger("jlora.server")

_IDLE_WAIT_S = 0.05  # how long an idle engine thread sleeps on the command queue before checking for stop
# A step that raised outside the engine's isolation fails its culprit; when steps keep raising
# (the culprit was not it, or none could be named) this many times in a row, every running
# request is failed, and after twice as many everything in flight, so the thread never spins.
_REPEATS_BEFORE_RUNNING = 3


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
    n: int = 1  # samples per prompt (a failure the engine cannot describe still ends each of them)


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
        self.waiting = 0  # sequences waiting for admission at the last snapshot (read from any thread)
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
        stalled = False  # the last step changed nothing and nothing runs: don't spin on it
        failures = 0  # steps in a row that raised outside the engine's isolation
        while True:
            try:
                done, stalled, failures = self._turn(stalled, failures)
            except Exception:  # a bug in this loop's own bookkeeping: log it, keep serving
                log.exception("the engine thread's loop failed; going on")
                time.sleep(_IDLE_WAIT_S)  # the same failure must not spin a core
                done = False
            if done:
                return

    def _turn(self, stalled: bool, failures: int) -> tuple[bool, bool, int]:
        """One loop turn: commands, then one step. Returns (the thread is done, stalled, failures)."""
        eng = self.engine
        if failures and not eng.has_unfinished():  # the failing requests are gone: start afresh
            failures = 0
        if failures == 0:  # steps that keep raising are no progress: /health goes 503 after a while
            self.heartbeat = time.monotonic()
        elif failures >= _REPEATS_BEFORE_RUNNING:
            time.sleep(_IDLE_WAIT_S)  # a broken engine must not spin a core
        busy = eng.has_unfinished() and not stalled
        if self._run_commands(timeout=None if busy else _IDLE_WAIT_S):
            # A command may have stepped the engine itself (an offline LLM.generate on this
            # thread): what it advanced of our requests is delivered now.
            self._deliver(self._outputs_of(list(self._sinks)))
        if self._stopping and (not eng.has_unfinished() or time.monotonic() >= self._deadline):
            self._finish_all("abort")
            self._update_snapshot()
            self._fail_pending_commands()
            return True, stalled, failures
        stalled = False
        if eng.has_unfinished():
            running = self._running_ids()
            try:
                changed = {o.request_id: o for o in eng.step()}
            except Exception as e:  # outside the step's own isolation: fail the culprit, go on
                failures += 1
                self._step_raised(e, running, failures)
                return False, stalled, failures
            failures = 0
            self._deliver(changed)
            stalled = not changed and eng.stats().running == 0
        self._update_snapshot()
        return False, stalled, failures

    def _outputs_of(self, request_ids: list[str]) -> dict[str, RequestOutput]:
        out = {}
        for rid in request_ids:
            try:
                o = self.engine.get_output(rid)
            except Exception as e:  # this request's state cannot be read: it alone fails
                self._fail(rid, f"reading its state failed: {type(e).__name__}: {e}")
                continue
            if o is not None:
                out[rid] = o
        return out

    def _running_ids(self) -> list[str]:
        """The requests with a sequence in the engine's running batch."""
        try:
            return list(dict.fromkeys(s.request_id for s in self.engine.scheduler.running))
        except Exception:  # noqa: BLE001 (an engine without a scheduler to read: no batch to name)
            return []

    def _step_raised(self, e: Exception, running_before: list[str], failures: int) -> None:
        """`engine.step()` raised outside its own isolation: fail the request the raising code was
        handling; when none can be named, or steps keep raising, the running batch; past twice
        that, everything in flight (the engine may be broken for everyone)."""
        error = f"the engine step failed: {type(e).__name__}: {e}"
        culprits = culprit_requests(e.__traceback__)
        if failures >= 2 * _REPEATS_BEFORE_RUNNING:
            log.error("engine steps keep failing (%d in a row); aborting every request", failures, exc_info=e)
            self._finish_all("error", error)
            return
        if not culprits or failures >= _REPEATS_BEFORE_RUNNING:
            culprits = list(dict.fromkeys(running_before + self._running_ids())) or culprits
        if not culprits:  # nothing runs and nothing can be named: the head of the queue was being admitted
            culprits = list(self._sinks)[:1] or list(getattr(self.engine, "requests", {}))[:1]
        log.error("an engine step failed outside its isolation; failing %s", culprits, exc_info=e)
        for rid in culprits:
            self._fail(rid, error)
        # What the step did before it raised (a request it finished) reaches its client now.
        self._deliver(self._outputs_of(list(self._sinks)))
        self._update_snapshot()

    def _run_commands(self, timeout: float | None) -> bool:
        """Run the queued commands; wait up to `timeout` s for the first one (None: don't wait).
        True if any ran."""
        try:
            item = self._cmds.get(timeout=timeout) if timeout else self._cmds.get_nowait()
        except queue.Empty:
            return False
        while True:
            fn, fut = item
            item = None
            if fut is None:
                fn()
            elif fut.set_running_or_notify_cancel():
                try:
                    fut.set_result(fn())
                except BaseException as e:  # handed to the caller
                    fut.set_exception(e)
            # A failed command's traceback holds this frame: were the future (which holds the
            # failure) still a local here, the cycle would keep the engine until a full collection.
            fn = fut = None
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
            self._sinks[rid] = _Sink(callback, i, received, params.n)

    def _abort(self, request_ids: list[str], status: str) -> None:
        for rid in request_ids:
            sink = self._sinks.pop(rid, None)
            try:
                out = self.engine.pop_finished(rid) if self.engine.abort(rid) is not None else None
            except Exception:  # noqa: BLE001 (its client has gone; the others go on)
                log.exception("could not abort request %s", rid)
                continue
            if out is not None and sink is not None:
                self._record(out, sink, status)

    def _finish_all(self, status: str, error: str | None = None) -> None:
        """Abort everything still in flight and tell each client: its stream ends with `abort`, or,
        with an `error`, as a failed request (finish_reason "error"; a whole reply is a 500)."""
        changed = {}
        for rid in list(self._sinks):
            try:
                out = self.engine.abort(rid)
            except Exception as e:  # noqa: BLE001 (this one cannot be aborted: it is failed, the rest go on)
                self._fail(rid, error or f"aborting it failed: {type(e).__name__}: {e}")
                continue
            if out is not None:
                changed[rid] = out
        self._deliver(changed, status, error)

    def _deliver(self, changed: dict[str, RequestOutput], abort_status: str = "abort",
                 error: str | None = None) -> None:
        """Send each changed request's update to its client; a finished one is popped and recorded
        (`error`: what ended the aborted ones, given to their clients as the engine's error).
        Handing one request its update can fail only that request."""
        for rid, out in changed.items():
            sink = self._sinks.get(rid)
            if sink is None:  # not ours (an offline call on this thread), or already aborted
                continue
            try:
                update = self._update(rid, out, sink, abort_status, error)
            except Exception as e:
                log.exception("handing request %s its update failed; failing it alone", rid)
                self._fail(rid, f"handing it its output failed: {type(e).__name__}: {e}")
                continue
            self._send(rid, sink, update)

    def _update(self, rid: str, out: RequestOutput, sink: _Sink, abort_status: str, error: str | None) -> Update:
        eng = self.engine
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
        return Update(sink.index, deltas, out, out.finished)

    def _send(self, rid: str, sink: _Sink, update: Update) -> None:
        try:
            sink.callback(update)
        except Exception:  # the event loop is gone (shutdown); the request is done anyway
            log.debug("could not deliver an update for %s", rid, exc_info=True)

    def _fail(self, rid: str, error: str) -> None:
        """End request `rid` as failed (finish_reason "error", `error` its message), whatever state
        the engine is in: its client always gets a last update, and the engine drops it if it can."""
        sink = self._sinks.pop(rid, None)
        out = None
        try:
            if self.engine.abort(rid) is not None:
                out = self.engine.pop_finished(rid)
        except Exception:  # noqa: BLE001 (the engine cannot drop it: its client still hears)
            log.exception("could not drop request %s from the engine", rid)
        if sink is None:
            return
        if out is None or len(out.outputs) != sink.n:
            out = RequestOutput(rid, None, [], [CompletionOutput(i, "", []) for i in range(sink.n)], True)
        out.finished, out.error = True, out.error or error
        for o in out.outputs:
            if o.finish_reason in (None, "abort"):
                o.finish_reason = "error"
        try:
            self._record(out, sink, "error")
        except Exception:  # noqa: BLE001 (metrics only)
            log.debug("could not record request %s", rid, exc_info=True)
        self._send(rid, sink, Update(sink.index, [""] * len(out.outputs), out, True))

    def _record(self, out: RequestOutput, sink: _Sink, status: str) -> None:
        m = out.metrics
        if m is None:
            return
        self.metrics.request_done(status, m.num_prompt_tokens, m.num_generated_tokens, sink.received,
                                  m.first_token_time, m.finished_time or time.time())

    def _update_snapshot(self) -> None:
        try:
            st = self.engine.stats()
        except Exception:  # noqa: BLE001 (metrics only: the last snapshot stays)
            log.exception("reading the engine's stats failed")
            return
        self.waiting = st.waiting
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


def culprit_requests(tb: types.TracebackType | None) -> list[str]:
    """The request ids the innermost frame of `tb` that holds a `Sequence` or `Request` in a local
    variable was handling (the scheduler's `seq`, the output loop's `s`); [] when no frame does.

    The first frame (the caller's, which caught the exception) is not read: reading `f_locals`
    stores a snapshot of the locals on the frame, and the caller's holds the exception, whose
    traceback holds that frame: a reference cycle that kept the engine until a full collection."""
    frames = []
    tb = tb.tb_next if tb is not None else None
    while tb is not None:
        frames.append(tb.tb_frame)
        tb = tb.tb_next
    for frame in reversed(frames):
        ids = [v.request_id for v in frame.f_locals.values() if isinstance(v, (Sequence, Request))]
        if ids:
            return list(dict.fromkeys(ids))
    return []
