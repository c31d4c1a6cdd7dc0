"""The start-up stack sampler (`jlora.bench.stack_sampler`): a C call that kept the GIL is a gap in
its samples, placed in time, with the stacks on its sides."""
import threading
import time

from jlora.bench.stack_sampler import StackSampler


def _hold_the_gil() -> int:
    # sum over a range runs in C without giving up the GIL: the sampler cannot wake meanwhile
    return sum(range(40_000_000))


def _sleep_in_a_thread(stop: threading.Event) -> None:
    while not stop.is_set():
        time.sleep(0.005)


def test_a_call_that_keeps_the_gil_is_a_gap_with_its_stack():
    stop = threading.Event()
    sleeper = threading.Thread(target=_sleep_in_a_thread, args=(stop,), name="sleeper")
    sleeper.start()
    sampler = StackSampler(interval=0.005).start()
    time.sleep(0.1)
    t = time.perf_counter()
    _hold_the_gil()
    t_end = time.perf_counter()
    held = t_end - t
    time.sleep(0.1)
    sampler.stop()
    stop.set()
    sleeper.join()
    report = sampler.report(min_gap=held / 2)
    assert report["samples"] > 20 and report["seconds"] >= 0.2 + held * 0.9
    gap = report["gaps"][0]
    # the gap spans the call (the samples on its sides are taken before and after it)
    assert gap["gap_s"] >= held * 0.95
    assert gap["at_s"] <= t - sampler.t0 + 0.01 and gap["at_s"] + gap["gap_s"] >= t_end - sampler.t0 - 0.01
    assert any("test_a_call_that_keeps_the_gil" in f for f in gap["before"]["MainThread"] + gap["after"]["MainThread"])
    assert report["gil_held_elsewhere_s"] >= gap["gap_s"]
    assert any("_sleep_in_a_thread" in f for f, _ in report["on_stack"]["sleeper"])


def test_an_idle_process_has_no_gaps():
    sampler = StackSampler(interval=0.005).start()
    time.sleep(0.2)
    sampler.stop()
    report = sampler.report(min_gap=0.1)
    assert report["gaps"] == [] and report["gil_held_elsewhere_s"] == 0
    assert report["samples"] >= 10
