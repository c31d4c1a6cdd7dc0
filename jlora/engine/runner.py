"""ModelRunner: owns the device state (weights, paged KV cache, LoRA slots) and the one jitted step.

A step is one device call: the running sequences' decode tokens (R rows, padding where a row is
free) and a prefill part (P sequences x Q chunk tokens, one of `EngineConfig.prefill_shapes()`),
packed into one token axis, go through the model together (every weight read once), and the
sampler runs in the same graph. Graphs are keyed by (R, P, Q): `EngineConfig.step_shapes()`. Host and
device meet once each way: the scheduler's NumPy arrays go over in one transfer, and only the
sampled tokens (and logprobs) come back.

The LoRA slot arrays are the runner's too (`self.lora`, a `LoRASlots`): the adapter manager only
decides which adapter goes in which slot and queues the writes, already padded on the host; the
step plan carries them and `write_slots` applies them right before the step that reads them.
"""

from __future__ import annotations

import contextlib
import os
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from tqdm.auto import tqdm

from jlora import compile_stats
from jlora.adapters.manager import LoRASlots, SlotWrite
from jlora.engine.config import EngineConfig
from jlora.engine.structured import fill_mask
from jlora.models import quant
from jlora.models.llama import AttnGroup, Llama, init_cache
from jlora.models.tensor_parallel import CACHE_SPEC, TensorParallel, fetch, layout_model, weight_spec
from jlora.sampling import MAX_LOGPROBS, SamplingRow, empty_sampling_batch, fill_sampling_row, sample

if TYPE_CHECKING:
    from jlora.engine.scheduler import StepPlan
    from jlora.engine.sequence import Sequence


class RowFailed(Exception):
    """Writing `seq`'s row of a step raised: that sequence's request fails, the others do not."""

    def __init__(self, seq: Sequence, error: BaseException):
        super().__init__(f"{type(error).__name__}: {error}")
        self.seq = seq


@contextlib.contextmanager
def _blame(seq: Sequence) -> Iterator[None]:
    try:
        yield
    except Exception as e:
        raise RowFailed(seq, e) from e


def _prompt_logprobs(model: Llama, hidden: jax.Array, targets: jax.Array) -> dict[str, jax.Array]:
    """Log-probabilities of the next prompt token at each prefill position (targets i32[P*Q], -1 =
    none) and the top MAX_LOGPROBS there; the head over every prefill token runs only in steps
    where some row asked for prompt logprobs (a cond, so no extra graph)."""
    k = min(MAX_LOGPROBS, model.cfg.vocab_size)

    def compute():
        lp = jax.nn.log_softmax(model.logits(hidden), axis=-1)  # f32[P*Q, V]: the model's raw distribution
        top_lp, top_ids = jax.lax.top_k(lp, k)
        return jnp.take_along_axis(lp, jnp.maximum(targets, 0)[:, None], axis=-1)[:, 0], top_ids.astype(jnp.int32), top_lp

    def skip():
        t = targets.shape[0]
        return jnp.zeros((t,), jnp.float32), jnp.zeros((t, k), jnp.int32), jnp.zeros((t, k), jnp.float32)

    tok, ids, top = jax.lax.cond(jnp.any(targets >= 0), compute, skip)
    return {"prompt_token_logprob": tok, "prompt_top_ids": ids, "prompt_top_logprobs": top}


class ModelRunner:
    """`devices`: the engine's devices, a tensor-parallel mesh over them when there are several
    (jlora.models.tensor_parallel; default: the first device). Each device then holds its shard
    of every weight, of the KV cache and of the slots; XLA partitions the one step graph."""

    def __init__(self, model: Llama, config: EngineConfig, eos_token_id: int | None = None,
                 devices: Sequence[Any] | None = None):
        self.cfg = model.cfg  # the logical config (what adapters and requests are checked against)
        self.config = config
        self.eos_token_id = eos_token_id  # banned before a row's min_tokens
        self.tp = TensorParallel.create(model.cfg, list(devices) if devices is not None else jax.devices()[:1])
        # Streamed onto exactly these devices (jlora.models.streaming): already laid out and sharded.
        self._preplaced = getattr(model, "placed_on", None) == tuple(self.tp.mesh.devices.flat)
        model = layout_model(model, self.tp)
        self.layout_cfg = model.cfg  # KV heads repeated when tensor_parallel_size exceeds them
        self.graphdef, self.state = nnx.split(model)
        # A flat list of arrays crosses the jit boundary fastest (NNX state flattens in Python).
        leaves, self._weights_def = jax.tree_util.tree_flatten_with_path(self.state)
        self._weights = [self._place(path, w) for path, w in leaves]
        self.state = jax.tree.unflatten(self._weights_def, self._weights)
        self.kv_dtype = model.dtype
        self.cache = self._zero_cache()
        self.lora = LoRASlots(self.cfg, config.max_loras, config.max_lora_rank, model.dtype, tp=self.tp,
                              slot_ranks=config.slot_ranks)
        shardings = None
        if self.tp.size > 1 or jax.process_count() > 1:  # outputs replicated; the cache keeps its sharding
            shardings = dict(out_shardings=(self.tp.replicated, {k: x.sharding for k, x in self.cache.items()}))
        self._step = jax.jit(self._step_impl, static_argnames=("lora_impl", "attn_chunk"), donate_argnames=("cache",),
                             **(shardings or {}))
        self._executables: dict[tuple[int, int, int], Any] = {}  # (R, P, Q) -> compiled step

    def _place(self, path: tuple[Any, ...], w: Any) -> jax.Array:
        """One weight on the mesh: in the shard-major column order and sharded by its name
        (`weight_spec`); bf16 kept as its bits on XLA:CPU (jlora.models.quant)."""
        name = next(k.key for k in reversed(path) if isinstance(k, jax.tree_util.DictKey))
        if self._preplaced and isinstance(w, jax.Array):  # no second copy, no trip through the host
            target = self.tp.sharding(weight_spec(name, w.shape, w.dtype == jnp.int8, self.tp.size))
            return w if w.sharding.is_equivalent_to(target, w.ndim) else jax.device_put(w, target)
        if self.tp.size > 1:
            w = self.tp.layout_weight(name, np.asarray(w))
        w = quant.to_storage(w)
        return self.tp.put(w, weight_spec(name, w.shape, w.dtype == jnp.int8, self.tp.size))

    def _zero_cache(self) -> dict[str, jax.Array]:
        """A zeroed KV cache [L, NB, bs, KVH, Dh], sharded over its KV heads."""
        return init_cache(self.layout_cfg, self.config.num_kv_blocks, self.config.block_size,
                          quant.storage_dtype(self.kv_dtype), zeros=lambda shape, dtype: self.tp.zeros(shape, dtype, CACHE_SPEC))

    def _step_impl(self, weights, lora_state, cache, batch, *, lora_impl, attn_chunk):
        model = nnx.merge(self.graphdef, jax.tree.unflatten(self._weights_def, weights))
        groups = [AttnGroup(batch["dec_positions"][:, None], batch["dec_tables"])]
        if batch["pre_positions"].shape[0]:
            groups.append(AttnGroup(batch["pre_positions"], batch["pre_tables"]))
        hidden, cache = model.forward(batch["tokens"], batch["slot_ids"], tuple(groups), cache, lora_state,
                                      lora_impl=lora_impl, attn_chunk=attn_chunk)
        logits = model.logits(hidden[batch["sample_index"]])
        out = sample(logits, batch["sampling"])
        if batch["pre_positions"].shape[0]:
            out.update(_prompt_logprobs(model, hidden[batch["dec_positions"].shape[0]:], batch["prompt_targets"]))
        return out, cache

    @property
    def lora_state(self):  # packed module -> {"A": [L, N, in, S*R], "B": [L, N, R, out]}; a tuple of them per pool
        return self.lora.state

    def write_slots(self, writes: tuple[SlotWrite, ...]) -> None:
        """Apply a plan's queued slot writes (already padded on the host) before its step."""
        self.lora.write(writes)

    @property
    def kv_cache_bytes(self) -> int:
        return sum(x.nbytes for x in self.cache.values())

    def empty_batch(self, shape: tuple[int, int, int]) -> dict[str, Any]:
        """Host arrays for one step with every row and token padding; the scheduler fills them in.

        shape (R, P, Q): R decode rows; the prefill part, P sequences of Q chunk tokens (0, 0: none).
        tokens / slot_ids [R + P*Q]: the R decode rows first, then the prefill rows;
        dec_positions [R], dec_tables [R, MB]; pre_positions [P, Q], pre_tables [P, MB];
        sample_index [R]: the token each row samples from (its decode token, or the last prompt
        token of a prefill that completes in this step); prompt_targets [P*Q]: at a prefill token
        whose sequence wants prompt logprobs, the prompt token that follows it (else -1).
        """
        c, (r, p, q) = self.config, shape
        return dict(
            tokens=np.zeros((r + p * q,), np.int32), slot_ids=np.full((r + p * q,), -1, np.int32),
            dec_positions=np.full((r,), -1, np.int32), dec_tables=np.zeros((r, c.blocks_per_seq), np.int32),
            pre_positions=np.full((p, q), -1, np.int32), pre_tables=np.zeros((p, c.blocks_per_seq), np.int32),
            sample_index=np.arange(r, dtype=np.int32),
            prompt_targets=np.full((p * q,), -1, np.int32),
            sampling=empty_sampling_batch(r, c.max_model_len, self.cfg.vocab_size))

    def build_batch(self, plan: StepPlan) -> dict[str, Any]:
        """The host arrays of `plan` (layout in `empty_batch`). Raises RowFailed naming the
        sequence whose row could not be written."""
        r, _, q = plan.shape
        batch = self.empty_batch(plan.shape)
        for row, s in enumerate(plan.decode):
            with _blame(s):
                batch["tokens"][row] = s.output_ids[-1]
                batch["slot_ids"][row] = s.slot
                batch["dec_positions"][row] = s.total_len - 1
                batch["dec_tables"][row, : len(s.blocks)] = s.blocks
        completing = len(plan.decode)
        for i, (s, start, n) in enumerate(plan.prefill):
            at = r + i * q
            with _blame(s):
                batch["tokens"][at: at + n] = s.all_ids[start: start + n]
                batch["slot_ids"][at: at + n] = s.slot
                batch["pre_positions"][i, :n] = np.arange(start, start + n)
                batch["pre_tables"][i, : len(s.blocks)] = s.blocks
                if s.prompt_logprobs is not None:  # positions whose next prompt token has no logprob yet
                    first = max(start, len(s.prompt_logprobs) - 1)
                    last = min(start + n, len(s.prompt_token_ids) - 1)
                    if first < last:
                        batch["prompt_targets"][i * q + first - start: i * q + last - start] = \
                            s.prompt_token_ids[first + 1: last + 1]
            if start + n == s.total_len:  # the prompt is in: a free row samples its first token
                batch["sample_index"][completing] = at + n - 1
                completing += 1
        for row, s in enumerate(plan.sampled):
            with _blame(s):
                fill_sampling_row(batch["sampling"], row,
                                  SamplingRow(s.params, s.seed, s.prompt_token_ids, s.output_ids, self.eos_token_id))
                if s.matcher is not None:
                    fill_mask(s.matcher, batch["sampling"]["allowed"], row)
        return batch

    def step(self, batch: dict[str, Any]) -> dict[str, np.ndarray]:
        """Runs one step; returns the sampled tokens i32[R] (and logprob arrays) on the host."""
        shape = batch["dec_positions"].shape + batch["pre_positions"].shape
        dev = self.tp.put(batch)  # one transfer (to every device of the mesh)
        if shape not in self._executables:  # lazy mode, or a shape warm-up did not cover
            self._compile([shape])
        out, self.cache = self._executables[shape](self._weights, self.lora.state, self.cache, dev)
        return fetch(out)

    def reset_cache_if_lost(self) -> bool:
        """After a step raised: if the donated KV cache went with it, start a zeroed one (the engine
        recomputes what the running sequences had in it). True if the cache was reset."""
        if not any(x.is_deleted() for x in self.cache.values()):
            return False
        self.cache = self._zero_cache()
        return True

    def _compile(self, shapes: list[tuple[int, int, int]], progress: bool = False) -> None:
        """Trace and lower each shape (Python, one at a time), then compile them on all cores at once:
        XLA compiles outside the GIL, and the step graphs do not depend on each other."""
        if not shapes:
            return
        lowered = {shape: self._step.lower(self._weights, self.lora.state, self.cache,
                                           self.tp.put(self.empty_batch(shape)),
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

    def warmup(self, progress: bool = True) -> None:
        """Compile the slot write and every step graph once, before the first request."""
        self.lora.warmup()
        self._compile([s for s in self.config.step_shapes() if s not in self._executables], progress)
