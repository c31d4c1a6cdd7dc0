"""The fused projection + LoRA expand kernel (jlora.kernels.lora_matmul_tpu): interpret mode on the
CPU against its jnp reference and against the unfused XLA path (`quant.linear` + `lora_delta_laned`),
a lowering for TPU, and the tiny model through it (LORA_FUSED="interpret") against LORA_FUSED="off"."""

from __future__ import annotations

import dataclasses
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jlora.kernels.laned_dense import lora_delta_laned
from jlora.kernels.lora_matmul_tpu import (column_tile, depth_block, lora_matmul_reference, lora_matmul_tpu,
                                           split_shrink)
from jlora.models import quant

L, N, R = 3, 3, 8


def _case(d: int, splits: tuple[int, ...], t: int, dtype, seed: int = 0):
    o, s = sum(splits), len(splits)
    k = jax.random.split(jax.random.PRNGKey(seed), 5)
    x = jax.random.normal(k[0], (t, d), jnp.float32).astype(dtype)
    w = (jax.random.normal(k[1], (L, d, o), jnp.float32) * d ** -0.5).astype(dtype)
    a = (jax.random.normal(k[2], (L, N, d, s * R), jnp.float32) * d ** -0.5).astype(dtype)
    b = (jax.random.normal(k[3], (L, N, R, o), jnp.float32)).astype(dtype)
    ids = jax.random.randint(k[4], (t,), -1, N).at[:3].set(jnp.array([-1, 0, N - 1]))  # -1 and several slots
    return x, w, a, b, ids


CASES = [  # (D, splits, T): T is never a multiple of the 128-column tile
    (256, (384,), 96),  # not packed
    (256, (256, 256), 100),  # gate|up: equal splits
    (384, (256, 128, 128), 72),  # q|k|v: unequal splits
]


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("d,splits,t", CASES, ids=["plain", "equal", "unequal"])
def test_fused_kernel_matches_reference_and_unfused_path(d, splits, t, dtype):
    x, w, a, b, ids = _case(d, splits, t, dtype)
    sp = splits if len(splits) > 1 else None
    bflat = b.reshape(L, N * R, sum(splits))
    tol = dict(rtol=2e-2, atol=2e-2) if dtype == jnp.bfloat16 else dict(rtol=1e-5, atol=1e-4)
    for layer in (0, 2):  # the layer comes from the stack, not the first one
        h = split_shrink(x, a[layer], ids, len(splits), dtype=b.dtype)
        # block_d=128: D in several blocks (the f32 accumulator); block_o=128: several column tiles
        got = lora_matmul_tpu(x, w, jnp.int32(layer), h, bflat, splits=sp, block_d=128, block_o=128, interpret=True)
        whole = lora_matmul_tpu(x, w, jnp.int32(layer), h, bflat, splits=sp, interpret=True)  # default blocks
        ref = lora_matmul_reference(x, w, jnp.int32(layer), h, bflat, splits=sp)
        unfused = quant.linear(x, w[layer]) + lora_delta_laned(x, a[layer], b[layer], ids, splits=sp,
                                                                block_expand=False)
        assert got.dtype == x.dtype and got.shape == (t, sum(splits))
        f = partial(np.asarray, dtype=np.float32)
        np.testing.assert_allclose(f(got), f(ref), **tol)
        np.testing.assert_allclose(f(whole), f(ref), **tol)
        np.testing.assert_allclose(f(got), f(unfused), **tol)
        other = quant.linear(x, w[1 - layer // 2])  # a wrong layer's weight would be far off
        assert np.abs(f(got) - f(other)).max() > 0.5
    # a token without an adapter gets the base projection only
    np.testing.assert_allclose(f(got)[0], f(quant.linear(x, w[2]))[0], **tol)


def test_tiles():
    assert column_tile((2048, 512, 512)) == 512 and column_tile((8192, 8192)) == 512
    assert column_tile((256, 128, 128)) == 128 and column_tile((64, 32, 32)) is None
    assert depth_block(2048) == 2048 and depth_block(8192) == 2048 and depth_block(576) == 576


def test_bad_input_is_a_clear_value_error():
    x, w, a, b, ids = _case(256, (256, 128, 128), 80, jnp.float32)
    h = split_shrink(x, a[0], ids, 3)
    bflat = b.reshape(L, N * R, 512)
    call = partial(lora_matmul_tpu, interpret=True, splits=(256, 128, 128))
    with pytest.raises(ValueError, match="w \\[L, D, O\\] has D=128"):
        call(x, w[:, :128], jnp.int32(0), h, bflat)
    with pytest.raises(ValueError, match="h must be \\[S, T, N\\*R\\]"):
        call(x, w, jnp.int32(0), h[:2], bflat)
    with pytest.raises(ValueError, match="b must be \\[L, N\\*R, O\\]"):
        call(x, w, jnp.int32(0), h, bflat[:, :5])
    with pytest.raises(ValueError, match="splits .* must add up"):
        lora_matmul_tpu(x, w, jnp.int32(0), h, bflat, splits=(256, 128, 64), interpret=True)
    with pytest.raises(ValueError, match="block_o=256 must be a multiple of 128 dividing"):
        call(x, w, jnp.int32(0), h, bflat, block_o=256)  # does not divide k's 128 columns
    with pytest.raises(ValueError, match="block_d=96 must divide D=256"):
        call(x, w, jnp.int32(0), h, bflat, block_d=96)
    with pytest.raises(ValueError, match="block_t=48 must divide T=80"):
        call(x, w, jnp.int32(0), h, bflat, block_t=48)
    with pytest.raises(ValueError, match="share dtypes"):
        call(x.astype(jnp.bfloat16), w, jnp.int32(0), h, bflat)


@pytest.mark.parametrize("splits,d", [((2048, 512, 512), 2048), ((8192, 8192), 2048), ((2048,), 8192)],
                         ids=["qkv", "gate_up", "down"])
def test_lowers_for_tpu(splits, d):
    """The 1B shape's projections at a 1,088-token step lower to one Mosaic custom call each."""
    t, nr, s = 1088, 64, len(splits)
    spec = jax.ShapeDtypeStruct
    fn = jax.jit(partial(lora_matmul_tpu, splits=splits if s > 1 else None, interpret=False))
    exp = jax.export.export(fn, platforms=["tpu"])(
        spec((t, d), jnp.bfloat16), spec((16, d, sum(splits)), jnp.bfloat16), spec((), jnp.int32),
        spec((s, t, nr), jnp.bfloat16), spec((16, nr, sum(splits)), jnp.bfloat16))
    assert exp.platforms == ("tpu",)
    assert exp.mlir_module().count("tpu_custom_call") == 1


def test_tiny_model_through_the_fused_kernel_matches_the_unfused_path(monkeypatch):
    """A 128-lane-aligned tiny Llama (q|k|v = 256|128|128, gate|up = 256|256) at a 96-token step with
    mixed adapters: the fused kernel in interpret mode gives the unfused path's logits and greedy
    tokens, and a step without adapters is unchanged."""
    from jlora.models import Llama, LlamaConfig, init_cache, init_lora_state, llama

    cfg = dataclasses.replace(LlamaConfig.preset("tiny"), vocab_size=128, hidden_size=256, intermediate_size=256,
                              num_attention_heads=8, num_key_value_heads=4, head_dim=32)
    m = Llama(cfg, rngs=nnx.Rngs(0))
    rng = np.random.default_rng(5)
    lora = jax.tree.map(lambda z: jnp.asarray(rng.normal(size=z.shape) * 0.05, z.dtype),
                        init_lora_state(cfg, max_loras=3, max_rank=4))
    b, t = 2, 48  # 96 token rows > BATCHED_SHRINK_MAX_T
    toks = jnp.asarray(rng.integers(0, 128, size=(b, t)), jnp.int32)
    pos = jnp.tile(jnp.arange(t, dtype=jnp.int32), (b, 1)).at[1, 40:].set(-1)  # padding in row 1
    calls = []
    real = llama.lora_matmul_tpu
    monkeypatch.setattr(llama, "lora_matmul_tpu", lambda *a, **k: calls.append(k) or real(*a, **k))

    def logits(mode, seq_ids):
        monkeypatch.setattr(llama, "LORA_FUSED", mode)
        out, _ = m(toks, pos, init_cache(cfg, b, 64), lora, jnp.asarray(seq_ids, jnp.int32))
        return np.asarray(out)

    for seq_ids in ([0, 2], [-1, 1]):
        calls.clear()
        fused = logits("interpret", seq_ids)
        assert len(calls) == 4 and all(c["interpret"] for c in calls)  # every projection, once (one layer traced)
        off = logits("off", seq_ids)
        np.testing.assert_allclose(fused, off, rtol=1e-5, atol=1e-5)
        np.testing.assert_array_equal(fused.argmax(-1)[:, :40], off.argmax(-1)[:, :40])
    assert not np.allclose(fused[1], logits("off", [-1, -1])[1])  # the adapters are read
    np.testing.assert_allclose(logits("interpret", [-1, -1]), logits("off", [-1, -1]), rtol=1e-5, atol=1e-5)


def test_fused_path_is_off_on_the_cpu_by_default_and_skips_what_does_not_qualify(monkeypatch):
    from jlora.models import llama

    monkeypatch.setattr(llama, "LORA_FUSED", None)
    assert llama.lora_fused() == "off"
    monkeypatch.setattr(llama, "LORA_FUSED", "interpret")
    x, w, a, b, ids = _case(256, (256, 128, 128), 96, jnp.float32)
    pool = {"A": a, "B": b}
    run = partial(llama.fused_projection, stacked=w, pool=pool, layer=jnp.int32(1), lora_impl="auto")
    assert run(x, slot_ids=ids, splits=(256, 128, 128)) is not None
    assert run(x[:64], slot_ids=ids[:64], splits=(256, 128, 128)) is None  # decode-sized: the batched shrink
    assert run(x, slot_ids=ids, splits=(256, 192, 64)) is None  # no 128-column tile divides 192 and 64
    assert run(x, slot_ids=ids, splits=(256, 128, 128), lora_impl="grouped") is None
    assert run(x.astype(jnp.bfloat16), slot_ids=ids, splits=(256, 128, 128)) is None  # x and W dtypes differ
    monkeypatch.setattr(llama, "LORA_FUSED", "packed")  # q|k|v and gate|up only
    assert run(x, slot_ids=ids, splits=(256, 128, 128)) is not None
    assert run(x, slot_ids=ids, splits=None, pool={"A": a[:, :, :, :4], "B": b}) is None
    monkeypatch.setattr(llama, "LORA_FUSED", "sideways")
    with pytest.raises(ValueError, match="LORA_FUSED"):
        llama.lora_fused()
