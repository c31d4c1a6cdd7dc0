"""`jlora bench tpu`: jlora on a TPU chip against the chip's own limits (docs/tpu.md).

    jlora bench tpu --shape llama-3.2-1b --dir /tmp/ckpt --out results/ [--sections ...]
    jlora bench tpu --shape llama-3.1-8b --quantization int8-weight-only \
        --sections checkpoint,load,qmatmul,engine,agree,warm

Runs where no model hub or default-model package is: it writes a random-weight checkpoint of a
named shape (HF layout: config.json, safetensors in bfloat16, a word-level tokenizer.json) and
feeds token-id prompts. Sections (`--sections`, in the order given):

  checkpoint  write the checkpoint (skipped when it is there)
  load        the streaming loader alone, each load in a fresh process (`--load-modes`): cold (an
              empty weights cache: hash, convert/quantize, write the cache, stream onto the chip),
              warm (from the weights cache), direct (no cache: quantized layer by layer from the
              checkpoint); seconds, peak host RSS above where the load began (and sampled anonymous
              memory: what is not file pages), device bytes by dtype and the device's peak
  kernel      paged attention alone, the Pallas kernel and the XLA loop inside one jit each,
              against the reference: GB/s of KV read and the fraction of the HBM roofline
  qmatmul     the shape's projections and lm head alone, bf16 / W8A16 / W8A8, inside one jit each:
              decode rows against the HBM roofline, a prefill chunk against the MXU peak
  layers      the decoder's layer stack alone (attention left out) at 1, 64 and 1,088 tokens: no
              LoRA, slots without adapter tokens, 4 mixed adapters with and without the LoRA
              conditionals (what LoRA adds to the projections, without an engine per variant)
  engine      LLM() on the checkpoint with `--quantization`: start-up, the compiled steps' HLO checked
              for whole-cache copies and their memory, the workloads of `WORKLOADS` (tok/s, decode ms
              per step and its fraction of the HBM roofline, prefill's fraction of the MXU peak,
              TTFT), LoRA overhead, compiles after warm-up, and a profile's top device ops
  agree       int8-weight-only and int8 against bf16 at the 1B shape (its own checkpoint):
              teacher-forced top-1 agreement and logit differences on a few token-id prompts
  warm        a second process starting the same engine (persistent compile and weights caches)
  slora       S-LoRA's experiment (`slora`): `--slora-adapters` distinct random q/v adapters (rank
              8-16), `--slora-rows` running sequences, one engine per `--slora-slots` count, each
              checked against the CPU first; the same requests on one adapter and on adapters drawn
              uniformly and with power-law popularity: tok/s and its ratio, TTFT p50/p99, slot
              writes, each adapter's host-to-device load (p50/p99), compiles after warm-up
  runtime     the TPU runtime's start in fresh processes for each `--premapped-sizes` value of
              TPU_PREMAPPED_BUFFER_SIZE, with a 512 MB transfer each way; LLM()'s imports alone and
              beside the runtime's start (`jlora.engine.startup.start_backend`)

Where each part lives: `shapes` (the shapes, their checkpoints and adapters; the memory arithmetic
is `jlora.engine.kv_plan`), `micro` (kernel, qmatmul, layers), `workloads` (engine), `slora` (slora), `startup`
(load, runtime, warm), `agree` (check, agree), `common` (the chip's peaks, results, processes) and
`cli` (flags and the run).

One process at a time can hold the chip, so every section that uses it runs in a fresh process of
its own (kernel, qmatmul and engine, when next to each other, share one); `--in-process` runs them
all here (the CPU). KV cache: `--max-num-seqs auto` (the default) sizes it to what the chip's
memory holds after the weights, the LoRA slots and `--kv-headroom-gb` for the step's temporaries
(`jlora.engine.kv_plan.kv_plan`); every sequence gets max_model_len positions.

Roofline arithmetic: a decode step must read every weight once (an untied embedding table only
for its rows: it is not counted; int8 weights as 1 byte each plus their float32 scales), the KV of
every row's context and the LoRA slots its rows use; bytes / step time / HBM bandwidth is the
fraction. A prefill step must do 2 x (matmul parameters) x tokens flops; flops / step time / MXU
peak (197 TFLOP/s bf16; 394 TOPS for W8A8's int8 projections).
Everything is written to --out as it is measured (results.json, profile-<shape>-<quantization>.txt).
"""


from jlora.bench.tpu.cli import main, parse_args

__all__ = ["main", "parse_args"]
