"""int8 quantization and bf16 storage (jlora.models.quant) on tiny random models: no torch, a few seconds.

The quantizer against its NumPy reference (scales, rounding, zero rows), the quantized linear against
a NumPy W8A8 / W8A16 reference, load-time quantization from safetensors and from GGUF (Q8_0, Q4_0, Q4_1:
equal to dequantize-then-quantize), the weights cache holding int8, and bf16 kept as bits on XLA:CPU
(no whole-array conversions in the compiled decoder).
"""

import json
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jlora.formats import read_safetensors
from jlora.models import build_model, init_cache, load_model
from jlora.models import quant
from jlora.models import weights_cache as wc
from jlora.models.config import LlamaConfig
from jlora.models.llama import AttnGroup, Llama

CFG = dict(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
           num_key_value_heads=2, head_dim=16, max_position_embeddings=128, rms_norm_eps=1e-5)


# ---- the quantizer ---------------------------------------------------------------------------------


def test_quantize_np_scales_rounding_and_zero_rows():
    w = np.array([[127.0, 0.5, 1.5, -2.5, -127.0],  # scale 1: round half to even, -127..127
                  [0.0, 0.0, 0.0, 0.0, 0.0],  # a zero row: scale 0, q 0, dequantizes to exact zeros
                  [1.0, -0.5, 0.25, 0.0, 0.125]], np.float32)
    q, s = quant.quantize_np(w, axis=-1)
    assert q.dtype == np.int8 and s.dtype == np.float32 and s.shape == (3,)
    np.testing.assert_array_equal(s, np.array([127, 0, 1], np.float32) * np.float32(1 / 127))
    np.testing.assert_array_equal(q[0], [127, 0, 2, -2, -127])
    np.testing.assert_array_equal(q[1], 0)
    np.testing.assert_array_equal(q[2], [127, -64, 32, 0, 16])  # -63.5 -> -64 (half to even), 31.75 -> 32
    np.testing.assert_array_equal(quant.dequantize_np(q, s)[1], 0.0)
    # Rounding error at most half a step per element; the row's max is exact.
    rng = np.random.default_rng(0)
    w = rng.standard_normal((32, 48)).astype(np.float32) * rng.uniform(0.01, 10, (32, 1)).astype(np.float32)
    q, s = quant.quantize_np(w)
    assert np.all(np.abs(quant.dequantize_np(q, s) - w) <= s[:, None] / 2 * (1 + 1e-6))
    assert np.all(np.abs(q).max(axis=1) == 127)
    # Per column (axis=0) is the same thing transposed.
    q0, s0 = quant.quantize_np(w, axis=0)
    qt, st = quant.quantize_np(w.T)
    np.testing.assert_array_equal(q0, qt.T)
    np.testing.assert_array_equal(s0, st)


def test_jax_quantize_equals_numpy_reference():
    rng = np.random.default_rng(1)
    w = rng.standard_normal((3, 40, 24)).astype(np.float32)
    w[1, 5] = 0.0  # a zero row
    w[2, :, 7] = 0.0  # a zero column
    for axis in (-1, -2):
        q, s = quant.quantize(jnp.asarray(w), axis=axis)
        qr, sr = quant.quantize_np(w, axis=axis)
        np.testing.assert_array_equal(np.asarray(q), qr)
        np.testing.assert_array_equal(np.asarray(s), sr)


def test_check_quantization_and_activation_modes():
    assert quant.check_quantization(None) == "none"
    with pytest.raises(ValueError, match="quantization must be one of"):
        quant.check_quantization("int4")
    assert quant.activation_mode("none") is None
    assert quant.activation_mode("int8", "cpu") == "int8"  # W8A8 where the int8 dot is fast
    assert quant.activation_mode("int8", "tpu") == "int8"  # the MXU's native int8
    assert quant.activation_mode("int8", "gpu") == "float"  # dequantized in the matmul elsewhere
    assert quant.activation_mode("int8-weight-only", "tpu") == "float"
    assert quant.activation_mode("int8-weight-only", "cpu") == "float"


def test_linear_w8a8_and_w8a16_match_numpy_reference():
    rng = np.random.default_rng(2)
    x = rng.standard_normal((5, 64)).astype(np.float32)
    x[3] = 0.0  # a zero token: scale 0, output 0
    w = rng.standard_normal((64, 40)).astype(np.float32) * 0.1  # [in, out]
    q, s = quant.quantize_np(w.T)  # rows = output channels
    # W8A8: per-token int8 activations, int32 accumulation.
    xq, xs = quant.quantize_np(x)
    ref = (xq.astype(np.int64) @ q.T.astype(np.int64)).astype(np.float32) * xs[:, None] * s[None, :]
    got = quant.linear(jnp.asarray(x), quant.QArray(jnp.asarray(q), jnp.asarray(s), "int8"))
    np.testing.assert_allclose(np.asarray(got), ref, rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(np.asarray(got)[3], 0.0)
    # W8A16: the dequantized weight times float activations.
    got16 = quant.linear(jnp.asarray(x), quant.QArray(jnp.asarray(q), jnp.asarray(s), "float"))
    np.testing.assert_allclose(np.asarray(got16), x @ quant.dequantize_np(q, s).T, rtol=1e-5, atol=1e-5)
    # Both stay near the float product (the quality bound the model tests rely on).
    assert np.abs(np.asarray(got) - x @ w).max() < 0.05
    assert np.abs(np.asarray(got16) - x @ w).max() < 0.02


# ---- models -----------------------------------------------------------------------------------------


def write_checkpoint(path, tied: bool, seed: int = 0) -> dict[str, np.ndarray]:
    """A tiny random HF checkpoint (config.json + model.safetensors), written without torch."""
    from safetensors.numpy import save_file

    cfg = LlamaConfig(**CFG, tie_word_embeddings=tied)
    rng = np.random.default_rng(seed)
    d, L = cfg.hidden_size, cfg.num_hidden_layers
    t = {"model.embed_tokens.weight": rng.standard_normal((cfg.vocab_size, d)), "model.norm.weight": 1 + 0.1 * rng.standard_normal(d)}
    if not tied:
        t["lm_head.weight"] = rng.standard_normal((cfg.vocab_size, d)) * 0.5
    for i in range(L):
        p = f"model.layers.{i}."
        for m, (d_in, d_out) in cfg.module_shapes().items():
            sub = "self_attn" if m in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
            t[p + f"{sub}.{m}.weight"] = rng.standard_normal((d_out, d_in)) / np.sqrt(d_in)
        t[p + "input_layernorm.weight"] = 1 + 0.1 * rng.standard_normal(d)
        t[p + "post_attention_layernorm.weight"] = 1 + 0.1 * rng.standard_normal(d)
    t = {k: np.asarray(v, np.float32) for k, v in t.items()}
    t["model.layers.1.self_attn.v_proj.weight"][3] = 0.0  # a zero output channel
    path.mkdir(parents=True, exist_ok=True)
    save_file(t, str(path / "model.safetensors"))
    hf = {"vocab_size": cfg.vocab_size, "hidden_size": d, "intermediate_size": cfg.intermediate_size,
          "num_hidden_layers": L, "num_attention_heads": cfg.num_attention_heads,
          "num_key_value_heads": cfg.num_key_value_heads, "head_dim": cfg.head_dim, "rms_norm_eps": 1e-5,
          "max_position_embeddings": 128, "tie_word_embeddings": tied, "architectures": ["LlamaForCausalLM"]}
    (path / "config.json").write_text(json.dumps(hf))
    return t


def sub_weight(model: Llama, m: str):
    """Sub-module `m`'s part of its packed weight (q of qkv_proj, up of gate_up_proj, ...): a QArray
    q [L, out, in] with its scales, or a float [L, in, out]."""
    from jlora.models.config import PACKED_MODULES

    fused = next(f for f, subs in PACKED_MODULES.items() if m in subs)
    outs = model.cfg.packed_shapes()[fused][1]
    start = sum(outs[: PACKED_MODULES[fused].index(m)])
    stop = start + outs[PACKED_MODULES[fused].index(m)]
    w = quant.weight(model.layers, fused)
    if isinstance(w, quant.QArray):
        return quant.QArray(w.q[:, start:stop], w.scale[:, start:stop], w.act)
    return w[..., start:stop]


def model_logits(model: Llama, ids: np.ndarray) -> np.ndarray:  # f32[B, T, V]
    b, t = ids.shape
    pos = np.tile(np.arange(t, dtype=np.int32), (b, 1))
    out, _ = model(jnp.asarray(ids), jnp.asarray(pos), init_cache(model.cfg, b, t, jnp.float32))
    return np.asarray(out)


@pytest.mark.parametrize("tied", [True, False])
def test_load_time_quantization_equals_quantizing_the_float_model(tmp_path, tied):
    tensors = write_checkpoint(tmp_path / "ckpt", tied)
    qm, _, _ = load_model(tmp_path / "ckpt", quantization="int8")
    fm, _, _ = load_model(tmp_path / "ckpt")
    # Every projection is int8 [L, out, in] with a scale per (layer, output channel), from the HF tensor.
    for m in fm.cfg.module_shapes():
        w = sub_weight(qm, m)
        assert isinstance(w, quant.QArray) and w.q.dtype == jnp.int8 and w.act == "int8"
        sub = "self_attn" if m in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
        for i in range(fm.cfg.num_hidden_layers):
            q, s = quant.quantize_np(tensors[f"model.layers.{i}.{sub}.{m}.weight"])
            np.testing.assert_array_equal(np.asarray(w.q[i]), q)
            np.testing.assert_array_equal(np.asarray(w.scale[i]), s)
    head = "model.embed_tokens.weight" if tied else "lm_head.weight"
    q, s = quant.quantize_np(tensors[head])
    rows = quant.head_rows(qm)
    np.testing.assert_array_equal(np.asarray(rows.q), q)
    np.testing.assert_array_equal(np.asarray(rows.scale), s)
    assert np.asarray(sub_weight(qm, "v_proj").scale[1, 3]) == 0.0  # the zero channel
    # The same as quantizing the float model in the graph (quantize_model).
    qm2 = quant.quantize_model(load_model(tmp_path / "ckpt")[0], "int8")
    for a, b in zip(jax.tree.leaves(nnx.state(qm, nnx.Param)), jax.tree.leaves(nnx.state(qm2, nnx.Param))):
        assert a.dtype == b.dtype
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    # Quality: logits near the float model's; weight-only closer than W8A8.
    ids = np.random.default_rng(0).integers(0, CFG["vocab_size"], (2, 12)).astype(np.int32)
    ref = model_logits(fm, ids)
    wo, _, _ = load_model(tmp_path / "ckpt", quantization="int8-weight-only")
    err8 = np.abs(model_logits(qm, ids) - ref).max()
    err16 = np.abs(model_logits(wo, ids) - ref).max()
    scale = np.abs(ref).max()
    assert err16 < 0.02 * scale and err8 < 0.06 * scale, (err16, err8, scale)


def write_gguf(path, qtypes: dict[str, str]) -> dict[str, np.ndarray]:
    """A tiny llama GGUF whose projections use the given quant types; returns the raw float tensors."""
    import gguf

    cfg = LlamaConfig(**CFG, tie_word_embeddings=True)
    rng = np.random.default_rng(3)
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(cfg.num_hidden_layers)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_context_length(128)
    names = {"q_proj": "attn_q", "k_proj": "attn_k", "v_proj": "attn_v", "o_proj": "attn_output",
             "gate_proj": "ffn_gate", "up_proj": "ffn_up", "down_proj": "ffn_down"}
    raw = {}

    def add(name, arr, qtype):
        arr = np.asarray(arr, np.float32)
        raw[name] = arr
        if qtype == "F32":
            w.add_tensor(name, arr)
        else:
            t = getattr(gguf.GGMLQuantizationType, qtype)
            w.add_tensor(name, gguf.quants.quantize(arr, t), raw_dtype=t)

    add("token_embd.weight", rng.standard_normal((cfg.vocab_size, cfg.hidden_size)), qtypes["embed"])
    add("output_norm.weight", np.ones(cfg.hidden_size), "F32")
    for i in range(cfg.num_hidden_layers):
        for m, (d_in, d_out) in cfg.module_shapes().items():
            add(f"blk.{i}.{names[m]}.weight", rng.standard_normal((d_out, d_in)) / 8, qtypes[m])
        add(f"blk.{i}.attn_norm.weight", np.ones(cfg.hidden_size), "F32")
        add(f"blk.{i}.ffn_norm.weight", np.ones(cfg.hidden_size), "F32")
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return raw


def test_gguf_q8_0_q4_0_q4_1_quantize_equals_dequantize_then_quantize(tmp_path):
    import gguf

    from jlora.models.loading import reverse_gguf_permute

    qtypes = {"embed": "Q8_0", "q_proj": "Q4_0", "k_proj": "Q4_1", "v_proj": "Q8_0", "o_proj": "Q4_1",
              "gate_proj": "Q4_0", "up_proj": "Q8_0", "down_proj": "Q4_1"}
    path = tmp_path / "tiny.gguf"
    write_gguf(path, qtypes)
    reader = gguf.GGUFReader(str(path))
    seen = {t.tensor_type.name for t in reader.tensors}
    assert {"Q8_0", "Q4_0", "Q4_1"} <= seen
    deq = {t.name: np.asarray(gguf.quants.dequantize(t.data, t.tensor_type), np.float32).reshape(
        tuple(int(s) for s in reversed(t.shape))) for t in reader.tensors}
    totals = {"misses": 0, "hits": 0, "rebuilds": 0}  # over this test's own cache instances
    for root in (None, tmp_path / "wcache"):  # uncached, and through the weights cache (miss, then hit)
        for _ in range(1 if root is None else 2):
            cache = wc.open_cache(root) if root else False
            model, _, _ = load_model(path, quantization="int8", weights_cache=cache)
            for k in totals:
                totals[k] += cache.stats[k] if cache else 0
            cfg = model.cfg
            names = {"q_proj": "attn_q", "k_proj": "attn_k", "v_proj": "attn_v", "o_proj": "attn_output",
                     "gate_proj": "ffn_gate", "up_proj": "ffn_up", "down_proj": "ffn_down"}
            for m, g in names.items():
                w = sub_weight(model, m)
                for i in range(cfg.num_hidden_layers):
                    ref = deq[f"blk.{i}.{g}.weight"]
                    if m in ("q_proj", "k_proj"):
                        ref = reverse_gguf_permute(ref, cfg.num_attention_heads if m == "q_proj" else cfg.num_key_value_heads)
                    q, s = quant.quantize_np(ref)
                    np.testing.assert_array_equal(np.asarray(w.q[i]), q, err_msg=f"{m} ({qtypes[m]}) layer {i}")
                    np.testing.assert_array_equal(np.asarray(w.scale[i]), s)
            q, s = quant.quantize_np(deq["token_embd.weight"])
            np.testing.assert_array_equal(np.asarray(quant.head_rows(model).q), q)
    assert totals == {"misses": 1, "hits": 1, "rebuilds": 0}
    entry = next(p for p in (tmp_path / "wcache").iterdir() if not p.name.startswith(".") and p.name != "hashes")
    meta = json.loads((entry / "meta.json").read_text())
    assert meta["quantization"] == "int8"
    tensors = read_safetensors(entry / "model.safetensors")
    assert tensors["model.layers.0.self_attn.q_proj.weight"].dtype == np.int8
    assert tensors["model.layers.0.self_attn.q_proj.weight_scale"].dtype == np.float32


def test_weights_cache_keeps_float_and_int8_entries_apart(tmp_path):
    write_checkpoint(tmp_path / "ckpt", tied=True)
    root = tmp_path / "wc"
    f32, _, _ = load_model(tmp_path / "ckpt", weights_cache=root)
    i8, _, _ = load_model(tmp_path / "ckpt", weights_cache=root, quantization="int8")
    wo, _, _ = load_model(tmp_path / "ckpt", weights_cache=root, quantization="int8-weight-only")
    entries = [p for p in root.iterdir() if not p.name.startswith(".") and p.name != "hashes"]
    assert len(entries) == 2  # float32 and int8; both int8 modes share one entry
    assert f32.layers.qkv_proj[...].dtype == jnp.float32 and i8.layers.qkv_proj[...].dtype == jnp.int8
    assert quant.weight(wo.layers, "qkv_proj").act == "float"
    np.testing.assert_array_equal(np.asarray(i8.layers.qkv_proj[...]), np.asarray(wo.layers.qkv_proj[...]))


# ---- bfloat16 kept as bits on XLA:CPU ---------------------------------------------------------------------


def test_bits_round_trip():
    x = jnp.asarray(np.random.default_rng(4).standard_normal((3, 5)), jnp.bfloat16)
    bits = quant.to_bits(x)
    assert bits.dtype == jnp.uint16
    np.testing.assert_array_equal(np.asarray(quant.from_bits(bits)), np.asarray(x))
    np.testing.assert_array_equal(np.asarray(quant.widen(bits)), np.asarray(x, np.float32))
    np.testing.assert_array_equal(np.asarray(quant.narrow(x.astype(jnp.float32), bits)), np.asarray(bits))
    host = quant.to_storage(np.asarray(x))
    assert host.dtype == np.uint16 and np.array_equal(host, np.asarray(bits))
    f = jnp.ones(3)
    assert quant.to_bits(f) is f and quant.widen(f) is f and quant.to_storage(f) is f


def test_bf16_model_matches_float32_and_compiles_without_whole_array_converts(tmp_path, monkeypatch):
    monkeypatch.setattr(quant, "HEAD_CHUNK", 64)  # the lm head widened 64 vocabulary rows at a time
    write_checkpoint(tmp_path / "ckpt", tied=True)
    fm, _, _ = load_model(tmp_path / "ckpt")
    bm, _, _ = load_model(tmp_path / "ckpt", dtype=jnp.bfloat16)
    assert bm.layers.qkv_proj[...].dtype == jnp.uint16  # bf16 bits (XLA:CPU)
    ids = np.random.default_rng(5).integers(0, CFG["vocab_size"], (2, 10)).astype(np.int32)
    ref = model_logits(fm, ids)
    got = model_logits(bm, ids)
    assert np.abs(got - ref).max() < 0.03 * np.abs(ref).max()
    # The decode step's compiled graph converts no whole stacked array (weights, cache) to f32:
    # the cause of the bf16 slowdown this module fixes.
    cfg = bm.cfg
    cache = init_cache(cfg, 8, 16, quant.storage_dtype(jnp.bfloat16))
    graphdef, state = nnx.split(bm)
    group = AttnGroup(jnp.full((4, 1), 5, jnp.int32), jnp.arange(8, dtype=jnp.int32).reshape(4, 2))

    def step(state, cache):
        m = nnx.merge(graphdef, state)
        h, cache = m.forward(jnp.arange(4, dtype=jnp.int32), jnp.full((4,), -1, jnp.int32), (group,), cache)
        return m.logits(h), cache

    hlo = jax.jit(step).lower(state, cache).compile().as_text()
    L = cfg.num_hidden_layers
    stacked = [f"f32[{L},{a},{sum(b)}]" for a, b in cfg.packed_shapes().values()]
    stacked += [f"f32[{L},8,16,{cfg.num_key_value_heads},{cfg.head_dim}]", f"f32[{cfg.vocab_size},{cfg.hidden_size}]"]
    found = [s for s in stacked if s in hlo]
    assert not found, f"whole-array f32 conversions in the bf16 step: {found}"
    assert not re.search(r"bf16\[[^\]]*\][^\n]*\b(dot|gather|scatter|dynamic-slice)\(", hlo)


# ---- the command line ----------------------------------------------------------------------------------


def test_cli_quantization_flag_reaches_llm(cli_llm_kwargs):
    generate, serve = cli_llm_kwargs
    seen = generate(["--quantization", "int8", "--dtype", "bfloat16"])
    assert seen["quantization"] == "int8" and seen["dtype"] == "bfloat16"
    assert serve(["--quantization", "int8-weight-only"])["quantization"] == "int8-weight-only"
    from jlora import cli

    with pytest.raises(SystemExit):  # argparse rejects an unknown mode
        cli.build_parser().parse_args(["generate", "hi", "--quantization", "int4"])


def test_bf16_with_int8_weights(tmp_path):
    """dtype=bfloat16 with int8: norms (and KV cache, slots) in bf16 bits, projections int8."""
    write_checkpoint(tmp_path / "ckpt", tied=False)
    m32, _, _ = load_model(tmp_path / "ckpt", quantization="int8")
    m16, _, _ = load_model(tmp_path / "ckpt", dtype=jnp.bfloat16, quantization="int8")
    assert m16.layers.input_layernorm[...].dtype == quant.storage_dtype(jnp.bfloat16)
    assert m16.layers.qkv_proj[...].dtype == jnp.int8 and m16.lm_head[...].dtype == jnp.int8
    ids = np.random.default_rng(6).integers(0, CFG["vocab_size"], (2, 8)).astype(np.int32)
    ref = model_logits(m32, ids)
    assert np.abs(model_logits(m16, ids) - ref).max() < 0.05 * np.abs(ref).max()


# ---- lowering for the TPU, without one ---------------------------------------------------------------


@pytest.mark.parametrize("quantization", ["int8-weight-only", "int8"])
def test_quantized_serving_step_lowers_for_tpu(tmp_path, monkeypatch, quantization):
    """The whole serving step of an int8 bf16 engine, built as on a TPU (jax.default_backend() says
    "tpu" while it is traced: real bf16 arrays, the Pallas attention kernel, int8 activations for
    `int8`) and lowered for platforms=["tpu"] with jax.export: every step graph lowers (the kernel
    through Mosaic); W8A8 multiplies int8 x int8 -> int32 in every projection and the lm head, W8A16
    never does; the LoRA delta stays bf16. Shapes: the 8B's head_dim 128 and its 4:1 heads."""
    from jlora import LLM
    from jlora.bench.tpu import shapes as tpu
    from jlora.engine.runner import pack_batch
    from jlora.models import llama

    monkeypatch.setitem(tpu.SHAPES, "tpu-lowering", dict(
        hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=1,
        head_dim=128, vocab_size=512, tie_word_embeddings=False))
    path = tmp_path / "ckpt"
    tpu.write_checkpoint(path, "tpu-lowering")
    monkeypatch.setattr(jax, "default_backend", lambda: "tpu")
    try:
        llm = LLM(str(path), dtype="bfloat16", quantization=quantization, max_model_len=256, max_num_seqs=8,
                  max_num_batched_tokens=128, token_buckets=(128,), decode_row_buckets=(8,), max_loras=2,
                  max_lora_rank=8, warmup=False, progress=False, weights_cache=False, use_compilation_cache=False)
        runner = llm.engine.runner
        assert runner.attn_impl == "pallas" and llm.engine._async
        assert {str(w.dtype) for w in runner._weights} == {"bfloat16", "float32", "int8"}  # no uint16 bits
        for shape in llm.config.step_shapes():
            batch = runner.empty_batch(shape)
            sampling = dict(batch["sampling"])
            extra = runner._defaults(shape[0], sampling.pop("history").shape[1], sampling.pop("allowed").shape[1])
            ints, floats, layout = pack_batch({**batch, "sampling": sampling})
            exp = jax.export.export(runner._step, platforms=["tpu"])(
                runner._weights, runner.lora.state, runner.cache, ints, floats, *extra, layout=layout,
                lora_impl="auto", attn_chunk=runner.attn_chunk, attn_impl=runner.attn_impl)
            text = exp.mlir_module()
            assert "tpu_custom_call" in text  # the attention kernel, lowered by Mosaic
            dots = [ln for ln in text.splitlines() if "stablehlo.dot_general" in ln]
            int8 = [ln for ln in dots if re.search(r"\(tensor<[0-9x]+xi8>, tensor<[0-9x]+xi8>\) -> tensor<[0-9x]+xi32>", ln)]
            # 4 projections in the layer scan, each in both branches of its LoRA conditional (the TPU's
            # lora_cond "inside"), + the lm head (+ the prompt-logprob head in a prefill step).
            assert llm.config.tuning.resolved_lora_cond(jax.default_backend()) == "inside"
            assert len(int8) == (0 if quantization == "int8-weight-only" else 9 + (shape[1] > 0)), (shape, int8)
            if quantization == "int8-weight-only":  # the head [512, 256] widened in the dot, not chunk by chunk in f32
                assert any(re.search(r"tensor<512x256xbf16>\) -> tensor<[0-9x]+x512xf32>", ln) for ln in dots), shape
                assert not any("tensor<512x256xf32>" in ln for ln in dots), shape
            # The LoRA shrink (x [T, 256] by every slot's A lanes) multiplies bf16 by bf16.
            assert any(re.search(r"\(tensor<[0-9x]+xbf16>, tensor<2x256x(8|16|24)xbf16>\)", ln) for ln in dots), shape
    finally:
        jax.clear_caches()  # nothing traced as for a TPU is reused by a later test on the CPU
