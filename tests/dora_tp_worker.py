"""Run by tests/test_dora.py in a process of its own (JAX fixes its device count at start): greedy
tokens of a batch mixing DoRA, plain and base rows on one device and under tensor_parallel_size=2."""

import json
import os
import sys

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
os.environ["JAX_PLATFORMS"] = "cpu"

from jlora import LLM, LoRARequest, SamplingParams, compile_stats  # noqa: E402

base, *adapters = sys.argv[1:]
engine = dict(max_model_len=128, max_num_seqs=4, max_num_batched_tokens=32, max_loras=2, max_lora_rank=8,
              token_buckets=(16, 32), progress=False, enable_dora=True)
greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
prompts = ["Hello there", "Once upon a time", "1 2 3 4", "The cat"]
reqs = [LoRARequest(f"a{i}", i + 1, p) for i, p in enumerate(adapters)]
loras = [reqs[0], None, reqs[1], reqs[2]]
one = LLM(base, **engine)
want = [o.outputs[0].token_ids for o in one.generate(prompts, greedy, loras)]
tp = LLM(base, tensor_parallel_size=2, **engine)
before = compile_stats.compile_count()
got = [o.outputs[0].token_ids for o in tp.generate(prompts, greedy, loras)]
got_reversed = [o.outputs[0].token_ids for o in tp.generate(prompts[::-1], greedy, loras[::-1])][::-1]
print(json.dumps({"one": want, "tp": got, "tp_reversed": got_reversed,
                  "compiles": compile_stats.compile_count() - before}))
