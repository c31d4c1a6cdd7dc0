"""ModelRunner: owns the device state (weights, paged KV cache) and the one jitted step.

A step is one device call: the running sequences' decode tokens (R rows, padding where a row is
free) and a prefill part (P sequences x Q chunk tokens, one of `EngineConfig.prefill_shapes()`),
packed into one token axis, go through the model together (every weight read once), and the
sampler runs in the same graph. Graphs are keyed by (R, P, Q): `EngineConfig.step_shapes()`. Host and
device meet once each way: the scheduler's NumPy arrays go over in one transfer, and only the
sampled tokens (and logprobs) come back.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import jax
import numpy as np
from flax import nnx
from tqdm.auto import tqdm

from jlora import compile_stats
from jlora.engine.config import EngineConfig
from jlora.models import quant
from jlora.models.llama import AttnGroup, Llama, LoRAState, host_zeros, init_cache
from jlora.sampling import build_sampling_batch, sample


class ModelRunner:
    def __init__(self, model: Llama, config: EngineConfig, kv_dtype: Any = None):
        self.cfg = model.cfg
        self.config = config
        self.graphdef, self.state = nnx.split(model)
        # A flat list of arrays crosses the jit boundary fastest (NNX state flattens in Python).
        self._weights, self._weights_def = jax.tree.flatten(self.state)
        # bf16 is kept as its bits on XLA:CPU (jlora.models.quant): a no-op for weights loaded that way.
        self._weights = [quant.to_storage(w) for w in self._weights]
        self.state = jax.tree.unflatten(self._weights_def, self._weights)
        self.kv_dtype = kv_dtype or model.dtype
        self.cache = init_cache(self.cfg, config.num_kv_blocks, config.block_size, quant.storage_dtype(self.kv_dtype),
                                zeros=host_zeros)
        self._step = jax.jit(self._step_impl, static_argnames=("lora_impl", "attn_chunk"), donate_argnames=("cache",))
        self._executables: dict[tuple[int, int, int], Any] = {}  # (R, P, Q) -> compiled step

    def _step_impl(self, weights, lora_state, cache, batch, *, lora_impl, attn_chunk):
        model = nnx.merge(self.graphdef, jax.tree.unflatten(self._weights_def, weights))
        groups = [AttnGroup(batch["dec_positions"][:, None], batch["dec_tables"])]
        if batch["pre_positions"].shape[0]:
            groups.append(AttnGroup(batch["pre_positions"], batch["pre_tables"]))
        hidden, cache = model.forward(batch["tokens"], batch["slot_ids"], tuple(groups), cache, lora_state,
                                      lora_impl=lora_impl, attn_chunk=attn_chunk)
        logits = model.logits(hidden[batch["sample_index"]])
        return sample(logits, batch["sampling"]), cache

    @property
    def kv_cache_bytes(self) -> int:
        return sum(x.nbytes for x in self.cache.values())

    def empty_batch(self, shape: tuple[int, int, int]) -> dict[str, Any]:
        """Host arrays for one step with every row and token padding; the scheduler fills them in.

        shape (R, P, Q): R decode rows; the prefill part, P sequences of Q chunk tokens (0, 0: none).
        tokens / slot_ids [R + P*Q]: the R decode rows first, then the prefill rows;
        dec_positions [R], dec_tables [R, MB]; pre_positions [P, Q], pre_tables [P, MB];
        sample_index [R]: the token each row samples from (its decode token, or the last prompt
        token of a prefill that completes in this step).
        """
        c, (r, p, q) = self.config, shape
        return dict(
            tokens=np.zeros((r + p * q,), np.int32), slot_ids=np.full((r + p * q,), -1, np.int32),
            dec_positions=np.full((r,), -1, np.int32), dec_tables=np.zeros((r, c.blocks_per_seq), np.int32),
            pre_positions=np.full((p, q), -1, np.int32), pre_tables=np.zeros((p, c.blocks_per_seq), np.int32),
            sample_index=np.arange(r, dtype=np.int32),
            sampling=build_sampling_batch({}, r, c.max_model_len))

    def step(self, lora_state: LoRAState | None, batch: dict[str, Any]) -> dict[str, np.ndarray]:
        """Runs one step; returns the sampled tokens i32[R] (and logprob arrays) on the host."""
        shape = batch["dec_positions"].shape + batch["pre_positions"].shape
        dev = jax.device_put(batch)  # one transfer
        if shape not in self._executables:  # lazy mode, or a shape warm-up did not cover
            self._compile([shape], lora_state)
        out, self.cache = self._executables[shape](self._weights, lora_state, self.cache, dev)
        return jax.device_get(out)

    def _compile(self, shapes: list[tuple[int, int, int]], lora_state: LoRAState | None, progress: bool = False) -> None:
        """Trace and lower each shape (Python, one at a time), then compile them on all cores at once:
        XLA compiles outside the GIL, and the step graphs do not depend on each other."""
        if not shapes:
            return
        lowered = {shape: self._step.lower(self._weights, lora_state, self.cache, jax.device_put(self.empty_batch(shape)),
                                           lora_impl=self.config.lora_impl, attn_chunk=self.config.attn_chunk)
                   for shape in shapes}

        def build(shape: tuple[int, int, int]) -> None:
            with compile_stats.stage("step"):
                self._executables[shape] = lowered[shape].compile()

        bar = tqdm(total=len(shapes), desc="jlora warm-up (compiling step graphs)", disable=not progress)
        with ThreadPoolExecutor(max_workers=min(len(shapes), os.cpu_count() or 1)) as pool:
            for _ in pool.map(build, shapes):
                bar.update(1)
        bar.close()

    def warmup(self, lora_state: LoRAState | None, progress: bool = True) -> None:
        """Compile every step graph once, before the first request."""
        self._compile([s for s in self.config.step_shapes() if s not in self._executables], lora_state, progress)
