"""Time to bring a PEFT adapter into a device slot on the default model (all seven modules).

Two phases, timed separately, median of several runs:
  disk -> host: read adapter_model.safetensors, check shapes, fold the scale, pad to max rank;
  host -> device: the one jitted, donated `set_slot` write (blocked until done).
Adapters are written with safetensors directly (same keys peft writes), so torch is not needed.

    jlora bench adapter-load [--ranks 8 64] [--max-lora-rank 64] [--slots 4] [--dora]

`--dora`: DoRA adapters (`use_dora`); the slot write then also takes the norm of W + s B A per
output column from the default model's weights (float32), which it loads first.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import jax
import numpy as np

from jlora.adapters.slots import LoRASlots, SlotWrite, padded_update
from jlora.adapters.peft import read_adapter
from jlora.bench.peft_adapters import write_peft_adapter
from jlora.models.llama import LORA_MODULES
from jlora.models.loading import read_model_config


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="jlora bench adapter-load", description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", type=int, nargs="+", default=[8, 64])
    p.add_argument("--max-lora-rank", type=int, default=64)
    p.add_argument("--slots", type=int, default=4)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--dora", action="store_true", help="DoRA adapters (the write computes their norms)")
    args = p.parse_args(argv)
    cfg = read_model_config()
    base = None
    if args.dora:
        from jlora.models.loading import load_model

        base = load_model(None)[0].layers.weights()
    slots = LoRASlots(cfg, args.slots, args.max_lora_rank, base=base, dora=args.dora)  # as a ModelRunner's
    slots.warmup()  # compiles set_slot once
    state_mb = sum(x.nbytes for x in jax.tree.leaves(slots.state)) / 1e6
    print(f"lora_state: {args.slots} slots x rank {args.max_lora_rank}, {state_mb:.0f} MB")
    print("| adapter rank | file MB | disk -> host (ms) | host -> device set_slot (ms) | slot MB written |")
    print("|---:|---:|---:|---:|---:|")
    with tempfile.TemporaryDirectory() as tmp:
        for rank in args.ranks:
            path = Path(tmp) / f"r{rank}"
            write_peft_adapter(path, cfg, rank, LORA_MODULES, np.random.default_rng(rank), dora=args.dora)
            file_mb = (path / "adapter_model.safetensors").stat().st_size / 1e6
            host, device = [], []
            for k in range(args.repeats):
                t = time.perf_counter()
                adapter = read_adapter(path, cfg, args.max_lora_rank)
                update = padded_update(adapter, cfg, args.max_lora_rank, dora=args.dora)
                host.append(time.perf_counter() - t)
                t = time.perf_counter()
                slots.write([SlotWrite(k % args.slots, update)])  # the runner's way in: the compiled write
                jax.block_until_ready(slots.state)
                device.append(time.perf_counter() - t)
            slot_mb = sum(a.nbytes for u in update.values() for a in u.values()) / 1e6
            print(f"| {rank} | {file_mb:.1f} | {statistics.median(host) * 1e3:.0f} | "
                  f"{statistics.median(device) * 1e3:.1f} | {slot_mb:.0f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
