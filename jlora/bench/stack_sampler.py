"""Where a start-up's wall time goes, thread by thread, including C++ calls that keep the GIL.

A daemon thread wakes every `interval` seconds and records each thread's innermost frames. It
needs the GIL to run, so a sample that comes late means some thread held the GIL all along (a
C++ call that does not release it, or Python code that did not yield): `StackSampler.report`
lists those gaps with the stacks on each side, and charges each thread's time to its innermost
frames. Used by `jlora bench tpu --sections warm --sample-stacks` on the chip, where a warm start's
seconds are spent in the TPU runtime's start, imports and executable loads side by side.
"""
from __future__ import annotations

import sys
import threading
import time
from collections import Counter
from typing import Any


def _frames(frame: Any, depth: int) -> list[str]:
    """The innermost `depth` frames as `module-file:function`, innermost first."""
    out = []
    while frame is not None and len(out) < depth:
        code = frame.f_code
        path = code.co_filename
        short = path.rsplit("site-packages/", 1)[-1].rsplit("/work/", 1)[-1]
        out.append(f"{short}:{code.co_name}:{frame.f_lineno}")
        frame = frame.f_back
    return out


class StackSampler:
    """Samples every thread's stack from a daemon thread (`start`, `stop`, `report`)."""

    def __init__(self, interval: float = 0.01, depth: int = 8):
        self.interval, self.depth = interval, depth
        self.samples: list[tuple[float, dict[str, list[str]]]] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.t0 = 0.0

    def start(self) -> "StackSampler":
        self.t0 = time.perf_counter()
        self._thread = threading.Thread(target=self._run, name="jlora-stack-sampler", daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        me = threading.get_ident()
        while not self._stop.is_set():
            names = {t.ident: t.name for t in threading.enumerate()}
            now = time.perf_counter() - self.t0
            stacks = {names.get(ident, str(ident)): _frames(frame, self.depth)
                      for ident, frame in sys._current_frames().items() if ident != me}
            self.samples.append((now, stacks))
            time.sleep(self.interval)

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def report(self, min_gap: float = 0.1, top: int = 25) -> dict[str, Any]:
        """Gaps longer than `min_gap` (the GIL held elsewhere) with the stacks before and after, and
        per thread the seconds charged to its innermost frame and to each frame on its stack (an interval
        is charged to the stacks at its start, which for a gap may be just before the call that held the
        GIL: read a gap's `after` stacks too)."""
        gaps = []
        inner: dict[str, Counter] = {}
        anywhere: dict[str, Counter] = {}
        for (t_prev, before), (t, after) in zip(self.samples, self.samples[1:]):
            dt = t - t_prev
            if dt >= min_gap:
                gaps.append({"at_s": round(t_prev, 3), "gap_s": round(dt, 3),
                             "before": {k: v[:4] for k, v in before.items()},
                             "after": {k: v[:4] for k, v in after.items()}})
            for name, frames in before.items():  # the interval is charged to what ran at its start
                if frames:
                    inner.setdefault(name, Counter())[frames[0]] += dt
                    for f in dict.fromkeys(frames):
                        anywhere.setdefault(name, Counter())[f] += dt
        return {
            "seconds": round(self.samples[-1][0], 3) if self.samples else 0.0,
            "samples": len(self.samples),
            "gaps": sorted(gaps, key=lambda g: -g["gap_s"])[:top],
            "gil_held_elsewhere_s": round(sum(g["gap_s"] for g in gaps), 3),
            "innermost": {n: [(f, round(s, 3)) for f, s in c.most_common(top)] for n, c in inner.items()},
            "on_stack": {n: [(f, round(s, 3)) for f, s in c.most_common(top)] for n, c in anywhere.items()},
        }
