"""The slora section of `jlora bench tpu`: S-LoRA's experiment on one chip.

Many distinct random PEFT adapters (`--slora-adapters`, rank 8-16 on q/v, bf16), `--slora-rows`
running sequences, each slot count of `--slora-slots` one engine. Every engine is held to the
CPU first (`chip_check.check_engine`, one reference shared by the slot counts); a failure
withholds its timed rows. Then the same requests (random prompt and output lengths, greedy, EOS
ignored, all queued at once) run on one adapter and on adapters drawn uniformly or with power-law
popularity (alpha 1) from all of them. Reported per row: tok/s and its ratio to the one-adapter
row of the same engine, TTFT p50/p99 (from the queueing), the slot writes and their host time in
the step loop; per engine: each adapter's host-to-device load timed alone (p50/p99), compiles after
warm-up. As in S-LoRA every adapter of a run is in host memory (converted, padded to the slots)
before it starts: the conversion's time is reported apart. The adapters are q/v only:
`--lora-target-modules q_proj,v_proj` gives the engines slots of the q|k|v projection alone
(`LLM(lora_target_modules=...)`), a fifth of every decoder module's slot bytes at the 1B shape, so
a step reads that much less of the slots.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import gc
import json
import os
import time
from pathlib import Path
from typing import Any

import numpy as np

from jlora.bench.tpu.common import device_memory, run_tag, save_results, tuning_options
from jlora.engine.step_listener import StepListener

TARGETS = ("q_proj", "v_proj")
POOL_VALUES = 1 << 22  # the draws every adapter's tensors are runs of (8 MB of bf16)
POPULARITIES = ("uniform", "power-law")


def adapter_bytes(cfg: dict[str, Any], rank: int) -> int:
    """A bf16 adapter's tensor bytes on q/v (`TARGETS`) at `rank`, from HF config fields (`SHAPES`)."""
    d, h, kvh = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    dh = cfg.get("head_dim") or d // h
    return 2 * cfg["num_hidden_layers"] * rank * ((d + h * dh) + (d + kvh * dh))


def write_slora_adapters(cfg: Any, n: int, root: Path, ranks: tuple[int, int] = (8, 16), seed: int = 0,
                         workers: int | None = None) -> dict[str, Any]:
    """`n` PEFT directories `root/a0000`, ... on `TARGETS` of every layer, each rank drawn in
    [ranks[0], ranks[1]]: every tensor a run of one pool of N(0, 0.02) bf16 draws at an offset of
    the adapter's own seed (distinct adapters, no draw per value), written side by side. Kept when
    `root/written.json` says the same adapters are there. Returns what was written and how fast."""
    import ml_dtypes

    from jlora.formats import write_safetensors

    spec = dict(n=n, ranks=list(ranks), seed=seed, targets=list(TARGETS), layers=cfg.num_hidden_layers,
                hidden=cfg.hidden_size, kv=cfg.num_key_value_heads * cfg.head_dim)
    done = root / "written.json"
    if done.is_file() and json.loads(done.read_text()).get("spec") == spec:
        return {**json.loads(done.read_text()), "reused": True}
    t0 = time.perf_counter()
    pool = (np.random.default_rng(seed).standard_normal(POOL_VALUES, np.float32) * 0.02).astype(ml_dtypes.bfloat16)
    shapes = cfg.module_shapes()

    def write(a: int) -> tuple[int, int]:
        rng = np.random.default_rng([seed, a])
        rank = int(rng.integers(ranks[0], ranks[1] + 1))
        tensors = {}
        for layer in range(cfg.num_hidden_layers):
            for m in TARGETS:
                d_in, d_out = shapes[m]
                key = f"base_model.model.model.layers.{layer}.self_attn.{m}"
                for part, shape in (("lora_A", (rank, d_in)), ("lora_B", (d_out, rank))):
                    size = shape[0] * shape[1]
                    at = int(rng.integers(0, POOL_VALUES - size))
                    tensors[f"{key}.{part}.weight"] = pool[at:at + size].reshape(shape)
        out = root / f"a{a:04d}"
        out.mkdir(parents=True, exist_ok=True)
        size = write_safetensors(out / "adapter_model.safetensors", tensors)
        (out / "adapter_config.json").write_text(json.dumps({
            "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": 2 * rank, "lora_dropout": 0.0,
            "target_modules": list(TARGETS), "bias": "none", "fan_in_fan_out": False,
            "base_model_name_or_path": "random"}))
        return rank, size

    with concurrent.futures.ThreadPoolExecutor(workers or min(16, os.cpu_count() or 1)) as ex:
        got = list(ex.map(write, range(n)))
    seconds = time.perf_counter() - t0
    total = sum(size for _, size in got)
    info = dict(spec=spec, seconds=seconds, bytes=total, mean_bytes=total / n,
                ranks=[r for r, _ in got])
    done.write_text(json.dumps(info))
    return {**info, "reused": False}


def draw(n_adapters: int, n: int, popularity: str, seed: int) -> list[int]:
    """Each request's adapter: uniform over n_adapters, or power-law (p(i) ~ 1/(i+1), alpha 1)."""
    rng = np.random.default_rng(seed)
    if popularity == "uniform":
        return rng.integers(0, n_adapters, n).tolist()
    p = 1.0 / np.arange(1, n_adapters + 1)
    return rng.choice(n_adapters, size=n, p=p / p.sum()).tolist()


class SlotWriteTime(StepListener):
    """Host seconds of the step loop's slot writes (the engine's "write_slots" phase)."""

    def __init__(self) -> None:
        self.seconds = 0.0

    def phase(self, name: str, seconds: float) -> None:
        if name == "write_slots":
            self.seconds += seconds


def percentiles(xs: list[float]) -> dict[str, float]:
    if not xs:
        return {}
    return dict(p50=float(np.percentile(xs, 50)), p99=float(np.percentile(xs, 99)), mean=float(np.mean(xs)),
                total=float(np.sum(xs)), n=len(xs))


def slora_sizes(args: argparse.Namespace) -> dict[str, Any]:
    """The engines' sizes: room for the longest prompt and output, a prefill chunk bucket that
    holds the longest prompt (and the one the engine ends its buckets at), one decode row bucket
    (few graphs: a cheaper check)."""
    from jlora.engine_args import default_block_size

    longest = args.slora_prompt_len[1] + args.slora_new_tokens[1]
    max_len = 1 << max(0, longest).bit_length()  # a power of two above prompt + output
    chunk = 1 << max(0, args.slora_prompt_len[1] - 1).bit_length()
    batched = max(chunk, min(4 * chunk, 1024))
    return dict(max_model_len=max_len, max_num_seqs=args.slora_rows, max_num_batched_tokens=batched,
                token_buckets=tuple(sorted({chunk, min(batched, max_len)})), decode_row_buckets=(args.slora_rows,),
                block_size=default_block_size(max_len, "tpu"))


def make_slora_llm(ckpt: Path, args: argparse.Namespace, slots: int, n_host: int) -> Any:
    from jlora import LLM

    from jlora.bench.tpu.workloads import weights_cache_dir

    s = slora_sizes(args)
    return LLM(str(ckpt), dtype=args.dtype, quantization=args.quantization, max_model_len=s["max_model_len"],
               max_num_seqs=s["max_num_seqs"], max_num_batched_tokens=s["max_num_batched_tokens"],
               token_buckets=s["token_buckets"], decode_row_buckets=s["decode_row_buckets"], max_loras=slots,
               max_lora_rank=args.slora_ranks[1], max_cpu_loras=max(n_host, 8), lora_impl=args.lora_impl,
               lora_target_modules=getattr(args, "lora_target_modules", None),
               block_size=s["block_size"], weights_cache=str(weights_cache_dir(args)), adapter_cache=False,
               progress=False, tuning=tuning_options(args))


def make_requests(args: argparse.Namespace, vocab: int) -> list[tuple[list[int], int]]:
    """The section's requests (prompt ids, new tokens), the same for every row."""
    rng = np.random.default_rng(args.slora_seed)
    (plo, phi), (nlo, nhi) = args.slora_prompt_len, args.slora_new_tokens
    return [(rng.integers(3, vocab, int(rng.integers(plo, phi + 1))).tolist(), int(rng.integers(nlo, nhi + 1)))
            for _ in range(args.slora_requests)]


def prepare_all(llm: Any, loras: list[Any], workers: int) -> list[float]:
    """Every distinct adapter of `loras` converted into the host cache, side by side; each one's seconds."""
    manager = llm.engine.adapters
    distinct = list({lr.lora_name: lr for lr in loras}.values())

    def one(lr: Any) -> float:
        t = time.perf_counter()
        manager.prepare(lr)
        return time.perf_counter() - t

    with concurrent.futures.ThreadPoolExecutor(workers) as ex:
        return list(ex.map(one, distinct))


def run_row(llm: Any, requests: list[tuple[list[int], int]], loras: list[Any], writes: SlotWriteTime) -> dict[str, Any]:
    """Every request queued at once, request i on loras[i], through the engine's step loop."""
    from jlora import SamplingParams

    engine = llm.engine
    manager = engine.adapters
    before = dict(manager.stats)
    writes.seconds = 0.0
    t0 = time.perf_counter()
    ids = [engine.add_request({"prompt_token_ids": p}, SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True),
                              lr) for (p, new), lr in zip(requests, loras)]
    steps = 0
    while engine.has_unfinished():
        engine.step(finished_only=True)
        steps += 1
    wall = time.perf_counter() - t0
    outs = [engine.pop_finished(r) for r in ids]
    generated = sum(len(o.outputs[0].token_ids) for o in outs)
    ttft = [o.metrics.time_to_first_token for o in outs]
    moved = {k: manager.stats[k] - before.get(k, 0) for k in ("slot_writes", "evictions", "slot_hits")}
    return dict(seconds=wall, generated=generated, tok_s=generated / wall, steps=steps,
                ttft_p50=float(np.percentile(ttft, 50)), ttft_p99=float(np.percentile(ttft, 99)),
                distinct_adapters=len({lr.lora_name for lr in loras}), slot_write_host_s=writes.seconds, **moved)


def time_loads(llm: Any, loras: list[Any], n: int) -> list[float]:
    """Host-to-device load of `n` prepared adapters, each into a slot on an idle engine and waited
    for: the write a scheduled adapter costs. The slots written are then marked empty (unload), so
    the manager never serves a slot it did not write."""
    import jax

    from jlora.adapters.slots import SlotWrite

    runner, manager = llm.engine.runner, llm.engine.adapters
    handles = [manager.prepare(lr) for lr in loras[:n]]
    jax.block_until_ready(runner.lora_state)
    out = []
    for i, h in enumerate(handles):
        t = time.perf_counter()
        runner.write_slots((SlotWrite(i % llm.config.max_loras, h.update),))
        jax.block_until_ready(runner.lora_state)
        out.append(time.perf_counter() - t)
    for name in manager.list_adapters():
        manager.unload(name)
    return out


def slora_section(args: argparse.Namespace, ckpt: Path, out: Path, results: dict[str, Any]) -> None:
    import jax

    from jlora import LoRARequest, compile_stats
    from jlora.bench import chip_check
    from jlora.models.loading import read_model_config

    res = results.setdefault(run_tag(args), {}).setdefault("slora", {})
    cfg = read_model_config(ckpt)
    root = Path(args.dir) / f"slora-adapters-{args.shape}"
    written = write_slora_adapters(cfg, args.slora_adapters, root, tuple(args.slora_ranks))
    res["adapters_written"] = {k: v for k, v in written.items() if k != "ranks"}
    print(f"slora: {args.slora_adapters} adapters (rank {args.slora_ranks[0]}-{args.slora_ranks[1]}, "
          f"{'/'.join(TARGETS)}, bf16) at {root}: {written['bytes'] / 1e9:.2f} GB, {written['mean_bytes'] / 1e6:.2f} MB "
          f"each, " + ("already there" if written["reused"] else f"written in {written['seconds']:.1f} s"), flush=True)
    paths = [root / f"a{a:04d}" for a in range(args.slora_adapters)]
    requests = make_requests(args, cfg.vocab_size)
    sizes = slora_sizes(args)
    res.update(sizes=sizes, requests=len(requests), running_rows=args.slora_rows,
               new_tokens=sum(n for _, n in requests), prompt_tokens=sum(len(p) for p, _ in requests))
    draws = {pop: draw(args.slora_adapters, len(requests), pop, args.slora_seed + 1) for pop in args.slora_popularity}
    n_host = max([len(set(d)) for d in draws.values()] + [1])
    res.setdefault("rows", [])
    engines = res.setdefault("engines", {})
    save_results(out, results)
    next_id = iter(range(1, 10**9))
    for slots in args.slora_slots:
        key = str(slots)
        print(f"slora: engine with {slots} slots, {args.slora_rows} rows, sizes {sizes}", flush=True)
        t0 = time.perf_counter()
        llm = make_slora_llm(ckpt, args, slots, n_host)
        llm.wait_for_warmup()
        eng = engines[key] = dict(slots=slots, start_s=time.perf_counter() - t0, graphs=llm.config.num_step_graphs,
                                  lora_target_modules=llm.config.lora_target_modules,
                                  slot_bytes=sum(int(x.nbytes) for x in jax.tree.leaves(llm.engine.runner.lora.state))
                                  // slots, device_memory=device_memory())
        print(f"slora {slots} slots: ready with every graph in {eng['start_s']:.1f} s, {eng['graphs']} step graphs, "
              f"{eng['slot_bytes'] / 1e6:.1f} MB a slot", flush=True)
        save_results(out, results)
        try:
            eng["check"] = chip_check.check_engine(llm, ckpt, Path(args.dir) / f"check-slora-{args.shape}",
                                                   None if args.quantization == "none" else args.quantization)
            print(f"slora {slots} slots: check against the CPU: {chip_check.summary_line(eng['check'])} "
                  f"({eng['check']['seconds']:.0f} s)", flush=True)
            save_results(out, results)
            if not eng["check"]["passed"]:
                eng["withheld"] = "the engine failed its check against the CPU"
                print(f"slora {slots} slots: no timed rows: this configuration failed its check", flush=True)
                save_results(out, results)
                continue
            writes = SlotWriteTime()
            llm.engine.add_step_listener(writes)
            compiles = compile_stats.compile_count()
            one_path = paths[0]
            # One pass of a row's worth of requests first, unrecorded: the first run's one-time host
            # costs (allocator, transfer paths) go before the one-adapter row they would slow.
            warm = LoRARequest(f"s{slots}-warm", next(next_id), str(paths[-1]))
            run_row(llm, requests[:args.slora_rows], [warm] * min(args.slora_rows, len(requests)), writes)
            llm.engine.adapters.unload(warm.lora_name)
            one = None
            for pop in ["one"] + list(args.slora_popularity):
                tag = f"s{slots}-{pop}"
                if pop == "one":
                    lr = LoRARequest(f"{tag}-a0", next(next_id), str(one_path))
                    loras = [lr] * len(requests)
                else:  # fresh names: no run starts with another's adapters resident
                    by_index = {i: LoRARequest(f"{tag}-a{i}", next(next_id), str(paths[i])) for i in set(draws[pop])}
                    loras = [by_index[i] for i in draws[pop]]
                conv = prepare_all(llm, loras, args.slora_workers)
                print(f"slora {slots} slots, {pop}: {len(conv)} adapters converted into host memory in "
                      f"{sum(conv):.1f} s of thread time (p50 {np.median(conv) * 1e3:.0f} ms each)", flush=True)
                row = dict(slots=slots, popularity=pop, adapters=1 if pop == "one" else args.slora_adapters,
                           conversion_s=percentiles(conv), **run_row(llm, requests, loras, writes))
                if pop == "one":
                    one = row
                row["vs_one_adapter"] = row["tok_s"] / one["tok_s"] if one else None
                res["rows"].append(row)
                print(f"slora {slots} slots, {pop}: {row['tok_s']:.0f} tok/s"
                      + (f" ({row['vs_one_adapter']:.3f}x of one adapter)" if one and pop != "one" else "")
                      + f", {row['distinct_adapters']} adapters, {row['slot_writes']} slot writes "
                      f"({row['slot_write_host_s']:.2f} s on the host), TTFT p50 {row['ttft_p50']:.2f} s "
                      f"p99 {row['ttft_p99']:.2f} s, {row['seconds']:.1f} s", flush=True)
                for lr in {x.lora_name: x for x in loras}.values():  # the next row starts with empty slots
                    llm.engine.adapters.unload(lr.lora_name)
                save_results(out, results)
            eng["compiles_after_warmup"] = compile_stats.compile_count() - compiles
            n_loads = min(args.slora_load_samples, args.slora_adapters)
            loads = time_loads(llm, [LoRARequest(f"s{slots}-load-a{i}", next(next_id), str(paths[i]))
                                     for i in range(n_loads)], n_loads)
            eng["load_s"] = percentiles(loads)
            print(f"slora {slots} slots: compiles after warm-up {eng['compiles_after_warmup']}; one adapter's load "
                  f"host to device p50 {eng['load_s']['p50'] * 1e3:.2f} ms, p99 {eng['load_s']['p99'] * 1e3:.2f} ms "
                  f"({n_loads} loads, {eng['load_s']['total']:.2f} s)", flush=True)
            save_results(out, results)
        finally:
            llm.close()
            del llm
            gc.collect()
