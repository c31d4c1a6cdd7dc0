"""Every benchmark, behind one entry point: `jlora bench [NAME] [ARGS]` (or `python -m jlora.bench.MODULE`).

    jlora bench [--write]          workload.py: the reference workload against transformers(+peft)
    jlora bench start [--write]    start.py: cold and warm start-up of LLM() in fresh processes
    jlora bench kernels [--quick]  kernels.py: LoRA kernel micro-benchmark (docs/kernels.md)
    jlora bench serve              serve.py: the HTTP server under Poisson arrivals
    jlora bench adapters           adapters.py: many adapters, S-LoRA's experiment
    jlora bench lora-cost          lora_cost.py: jlora with 4 mixed adapters against no adapters
    jlora bench decode-step        decode_step.py: one engine decode step, adapters against none
    jlora bench adapter-load       adapter_load.py: disk -> host -> device slot time of one adapter
    jlora bench dora-cost          dora_cost.py: the decoder with and without DoRA factors, one process
    jlora bench embed-cost         embed_cost.py: a plain mixed batch with enable_embedding_lora off vs on
    jlora bench parallel           parallel.py: step time and tokens/s against TP x DP (forced CPU devices)
    jlora bench tpu                tpu/: on a TPU chip, against its HBM and MXU roofline (docs/tpu.md)
    jlora bench tpu-compile        tpu_compile.py: the step graphs compiled for a v5e chip without one (libtpu)
    jlora bench prefix             prefix.py: a shared system prompt over 4 adapters, prefix cache on vs off
    jlora bench soak               soak.py: `jlora serve` under sustained mixed load, adapter churn, walk-aways

Each module has a `main(argv) -> int` and imports what it measures only when it runs, so this
table (and `jlora --help`) costs no JAX import.
"""

from __future__ import annotations

import importlib

# command name -> module under jlora.bench; "e2e" is what a bare `jlora bench` runs
BENCHMARKS = {"e2e": "workload", "start": "start", "kernels": "kernels", "serve": "serve", "adapters": "adapters",
              "lora-cost": "lora_cost", "decode-step": "decode_step", "adapter-load": "adapter_load",
              "parallel": "parallel", "tpu": "tpu", "tpu-compile": "tpu_compile", "prefix": "prefix",
              "soak": "soak", "dora-cost": "dora_cost", "embed-cost": "embed_cost"}


def run(name: str, argv: list[str]) -> int:
    """Run benchmark `name` (a key of BENCHMARKS) with its own command line `argv`."""
    if name not in BENCHMARKS:
        raise ValueError(f"unknown benchmark {name!r}; choose from {list(BENCHMARKS)}")
    return importlib.import_module(f"jlora.bench.{BENCHMARKS[name]}").main(argv)
