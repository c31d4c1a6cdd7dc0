"""Runs tensor/data-parallel engines in a process of its own (the device count is fixed when JAX
starts) and prints one JSON line of what it saw; tests/test_parallel.py asserts on it.

    python tests/parallel_worker.py tiny MODEL_DIR ADAPTER_DIR... (4 forced CPU devices)
    python tests/parallel_worker.py real ADAPTER_DIR... (3 forced CPU devices, the default model)
    python tests/parallel_worker.py distributed PORT PROCESS_ID MODEL_DIR ADAPTER_DIR... (one of two processes)
    python tests/parallel_worker.py serve MODEL_DIR ADAPTER_DIR... (the OpenAI server over TP 2 x DP 2)
"""

from __future__ import annotations

import json
import os
import sys

MODE = sys.argv[1]
if MODE != "distributed":
    os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={3 if MODE == 'real' else 4}"
os.environ["JAX_PLATFORMS"] = "cpu"

import jax  # noqa: E402
import numpy as np  # noqa: E402

# Two step graphs an engine (4 decode rows; 4 rows beside one 32-token prompt chunk): the step
# compiles are nearly all of this worker's time (13 runners; 5 graphs each took 374 CPU-s cold,
# 2 take 159, 2026-12-07), and every prompt here fits one chunk.
SIZES = dict(max_model_len=256, max_num_seqs=4, max_num_batched_tokens=32, max_loras=2, max_lora_rank=8,
             token_buckets=(32,), decode_row_buckets=(4,), progress=False, weights_cache=False, adapter_cache=False)
PROMPTS = ["Hello there, how", "The capital of France is", "1 2 3 4 5", "Once upon a time",
           "def add(a, b):", "Water boils at", "The quick brown fox", "In 1969 the first"]


def generate(llm, adapters: list[str]) -> dict:
    """Greedy tokens and top-3 logprobs for PROMPTS, each with its own adapter (one with none);
    more adapters than slots, so the slots churn."""
    from jlora import LoRARequest, SamplingParams, compile_stats

    loras = [None if i % 5 == 4 else LoRARequest(f"a{i % len(adapters)}", 1 + i % len(adapters), adapters[i % len(adapters)])
             for i in range(len(PROMPTS))]
    params = SamplingParams(max_tokens=10, temperature=0.0, logprobs=3)
    before = compile_stats.compile_count()
    outs = llm.generate(PROMPTS, params, loras, use_tqdm=False)
    outs += llm.generate(PROMPTS[::-1], params, loras[::-1], use_tqdm=False)  # churn again, other order
    return {"tokens": [list(o.outputs[0].token_ids) for o in outs],
            "logprobs": [[{str(k): float(v) for k, v in d.items()} for d in o.outputs[0].logprobs]
                         for o in outs],
            "compiles_after_warmup": compile_stats.compile_count() - before}


def shard_fractions(llm) -> dict:
    """For every array of every runner: its bytes on one device / its whole bytes, by name."""
    out = {}
    for r, runner in enumerate(llm.runners):
        named = {"cache." + k: v for k, v in runner.cache.items()}
        for path, x in jax.tree_util.tree_flatten_with_path(runner.state)[0]:
            named["w." + ".".join(str(getattr(k, "key", "")) for k in path if hasattr(k, "key"))] = x
        for path, x in jax.tree_util.tree_flatten_with_path(runner.lora_state)[0]:  # pools: a leading index
            named["lora." + ".".join(str(getattr(k, "key", getattr(k, "idx", ""))) for k in path)] = x
        for name, x in named.items():
            shards = x.addressable_shards
            out[f"{r}:{name}"] = {"fraction": shards[0].data.size / x.size, "devices": len({s.device for s in shards}),
                                  "all_same_size": len({s.data.size for s in shards}) == 1}
    return out


def tiny(model_dir: str, adapters: list[str]) -> dict:
    from jlora import LLM

    result = {"devices": len(jax.devices())}
    for tp, dp in ((1, 1), (2, 1), (4, 1), (1, 2), (2, 2)):
        llm = LLM(model_dir, tensor_parallel_size=tp, data_parallel_size=dp, **SIZES)
        run = generate(llm, adapters)
        run["shards"] = shard_fractions(llm)
        run["memory"] = llm.memory_report()
        run["preplaced"] = [r._preplaced for r in llm.runners]  # streamed onto the mesh, used as loaded
        if dp > 1:  # a new request goes to the replica whose slot holds its adapter
            from jlora import LoRARequest, SamplingParams

            run["routing"] = []
            for (replica, _), name in sorted(llm.engine.adapters.resident().items()):
                i = int(name[1:])
                rid = llm.engine.add_request("Hi", SamplingParams(max_tokens=2), LoRARequest(name, 1 + i, adapters[i]))
                run["routing"].append([replica, llm.engine.replica_of(rid)])
                llm.engine.abort(rid)
                llm.engine.pop_finished(rid)
        result[f"tp{tp}_dp{dp}"] = run
        del llm
    # The int8 and bfloat16 layouts, and slots of several ranks, sharded too: each against its own one-device run.
    for name, extra in (("int8", {"quantization": "int8"}), ("bfloat16", {"dtype": "bfloat16"}),
                        ("slot_ranks", {"max_loras": 3, "lora_slot_ranks": (2, 4, 8)})):
        for tp in (1, 2):
            llm = LLM(model_dir, tensor_parallel_size=tp, **{**SIZES, **extra})
            run = generate(llm, adapters)
            run["shards"] = shard_fractions(llm)
            result[f"{name}_tp{tp}"] = run
            del llm
    result["stream"] = stream(model_dir)
    for tp, dp in ((3, 1), (2, 3), (0, 1), (1, 0)):
        try:
            LLM(model_dir, tensor_parallel_size=tp, data_parallel_size=dp, **SIZES)
            result[f"error_tp{tp}_dp{dp}"] = None
        except ValueError as e:
            result[f"error_tp{tp}_dp{dp}"] = str(e)
    return result


def stream(model_dir: str) -> dict:
    """The streaming loader onto 2 and 4 devices: the slice of each layer every device was sent, and
    the bytes each device holds afterwards (no whole copy left on any of them)."""
    import gc

    from jlora.models.loading import open_hf_checkpoint
    from jlora.models.streaming import stream_model

    def held() -> dict[str, int]:  # bytes of live arrays per device
        gc.collect()
        out = {str(d): 0 for d in jax.devices()}
        for x in jax.live_arrays():
            for shard in x.addressable_shards:
                out[str(shard.device)] += shard.data.nbytes
        return out

    out = {}
    for tp in (2, 4):
        for quantization in (None, "int8"):
            reads: list = []
            before = held()
            cfg, tensors = open_hf_checkpoint(model_dir)
            model = stream_model(cfg, tensors, quantization=quantization, devices=jax.devices()[:tp], reads=reads)
            after = held()
            out[f"tp{tp}_{quantization}"] = {"reads": reads, "held": {d: after[d] - before[d] for d in after},
                                             "model_bytes": sum(int(x.nbytes) for x in jax.tree.leaves(
                                                 __import__("flax").nnx.state(model)))}
            del model
    return out


def real(adapters: list[str]) -> dict:
    """The default model (9 query / 3 KV heads) at TP = 3 against one device, with real-model random
    adapters made by peft in the test process (`make_real_adapters` in tests/test_parallel.py)."""
    from jlora import LLM

    result = {"devices": len(jax.devices())}
    for tp in (1, 3):
        llm = LLM(tensor_parallel_size=tp, **{**SIZES, "weights_cache": True})
        run = generate(llm, adapters)
        run["shards"] = shard_fractions(llm)
        result[f"tp{tp}_dp1"] = run
        del llm
    try:
        LLM(tensor_parallel_size=2, **SIZES)
        result["error_tp2_dp1"] = None
    except ValueError as e:
        result["error_tp2_dp1"] = str(e)
    return result


def distributed(port: str, process_id: str, model_dir: str, adapters: list[str]) -> dict:
    from jlora import init_distributed

    init_distributed(f"127.0.0.1:{port}", num_processes=2, process_id=int(process_id))
    from jlora import LLM

    llm = LLM(model_dir, tensor_parallel_size=2, **SIZES)
    run = generate(llm, adapters)
    run["devices"] = len(jax.devices())
    run["local_devices"] = len(jax.local_devices())
    run["process"] = jax.process_index()
    return run


def serve(model_dir: str, adapters: list[str]) -> dict:
    """`jlora serve`'s app live on 127.0.0.1 over TP 2 x DP 2: concurrent openai clients, each
    request its own adapter (or none), against offline generation on the same engine."""
    from concurrent.futures import ThreadPoolExecutor
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent))
    from live import KEY, serve_live

    from jlora import LLM
    from jlora.server.app import build_app

    llm = LLM(model_dir, tensor_parallel_size=2, data_parallel_size=2, **SIZES)
    names = [f"a{i}" for i in range(len(adapters))]
    app = build_app(llm, "tiny", lora_modules=dict(zip(names, adapters)), api_key=KEY)
    jobs = [(PROMPTS[i], None if i % 5 == 4 else names[i % len(names)]) for i in range(len(PROMPTS))] * 2
    with serve_live(llm, app) as live:
        client = live.client()

        def one(job):
            prompt, model = job
            r = client.completions.create(model=model or "tiny", prompt=prompt, max_tokens=8, temperature=0.0,
                                          extra_body={"ignore_eos": True})
            return r.choices[0].text

        with ThreadPoolExecutor(8) as pool:
            texts = list(pool.map(one, jobs))
        offline = [live.offline([p], m, 8)[0].outputs[0].text for p, m in jobs]
        metrics = live.http().get("/metrics").text
    return {"texts": texts, "offline": offline,
            "replicas_with_adapters": sorted({r for r, _ in llm.engine.adapters.resident()}),
            "metrics_ok": "jlora_kv_blocks_used" in metrics}


if __name__ == "__main__":
    out = {"tiny": lambda: tiny(sys.argv[2], sys.argv[3:]), "real": lambda: real(sys.argv[2:]),
           "distributed": lambda: distributed(sys.argv[2], sys.argv[3], sys.argv[4], sys.argv[5:]),
           "serve": lambda: serve(sys.argv[2], sys.argv[3:])}[MODE]()
    print("RESULT " + json.dumps(out, default=lambda o: o.item() if isinstance(o, np.generic) else str(o)), flush=True)
