"""StepListener: what each engine step did and where its host time went, for benchmarks and tracing.

    engine.add_step_listener(listener)     # LLMEngine; `llm.engine` of an LLM
    engine.remove_step_listener(listener)

A listener's methods run on the engine's thread, inside the step: keep them cheap. With no
listener the engine takes no timestamps. `jlora bench tpu` records each step's shape and device
time (its decode steps against the HBM roofline) and the host's share per phase through this.
"""

from __future__ import annotations

from typing import Any

# The phases of an engine step a listener is told about (`phase`), in the order they run:
# planning (`Scheduler.schedule`), writing the adapters the plan admitted into their device slots
# (host to device; dispatched, not waited for), building the batch's host arrays, launching it (packing,
# transfers, dispatch), waiting for the device, reading its outputs back, booking the step in the
# scheduler, processing the tokens (text, stops, outputs).
PHASES = ("schedule", "write_slots", "build_batch", "launch", "wait_device", "read_outputs", "commit", "process")


class StepListener:
    """Override what you need; every method does nothing here."""

    def step_started(self) -> None:
        """`LLMEngine.step()` began."""

    def step_finished(self, seconds: float) -> None:
        """`LLMEngine.step()` returns after `seconds` of wall time."""

    def phase(self, name: str, seconds: float) -> None:
        """A phase of the current step (`PHASES`) took `seconds`; several calls of one phase in a
        step (a step launched ahead of the next: two launches) each report."""

    def launched(self, batch: dict[str, Any], handle: Any, prev: Any, started: float) -> None:
        """A step went to the device: its host `batch` (`ModelRunner.build_batch`'s arrays), the
        handle `collected` will get, the step whose tokens it takes on the device (`prev`, async
        scheduling; None else), and when the launch began (`time.perf_counter()`)."""

    def collected(self, handle: Any, started: float, done: float) -> None:
        """The step of `handle` finished: its outputs were waited for from `started` and were on the
        host at `done` (`time.perf_counter()`)."""
