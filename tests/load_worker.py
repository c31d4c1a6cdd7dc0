"""Loads one checkpoint in a process of its own and prints what it cost the host (peak RSS is per
process, so each measurement needs a fresh one); tests/test_streaming_loader.py asserts on it.

    python tests/load_worker.py new|old CHECKPOINT float32|bfloat16 none|int8 [WEIGHTS_CACHE_DIR]

`new`: the streaming loader (`load_model`); `old`: today's eager loader before it
(tests/loader_reference.py: read_hf_checkpoint + build_model). JAX is started and has compiled a
trivial graph before the measurement starts, so its one-time start-up is not counted.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

os.environ["JAX_PLATFORMS"] = "cpu"
sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parent)]

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from flax import nnx  # noqa: E402

from jlora.models import streaming  # noqa: E402
from jlora.models.loading import load_model  # noqa: E402


def main() -> None:
    mode, ckpt, dtype, quantization = sys.argv[1:5]
    cache = sys.argv[5] if len(sys.argv) > 5 else False
    dtype = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}[dtype]
    quantization = None if quantization == "none" else quantization
    jax.jit(lambda x: x + 1)(jnp.zeros(4)).block_until_ready()  # JAX's own start-up, before the baseline
    if mode == "new":
        model, _, _ = load_model(ckpt, dtype, weights_cache=cache, quantization=quantization)
        stats = model.load_stats
    else:
        import loader_reference as ref

        def load():
            cfg, tensors = ref.read_hf_checkpoint(ckpt)
            return jax.block_until_ready(ref.build_model(cfg, tensors, dtype, quantization))

        model, stats = streaming.timed_load(load, "reference")
    leaves = jax.tree.leaves(nnx.state(model, nnx.Param))
    layered = jax.tree.leaves(nnx.state(model.layers, nnx.Param))
    layers = model.cfg.num_hidden_layers
    print("RESULT " + json.dumps({**stats.to_dict(), "device_bytes": sum(int(x.nbytes) for x in leaves),
                                  "layer_bytes": sum(int(x.nbytes) for x in layered) // layers,
                                  "rss_after_bytes": streaming.host_rss_bytes()}))


if __name__ == "__main__":
    main()
