"""The cost of DoRA's factors in the decoder, isolated: one process, one compiled graph per state.

The SmolLM2-135M decoder's forward + logits over 16 decode tokens at ~48 cached positions, 4 adapters
of ranks 8/16/8/32 on every linear layer in 4 slots of rank 32, round-robin, lora_impl auto, float32:
  no_M:  the slots without "M" (DoRA factor) arrays: an engine without `enable_dora` (the default);
  plain: the same adapters in slots with "M" (`enable_dora=True`; all zeros: factor exactly 1);
  dora:  the same 4 adapters as DoRA adapters, magnitudes = their columns' norms x U(0.9, 1.1).
Calls interleaved; medians and minima of `--reps` calls. Less affected by which engine holds which
memory than `jlora bench decode-step --dora-packages jlora` (three engines side by side).

    jlora bench dora-cost [--reps 60]
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import numpy as np

from jlora.bench.timing import decode_inputs, interleaved_ms


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="jlora bench dora-cost", description=__doc__.split("\n\n")[0])
    p.add_argument("--reps", type=int, default=60)
    reps = p.parse_args(argv).reps

    import jax
    import jax.numpy as jnp
    from flax import nnx
    from safetensors.numpy import load_file, save_file

    from jlora.adapters import padded_update, read_peft_adapter
    from jlora.adapters.slots import LoRASlots, SlotWrite
    from jlora.bench.lora_cost import write_adapters
    from jlora.models.config import PACKED_MODULES
    from jlora.models.loading import load_model

    model = load_model(None)[0]
    cfg = model.cfg
    root = Path(tempfile.mkdtemp(prefix="jlora-dora-cost-"))
    weights = {k: np.asarray(v) for k, v in model.layers.weights().items() if k in PACKED_MODULES}  # [L, in, out]

    def realistic_magnitudes(path: Path) -> None:  # a trained adapter's m is near its columns' norms
        t = load_file(str(path / "adapter_model.safetensors"))
        for key in [k for k in t if k.endswith(".lora_magnitude_vector")]:
            stem = key[: -len(".lora_magnitude_vector")]
            layer, mod = int(stem.split(".layers.")[1].split(".")[0]), stem.rsplit(".", 1)[1]
            fused = next(f for f, subs in PACKED_MODULES.items() if mod in subs)
            outs, i = cfg.packed_shapes()[fused][1], PACKED_MODULES[fused].index(mod)
            w = weights[fused][layer][:, sum(outs[:i]): sum(outs[: i + 1])]
            full = w + 2.0 * (t[stem + ".lora_B.weight"] @ t[stem + ".lora_A.weight"]).T  # scale alpha / r = 2
            jitter = np.random.default_rng(layer).uniform(0.9, 1.1, full.shape[1])
            t[key] = (np.linalg.norm(full, axis=0) * jitter).astype(np.float32)
        save_file(t, str(path / "adapter_model.safetensors"))

    states = {}
    for dora in (False, True):
        slots = LoRASlots(cfg, 4, 32, base=model.layers.weights(), dora=True)  # the slots of enable_dora=True
        paths = write_adapters(root, cfg, dora=dora)
        for path in paths if dora else ():
            realistic_magnitudes(path)
        slots.write([SlotWrite(i, padded_update(read_peft_adapter(p, cfg, 32), cfg, 32, dora=True))
                     for i, p in enumerate(paths)])
        states["dora" if dora else "plain"] = slots.state
    states["no_M"] = {m: {k: v for k, v in s.items() if k != "M"} for m, s in states["plain"].items()}  # option off
    t = 16
    graphdef, params = nnx.split(model)
    cache, tokens, group, slot_ids = decode_inputs(cfg, t)

    @jax.jit
    def step(params, state, cache):
        m = nnx.merge(graphdef, params)
        h, _ = m.forward(tokens, slot_ids, (group,), cache, state)
        return m.logits(h)

    outs = {k: step(params, s, cache).block_until_ready() for k, s in states.items()}
    print("finite:", {k: bool(jnp.isfinite(v).all()) for k, v in outs.items()},
          "| plain == no_M logits bit-equal:", bool(jnp.array_equal(outs["plain"], outs["no_M"])),
          "| dora moves logits by up to", float(jnp.abs(outs["dora"] - outs["plain"]).max()))
    stats = interleaved_ms({k: (lambda s=s: step(params, s, cache)) for k, s in states.items()}, reps)
    for name, ms in stats.items():
        print(f"{name} ms:", {k: round(v, 1) for k, v in ms.items()}, "plain / no_M:",
              round(ms["plain"] / ms["no_M"], 4), "dora / plain:", round(ms["dora"] / ms["plain"], 4))
    print("reps:", reps, "jax", jax.__version__)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
