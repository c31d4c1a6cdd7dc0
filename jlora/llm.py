"""LLM: the vLLM-shaped entry point (`generate`, `chat`, streaming) over an LLMEngine."""

from __future__ import annotations

import os
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence as Seq

import jax
import jax.numpy as jnp
from tqdm.auto import tqdm

from jlora import caches, compile_stats
from jlora.adapters.request import LoRARequest
from jlora.closing import Closable
from jlora.engine import executables
from jlora.engine_args import ENGINE_DEFAULTS, engine_config
from jlora.outputs import RequestOutput
from jlora.sampling import SamplingParams
from jlora.tuning import TuningOptions

# The engine, the model loader and the tokenizer (Flax, transformers: 2-5 s on a TPU host) are
# imported inside LLM(), while the TPU runtime starts in a thread (`start_backend`).

_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


def enable_compilation_cache(path: str | os.PathLike | None = None) -> Path | None:
    """Persistent XLA cache so a second start skips compilation: in `path`, else
    `$JLORA_CACHE_DIR/xla` (`jlora.caches`). Capped by JAX's own LRU eviction
    (`jax_compilation_cache_max_size`, from JLORA_CACHE_MAX_XLA_GB) unless that option was set
    already. JAX's eviction needs an `-atime` file beside each entry: entries written without one
    (eviction off: an older jlora, JAX alone) get it here; one such written while this process runs
    makes JAX skip (with a warning) this process's later writes to the cache, until the next start. None (and a warning) when the folder is not the user's own (`caches.usable`): a cached
    executable runs code when loaded, so the cache stays off."""
    path = Path(path).expanduser() if path is not None else caches.cache_dir("xla")
    if not caches.usable(path):
        return None
    caches.make_dir(path)
    jax.config.update("jax_compilation_cache_dir", str(path))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    cap = caches.max_bytes("xla")
    # JAX's eviction locks the folder with `filelock` (a dependency of transformers' hub client). It
    # is on even without a cap (JLORA_CACHE_MAX_XLA_GB=none: a cap no folder reaches), so that every
    # jlora process writes the -atime file another one's eviction reads.
    if jax.config.jax_compilation_cache_max_size == -1 and _has_filelock():
        caches.prepare_xla_eviction(path)  # entries written with eviction off get their -atime file
        jax.config.update("jax_compilation_cache_max_size", cap if cap is not None else 2**62)
    return path


def _has_filelock() -> bool:
    import importlib.util

    return importlib.util.find_spec("filelock") is not None


def weights_cache_dir() -> Path:
    """Where converted weights are cached: `$JLORA_CACHE_DIR/weights` (or JLORA_WEIGHTS_CACHE_DIR)."""
    return caches.cache_dir("weights")


def adapter_cache_dir() -> Path:
    """Where converted adapters are cached: `$JLORA_CACHE_DIR/adapters` (or JLORA_ADAPTER_CACHE_DIR)."""
    return caches.cache_dir("adapters")


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
    sequences. None (the default): num_kv_blocks.

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
        kv_cache_memory_fraction: float | None = ENGINE_DEFAULTS["kv_cache_memory_fraction"],
        kv_cache_dtype: str | None = ENGINE_DEFAULTS["kv_cache_dtype"],
    ):
        t0 = time.perf_counter()
        backend_started = start_backend()  # the TPU runtime's start overlaps the imports below
        v = max_cpu_lora_bytes
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 0):
            raise ValueError(f"max_cpu_lora_bytes must be None or an int >= 0, got {v!r}")
        if not isinstance(adapter_cache, (bool, str, os.PathLike)):
            raise ValueError(f"adapter_cache must be a bool or a directory, got {adapter_cache!r}")
        if not isinstance(executable_cache, (bool, str, os.PathLike)) and executable_cache is not None:
            raise ValueError(f"executable_cache must be None, a bool or a directory, got {executable_cache!r}")
        caches.check_env()  # a malformed JLORA_CACHE_MAX_<NAME>_GB, named
        from jlora.models import weights_cache as wc
        from jlora.models.loading import load_model, read_model_config, resolve_model_path
        from jlora.models.quant import check_quantization

        # The engine's and the tokenizer's modules (transformers among them) are imported in a thread
        # while this one waits for the runtime and then streams the weights in: on a v5e host the
        # runtime's start holds the GIL 4-5 s of its 7-8 s, and the weights' load is mostly copies and
        # transfers, which leave it free (docs/tpu.md, "Where a warm start goes").
        engine_imports = import_in_background(_ENGINE_MODULES)
        t_imports = time.perf_counter()
        runtime_wait = backend_started()
        t_runtime = time.perf_counter()
        warmup = resolve_warmup(warmup)
        self.quantization = check_quantization(quantization)
        self.dtype = dtype
        self.config = engine_config(
            dtype=dtype, max_model_len=max_model_len, max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens, max_loras=max_loras, max_lora_rank=max_lora_rank,
            max_cpu_loras=max_cpu_loras, lora_impl=lora_impl, token_buckets=token_buckets,
            lora_slot_ranks=lora_slot_ranks, enable_embedding_lora=enable_embedding_lora, enable_dora=enable_dora,
            attn_chunk=attn_chunk, attn_impl=attn_impl, async_scheduling=async_scheduling, block_size=block_size,
            base_graphs=base_graphs, scheduling_policy=scheduling_policy,
            decode_row_buckets=None if decode_row_buckets is None else tuple(decode_row_buckets),
            max_overtakes=max_overtakes, max_n=max_n, max_waiting_seqs=max_waiting_seqs,
            num_kv_blocks=num_kv_blocks, enable_prefix_caching=enable_prefix_caching, backend=jax.default_backend(),
            tuning=TuningOptions() if tuning is None else tuning, kv_cache_memory_fraction=kv_cache_memory_fraction,
            kv_cache_dtype=kv_cache_dtype)
        if kv_cache_memory_fraction is not None and num_kv_blocks is not None:
            raise ValueError("give num_kv_blocks or kv_cache_memory_fraction, not both")
        path = resolve_model_path(model)  # a missing model path fails here, before anything is read
        if self.config.enable_embedding_lora and tensor_parallel_size != 1:
            raise ValueError(f"enable_embedding_lora=True is not supported with tensor parallelism "
                             f"(tensor_parallel_size={tensor_parallel_size}): the embedding / head LoRA slots are "
                             f"not sharded")
        self.tensor_parallel_size, self.data_parallel_size = tensor_parallel_size, data_parallel_size
        device_groups = parallel_devices(path, tensor_parallel_size, data_parallel_size)
        t_checked = time.perf_counter()
        self.progress = progress
        if use_compilation_cache:
            enable_compilation_cache(compilation_cache_dir)
        cache = None
        if weights_cache and wc.cache_enabled():
            cache = wc.open_cache(weights_cache_dir() if weights_cache is True else weights_cache)
        # The step graphs compiled by an earlier start of this engine, read while the weights stream in.
        model_cfg = read_model_config(path)
        store = None
        if executable_cache_wanted(executable_cache, use_compilation_cache, len(device_groups),
                                   tensor_parallel_size):
            store = open_executable_store(executable_cache, device_groups[0], model_cfg, dtype, self.quantization,
                                          self.config)
        # Read beside the weights' transfer, on every backend (XLA:CPU: a warm LLM() 4-5 s sooner on
        # a busy 2-core machine, docs/benchmarks.md, "Warm-up on XLA:CPU").
        if store is not None and warmup != "lazy":
            store.prefetch(executables.graph_name(g) for g in
                           (self.config.first_graphs() if warmup == "background" else self.config.step_graphs()))
        if progress:
            self._say(f"loading weights from {path}: {_weights_source(path, cache, _DTYPES[dtype], self.quantization)}")
        t1 = time.perf_counter()
        # One engine: stream the weights straight onto its devices, sharded (jlora.models.streaming).
        self.model, self.model_path, fields = load_model(path, _DTYPES[dtype], weights_cache=cache or False,
                                                           quantization=self.quantization,
                                                           devices=device_groups[0] if len(device_groups) == 1 else None)
        # True: read from the weights cache; False: converted (and cached); None: cache off or not needed.
        self.weights_cache_hit: bool | None = (
            None if cache is None else True if cache.stats["hits"] else False if cache.stats["misses"] else None)
        cfg = self.model.cfg
        if max_model_len > cfg.max_position_embeddings:
            raise ValueError(f"max_model_len={max_model_len} exceeds the model's "
                             f"max_position_embeddings={cfg.max_position_embeddings}")
        # The KV cache sized to the device's memory left after the weights (kv_cache_memory_fraction).
        self.kv_cache_plan: dict[str, Any] | None = None
        if self.config.kv_cache_memory_fraction is not None:
            from jlora.engine.kv_plan import size_kv_cache

            self.config, self.kv_cache_plan = size_kv_cache(self.config, cfg, [d for g in device_groups for d in g],
                                                            self.model.dtype)
            p = self.kv_cache_plan
            if progress:
                self._say(f"KV cache: {p['num_kv_blocks']} blocks of {self.config.block_size} positions"
                          + (f" ({p['kv_bytes'] / 1e9:.2f} GB, {p['full_length_sequences']} sequences of "
                             f"{max_model_len}: {p['fraction']} of {p['bytes_limit'] / 1e9:.2f} GB less "
                             f"{p['in_use'] / 1e9:.2f} GB in use and {p['lora_slots'] / 1e9:.2f} GB of LoRA slots)"
                             if p["sized"] else f" ({p['reason']})"))
        t2 = time.perf_counter()
        imports_waited = engine_imports()
        from jlora.engine.data_parallel import DataParallelEngine
        from jlora.engine.llm_engine import LLMEngine
        from jlora.tokenizer import load_gguf_tokenizer, load_hf_tokenizer

        t_engine_imports = time.perf_counter()
        if self.model_path.is_file():
            self.tokenizer = load_gguf_tokenizer(self.model_path, fields)
        else:
            self.tokenizer = load_hf_tokenizer(self.model_path)
        eos = self.tokenizer.eos_token_id if self.tokenizer.eos_token_id is not None else cfg.eos_token_id
        t3 = time.perf_counter()
        with compile_stats.stage("init"):  # the zero-filled KV cache and adapter slots
            engines = [LLMEngine(self.model, self.tokenizer, self.config, eos, devices) for devices in device_groups]
            self.engine = engines[0] if len(engines) == 1 else DataParallelEngine(engines)
        self.engine.adapters.set_disk_cache(adapter_cache)
        self.engine.adapters.set_max_cpu_lora_bytes(max_cpu_lora_bytes)
        if store is not None and cfg != model_cfg:  # the loaded config is not the one the key was made of
            store = open_executable_store(executable_cache, device_groups[0], cfg, dtype, self.quantization,
                                          self.config)
        self.executable_store = store
        for runner in self.runners:
            runner.executable_store = store
        t4 = time.perf_counter()
        # Where the start-up went, in seconds (`jlora bench start` reports these). "imports" are the
        # loader's modules, imported while the backend started; "runtime" is what was left of the
        # backend's start after them (its whole start: `runtime_start`); "engine_imports" what was left
        # of the engine's and tokenizer's imports after the weights (`engine_imports_waited` of it
        # waiting for the import thread).
        self.startup_seconds: dict[str, float] = {
            "imports": t_imports - t0, "runtime": t_runtime - t_imports, "runtime_start": runtime_wait,
            "validate": t_checked - t_runtime, "open_caches": t1 - t_checked, "load_weights": t2 - t1,
            "engine_imports": t_engine_imports - t2, "engine_imports_waited": imports_waited,
            "tokenizer": t3 - t_engine_imports, "engine_init": t4 - t3}
        self.warmup_mode = warmup
        if warmup != "lazy":
            self.warmup(background=warmup == "background")
        elif progress:
            self._say("lazy start (warmup=False): each graph compiles the first time a batch needs it")
        self.startup_seconds["warmup"] = time.perf_counter() - t4
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
                      + f"); {_compile_cache_holds()}")
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
        "dtype", "tokens"}, "lora_slots": {"bytes", "dtype", "slots", "max_rank"}, "total": {"bytes"},
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
                           "slot_ranks": list(self.config.slot_ranks)},
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


def _weights_source(path: Path, cache: Any, dtype: Any, quantization: str | None) -> str:
    """Where `load_model` is about to take the weights from, in words (the weights cache's hit or miss
    is looked up by the same key `cached_read` uses)."""
    if path.is_dir() and (path / "jlora_model.json").is_file():
        return "a jlora checkpoint, read as saved"
    convert = "dequantizing the GGUF" if path.is_file() else "converting the checkpoint"
    if cache is None:
        return f"weights cache off, {convert}"
    from jlora.content_cache import META_FILE
    from jlora.models import weights_cache as wc

    entry = cache.entry(wc.model_key(path, dtype, cache, quantization))
    if (entry / META_FILE).is_file():
        return f"weights cache hit ({entry})"
    return f"weights cache miss, {convert} and caching it in {cache.root}"


def start_backend() -> Callable[[], float]:
    """Start JAX's backends (on a v5e host the TPU runtime takes 5-8 s) in a thread, so what needs no
    device (imports, config files) is done meanwhile. Returns a function that waits for the start
    and gives its seconds (0 when the backends were already up). A failed start is raised by the
    next JAX call that needs a backend, as without the thread.

    (A smaller TPU_PREMAPPED_BUFFER_SIZE, the host buffer libtpu pins at its start, starts the
    runtime in 2.3-3.7 s instead of 5.4-8 s on a v5e host, but it is not set here: with 1-2 GiB the
    background warm-up's executable loads then took 34-37 s instead of 13-14 s and held a first
    request 17-21 s; docs/tpu.md, "Caches".)"""
    from jax._src import xla_bridge

    if xla_bridge.backends_are_initialized():
        return lambda: 0.0
    took: list[float] = []

    def start() -> None:
        t = time.perf_counter()
        try:
            jax.devices()
        except Exception:  # noqa: BLE001 (the caller's next JAX call raises it with its own context)
            pass
        took.append(time.perf_counter() - t)

    thread = threading.Thread(target=start, name="jlora-backend-start", daemon=True)
    thread.start()

    def wait() -> float:
        thread.join()
        return took[0] if took else 0.0
    return wait


_ENGINE_MODULES = ("jlora.engine.llm_engine", "jlora.engine.data_parallel", "jlora.tokenizer")


def import_in_background(modules: Seq[str]) -> Callable[[], float]:
    """Import `modules` in a thread; returns a function that waits for it and gives the seconds
    waited. A failed import is left to the caller's own import, which raises it in context (a module
    that failed is not left half-imported in `sys.modules`)."""
    import importlib

    def run() -> None:
        for name in modules:
            try:
                importlib.import_module(name)
            except BaseException:  # noqa: BLE001 (the caller's import raises it)
                return

    thread = threading.Thread(target=run, name="jlora-imports", daemon=True)
    thread.start()

    def wait() -> float:
        t = time.perf_counter()
        thread.join()
        return time.perf_counter() - t
    return wait


def executable_cache_wanted(executable_cache: bool | str | os.PathLike | None, use_compilation_cache: bool,
                            engines: int, tensor_parallel_size: int) -> bool:
    """Whether LLM() keeps its step graphs as serialized executables (`jlora.engine.executables`):
    None (the default) on one TPU host with the compile cache on, where tracing is seconds of a warm
    start; True anywhere a single engine runs on one device; False never."""
    if executable_cache is False or engines != 1 or tensor_parallel_size != 1 or jax.process_count() != 1:
        return False
    if executable_cache is None:
        return use_compilation_cache and jax.default_backend() == "tpu"
    return True


def open_executable_store(executable_cache: bool | str | os.PathLike | None, devices: Seq[Any], model_cfg: Any,
                          dtype: str, quantization: str, config: Any) -> executables.ExecutableStore | None:
    """The executable store of this engine (True/None: `$JLORA_CACHE_DIR/executables`; a path: there):
    keyed by the code, the platform and devices, the model's config, dtype and quantization and the
    engine's config (`executables.fingerprint`)."""
    key = executables.fingerprint(devices, f"model={model_cfg!r}", f"dtype={dtype}", f"quantization={quantization}",
                                  f"engine={config!r}")
    return executables.open_store(True if executable_cache is None else executable_cache, key)


WARMUP_MODES = {True: "eager", False: "lazy", "eager": "eager", "lazy": "lazy", "background": "background"}


def resolve_warmup(warmup: bool | str | None) -> str:
    """LLM(warmup=...) as "eager", "background" or "lazy" (None: background on one TPU host)."""
    if warmup is None:
        return "background" if jax.default_backend() == "tpu" and jax.process_count() == 1 else "eager"
    if isinstance(warmup, bool) or (isinstance(warmup, str) and warmup in WARMUP_MODES):
        if warmup == "background" and jax.process_count() > 1:  # processes must step the same graphs
            raise ValueError("warmup='background' needs one process (jax.distributed runs every graph in step)")
        return WARMUP_MODES[warmup]
    raise ValueError(f"warmup must be True, False, None or one of 'eager', 'background', 'lazy', got {warmup!r}")


def _compile_cache_holds() -> str:
    """How many compiled graphs the persistent compile cache holds (of every engine configuration)."""
    where = jax.config.jax_compilation_cache_dir
    if not where or not jax.config.jax_enable_compilation_cache:
        return "the compile cache is off"
    try:
        held = sum(1 for f in os.scandir(where) if f.name.endswith("-cache"))
    except OSError:
        held = 0
    return f"the compile cache ({where}) holds {held} graphs of any configuration"


def parallel_devices(model: str | os.PathLike | Path, tensor_parallel_size: int,
                     data_parallel_size: int) -> list[list[Any]]:
    """The device group of each data-parallel replica, tensor_parallel_size devices each, in
    `jax.devices()` order (under jax.distributed: every process's devices). Checked against the
    model's heads (`check_tensor_parallel`) and the devices there are, before any weight is read."""
    from jlora.models.loading import read_model_config
    from jlora.models.tensor_parallel import check_tensor_parallel

    d = data_parallel_size
    if not isinstance(d, int) or isinstance(d, bool) or d < 1:
        raise ValueError(f"data_parallel_size must be a positive int, got {d!r}")
    check_tensor_parallel(read_model_config(model), tensor_parallel_size)
    devices = jax.devices()
    need = tensor_parallel_size * d
    if need > len(devices):
        raise ValueError(f"tensor_parallel_size={tensor_parallel_size} x data_parallel_size={d} needs {need} "
                         f"devices; JAX sees {len(devices)} ({devices[0].platform}). On a CPU, "
                         f"XLA_FLAGS=--xla_force_host_platform_device_count={need} makes that many.")
    return [devices[i * tensor_parallel_size:(i + 1) * tensor_parallel_size] for i in range(d)]


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
