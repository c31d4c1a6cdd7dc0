"""Time to bring a PEFT adapter into a device slot on the default model (all seven modules).

Two phases, timed separately, median of several runs:
  disk -> host: read adapter_model.safetensors, check shapes, fold the scale, pad to max rank;
  host -> device: the one jitted, donated `set_slot` write (blocked until done).
Adapters are written with safetensors directly (same keys peft writes), so torch is not needed.

    python benchmarks/bench_adapter_load.py [--ranks 8 64] [--max-lora-rank 64] [--slots 4]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import jax
import numpy as np
from safetensors.numpy import save_file

from jlora.adapters.manager import LoRASlots, padded_update, set_slot
from jlora.adapters.peft import read_adapter
from jlora.models.llama import LORA_MODULES
from jlora.models.loading import read_model_config

PREFIX = {m: ("self_attn" if m in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp") for m in LORA_MODULES}


def write_peft_adapter(path: Path, cfg, rank: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    tensors = {}
    for i in range(cfg.num_hidden_layers):
        for m, (d_in, d_out) in cfg.module_shapes().items():
            key = f"base_model.model.model.layers.{i}.{PREFIX[m]}.{m}"
            tensors[f"{key}.lora_A.weight"] = rng.normal(0, 0.02, (rank, d_in)).astype(np.float32)
            tensors[f"{key}.lora_B.weight"] = rng.normal(0, 0.02, (d_out, rank)).astype(np.float32)
    path.mkdir(parents=True)
    save_file(tensors, str(path / "adapter_model.safetensors"))
    (path / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(LORA_MODULES),
        "bias": "none", "task_type": "CAUSAL_LM"}))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--ranks", type=int, nargs="+", default=[8, 64])
    p.add_argument("--max-lora-rank", type=int, default=64)
    p.add_argument("--slots", type=int, default=4)
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args()
    cfg = read_model_config()
    slots = LoRASlots(cfg, args.slots, args.max_lora_rank)  # the slot arrays a ModelRunner holds
    slots.warmup()  # compiles set_slot once
    state_mb = sum(x.nbytes for x in jax.tree.leaves(slots.state)) / 1e6
    print(f"lora_state: {args.slots} slots x rank {args.max_lora_rank}, {state_mb:.0f} MB")
    print("| adapter rank | file MB | disk -> host (ms) | host -> device set_slot (ms) | slot MB written |")
    print("|---:|---:|---:|---:|---:|")
    with tempfile.TemporaryDirectory() as tmp:
        for rank in args.ranks:
            path = Path(tmp) / f"r{rank}"
            write_peft_adapter(path, cfg, rank, seed=rank)
            file_mb = (path / "adapter_model.safetensors").stat().st_size / 1e6
            host, device = [], []
            state = slots.state
            for k in range(args.repeats):
                t = time.perf_counter()
                adapter = read_adapter(path, cfg, args.max_lora_rank)
                update = padded_update(adapter, cfg, args.max_lora_rank)
                host.append(time.perf_counter() - t)
                t = time.perf_counter()
                state = set_slot(state, k % args.slots, update)
                jax.block_until_ready(state)
                device.append(time.perf_counter() - t)
            slots.state = state
            slot_mb = sum(a.nbytes for u in update.values() for a in u.values()) / 1e6
            print(f"| {rank} | {file_mb:.1f} | {statistics.median(host) * 1e3:.0f} | "
                  f"{statistics.median(device) * 1e3:.1f} | {slot_mb:.0f} |")


if __name__ == "__main__":
    main()
