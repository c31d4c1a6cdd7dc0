"""Model families (Mistral, Qwen2/2.5, Qwen3, Llama with biases) on tiny random checkpoints written
by transformers itself: logits, greedy tokens and peft adapters against transformers + peft, bf16
and int8 agreement, GGUF round trips as llama.cpp writes them, and the refusals."""

import json

import jax.numpy as jnp
import numpy as np
import peft
import pytest
import torch
import transformers

from jlora import LLM, LoRARequest, SamplingParams
from jlora.models import LlamaConfig, build_model, init_cache, load_model, read_hf_checkpoint
from jlora.models.loading import read_gguf
from jlora.models.llama import Llama

VOCAB = 49152  # the default model's tokenizer, so the engine can run these checkpoints
BASE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2)

# name -> (config class, model class, extra config): each switch of the family is on somewhere.
FAMILIES = {
    # Sliding window narrower than the prompts, so the window changes the answer.
    "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM,
                dict(head_dim=16, sliding_window=24, tie_word_embeddings=False, rope_theta=10000.0)),
    # q/k/v biases, tied head; sliding window on the second layer only (max_window_layers).
    "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM,
              dict(tie_word_embeddings=True, use_sliding_window=True, sliding_window=20, max_window_layers=1,
                   rope_theta=1000000.0)),
    # Per-head q/k RMSNorm, head_dim (24) unlike hidden/heads (16), biases on q/k/v and o.
    "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM,
              dict(head_dim=24, attention_bias=True, tie_word_embeddings=False, rope_theta=1000000.0)),
    # Llama with attention_bias (q/k/v and o biases).
    "llama_bias": (transformers.LlamaConfig, transformers.LlamaForCausalLM,
                   dict(head_dim=16, attention_bias=True, tie_word_embeddings=False)),
}
ENGINE = dict(max_model_len=128, max_num_seqs=4, max_num_batched_tokens=64, max_loras=2, max_lora_rank=8,
              token_buckets=(64,), attn_chunk=16, block_size=16, warmup=False, progress=False,
              weights_cache=False, adapter_cache=False)


WINDOW_KEYS = ("use_sliding_window", "sliding_window", "max_window_layers")


def make_checkpoint(root, name: str, seed: int = 0, window: bool = True):
    """A random checkpoint (biases and norms made non-trivial) plus the GGUF tokenizer, in HF format."""
    from jlora.models import default_model_path
    from jlora.tokenizer import load_gguf_tokenizer

    cfg_cls, model_cls, extra = FAMILIES[name]
    cfg = cfg_cls(**BASE, **{k: v for k, v in extra.items() if window or k not in WINDOW_KEYS})
    cfg._attn_implementation = "eager"  # the reference applies the sliding window exactly
    torch.manual_seed(seed)
    model = model_cls(cfg).eval()
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.endswith(".bias") or "norm" in n:  # zeros / ones by default: make them matter
                p.add_(torch.randn_like(p) * 0.3)
        # Sharper than uniform, so greedy tokens are well separated (as tests/conftest.py's tiny model).
        (model.model.embed_tokens if cfg.tie_word_embeddings else model.lm_head).weight.mul_(4.0)
    path = root / name
    model.save_pretrained(path, safe_serialization=True)
    load_gguf_tokenizer(default_model_path()).save_pretrained(path)
    return path, model


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, tmp_path_factory):
    path, model = make_checkpoint(tmp_path_factory.mktemp("families"), request.param)
    return request.param, path, model


def hf_logits(model, ids: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor(ids, dtype=torch.long)).logits.float().numpy()


def jlora_logits(model: Llama, ids: np.ndarray) -> np.ndarray:
    b, t = ids.shape
    pos = np.tile(np.arange(t, dtype=np.int32), (b, 1))
    out, _ = model(jnp.asarray(ids), jnp.asarray(pos), init_cache(model.cfg, b, t, jnp.float32))
    return np.asarray(out)


def ids_for(seed: int, b: int = 2, t: int = 48) -> np.ndarray:  # longer than every window above
    return np.random.default_rng(seed).integers(3, VOCAB, size=(b, t)).astype(np.int32)


def test_config_reads_the_family(family):
    name, path, _ = family
    cfg, _ = read_hf_checkpoint(path)
    expected = {
        "mistral": dict(model_type="mistral", qkv_bias=False, o_bias=False, qk_norm=False, sliding_windows=(24, 24)),
        "qwen2": dict(model_type="qwen2", qkv_bias=True, o_bias=False, qk_norm=False, sliding_windows=(None, 20)),
        "qwen3": dict(model_type="qwen3", qkv_bias=True, o_bias=True, qk_norm=True, sliding_windows=None,
                      head_dim=24),
        "llama_bias": dict(model_type="llama", qkv_bias=True, o_bias=True, qk_norm=False, sliding_windows=None),
    }[name]
    assert {k: getattr(cfg, k) for k in expected} == expected


def test_logits_match_transformers(family):
    _, path, ref = family
    model, _, _ = load_model(path)
    ids = ids_for(0)
    np.testing.assert_allclose(jlora_logits(model, ids), hf_logits(ref, ids), rtol=1e-4, atol=1e-4)


def test_bf16_and_int8_agree_with_float32(family):
    """The agreement the int8/bf16 step defines on tiny models (tests/test_quant.py): max logit
    error within 2% (bf16, int8 weight-only) and 6% (W8A8) of the largest logit."""
    _, path, ref = family
    cfg, tensors = read_hf_checkpoint(path)
    ids = ids_for(1)
    want = hf_logits(ref, ids)
    scale = np.abs(want).max()
    for dtype, quantization, tol in [(jnp.bfloat16, None, 0.02), (jnp.float32, "int8-weight-only", 0.02),
                                     (jnp.float32, "int8", 0.06)]:
        got = jlora_logits(build_model(cfg, tensors, dtype, quantization), ids)
        err = np.abs(got - want).max()
        assert err < tol * scale, (dtype, quantization, err, scale)


def test_engine_greedy_and_peft_adapter_match(family, tmp_path):
    """Through LLM: greedy tokens of the base model and of a peft adapter (all linear layers, in
    one batch) equal transformers' and peft's; the adapter's prompt logprobs equal peft's."""
    name, path, ref = family
    torch.manual_seed(7)
    pm = peft.get_peft_model(ref, peft.LoraConfig(r=8, lora_alpha=16, target_modules="all-linear",
                                                   init_lora_weights=False), adapter_name="ad")
    with torch.no_grad():
        for n, p in pm.named_parameters():
            if "lora_B" in n:
                p.mul_(3.0)
    pm.save_pretrained(tmp_path, selected_adapters=["ad"])
    pm.eval()
    prompt = [int(t) for t in ids_for(2, 1, 40)[0]]
    with torch.no_grad():
        with pm.disable_adapter():
            base_ref = pm.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False,
                                   min_new_tokens=12)[0, len(prompt):].tolist()
        ad_ref = pm.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False,
                             min_new_tokens=12)[0, len(prompt):].tolist()
        ad_lp = torch.log_softmax(pm(torch.tensor([prompt])).logits[0].double(), -1).numpy()
    pm.unload()
    assert base_ref != ad_ref  # the adapter changes the answer, so the comparison below means something

    llm = LLM(str(path), **ENGINE)
    lora = LoRARequest(f"{name}-ad", 1, str(tmp_path / "ad"))
    sp = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    sp_lp = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, prompt_logprobs=0)
    base, adapted = llm.generate([{"prompt_token_ids": prompt}] * 2, [sp, sp_lp], lora_request=[None, lora])
    assert base.outputs[0].token_ids == base_ref
    assert adapted.outputs[0].token_ids == ad_ref
    lps = adapted.prompt_logprobs
    for pos in range(1, len(prompt)):
        np.testing.assert_allclose(lps[pos][prompt[pos]], ad_lp[pos - 1, prompt[pos]], atol=1e-4)


# ---- GGUF, as llama.cpp's convert_hf_to_gguf.py writes these architectures ---------------------------


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute: HF's half-split rotary rows -> interleaved."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(path, arch: str, cfg: LlamaConfig, tensors: dict[str, np.ndarray]) -> None:
    import gguf

    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_key_length(cfg.head_dim)
    w.add_value_length(cfg.head_dim)
    w.add_rope_dimension_count(cfg.head_dim)
    w.add_rope_freq_base(cfg.rope_theta)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    names = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
             "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
             "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
             "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm"}
    for name, arr in tensors.items():
        if name == "model.embed_tokens.weight":
            gname = "token_embd.weight"
        elif name == "model.norm.weight":
            gname = "output_norm.weight"
        elif name == "lm_head.weight":
            gname = "output.weight"
        else:
            _, _, i, *mod, kind = name.split(".")
            gname = f"blk.{i}.{names['.'.join(mod)]}.{kind}"
            if arch == "llama" and mod[-1] in ("q_proj", "k_proj"):
                heads = cfg.num_attention_heads if mod[-1] == "q_proj" else cfg.num_key_value_heads
                arr = llama_cpp_permute(arr, heads)
        w.add_tensor(gname, np.ascontiguousarray(arr, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("name,arch", [("qwen2", "qwen2"), ("qwen3", "qwen3"), ("llama_bias", "llama")])
def test_gguf_round_trip(tmp_path, name, arch):
    # llama.cpp keeps no sliding window for these architectures' GGUF files; compare without one.
    path, ref = make_checkpoint(tmp_path, name, seed=3, window=False)
    cfg, tensors = read_hf_checkpoint(path)
    write_gguf(tmp_path / "m.gguf", arch, cfg, tensors)
    gcfg, gtensors, fields = read_gguf(tmp_path / "m.gguf")
    assert fields["general.architecture"] == arch
    assert (gcfg.model_type, gcfg.qkv_bias, gcfg.o_bias, gcfg.qk_norm, gcfg.head_dim) == (
        arch, cfg.qkv_bias, cfg.o_bias, cfg.qk_norm, cfg.head_dim)
    assert sorted(gtensors) == sorted(tensors)
    ids = ids_for(4)
    np.testing.assert_allclose(jlora_logits(build_model(gcfg, gtensors), ids), hf_logits(ref, ids),
                               rtol=1e-4, atol=1e-4)


# ---- refusals: named fields, before any weight is read -----------------------------------------------


def test_unsupported_model_type_is_refused_before_weights(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2", **BASE}))
    # No weights in the directory: the error must be about the model type, not a missing file.
    with pytest.raises(ValueError, match=r"model_type='gpt2' is not supported; supported: \['llama', 'mistral', "
                                         r"'qwen2', 'qwen3'\]"):
        load_model(tmp_path)
    with pytest.raises(ValueError, match="model_type='gpt2'"):
        LLM(str(tmp_path), **ENGINE)


def test_mlp_bias_is_refused(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "mlp_bias": True, **BASE}))
    with pytest.raises(ValueError, match="mlp_bias"):
        load_model(tmp_path)


def test_unsupported_gguf_architecture_is_refused(tmp_path):
    import gguf

    w = gguf.GGUFWriter(str(tmp_path / "phi.gguf"), "phi3")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((8, 4), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ValueError, match=r"general.architecture='phi3' is not supported; supported: "
                                         r"\['llama', 'qwen2', 'qwen3'\]"):
        read_gguf(tmp_path / "phi.gguf")


def test_unknown_layer_type_is_refused():
    with pytest.raises(ValueError, match="layer_types"):
        LlamaConfig.from_hf_dict({**BASE, "model_type": "qwen2", "sliding_window": 8,
                                  "layer_types": ["full_attention", "chunked_attention"]})


def test_sharded_checkpoint_and_weights_cache_keep_the_family(tmp_path):
    """A sharded save (model.safetensors.index.json) loads; the weights cache and a jlora save
    give back the same config (per-layer windows included) and the same logits."""
    from jlora.models.loading import restore_model, save_model

    cfg_cls, model_cls, extra = FAMILIES["qwen2"]
    torch.manual_seed(5)
    ref = model_cls(cfg_cls(**BASE, **extra)).eval()
    ref.config._attn_implementation = "eager"
    ref.save_pretrained(tmp_path / "sharded", safe_serialization=True, max_shard_size="1MB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").is_file()
    assert len(list((tmp_path / "sharded").glob("*.safetensors"))) > 1
    ids = ids_for(6)
    want = hf_logits(ref, ids)
    first, _, _ = load_model(tmp_path / "sharded", weights_cache=tmp_path / "wc")
    cached, _, _ = load_model(tmp_path / "sharded", weights_cache=tmp_path / "wc")
    save_model(cached, tmp_path / "saved")
    restored = restore_model(tmp_path / "saved")
    assert first.cfg == cached.cfg == restored.cfg and first.cfg.sliding_windows == (None, 20)
    for model in (first, cached, restored):
        np.testing.assert_allclose(jlora_logits(model, ids), want, rtol=1e-4, atol=1e-4)


def test_qwen2_pre_tokenizer_splits_single_digits(caplog):
    """llama.cpp's "qwen2" pre type (Qwen2/2.5/3 GGUF files): Llama 3's split with one digit per
    piece, as Qwen2's tokenizer.json does; no fallback warning."""
    from jlora.tokenizer import _pre_tokenizer

    pieces = [p for p, _ in _pre_tokenizer("qwen2").pre_tokenize_str("abc 12345 it's")]
    assert pieces == ["abc", "Ġ", "1", "2", "3", "4", "5", "Ġit", "'s"]
    assert [p for p, _ in _pre_tokenizer("llama-bpe").pre_tokenize_str("abc 12345")] == ["abc", "Ġ", "123", "45"]
    assert "unknown tokenizer.ggml.pre" not in caplog.text
