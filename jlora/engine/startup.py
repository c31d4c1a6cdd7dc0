"""LLM()'s start-up as named steps: arguments checked, backends and imports started, the model
resolved to a path and devices, the caches opened, the weights loaded, the KV cache sized, the
tokenizer read, the engine built. `LLM.__init__` calls them in that order, timing each with
`Phases` (`LLM.startup_seconds`, which `jlora bench start` reports); the warm-up is `LLM.warmup`.

Each step takes what it reads and returns what it makes; none keeps state. The engine's and the
tokenizer's modules (Flax, transformers: 2-5 s on a TPU host) are imported in a thread while the
TPU runtime starts in another (`start_backend`) and the weights stream in.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Sequence as Seq

import jax
import jax.numpy as jnp

from jlora import caches, compile_stats
from jlora.engine import executables

if TYPE_CHECKING:
    from jlora.engine.config import EngineConfig
    from jlora.models.llama import Llama

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


class Phases:
    """Seconds of each start-up phase, each from the end of the one before (`LLM.startup_seconds`)."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self._t = time.perf_counter()

    def done(self, name: str) -> None:
        """End phase `name` now; the next one starts here."""
        now = time.perf_counter()
        self.seconds[name] = now - self._t
        self._t = now


# ---- the steps, in LLM()'s order --------------------------------------------------------------------------


def check_cache_args(max_cpu_lora_bytes: int | None, adapter_cache: bool | str | os.PathLike,
                     executable_cache: bool | str | os.PathLike | None) -> None:
    """The cache arguments and the JLORA_CACHE_MAX_<NAME>_GB variables, checked before anything starts."""
    v = max_cpu_lora_bytes
    if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 0):
        raise ValueError(f"max_cpu_lora_bytes must be None or an int >= 0, got {v!r}")
    if not isinstance(adapter_cache, (bool, str, os.PathLike)):
        raise ValueError(f"adapter_cache must be a bool or a directory, got {adapter_cache!r}")
    if not isinstance(executable_cache, (bool, str, os.PathLike)) and executable_cache is not None:
        raise ValueError(f"executable_cache must be None, a bool or a directory, got {executable_cache!r}")
    caches.check_env()  # a malformed JLORA_CACHE_MAX_<NAME>_GB, named


def start_imports() -> Callable[[], float]:
    """Import the loader's modules here and start the engine's and the tokenizer's in a thread;
    returns `finish_imports`' argument. On a v5e host the runtime's start holds the GIL 4-5 s of its
    7-8 s, and the weights' load is mostly copies and transfers, which leave it free (docs/tpu.md,
    "Where a warm start goes")."""
    from jlora.models import loading, quant, weights_cache  # noqa: F401 (the loader's, needed first)

    return import_in_background(_ENGINE_MODULES)


def resolve_model(model: str | os.PathLike | None, config: EngineConfig, num_kv_blocks: int | None,
                  tensor_parallel_size: int, data_parallel_size: int) -> tuple[Path, list[list[Any]]]:
    """The model's path (a missing one fails here, before anything is read) and each data-parallel
    replica's devices, checked against the engine config."""
    from jlora.models.loading import resolve_model_path

    if config.kv_cache_memory_fraction is not None and num_kv_blocks is not None:
        raise ValueError("give num_kv_blocks or kv_cache_memory_fraction, not both")
    path = resolve_model_path(model)  # a missing model path fails here, before anything is read
    if config.enable_embedding_lora and tensor_parallel_size != 1:
        raise ValueError(f"enable_embedding_lora=True is not supported with tensor parallelism "
                         f"(tensor_parallel_size={tensor_parallel_size}): the embedding / head LoRA slots are "
                         f"not sharded")
    return path, parallel_devices(path, tensor_parallel_size, data_parallel_size)


def open_caches(path: Path, dtype: str, quantization: str | None, config: EngineConfig,
                device_groups: list[list[Any]], warmup: str, use_compilation_cache: bool,
                compilation_cache_dir: str | os.PathLike | None, weights_cache: bool | str | os.PathLike,
                executable_cache: bool | str | os.PathLike | None, tensor_parallel_size: int,
                say: Callable[[str], None] | None) -> tuple[Any, Any, Any]:
    """Turn the XLA compile cache on and open the weights cache and the executable store (its step
    graphs prefetched); `say` (None: quiet) hears where the weights will come from. Returns (the
    weights cache or None, the model's config as read from `path`, the executable store or None)."""
    from jlora.models import weights_cache as wc
    from jlora.models.loading import read_model_config

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
        store = open_executable_store(executable_cache, device_groups[0], model_cfg, dtype, quantization, config)
    # Read beside the weights' transfer, on every backend (XLA:CPU: a warm LLM() 4-5 s sooner on
    # a busy 2-core machine, docs/benchmarks.md, "Warm-up on XLA:CPU").
    if store is not None and warmup != "lazy":
        store.prefetch(executables.graph_name(g) for g in
                       (config.first_graphs() if warmup == "background" else config.step_graphs()))
    if say is not None:
        say(f"loading weights from {path}: {_weights_source(path, cache, DTYPES[dtype], quantization)}")
    return cache, model_cfg, store


def load_weights(path: Path, dtype: str, cache: Any, quantization: str | None, device_groups: list[list[Any]],
                 max_model_len: int) -> tuple[Llama, Path, Any, bool | None]:
    """(the Llama, the model file or folder, the GGUF fields or None, weights-cache hit): True when
    read from the weights cache, False when converted (and cached), None when the cache is off or
    not needed. One engine: the weights stream straight onto its devices, sharded
    (jlora.models.streaming)."""
    from jlora.models.loading import load_model

    model, model_path, fields = load_model(path, DTYPES[dtype], weights_cache=cache or False,
                                           quantization=quantization,
                                           devices=device_groups[0] if len(device_groups) == 1 else None)
    hit = None if cache is None else True if cache.stats["hits"] else False if cache.stats["misses"] else None
    cfg = model.cfg
    if max_model_len > cfg.max_position_embeddings:
        raise ValueError(f"max_model_len={max_model_len} exceeds the model's "
                         f"max_position_embeddings={cfg.max_position_embeddings}")
    return model, model_path, fields, hit


def size_kv_cache(config: EngineConfig, model: Llama, device_groups: list[list[Any]], max_model_len: int,
                  say: Callable[[str], None] | None) -> tuple[EngineConfig, dict[str, Any] | None]:
    """The engine config with the KV cache sized to the device's memory left after the weights
    (kv_cache_memory_fraction), and the plan (`LLM.kv_cache_plan`); unchanged and None without it."""
    if config.kv_cache_memory_fraction is None:
        return config, None
    from jlora.engine.kv_plan import size_kv_cache as plan_kv_cache

    config, p = plan_kv_cache(config, model.cfg, [d for g in device_groups for d in g], model.dtype)
    if say is not None:
        say(f"KV cache: {p['num_kv_blocks']} blocks of {config.block_size} positions"
            + (f" ({p['kv_bytes'] / 1e9:.2f} GB, {p['full_length_sequences']} sequences of "
               f"{max_model_len}: {p['fraction']} of {p['bytes_limit'] / 1e9:.2f} GB less "
               f"{p['in_use'] / 1e9:.2f} GB in use and {p['lora_slots'] / 1e9:.2f} GB of LoRA slots)"
               if p["sized"] else f" ({p['reason']})"))
    return config, p


def finish_imports(engine_imports: Callable[[], float]) -> float:
    """Wait for `start_imports`' thread; the seconds waited. A module that failed there raises here."""
    waited = engine_imports()
    from jlora import tokenizer  # noqa: F401
    from jlora.engine import data_parallel, llm_engine  # noqa: F401

    return waited


def load_tokenizer(model_path: Path, fields: Any) -> Any:
    """The tokenizer: from the GGUF's metadata (`fields`) for a GGUF file, else the checkpoint's."""
    from jlora.tokenizer import load_gguf_tokenizer, load_hf_tokenizer

    if model_path.is_file():
        return load_gguf_tokenizer(model_path, fields)
    return load_hf_tokenizer(model_path)


def build_engine(model: Llama, tokenizer: Any, config: EngineConfig, device_groups: list[list[Any]],
                 adapter_cache: bool | str | os.PathLike, max_cpu_lora_bytes: int | None) -> Any:
    """One LLMEngine per device group (a DataParallelEngine over them for more than one), with its
    zero-filled KV cache and adapter slots, and the host adapter cache's settings."""
    from jlora.engine.data_parallel import DataParallelEngine
    from jlora.engine.llm_engine import LLMEngine

    eos = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else model.cfg.eos_token_id
    with compile_stats.stage("init"):  # the zero-filled KV cache and adapter slots
        engines = [LLMEngine(model, tokenizer, config, eos, devices) for devices in device_groups]
        engine = engines[0] if len(engines) == 1 else DataParallelEngine(engines)
    engine.adapters.set_disk_cache(adapter_cache)
    engine.adapters.set_max_cpu_lora_bytes(max_cpu_lora_bytes)
    return engine


def attach_executable_store(store: Any, runners: Seq[Any], read_cfg: Any, model: Llama,
                            executable_cache: bool | str | os.PathLike | None, device_groups: list[list[Any]],
                            dtype: str, quantization: str | None, config: EngineConfig) -> Any:
    """Give the runners the executable store, reopened under the loaded model's config when that is
    not the one read before the load (`read_cfg`, which the store's key was made of)."""
    if store is not None and model.cfg != read_cfg:
        store = open_executable_store(executable_cache, device_groups[0], model.cfg, dtype, quantization, config)
    for runner in runners:
        runner.executable_store = store
    return store


# ---- what the steps use ---------------------------------------------------------------------------------


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


def compile_cache_holds() -> str:
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
