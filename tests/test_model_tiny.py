"""The NNX Llama on a tiny random HF checkpoint against transformers, and its LoRA layer."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from flax import nnx

from jlora.models import LlamaConfig, build_model, init_cache, load_model, read_hf_checkpoint
from jlora.models.loading import restore_model, save_model


@pytest.fixture(scope="module")
def hf_tiny(tmp_path_factory):
    """A tiny random Llama 3-style checkpoint (rope scaling, untied head) written by transformers."""
    cfg = transformers.LlamaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=256, tie_word_embeddings=False,
        rms_norm_eps=1e-5, rope_theta=500000.0,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 32},
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).eval()
    path = tmp_path_factory.mktemp("tiny_llama")
    model.save_pretrained(path, safe_serialization=True)
    return path, model


def hf_logits(model, ids: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor(ids)).logits.numpy()


def test_hf_checkpoint_loads_and_matches_transformers(hf_tiny):
    path, ref = hf_tiny
    cfg, tensors = read_hf_checkpoint(path)
    assert cfg.rope_scaling_dict["rope_type"] == "llama3" and not cfg.tie_word_embeddings
    model = build_model(cfg, tensors)
    ids = np.random.default_rng(0).integers(0, 128, size=(2, 40)).astype(np.int32)
    pos = np.broadcast_to(np.arange(40, dtype=np.int32), (2, 40))
    logits, _ = model(jnp.asarray(ids), jnp.asarray(pos), init_cache(cfg, 2, 64))
    np.testing.assert_allclose(np.asarray(logits), hf_logits(ref, ids), rtol=1e-4, atol=1e-4)


def test_incremental_decode_with_kv_cache_equals_full_forward(hf_tiny):
    path, ref = hf_tiny
    model, _, _ = load_model(path)
    ids = np.random.default_rng(1).integers(0, 128, size=(1, 24)).astype(np.int32)
    full = hf_logits(ref, ids)[0]
    cache = init_cache(model.cfg, 1, 32)
    # Prefill 16 tokens padded to 20 (padding positions = -1), then decode one token at a time.
    toks = np.zeros((1, 20), np.int32)
    pos = np.full((1, 20), -1, np.int32)
    toks[0, :16], pos[0, :16] = ids[0, :16], np.arange(16)
    logits, cache = model(jnp.asarray(toks), jnp.asarray(pos), cache, logits_index=jnp.array([15]))
    np.testing.assert_allclose(np.asarray(logits[0]), full[15], rtol=1e-4, atol=1e-4)
    for t in range(16, 24):
        logits, cache = model(jnp.asarray(ids[:, t:t + 1]), jnp.array([[t]]), cache,
                              logits_index=jnp.array([0]))
        np.testing.assert_allclose(np.asarray(logits[0]), full[t], rtol=1e-4, atol=1e-4)


def test_paged_cache_with_scattered_blocks_equals_full_forward(hf_tiny):
    # Two sequences share one pool of 4-token blocks, in a scrambled order; the second has a
    # shorter prompt. Prefill, then decode: every step must match the full forward.
    path, ref = hf_tiny
    model, _, _ = load_model(path)
    ids = np.random.default_rng(2).integers(0, 128, size=(2, 20)).astype(np.int32)
    full = hf_logits(ref, ids)
    cache = init_cache(model.cfg, 16, 4)  # 16 blocks of 4 positions
    tables = jnp.array([[9, 2, 14, 5, 0, 11], [3, 15, 7, 1, 12, 6]], jnp.int32)  # 6 blocks = span 24
    lens = [13, 9]
    toks = np.zeros((2, 16), np.int32)
    pos = np.full((2, 16), -1, np.int32)
    for b, n in enumerate(lens):
        toks[b, :n], pos[b, :n] = ids[b, :n], np.arange(n)
    logits, cache = model(jnp.asarray(toks), jnp.asarray(pos), cache, logits_index=jnp.array([12, 8]),
                          block_tables=tables)
    for b, n in enumerate(lens):
        np.testing.assert_allclose(np.asarray(logits[b]), full[b, n - 1], rtol=1e-4, atol=1e-4)
    for step in range(7):
        p = np.array([lens[0] + step, lens[1] + step])
        logits, cache = model(jnp.asarray(ids[[0, 1], p][:, None]), jnp.asarray(p[:, None].astype(np.int32)), cache,
                              logits_index=jnp.array([0, 0]), block_tables=tables)
        for b in range(2):
            np.testing.assert_allclose(np.asarray(logits[b]), full[b, p[b]], rtol=1e-4, atol=1e-4)


def test_orbax_round_trip(hf_tiny, tmp_path):
    path, ref = hf_tiny
    model, _, _ = load_model(path)
    save_model(model, tmp_path / "ckpt")
    again = restore_model(tmp_path / "ckpt")
    ids = jnp.arange(8, dtype=jnp.int32)[None]
    pos = jnp.arange(8, dtype=jnp.int32)[None]
    a, _ = model(ids, pos, init_cache(model.cfg, 1, 8))
    b, _ = again(ids, pos, init_cache(model.cfg, 1, 8))
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    c, _, _ = load_model(tmp_path / "ckpt")  # load_model recognises the orbax layout too
    np.testing.assert_array_equal(np.asarray(c(ids, pos, init_cache(model.cfg, 1, 8))[0]), np.asarray(a))


def test_lora_linear_matches_dense_reference_per_token():
    from jlora.models.llama import lora_linear

    rng = np.random.default_rng(2)
    d, o, n, r, t = 24, 40, 3, 5, 9
    w = rng.normal(size=(d, o)).astype(np.float32)
    a = rng.normal(size=(n, d, r)).astype(np.float32)
    b = rng.normal(size=(n, r, o)).astype(np.float32)
    x = rng.normal(size=(1, t, d)).astype(np.float32)
    slots = np.array([0, 2, -1, 1, 1, -1, 2, 0, -1], np.int32)
    for impl in ("gather", "laned"):
        y = np.asarray(lora_linear(jnp.asarray(x[0]), jnp.asarray(w), {"A": jnp.asarray(a), "B": jnp.asarray(b)},
                                   jnp.asarray(slots), impl))[None]
        for i, s in enumerate(slots):
            dense = w + (a[s] @ b[s] if s >= 0 else 0.0)  # W + scale*A@B, scale folded into B
            np.testing.assert_allclose(y[0, i], x[0, i] @ dense, rtol=1e-4, atol=1e-4)


def test_padding_tokens_never_read_a_slot():
    cfg = LlamaConfig.preset("tiny")
    from jlora.models import Llama, init_lora_state

    m = Llama(cfg, rngs=nnx.Rngs(0))
    lora = init_lora_state(cfg, max_loras=2, max_rank=4)
    # Fill every slot with large values: any leak into padding or base rows would show.
    lora = jax.tree.map(lambda z: jnp.full_like(z, 0.5), lora)
    toks = jnp.array([[5, 6, 7, 0], [5, 6, 7, 0]], jnp.int32)
    pos = jnp.array([[0, 1, 2, -1], [0, 1, 2, -1]], jnp.int32)
    base, base_cache = m(toks, pos, init_cache(cfg, 2, 8))
    mixed, mixed_cache = m(toks, pos, init_cache(cfg, 2, 8), lora, jnp.array([-1, 1], jnp.int32))
    np.testing.assert_allclose(np.asarray(mixed[0, :3]), np.asarray(base[0, :3]), rtol=1e-5, atol=1e-5)
    assert not np.allclose(np.asarray(mixed[1, :3]), np.asarray(base[1, :3]))  # the slot is read by real tokens
    # The padding token of the row with an adapter computes exactly what it computes without one:
    # its projections read no slot (a slot 0.5 everywhere would move every logit) ...
    np.testing.assert_allclose(np.asarray(mixed[:, 3]), np.asarray(base[:, 3]), rtol=1e-5, atol=1e-5)
    # ... and it writes no key or value: position 3 of both caches stays zero.
    for c in (base_cache, mixed_cache):
        assert not np.asarray(c["k"])[:, :, 3].any() and not np.asarray(c["v"])[:, :, 3].any()


def test_missing_model_and_malformed_config(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_model(tmp_path / "nope.gguf")
    with pytest.raises(FileNotFoundError, match="hub names are not supported"):  # what a vLLM user types first
        load_model("HuggingFaceTB/SmolLM2-135M-Instruct")
    from jlora.models.loading import _looks_like_hub_name

    assert not any(_looks_like_hub_name(p) for p in ("models/x.gguf", "./a/b", "/abs/path", "a/b/c", "~/m"))
    (tmp_path / "config.json").write_text("{not json")
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(ValueError, match="malformed config.json"):
        load_model(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 8}))
    with pytest.raises(ValueError, match="missing required fields"):
        load_model(tmp_path)


def test_where_lora_is_sliced_or_skipped_changes_nothing():
    """TuningOptions.lora_slices (a layer's slots sliced inside the LoRA conditional or before it),
    lora_cond (the base projection before the conditional or inside its branches) and lora_skip
    (False: LoRA computed for every token, no conditional; what a shape with a base graph runs) give
    the logits the defaults give, bit for bit, with adapters and without."""
    from jlora.models import Llama, init_lora_state, llama
    from jlora.tuning import TuningOptions

    cfg = LlamaConfig.preset("tiny")
    m = Llama(cfg, rngs=nnx.Rngs(0))
    rng = np.random.default_rng(3)
    state = init_lora_state(cfg, max_loras=2, max_rank=4, dora=True)
    # Plain adapters (DoRA factors "M" zero): bit for bit below. DoRA factors: to float32 rounding
    # (XLA:CPU fuses the factor's multiply differently without the conditional).
    dora = jax.tree.map(lambda z: jnp.asarray(rng.normal(size=z.shape) * 0.1, z.dtype), state)
    lora = {k: dict(v, M=jnp.zeros_like(v["M"])) if "M" in v else v for k, v in dora.items()}
    toks = jnp.array([[5, 6, 7, 8], [9, 10, 11, 12]], jnp.int32)
    pos = jnp.tile(jnp.arange(4, dtype=jnp.int32), (2, 1))
    def logits(ids, skip=True, tuning=TuningOptions()):
        slot_ids = jnp.where(pos >= 0, jnp.array(ids, jnp.int32)[:, None], -1).reshape(-1)
        x, _ = m.forward(toks.reshape(-1), slot_ids, (llama.AttnGroup(pos, jnp.arange(2, dtype=jnp.int32)[:, None]),),
                         init_cache(cfg, 2, 8), lora, lora_skip=skip, tuning=tuning)
        return np.asarray(m.logits(x))

    got = {}
    for variant in ("inside", "before", "no skip", "base inside the cond"):
        tuning = TuningOptions(lora_slices=variant if variant in ("inside", "before") else "inside",
                               lora_cond="inside" if variant == "base inside the cond" else "pass")
        got[variant] = [logits(ids, variant != "no skip", tuning) for ids in ([-1, -1], [0, 1], [-1, 1])]
    for variant in ("before", "no skip", "base inside the cond"):
        for a, b in zip(got["inside"], got[variant]):
            np.testing.assert_array_equal(a, b)
    first = got["inside"]
    assert not np.allclose(first[0], first[1])  # the slots are read
    np.testing.assert_array_equal(first[2][:4], first[0][:4])  # a row without an adapter reads none
    lora = {k: {n: a for n, a in v.items() if n != "M"} for k, v in dora.items()}  # slots without enable_dora
    np.testing.assert_array_equal(logits([0, 1]), first[1])  # zero factors: the step without them, bit for bit
    lora = dora
    with_dora = {v: [logits([0, 1], v != "no skip", TuningOptions(lora_slices="before" if v == "before" else "inside"))]
                 for v in ("inside", "before", "no skip")}
    assert not np.allclose(with_dora["inside"][0], first[1])  # the factors are applied
    for v in ("before", "no skip"):
        np.testing.assert_allclose(with_dora[v][0], with_dora["inside"][0], rtol=1e-5, atol=1e-6)

    # int8 weights (QArrays): "inside" slices each layer's int8 rows and scales inside the branches
    from jlora.models import quant

    m = quant.quantize_model(m, "int8-weight-only")
    q = {}
    for cond in ("pass", "inside"):
        q[cond] = [logits(ids, tuning=TuningOptions(lora_cond=cond)) for ids in ([-1, -1], [0, 1])]
    for a, b in zip(q["pass"], q["inside"]):  # (XLA:CPU fuses the dequantizing multiply differently
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-6)  # inside a branch: float rounding only)
    assert not np.allclose(q["inside"][0], first[0])  # the int8 weights are the ones read
