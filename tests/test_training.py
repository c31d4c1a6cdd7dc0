"""Train and serve: gradients through every trainable lora_delta, the training forward against the
serving forward and against torch + peft's gradients, PEFT export that peft loads."""

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import optax
import peft
import pytest
import torch
import transformers
from jax.test_util import check_grads

from jlora.adapters import read_peft_adapter
from jlora.adapters.training import _targets, init_lora_params, lora_params_from_adapter, peft_tensors, save_peft
from jlora.kernels import lora_delta
from jlora.models import build_model, init_cache, read_hf_checkpoint
from jlora.models.config import PACKED_MODULES

V = 256
ADAPTER = dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "o_proj", "gate_proj", "down_proj"],
               rank_pattern={"v_proj": 6}, alpha_pattern={"down_proj": 3}, use_rslora=True)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny random Llama written by transformers, a peft adapter on it (non-zero B), and jlora's model."""
    root = tmp_path_factory.mktemp("train")
    torch.manual_seed(0)
    hf_cfg = transformers.LlamaConfig(vocab_size=V, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                                      rms_norm_eps=1e-5, tie_word_embeddings=False)
    base = transformers.LlamaForCausalLM(hf_cfg).eval()
    base.save_pretrained(root / "base", safe_serialization=True)
    torch.manual_seed(1)
    pm = peft.get_peft_model(transformers.LlamaForCausalLM.from_pretrained(root / "base"),
                             peft.LoraConfig(init_lora_weights=False, **ADAPTER))
    pm.save_pretrained(root / "ad")
    cfg, tensors = read_hf_checkpoint(root / "base")
    return root, cfg, build_model(cfg, tensors)


def tokens(b=2, t=12, seed=0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, V, size=(b, t)).astype(np.int32)


def ce_loss(logits, ids):  # next-token cross entropy, mean over positions
    return optax.softmax_cross_entropy_with_integer_labels(logits[:, :-1], ids[:, 1:]).mean()


# ---- kernels ----------------------------------------------------------------------------------------------

TRAINABLE = {
    "gather": dict(impl="gather"), "laned": dict(impl="laned"),
    "pallas_tpu": dict(impl="pallas", interpret=True),  # Mosaic kernel in interpret mode
}


@pytest.mark.parametrize("splits", [None, (24, 8, 8)])
@pytest.mark.parametrize("name", list(TRAINABLE))
def test_lora_delta_gradients(name, splits):
    """check_grads (reverse mode, against finite differences) and equality with gather's gradients,
    with a token on no adapter and a packed module."""
    rng = np.random.default_rng(0)
    t, d, n, r = 8, 32, 3, 4
    s = 1 if splits is None else len(splits)
    o = 40 if splits is None else sum(splits)
    x = jnp.asarray(rng.standard_normal((t, d)), jnp.float32)
    a = jnp.asarray(rng.standard_normal((n, d, s * r)) / 4, jnp.float32)
    b = jnp.asarray(rng.standard_normal((n, r, o)) / 4, jnp.float32)
    slots = jnp.asarray([0, 1, 2, -1, 0, 2, 1, 1], jnp.int32)
    f = partial(lambda x, a, b, kw: lora_delta(x, a, b, slots, splits=splits, **kw), kw=TRAINABLE[name])
    check_grads(f, (x, a, b), order=1, modes=["rev"], atol=1e-2, rtol=1e-2)

    def loss(fn):
        return lambda x, a, b: jnp.sum(jnp.sin(fn(x, a, b)))

    want = jax.grad(loss(partial(lambda x, a, b: lora_delta(x, a, b, slots, impl="gather", splits=splits))),
                    argnums=(0, 1, 2))(x, a, b)
    got = jax.grad(loss(f), argnums=(0, 1, 2))(x, a, b)
    for w, g in zip(want, got):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-5, atol=1e-5)
    assert float(jnp.abs(got[1][:, :, :]).max()) > 0  # the weight gradients are not trivially zero


# ---- the training forward ----------------------------------------------------------------------------------


@pytest.mark.slow  # training runs, 25-40 s each
def test_train_logits_equal_the_serving_forward(tiny):
    _, cfg, model = tiny
    params = init_lora_params(cfg, ADAPTER, jax.random.key(0), num_adapters=2)
    params = jax.tree.map(lambda p: p + 0.05 * jax.random.normal(jax.random.key(1), p.shape), params)
    ids = tokens()
    slots = jnp.asarray([1, 0], jnp.int32)
    got = model.train_logits(jnp.asarray(ids), params, slots)
    pos = np.tile(np.arange(ids.shape[1], dtype=np.int32), (2, 1))
    want, _ = model(jnp.asarray(ids), jnp.asarray(pos), init_cache(cfg, 2, ids.shape[1]), params, slots)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="lora_impl='grouped' cannot be differentiated"):
        model.train_logits(jnp.asarray(ids), params, slots, lora_impl="grouped")


def test_gradients_equal_torch_peft(tiny):
    """d(loss)/d(lora_A, lora_B) of a peft adapter in torch equals jlora's gradient of the same
    loss in its served layout, mapped back (A transposed; B scaled by the PEFT scale)."""
    root, cfg, model = tiny
    ids = tokens(seed=3)
    base = transformers.LlamaForCausalLM.from_pretrained(root / "base")
    pm = peft.PeftModel.from_pretrained(base, root / "ad", is_trainable=True)
    out = pm(input_ids=torch.from_numpy(ids.astype(np.int64)))
    loss = torch.nn.functional.cross_entropy(out.logits[:, :-1].reshape(-1, V).float(),
                                             torch.from_numpy(ids[:, 1:].astype(np.int64)).reshape(-1))
    loss.backward()
    ref = {n.replace(".default", ""): p.grad.numpy() for n, p in pm.named_parameters() if p.grad is not None}

    adapter = read_peft_adapter(root / "ad", cfg, 8)
    params = lora_params_from_adapter(adapter, cfg)
    jloss, grads = jax.value_and_grad(lambda p: ce_loss(model.train_logits(jnp.asarray(ids), p), ids))(params)
    np.testing.assert_allclose(float(jloss), float(loss.detach()), rtol=1e-5)
    # The gradient in PEFT's naming: the export of a gradient is the gradient of the export
    # up to the scale, which multiplies B's gradient instead of dividing it.
    mapped = peft_tensors(grads, cfg, ADAPTER)
    scales = {t[3]: t[6] for t in _targets(cfg, ADAPTER)}  # module -> PEFT scale (the same in every layer)
    assert len(ref) == len(mapped) == 2 * 2 * 5
    for key, g in mapped.items():
        module = key.split(".")[-3]
        want = ref[key]
        if ".lora_B." in key:
            g = g * scales[module] ** 2  # peft_tensors divided by the scale; the gradient needs a product
        np.testing.assert_allclose(g, want, rtol=1e-4, atol=1e-6, err_msg=key)


# ---- PEFT export --------------------------------------------------------------------------------------------


def _peft_logits(root, adapter_dir, ids):
    base = transformers.LlamaForCausalLM.from_pretrained(root / "base")
    pm = peft.PeftModel.from_pretrained(base, adapter_dir).eval()
    with torch.no_grad():
        return pm(input_ids=torch.from_numpy(ids.astype(np.int64))).logits.numpy()


def test_save_peft_round_trips_a_peft_adapter(tiny, tmp_path):
    """peft -> jlora's layout -> save_peft -> peft: the same tensors and the same logits, with
    rank_pattern, alpha_pattern and rsLoRA (packed q/k/v and gate/up split back)."""
    root, cfg, _ = tiny
    params = lora_params_from_adapter(read_peft_adapter(root / "ad", cfg, 8), cfg)
    out = save_peft(params, ADAPTER, tmp_path / "export", cfg)
    from safetensors.numpy import load_file

    orig = {k.replace(".default", ""): v for k, v in load_file(root / "ad" / "adapter_model.safetensors").items()}
    back = load_file(out / "adapter_model.safetensors")
    assert sorted(back) == sorted(orig)
    for k in orig:
        np.testing.assert_allclose(back[k], orig[k], rtol=1e-6, atol=1e-7, err_msg=k)
    ids = tokens(seed=4)
    np.testing.assert_allclose(_peft_logits(root, out, ids), _peft_logits(root, root / "ad", ids),
                               rtol=1e-5, atol=1e-5)


@pytest.mark.slow  # training runs, 25-40 s each
def test_train_steps_then_export_match_peft(tiny, tmp_path):
    """A few optax Adam steps: the loss falls, untargeted lanes stay exactly zero, and the
    exported adapter gives in peft the logits jlora's training forward gives."""
    root, cfg, model = tiny
    ids = tokens(b=4, t=16, seed=5)
    params = init_lora_params(cfg, ADAPTER, jax.random.key(2))
    zero = jax.tree.map(lambda p: np.asarray(p) == 0, params)  # B is all zero at init
    opt = optax.adam(1e-2)
    state = opt.init(params)

    @jax.jit
    def step(params, state):
        loss, g = jax.value_and_grad(lambda p: ce_loss(model.train_logits(jnp.asarray(ids), p), ids))(params)
        upd, state = opt.update(g, state)
        return optax.apply_updates(params, upd), state, loss

    losses = []
    for _ in range(8):
        params, state, loss = step(params, state)
        losses.append(float(loss))
    assert losses[-1] < losses[0] - 0.1, losses
    masks = {f: {k: np.zeros(v.shape, bool) for k, v in ab.items()} for f, ab in params.items()}
    shapes = cfg.packed_shapes()
    for i, fused, s, _, _, r, _ in _targets(cfg, ADAPTER):
        rank = params[fused]["B"].shape[2]
        masks[fused]["A"][i, :, :, s * rank: s * rank + r] = True
        col = sum(shapes[fused][1][:s])
        masks[fused]["B"][i, :, :r, col: col + shapes[fused][1][s]] = True
    for f, ab in params.items():
        for k, v in ab.items():
            v = np.asarray(v)
            assert np.all(v[~masks[f][k]] == 0), (f, k)  # never trained
            assert np.any(v[masks[f][k] & zero[f][k]] != 0) or k == "A", (f, k)  # B did train
    assert set(params) == set(PACKED_MODULES)  # every packed module has a target here

    out = save_peft(params, ADAPTER, tmp_path / "trained", cfg)
    ev = tokens(seed=6)
    np.testing.assert_allclose(_peft_logits(root, out, ev), np.asarray(model.train_logits(jnp.asarray(ev), params)),
                               rtol=1e-4, atol=1e-4)


def test_export_refuses_what_it_would_drop(tiny, tmp_path):
    _, cfg, _ = tiny
    params = init_lora_params(cfg, ADAPTER, jax.random.key(0))
    params["qkv_proj"]["A"] = params["qkv_proj"]["A"].at[0, 0, 0, 4].set(1.0)  # k_proj's lanes: not targeted
    with pytest.raises(ValueError, match="non-zero qkv_proj.A weights .* that config does not target"):
        save_peft(params, ADAPTER, tmp_path / "x", cfg)
    assert not (tmp_path / "x").exists()
    with pytest.raises(ValueError, match="target_modules is required"):
        init_lora_params(cfg, {"r": 4}, jax.random.key(0))
    with pytest.raises(ValueError, match="rank=2 is below the config's largest module rank 6"):
        init_lora_params(cfg, ADAPTER, jax.random.key(0), rank=2)
    with pytest.raises(ValueError, match="use_dora"):
        init_lora_params(cfg, {**ADAPTER, "use_dora": True}, jax.random.key(0))


# ---- serving what was trained --------------------------------------------------------------------------------


@pytest.mark.slow  # training runs, 25-40 s each
def test_train_step_then_update_adapter_serves_it_without_compiling(tiny_dir, tmp_path):
    """Through LLM on the tiny engine model: a train step, `update_adapter`, and the served
    output changes to exactly what the new weights give (the same weights from a PEFT directory
    give the same tokens); a request already running keeps the version it started with; no
    XLA compile after warm-up; nothing is written to the adapter disk cache."""
    from jlora import LLM, SamplingParams, compile_stats

    cache = tmp_path / "adapter-cache"
    llm = LLM(str(tiny_dir[0]), progress=False, max_model_len=128, max_num_seqs=4, max_num_batched_tokens=32,
              max_loras=2, max_lora_rank=8, token_buckets=(32,), adapter_cache=cache)
    cfg = llm.model.cfg
    config = dict(r=8, lora_alpha=16, target_modules="all-linear")
    prompt = "The quick brown fox"
    ids = np.asarray([llm.tokenizer.encode(prompt + " jumps over the lazy dog again and again")], np.int32)
    sp = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)

    params = init_lora_params(cfg, config, jax.random.key(0))
    opt = optax.adam(5e-2)
    state = opt.init(params)

    def train_step(params, state):
        g = jax.grad(lambda p: ce_loss(llm.model.train_logits(jnp.asarray(ids), p), ids))(params)
        upd, state = opt.update(g, state)
        return optax.apply_updates(params, upd), state

    base = llm.generate([prompt], sp)[0].outputs[0].text
    v1 = llm.update_adapter("trained", params, config, 5)  # B = 0: the base model's answer
    assert llm.generate([prompt], sp, lora_request=v1)[0].outputs[0].text == base
    for _ in range(3):
        params, state = train_step(params, state)
    v2_params = params

    compiles = compile_stats.compile_count()
    stream = llm.generate_stream(prompt, sp, lora_request=v1)
    first = [next(stream), next(stream)]  # v1 is running ...
    v2 = llm.update_adapter("trained", v2_params, config, 5)  # ... when v2 arrives
    assert "".join(first + list(stream)) == base  # it finished on the weights it started with
    served = llm.generate([prompt], sp, lora_request=v2)[0].outputs[0].text
    assert served != base
    exported = save_peft(v2_params, config, tmp_path / "v2", cfg)
    from jlora import LoRARequest

    from_dir = llm.generate([prompt], sp, lora_request=LoRARequest("from-dir", 6, str(exported)))
    assert from_dir[0].outputs[0].text == served
    assert compile_stats.compile_count() == compiles
    assert v1.content_hash != v2.content_hash and v1.lora_name == v2.lora_name
    # Only the PEFT directory's conversion reached the disk cache; the updates did not.
    entries = [p for p in cache.iterdir() if p.is_dir() and p.name != "hashes" and not p.name.startswith(".")]
    assert len(entries) == 1  # ("hashes" memoizes file digests; it is not an entry)
