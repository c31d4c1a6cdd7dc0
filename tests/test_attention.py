"""Paged attention against a plain NumPy reference, at spans of many key chunks.

The engine's default max_model_len is 2048 and attention walks the keys `attn_chunk` positions
at a time (an online softmax across chunks), so spans here cross up to ~40 chunks, with several
chunk and block sizes, scattered block tables, grouped-query heads, prefill groups (Q > 1 with
causal masking inside the chunk) and fully padded rows.
"""

from __future__ import annotations

import numpy as np
import pytest
import jax
import jax.numpy as jnp

from jlora.models.llama import AttnGroup, paged_attention

H, KVH, DH = 4, 2, 16


def reference(q, positions, tables, k, v, block_size):  # plain causal GQA over each sequence's keys
    b, nq = positions.shape
    out = np.zeros((b, nq, H, DH), np.float64)
    for i in range(b):
        for j in range(nq):
            pos = positions[i, j]
            if pos < 0:
                continue
            idx = np.arange(pos + 1)
            blocks = tables[i, idx // block_size]
            keys = k[0, blocks, idx % block_size].astype(np.float64)  # [S, KVH, DH]
            vals = v[0, blocks, idx % block_size].astype(np.float64)
            for h in range(H):
                kv = h // (H // KVH)
                s = keys[:, kv] @ q[i, j, h].astype(np.float64) / np.sqrt(DH)
                p = np.exp(s - s.max())
                out[i, j, h] = (p / p.sum()) @ vals[:, kv]
    return out


@pytest.mark.parametrize("block_size,attn_chunk", [(16, 128), (8, 32), (16, 16), (4, 64)])
@pytest.mark.parametrize("nq", [1, 7])
def test_paged_attention_matches_reference_across_many_chunks(block_size, attn_chunk, nq):
    rng = np.random.default_rng(block_size * 1000 + attn_chunk + nq)
    max_len = 640
    mb = max_len // block_size
    b = 3
    nb = b * mb + 5
    k = rng.standard_normal((1, nb, block_size, KVH, DH)).astype(np.float32)
    v = rng.standard_normal((1, nb, block_size, KVH, DH)).astype(np.float32)
    tables = rng.permutation(nb)[: b * mb].reshape(b, mb).astype(np.int32)  # scattered blocks
    ends = np.array([max_len - 1, 300, 37])  # the last query position of each sequence
    positions = np.stack([np.arange(e - nq + 1, e + 1) for e in ends]).astype(np.int32)
    positions[2, : nq // 2] = -1  # padding inside a group's row
    if nq > 1:
        positions[1, :] = -1  # and a fully padded sequence
    q = rng.standard_normal((b, nq, H, DH)).astype(np.float32)
    chunk = max(block_size, attn_chunk // block_size * block_size)
    got = jax.jit(paged_attention, static_argnames="chunk")(
        jnp.asarray(q), AttnGroup(jnp.asarray(positions), jnp.asarray(tables)), jnp.asarray(k), jnp.asarray(v),
        jnp.int32(0), chunk=chunk)
    want = reference(q, positions, tables, k, v, block_size)
    np.testing.assert_allclose(np.asarray(got), want, atol=2e-5, rtol=2e-5)
    assert not np.asarray(got)[positions < 0].any()  # padded queries read nothing
