"""ModelRunner: owns the device state (weights, paged KV cache) and the jitted step and sampler.

Host and device meet once per call: the scheduler hands over NumPy index arrays padded to a
bucket, they go over in one transfer, and only the sampled token ids come back.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from tqdm.auto import tqdm

from jlora import compile_stats
from jlora.engine.config import EngineConfig
from jlora.models.llama import Llama, LoRAState, init_cache
from jlora.sampling import build_sampling_batch, sample


class ModelRunner:
    def __init__(self, model: Llama, config: EngineConfig, kv_dtype: Any = None):
        self.cfg = model.cfg
        self.config = config
        self.graphdef, self.state = nnx.split(model)
        # A flat list of arrays crosses the jit boundary fastest (NNX state flattens in Python).
        self._weights, self._weights_def = jax.tree.flatten(self.state)
        self.kv_dtype = kv_dtype or model.dtype
        self.cache = init_cache(self.cfg, config.num_kv_blocks, config.block_size, self.kv_dtype)
        self._step = jax.jit(self._step_impl, static_argnames=("lora_impl",), donate_argnames=("cache",))

    def _step_impl(self, weights, lora_state, cache, tokens, positions, slot_ids, logits_index, block_tables,
                   *, lora_impl):
        model = nnx.merge(self.graphdef, jax.tree.unflatten(self._weights_def, weights))
        return model(tokens, positions, cache, lora_state, slot_ids, logits_index, block_tables, lora_impl=lora_impl)

    @property
    def kv_cache_bytes(self) -> int:
        return sum(x.nbytes for layer in self.cache for x in layer.values())

    def forward(
        self,
        lora_state: LoRAState | None,
        tokens: np.ndarray,  # i32[B, T]
        positions: np.ndarray,  # i32[B, T], -1 = padding
        slot_ids: np.ndarray,  # i32[B], -1 = base model
        logits_index: np.ndarray,  # i32[B]
        block_tables: np.ndarray,  # i32[B, span // block_size]: the span bucket is its width
        stage: str,
    ) -> jax.Array:  # f32[B, V], stays on device
        dev = jax.device_put((tokens, positions, slot_ids, logits_index, block_tables))  # one transfer
        with compile_stats.stage(stage):
            logits, self.cache = self._step(
                self._weights, lora_state, self.cache, *dev, lora_impl=self.config.lora_impl)
        return logits

    def sample(self, logits: jax.Array, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Sampled tokens (and logprobs) for each row; one device->host transfer."""
        with compile_stats.stage("sample"):
            out = sample(logits, jax.device_put(batch))
        return jax.device_get(out)

    def warmup(self, lora_state: LoRAState | None, progress: bool = True) -> None:
        """Compile every prefill, decode and sampler graph once, before the first request."""
        c = self.config
        jobs: list[tuple[str, tuple[int, ...]]] = [("prefill", s) for s in c.prefill_shapes()]
        jobs += [("decode", s) for s in c.decode_shapes()]
        for (name, shape) in tqdm(jobs, desc="jlora warm-up (compiling graphs)", disable=not progress):
            b, t, span = shape if name == "prefill" else (shape[0], 1, shape[1])
            tokens = np.zeros((b, t), np.int32)
            positions = np.full((b, t), -1, np.int32)  # all padding: writes are dropped
            tables = np.zeros((b, c.blocks_for(span)), np.int32)
            logits = self.forward(lora_state, tokens, positions, np.full((b,), -1, np.int32),
                                  np.zeros((b,), np.int32), tables, name)
        for b in c.batch_buckets:
            logits = jnp.zeros((b, self.cfg.vocab_size), jnp.float32)
            self.sample(logits, build_sampling_batch({}, b, c.max_model_len))
        jax.block_until_ready(self.cache)
