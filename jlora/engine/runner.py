"""ModelRunner: owns the device state (weights, paged KV cache, LoRA slots) and the one jitted step.

A step is one device call: the running sequences' decode tokens (R rows, padding where a row is
free) and a prefill part (P sequences x Q chunk tokens, one of `EngineConfig.prefill_shapes()`),
packed into one token axis, go through the model together (every weight read once), and the
sampler runs in the same graph. Graphs are keyed by (R, P, Q) and whether they hold LoRA
(`EngineConfig.step_graphs()`). Host and device meet once each way: the scheduler's NumPy arrays
go over in one transfer, and only the sampled tokens (and logprobs) come back.

The LoRA slot arrays are the runner's too (`self.lora`, a `LoRASlots`): the adapter manager only
decides which adapter goes in which slot and queues the writes, already padded on the host; the
step plan carries them and `write_slots` applies them right before the step that reads them.

Compiling the step graphs (warm-up, in the background too, and the executable store) is
`jlora.engine.compiling`'s `GraphCompiler`, a base of ModelRunner; reading a compiled graph's HLO
is `jlora.engine.hlo`. Their public names are re-exported here.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import time
from typing import TYPE_CHECKING, Any, Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jlora.adapters.slots import LoRASlots, SlotWrite
from jlora.engine.compiling import GraphCompiler, _abstract, wait_for_stored_executables  # noqa: F401 (re-exported)
from jlora.engine.config import EngineConfig
from jlora.engine.hlo import whole_cache_copies  # noqa: F401 (re-exported)
from jlora.engine.structured import fill_mask
from jlora.kernels.common import MIX_SLOT
from jlora.kernels.paged_attention_tpu import cache_lanes, default_chunk
from jlora.models import quant
from jlora.models.llama import AttnGroup, Llama, init_cache
from jlora.models.tensor_parallel import (CACHE_SCALE_SPEC, CACHE_SPEC, TensorParallel, fetch, layout_model,
                                          weight_spec)
from jlora.sampling import MAX_LOGPROBS, SamplingRow, empty_sampling_batch, fill_sampling_row, sample

if TYPE_CHECKING:
    from jlora.engine.scheduler import StepPlan
    from jlora.engine.sequence import Sequence


@dataclasses.dataclass
class StepHandle:
    """A launched step: its shape and its device outputs (packed host-bound outputs; the sampled
    tokens padded to max_num_seqs, which the next step may read on the device)."""

    shape: tuple[int, int, int]
    packed: jax.Array
    tokens: jax.Array


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


def _prompt_logprobs(head: Any, rows: slice, targets: jax.Array, vocab_size: int) -> dict[str, jax.Array]:
    """Log-probabilities of the next prompt token at each prefill position (targets i32[P*Q], -1 =
    none) and the top MAX_LOGPROBS there; the head over every prefill token runs only in steps
    where some row asked for prompt logprobs (a cond, so no extra graph). `head(rows)`: the logits
    of the prefill tokens `rows` (with their rows' head LoRA)."""
    k = min(MAX_LOGPROBS, vocab_size)

    def compute():
        lp = jax.nn.log_softmax(head(rows), axis=-1)  # f32[P*Q, V]: the model's raw distribution
        top_lp, top_ids = jax.lax.top_k(lp, k)
        return jnp.take_along_axis(lp, jnp.maximum(targets, 0)[:, None], axis=-1)[:, 0], top_ids.astype(jnp.int32), top_lp

    def skip():
        t = targets.shape[0]
        return jnp.zeros((t,), jnp.float32), jnp.zeros((t, k), jnp.int32), jnp.zeros((t, k), jnp.float32)

    tok, ids, top = jax.lax.cond(jnp.any(targets >= 0), compute, skip)
    return {"prompt_token_logprob": tok, "prompt_top_ids": ids, "prompt_top_logprobs": top}


# ---- one transfer each way --------------------------------------------------------------------------

BatchLayout = tuple  # (treedef, ((group, offset, shape, dtype name), ...)): static, one per step shape


def pack_batch(batch: dict[str, Any]) -> tuple[np.ndarray, np.ndarray, BatchLayout]:
    """A step's host arrays as one int32 and one float32 vector (uint32 and bool ride as int32) and the
    static layout that `unpack_batch` undoes inside the graph."""
    leaves, treedef = jax.tree_util.tree_flatten(batch)
    ints, floats, entries, n_int, n_float = [], [], [], 0, 0
    for leaf in leaves:
        a = np.asarray(leaf)
        if a.dtype == np.float32:
            entries.append(("f", n_float, a.shape, "float32"))
            floats.append(a.reshape(-1))
            n_float += a.size
        else:
            if a.dtype not in (np.int32, np.uint32, np.bool_):
                raise ValueError(f"step batch arrays must be int32, uint32, bool or float32, got {a.dtype}")
            entries.append(("i", n_int, a.shape, a.dtype.name))
            ints.append(a.astype(np.int32).reshape(-1) if a.dtype == np.bool_ else a.reshape(-1).view(np.int32))
            n_int += a.size
    cat = lambda parts, dt: np.concatenate(parts) if parts else np.zeros((0,), dt)  # noqa: E731
    return cat(ints, np.int32), cat(floats, np.float32), (treedef, tuple(entries))


def unpack_batch(ints: jax.Array, floats: jax.Array, layout: BatchLayout) -> dict[str, Any]:
    """Inside the step: the batch dict back from the two vectors (static slices, no copies to speak of)."""
    treedef, entries = layout
    leaves = []
    for group, offset, shape, dtype in entries:
        size = int(np.prod(shape))
        x = (floats if group == "f" else ints)[offset: offset + size].reshape(shape)
        if dtype == "uint32":
            x = jax.lax.bitcast_convert_type(x, jnp.uint32)
        elif dtype == "bool":
            x = x != 0
        leaves.append(x)
    return jax.tree_util.tree_unflatten(treedef, leaves)


def pack_outputs(out: dict[str, jax.Array]) -> tuple[jax.Array, Any]:
    """Inside the step: every output as one int32 vector (float32 ones bit-cast), so the host reads
    them in one transfer, and the layout `unpack_outputs` needs.

    Ints must not ride as float32 bits: a token id below 2^23 is a subnormal float32, and XLA:TPU
    flushes subnormals to zero in the fusion that assembles the vector (a v5e returned id 0 for
    every decode-only step of a small row bucket). Float bits in an int32 vector are only moved."""
    leaves, treedef = jax.tree_util.tree_flatten(out)
    parts, entries, offset = [], [], 0
    for x in leaves:
        if x.dtype == jnp.int32:
            parts.append(x.reshape(-1))
        else:
            parts.append(jax.lax.bitcast_convert_type(x.astype(jnp.float32), jnp.int32).reshape(-1))
        entries.append((offset, x.shape, "int32" if x.dtype == jnp.int32 else "float32"))
        offset += x.size
    return jnp.concatenate(parts), (treedef, tuple(entries))


def unpack_outputs(packed: np.ndarray, layout: Any) -> dict[str, np.ndarray]:
    treedef, entries = layout
    packed = np.asarray(packed)
    if packed.dtype != np.int32:
        raise ValueError(f"packed step outputs must be int32, got {packed.dtype}")
    leaves = [(packed[o: o + int(np.prod(shape))].view(np.float32) if dt == "float32" else
               packed[o: o + int(np.prod(shape))]).reshape(shape) for o, shape, dt in entries]
    return jax.tree_util.tree_unflatten(treedef, leaves)


def resolve_attn_impl(impl: str, tp_size: int, kv_dtype: Any) -> str:
    """`EngineConfig.attn_impl` for this runner: "auto" is the Pallas kernel on one TPU device (a
    Pallas call is not partitioned across a mesh, and XLA:CPU keeps bf16 as uint16 bits, which the
    kernel does not read), else the XLA loop."""
    real_floats = quant.storage_dtype(kv_dtype) != jnp.uint16
    if impl == "pallas" and (tp_size > 1 or not real_floats):
        raise ValueError(f"attn_impl='pallas' needs one device and a float KV cache on this backend (tensor "
                         f"parallel size {tp_size}, KV stored as {jnp.dtype(quant.storage_dtype(kv_dtype)).name}); "
                         f"use attn_impl='xla' or 'auto'")
    if impl != "auto":
        return impl
    return "pallas" if jax.default_backend() == "tpu" and tp_size == 1 and real_floats else "xla"


def fill_slots(batch: dict[str, Any], rows: slice, s: Sequence) -> None:
    """Tokens `rows` of `batch` read `s`'s adapter: its slot and scale, or (a combination) MIX_SLOT
    and each part's weight at the part's slot. With embedding LoRA slots (`vocab_lora` in the
    batch), marks whether `s`'s adapter has embed_tokens / lm_head LoRA, for the step's conditionals."""
    if "vocab_lora" in batch:
        for i, m in enumerate(("embed_tokens", "lm_head")):
            batch["vocab_lora"][i] |= any(m in h.adapter.weights for h in s.handles)
    if s.slots:
        batch["slot_ids"][rows] = MIX_SLOT
        batch["slot_mix"][rows, list(s.slots)] = s.lora.slot_weights
    else:
        batch["slot_ids"][rows] = s.slot
        if s.lora is not None:
            batch["slot_scale"][rows] = s.lora.scale


def step_graph(weights, lora_state, cache, ints, floats, history, allowed, prev_tokens, *, layout, lora_impl,
               attn_chunk, attn_impl, lora_skip=True, graphdef, weights_def, out_layouts, max_num_seqs, tuning):
    """One step (ModelRunner's `_step` jits it, the keyword arguments after `lora_skip` bound): the
    model over the packed batch, the sampler, and the outputs packed for one transfer. Records how
    the host unpacks them in `out_layouts` at trace time."""
    batch = unpack_batch(ints, floats, layout)
    batch["sampling"]["history"], batch["sampling"]["allowed"] = history, allowed
    # Async scheduling: a decode row whose token the previous step sampled (still on the device)
    # takes it from there (prev_rows[row] = its row in that step; -1 = the host's token).
    r = batch["dec_positions"].shape[0]
    prev = batch["prev_rows"]
    fed = jnp.where(prev >= 0, prev_tokens[jnp.maximum(prev, 0)], batch["tokens"][:r])
    batch["tokens"] = batch["tokens"].at[:r].set(fed)
    model = nnx.merge(graphdef, jax.tree.unflatten(weights_def, weights))
    groups = [AttnGroup(batch["dec_positions"][:, None], batch["dec_tables"])]
    if batch["pre_positions"].shape[0]:
        groups.append(AttnGroup(batch["pre_positions"], batch["pre_tables"], runs=True))
    # Embedding / head LoRA (enable_embedding_lora): whether some row's adapter has each, so a step
    # without skips it (jlora.models.vocab_lora); None where the engine holds no such slots.
    flags = batch.get("vocab_lora")
    hidden, cache = model.forward(batch["tokens"], batch["slot_ids"], tuple(groups), cache, lora_state,
                                  lora_impl=lora_impl, attn_chunk=attn_chunk, attn_impl=attn_impl,
                                  lora_skip=lora_skip, tuning=tuning,
                                  slot_scale=batch["slot_scale"], slot_mix=batch["slot_mix"],
                                  embed_lora=None if flags is None else flags[0])

    def head(rows: Any) -> Any:  # logits of the tokens at `rows` (an index array or a slice)
        if flags is None:
            return model.logits(hidden[rows])
        return model.logits(hidden[rows], lora_state, batch["slot_ids"][rows], batch["slot_scale"][rows],
                            batch["slot_mix"][rows], enabled=flags[1])

    out = sample(head(batch["sample_index"]), batch["sampling"])
    if batch["pre_positions"].shape[0]:
        out.update(_prompt_logprobs(head, slice(batch["dec_positions"].shape[0], None), batch["prompt_targets"],
                                    model.cfg.vocab_size))
    packed, out_layout = pack_outputs(out)
    shape = batch["dec_positions"].shape + batch["pre_positions"].shape
    out_layouts[shape] = out_layout  # at trace time: how the host unpacks this graph's outputs
    tokens = jnp.zeros((max_num_seqs,), jnp.int32).at[: out["tokens"].shape[0]].set(out["tokens"])
    return packed, tokens, cache


class ModelRunner(GraphCompiler):
    """`devices`: the engine's devices, a tensor-parallel mesh over them when there are several
    (jlora.models.tensor_parallel; default: the first device). Each device then holds its shard
    of every weight, of the KV cache and of the slots; XLA partitions the one step graph."""

    def __init__(self, model: Llama, config: EngineConfig, eos_token_id: int | None = None,
                 devices: Sequence[Any] | None = None):
        super().__init__()  # the compiled graphs' bookkeeping (GraphCompiler)
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
        self._owned = [p is not w for (_, w), p in zip(leaves, self._weights)]  # False: the model's array itself
        self.state = jax.tree.unflatten(self._weights_def, self._weights)
        # What the KV cache holds: the model's dtype, or int8 with scales (EngineConfig.kv_cache_dtype).
        self.kv_dtype = jnp.int8 if config.kv_cache_dtype == "int8" else model.dtype
        self.attn_impl = resolve_attn_impl(config.attn_impl, self.tp.size, self.kv_dtype)
        kvh, dh = self.layout_cfg.num_key_value_heads, self.layout_cfg.head_dim
        self.cache_lanes = cache_lanes(kvh, dh) if self.attn_impl == "pallas" else kvh * dh  # a cache row
        self.cache = self._zero_cache()
        if config.enable_embedding_lora and self.tp.size > 1:
            raise ValueError(f"enable_embedding_lora=True is not supported with tensor parallelism "
                             f"(tensor_parallel_size={self.tp.size}): the embedding / head LoRA slots are not sharded")
        # With enable_dora the placed base weights go to the slots too: a DoRA write takes its norm of them.
        base = nnx.merge(self.graphdef, self.state).layers.weights() if config.enable_dora else None
        self.lora = LoRASlots(self.cfg, config.max_loras, config.max_lora_rank, model.dtype, tp=self.tp,
                              slot_ranks=config.slot_ranks, modules=config.lora_modules, dora=config.enable_dora,
                              base=base)
        shardings = None
        if self.tp.size > 1 or jax.process_count() > 1:  # outputs replicated; the cache keeps its sharding
            shardings = dict(out_shardings=(self.tp.replicated, self.tp.replicated,
                                            {k: x.sharding for k, x in self.cache.items()}))
        pallas_chunk = default_chunk(self.cache_lanes, jnp.dtype(self.kv_dtype).itemsize)
        self.attn_chunk = config.attn_chunk or (pallas_chunk if self.attn_impl == "pallas" else 128)
        self._out_layouts: dict[tuple[int, int, int], Any] = {}  # (R, P, Q) -> how its packed outputs unpack
        # A module-level function with what it reads of the runner bound in, not a bound method: the
        # jitted function holds no reference back to the runner, so a dropped engine frees its device
        # arrays and executables at once instead of at the cyclic collector's next full pass.
        self._step = jax.jit(functools.partial(step_graph, graphdef=self.graphdef, weights_def=self._weights_def,
                                               out_layouts=self._out_layouts, max_num_seqs=config.max_num_seqs,
                                               tuning=config.tuning),
                             static_argnames=("layout", "lora_impl", "attn_chunk", "attn_impl", "lora_skip"),
                             donate_argnames=("cache",), **(shardings or {}))
        self._base_shapes = frozenset(config.base_graph_shapes())  # shapes with a graph without LoRA too
        # Steps launched per graph ((R, P, Q), with LoRA): which compiled graphs a workload ran
        # (the chip check holds every one of them against the CPU).
        self.graph_runs: collections.Counter[tuple[tuple[int, int, int], bool]] = collections.Counter()
        # float32 means float32: XLA:TPU (and TF32 GPUs) multiply float32 operands in bf16 passes at
        # the default precision, which left a v5e's float32 greedy tokens off the CPU's within 20
        # tokens; narrower dtypes keep the default (Mosaic refuses bf16 operands under "highest").
        self.matmul_precision = "highest" if jnp.dtype(model.dtype) == jnp.float32 else None
        self._resident: dict[int, tuple[jax.Array, jax.Array, jax.Array]] = {}  # rows -> `_defaults`
        # StepListeners told of each launch and collect (LLMEngine.add_step_listener shares its list).
        self.listeners: list[Any] = []

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
        """A zeroed KV cache [L, NB, bs, KVH*Dh] (rows padded for the TPU kernel: `cache_lanes`), sharded
        over its KV heads."""
        return init_cache(self.layout_cfg, self.config.num_kv_blocks, self.config.block_size,
                          quant.storage_dtype(self.kv_dtype), lanes=self.cache_lanes,
                          zeros=lambda shape, dtype: self.tp.zeros(shape, dtype, CACHE_SPEC),
                          scale_zeros=lambda shape, dtype: self.tp.zeros(shape, dtype, CACHE_SCALE_SPEC))

    @property
    def lora_state(self):  # module -> {"A": [L, N, in, S*R], "B": [L, N, R, out], "M" (enable_dora): [L, N, out]}; per pool
        return self.lora.state

    def write_slots(self, writes: tuple[SlotWrite, ...]) -> None:
        """Apply a plan's queued slot writes (already padded on the host) before its step."""
        self.lora.write(writes)

    @property
    def kv_cache_bytes(self) -> int:
        return sum(x.nbytes for x in self.cache.values())

    @property
    def weights(self) -> tuple[jax.Array, ...]:
        """The model's device arrays as the step graphs take them (int8 ones with their scales)."""
        return tuple(self._weights)

    @property
    def compiled_graphs(self) -> dict[tuple[tuple[int, int, int], bool], Any]:
        """((R, P, Q), with LoRA) -> its compiled step (`jax.stages.Compiled`: `as_text()`,
        `memory_analysis()`), for the graphs compiled or loaded so far."""
        return dict(self._executables)

    def empty_batch(self, shape: tuple[int, int, int]) -> dict[str, Any]:
        """Host arrays for one step with every row and token padding; the scheduler fills them in.

        shape (R, P, Q): R decode rows; the prefill part, P sequences of Q chunk tokens (0, 0: none).
        tokens / slot_ids [R + P*Q]: the R decode rows first, then the prefill rows (slot id
        MIX_SLOT: a combination of adapters); slot_scale f32[R + P*Q]: each token's LoRA scale;
        slot_mix f32[R + P*Q, max_loras]: a combination's weight of each slot (zeros elsewhere);
        prev_rows [R]: for async scheduling, the row of the previous step whose sampled token (still
        on the device) is this decode row's token, -1 = `tokens` as given;
        dec_positions [R], dec_tables [R, MB]; pre_positions [P, Q], pre_tables [P, MB];
        sample_index [R]: the token each row samples from (its decode token, or the last prompt
        token of a prefill that completes in this step); prompt_targets [P*Q]: at a prefill token
        whose sequence wants prompt logprobs, the prompt token that follows it (else -1);
        vocab_lora bool[2] (enable_embedding_lora only): whether a row's adapter has embed_tokens /
        lm_head LoRA (the step skips each delta otherwise).
        """
        c, (r, p, q) = self.config, shape
        return dict(
            tokens=np.zeros((r + p * q,), np.int32), slot_ids=np.full((r + p * q,), -1, np.int32),
            slot_scale=np.ones((r + p * q,), np.float32), slot_mix=np.zeros((r + p * q, c.max_loras), np.float32),
            dec_positions=np.full((r,), -1, np.int32), dec_tables=np.zeros((r, c.blocks_per_seq), np.int32),
            prev_rows=np.full((r,), -1, np.int32),
            pre_positions=np.full((p, q), -1, np.int32), pre_tables=np.zeros((p, c.blocks_per_seq), np.int32),
            sample_index=np.arange(r, dtype=np.int32),
            prompt_targets=np.full((p * q,), -1, np.int32),
            sampling=empty_sampling_batch(r, c.max_model_len, self.cfg.vocab_size),
            # enable_embedding_lora: (some row's adapter has embed_tokens LoRA, some has lm_head LoRA)
            **({"vocab_lora": np.zeros((2,), np.bool_)} if c.enable_embedding_lora else {}))

    def build_batch(self, plan: StepPlan) -> dict[str, Any]:
        """The host arrays of `plan` (layout in `empty_batch`). Raises RowFailed naming the
        sequence whose row could not be written."""
        r, _, q = plan.shape
        batch = self.empty_batch(plan.shape)
        for row, s in enumerate(plan.decode):
            with _blame(s):
                batch["tokens"][row] = s.output_ids[-1]
                fill_slots(batch, slice(row, row + 1), s)
                batch["dec_positions"][row] = s.total_len - 1
                batch["dec_tables"][row, : len(s.blocks)] = s.blocks
        completing = len(plan.decode)
        for i, (s, start, n) in enumerate(plan.prefill):
            at = r + i * q
            with _blame(s):
                batch["tokens"][at: at + n] = s.all_ids[start: start + n]
                fill_slots(batch, slice(at, at + n), s)
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
        return self.collect(self.launch(batch))

    def launch(self, batch: dict[str, Any], prev: StepHandle | None = None) -> StepHandle:
        """Starts one step on the device and returns at once (JAX dispatches asynchronously).
        `prev`: the step whose sampled tokens rows with `prev_rows` >= 0 take (async scheduling).

        The batch crosses in two transfers (its int32 and float32 arrays, each packed into one; the
        sampler's history and grammar mask only when some row uses them, else a resident default)
        and the outputs come back in one (`collect`): on a TPU host each transfer costs latency,
        and the ~24 arrays of a step, sent one by one, cost more than the device's decode step."""
        t0 = time.perf_counter() if self.listeners else 0.0
        key = self.graph_of(batch)
        shape = key[0]
        sampling = dict(batch["sampling"])
        history, allowed = sampling.pop("history"), sampling.pop("allowed")
        ints, floats, layout = pack_batch({**batch, "sampling": sampling})
        dev = list(self.tp.put((ints, floats)))
        default_history, default_allowed, no_tokens = self._defaults(shape[0], history.shape[1], allowed.shape[1])
        dev.append(default_history if history[:, 0].max() < 0 else self.tp.put(history))
        dev.append(default_allowed if allowed.min() == -1 and allowed.max() == -1 else self.tp.put(allowed))
        dev.append(no_tokens if prev is None else prev.tokens)
        if key not in self._executables:  # lazy mode, or a shape warm-up did not cover
            self._compile([key])
        self.graph_runs[key] += 1
        packed, tokens, self.cache = self._executables[key](self._weights, self.lora.state if key[1] else None,
                                                            self.cache, *dev)
        handle = StepHandle(shape, packed, tokens)
        if self.listeners:
            seconds = time.perf_counter() - t0
            for listener in self.listeners:
                listener.phase("launch", seconds)
                listener.launched(batch, handle, prev, t0)
        return handle

    def graph_of(self, batch: dict[str, Any]) -> tuple[tuple[int, int, int], bool]:
        """The step graph (shape, with LoRA) a batch runs: the one without LoRA when no row has an
        adapter and its shape has one (EngineConfig.base_graphs), else the LoRA graph."""
        shape = batch["dec_positions"].shape + batch["pre_positions"].shape
        ids = batch["slot_ids"]
        with_lora = bool(((ids >= 0) | (ids == MIX_SLOT)).any()) or shape not in self._base_shapes
        # While a background warm-up compiles the base graph, the LoRA graph (always compiled before
        # its shape is scheduled) runs the step: LoRA for every row, zero for rows without an adapter.
        return shape, with_lora or (shape, False) in self._pending

    def can_run(self, shape: tuple[int, int, int]) -> bool:
        """Whether a step of `shape` runs without waiting for a compile: false only for a graph a
        background warm-up has not compiled yet (the scheduler then picks a larger shape)."""
        return (shape, True) not in self._pending

    def collect(self, handle: StepHandle) -> dict[str, np.ndarray]:
        """Waits for a launched step; its outputs on the host, in one transfer."""
        if not self.listeners:
            return unpack_outputs(fetch(handle.packed), self._out_layouts[handle.shape])
        t0 = time.perf_counter()
        handle.packed.block_until_ready()
        t1 = time.perf_counter()
        out = unpack_outputs(fetch(handle.packed), self._out_layouts[handle.shape])
        t2 = time.perf_counter()
        for listener in self.listeners:
            listener.phase("wait_device", t1 - t0)
            listener.phase("read_outputs", t2 - t1)
            listener.collected(handle, t0, t2)
        return out

    def _defaults(self, rows: int, history_len: int, mask_words: int) -> tuple[jax.Array, jax.Array, jax.Array]:
        """Device-resident "nothing" inputs: a history of -1 (no penalties), an all-allowed grammar
        mask and zero previous tokens, made once per row count."""
        if rows not in self._resident:
            self._resident[rows] = self.tp.put((np.full((rows, history_len), -1, np.int32),
                                                np.full((rows, mask_words), -1, np.int32),
                                                np.zeros((self.config.max_num_seqs,), np.int32)))
        return self._resident[rows]

    def reset_cache_if_lost(self) -> bool:
        """After a step raised: if the donated KV cache went with it, start a zeroed one (the engine
        recomputes what the running sequences had in it). True if the cache was reset."""
        if not any(x.is_deleted() for x in self.cache.values()):
            return False
        self.cache = self._zero_cache()
        return True

    def step_inputs(self, key: tuple[tuple[int, int, int], bool]) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """The arguments (an empty batch of the graph's shape) and static arguments the step graph
        `key` ((R, P, Q), with LoRA) is traced with."""
        shape, with_lora = key
        batch = self.empty_batch(shape)
        sampling = dict(batch["sampling"])
        extra = self._defaults(shape[0], sampling.pop("history").shape[1], sampling.pop("allowed").shape[1])
        ints, floats, layout = pack_batch({**batch, "sampling": sampling})
        args = (self._weights, self.lora.state if with_lora else None, self.cache, *self.tp.put((ints, floats)), *extra)
        # A shape with a graph without LoRA leaves adapter-free steps to it: its LoRA graph
        # computes LoRA for every row instead of skipping it with conditionals.
        return args, dict(layout=layout, lora_impl=self.config.lora_impl, attn_chunk=self.attn_chunk,
                          attn_impl=self.attn_impl, lora_skip=shape not in self._base_shapes)

    def lower(self, key: tuple[tuple[int, int, int], bool]) -> Any:
        """The step graph `key` traced and lowered (a `jax.stages.Lowered`: `.as_text()` is its
        StableHLO), as warm-up compiles it, with this engine's config and tuning options."""
        args, static = self.step_inputs(key)
        # Abstract arguments: a background warm-up lowers while steps donate the cache it would
        # otherwise hold (and the shapes and shardings are all a lowering reads).
        with jax.default_matmul_precision(self.matmul_precision):
            return self._step.lower(*jax.tree.map(_abstract, args), **static)

    def close(self) -> None:
        """Stop a background warm-up and free the device arrays (KV cache, weights this runner
        placed, LoRA slots) and compiled graphs. Weights it shares with the model it was given
        (already on its devices) are left to their owner. Idempotent; the runner is unusable after."""
        self.stop_background_warmup()
        owned = [w for w, mine in zip(self._weights, self._owned) if mine]
        for x in [*owned, *self.cache.values(), *jax.tree.leaves(self._resident)]:
            x.delete()
        self.lora.close()
        self._weights, self.state, self.cache, self._resident = [], None, {}, {}
        self._executables.clear()
        self._step = None
