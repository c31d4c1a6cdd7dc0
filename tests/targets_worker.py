"""Run by tests/test_lora_targets.py in a process of its own (JAX fixes its device count at start):
greedy tokens and logprobs of a batch mixing q/v adapters and base rows, from an engine with slots
for every module, one with q/v-only slots (with DoRA factors and slots of two ranks), and that one
under tensor_parallel_size=2."""

import json
import os
import sys

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
os.environ["JAX_PLATFORMS"] = "cpu"

from jlora import LLM, LoRARequest, SamplingParams, compile_stats  # noqa: E402

base, *adapters = sys.argv[1:]
engine = dict(max_model_len=128, max_num_seqs=4, max_num_batched_tokens=32, max_loras=2, max_lora_rank=8,
              token_buckets=(16, 32), progress=False, weights_cache=False, adapter_cache=False)
qv = dict(lora_target_modules=("q_proj", "v_proj"), enable_dora=True, lora_slot_ranks=(4, 8))
greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=2)
prompts = ["Hello there", "Once upon a time", "1 2 3 4", "The cat", "Water boils at", "def add(a, b):"]
reqs = [LoRARequest(f"a{i}", i + 1, p) for i, p in enumerate(adapters)]
loras = [reqs[0], None, reqs[1], reqs[2], None, reqs[3]]  # four adapters over two slots: they churn


def run(llm: LLM) -> dict:
    before = compile_stats.compile_count()
    outs = llm.generate(prompts, greedy, loras) + llm.generate(prompts[::-1], greedy, loras[::-1])
    return {"tokens": [o.outputs[0].token_ids for o in outs],
            "logprobs": [[{str(t): v for t, v in d.items()} for d in o.outputs[0].logprobs] for o in outs],
            "compiles": compile_stats.compile_count() - before,
            "modules": sorted(llm.engine.runner.lora_state[0] if isinstance(llm.engine.runner.lora_state, tuple)
                              else llm.engine.runner.lora_state)}


result = {}
for name, kw in (("default", {}), ("qv", qv), ("qv_tp", dict(qv, tensor_parallel_size=2))):
    llm = LLM(base, **engine, **kw)
    result[name] = run(llm)
    llm.close()
print(json.dumps(result))
