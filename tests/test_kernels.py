"""Every LoRA kernel against the `gather` reference, plus lowering, recompilation and input checks.

Pallas kernels run with interpret=True on this CPU host, and are lowered for their real targets
with `jax.export` (platforms=["tpu"] / ["cuda"]) without the hardware.
"""

from __future__ import annotations

import itertools
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jlora.kernels import (
    CHOICES,
    choose_impl,
    lora_delta,
    lora_delta_gather,
    lora_delta_grouped,
    lora_delta_laned,
    lora_delta_pallas,
    lora_delta_pallas_gpu,
    lora_delta_pallas_tpu,
)
from jlora.kernels.pallas_gpu import TRITON_CUSTOM_CALL

D, O = 200, 72  # neither a multiple of 128
TOL = {jnp.float32: 2e-5, jnp.bfloat16: 3e-2}  # max |y - ref| / max |ref|

XLA_IMPLS = {
    "laned": lora_delta_laned,
    "grouped": lora_delta_grouped,
    "grouped_ragged": partial(lora_delta_grouped, method="ragged"),
}
PALLAS_IMPLS = {
    "pallas_tpu": partial(lora_delta_pallas_tpu, interpret=True),
    "pallas_gpu": partial(lora_delta_pallas_gpu, interpret=True),
}
ALL_IMPLS = {**XLA_IMPLS, "auto": lora_delta, **PALLAS_IMPLS}
F32, BF16 = jnp.float32, jnp.bfloat16

# A covering design rather than the full product (every compile costs ~0.3-2 s on 2 cores):
# every T meets both dtypes and several N and R, every N in {1, 4, 16} and R in {4, 8, 16, 64}
# meets several T; T=1000 runs for a subset.
XLA_GRID = [
    (1, 1, 4, F32), (1, 4, 64, BF16), (1, 16, 8, F32), (1, 16, 16, BF16),
    (7, 4, 4, BF16), (7, 16, 64, F32), (7, 1, 8, BF16), (7, 4, 16, F32),
    (128, 16, 4, F32), (128, 1, 64, BF16), (128, 4, 8, BF16), (128, 16, 16, F32),
    (1000, 16, 16, F32), (1000, 4, 64, BF16),
]  # fmt: skip
PALLAS_GRID = [(1, 1, 4, F32), (7, 16, 64, BF16), (128, 4, 8, BF16), (128, 16, 16, F32), (1000, 16, 64, F32)]


def _id(case):
    t, n, r, dtype = case
    return f"T{t}-N{n}-R{r}-{jnp.dtype(dtype).name}"


def make(t, n, r, dtype, *, d=D, o=O, seed=0, slots=None):
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal((t, d)), dtype)
    a = jnp.asarray(rng.standard_normal((n, d, r)) / np.sqrt(d), dtype)
    b = jnp.asarray(rng.standard_normal((n, r, o)) / np.sqrt(r), dtype)
    s = rng.integers(-1, n, t) if slots is None else np.broadcast_to(slots, (t,))
    return x, a, b, jnp.asarray(s, jnp.int32)


def check(fn, args, dtype):
    y = fn(*args)
    ref = lora_delta_gather(*args)
    assert y.shape == ref.shape and y.dtype == args[0].dtype
    y, ref = np.asarray(y, np.float32), np.asarray(ref, np.float32)
    err = np.max(np.abs(y - ref)) / max(np.max(np.abs(ref)), 1e-6)
    assert err <= TOL[dtype], f"relative error {err:.2e} > {TOL[dtype]:.0e}"
    return y


@pytest.mark.parametrize("case", XLA_GRID, ids=_id)
@pytest.mark.parametrize("impl", list(XLA_IMPLS))
def test_xla_impls_match_gather(impl, case):
    t, n, r, dtype = case
    check(XLA_IMPLS[impl], make(t, n, r, dtype), dtype)


@pytest.mark.parametrize("case", XLA_GRID[1::4], ids=_id)
def test_auto_matches_gather(case):
    t, n, r, dtype = case
    check(lora_delta, make(t, n, r, dtype), dtype)


@pytest.mark.parametrize("case", PALLAS_GRID, ids=_id)
@pytest.mark.parametrize("impl", list(PALLAS_IMPLS))
def test_pallas_match_gather(impl, case):
    t, n, r, dtype = case
    check(PALLAS_IMPLS[impl], make(t, n, r, dtype), dtype)


@pytest.mark.parametrize("impl", list(ALL_IMPLS))
@pytest.mark.parametrize("kind", ["same_slot", "all_none", "out_of_range"])
def test_special_batches(impl, kind):
    t, n, r = 16, 4, 8
    slots = {"same_slot": 2, "all_none": -1, "out_of_range": np.array([-1, 4, 5, -7] * 4)}[kind]
    y = check(ALL_IMPLS[impl], make(t, n, r, jnp.float32, slots=slots), jnp.float32)
    if kind != "same_slot":
        assert not np.any(y), "ids outside [0, N) must give exactly zero"


# ---- packed modules (q/k/v, gate/up as one call) ------------------------------------------------

PACKED_IMPLS = {
    "gather": lora_delta_gather, **XLA_IMPLS, "auto": lora_delta,
    # laned's TPU expand for T > 64: one block-diagonal matmul (laned_dense.block_diagonal)
    "laned_block": partial(lora_delta_laned, block_expand=True),
    "pallas_tpu": partial(lora_delta_pallas, target="tpu", interpret=True),
    "pallas_gpu": partial(lora_delta_pallas, target="gpu", interpret=True),
}


_PACKED_CASES = [(1, 4, 8, F32), (7, 16, 4, BF16), (128, 4, 16, F32), (1000, 4, 8, F32)]


@pytest.mark.parametrize("impl,case", [(impl, case) for impl in PACKED_IMPLS for case in _PACKED_CASES
                                       # Pallas in interpret mode is slow at long T; its split logic is shape-independent.
                                       if not (impl.startswith("pallas") and case[0] > 128)],
                         ids=lambda v: v if isinstance(v, str) else _id(v))
@pytest.mark.parametrize("splits", [(72, 24, 24), (96, 96)], ids=["qkv", "gate_up"])
def test_packed_splits_match_one_call_per_sub_module(impl, splits, case):
    """a [N, D, S*R] (sub-module s in lanes s*R..), b [N, R, sum(splits)] (its own columns): each
    sub-module's columns equal the gather reference run on that sub-module alone."""
    t, n, r, dtype = case
    x, a, b, s = make(t, n, len(splits) * r, dtype, o=sum(splits), seed=3)
    b = b[:, :r]
    start, want = 0, []
    for k, w in enumerate(splits):
        want.append(lora_delta_gather(x, a[:, :, k * r:(k + 1) * r], b[:, :, start:start + w], s))
        start += w
    want = np.concatenate([np.asarray(y, np.float32) for y in want], axis=1)
    got = PACKED_IMPLS[impl](x, a, b, s, splits=splits)
    assert got.shape == want.shape and got.dtype == x.dtype
    err = np.max(np.abs(np.asarray(got, np.float32) - want)) / max(np.max(np.abs(want)), 1e-6)
    assert err <= TOL[dtype], f"relative error {err:.2e} > {TOL[dtype]:.0e}"


@pytest.mark.parametrize("impl", list(PACKED_IMPLS))
@pytest.mark.parametrize("shards", [2, 3])
def test_packed_splits_shard_major(impl, shards):
    """Tensor-parallel layout: b's columns are `shards` blocks, each holding its part of every
    sub-module (widths `splits`); sub-module s of shard j equals the gather reference on s's lanes
    and those columns alone."""
    splits, r = (16, 8, 8), 4
    t = 100 if impl == "laned_block" else 12  # the block-diagonal expand is laned's path above T = 64
    x, a, b, s = make(t, 3, len(splits) * r, jnp.float32, o=shards * sum(splits), seed=5)
    b = b[:, :r]
    want = np.zeros((t, shards * sum(splits)), np.float32)
    for j in range(shards):
        start = j * sum(splits)
        for k, w in enumerate(splits):
            cols = slice(start, start + w)
            want[:, cols] = np.asarray(lora_delta_gather(x, a[:, :, k * r:(k + 1) * r], b[:, :, cols], s))
            start += w
    got = PACKED_IMPLS[impl](x, a, b, s, splits=splits)
    err = np.max(np.abs(np.asarray(got, np.float32) - want)) / np.max(np.abs(want))
    assert err <= TOL[jnp.float32], f"relative error {err:.2e}"


@pytest.mark.parametrize("splits,msg", [((72, 24), "add up to"), ((48, 24, 24, 0), "positive ints"),
                                        ((60, 60), "lanes")])
def test_packed_splits_validated(splits, msg):
    x, a, b, s = make(8, 4, 24, jnp.float32, o=120)
    with pytest.raises(ValueError, match=msg):
        lora_delta(x, a, b[:, :8], s, splits=splits)


TPU_SMALL_BLOCKS = dict(block_t=16, block_d=128, block_o=128)  # pads T, D, O; several grid steps
GPU_SMALL_BLOCKS = dict(block_t=16, block_d=32, block_o=32)


@pytest.mark.parametrize(
    "kernel,kw,n,r",
    [
        (lora_delta_pallas_tpu, TPU_SMALL_BLOCKS, 5, 24),  # R does not divide the lane tile
        (lora_delta_pallas_tpu, TPU_SMALL_BLOCKS, 3, 200),  # R above one lane tile
        (lora_delta_pallas_gpu, GPU_SMALL_BLOCKS, 5, 24),
    ],
    ids=["tpu-R24", "tpu-R200", "gpu-R24"],
)
def test_pallas_padding_and_odd_ranks(kernel, kw, n, r):
    args = make(40, n, r, jnp.float32, d=300, o=136, seed=1)
    check(partial(kernel, interpret=True, **kw), args, jnp.float32)


def test_grouped_block_sizes():
    args = make(128, 4, 8, jnp.float32)
    for bt in (1, 3, 512):
        check(partial(lora_delta_grouped, block_t=bt), args, jnp.float32)


def test_grouped_argsort_path(monkeypatch):
    """Large T * N sorts with argsort instead of the counting sort; both must agree."""
    import jlora.kernels.grouped as grouped

    monkeypatch.setattr(grouped, "COUNTING_SORT_MAX", 0)
    args = make(33, 4, 8, jnp.float32, seed=3)  # a shape no other test traces
    check(lora_delta_grouped, args, jnp.float32)
    check(partial(lora_delta_grouped, method="ragged"), args, jnp.float32)


def test_dispatcher_forces_every_impl_and_auto_picks_a_real_one():
    args = make(7, 4, 8, jnp.float32)
    for impl in CHOICES:
        check(partial(lora_delta, impl=impl), args, jnp.float32)
    # Each rule of the dispatcher's table, at a shape on either side of its crossover.
    expected = {  # (T, N, R, backend) -> impl
        (16, 4, 64, "cpu"): "laned",  # decode, few slots: one dense GEMM over all lanes
        (8, 64, 16, "cpu"): "gather",  # decode, N >= 4T: tokens almost never share a slot
        (16, 16, 16, "cpu"): "gather",  # decode, small rank, under 4 tokens per slot
        (64, 16, 64, "cpu"): "grouped",  # decode at R > 16 and N < 4T
        (512, 8, 64, "cpu"): "laned",  # prefill, N*R = 512
        (512, 16, 64, "cpu"): "grouped",  # prefill, N*R above 512
        (2048, 4, 128, "gpu"): "laned", (16, 16, 64, "gpu"): "gather", (512, 16, 64, "gpu"): "grouped",
        (16, 8, 64, "tpu"): "laned", (16, 16, 64, "tpu"): "grouped",
    }
    for (t, n, r, backend), impl in expected.items():
        assert choose_impl(t, 576, 576, n, r, backend) == impl, (t, n, r, backend)
    for t, n, r in itertools.product((1, 8, 64, 512, 2048), (1, 4, 16, 64), (8, 16, 64)):
        for backend in ("cpu", "gpu", "tpu"):
            assert choose_impl(t, 576, 576, n, r, backend) != "pallas"  # never picked until measured


def test_inside_a_larger_jit():
    """The model calls lora_delta inside its own jit, on [B*T, D] rows, with impl static."""
    x, a, b, s = make(16, 4, 8, jnp.float32)
    w = jnp.ones((D, O), jnp.float32) * 0.01

    @jax.jit
    def layer(x, a, b, s):
        return x @ w + lora_delta(x, a, b, s, impl="auto")

    np.testing.assert_allclose(layer(x, a, b, s), x @ w + lora_delta_gather(x, a, b, s), rtol=1e-5, atol=1e-5)


def test_bench_quick_writes_its_section(tmp_path):
    from jlora.bench.kernels import BEGIN, END, main

    out = tmp_path / "kernels.md"
    out.write_text(f"# prose kept\n\n{BEGIN}\nold\n{END}\n\ntail kept\n")
    assert main(["--quick", "--out", str(out), "--max-reps", "3", "--budget", "0"]) == 0
    text = out.read_text()
    assert text.startswith("# prose kept") and text.endswith("tail kept\n") and "old" not in text
    assert "| decode | 8 | 576 | 1 | 8 |" in text


# ---- no recompilation when only slot ids or adapter values change ----------------------------


@pytest.fixture
def compile_counter():
    events = []

    def listener(name, *args, **kwargs):
        if name == "/jax/core/compile/backend_compile_duration":
            events.append(name)

    jax.monitoring.register_event_duration_secs_listener(listener)
    yield events
    jax.monitoring.unregister_event_duration_listener(listener)


@pytest.mark.parametrize("impl", ["gather", "laned", "grouped", "grouped_ragged", "auto", "pallas_tpu"])
def test_no_recompile_on_new_slots_or_weights(impl, compile_counter):
    fn = jax.jit(partial({"gather": lora_delta_gather, **ALL_IMPLS}[impl]))
    x, a, b, s = make(16, 4, 8, jnp.float32)
    others = [make(16, 4, 8, jnp.float32, seed=seed) for seed in range(1, 4)]
    none = jax.block_until_ready(jnp.full((16,), -1, jnp.int32))
    jax.block_until_ready(fn(x, a, b, s))
    before = len(compile_counter)
    for _, a2, b2, s2 in others:
        jax.block_until_ready(fn(x, a2, b2, s2))  # new adapter values and new slot ids
    jax.block_until_ready(fn(x, a, b, none))
    assert len(compile_counter) == before
    assert fn._cache_size() == 1


def test_entry_points_cache_one_graph_per_shape():
    x, a, b, s = make(16, 4, 8, jnp.float32)
    for f in (lora_delta_laned, lora_delta_grouped, lora_delta):
        f(x, a, b, s)
        size = f._cache_size()
        f(x, a * 2, b, (s + 1) % 4)
        assert f._cache_size() == size


# ---- lowering for the real targets, on this CPU host -----------------------------------------


def _specs(t, d, o, n, r, dtype):
    return (
        jax.ShapeDtypeStruct((t, d), dtype),
        jax.ShapeDtypeStruct((n, d, r), dtype),
        jax.ShapeDtypeStruct((n, r, o), dtype),
        jax.ShapeDtypeStruct((t,), jnp.int32),
    )


SHAPES_FOR_EXPORT = [(8, 576, 576, 16, 16, jnp.float32), (1000, 4100, 300, 5, 24, jnp.bfloat16)]


@pytest.mark.parametrize("shape", SHAPES_FOR_EXPORT, ids=["decode_f32", "odd_bf16"])
def test_pallas_tpu_lowers_for_tpu(shape):
    fn = jax.jit(partial(lora_delta_pallas, target="tpu", interpret=False))
    exp = jax.export.export(fn, platforms=["tpu"])(*_specs(*shape))
    text = exp.mlir_module()
    assert text.count("tpu_custom_call") == 2  # shrink and expand are Mosaic kernels
    assert exp.platforms == ("tpu",)


@pytest.mark.parametrize("shape", SHAPES_FOR_EXPORT, ids=["decode_f32", "odd_bf16"])
def test_pallas_gpu_lowers_for_cuda(shape):
    fn = jax.jit(partial(lora_delta_pallas, target="gpu", interpret=False))
    with pytest.raises(ValueError, match="compatibility guarantees"):
        jax.export.export(fn, platforms=["cuda"])(*_specs(*shape))  # Triton IR is not a stable format
    checks = [jax.export.DisabledSafetyCheck.custom_call(TRITON_CUSTOM_CALL)]
    exp = jax.export.export(fn, platforms=["cuda"], disabled_checks=checks)(*_specs(*shape))
    assert exp.mlir_module().count(TRITON_CUSTOM_CALL) == 2


# ---- bad inputs ------------------------------------------------------------------------------


def _bad_inputs():
    x, a, b, s = make(8, 4, 8, jnp.float32)
    return {
        "x_rank": ((x[0], a, b, s), "x must be"),
        "a_rank": ((x, a[0], b, s), "a must be"),
        "b_rank": ((x, a, b[0], s), "b must be"),
        "d_mismatch": ((x[:, :-1], a, b, s), "D="),
        "n_mismatch": ((x, a, b[:-1], s), "N="),
        "r_mismatch": ((x, a, b[:, :-1], s), "R="),
        "slots_len": ((x, a, b, s[:-1]), "slot_ids must be"),
        "slots_float": ((x, a, b, s.astype(jnp.float32)), "slot_ids must be an integer"),
        "x_int": ((x.astype(jnp.int32), a, b, s), "x must be float32"),
        "a_int8": ((x, a.astype(jnp.int8), b, s), "a must be float32"),
        "empty": ((x[:0], a, b, s[:0]), "x must have no zero-sized"),
    }


@pytest.mark.parametrize("case", list(_bad_inputs()))
@pytest.mark.parametrize("impl", ["gather", "laned", "grouped", "pallas_tpu", "pallas_gpu", "auto"])
def test_bad_inputs_raise_value_error_naming_the_argument(impl, case):
    args, msg = _bad_inputs()[case]
    fn = {"gather": lora_delta_gather, **ALL_IMPLS}[impl]
    with pytest.raises(ValueError, match=msg):
        fn(*args)


@pytest.mark.parametrize(
    "call,msg",
    [
        (lambda args: lora_delta(*args, impl="fast"), "impl must be one of"),
        (lambda args: lora_delta_grouped(*args, method="dense"), "method must be one of"),
        (lambda args: lora_delta_grouped(*args, block_t=0), "block_t must be a positive int"),
        (lambda args: lora_delta_pallas(*args, target="cpu"), "target must be one of"),
        (lambda args: lora_delta_pallas_tpu(*args, block_d=100), "block_d must be a multiple of 128"),
        (lambda args: lora_delta_pallas_gpu(*args, block_t=24), "block_t must be a power of two"),
    ],
    ids=["impl", "method", "block_t", "target", "tpu_block_d", "gpu_block_t"],
)
def test_bad_options_raise_value_error(call, msg):
    with pytest.raises(ValueError, match=msg):
        call(make(8, 4, 8, jnp.float32))
