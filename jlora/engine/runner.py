"""ModelRunner: owns the device state (weights, paged KV cache) and the one jitted step.

A step is one device call: the running sequences' decode tokens (always `max_num_seqs` rows,
padding where a row is free) and at most one prefill chunk, packed into one token axis, go through
the model together (every weight read once), and the sampler runs in the same graph. Host and
device meet once each way: the scheduler's NumPy arrays go over in one transfer, and only the
sampled tokens (and logprobs) come back.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
from flax import nnx
from tqdm.auto import tqdm

from jlora import compile_stats
from jlora.engine.config import EngineConfig
from jlora.models.llama import AttnGroup, Llama, LoRAState, init_cache
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
        self._step = jax.jit(self._step_impl, static_argnames=("lora_impl", "attn_chunk"), donate_argnames=("cache",))

    def _step_impl(self, weights, lora_state, cache, batch, *, lora_impl, attn_chunk):
        model = nnx.merge(self.graphdef, jax.tree.unflatten(self._weights_def, weights))
        groups = [AttnGroup(batch["dec_positions"][:, None], batch["dec_tables"])]
        if batch["pre_positions"].shape[0]:
            groups.append(AttnGroup(batch["pre_positions"][None], batch["pre_table"][None]))
        hidden, cache = model.forward(batch["tokens"], batch["slot_ids"], tuple(groups), cache, lora_state,
                                      lora_impl=lora_impl, attn_chunk=attn_chunk)
        logits = model.logits(hidden[batch["sample_index"]])
        return sample(logits, batch["sampling"]), cache

    @property
    def kv_cache_bytes(self) -> int:
        return sum(x.nbytes for x in self.cache.values())

    @property
    def num_rows(self) -> int:
        return self.config.max_num_seqs

    def empty_batch(self, prefill_tokens: int) -> dict[str, Any]:
        """Host arrays for one step with every row and token padding; the scheduler fills them in.

        tokens / slot_ids [R + P]: the R decode rows first, then the P prefill tokens;
        dec_positions [R], dec_tables [R, MB]; pre_positions [P], pre_table [MB];
        sample_index [R + 1]: the token each sampled row reads (row R: the prefill's last token).
        """
        c, r, p = self.config, self.num_rows, prefill_tokens
        return dict(
            tokens=np.zeros((r + p,), np.int32), slot_ids=np.full((r + p,), -1, np.int32),
            dec_positions=np.full((r,), -1, np.int32), dec_tables=np.zeros((r, c.blocks_per_seq), np.int32),
            pre_positions=np.full((p,), -1, np.int32), pre_table=np.zeros((c.blocks_per_seq,), np.int32),
            sample_index=np.concatenate([np.arange(r), [r if p else 0]]).astype(np.int32),
            sampling=build_sampling_batch({}, r + 1, c.max_model_len))

    def step(self, lora_state: LoRAState | None, batch: dict[str, Any]) -> dict[str, np.ndarray]:
        """Runs one step; returns the sampled tokens i32[R + 1] (and logprob arrays) on the host."""
        dev = jax.device_put(batch)  # one transfer
        with compile_stats.stage("step"):
            out, self.cache = self._step(self._weights, lora_state, self.cache, dev,
                                         lora_impl=self.config.lora_impl, attn_chunk=self.config.attn_chunk)
        return jax.device_get(out)

    def warmup(self, lora_state: LoRAState | None, progress: bool = True) -> None:
        """Compile every step graph once (all padding: nothing is written), before the first request."""
        shapes = self.config.step_shapes()
        for p in tqdm(shapes, desc="jlora warm-up (compiling step graphs)", disable=not progress):
            self.step(lora_state, self.empty_batch(p))
        jax.block_until_ready(self.cache)
