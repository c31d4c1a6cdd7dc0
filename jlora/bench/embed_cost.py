"""What `enable_embedding_lora` costs a plain mixed batch: two engines, the option off and on, one process.

SmolLM2-135M, float32, 4 slots of rank 32, 16 requests of 16-64 prompt tokens, 32 new tokens, greedy,
EOS ignored, 4 plain adapters (ranks 8/16/8/32 on every linear layer) round-robin with every fourth
request on the base model. Rounds interleave the engines (off, on, off, on, ...); each reports
output tokens per wall second and per CPU second of the process (steadier on a shared machine).
Both engines must give the same tokens (the option changes no plain row's arithmetic). `--vocab`
also runs a third engine (option on) whose adapters add embed_tokens + lm_head LoRA (same ranks):
what rows with such adapters cost.

`--step-reps N` instead times the decoder step alone (forward + head over 16 decode tokens, 4 plain
adapters of ranks 8/16/8/32 in 4 slots of rank 32, one jitted function per state, calls
interleaved): the slots without and with the embedding / head entries, the flags False, as a plain
batch on an engine with the option runs it.

    jlora bench embed-cost [--rounds 3] [--vocab]
    jlora bench embed-cost --step-reps 60
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

import numpy as np

from jlora.bench.timing import decode_inputs, interleaved_ms


def add_vocab_lora(path: Path, dst: Path, cfg, rng: np.random.Generator) -> Path:
    """A copy of the PEFT adapter at `path` with embed_tokens and lm_head LoRA of its rank added."""
    from safetensors.numpy import load_file, save_file

    c = json.loads((path / "adapter_config.json").read_text())
    t = load_file(str(path / "adapter_model.safetensors"))
    r, v, d = c["r"], cfg.vocab_size, cfg.hidden_size
    t["base_model.model.model.embed_tokens.lora_embedding_A"] = rng.standard_normal((r, v), np.float32) * 0.1
    t["base_model.model.model.embed_tokens.lora_embedding_B"] = rng.standard_normal((d, r), np.float32) * 0.01
    t["base_model.model.lm_head.lora_A.weight"] = rng.standard_normal((r, d), np.float32) / np.sqrt(d)
    t["base_model.model.lm_head.lora_B.weight"] = rng.standard_normal((v, r), np.float32) * 0.01
    c["target_modules"] = list(c["target_modules"]) + ["embed_tokens", "lm_head"]
    dst.mkdir(parents=True)
    save_file(t, str(dst / "adapter_model.safetensors"))
    (dst / "adapter_config.json").write_text(json.dumps(c))
    return dst


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="jlora bench embed-cost", description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--vocab", action="store_true", help="also time rows whose adapters have embed/head LoRA")
    p.add_argument("--step-reps", type=int, default=0, help="time the decoder step alone, this many calls each")
    args = p.parse_args(argv)
    if args.step_reps:
        return step_cost(args.step_reps)

    import jax

    from jlora import LLM, LoRARequest, SamplingParams
    from jlora.bench.adapters import run_queued
    from jlora.bench.lora_cost import write_adapters

    engine = dict(max_model_len=256, max_num_seqs=16, max_num_batched_tokens=256, max_loras=4, max_lora_rank=32,
                  progress=False)
    llms = {"off": LLM(**engine), "on": LLM(enable_embedding_lora=True, **engine)}
    cfg = llms["off"].engine.adapters.model_cfg
    root = Path(tempfile.mkdtemp(prefix="jlora-embed-cost-"))
    paths = write_adapters(root, cfg)
    plain = [LoRARequest(f"plain{i}", 1 + i, str(q)) for i, q in enumerate(paths)]
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, cfg.vocab_size, int(rng.integers(16, 65))).tolist() for _ in range(16)]
    loras = [None if i % 4 == 3 else plain[i % 4] for i in range(16)]
    params = SamplingParams(temperature=0.0, max_tokens=args.new_tokens, ignore_eos=True)
    runs = {"off": (llms["off"], loras), "on": (llms["on"], loras)}
    if args.vocab:  # its own engine: sharing slots with the plain adapters would add slot writes to both runs
        llms["on+vocab"] = LLM(enable_embedding_lora=True, **engine)
        vocab = [LoRARequest(f"vocab{i}", 11 + i, str(add_vocab_lora(q, root / f"vocab{i}", cfg, rng)))
                 for i, q in enumerate(paths)]
        runs["on+vocab"] = (llms["on+vocab"], [None if i % 4 == 3 else vocab[i % 4] for i in range(16)])
    tokens = {}
    for name, (llm, rows) in runs.items():  # warm: adapters converted and written, outside the timing
        outs = llm.generate([{"prompt_token_ids": q} for q in prompts], params, lora_request=rows, use_tqdm=False)
        tokens[name] = [o.outputs[0].token_ids for o in outs]
    print("plain rows give the same tokens with the option on and off:", tokens["on"] == tokens["off"])
    results: dict[str, list[dict]] = {k: [] for k in runs}
    for _ in range(args.rounds):
        for name, (llm, rows) in runs.items():
            results[name].append(run_queued(llm, prompts, rows, params))
    for name, rs in results.items():
        print(f"{name:9s} tok/s {[round(r['tok_s'], 1) for r in rs]} median {statistics.median(r['tok_s'] for r in rs):.1f}"
              f" | tok/CPU-s {[round(r['tok_cpu_s'], 1) for r in rs]} median "
              f"{statistics.median(r['tok_cpu_s'] for r in rs):.1f}")
    for name in list(results)[1:]:
        for key in ("tok_s", "tok_cpu_s"):
            ratio = statistics.median(r[key] for r in results[name]) / statistics.median(r[key] for r in results["off"])
            print(f"{name} / off, {key}: {ratio:.3f}")
    print("rounds:", args.rounds, "jax", jax.__version__)
    for llm in llms.values():
        llm.close()
    return 0


def step_cost(reps: int) -> int:
    """The decoder step with slots without / with embedding and head LoRA entries (flags False)."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from jlora.adapters import padded_update, read_peft_adapter
    from jlora.adapters.slots import LoRASlots, SlotWrite
    from jlora.bench.lora_cost import write_adapters
    from jlora.models.config import LORA_MODULES, VOCAB_MODULES
    from jlora.models.loading import load_model

    model = load_model(None)[0]
    cfg = model.cfg
    paths = write_adapters(Path(tempfile.mkdtemp(prefix="jlora-embed-step-")), cfg)
    states = {}
    for name, modules in (("off", LORA_MODULES), ("on", LORA_MODULES + VOCAB_MODULES)):
        slots = LoRASlots(cfg, 4, 32, modules=modules)
        slots.write([SlotWrite(i, padded_update(read_peft_adapter(q, cfg, 32), cfg, 32, modules))
                     for i, q in enumerate(paths)])
        states[name] = slots.state
    t = 16
    graphdef, params = nnx.split(model)
    cache, tokens, group, slot_ids = decode_inputs(cfg, t)
    scale, mix, no = jnp.ones((t,), jnp.float32), jnp.zeros((t, 4), jnp.float32), jnp.asarray(False)

    @jax.jit
    def step(params, state, cache):
        m = nnx.merge(graphdef, params)
        h, _ = m.forward(tokens, slot_ids, (group,), cache, state, slot_scale=scale, slot_mix=mix, embed_lora=no)
        return m.logits(h, state, slot_ids, scale, mix, enabled=no)

    outs = {k: step(params, s, cache).block_until_ready() for k, s in states.items()}
    print("logits bit-equal with and without the embedding / head slots:", bool(jnp.array_equal(*outs.values())))
    stats = interleaved_ms({k: (lambda s=s: step(params, s, cache)) for k, s in states.items()}, reps)
    for name, ms in stats.items():
        print(f"{name} ms:", {k: round(v, 1) for k, v in ms.items()}, "on / off:", round(ms["on"] / ms["off"], 4))
    print("reps:", reps, "jax", jax.__version__)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
