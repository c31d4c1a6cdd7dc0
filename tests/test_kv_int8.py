"""The int8 KV cache (`kv_cache_dtype="int8"`, jlora.kernels.kv_quant).

Quantization round trips within half a step of each head's scale; the XLA loop and the Pallas TPU
kernel (interpreted here, and lowered for the chip with `jax.export`) read an int8 cache as their
reference does and stay close to the float cache's result; an engine on the tiny model serves
mixed adapter batches with prefix caching from it with no compile after warm-up and no whole-cache
copy in its step graphs; bad values are refused naming the option; and on the real default model
(SmolLM2, float32 compute) the int8 cache's teacher-forced top-1 agrees with the float32 cache's
at a measured rate (slow).
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from test_attention_tpu import make_case

from jlora.engine.config import EngineConfig
from jlora.engine.kv_plan import kv_bytes_per_token, kv_plan, shape_bytes
from jlora.kernels.attention import paged_attention, paged_attention_reference
from jlora.kernels.kv_quant import dequantize_kv, quantize_kv
from jlora.kernels.paged_attention_tpu import cache_lanes, paged_attention_tpu


def quantized(c: np.ndarray, dh: int) -> tuple[jax.Array, jax.Array]:
    """A float cache [L, NB, bs, KVH*Dh] as the engine writes it: int8 rows and scales [L, NB, KVH, bs]."""
    L, nb, bs, kd = c.shape
    rows, scale = quantize_kv(jnp.asarray(c).reshape(-1, kd // dh, dh))
    return rows.reshape(c.shape), jnp.swapaxes(scale.reshape(L, nb, bs, kd // dh), 2, 3)


def test_round_trip_error_is_at_most_half_a_step():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((64, 3, 64)).astype(np.float32) * rng.uniform(0.01, 30, (64, 3, 1)).astype(np.float32)
    x[5, 1] = 0.0  # an all-zero head: scale 0, read back as zeros
    x[7, 2, 3] = 500.0  # an outlier sets its head's scale
    q, s = quantize_kv(jnp.asarray(x))
    assert q.dtype == jnp.int8 and q.shape == (64, 3 * 64) and s.shape == (64, 3) and s.dtype == jnp.float32
    back = np.asarray(dequantize_kv(q, s)).reshape(x.shape)
    step = np.asarray(s)[..., None]
    err = np.abs(back - x)
    assert (err <= step / 2 + 1e-6 * np.abs(x)).all()
    np.testing.assert_allclose(np.abs(x).max(-1), np.asarray(s) * 127, rtol=1e-6)  # absmax maps to +-127
    assert np.asarray(q).min() >= -127 and (back[5, 1] == 0).all() and back[7, 2, 3] == pytest.approx(500.0)
    # relative to each head's largest value, never worse than 1/254 (half a step of 127)
    assert (err.max(-1) <= np.abs(x).max(-1) / 254 + 1e-6).all()


@pytest.mark.parametrize("h,kvh,dh,bs,chunk,nq", [
    (4, 2, 16, 16, 32, 1),     # tile = the whole 32-lane row
    (4, 2, 64, 16, 64, 1),     # two heads per 128-lane tile, decode
    (8, 2, 64, 16, 128, 5),    # two heads per tile, G=4, a prefill group
    (4, 2, 128, 8, 32, 3),     # one head per tile
    (9, 3, 64, 16, 128, 2),    # SmolLM2's heads: 3 x 64 = 192 lanes, one tile
    (9, 3, 64, 16, 64, 16),    # a prefill block of SmolLM2's rows
])
def test_kernel_and_xla_loop_read_int8_as_their_reference(h, kvh, dh, bs, chunk, nq):
    q, k, v, positions, tables = make_case(h, kvh, dh, bs, nq, seed=h * 10 + dh + nq)
    k8, ks = quantized(k, dh)
    v8, vs = quantized(v, dh)
    layer = jnp.int32(1)
    want = paged_attention_reference(q, k8, v8, layer, positions, tables, k_scale=ks, v_scale=vs)
    got = paged_attention_tpu(q, k8, v8, layer, positions, tables, chunk=chunk, interpret=True, k_scale=ks, v_scale=vs)
    xla = paged_attention(q, k8, v8, layer, positions, tables, chunk=chunk, k_scale=ks, v_scale=vs)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-5, rtol=2e-5)
    np.testing.assert_allclose(np.asarray(xla), np.asarray(want), atol=2e-5, rtol=2e-5)
    # Against the float cache: unit-normal keys and values, softmax-averaged. Measured max |diff|
    # 0.005-0.016 over these shapes (2026-12-07); a kernel that dropped or misplaced a scale is off by O(1).
    exact = np.asarray(paged_attention_reference(q, k, v, layer, positions, tables))
    assert np.abs(np.asarray(got) - exact).max() < 0.04
    assert np.abs(np.asarray(got) - exact).mean() < 0.005


def test_kernel_int8_with_padded_rows_and_bf16_queries():
    """SmolLM2's 192-lane rows widened to 256 (`cache_lanes`): the pad head's values are junk whose
    scale is 0 as the engine writes them (zeros); bfloat16 queries multiply in bfloat16."""
    h, kvh, dh = 9, 3, 64
    q, k, v, positions, tables = make_case(h, kvh, dh, 16, 4, seed=3)
    lanes = cache_lanes(kvh, dh)
    pad = lambda c: np.concatenate([c, np.zeros(c.shape[:-1] + (lanes - c.shape[-1],), c.dtype)], -1)
    k8, ks = quantized(pad(k), dh)
    v8, vs = quantized(pad(v), dh)
    assert ks.shape[2] == lanes // dh and float(jnp.abs(ks[:, :, kvh:]).max()) == 0.0
    want = paged_attention_reference(q, *quantized(k, dh)[:1], *quantized(v, dh)[:1], jnp.int32(0), positions, tables,
                                     k_scale=quantized(k, dh)[1], v_scale=quantized(v, dh)[1])
    got = paged_attention_tpu(q, k8, v8, jnp.int32(0), positions, tables, chunk=64, interpret=True, kv_heads=kvh,
                              k_scale=ks, v_scale=vs)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-5, rtol=2e-5)
    got16 = paged_attention_tpu(jnp.asarray(q, jnp.bfloat16), k8, v8, jnp.int32(0), positions, tables, chunk=64,
                                interpret=True, kv_heads=kvh, k_scale=ks, v_scale=vs)
    assert got16.dtype == jnp.bfloat16
    assert np.abs(np.asarray(got16, np.float32) - np.asarray(want)).max() < 0.05  # bf16 rounding of q, p and values


@pytest.mark.parametrize("b,nq,seqs", [(16, 1, 1), (1, 256, 1), (64, 1, 8)])
def test_int8_kernel_lowers_for_tpu(b, nq, seqs):
    """Mosaic lowering of the int8 kernel for the chip, without it (SmolLM2's padded rows, 128-position pages)."""
    from jlora.tuning import AttentionOptions

    spec = jax.ShapeDtypeStruct
    fn = jax.jit(partial(paged_attention_tpu, chunk=1024, interpret=False, kv_heads=3,
                         options=AttentionOptions(seqs_per_program=seqs)))
    cache, scale = spec((30, 512, 128, 256), jnp.int8), spec((30, 512, 4, 128), jnp.float32)
    exp = jax.export.export(fn, platforms=["tpu"])(
        spec((b, nq, 9, 64), jnp.bfloat16), cache, cache, spec((), jnp.int32), spec((b, nq), jnp.int32),
        spec((b, 16), jnp.int32), None, k_scale=scale, v_scale=scale)
    assert "tpu_custom_call" in exp.mlir_module()


def test_attention_refuses_mismatched_scales():
    q, k, v, positions, tables = make_case(4, 2, 16, 16, 1)
    k8, ks = quantized(k, 16)
    v8, vs = quantized(v, 16)
    with pytest.raises(ValueError, match="int8 cache needs k_scale and v_scale"):
        paged_attention_reference(q, k8, v8, jnp.int32(0), positions, tables)
    with pytest.raises(ValueError, match="int8 cache needs k_scale and v_scale"):
        paged_attention(q, k, v, jnp.int32(0), positions, tables, chunk=32, k_scale=ks, v_scale=vs)
    with pytest.raises(ValueError, match=r"v_scale must be float \[L, NB, KVH, bs\]"):
        paged_attention(q, k8, v8, jnp.int32(0), positions, tables, chunk=32, k_scale=ks, v_scale=vs[:, :, :1])


@pytest.mark.parametrize("bad", ["int4", "fp8", "INT8", "bfloat16", 8, True])
def test_bad_kv_cache_dtype_is_refused_naming_the_option(bad, tmp_path):
    from jlora import LLM

    with pytest.raises(ValueError, match=r"kv_cache_dtype must be one of \['auto', 'int8'\]"):
        EngineConfig(kv_cache_dtype=bad)
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of"):  # before any model is read
        LLM(str(tmp_path / "no-such-model"), kv_cache_dtype=bad, progress=False)
    assert EngineConfig(kv_cache_dtype=None).kv_cache_dtype == "auto"


def test_kv_plan_counts_int8_bytes_and_scales():
    """SmolLM2's shape (30 layers, 3 KV heads of 64): 23,040 bytes a token in bf16; int8 rows plus
    the scales as a TPU pads them (3 heads -> 8 rows of float32): 2 x 30 x (192 + 32) = 13,440; with
    the kernel's 256-lane rows 30,720 -> 17,280. kv_plan fits ~1.7x the sequences."""
    cfg = dict(hidden_size=576, intermediate_size=1536, num_attention_heads=9, num_key_value_heads=3, head_dim=64,
               num_hidden_layers=30, vocab_size=49152, tie_word_embeddings=True)
    assert kv_bytes_per_token(30, 3, 64, 2) == shape_bytes(cfg)["kv_per_token"] == 23040
    assert kv_bytes_per_token(30, 3, 64, 2, "int8") == shape_bytes(cfg, kv_cache_dtype="int8")["kv_per_token"] == 13440
    assert (kv_bytes_per_token(30, 3, 64, 2, lanes=256), kv_bytes_per_token(30, 3, 64, 2, "int8", 256)) == (30720, 17280)
    plan = partial(kv_plan, cfg, "none", 2048, 128, 4, 16, hbm_bytes=4 * 10**9, cap=10**6)
    bf16, int8 = plan(), plan(kv_cache_dtype="int8")
    free = int8["hbm_bytes"] - int8["weights"] - int8["lora_slots"] - int8["headroom"]
    assert (bf16["max_num_seqs"], int8["max_num_seqs"]) == (free // (2048 * 23040), free // (2048 * 13440)) == (35, 61)


@pytest.fixture(scope="module")
def int8_engine(tiny_dir):  # (warm-up ~50 s on the 2-core machine: the test using it is marked slow)
    from jlora import LLM

    return LLM(str(tiny_dir[0]), kv_cache_dtype="int8", max_model_len=256, max_num_seqs=4, max_num_batched_tokens=64,
               token_buckets=(32, 64), max_loras=2, max_lora_rank=8, progress=False)


@pytest.mark.slow
def test_engine_serves_mixed_adapters_with_prefix_caching_from_an_int8_cache(int8_engine, tiny_adapters):
    from jlora import LoRARequest, SamplingParams, compile_stats
    from jlora.engine.runner import whole_cache_copies

    llm = int8_engine
    runner = llm.engine.runner
    assert llm.config.enable_prefix_caching and runner.attn_impl == "xla"
    cache = runner.cache
    assert cache["k"].dtype == cache["v"].dtype == jnp.int8
    L, nb, bs, kd = cache["k"].shape
    assert cache["k_scale"].shape == cache["v_scale"].shape == (L, nb, 2, bs)
    report = llm.memory_report(print_table=False)["kv_cache"]
    assert report["dtype"] == "int8" and report["bytes"] == 2 * nb * bs * L * (kd + 2 * 4)
    assert report["scale_bytes"] == 2 * L * nb * 2 * bs * 4

    shared = list(range(100, 100 + 3 * bs))  # three whole blocks every request shares
    prompts = [{"prompt_token_ids": shared + list(range(7 * i, 7 * i + 5 + i))} for i in range(6)]
    loras = [None, LoRARequest("a0", 1, str(tiny_adapters[0])), LoRARequest("a1", 2, str(tiny_adapters[1]))] * 2
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    before = compile_stats.compile_count()
    first = [o.outputs[0].token_ids for o in llm.generate(prompts, params, lora_request=loras, use_tqdm=False)]
    outs = llm.generate(prompts, params, lora_request=loras, use_tqdm=False)
    again = [o.outputs[0].token_ids for o in outs]
    assert compile_stats.compile_count() == before  # warmed up at construction: nothing compiles serving
    # The second round reads the first's int8 blocks (and their scales) from the prefix cache, per
    # adapter: the same tokens.
    assert all(o.num_cached_tokens >= 3 * bs for o in outs)
    assert again == first and all(len(t) == 6 for t in first)
    assert first[1] != first[0] or first[2] != first[0]  # adapters change the output
    for exe in runner._executables.values():
        text = exe.as_text()
        assert whole_cache_copies(text, runner.cache["k"].shape) == []
        assert whole_cache_copies(text, runner.cache["k_scale"].shape) == []


# Real chat text for the agreement measurement: a summary request over this repository's own docs and
# two everyday questions, each followed by the model's greedy answer (float32 cache).
CHATS = ["Summarize this for a new engineer:\n\n{doc}",
         "I am planning a three-day trip to Lisbon in spring. What should I see, and what food should I try?",
         "My Python script reads a 2 GB CSV file with pandas and runs out of memory. How can I fix it?"]


@pytest.mark.slow
def test_smollm2_int8_cache_agrees_with_the_float_cache(real_llm):
    """Teacher-forced over prompt + greedy answer (557 positions), SmolLM2 in float32 with the int8
    cache against the float32 cache. Measured 2026-12-07 (CPU): top-1 agreement 97.1% (541/557),
    max |logit diff| 1.85, and every one of the 16 disagreements a near-tie of the float32 logits
    (top-two margin <= 0.091). (A bfloat16 cache agreed on all positions of the same texts.)"""
    from pathlib import Path

    from jlora import SamplingParams
    from jlora.models import init_cache

    doc = (Path(__file__).parent.parent / "docs" / "engine.md").read_text()[:500]
    rows = []
    for text in CHATS:
        conv = [{"role": "user", "content": text.format(doc=doc)}]
        answer = real_llm.chat([conv], SamplingParams(temperature=0.0, max_tokens=96), use_tqdm=False)[0]
        rows.append(list(real_llm.apply_chat_template(conv)) + list(answer.outputs[0].token_ids))

    def logits(row, dtype):
        ids, pos = jnp.asarray([row], jnp.int32), jnp.arange(len(row), dtype=jnp.int32)[None]
        out, _ = real_llm.model(ids, pos, init_cache(real_llm.model.cfg, 1, len(row), dtype))
        return np.asarray(out[0])

    same, margins, dmax = [], [], 0.0
    for row in rows:
        ref, got = logits(row, jnp.float32), logits(row, jnp.int8)
        top2 = np.sort(ref, -1)[:, -2:]
        agree = ref.argmax(-1) == got.argmax(-1)
        same.append(agree)
        margins += list((top2[:, 1] - top2[:, 0])[~agree])
        dmax = max(dmax, float(np.abs(ref - got).max()))
    rate = np.concatenate(same).mean()
    print(f"int8 KV vs float32 KV, SmolLM2: top-1 {rate:.4f} over {sum(map(len, same))} positions, "
          f"max |dlogit| {dmax:.3f}, disagreement margins {np.round(margins, 3).tolist()}")
    assert sum(map(len, same)) >= 400
    assert rate >= 0.95
    assert max(margins, default=0.0) < 0.25  # only near-ties flip
    assert dmax < 3.0


def test_cli_flag_reaches_llm(cli_llm_kwargs, capsys):
    generate, serve = cli_llm_kwargs
    assert generate(["--kv-cache-dtype", "int8"])["kv_cache_dtype"] == "int8"
    assert generate([])["kv_cache_dtype"] == "auto"
    assert serve(["--kv-cache-dtype", "int8"])["kv_cache_dtype"] == "int8"
    capsys.readouterr()
    assert generate(["--kv-cache-dtype", "int4"]) == {}  # the parser exits before an LLM is made
    assert "--kv-cache-dtype: invalid choice: 'int4'" in capsys.readouterr().err


@pytest.mark.slow  # the interpreted kernel inside the step graphs
def test_engine_with_the_kernel_reads_int8_as_the_xla_loop(tiny_dir, tiny_adapters):
    """The whole serving step with attn_impl="pallas" (interpreted here; rows padded to 128 lanes,
    the pad head's scales zero) on an int8 cache: the XLA loop's greedy tokens, mixed adapters.
    Each prompt takes two 32-token chunks (the second reads the first from the int8 cache) and
    the third waits for a row, so prefill chunks run beside decode rows."""
    from jlora import LLM, LoRARequest, SamplingParams

    # Two step graphs (two decode rows; the same beside one prompt chunk), and a 256-position key
    # chunk: the interpreted kernel's compile is this test's time, and it grows with the pages a
    # chunk unrolls (2 graphs, CPU-s on 2 cores: 71 at the default 1,024, 41 at 256, 2026-12-07).
    # At 256 a decode program still computes a partial chunk in 128-position steps, as at 1,024.
    engine = dict(kv_cache_dtype="int8", max_model_len=256, max_num_seqs=2, max_num_batched_tokens=32,
                  token_buckets=(32,), decode_row_buckets=(2,), max_loras=2, max_lora_rank=8, progress=False)
    prompts = [{"prompt_token_ids": list(range(5 + 17 * i, 45 + 23 * i))} for i in range(3)]
    loras = [None, LoRARequest("a0", 1, str(tiny_adapters[0])), LoRARequest("a1", 2, str(tiny_adapters[1]))]
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    outs = {}
    for impl in ("xla", "pallas"):
        llm = LLM(str(tiny_dir[0]), attn_impl=impl, attn_chunk=256 if impl == "pallas" else None, **engine)
        assert llm.engine.runner.attn_impl == impl and llm.config.num_step_graphs == 2
        cache = llm.engine.runner.cache
        assert cache["k"].dtype == jnp.int8 and cache["k_scale"].shape[2] == (8 if impl == "pallas" else 2)
        if impl == "pallas":
            assert cache["k"].shape[-1] == 128
        outs[impl] = [o.outputs[0].token_ids for o in llm.generate(prompts, params, lora_request=loras,
                                                                   use_tqdm=False)]
        del llm
    assert outs["pallas"] == outs["xla"] and all(len(t) == 5 for t in outs["xla"])
