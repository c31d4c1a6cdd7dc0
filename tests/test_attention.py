"""Paged attention against its reference, at spans of many key chunks, and through the engine.

The engine's default max_model_len is 2048 and attention walks the keys `attn_chunk` positions
at a time (an online softmax across chunks), so spans here cross up to ~40 chunks, with several
chunk and block sizes, scattered block tables, grouped-query heads, prefill groups (Q > 1 with
causal masking inside the chunk) and fully padded rows. The reference itself is checked once
against a per-query NumPy loop; the engine runs a ~1,500-token prompt through chunked prefill
and decode against the one-request reference generator.
"""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import jax
import jax.numpy as jnp

from jlora.kernels.attention import paged_attention, paged_attention_reference

H, KVH, DH = 4, 2, 16


def heads(cache):  # [L, NB, bs, KVH*DH] -> [L, NB, bs, KVH, DH]: the cache's minor axis is the heads side by side
    return np.asarray(cache).reshape(cache.shape[:3] + (KVH, DH))


def numpy_attention(q, positions, tables, k, v, block_size):  # one query at a time, float64
    k, v = heads(k), heads(v)
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


def make_case(block_size: int, nq: int, max_len: int = 640, layers: int = 1, seed: int = 0):
    """Three sequences ending at max_len - 1, 300 and 37, scattered blocks, some padding."""
    rng = np.random.default_rng(seed)
    mb = max_len // block_size
    b = 3
    nb = b * mb + 5
    k = rng.standard_normal((layers, nb, block_size, KVH * DH)).astype(np.float32)
    v = rng.standard_normal((layers, nb, block_size, KVH * DH)).astype(np.float32)
    tables = rng.permutation(nb)[: b * mb].reshape(b, mb).astype(np.int32)
    ends = np.array([max_len - 1, 300, 37])  # the last query position of each sequence
    positions = np.stack([np.arange(e - nq + 1, e + 1) for e in ends]).astype(np.int32)
    positions[2, : nq // 2] = -1  # padding inside a group's row
    if nq > 1:
        positions[1, :] = -1  # and a fully padded sequence
    q = rng.standard_normal((b, nq, H, DH)).astype(np.float32)
    return q, k, v, positions, tables


def test_reference_matches_a_per_query_loop():
    q, k, v, positions, tables = make_case(16, 7, max_len=320, seed=1)
    got = paged_attention_reference(q, k, v, jnp.int32(0), positions, tables)
    np.testing.assert_allclose(np.asarray(got), numpy_attention(q, positions, tables, k, v, 16), atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("block_size,attn_chunk", [(16, 128), (8, 32), (16, 16), (4, 64), (32, 256), (16, 384)])
@pytest.mark.parametrize("nq", [1, 7])
def test_paged_attention_matches_reference_across_many_chunks(block_size, attn_chunk, nq):
    # 640 positions: 5 chunks of 128, 40 of 16, 2.5 of 256; layer 1 of a 2-layer cache.
    q, k, v, positions, tables = make_case(block_size, nq, layers=2, seed=block_size * 1000 + attn_chunk + nq)
    chunk = max(block_size, attn_chunk // block_size * block_size)
    got = paged_attention(q, k, v, jnp.int32(1), positions, tables, chunk=chunk)
    want = paged_attention_reference(q, k, v, jnp.int32(1), positions, tables)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-5, rtol=2e-5)
    assert not np.asarray(got)[positions < 0].any()  # padded queries read nothing
    assert np.abs(np.asarray(got)[positions >= 0]).sum(-1).min() > 0  # every real query read something


@pytest.mark.parametrize("window", [1, 37, 100, 300])
def test_sliding_window_matches_reference_and_a_numpy_loop(window):
    """Keys in (p - window, p]: kernel (which skips chunks before every query's window) against
    the reference, and the reference against the per-query loop restricted to the window."""
    q, k, v, positions, tables = make_case(16, 7, max_len=640, seed=window)
    w = jnp.int32(window)
    got = paged_attention(q, k, v, jnp.int32(0), positions, tables, w, chunk=32)
    want = paged_attention_reference(q, k, v, jnp.int32(0), positions, tables, w)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-5, rtol=2e-5)
    full = paged_attention_reference(q, k, v, jnp.int32(0), positions, tables)
    assert np.abs(np.asarray(want) - np.asarray(full)).max() > 1e-3  # the window changes the answer
    # The per-query loop over keys (p - window, p]: shift each query's keys by masking the older ones out.
    rows = np.asarray(positions)
    ref = np.zeros_like(np.asarray(want))
    for i in range(rows.shape[0]):
        for j in range(rows.shape[1]):
            pos = rows[i, j]
            if pos < 0:
                continue
            idx = np.arange(max(0, pos - window + 1), pos + 1)
            blocks = tables[i, idx // 16]
            keys, vals = heads(k)[0, blocks, idx % 16], heads(v)[0, blocks, idx % 16]
            for h in range(H):
                s_ = keys[:, h // (H // KVH)] @ q[i, j, h] / np.sqrt(DH)
                p_ = np.exp(s_ - s_.max())
                ref[i, j, h] = (p_ / p_.sum()) @ vals[:, h // (H // KVH)]
    np.testing.assert_allclose(np.asarray(want), ref, atol=2e-5, rtol=2e-5)
    with pytest.raises(ValueError, match="window must be None or an integer scalar"):
        paged_attention(q, k, v, jnp.int32(0), positions, tables, jnp.float32(3.0), chunk=32)


def test_bf16_bits_cache_reads_as_bf16():
    q, k, v, positions, tables = make_case(16, 3, max_len=384, seed=3)
    kb, vb = jnp.asarray(k, jnp.bfloat16), jnp.asarray(v, jnp.bfloat16)
    bits = [jax.lax.bitcast_convert_type(x, jnp.uint16) for x in (kb, vb)]
    got = paged_attention(q, *bits, jnp.int32(0), positions, tables, chunk=128)
    want = paged_attention_reference(q, kb, vb, jnp.int32(0), positions, tables)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-5, rtol=2e-5)


def test_all_padding_returns_zeros():
    q, k, v, positions, tables = make_case(16, 2, max_len=256)
    positions[:] = -1
    for out in (paged_attention(q, k, v, jnp.int32(0), positions, tables, chunk=128),
                paged_attention_reference(q, k, v, jnp.int32(0), positions, tables)):
        assert np.array_equal(np.asarray(out), np.zeros(q.shape, np.float32))


def _bad(case, **change):
    args = dict(zip(("q", "cache_k", "cache_v", "positions", "block_tables"), case), layer=jnp.int32(0))
    args.update(change)
    return args


@pytest.mark.parametrize("change,message", [
    (lambda c: dict(q=c[0][0]), r"q must be \[B, Q, H, Dh\], got shape \(2, 4, 16\)"),
    (lambda c: dict(q=c[0].astype(np.int32)), "q must be float32, bfloat16 or float16, got int32"),
    (lambda c: dict(q=c[0][..., :12]), r"KVH\*Dh=32, not a multiple of q .*'s Dh=12"),
    (lambda c: dict(q=c[0][:, :, :3]), "H=3 heads, not a multiple of cache_k's KVH=2"),
    (lambda c: dict(cache_k=c[1][0]), r"cache_k must be \[L, NB, bs, KVH\*Dh\], got shape"),
    (lambda c: dict(cache_k=c[1].astype(np.int32), cache_v=c[2].astype(np.int32)), "cache_k must be float32, "),
    (lambda c: dict(cache_v=c[2][:, :-1]), "cache_v float32.* must match cache_k"),
    (lambda c: dict(positions=c[3][:, :1]), r"positions must be int32\[B, Q\] = \[3, 2\]"),
    (lambda c: dict(positions=c[3].astype(np.float32)), "positions must be an integer array"),
    (lambda c: dict(block_tables=c[4][:2]), r"block_tables must be int32\[B, MB\] with B=3"),
    (lambda c: dict(block_tables=c[4][0]), r"block_tables must be \[B, MB\]"),
    (lambda c: dict(layer=jnp.zeros((1,), jnp.int32)), r"layer must be \[\], got shape \(1,\)"),
    (lambda c: dict(layer=jnp.float32(0)), "layer must be an integer array"),
])
def test_bad_inputs_name_the_argument(change, message):
    case = make_case(16, 2, max_len=256)
    args = _bad(case, **change(case))
    for fn, kw in ((paged_attention, dict(chunk=128)), (paged_attention_reference, {})):
        with pytest.raises(ValueError, match=message):
            fn(args["q"], args["cache_k"], args["cache_v"], args["layer"], args["positions"], args["block_tables"], **kw)


@pytest.mark.parametrize("chunk", [0, 24, 128.0, True])
def test_chunk_must_be_a_multiple_of_the_block_size(chunk):
    q, k, v, positions, tables = make_case(16, 2, max_len=256)
    with pytest.raises(ValueError, match="chunk must be a positive multiple of the block size 16"):
        paged_attention(q, k, v, jnp.int32(0), positions, tables, chunk=chunk)


# ---- the engine: a ~1,500-token prompt through chunked prefill ----------------------------------------


def test_long_prompt_through_the_engine_equals_reference(tiny_dir, tiny_adapters, tmp_path):
    """1,500 prompt tokens in 128-token prefill chunks (12 chunks, each reading up to 12 key chunks
    of 128 through a scattered block table), then decode past them; the reference runs the whole
    sequence as one block each token. Greedy, with and without an adapter."""
    from jlora import LLM, LoRARequest, SamplingParams
    from reference import ReferenceGenerator

    ckpt = tmp_path / "tiny_2048"
    shutil.copytree(tiny_dir[0], ckpt)
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg["max_position_embeddings"] = 2048  # the tiny model's weights do not depend on it
    (ckpt / "config.json").write_text(json.dumps(cfg))
    engine = dict(max_model_len=2048, max_num_seqs=2, max_num_batched_tokens=128, token_buckets=(128,),
                  max_loras=1, max_lora_rank=8, block_size=16, attn_chunk=128)
    llm = LLM(str(ckpt), progress=False, **engine)
    ref = ReferenceGenerator(llm.model, llm.tokenizer, engine["max_model_len"], llm.engine.eos_token_id,
                             engine["max_lora_rank"])
    prompt = np.random.default_rng(0).integers(0, 49152, 1500).tolist()
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    lora = LoRARequest("a0", 1, str(tiny_adapters[0]))
    outs = llm.generate([{"prompt_token_ids": prompt}] * 2, params, lora_request=[None, lora])
    for out, path in zip(outs, [None, str(tiny_adapters[0])]):
        exp = ref.generate(prompt, params, 0, path)[0]
        assert out.outputs[0].token_ids == exp.token_ids
        assert len(exp.token_ids) == 6
