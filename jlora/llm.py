"""LLM: the vLLM-shaped entry point (`generate`, `chat`, streaming) over an LLMEngine."""

from __future__ import annotations

import os
import sys
import time
from typing import Any, Iterator, Sequence as Seq

import jax
import jax.numpy as jnp
from tqdm.auto import tqdm

from jlora import compile_stats
from jlora.adapters.request import LoRARequest
from jlora.closing import Closable
from jlora.engine import startup
from jlora.engine.startup import (  # noqa: F401 (re-exported)
    WARMUP_MODES, adapter_cache_dir, enable_compilation_cache, executable_cache_wanted, import_in_background,
    open_executable_store, parallel_devices, resolve_warmup, start_backend, weights_cache_dir,
)
from jlora.engine_args import ENGINE_DEFAULTS, engine_config
from jlora.outputs import RequestOutput
from jlora.sampling import SamplingParams
from jlora.tuning import TuningOptions

# The engine, the model loader and the tokenizer (Flax, transformers: 2-5 s on a TPU host) are
# imported inside LLM(), while the TPU runtime starts in a thread (`start_backend`); the start-up's
# steps are jlora.engine.startup's (re-exported here: `from jlora.llm import start_backend` works).


class LLM(Closable):
    """A model, its tokenizer and an engine; `generate`, `generate_stream` and `chat` as in vLLM.

    Everything checkable from the arguments alone (dtype, engine sizes, buckets, lora_impl, the model
    path) is checked before any weights are read or graphs compiled. The size defaults are
    `EngineConfig`'s (`ENGINE_DEFAULTS`), shared with the CLI.

    warmup=True ("eager") compiles every graph before returning, so no request waits for a compile.
    warmup="background" compiles the two graphs that can run any step (the most decode rows, one
    prompt's full chunk) before returning and the rest in a thread while the engine serves: steps
    keep to the compiled shapes (padding costs compute, never a wait for a compile) until
    `wait_for_warmup()` would return. warmup=False ("lazy"): each graph compiles the first time a
    batch needs it (and shows in `compile_report()` under its stage), so a one-off call that needs
    few graphs starts sooner. None (the default): "background" on one TPU host, where a step graph
    takes seconds to compile; eager elsewhere.

    weights_cache=True keeps the converted (dequantized) weights on disk, keyed by the source file's
    contents, so a second start does not dequantize the GGUF again (`jlora.models.weights_cache`);
    False turns it off (so does JLORA_WEIGHTS_CACHE=0); a path puts the cache there.

    adapter_cache=True does the same for converted LoRA adapters (`jlora.adapters.disk_cache`): keyed by
    the adapter's content, so a restart or a second engine reads instead of converting; False turns
    it off (so does JLORA_ADAPTER_CACHE=0); a path puts it there. The host cache of converted adapters
    holds at most `max_cpu_loras` of them and, when given, at most `max_cpu_lora_bytes` bytes.

    executable_cache keeps each compiled step graph as a serialized executable, keyed by the code,
    the platform and both configs (`jlora.engine.executables`), so a later start of the same engine
    loads it without tracing: None (the default) on one TPU host with the compile cache on, True
    wherever one engine runs on one device, a path puts it there, False (or
    JLORA_EXECUTABLE_CACHE=0) turns it off.

    Every cache lives in its own folder under one root, `$JLORA_CACHE_DIR` (default ~/.cache/jlora):
    xla/, weights/, adapters/, executables/, each capped in size (`jlora.caches`).
    compilation_cache_dir puts the XLA compile cache (only) elsewhere; use_compilation_cache=False
    turns it off.

    kv_cache_memory_fraction: size the KV cache to this share of the device's memory once the
    weights are placed, less the LoRA slots (vLLM's gpu_memory_utilization; `llm.kv_cache_plan`
    says what it chose); a backend without a memory limit (the CPU) keeps max_num_seqs full-length
    sequences. None: num_kv_blocks. "auto" (the default): 0.8 on one TPU device when num_kv_blocks
    is not given (`jlora.engine_args.default_kv_cache_memory_fraction`), else None. max_num_seqs still
    bounds the sequences running at once; the rest of the cache holds cached prefixes and lets long
    sequences run without preemption.

    kv_cache_dtype: "auto" (the default, or None) keeps keys and values in the model's dtype; "int8"
    stores them as int8 with a float32 scale per position and KV head (`jlora.kernels.kv_quant`),
    about half a bf16 cache's bytes a token, so kv_cache_memory_fraction fits about twice the
    sequences (docs/tpu.md, "KV sizing"). Both attention paths read it; outputs move slightly
    (SmolLM2: teacher-forced top-1 agreement with the float cache in docs/api.md).

    tuning: the engine's performance switches (`jlora.tuning.TuningOptions`: how the LoRA
    conditionals and the attention kernel's programs are built, how prefill shapes are chosen);
    the default (or None) is the measured defaults. Outputs do not depend on it.

    `close()` (or leaving `with LLM(...) as llm:`) stops a background warm-up and frees the device
    memory (weights, KV cache, LoRA slots), the compiled graphs and the engine's threads at once;
    using the LLM afterwards raises RuntimeError. A dropped LLM frees the same without it.
    """

    _closed_name = "this LLM"

    def __init__(
        self,
        model: str | os.PathLike | None = None,
        *,
        dtype: str = "float32",
        quantization: str | None = None,
        max_model_len: int = ENGINE_DEFAULTS["max_model_len"],
        max_num_seqs: int = ENGINE_DEFAULTS["max_num_seqs"],
        max_num_batched_tokens: int = ENGINE_DEFAULTS["max_num_batched_tokens"],
        max_loras: int = ENGINE_DEFAULTS["max_loras"],
        max_lora_rank: int = ENGINE_DEFAULTS["max_lora_rank"],
        lora_slot_ranks: Seq[int] | None = None,
        enable_embedding_lora: bool = ENGINE_DEFAULTS["enable_embedding_lora"],
        enable_dora: bool = ENGINE_DEFAULTS["enable_dora"],
        lora_target_modules: Seq[str] | None = ENGINE_DEFAULTS["lora_target_modules"],
        max_cpu_loras: int | None = None,
        max_cpu_lora_bytes: int | None = None,
        lora_impl: str = ENGINE_DEFAULTS["lora_impl"],
        token_buckets: Seq[int] | None = None,
        attn_chunk: int | None = ENGINE_DEFAULTS["attn_chunk"],
        attn_impl: str = ENGINE_DEFAULTS["attn_impl"],
        async_scheduling: bool | None = ENGINE_DEFAULTS["async_scheduling"],
        block_size: int | None = ENGINE_DEFAULTS["block_size"],
        base_graphs: str | None = ENGINE_DEFAULTS["base_graphs"],
        decode_row_buckets: Seq[int] | None = None,
        scheduling_policy: str = ENGINE_DEFAULTS["scheduling_policy"],
        max_overtakes: int = ENGINE_DEFAULTS["max_overtakes"],
        max_n: int = ENGINE_DEFAULTS["max_n"],
        max_waiting_seqs: int | None = ENGINE_DEFAULTS["max_waiting_seqs"],
        num_kv_blocks: int | None = None,
        enable_prefix_caching: bool = ENGINE_DEFAULTS["enable_prefix_caching"],
        tensor_parallel_size: int = 1,
        data_parallel_size: int = 1,
        warmup: bool | str | None = None,
        compilation_cache_dir: str | os.PathLike | None = None,
        use_compilation_cache: bool = True,
        weights_cache: bool | str | os.PathLike = True,
        adapter_cache: bool | str | os.PathLike = True,
        executable_cache: bool | str | os.PathLike | None = None,
        progress: bool = True,
        tuning: TuningOptions | None = ENGINE_DEFAULTS["tuning"],
        kv_cache_memory_fraction: float | str | None = ENGINE_DEFAULTS["kv_cache_memory_fraction"],
        kv_cache_dtype: str | None = ENGINE_DEFAULTS["kv_cache_dtype"],
    ):
        phases = startup.Phases()
        backend_started = start_backend()  # the TPU runtime's start overlaps the imports below
        startup.check_cache_args(max_cpu_lora_bytes, adapter_cache, executable_cache)
        engine_imports = startup.start_imports()  # the engine's and tokenizer's, in a thread
        phases.done("imports")
        runtime_wait = backend_started()
        phases.done("runtime")
        phases.seconds["runtime_start"] = runtime_wait
        from jlora.models.quant import check_quantization

        warmup = resolve_warmup(warmup)
        self.quantization = check_quantization(quantization)
        self.dtype = dtype
        self.config = engine_config(
            dtype=dtype, max_model_len=max_model_len, max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens, max_loras=max_loras, max_lora_rank=max_lora_rank,
            max_cpu_loras=max_cpu_loras, lora_impl=lora_impl, token_buckets=token_buckets,
            lora_slot_ranks=lora_slot_ranks, enable_embedding_lora=enable_embedding_lora, enable_dora=enable_dora,
            lora_target_modules=lora_target_modules,
            attn_chunk=attn_chunk, attn_impl=attn_impl, async_scheduling=async_scheduling, block_size=block_size,
            base_graphs=base_graphs, scheduling_policy=scheduling_policy,
            decode_row_buckets=None if decode_row_buckets is None else tuple(decode_row_buckets),
            max_overtakes=max_overtakes, max_n=max_n, max_waiting_seqs=max_waiting_seqs,
            num_kv_blocks=num_kv_blocks, enable_prefix_caching=enable_prefix_caching, backend=jax.default_backend(),
            tuning=TuningOptions() if tuning is None else tuning, kv_cache_memory_fraction=kv_cache_memory_fraction,
            devices=tensor_parallel_size * data_parallel_size, kv_cache_dtype=kv_cache_dtype)
        path, device_groups = startup.resolve_model(model, self.config, num_kv_blocks, tensor_parallel_size,
                                                    data_parallel_size)
        self.tensor_parallel_size, self.data_parallel_size = tensor_parallel_size, data_parallel_size
        phases.done("validate")
        self.progress = progress
        say = self._say if progress else None
        cache, read_cfg, store = startup.open_caches(
            path, dtype, self.quantization, self.config, device_groups, warmup, use_compilation_cache,
            compilation_cache_dir, weights_cache, executable_cache, tensor_parallel_size, say)
        phases.done("open_caches")
        self.model, self.model_path, fields, self.weights_cache_hit = startup.load_weights(
            path, dtype, cache, self.quantization, device_groups, max_model_len)
        self.config, self.kv_cache_plan = startup.size_kv_cache(self.config, self.model, device_groups,
                                                                max_model_len, say)
        phases.done("load_weights")
        imports_waited = startup.finish_imports(engine_imports)
        phases.done("engine_imports")
        phases.seconds["engine_imports_waited"] = imports_waited
        self.tokenizer = startup.load_tokenizer(self.model_path, fields)
        phases.done("tokenizer")
        self.engine = startup.build_engine(self.model, self.tokenizer, self.config, device_groups, adapter_cache,
                                           max_cpu_lora_bytes)
        self.executable_store = startup.attach_executable_store(
            store, self.runners, read_cfg, self.model, executable_cache, device_groups, dtype, self.quantization,
            self.config)
        phases.done("engine_init")
        # Where the start-up went, in seconds (`jlora bench start` reports these). "imports" are the
        # loader's modules, imported while the backend started; "runtime" is what was left of the
        # backend's start after them (its whole start: `runtime_start`); "engine_imports" what was left
        # of the engine's and tokenizer's imports after the weights (`engine_imports_waited` of it
        # waiting for the import thread).
        self.startup_seconds: dict[str, float] = phases.seconds
        self.warmup_mode = warmup
        if warmup != "lazy":
            self.warmup(background=warmup == "background")
        elif progress:
            self._say("lazy start (warmup=False): each graph compiles the first time a batch needs it")
        phases.done("warmup")
        if warmup != "lazy":  # its parts: tracing and lowering the step graphs, then compiling (or loading) them
            for part in ("load_stored", "trace_and_lower", "compile"):
                self.startup_seconds[f"warmup_{part}"] = sum(r.compile_seconds[part] for r in self.runners)

    def _release(self) -> None:
        """`close()`: stop a background warm-up, free the engine's device arrays and compiled graphs
        and the model's weights, and stop the engine's threads (`LLMEngine.close`,
        `DataParallelEngine.close`) and the executable store's. Generate, chat and the rest raise
        RuntimeError after it."""
        from flax import nnx

        self.engine.close()
        if self.executable_store is not None:
            self.executable_store.close()
        for x in jax.tree.leaves(nnx.state(self.model)):  # the weights as loaded (the runner uses them on one device)
            if isinstance(x, jax.Array):
                x.delete()

    @property
    def runners(self) -> list:
        """The engine's ModelRunners: one per data-parallel replica."""
        return list(getattr(self.engine, "runners", [self.engine.runner]))

    def warmup(self, background: bool = False) -> None:
        """Compile every graph the engine can need: the slot writes and each step shape; with
        `background`, the step graphs but `EngineConfig.first_graphs()` in a thread (see the class)."""
        self._check_open()
        steps = sum(len([g for g in r.config.step_graphs() if g not in r._executables]) for r in self.runners)
        slots = sum(len(r.lora.pools) for r in self.runners)
        if self.progress:
            later = sum(len(set(r.config.step_graphs()) - set(r.config.first_graphs()) - set(r._executables))
                        for r in self.runners) if background else 0
            self._say(f"compiling {steps + slots} graphs ({steps} step graphs, {slots} set_slot"
                      + (f"; {later} of the step graphs in the background while serving" if later else "")
                      + f"); {startup.compile_cache_holds()}")
        t = time.perf_counter()
        n, hits = compile_stats.compile_count(exclude=(compile_stats.BACKGROUND,)), compile_stats.cache_hit_count()
        stored = sum(len(r.loaded_graphs) for r in self.runners)
        for runner in self.runners:
            runner.warmup(progress=self.progress, background=background)
        if self.progress:
            n = compile_stats.compile_count(exclude=(compile_stats.BACKGROUND,)) - n
            hits = compile_stats.cache_hit_count() - hits
            stored = sum(len(r.loaded_graphs) for r in self.runners) - stored
            self._say(f"warm-up done in {time.perf_counter() - t:.1f} s: {n} graphs compiled ({hits} of them "
                      f"loaded from the compile cache)"
                      + (f", {stored} step graphs loaded as stored executables, untraced" if stored else "")
                      + ("; serving while the rest compile" if background else ""))

    def wait_for_warmup(self, timeout: float | None = None) -> bool:
        """Wait for a background warm-up (`warmup="background"`) to compile its graphs; True when every
        step graph is compiled (at once for the other modes). Raises what a background compile raised."""
        self._check_open()
        deadline = None if timeout is None else time.monotonic() + timeout
        return all([r.wait_warmup(None if deadline is None else max(0.0, deadline - time.monotonic()))
                    for r in self.runners])

    def _say(self, message: str) -> None:
        """One line of what the start is doing, on stderr beside tqdm's bars (only with progress=True)."""
        if self.progress:
            print(f"jlora: {message}", file=sys.stderr, flush=True)

    # ---- generation -------------------------------------------------------------------------------

    def _add_all(self, prompts, params, lora_request) -> list[str]:
        self._check_open()
        prompts = [prompts] if isinstance(prompts, (str, dict)) else list(prompts)
        if prompts and isinstance(prompts[0], int):  # a single token id list
            prompts = [prompts]
        n = len(prompts)
        params_list = list(params) if isinstance(params, (list, tuple)) else [params or SamplingParams()] * n
        loras = list(lora_request) if isinstance(lora_request, (list, tuple)) else [lora_request] * n
        if len(params_list) != n:
            raise ValueError(f"got {len(params_list)} SamplingParams for {n} prompts")
        if len(loras) != n:
            raise ValueError(f"lora_request is a list of {len(loras)} for {n} prompts")
        ids = []  # a bad prompt un-queues the ones before it, so the engine is left as it was
        try:
            for p, sp, lr in zip(prompts, params_list, loras):
                ids.append(self.engine.add_request(p, sp, lr))
        except Exception:
            for rid in ids:
                self.engine.abort(rid)
                self.engine.pop_finished(rid)
            raise
        return ids

    def generate(
        self,
        prompts: str | dict | Seq[str | dict | list[int]],
        sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
        lora_request: LoRARequest | Seq[LoRARequest | None] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Outputs in prompt order. A request the engine failed comes back with finish_reason
        "error" and `error` set; the others are unaffected."""
        ids = self._add_all(prompts, sampling_params, lora_request)
        done: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(ids), desc="generate", disable=not (use_tqdm and self.progress and len(ids) > 1))
        try:
            while len(done) < len(ids):
                finished = [o.request_id for o in self.engine.step(finished_only=True) if o.finished]
                for rid in finished:
                    done[rid] = self.engine.pop_finished(rid)
                bar.update(len(finished))
                if not finished and not self.engine.has_unfinished():
                    raise RuntimeError("the engine has nothing left to run but requests are unfinished")
        finally:
            bar.close()
            for rid in ids:  # interrupted (KeyboardInterrupt, an engine bug): leave the engine clean
                if rid not in done:
                    self.engine.abort(rid)
                    self.engine.pop_finished(rid)
        return [done[r] for r in ids]

    def generate_stream(
        self,
        prompt: str | dict | list[int],
        sampling_params: SamplingParams | None = None,
        lora_request: LoRARequest | None = None,
    ) -> Iterator[str]:
        """Yields text deltas of one request as its tokens arrive (the first sample when n > 1)."""
        (rid,) = self._add_all([prompt], sampling_params, lora_request)
        finished = False
        try:
            while not finished:
                changed = {o.request_id: o for o in self.engine.step()}
                if rid in changed:
                    delta = self.engine.stream_deltas(rid)[0]
                    if delta:
                        yield delta
                    finished = changed[rid].finished
        finally:
            if not finished:
                self.engine.abort(rid)
            self.engine.pop_finished(rid)

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                            tools: list[dict[str, Any]] | None = None) -> list[int]:
        """Token ids of `messages` through the chat template; `tools` (OpenAI tool dicts) are handed
        to templates that render them."""
        from jlora.chat_templates import check_messages

        if not getattr(self.tokenizer, "chat_template", None):
            raise ValueError("the model has no chat template")
        check_messages(messages)
        out = self.tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=True,
                                                 tools=tools)
        return list(out["input_ids"] if isinstance(out, dict) or hasattr(out, "keys") else out)

    def chat(
        self,
        messages: dict[str, str] | list[dict[str, str]] | list[list[dict[str, str]]],
        sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
        lora_request: LoRARequest | Seq[LoRARequest | None] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """One conversation (a message dict, or a list of them) or a list of conversations."""
        if isinstance(messages, dict):
            messages = [messages]
        if not isinstance(messages, (list, tuple)) or not messages:
            raise ValueError("messages must be a message dict, a non-empty list of them, or a list of conversations")
        conversations = [messages] if isinstance(messages[0], dict) else messages
        prompts = [{"prompt_token_ids": self.apply_chat_template(c)} for c in conversations]
        return self.generate(prompts, sampling_params, lora_request, use_tqdm)

    # ---- introspection -----------------------------------------------------------------------------

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prompt prefix (vLLM's `LLM.reset_prefix_cache`), e.g. to time or
        compare runs of the same prompts from scratch. Returns False, forgetting nothing, while
        requests are unfinished."""
        self._check_open()
        return self.engine.reset_prefix_cache()

    def update_adapter(self, name: str, params: Any, config: Any, lora_int_id: int, *,
                       adapter: int = 0) -> LoRARequest:
        """Serve trained weights under `name`, from memory: `params` is a training pytree in the
        served layout (`jlora.adapters.training`, `Llama.train_logits`), `config` its PEFT LoRA
        config. The new version is converted now (nothing is written to disk) and a request using
        the returned LoRARequest only writes its slot: the graphs are the slots' own, so nothing
        recompiles. Requests already running keep the version they started with; older versions
        of `name` leave the host cache."""
        from jlora.adapters.training import peft_tensors

        self._check_open()
        req = LoRARequest(name, lora_int_id, tensors=peft_tensors(params, self.model.cfg, config, adapter),
                          config=config, disk_cache=False)
        self.engine.adapters.prepare(req)
        return req

    def memory_report(self, print_table: bool = False) -> dict[str, dict[str, object]]:
        """Device bytes of the weights, the KV cache and the LoRA slots, with how each is stored.

        {"weights": {"bytes", "dtype", "quantization", "int8_bytes", "float_bytes"}, "kv_cache": {"bytes",
        "dtype", "tokens"}, "lora_slots": {"bytes", "dtype", "slots", "max_rank", "slot_ranks", "modules"}, "total": {"bytes"},
        "per_device": {device: {"weights", "kv_cache", "lora_slots", "total"}}, "host_load": {"seconds",
        "rss_before_bytes", "peak_rss_bytes", "peak_added_bytes", ...}}. `host_load` is the host memory the
        weight load took (`jlora.models.streaming.LoadStats`; {} for a model restored from orbax). Bytes are what the
        devices hold: with tensor or data parallelism a sharded array counts its shards, a replicated
        one each copy (under jax.distributed, this process's devices only).
        bf16 kept as its uint16 bits on XLA:CPU (`jlora.models.quant`) is reported as bfloat16.
        """
        self._check_open()
        def name(x) -> str:
            return "bfloat16" if x.dtype == jnp.uint16 else str(x.dtype)

        per_device: dict[str, dict[str, int]] = {}

        def held(arrays, part: str, only=None) -> int:  # bytes of this process's shards, counted per device
            total = 0
            for x in arrays:
                if only is not None and not only(x):
                    continue
                for shard in x.addressable_shards:
                    row = per_device.setdefault(str(shard.device), {"weights": 0, "kv_cache": 0, "lora_slots": 0})
                    if only is None:
                        row[part] += shard.data.nbytes
                    total += shard.data.nbytes
            return total

        weights = [x for r in self.runners for x in jax.tree.leaves(r.state)]
        kv = [x for r in self.runners for x in r.cache.values()]
        slots = [x for r in self.runners for x in jax.tree.leaves(r.lora_state)]
        total_w, total_kv, total_slots = held(weights, "weights"), held(kv, "kv_cache"), held(slots, "lora_slots")
        int8 = held(weights, "weights", only=lambda x: x.dtype == jnp.int8)
        for row in per_device.values():
            row["total"] = row["weights"] + row["kv_cache"] + row["lora_slots"]
        report: dict[str, dict[str, object]] = {
            "weights": {"bytes": total_w, "dtype": self.dtype, "quantization": self.quantization,
                        "int8_bytes": int8, "float_bytes": total_w - int8,
                        "activations": getattr(self.model, "quant_act", None) or "float"},
            "kv_cache": {"bytes": total_kv, "dtype": name(kv[0]), "tokens": self.config.kv_capacity_tokens,
                         "scale_bytes": sum(x.nbytes for r in self.runners for k, x in r.cache.items()
                                            if k.endswith("_scale"))},
            "lora_slots": {"bytes": total_slots, "dtype": name(slots[0]) if slots else self.dtype,
                           "slots": self.config.max_loras, "max_rank": self.config.max_lora_rank,
                           "slot_ranks": list(self.config.slot_ranks),
                           "modules": list(self.config.lora_modules)},  # held PEFT modules (lora_target_modules)
        }
        report["total"] = {"bytes": sum(int(v["bytes"]) for v in report.values())}
        report["per_device"] = per_device
        stats = getattr(self.model, "load_stats", None)  # jlora.models.streaming.LoadStats
        report["host_load"] = stats.to_dict() if stats is not None else {}
        if print_table:
            print(format_memory_report(report))
        return report

    def compile_report(self, print_table: bool = True) -> dict[str, tuple[int, float]]:
        table = compile_stats.stage_table()
        if print_table:
            print(compile_stats.format_table(table))
        return table


def format_memory_report(report: dict[str, dict[str, object]]) -> str:
    """`LLM.memory_report()` as a small table (MB = 1e6 bytes)."""
    w, kv, lo = report["weights"], report["kv_cache"], report["lora_slots"]
    rows = [("weights", w["bytes"], f"{w['dtype']}, quantization={w['quantization']}"
             + (f" (int8 {w['int8_bytes'] / 1e6:.1f} MB, activations {w['activations']})" if w["int8_bytes"] else "")),
            ("kv_cache", kv["bytes"], f"{kv['dtype']}, {kv['tokens']} tokens"
             + (f", {kv['scale_bytes'] / 1e6:.2f} MB of it scales" if kv.get("scale_bytes") else "")),
            ("lora_slots", lo["bytes"], f"{lo['dtype']}, " + (
                f"{lo['slots']} slots x rank {lo['max_rank']}" if len(set(lo.get("slot_ranks") or [0])) == 1
                else f"slots of ranks {lo['slot_ranks']}")),
            ("total", report["total"]["bytes"], "")]
    lines = [f"{n:<11} {b / 1e6:9.1f} MB  {d}" for n, b, d in rows]
    load = report.get("host_load") or {}
    if load:
        lines.append(f"host load: peak RSS {load['peak_rss_bytes'] / 1e6:.1f} MB "
                     f"(+{load['peak_added_bytes'] / 1e6:.1f} MB during the load), {load['seconds']:.1f} s")
    devices = report.get("per_device", {})
    if len(devices) > 1:
        lines += [f"  {dev}: weights {r['weights'] / 1e6:.1f} MB, kv_cache {r['kv_cache'] / 1e6:.1f} MB, "
                  f"lora_slots {r['lora_slots'] / 1e6:.1f} MB" for dev, r in devices.items()]
    return "\n".join(lines)
