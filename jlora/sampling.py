"""The jitted per-row sampler (SamplingParams and its bounds live in `jlora.sampling_params`).

Every per-request setting becomes a row of an array, so one compiled sampler per batch bucket
serves any mix of greedy and sampled rows. The expensive parts (a full-vocabulary sort for
top-k/top-p/min-p, penalties, top-n logprobs) sit behind `lax.cond` and cost nothing in a batch
that does not ask for them. One outer `lax.switch` returning no [B, V] array (see `sample` for
why) gives a batch of plain greedy rows one argmax, and skips the logit edits (bans, bias, grammar
mask, penalties) in a batch without them.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from jlora.sampling_params import MAX_LOGIT_BIAS, MAX_BANNED, MAX_LOGPROBS, SamplingParams

__all__ = ["SamplingParams", "SamplingRow", "build_sampling_batch", "empty_sampling_batch", "fill_sampling_row",
           "sample", "MAX_LOGPROBS", "MAX_BANNED"]


@dataclasses.dataclass
class SamplingRow:
    """One sequence's view for the sampler: its params, seed, and tokens so far."""

    params: SamplingParams
    seed: int
    prompt_ids: list[int]
    output_ids: list[int]
    eos_token_id: int | None


def empty_sampling_batch(bucket: int, history_len: int, vocab_size: int | None = None) -> dict[str, np.ndarray]:
    """Host arrays for `sample` with every row greedy padding; `fill_sampling_row` sets one row.

    With `vocab_size`, also the per-row logit bias (`bias_ids` / `bias_values` [B, MAX_LOGIT_BIAS])
    and the grammar mask `allowed` (int32 [B, ceil(V/32)] bits, -1 = every token allowed), which
    the engine's step always carries (one graph whether or not a row uses them)."""
    extra = {} if vocab_size is None else dict(
        bias_ids=np.full((bucket, MAX_LOGIT_BIAS), -1, np.int32), bias_values=np.zeros((bucket, MAX_LOGIT_BIAS), np.float32),
        allowed=np.full((bucket, -(-vocab_size // 32)), -1, np.int32))
    return dict(**extra,
        temperature=np.zeros((bucket,), np.float32), top_k=np.zeros((bucket,), np.int32),
        top_p=np.ones((bucket,), np.float32), min_p=np.zeros((bucket,), np.float32),
        repetition_penalty=np.ones((bucket,), np.float32), presence_penalty=np.zeros((bucket,), np.float32),
        frequency_penalty=np.zeros((bucket,), np.float32), seeds=np.zeros((bucket,), np.uint32),
        counters=np.zeros((bucket,), np.int32), banned=np.full((bucket, MAX_BANNED), -1, np.int32),
        history=np.full((bucket, history_len), -1, np.int32), n_prompt=np.zeros((bucket,), np.int32),
        want_logprobs=np.zeros((bucket,), bool))


def fill_sampling_row(batch: dict[str, np.ndarray], b: int, r: SamplingRow) -> None:
    """Row `b` of `batch` from one sequence. Raises (OverflowError, ValueError) only for this row's
    values, so the engine can fail the one request instead of the step."""
    p = r.params
    batch["temperature"][b], batch["top_k"][b] = p.temperature, max(p.top_k, 0)
    batch["top_p"][b], batch["min_p"][b] = p.top_p, p.min_p
    batch["repetition_penalty"][b] = p.repetition_penalty
    batch["presence_penalty"][b], batch["frequency_penalty"][b] = p.presence_penalty, p.frequency_penalty
    batch["seeds"][b], batch["counters"][b] = r.seed, len(r.output_ids)
    batch["want_logprobs"][b] = p.logprobs is not None
    if len(r.output_ids) < p.min_tokens:
        ban = ([] if p.ignore_eos or r.eos_token_id is None else [r.eos_token_id]) + p.stop_token_ids
        batch["banned"][b, : len(ban)] = ban
    if p.logit_bias:
        if "bias_ids" not in batch:
            raise ValueError("this sampling batch has no logit_bias arrays (empty_sampling_batch without vocab_size)")
        ids, values = zip(*p.logit_bias.items())
        batch["bias_ids"][b, : len(ids)] = ids
        batch["bias_values"][b, : len(ids)] = values
    if p.uses_penalties:  # the history only matters to rows with penalties
        ids = r.prompt_ids + r.output_ids
        batch["history"][b, : len(ids)] = ids
        batch["n_prompt"][b] = len(r.prompt_ids)


def build_sampling_batch(rows: dict[int, SamplingRow], bucket: int, history_len: int) -> dict[str, np.ndarray]:
    """Host arrays for `sample`, one row per batch position (missing rows are greedy padding)."""
    batch = empty_sampling_batch(bucket, history_len)
    for b, r in rows.items():
        fill_sampling_row(batch, b, r)
    return batch


def _apply_penalties(logits, history, n_prompt, rep, presence, frequency):  # f32[B, V] -> f32[B, V]
    b, v = logits.shape
    valid = history >= 0
    is_output = valid & (jnp.arange(history.shape[1])[None, :] >= n_prompt[:, None])
    rows = jnp.broadcast_to(jnp.arange(b)[:, None], history.shape)
    ids = jnp.where(valid, history, v)  # out of range: dropped
    seen = jnp.zeros((b, v), bool).at[rows, ids].set(True, mode="drop")
    out_counts = jnp.zeros((b, v), jnp.float32).at[rows, ids].add(is_output.astype(jnp.float32), mode="drop")
    # Repetition penalty (CTRL / vLLM): divide positive logits, multiply negative ones, for seen tokens.
    penalized = jnp.where(logits > 0, logits / rep[:, None], logits * rep[:, None])
    logits = jnp.where(seen, penalized, logits)
    logits = logits - frequency[:, None] * out_counts - presence[:, None] * (out_counts > 0)
    return logits


def _filter_mask(scaled, top_k, top_p, min_p):  # f32[B, V] -> bool[B, V] (vocabulary order)
    """Tokens that survive top-k, then top-p over the top-k distribution, then min-p.

    Rows with top_k <= 0, top_p == 1 and min_p == 0 keep every token, so a row's draw does not
    depend on whether other rows in the batch filter.
    """
    b, v = scaled.shape
    vocab = jax.lax.broadcasted_iota(jnp.int32, (b, v), 1)
    # [B, V] best first, with each one's token (stable: ties keep vocabulary order)
    neg, order = jax.lax.sort((-scaled, vocab), dimension=1, num_keys=1, is_stable=True)
    sorted_logits = -neg
    rank = jnp.arange(v)[None, :]
    keep = jnp.where(top_k[:, None] > 0, rank < top_k[:, None], True)
    probs = jax.nn.softmax(jnp.where(keep, sorted_logits, -jnp.inf), axis=-1)
    # top-p: keep the smallest prefix whose mass reaches p (the best token always stays); p = 1
    # keeps all even where rounding makes the running sum reach 1 early.
    mass_before = jnp.cumsum(probs, axis=-1) - probs
    keep &= (mass_before < top_p[:, None]) | (top_p[:, None] >= 1.0)
    keep &= probs >= min_p[:, None] * probs[:, :1]
    # `keep` is a prefix of the sorted order; in vocabulary order it is every token above its last
    # one's logit, and the tokens tied with it up to its id: two values a row instead of a [B, V]
    # scatter by the sort's order (and the sort carries the values: no gather by it either).
    last = jnp.maximum(jnp.sum(keep, axis=-1), 1)[:, None] - 1
    t, t_id = jnp.take_along_axis(sorted_logits, last, axis=-1), jnp.take_along_axis(order, last, axis=-1)
    return (scaled > t) | ((scaled == t) & (vocab <= t_id))


def _modify(logits: jax.Array, batch: dict[str, jax.Array]) -> jax.Array:  # f32[B, V] -> f32[B, V]
    """Bans, logit bias, the grammar mask and penalties, each behind its own `lax.cond`."""
    b, v = logits.shape
    # Suppress EOS / stop tokens of rows still short of min_tokens.
    banned = batch["banned"]
    logits = jax.lax.cond(
        jnp.any(banned >= 0),
        lambda: logits.at[jnp.broadcast_to(jnp.arange(b)[:, None], banned.shape),
                          jnp.where(banned >= 0, banned, v)].set(-jnp.inf, mode="drop"),
        lambda: logits)
    if "bias_ids" in batch:  # OpenAI's logit_bias: added to the logits before anything else
        bias_ids = batch["bias_ids"]
        logits = jax.lax.cond(
            jnp.any(bias_ids >= 0),
            lambda: logits.at[jnp.broadcast_to(jnp.arange(b)[:, None], bias_ids.shape),
                              jnp.where(bias_ids >= 0, bias_ids, v)].add(batch["bias_values"], mode="drop"),
            lambda: logits)
    if "allowed" in batch:  # a grammar's mask (structured output): bit t of row b = token t allowed
        allowed = batch["allowed"]

        def masked() -> jax.Array:
            bits = (allowed[:, :, None] >> jnp.arange(32, dtype=jnp.int32)) & 1  # [B, V/32, 32]
            return jnp.where(bits.reshape(b, -1)[:, :v] > 0, logits, -jnp.inf)

        logits = jax.lax.cond(jnp.any(allowed != -1), masked, lambda: logits)
    return jax.lax.cond(
        _uses_penalties(batch),
        lambda: _apply_penalties(logits, batch["history"], batch["n_prompt"], batch["repetition_penalty"],
                                 batch["presence_penalty"], batch["frequency_penalty"]),
        lambda: logits)


def _uses_penalties(batch: dict[str, jax.Array]) -> jax.Array:  # bool[]
    return jnp.any((batch["repetition_penalty"] != 1.0) | (batch["presence_penalty"] != 0.0)
                   | (batch["frequency_penalty"] != 0.0))


def _no_logprobs(b: int, v: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    k = min(MAX_LOGPROBS, v)
    return jnp.zeros((b,), jnp.float32), jnp.zeros((b, k), jnp.int32), jnp.zeros((b, k), jnp.float32)


def _draw(logits: jax.Array, raw: jax.Array, batch: dict[str, jax.Array]) -> dict[str, jax.Array]:
    """Tokens from the modified `logits` (greedy or sampled per row), logprobs from the `raw` ones."""
    b, v = logits.shape
    temperature = batch["temperature"]
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    is_sampled = temperature > 0
    scaled = lambda: logits / jnp.maximum(temperature, 1e-6)[:, None]  # noqa: E731  (only when sampling)
    # A per-request key, folded with the row's own token counter: independent of batch composition.
    # Every path draws over the vocabulary in its own order with that key (Gumbel-max), so a row's
    # token depends only on its logits, parameters, seed and step.
    keys = jax.vmap(lambda s, c: jax.random.fold_in(jax.random.key(s), c))(batch["seeds"], batch["counters"])

    def plain() -> jax.Array:
        return jax.vmap(jax.random.categorical)(keys, scaled()).astype(jnp.int32)

    def filtered() -> jax.Array:
        x = scaled()
        keep = _filter_mask(x, batch["top_k"], batch["top_p"], batch["min_p"])
        return jax.vmap(jax.random.categorical)(keys, jnp.where(keep, x, -jnp.inf)).astype(jnp.int32)

    # The full-vocabulary sort is the expensive part: run it only when some row filters.
    needs_filter = jnp.any(is_sampled & ((batch["top_k"] > 0) | (batch["top_p"] < 1.0) | (batch["min_p"] > 0.0)))
    sampled = jax.lax.cond(
        jnp.any(is_sampled), lambda: jax.lax.cond(needs_filter, filtered, plain), lambda: greedy)
    tokens = jnp.where(is_sampled, sampled, greedy)

    def with_logprobs():  # the model's own distribution: before bans, penalties and temperature
        lp = jax.nn.log_softmax(raw, axis=-1)
        top_lp, top_ids = jax.lax.top_k(lp, min(MAX_LOGPROBS, v))
        return jnp.take_along_axis(lp, tokens[:, None], axis=-1)[:, 0], top_ids.astype(jnp.int32), top_lp

    tok_lp, top_ids, top_lp = jax.lax.cond(jnp.any(batch["want_logprobs"]), with_logprobs, lambda: _no_logprobs(b, v))
    return {"tokens": tokens, "token_logprob": tok_lp, "top_ids": top_ids, "top_logprobs": top_lp}


@jax.jit
def sample(
    logits: jax.Array,  # f32[B, V]
    batch: dict[str, jax.Array],  # from build_sampling_batch
) -> dict[str, jax.Array]:  # tokens i32[B]; token_logprob f32[B]; top_ids i32[B, K]; top_logprobs f32[B, K]
    logits = logits.astype(jnp.float32)
    b, v = logits.shape
    # XLA:TPU copies a conditional's pass-through operand into its output buffer: each
    # `cond(pred, modified, lambda: logits)` in `_modify` costs a full [B, V] copy even when no row
    # uses it (0.26 ms of a 7.8 ms decode step of the bench's 1B shape at B=64 on a v5e). So one
    # switch up front whose branches return only the small outputs: plain greedy rows (the common
    # batch) cost one argmax, and sampled or logprobs rows that modify no logit skip `_modify`.
    # lm_head matmul + sampler on a v5e, B=64, V=49152: greedy 0.26 -> 0.09 ms, sampled 0.33 ->
    # 0.20 ms (the matmul and an argmax alone: 0.08 ms); a batch with logit edits pays 0.01 ms more.
    modifies = jnp.any(batch["banned"] >= 0) | _uses_penalties(batch)
    if "bias_ids" in batch:
        modifies |= jnp.any(batch["bias_ids"] >= 0)
    if "allowed" in batch:
        modifies |= jnp.any(batch["allowed"] != -1)
    draws = jnp.any(batch["temperature"] > 0) | jnp.any(batch["want_logprobs"])

    def greedy_only() -> dict[str, jax.Array]:
        tok_lp, top_ids, top_lp = _no_logprobs(b, v)
        return {"tokens": jnp.argmax(logits, axis=-1).astype(jnp.int32), "token_logprob": tok_lp,
                "top_ids": top_ids, "top_logprobs": top_lp}

    return jax.lax.switch(jnp.where(modifies, 2, jnp.where(draws, 1, 0)),
                          [greedy_only, lambda: _draw(logits, logits, batch),
                           lambda: _draw(_modify(logits, batch), logits, batch)])
