"""The Pallas TPU paged-attention kernel against its reference, in interpret mode on the CPU.

`paged_attention_tpu` runs here with interpret=True (the same kernel body, DMAs and semaphores
emulated) and is lowered for platforms=["tpu"] with `jax.export`, as the LoRA kernels are; on a
TPU chip `scripts/tpu_check.py` runs it compiled (jlora bench tpu's kernel section too). Shapes
cover each lane-tile layout (`lane_tiles`): a whole KVH*Dh row per tile (Dh=16, SmolLM2's 3 x 64),
two heads per 128-lane tile (Dh=64), one head per tile (Dh=128), grouped-query heads, prefill
groups, padding, sliding windows, bfloat16 caches and a second layer of the cache.
"""

from __future__ import annotations

import base64
import re
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu

from jlora.kernels.attention import paged_attention_reference
from jlora.engine.runner import whole_cache_copies
from jlora.tuning import AttentionOptions
from jlora.kernels.paged_attention_tpu import (UNROLL_PAGES, VMEM_BUDGET, cache_lanes, compute_block, default_chunk,
                                               lane_tiles, paged_attention_tpu, prefill_sizes, query_block,
                                               vmem_estimate)

# The interpreted kernel costs seconds a call on 2 cores: `make test-fast` runs one case of each
# parametrized kernel test, `make test` every case.
SLOW = pytest.mark.slow


def make_case(h: int, kvh: int, dh: int, bs: int, nq: int, max_len: int = 384, layers: int = 2, seed: int = 0,
              dtype=np.float32):
    """Three sequences ending at max_len - 1, 200 and 37 (scattered blocks), with padding."""
    rng = np.random.default_rng(seed)
    mb, b = max_len // bs, 3
    nb = b * mb + 3
    k = rng.standard_normal((layers, nb, bs, kvh * dh)).astype(dtype)
    v = rng.standard_normal((layers, nb, bs, kvh * dh)).astype(dtype)
    tables = rng.permutation(nb)[: b * mb].reshape(b, mb).astype(np.int32)
    ends = np.array([max_len - 1, 200, 37])
    positions = np.stack([np.arange(e - nq + 1, e + 1) for e in ends]).astype(np.int32)
    positions[2, : nq // 2] = -1  # padding inside a row
    if nq > 1:
        positions[1, :] = -1  # a fully padded sequence
    q = rng.standard_normal((b, nq, h, dh)).astype(np.float32)
    return q, k, v, positions, tables


@pytest.mark.parametrize("h,kvh,dh,bs,chunk,nq", [
    (4, 2, 16, 16, 32, 1),     # tile = the whole 32-lane row
    pytest.param(4, 2, 64, 16, 64, 1, marks=SLOW),  # two heads per 128-lane tile, decode
    pytest.param(8, 2, 64, 16, 128, 5, marks=SLOW),  # two heads per tile, G=4, a prefill group
    pytest.param(4, 2, 128, 8, 32, 3, marks=SLOW),   # one head per tile
    (9, 3, 64, 16, 128, 2),    # SmolLM2's heads: 3 x 64 = 192 lanes, one tile
])
def test_kernel_matches_reference(h, kvh, dh, bs, chunk, nq):
    q, k, v, positions, tables = make_case(h, kvh, dh, bs, nq, seed=h * 100 + dh + nq)
    got = paged_attention_tpu(q, k, v, jnp.int32(1), positions, tables, chunk=chunk, interpret=True)
    want = paged_attention_reference(q, k, v, jnp.int32(1), positions, tables)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-5, rtol=2e-5)
    assert not np.asarray(got)[positions < 0].any()  # padded queries read nothing
    assert np.abs(np.asarray(got)[positions >= 0]).sum(-1).min() > 0


@pytest.mark.parametrize("h,kvh,dh,bs,chunk,nq", [
    (4, 2, 64, 16, 64, 1), pytest.param(8, 2, 64, 16, 128, 5, marks=SLOW),
    pytest.param(4, 2, 64, 8, 256, 1, marks=SLOW),  # 32 pages a chunk: past UNROLL_PAGES, the looped DMA issue
])
def test_pages_past_the_end_are_not_read(h, kvh, dh, bs, chunk, nq):
    """The kernel copies only the pages a sequence reaches; the rest of a chunk's buffer holds
    whatever was there (here: NaN, Pallas' interpreter filling uninitialized memory) and must not
    reach the output. The shortest sequence goes first, so its buffer was never written; a fully
    padded one sits between (the next program's first chunk is prefetched across it). The
    interpreter counts a DMA semaphore's bytes as the chip does, so a wait for more than was
    copied (a full chunk's single wait on a partial chunk) hangs here rather than passing."""
    assert (chunk // bs > UNROLL_PAGES) == (chunk == 256)
    q, k, v, positions, tables = make_case(h, kvh, dh, bs, nq, seed=5)
    q, positions, tables = q[::-1].copy(), positions[::-1].copy(), tables[::-1].copy()
    got = paged_attention_tpu(q, k, v, jnp.int32(1), positions, tables, chunk=chunk,
                              interpret=pltpu.InterpretParams(uninitialized_memory="nan"))
    want = paged_attention_reference(q, k, v, jnp.int32(1), positions, tables)
    assert not np.isnan(np.asarray(got)).any()
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("h,kvh,dh,bs,chunk,nq,sub", [
    # decode: 128-position steps of 8 pages, the last partly copied
    pytest.param(4, 2, 64, 16, 256, 1, None, marks=SLOW),
    pytest.param(4, 2, 64, 16, 256, 1, 16, marks=SLOW),    # a page a step
    (4, 2, 64, 32, 128, 1, 16),                            # half a page a step
    pytest.param(8, 2, 64, 16, 256, 3, 64, marks=SLOW),    # several queries, 4 pages a step
])
def test_compute_steps_skip_what_a_sequence_does_not_reach(h, kvh, dh, bs, chunk, nq, sub):
    """A program computes its chunk in `sub_block` steps and skips those past its sequence's last
    copied page (whose buffer rows hold NaN here: the first sequence's buffer was never written)."""
    q, k, v, positions, tables = make_case(h, kvh, dh, bs, nq, seed=11 + nq)
    q, positions, tables = q[::-1].copy(), positions[::-1].copy(), tables[::-1].copy()
    got = paged_attention_tpu(q, k, v, jnp.int32(1), positions, tables, chunk=chunk,
                              options=AttentionOptions(sub_block=sub),
                              interpret=pltpu.InterpretParams(uninitialized_memory="nan"))
    want = paged_attention_reference(q, k, v, jnp.int32(1), positions, tables)
    assert not np.isnan(np.asarray(got)).any()
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("step", [pytest.param(16, marks=SLOW), 32])
def test_prefill_programs_step_through_partial_chunks(step):
    """AttentionOptions.prefill_step: prefill programs (more than SMALL_PROGRAM_ROWS rows) compute a partial chunk in
    steps and skip those past their furthest query's page: a prompt from position 0 (its first
    query blocks reach one page of a 128-position chunk) and a later chunk of another prompt across
    a chunk boundary, against the reference; buffers never written hold NaN."""
    h, kvh, dh, bs, chunk, nq = 8, 2, 64, 16, 128, 96
    assert compute_block(chunk, bs, 8 * 16, step) == step and compute_block(chunk, bs, 8, step) == chunk  # decode
    # rule unchanged
    q, k, v, _, tables = make_case(h, kvh, dh, bs, nq, seed=31)
    positions = np.stack([np.arange(nq), np.arange(100, 100 + nq), np.full(nq, -1)]).astype(np.int32)
    positions[1, -5:] = -1  # padding after a short chunk
    got = paged_attention_tpu(q, k, v, jnp.int32(1), positions, tables, chunk=chunk,
                              options=AttentionOptions(prefill_step=step),
                              interpret=pltpu.InterpretParams(uninitialized_memory="nan"))
    want = paged_attention_reference(q, k, v, jnp.int32(1), positions, tables)
    assert not np.isnan(np.asarray(got)).any()
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("round_to,chunk", [pytest.param(16, 128, marks=SLOW), pytest.param(48, 128, marks=SLOW),
                                            (20, 64)])
def test_prefill_programs_compute_a_partial_chunk_as_one_smaller_block(round_to, chunk):
    """AttentionOptions.prefill_round: a prefill program computes a partial chunk as one block of the smallest
    multiple of `round_to` (whole pages: 20 -> 32) covering its copied pages; a size more than a
    page past the one below it reaches pages never copied (NaN here), which must be masked. A prompt
    from position 0, one across a chunk boundary with padding after it, and one all padding."""
    h, kvh, dh, bs, nq = 8, 2, 64, 16, 96
    step = bs * -(-round_to // bs)
    assert prefill_sizes(chunk, bs, 8 * 16, round_to) == tuple(range(step, chunk, step)) + (chunk,)
    assert prefill_sizes(chunk, bs, 8, round_to) == (chunk,)  # decode programs: unchanged
    assert prefill_sizes(chunk, bs, 8 * 16, None) == prefill_sizes(chunk, bs, 8 * 16, 0) == (chunk,)
    q, k, v, _, tables = make_case(h, kvh, dh, bs, nq, seed=37)
    positions = np.stack([np.arange(nq), np.arange(100, 100 + nq), np.full(nq, -1)]).astype(np.int32)
    positions[1, -5:] = -1
    want = paged_attention_reference(q, k, v, jnp.int32(1), positions, tables)
    nan = pltpu.InterpretParams(uninitialized_memory="nan")
    got = paged_attention_tpu(q, k, v, jnp.int32(1), positions, tables, chunk=chunk,
                              options=AttentionOptions(prefill_round=round_to), interpret=nan)
    assert not np.isnan(np.asarray(got)).any()
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-5, rtol=2e-5)
    got = paged_attention_tpu(q, k, v, jnp.int32(1), positions, tables, chunk=chunk, interpret=nan,
                              options=AttentionOptions(prefill_round=round_to, max_block_rows=128, trace_regions=True))
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-5, rtol=2e-5)  # 16 queries a program,
    # with trace regions (named scopes) in the kernel
    with pytest.raises(ValueError, match="max_block_rows must be an int >= 1"):
        AttentionOptions(max_block_rows=0)
    with pytest.raises(ValueError, match="prefill_round must be None or an int >= 0"):
        AttentionOptions(prefill_round=-16)


@pytest.mark.parametrize("seqs,nq", [pytest.param(2, 1, marks=SLOW), pytest.param(3, 1, marks=SLOW),
                                     pytest.param(6, 1, marks=SLOW), (4, 1), pytest.param(3, 2, marks=SLOW)])
def test_several_sequences_a_program(seqs, nq):
    """`seqs_per_program`: a program walks several sequences (the largest divisor of B up to it: 4
    -> 3 of 6), each its own chunks, the next one's first chunk in flight as across programs; a fully
    padded sequence among them. Uninitialized buffers hold NaN, as in the test above."""
    q, k, v, positions, tables = make_case(4, 2, 64, 16, nq, seed=21)
    q = np.concatenate([q, q[::-1]])
    positions = np.concatenate([positions, positions[::-1] - 5])
    positions[4] = -1  # a sequence with nothing to read
    tables = np.concatenate([tables, tables[::-1]])
    want = paged_attention_reference(q, k, v, jnp.int32(1), positions, tables)
    for sub in (None, 256):
        got = paged_attention_tpu(q, k, v, jnp.int32(1), positions, tables, chunk=256,
                                  options=AttentionOptions(sub_block=sub, seqs_per_program=seqs),
                                  interpret=pltpu.InterpretParams(uninitialized_memory="nan"))
        assert not np.isnan(np.asarray(got)).any()
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-5, rtol=2e-5)
    with pytest.raises(ValueError, match="seqs_per_program must be an int >= 1"):
        AttentionOptions(seqs_per_program=0)


def test_compute_block_rule_and_bad_sub_blocks():
    assert compute_block(1024, 128, 8) == 128 and compute_block(1024, 16, 4) == 128  # decode rows
    assert compute_block(1024, 256, 8) == 256 and compute_block(64, 16, 8) == 64  # a page; the whole chunk
    assert compute_block(1024, 128, 512) == 1024  # prefill rows take the chunk at once
    q, k, v, positions, tables = make_case(4, 2, 16, 16, 1)
    for bad in (24, 48):
        with pytest.raises(ValueError, match="sub_block must divide the chunk 64"):
            paged_attention_tpu(q, k, v, jnp.int32(0), positions, tables, chunk=64,
                                options=AttentionOptions(sub_block=bad), interpret=True)
    with pytest.raises(ValueError, match="sub_block must be None or an int >= 1"):
        AttentionOptions(sub_block=0)


@pytest.mark.parametrize("window", [pytest.param(1, marks=SLOW), 40, pytest.param(150, marks=SLOW)])
def test_sliding_window(window):
    q, k, v, positions, tables = make_case(8, 2, 64, 16, 3, seed=window)
    w = jnp.int32(window)
    got = paged_attention_tpu(q, k, v, jnp.int32(0), positions, tables, w, chunk=64, interpret=True)
    want = paged_attention_reference(q, k, v, jnp.int32(0), positions, tables, w)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-5, rtol=2e-5)
    full = paged_attention_reference(q, k, v, jnp.int32(0), positions, tables)
    assert np.abs(np.asarray(want) - np.asarray(full)).max() > 1e-3  # the window matters here


def test_bfloat16_cache():
    q, k, v, positions, tables = make_case(8, 2, 64, 16, 2, seed=7)
    kb, vb = jnp.asarray(k, jnp.bfloat16), jnp.asarray(v, jnp.bfloat16)
    got = paged_attention_tpu(q, kb, vb, jnp.int32(0), positions, tables, chunk=64, interpret=True)
    want = paged_attention_reference(q, kb, vb, jnp.int32(0), positions, tables)
    # q and the probabilities enter the MXU in bf16 (as on the chip): bf16-sized differences.
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=3e-2, rtol=3e-2)


def test_uint16_bits_cache_is_refused():
    q, k, v, positions, tables = make_case(4, 2, 16, 16, 1)
    bits = [jax.lax.bitcast_convert_type(jnp.asarray(x, jnp.bfloat16), jnp.uint16) for x in (k, v)]
    with pytest.raises(ValueError, match="uint16 .* XLA:CPU's storage"):
        paged_attention_tpu(q, *bits, jnp.int32(0), positions, tables, chunk=32, interpret=True)


def test_bad_arguments_are_named():
    q, k, v, positions, tables = make_case(4, 2, 16, 16, 1)
    with pytest.raises(ValueError, match="chunk must be a positive multiple of the block size 16"):
        paged_attention_tpu(q, k, v, jnp.int32(0), positions, tables, chunk=24, interpret=True)
    with pytest.raises(ValueError, match=r"positions must be int32\[B, Q\] = \[3, 1\]"):
        paged_attention_tpu(q, k, v, jnp.int32(0), np.zeros((3, 2), np.int32), tables, chunk=32, interpret=True)


def test_layouts():
    assert lane_tiles(8, 64) == (128, 2) and lane_tiles(8, 128) == (128, 1) and lane_tiles(3, 64) == (192, 3)
    assert lane_tiles(2, 16) == (32, 2) and lane_tiles(8, 256) == (256, 1)
    assert query_block(1, 8, 16) == 1 and query_block(512, 8, 16) == 64 and query_block(512, 9, 16) == 32
    assert query_block(7, 8, 16) == 7
    # VMEM: the shapes that compiled on a v5e keep their blocks; the two that ran out get smaller ones.
    assert query_block(256, 8, 16, chunk=512, kd=512) == 64  # 1B prefill: 512 rows, compiled
    assert query_block(512, 4, 16, chunk=512, kd=1024) == 64  # 8B prefill: 512 rows ran out; 256
    assert query_block(256, 8, 16, chunk=1024, kd=512) == 32  # 1B, 1,024-position chunks: 256 rows
    assert vmem_estimate(512, 512, 1024, 2) > VMEM_BUDGET >= vmem_estimate(256, 512, 1024, 2)
    assert query_block(1, 4, 16, chunk=4096, kd=1024) == 1  # one query always goes
    assert query_block(512, 4, 16, chunk=512, kd=1024, budget=2 * VMEM_BUDGET) == 128  # a raised limit: 512 rows
    assert query_block(256, 8, 16, chunk=1024, kd=512, max_rows=128) == 16  # a lower row cap


@pytest.mark.parametrize("shape", [(64, 1, 32, 8, 64, 16, 128), (1, 512, 32, 8, 64, 16, 128),
                                   (16, 1, 9, 3, 64, 16, 128), (4, 128, 32, 8, 128, 16, 256),
                                   (1, 512, 32, 8, 128, 16, 512),  # the 8B prefill chunk (its VMEM: query_block)
                                   (64, 1, 32, 8, 64, 128, 1024, 8),  # 8 sequences a program
                                   (1, 1024, 32, 8, 64, 128, 1024, 1, 128)])  # a prefill's partial chunk by size
def test_lowers_for_tpu(shape):
    """Mosaic lowering for the chip, without it (B, Q, H, KVH, Dh, bs, chunk[, sequences a program[,
    prefill_round]]; bf16 caches)."""
    b, nq, h, kvh, dh, bs, chunk, *more = shape
    seqs, round_to = (more + [1, None])[:2]
    spec = jax.ShapeDtypeStruct
    fn = jax.jit(partial(paged_attention_tpu, chunk=chunk, interpret=False,
                         options=AttentionOptions(seqs_per_program=seqs, prefill_round=round_to)))
    exp = jax.export.export(fn, platforms=["tpu"])(
        spec((b, nq, h, dh), jnp.bfloat16), spec((16, 2048, bs, kvh * dh), jnp.bfloat16),
        spec((16, 2048, bs, kvh * dh), jnp.bfloat16), spec((), jnp.int32), spec((b, nq), jnp.int32),
        spec((b, 128), jnp.int32), spec((), jnp.int32))
    assert "tpu_custom_call" in exp.mlir_module()


@pytest.mark.slow  # the interpreted kernel inside every step graph: ~100 s
def test_engine_with_the_kernel_equals_the_xla_loop(tiny_dir, tiny_adapters):
    """The whole serving step with attn_impl="pallas" (interpreted here) against attn_impl="xla":
    the same greedy tokens for mixed adapters, prefill chunks and decode. Refusals named."""
    from jlora import LLM, LoRARequest, SamplingParams

    engine = dict(max_model_len=256, max_num_seqs=2, max_num_batched_tokens=32, token_buckets=(32,),
                  max_loras=2, max_lora_rank=8, progress=False)
    prompts = [{"prompt_token_ids": list(range(5 + 17 * i, 45 + 23 * i))} for i in range(3)]
    loras = [None, LoRARequest("a0", 1, str(tiny_adapters[0])), LoRARequest("a1", 2, str(tiny_adapters[1]))]
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    outs = {}
    for impl in ("xla", "pallas"):
        llm = LLM(str(tiny_dir[0]), attn_impl=impl, **engine)
        assert llm.engine.runner.attn_impl == impl
        # attn_chunk=None: the kernel's default_chunk (a 64-lane f32 row here: 1,024), the XLA loop's 128
        assert llm.engine.runner.attn_chunk == (1024 if impl == "pallas" else 128)
        outs[impl] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, lora_request=loras)]
        runner = llm.engine.runner
        assert len(runner._executables) == llm.config.num_step_graphs
        if impl == "xla":  # XLA:CPU's layouts: no re-laid-out cache either. (Interpreted Pallas copies its
            # HBM operands by construction; the compiled kernel's step on a v5e had none: docs/tpu.md.)
            for exe in runner._executables.values():
                assert whole_cache_copies(exe.as_text(), runner.cache["k"].shape) == []
        del llm
    assert outs["pallas"] == outs["xla"] and all(len(t) == 5 for t in outs["xla"])
    with pytest.raises(ValueError, match="attn_impl must be one of"):
        LLM(str(tiny_dir[0]), attn_impl="flash", **engine)
    with pytest.raises(ValueError, match="attn_impl='pallas' needs one device and a float KV cache"):
        LLM(str(tiny_dir[0]), attn_impl="pallas", dtype="bfloat16", **engine)


@pytest.mark.parametrize("h,kvh,dh,nq", [pytest.param(9, 3, 64, 1, marks=SLOW), (9, 3, 64, 4),
                                         pytest.param(4, 2, 16, 1, marks=SLOW)])
def test_padded_cache_rows_read_as_the_unpadded(h, kvh, dh, nq):
    """A cache row widened to whole 128-lane tiles (`cache_lanes`: SmolLM2's 192 lanes -> 256, the
    tiny model's 32 -> 128): the kernel told the real KV heads reads what it reads from the
    unpadded cache. The pad lanes hold large values: a real head reading them would show."""
    q, k, v, positions, tables = make_case(h, kvh, dh, 16, nq, seed=7 + nq)
    lanes = cache_lanes(kvh, dh)
    assert lanes == -(-kvh * dh // 128) * 128
    junk = np.random.default_rng(1).uniform(50, 100, (lanes,)).astype(np.float32)
    pad = lambda c: np.concatenate([c, np.broadcast_to(junk[c.shape[-1]:], c.shape[:-1] + (lanes - c.shape[-1],))], -1)
    got = paged_attention_tpu(q, pad(k), pad(v), jnp.int32(1), positions, tables, chunk=64, interpret=True,
                              kv_heads=kvh)
    want = paged_attention_reference(q, k, v, jnp.int32(1), positions, tables)
    assert got.shape == q.shape
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-5, rtol=2e-5)
    with pytest.raises(ValueError, match="does not fit a cache row"):
        paged_attention_tpu(q, pad(k), pad(v), jnp.int32(1), positions, tables, chunk=64, interpret=True,
                            kv_heads=lanes // dh + 1)


def test_cache_lanes_round_up_to_whole_tiles_only_where_heads_fit():
    assert [cache_lanes(kvh, dh) for kvh, dh in ((8, 64), (3, 64), (2, 16), (8, 128), (3, 96), (1, 64))] == [
        512, 256, 128, 1024, 288, 128]


def test_whole_cache_copy_detector():
    """What a v5e profile of the old [L, NB, bs, KVH, Dh] step showed (XLA:TPU's HLO text) is found;
    a copy of one layer, a dynamic-update-slice of the cache and other shapes are not."""
    shape = (16, 4416, 16, 512)
    hlo = "\n".join([
        "  %copy.12 = bf16[16,4416,16,512]{1,3,2,0:T(8,128)(2,1)} copy(bf16[16,4416,16,512]{3,2,1,0} %p.3)",
        "  %copy_fusion.1 = bf16[16,4416,16,512]{3,2,1,0:T(8,128)(2,1)} fusion(%a), kind=kLoop, calls=%c",
        "  %transpose.2 = f32[16,4416,16,512]{3,2,1,0} transpose(f32[16,4416,512,16]{3,2,1,0} %x), dimensions={0,1,3,2}",
        "  %copy.13 = bf16[4416,16,512]{2,1,0} copy(bf16[4416,16,512]{2,1,0} %layer)",
        "  %dus = bf16[16,4416,16,512]{3,2,1,0} dynamic-update-slice(%cache, %row, %i, %j, %k, %l)",
        "  %copy.14 = bf16[16,4416,16,256]{3,2,1,0} copy(%other)",
    ])
    found = whole_cache_copies(hlo, shape)
    assert [f.split(" = ")[0] for f in found] == ["%copy.12", "%copy_fusion.1", "%transpose.2"]


def test_cli_flags_reach_llm(cli_llm_kwargs):
    """--attn-impl, --async-scheduling and --block-size from `jlora generate` and `jlora serve` to LLM(...)."""
    from jlora import cli

    generate, serve = cli_llm_kwargs
    seen = generate(["--attn-impl", "xla", "--async-scheduling", "--block-size", "32"])
    assert seen["attn_impl"] == "xla" and seen["async_scheduling"] is True and seen["block_size"] == 32
    seen = generate([])
    assert seen["attn_impl"] == "auto" and seen["async_scheduling"] is None and seen.get("block_size") is None
    kw = serve(["--attn-impl", "pallas", "--async-scheduling", "--block-size", "64"])
    assert kw["attn_impl"] == "pallas" and kw["async_scheduling"] is True and kw["block_size"] == 64
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["generate", "hi", "--attn-impl", "flash"])


def test_experiment_knobs_reach_mosaic():
    """`vmem_limit` and `bounds_checks` (jlora bench tpu --kernel-variants ...+vmemN+nobc) land in
    the lowered custom call's config for the chip; the defaults add neither."""
    spec = jax.ShapeDtypeStruct
    args = (spec((4, 1, 32, 64), jnp.bfloat16), spec((2, 64, 128, 512), jnp.bfloat16),
            spec((2, 64, 128, 512), jnp.bfloat16), spec((), jnp.int32), spec((4, 1), jnp.int32),
            spec((4, 16), jnp.int32), spec((), jnp.int32))

    def lowered(**kw) -> str:
        fn = jax.jit(partial(paged_attention_tpu, chunk=256, interpret=False, options=AttentionOptions(**kw)))
        return jax.export.export(fn, platforms=["tpu"])(*args).mlir_module()

    plain, knobs = lowered(), lowered(vmem_limit=64 * 2**20, bounds_checks=False)
    assert "disable_bounds_checks" not in plain and "scoped_memory_configs" not in plain
    assert "disable_bounds_checks" in knobs and "scoped_memory_configs" in knobs

    def kernel_body(text: str) -> bytes:  # the Mosaic module, serialized in the custom call's config
        return base64.b64decode(re.search(r'\\22body\\22: \\22([A-Za-z0-9+/=]+)\\22', text).group(1))

    # trace_regions: named scopes become Mosaic trace regions (for a profile); none by default.
    regions = kernel_body(lowered(trace_regions=True))
    assert all(name in regions for name in (b"tpu.trace_start", b"scores", b"softmax", b"values", b"wait"))
    assert b"tpu.trace_start" not in kernel_body(plain)


def test_kernel_variant_specs_parse_and_bad_ones_are_named():
    import argparse

    from jlora.bench.tpu.micro import parse_kernel_variants

    assert parse_kernel_variants("16x256,128x1024+nobc+vmem64,128x1024+sub1024+seqs8,128x1024+round256") == [
        (16, 256, {}), (128, 1024, {"bounds_checks": False, "vmem_limit": 64 * 2**20}),
        (128, 1024, {"sub_block": 1024, "seqs_per_program": 8}), (128, 1024, {"prefill_round": 256})]
    assert parse_kernel_variants("128x1024+rows128+regions") == [(128, 1024, {"max_block_rows": 128,
                                                                                 "trace_regions": True})]
    assert parse_kernel_variants("") == []
    from jlora.bench.tpu.cli import parse_args
    from jlora.bench.tpu.micro import KERNEL_VARIANT_CASES, parse_kernel_cases

    assert parse_kernel_cases("1x1024x1024,64x256x1") == ((1, 1024, 1024), (64, 256, 1))
    assert parse_args([]).kernel_cases == KERNEL_VARIANT_CASES
    assert parse_args(["--kernel-impls=", "--kernel-cases", "1x1024x256"]).kernel_impls == ()
    for bad in ("1x1024", "1x256x512", "0x64x1", "ax1x1"):
        with pytest.raises(argparse.ArgumentTypeError, match="ROWSxCONTEXTxQUERIES|queries"):
            parse_kernel_cases(bad)
    for bad in ("128", "128x1024+fast", "axb", "128x1024+vmem", "128x1024+subx", "128x1024+seqs",
                "128x1024+round"):
        with pytest.raises(argparse.ArgumentTypeError, match="BSxCHUNK"):
            parse_kernel_variants(bad)


def test_default_chunk_keeps_a_chunks_buffers_within_4_mib():
    """1,024 positions for the 1B shape's bf16 rows (8 KV heads x 64: 1 KB), 512 for the 8B's
    (8 x 128: 2 KB) and for float32 rows of 1B's width."""
    assert default_chunk(8 * 64, 2) == 1024
    assert default_chunk(8 * 128, 2) == 512 and default_chunk(8 * 64, 4) == 512
    assert default_chunk(3 * 64, 2) == 1024  # SmolLM2's 3 KV heads
