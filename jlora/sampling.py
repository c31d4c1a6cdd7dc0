"""SamplingParams (vLLM-shaped) and the jitted per-row sampler.

Every per-request setting becomes a row of an array, so one compiled sampler per batch bucket
serves any mix of greedy and sampled rows. The expensive parts (a full-vocabulary sort for
top-k/top-p/min-p, penalties, top-n logprobs) sit behind `lax.cond` and cost nothing in a batch
that does not ask for them.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

MAX_LOGPROBS = 20  # top-n logprobs per token: n is per request, the array width is static
MAX_BANNED = 8  # EOS plus stop_token_ids suppressed before min_tokens


@dataclasses.dataclass
class SamplingParams:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 (or 0) = no top-k
    min_p: float = 0.0
    repetition_penalty: float = 1.0  # >1 discourages tokens seen in the prompt or output
    presence_penalty: float = 0.0  # subtracted once from tokens already generated
    frequency_penalty: float = 0.0  # subtracted per occurrence in the generated tokens
    max_tokens: int | None = 16
    min_tokens: int = 0
    ignore_eos: bool = False
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    logprobs: int | None = None  # top-n logprobs per generated token (plus the sampled one)
    n: int = 1

    def __post_init__(self) -> None:
        def bad(name: str, why: str) -> ValueError:
            return ValueError(f"SamplingParams.{name}={getattr(self, name)!r}: {why}")

        def is_num(v: object) -> bool:
            return isinstance(v, (int, float)) and not isinstance(v, bool) and np.isfinite(v)

        def is_int(v: object) -> bool:
            return isinstance(v, int) and not isinstance(v, bool)

        if not is_num(self.temperature) or self.temperature < 0:
            raise bad("temperature", "must be a number >= 0 (0 = greedy)")
        if not is_num(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise bad("top_p", "must be in (0, 1]")
        if not is_int(self.top_k) or self.top_k < -1:
            raise bad("top_k", "must be an int >= -1 (-1 or 0 disables top-k)")
        if not is_num(self.min_p) or not 0.0 <= self.min_p <= 1.0:
            raise bad("min_p", "must be in [0, 1]")
        if not is_num(self.repetition_penalty) or self.repetition_penalty <= 0:
            raise bad("repetition_penalty", "must be > 0 (1 = off)")
        for name in ("presence_penalty", "frequency_penalty"):
            if not is_num(getattr(self, name)) or not -2.0 <= getattr(self, name) <= 2.0:
                raise bad(name, "must be in [-2, 2]")
        if self.max_tokens is not None and (not is_int(self.max_tokens) or self.max_tokens < 1):
            raise bad("max_tokens", "must be an int >= 1 or None")
        if not is_int(self.min_tokens) or self.min_tokens < 0:
            raise bad("min_tokens", "must be an int >= 0")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise bad("min_tokens", f"must not exceed max_tokens={self.max_tokens}")
        if self.seed is not None and (not is_int(self.seed) or not 0 <= self.seed < 2**32):
            raise bad("seed", "must be None or an int in [0, 2**32)")
        if self.logprobs is not None and (not is_int(self.logprobs) or not 0 <= self.logprobs <= MAX_LOGPROBS):
            raise bad("logprobs", f"must be None or an int in [0, {MAX_LOGPROBS}]")
        if not is_int(self.n) or self.n < 1:
            raise bad("n", "must be an int >= 1")
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise bad("stop", "must be a non-empty string or a list of non-empty strings")
        self.stop_token_ids = list(self.stop_token_ids or [])
        if any(not is_int(t) or t < 0 for t in self.stop_token_ids):
            raise bad("stop_token_ids", "must be a list of non-negative ints")
        if len(self.stop_token_ids) >= MAX_BANNED:
            raise bad("stop_token_ids", f"at most {MAX_BANNED - 1} ids are supported")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def uses_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0


@dataclasses.dataclass
class SamplingRow:
    """One sequence's view for the sampler: its params, seed, and tokens so far."""

    params: SamplingParams
    seed: int
    prompt_ids: list[int]
    output_ids: list[int]
    eos_token_id: int | None


def build_sampling_batch(rows: dict[int, SamplingRow], bucket: int, history_len: int) -> dict[str, np.ndarray]:
    """Host arrays for `sample`, one row per batch position (missing rows are greedy padding)."""
    temperature = np.zeros((bucket,), np.float32)
    top_k = np.zeros((bucket,), np.int32)
    top_p = np.ones((bucket,), np.float32)
    min_p = np.zeros((bucket,), np.float32)
    rep = np.ones((bucket,), np.float32)
    presence = np.zeros((bucket,), np.float32)
    frequency = np.zeros((bucket,), np.float32)
    seeds = np.zeros((bucket,), np.uint32)
    counters = np.zeros((bucket,), np.int32)
    banned = np.full((bucket, MAX_BANNED), -1, np.int32)
    history = np.full((bucket, history_len), -1, np.int32)
    n_prompt = np.zeros((bucket,), np.int32)
    want_logprobs = np.zeros((bucket,), bool)
    for b, r in rows.items():
        p = r.params
        temperature[b], top_k[b], top_p[b], min_p[b] = p.temperature, max(p.top_k, 0), p.top_p, p.min_p
        rep[b], presence[b], frequency[b] = p.repetition_penalty, p.presence_penalty, p.frequency_penalty
        seeds[b], counters[b] = r.seed, len(r.output_ids)
        want_logprobs[b] = p.logprobs is not None
        if len(r.output_ids) < p.min_tokens:
            ban = ([] if p.ignore_eos or r.eos_token_id is None else [r.eos_token_id]) + p.stop_token_ids
            banned[b, : len(ban)] = ban
        if p.uses_penalties:  # the history only matters to rows with penalties
            ids = r.prompt_ids + r.output_ids
            history[b, : len(ids)] = ids
            n_prompt[b] = len(r.prompt_ids)
    return dict(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p, repetition_penalty=rep,
                presence_penalty=presence, frequency_penalty=frequency, seeds=seeds, counters=counters,
                banned=banned, history=history, n_prompt=n_prompt, want_logprobs=want_logprobs)


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
    order = jnp.argsort(-scaled, axis=-1)  # [B, V], best first (stable: ties keep vocabulary order)
    sorted_logits = jnp.take_along_axis(scaled, order, axis=-1)
    rank = jnp.arange(v)[None, :]
    keep = jnp.where(top_k[:, None] > 0, rank < top_k[:, None], True)
    probs = jax.nn.softmax(jnp.where(keep, sorted_logits, -jnp.inf), axis=-1)
    # top-p: keep the smallest prefix whose mass reaches p (the best token always stays); p = 1
    # keeps all even where rounding makes the running sum reach 1 early.
    mass_before = jnp.cumsum(probs, axis=-1) - probs
    keep &= (mass_before < top_p[:, None]) | (top_p[:, None] >= 1.0)
    keep &= probs >= min_p[:, None] * probs[:, :1]
    rows = jnp.broadcast_to(jnp.arange(b)[:, None], (b, v))
    return jnp.zeros((b, v), bool).at[rows, order].set(keep)


@jax.jit
def sample(
    logits: jax.Array,  # f32[B, V]
    batch: dict[str, jax.Array],  # from build_sampling_batch
) -> dict[str, jax.Array]:  # tokens i32[B]; token_logprob f32[B]; top_ids i32[B, K]; top_logprobs f32[B, K]
    logits = raw = logits.astype(jnp.float32)
    b, v = logits.shape
    # Suppress EOS / stop tokens of rows still short of min_tokens.
    banned = batch["banned"]
    logits = jax.lax.cond(
        jnp.any(banned >= 0),
        lambda: logits.at[jnp.broadcast_to(jnp.arange(b)[:, None], banned.shape),
                          jnp.where(banned >= 0, banned, v)].set(-jnp.inf, mode="drop"),
        lambda: logits)
    logits = jax.lax.cond(
        jnp.any((batch["repetition_penalty"] != 1.0) | (batch["presence_penalty"] != 0.0)
                | (batch["frequency_penalty"] != 0.0)),
        lambda: _apply_penalties(logits, batch["history"], batch["n_prompt"], batch["repetition_penalty"],
                                 batch["presence_penalty"], batch["frequency_penalty"]),
        lambda: logits)
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

    def without_logprobs():
        k = min(MAX_LOGPROBS, v)
        return (jnp.zeros((b,), jnp.float32), jnp.zeros((b, k), jnp.int32),
                jnp.zeros((b, k), jnp.float32))

    tok_lp, top_ids, top_lp = jax.lax.cond(jnp.any(batch["want_logprobs"]), with_logprobs, without_logprobs)
    return {"tokens": tokens, "token_logprob": tok_lp, "top_ids": top_ids, "top_logprobs": top_lp}
