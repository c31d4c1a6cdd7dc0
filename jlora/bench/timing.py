"""Isolated timing: interleaved calls (one call of each variant per round, so a busy machine's slow
spells fall on every variant alike) and a decoder step's inputs."""

from __future__ import annotations

import statistics
import time
from typing import Any, Callable


def interleaved_ms(calls: dict[str, Callable[[], Any]], reps: int) -> dict[str, dict[str, float]]:
    """{"median": {name: ms}, "min": {name: ms}} over `reps` rounds; each call's result is blocked on."""
    times: dict[str, list[float]] = {k: [] for k in calls}
    for _ in range(reps):
        for k, call in calls.items():
            start = time.perf_counter()
            out = call()
            if hasattr(out, "block_until_ready"):
                out.block_until_ready()
            times[k].append(time.perf_counter() - start)
    return {name: {k: stat(v) * 1e3 for k, v in times.items()} for name, stat in (("median", statistics.median),
                                                                                   ("min", min))}


def decode_inputs(cfg: Any, rows: int = 16, slots: int = 4, context: int = 48) -> tuple[Any, ...]:
    """A decoder step's inputs for isolated timing: (cache, tokens i32[rows], one AttnGroup of
    `rows` decode rows at position `context`, slot ids round-robin over `slots`)."""
    import jax.numpy as jnp
    import numpy as np

    from jlora.models.llama import AttnGroup, init_cache

    cache = init_cache(cfg, 64, 16)
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, cfg.vocab_size, rows), jnp.int32)
    group = AttnGroup(jnp.full((rows, 1), context, jnp.int32),
                      jnp.asarray(np.arange(rows * 4).reshape(rows, 4) % 64, jnp.int32))
    slot_ids = jnp.asarray([i % slots for i in range(rows)], jnp.int32)
    return cache, tokens, group, slot_ids
