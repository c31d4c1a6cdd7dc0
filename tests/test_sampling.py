"""The jitted sampler: same outputs as before its restructuring, and no [B, V] pass-through on the greedy path."""

import re

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest

from jlora.sampling import (MAX_LOGPROBS, SamplingParams, SamplingRow, _apply_penalties, _filter_mask,
                            build_sampling_batch, empty_sampling_batch, fill_sampling_row, sample)


def _reference_filter_mask(scaled, top_k, top_p, min_p):
    """`_filter_mask` as it was: argsort, the sorted prefix kept, scattered back to vocabulary order."""
    b, v = scaled.shape
    order = jnp.argsort(-scaled, axis=-1)
    sorted_logits = jnp.take_along_axis(scaled, order, axis=-1)
    rank = jnp.arange(v)[None, :]
    keep = jnp.where(top_k[:, None] > 0, rank < top_k[:, None], True)
    probs = jax.nn.softmax(jnp.where(keep, sorted_logits, -jnp.inf), axis=-1)
    mass_before = jnp.cumsum(probs, axis=-1) - probs
    keep &= (mass_before < top_p[:, None]) | (top_p[:, None] >= 1.0)
    keep &= probs >= min_p[:, None] * probs[:, :1]
    rows = jnp.broadcast_to(jnp.arange(b)[:, None], (b, v))
    return jnp.zeros((b, v), bool).at[rows, order].set(keep)


@jax.jit
def _reference_sample(logits, batch):
    """`sample` as it was before its outer switch (one cond per feature, each returning the [B, V]
    logits): the expectation every batch below is held to, bit for bit."""
    logits = raw = logits.astype(jnp.float32)
    b, v = logits.shape
    banned = batch["banned"]
    logits = jax.lax.cond(
        jnp.any(banned >= 0),
        lambda: logits.at[jnp.broadcast_to(jnp.arange(b)[:, None], banned.shape),
                          jnp.where(banned >= 0, banned, v)].set(-jnp.inf, mode="drop"),
        lambda: logits)
    if "bias_ids" in batch:
        bias_ids = batch["bias_ids"]
        logits = jax.lax.cond(
            jnp.any(bias_ids >= 0),
            lambda: logits.at[jnp.broadcast_to(jnp.arange(b)[:, None], bias_ids.shape),
                              jnp.where(bias_ids >= 0, bias_ids, v)].add(batch["bias_values"], mode="drop"),
            lambda: logits)
    if "allowed" in batch:
        allowed = batch["allowed"]

        def masked():
            bits = (allowed[:, :, None] >> jnp.arange(32, dtype=jnp.int32)) & 1
            return jnp.where(bits.reshape(b, -1)[:, :v] > 0, logits, -jnp.inf)

        logits = jax.lax.cond(jnp.any(allowed != -1), masked, lambda: logits)
    logits = jax.lax.cond(
        jnp.any((batch["repetition_penalty"] != 1.0) | (batch["presence_penalty"] != 0.0)
                | (batch["frequency_penalty"] != 0.0)),
        lambda: _apply_penalties(logits, batch["history"], batch["n_prompt"], batch["repetition_penalty"],
                                 batch["presence_penalty"], batch["frequency_penalty"]),
        lambda: logits)
    temperature = batch["temperature"]
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    is_sampled = temperature > 0
    scaled = lambda: logits / jnp.maximum(temperature, 1e-6)[:, None]  # noqa: E731
    keys = jax.vmap(lambda s, c: jax.random.fold_in(jax.random.key(s), c))(batch["seeds"], batch["counters"])

    def plain():
        return jax.vmap(jax.random.categorical)(keys, scaled()).astype(jnp.int32)

    def filtered():
        x = scaled()
        keep = _reference_filter_mask(x, batch["top_k"], batch["top_p"], batch["min_p"])
        return jax.vmap(jax.random.categorical)(keys, jnp.where(keep, x, -jnp.inf)).astype(jnp.int32)

    needs_filter = jnp.any(is_sampled & ((batch["top_k"] > 0) | (batch["top_p"] < 1.0) | (batch["min_p"] > 0.0)))
    sampled = jax.lax.cond(
        jnp.any(is_sampled), lambda: jax.lax.cond(needs_filter, filtered, plain), lambda: greedy)
    tokens = jnp.where(is_sampled, sampled, greedy)

    def with_logprobs():
        lp = jax.nn.log_softmax(raw, axis=-1)
        top_lp, top_ids = jax.lax.top_k(lp, min(MAX_LOGPROBS, v))
        return jnp.take_along_axis(lp, tokens[:, None], axis=-1)[:, 0], top_ids.astype(jnp.int32), top_lp

    def without_logprobs():
        k = min(MAX_LOGPROBS, v)
        return (jnp.zeros((b,), jnp.float32), jnp.zeros((b, k), jnp.int32),
                jnp.zeros((b, k), jnp.float32))

    tok_lp, top_ids, top_lp = jax.lax.cond(jnp.any(batch["want_logprobs"]), with_logprobs, without_logprobs)
    return {"tokens": tokens, "token_logprob": tok_lp, "top_ids": top_ids, "top_logprobs": top_lp}


B, V, HISTORY = 8, 500, 12  # V not a multiple of 32: the grammar mask's last word is partial
KINDS = ("greedy", "greedy_logprobs", "sampled", "filtered", "penalties", "banned", "bias", "grammar",
         "sampled_logprobs", "mixed", "no_vocab_arrays", "no_vocab_sampled")


def _batch(kind: str, rng: np.random.Generator) -> dict[str, np.ndarray]:
    batch = empty_sampling_batch(B, HISTORY, None if kind.startswith("no_vocab") else V)
    batch["seeds"][:] = rng.integers(0, 2**32, B, dtype=np.uint32)
    batch["counters"][:] = rng.integers(0, 50, B)
    rows = rng.permutation(B)[: B // 2]  # the rows that use the feature; the others stay greedy
    if kind in ("greedy_logprobs", "sampled_logprobs", "mixed"):
        batch["want_logprobs"][rows[:2]] = True
    if kind in ("sampled", "filtered", "sampled_logprobs", "mixed", "no_vocab_arrays", "no_vocab_sampled"):
        batch["temperature"][rows] = rng.uniform(0.2, 1.5, len(rows))
    if kind in ("filtered", "mixed"):
        batch["top_k"][rows[0]] = rng.integers(1, 40)
        batch["top_p"][rows[1]] = rng.uniform(0.3, 0.95)
        batch["min_p"][rows[2]] = rng.uniform(0.01, 0.3)
        batch["top_k"][rows[3]], batch["top_p"][rows[3]] = 50, 0.8
    if kind in ("penalties", "mixed", "no_vocab_arrays"):
        batch["repetition_penalty"][rows[0]] = rng.uniform(1.1, 2.0)
        batch["presence_penalty"][rows[1]] = rng.uniform(-1.0, 1.5)
        batch["frequency_penalty"][rows[2]] = rng.uniform(-1.0, 1.5)
        for r in rows[:3]:
            n = rng.integers(1, HISTORY + 1)
            batch["history"][r, :n] = rng.integers(0, 30, n)  # few distinct ids: repeats count
            batch["n_prompt"][r] = rng.integers(0, n + 1)
    if kind in ("banned", "mixed", "no_vocab_arrays"):
        for r in rows[:2]:
            batch["banned"][r, :3] = rng.choice(V, 3, replace=False)
    if kind in ("bias", "mixed"):
        for r in rows[1:3]:
            batch["bias_ids"][r, :5] = rng.choice(V, 5, replace=False)
            batch["bias_values"][r, :5] = rng.uniform(-100, 100, 5)
    if kind in ("grammar", "mixed"):
        batch["allowed"][rows[2:]] = rng.integers(-2**31, 2**31, (len(rows) - 2, batch["allowed"].shape[1]),
                                                  dtype=np.int64).astype(np.int32)
    return batch


def _logits(rng: np.random.Generator, ties: bool) -> np.ndarray:
    x = (rng.standard_normal((B, V)) * 3).astype(np.float32)
    if ties:  # equal maxima: argmax and the stable sort must break them the same way
        x = np.round(x)
        x[0, rng.choice(V, 40, replace=False)] = -np.inf
    return x


def _assert_identical(got, want):
    assert got.keys() == want.keys()
    for k in want:
        g, w = np.asarray(got[k]), np.asarray(want[k])
        assert g.dtype == w.dtype and g.shape == w.shape, k
        np.testing.assert_array_equal(g.view(np.uint32), w.view(np.uint32), err_msg=k)  # bits, -0.0 and NaN too


@pytest.mark.parametrize("kind", KINDS)
def test_sample_matches_the_reference_bit_for_bit(kind):
    for seed in range(3):
        rng = np.random.default_rng([KINDS.index(kind), seed])
        logits = jnp.asarray(_logits(rng, ties=seed == 2))
        batch = {k: jnp.asarray(v) for k, v in _batch(kind, rng).items()}
        _assert_identical(sample(logits, batch), _reference_sample(logits, batch))


def test_sample_matches_the_reference_for_rows_from_params():
    rng = np.random.default_rng(7)
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.8, seed=3),
              SamplingParams(temperature=0.0, logprobs=5), SamplingParams(temperature=1.0, top_k=5, top_p=0.9),
              SamplingParams(temperature=0.0, min_tokens=4, stop_token_ids=[11, 12]),
              SamplingParams(temperature=0.0, logit_bias={3: 50.0, 4: -100.0}),
              SamplingParams(temperature=0.7, repetition_penalty=1.3, presence_penalty=0.5)]
    batch = empty_sampling_batch(B, HISTORY, V)
    for b, p in enumerate(params):
        fill_sampling_row(batch, b, SamplingRow(p, 100 + b, [1, 2, 3, 11], [3, 3], eos_token_id=2))
    logits = jnp.asarray(_logits(rng, ties=False))
    batch = {k: jnp.asarray(v) for k, v in batch.items()}
    _assert_identical(sample(logits, batch), _reference_sample(logits, batch))
    # Greedy rows alone: the greedy-only branch, still the reference's tokens (the argmax).
    greedy_batch = build_sampling_batch({b: SamplingRow(SamplingParams(temperature=0.0), b, [1], [], 2)
                                         for b in range(B)}, B, HISTORY)
    out = sample(logits, greedy_batch)
    _assert_identical(out, _reference_sample(logits, greedy_batch))
    assert np.asarray(out["tokens"]).tolist() == np.argmax(np.asarray(logits), -1).tolist()


# The decode shape the TPU profile showed the copies at (SmolLM2: V = 49152, 64 rows).
BIG_B, BIG_V = 64, 49152


def _greedy_args():
    batch = {k: jnp.asarray(v) for k, v in empty_sampling_batch(BIG_B, 16, BIG_V).items()}
    return jnp.zeros((BIG_B, BIG_V), jnp.float32), batch


def _conds_with_bv_outputs(fn, branch: int = 0) -> list:
    """Cond equations with a [B, V] output that a batch may run whose top-level conds take `branch`
    (0: every predicate false, an all-greedy batch; `sample`'s switch: 1, sampled or logprobs rows
    with no logit edit). Inside the branch taken every branch counts."""
    found = []

    def walk(jaxpr, top):
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == "cond":
                if any(getattr(o.aval, "shape", None) == (BIG_B, BIG_V) for o in eqn.outvars):
                    found.append(eqn)
                branches = eqn.params["branches"]
                for br in ([branches[min(branch, len(branches) - 1)]] if top else branches):
                    walk(br.jaxpr, top and branch == 0)
            else:
                for p in eqn.params.values():  # pjit / closed_call bodies
                    if isinstance(p, jax.extend.core.ClosedJaxpr):
                        walk(p.jaxpr, top)

    walk(jax.make_jaxpr(fn)(*_greedy_args()).jaxpr, True)
    return found


def _greedy_path_hlo_bv_ops(fn) -> list[str]:
    """In the CPU-compiled HLO: `copy` or `conditional` instructions producing f32[B, V] that an
    all-greedy batch runs (ENTRY, what it calls, and branch 0 of every conditional on the way).
    XLA:CPU shows the pass-through copy too (`(f32[B,V]) conditional` whose false branch copies)."""
    text = jax.jit(fn).lower(*_greedy_args()).compile().as_text()
    comps, name = {}, None
    for line in text.splitlines():
        m = re.match(r"(?:ENTRY )?%(\S+) \(.*\{$", line)
        if m:
            name = "ENTRY" if line.startswith("ENTRY") else m.group(1)
            comps[name] = []
        elif line == "}":
            name = None
        elif name is not None:
            comps[name].append(line)
    big = f"f32[{BIG_B},{BIG_V}]"
    found, seen, todo = [], set(), ["ENTRY"]
    while todo:
        c = todo.pop()
        if c in seen:
            continue
        seen.add(c)
        for line in comps[c]:
            m = re.search(r"= (\(.*?\)|\S+) (copy|conditional)\(", line)
            if m and big in m.group(1):
                found.append(line.strip())
            if " conditional(" in line:
                branches = re.search(r"branch_computations=\{%([^,}]+)", line) \
                    or re.search(r"false_computation=%([^,\s]+)", line)
                todo.append(branches.group(1))
            else:
                todo += re.findall(r"(?:calls|to_apply|body|condition)=%([^,\s}]+)", line)
    return found


def test_greedy_path_has_no_conditional_passing_the_logits_through():
    """XLA:TPU copies a conditional's pass-through [B, V] operand (three copies, ~0.26 ms of a 7.8 ms
    decode step before): an all-greedy batch must reach its argmax with no such conditional. The
    reference (the old sampler) shows them, so the checks do see what they look for."""
    assert _conds_with_bv_outputs(_reference_sample)
    assert not _conds_with_bv_outputs(sample)
    # Sampled or logprobs rows that edit no logit skip the [B, V] conds as well.
    assert not _conds_with_bv_outputs(sample, branch=1)
    assert _conds_with_bv_outputs(sample, branch=2)  # the logit edits: the old conds, still seen
    old = _greedy_path_hlo_bv_ops(_reference_sample)
    assert any(" conditional(" in op for op in old) and any(" copy(" in op for op in old), old
    assert _greedy_path_hlo_bv_ops(sample) == []


@pytest.mark.parametrize("seed", range(4))
def test_filter_mask_equals_the_sort_and_scatter(seed):
    """Top-k, top-p and min-p kept in vocabulary order without a scatter: the same tokens as the
    sorted prefix scattered back, with ties at the cut (rounded logits), -inf rows and all-kept rows."""
    rng = np.random.default_rng(seed)
    x = np.round(rng.standard_normal((32, 257)) * (2 if seed % 2 else 6)).astype(np.float32)
    x[0, :100] = -np.inf
    x[1] = 1.5  # every logit tied
    top_k = rng.choice([0, 1, 3, 40, 300], 32).astype(np.int32)
    top_p = rng.choice([1.0, 0.9, 0.5, 0.1], 32).astype(np.float32)
    min_p = rng.choice([0.0, 0.0, 0.05, 0.5], 32).astype(np.float32)
    got = np.asarray(jax.jit(_filter_mask)(x, top_k, top_p, min_p))
    want = np.asarray(jax.jit(_reference_filter_mask)(x, top_k, top_p, min_p))
    np.testing.assert_array_equal(got, want)
    assert got.sum(1).min() >= 1 and not got.all()  # every row keeps its best; some rows cut
