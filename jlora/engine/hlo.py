"""Reading a compiled step graph's HLO: what a layout change of the KV cache looks like there.

`whole_cache_copies` is how the tests (tests/test_attention_tpu.py, tests/test_kv_int8.py) and the
benches (`jlora bench tpu`, `jlora bench tpu-compile`) hold a compiled step to having no
whole-cache copy; it reads HLO text only and knows nothing of the runner.
"""

from __future__ import annotations

import re


def whole_cache_copies(hlo_text: str, cache_shape: tuple[int, ...]) -> list[str]:
    """Instructions of a compiled step's HLO that produce a whole-cache-sized array by a copy, a
    transpose or a fusion named for one: XLA changing the cache's layout, which costs a full read
    and write of the cache each time (on a TPU v5e, 25 of a 40 ms decode step before the cache
    became [L, NB, bs, KVH*Dh]). The serving step must have none."""
    dims = ",".join(str(d) for d in cache_shape)
    pattern = re.compile(rf"%?([\w.-]+) = \w+\[{dims}\](\{{[^}}]*\}})? ([\w-]+)\(")
    out = []
    for line in hlo_text.splitlines():
        m = pattern.search(line)
        if m and (m.group(3) in ("copy", "transpose") or "copy" in m.group(1) or "transpose" in m.group(1)):
            out.append(line.strip()[:240])
    return out
