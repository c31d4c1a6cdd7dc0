"""LoRA on the token embedding and the output head, per row, in a mixed batch.

An engine with `EngineConfig.enable_embedding_lora` holds two more entries in its LoRA state
(`init_lora_state` with VOCAB_MODULES), one "layer" each, PEFT scale folded into B as elsewhere:

    lora_state["embed_tokens"] = {"A": [1, N, V, R], "B": [1, N, R, D]}   # A row t: token t's shrink
    lora_state["lm_head"]      = {"A": [1, N, D, R], "B": [1, N, R, V]}

peft's `Embedding` adds scale * lora_embedding_A[:, t] @ lora_embedding_B^T to token t's row, so the
embedding delta is a gather of A rows by token id (no [V] one-hot), times B. The head is a plain
LoRA linear on the normed hidden state: x A B over the vocabulary. A slot whose adapter has neither
holds zeros, so a row reads an exact zero delta; the step skips each part with a conditional when
no row of the step needs it (the host sets `vocab_lora`), so a plain batch pays two predicates.

Each token weighs every slot (`slot_weights`): its own slot at its request's scale, or a
combination's weights (MIX_SLOT rows), the same per-token weights the linear modules' kernels read;
the math here is its own (gather + dense matmul), whatever `lora_impl` is.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from jlora.kernels.common import MIX_SLOT
from jlora.models import quant



def pools_of(lora_state: Any, module: str) -> tuple[dict[str, jax.Array], ...]:
    """`module`'s {"A", "B"} of each slot pool, in slot order; () when the state does not hold it."""
    if not lora_state:
        return ()
    pools = lora_state if isinstance(lora_state, tuple) else (lora_state,)
    return tuple(p[module] for p in pools) if module in pools[0] else ()


def slot_weights(
    slot_ids: jax.Array,  # i32[T]: a slot, -1 (none) or MIX_SLOT
    first: int, n: int,  # this pool's slots: [first, first + n)
    scale: jax.Array | None,  # f32[T]: a token's LoRA scale (None = 1)
    mix: jax.Array | None,  # f32[T, N_all]: MIX_SLOT tokens' weight of every slot
) -> jax.Array:  # f32[T, n]
    """How much of each of the pool's slots every token reads."""
    w = (slot_ids[:, None] == first + jnp.arange(n, dtype=slot_ids.dtype)).astype(jnp.float32)
    if scale is not None:
        w = w * scale.astype(jnp.float32)[:, None]
    if mix is not None:
        w = w + jnp.where((slot_ids == MIX_SLOT)[:, None], mix[:, first:first + n].astype(jnp.float32), 0.0)
    return w


def embed_delta(
    pools: tuple[dict[str, jax.Array], ...],  # embed_tokens: {"A": [1, n, V, R], "B": [1, n, R, D]} per pool
    tokens: jax.Array,  # i32[T]
    slot_ids: jax.Array,  # i32[T]
    scale: jax.Array | None = None,  # f32[T]
    mix: jax.Array | None = None,  # f32[T, N]
) -> jax.Array:  # f32[T, D]
    """sum over slots s of w[t, s] * A_s[token t] @ B_s: peft's Embedding LoRA, per row."""
    out, first = None, 0
    for p in pools:
        a, b = p["A"][0], p["B"][0]  # [n, V, R], [n, R, D]
        n, _, r = a.shape
        w = slot_weights(slot_ids, first, n, scale, mix)  # [T, n]
        rows = quant.widen(jnp.take(a, tokens, axis=1)).astype(jnp.float32)  # [n, T, R]: A rows of the tokens
        h = (jnp.swapaxes(rows, 0, 1) * w[:, :, None]).reshape(tokens.shape[0], n * r)
        d = jnp.dot(h, quant.widen(b).astype(jnp.float32).reshape(n * r, -1))
        out = d if out is None else out + d
        first += n
    return out


def head_delta(
    pools: tuple[dict[str, jax.Array], ...],  # lm_head: {"A": [1, n, D, R], "B": [1, n, R, V]} per pool
    x: jax.Array,  # [S, D]: the normed hidden states the head reads
    slot_ids: jax.Array,  # i32[S]
    scale: jax.Array | None = None,  # f32[S]
    mix: jax.Array | None = None,  # f32[S, N]
) -> jax.Array:  # f32[S, V]
    """sum over slots s of w[t, s] * x_t A_s B_s: peft's Linear LoRA on lm_head, per row."""
    out, first = None, 0
    xf = x.astype(jnp.float32)
    for p in pools:
        a, b = p["A"][0], p["B"][0]  # [n, D, R], [n, R, V]
        n, _, r = a.shape
        w = slot_weights(slot_ids, first, n, scale, mix)
        h = jnp.einsum("sd,ndr->snr", xf, quant.widen(a).astype(jnp.float32)) * w[:, :, None]
        d = jnp.dot(h.reshape(x.shape[0], n * r), quant.widen(b).astype(jnp.float32).reshape(n * r, -1))
        out = d if out is None else out + d
        first += n
    return out


def add_embed_delta(x: jax.Array, lora_state: Any, tokens: jax.Array, slot_ids: jax.Array,
                    scale: jax.Array | None, mix: jax.Array | None, enabled: jax.Array | None) -> jax.Array:
    """x [T, D] (the looked-up rows) plus each token's embedding delta; `enabled` (bool scalar)
    False skips it (no token's adapter has one), None computes it."""
    pools = pools_of(lora_state, "embed_tokens")
    if not pools:
        return x

    def add() -> jax.Array:
        return (x.astype(jnp.float32) + embed_delta(pools, tokens, slot_ids, scale, mix)).astype(x.dtype)

    return add() if enabled is None else jax.lax.cond(enabled, add, lambda: x)


def add_head_delta(logits: jax.Array, normed: jax.Array, lora_state: Any, slot_ids: jax.Array,
                   scale: jax.Array | None, mix: jax.Array | None, enabled: jax.Array | None) -> jax.Array:
    """logits f32[S, V] plus each row's head delta from `normed` [S, D]; `enabled` as in `add_embed_delta`."""
    pools = pools_of(lora_state, "lm_head")
    if not pools:
        return logits

    def add() -> jax.Array:
        return logits + head_delta(pools, normed, slot_ids, scale, mix)

    return add() if enabled is None else jax.lax.cond(enabled, add, lambda: logits)
