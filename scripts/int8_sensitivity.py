"""How far int8 activations (W8A8) carry a float32 rounding difference, against float32 and W8A16.

    python scripts/int8_sensitivity.py MODEL.gguf out.json [none,int8-weight-only,int8]

For each quantization: the model's logits on 4 random 96-token prompts (one prefill, "highest"
matmul precision) on the default device and on the CPU device of the same process, and each
against itself with the first layer norm's weights scaled by 1 + 1e-7 (a few float32 ulps).
Teacher-forced top-1 agreement and |dlogprob| for each pair; quantized logits against float32's.
docs/tpu.md gives what it measured on a v5e chip.
"""
from __future__ import annotations

import json
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jlora.models import llama
from jlora.models.loading import load_model

T, EPS = 96, 1e-7


def logits(model: llama.Llama, device: jax.Device, tokens: np.ndarray, perturb: float = 0.0) -> np.ndarray:
    graphdef, state = nnx.split(model)

    def f(state, tok, pos):
        m = nnx.merge(graphdef, state)
        if perturb:
            m.layers.input_layernorm[...] = m.layers.input_layernorm[...].at[0].multiply(1 + perturb)
        return m(tok, pos, llama.init_cache(m.cfg, tok.shape[0], tok.shape[1]))[0]

    pos = np.broadcast_to(np.arange(tokens.shape[1], dtype=np.int32), tokens.shape)
    with jax.default_matmul_precision("highest"):
        return np.asarray(jax.jit(f)(*jax.device_put((state, tokens, pos), device)))


def agreement(a: np.ndarray, b: np.ndarray) -> dict[str, float]:
    la = a - jax.nn.logsumexp(a, axis=-1, keepdims=True)
    lb = b - jax.nn.logsumexp(b, axis=-1, keepdims=True)
    d = np.abs(np.asarray(la - lb))
    return dict(top1=float((a.argmax(-1) == b.argmax(-1)).mean()), max_dlogprob=float(d.max()),
                mean_dlogprob=float(d.mean()))


def main(path: str, out: str, quantizations: list[str]) -> None:
    tokens = np.random.default_rng(0).integers(100, 40000, size=(4, T)).astype(np.int32)
    dev, cpu = jax.devices()[0], jax.devices("cpu")[0]
    res: dict[str, object] = dict(jax=jax.__version__, device=str(dev))
    base = None
    for q in quantizations:
        t0 = time.perf_counter()
        model, _, _ = load_model(path, jnp.float32, quantization=q)
        on_dev, on_cpu = logits(model, dev, tokens), logits(model, cpu, tokens)
        res[f"{q}: device vs cpu"] = agreement(on_dev, on_cpu)
        res[f"{q}: cpu vs cpu, one norm x (1+{EPS})"] = agreement(on_cpu, logits(model, cpu, tokens, EPS))
        if q == "none":
            base = on_cpu
        elif base is not None:
            res[f"{q} vs float32 (cpu)"] = agreement(on_cpu, base)
        res[f"{q}: seconds"] = time.perf_counter() - t0
        del model
        json.dump(res, open(out, "w"), indent=1)
    print(json.dumps(res, indent=1))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], (sys.argv[3] if len(sys.argv) > 3 else "none,int8-weight-only,int8").split(","))
