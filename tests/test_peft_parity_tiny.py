"""Parity with the real `peft` library: one mixed batch, several adapters and base rows.

A tiny random Llama is built with transformers and saved as safetensors; adapters are made with
peft (`init_lora_weights=False`, so B is non-zero) with different ranks, target_modules (list,
regex string, "all-linear"), rank_pattern / alpha_pattern, use_rslora and layers_to_transform.
jlora loads the base with `read_hf_checkpoint` + `build_model`, converts the adapters, writes
them into slots with `set_slot`, and its logits for every row must match PeftModel's with
`adapter_names=` (a mixed batch, "__base__" for base rows).
"""

from __future__ import annotations

import functools

import jax
import numpy as np
import peft  # the reference libraries: a missing one is a failure, not a skip
import pytest
import torch
import transformers
from flax import nnx

from jlora.adapters import AdapterManager, LoRARequest, LoRASlots, padded_update, read_peft_adapter, set_slot
from jlora.models import build_model, init_cache, init_lora_state, read_hf_checkpoint

MAX_RANK = 8
ADAPTERS = {
    # name: LoraConfig kwargs
    "list": dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"]),
    "regex_rslora": dict(r=8, lora_alpha=16, target_modules=r".*\.(k_proj|o_proj|up_proj)", use_rslora=True),
    "all_linear_patterns": dict(r=2, lora_alpha=4, target_modules="all-linear",
                                rank_pattern={"q_proj": 6, "layers.1.mlp.gate_proj": 3},
                                alpha_pattern={"down_proj": 2.0, "model.layers.0.self_attn.v_proj": 32}),
    "layers": dict(r=5, lora_alpha=10, target_modules=["q_proj", "gate_proj", "o_proj"], layers_to_transform=[1],
                   layers_pattern="layers", use_rslora=True, fan_in_fan_out=False),
}
# Sub-modules of the packed modules (qkv_proj, gate_up_proj) in every combination: the others of
# their packed module must contribute exactly nothing, and per-module ranks must land in their lanes.
PACKED = {
    "q_only": dict(r=4, lora_alpha=8, target_modules=["q_proj"]),
    "k_only": dict(r=3, lora_alpha=6, target_modules=["k_proj"]),
    "q_v": dict(r=6, lora_alpha=4, target_modules=["q_proj", "v_proj"]),
    "qkv_ranks": dict(r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj"],
                      rank_pattern={"q_proj": 2, "v_proj": 8}, alpha_pattern={"k_proj": 20}),
    "gate_only": dict(r=5, lora_alpha=10, target_modules=["gate_proj"]),
    "up_only": dict(r=8, lora_alpha=8, target_modules=["up_proj"], use_rslora=True),
    "gate_up_ranks": dict(r=3, lora_alpha=6, target_modules=["gate_proj", "up_proj"], rank_pattern={"up_proj": 7}),
}


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("peft_parity")
    torch.manual_seed(0)
    hf_cfg = transformers.LlamaConfig(
        vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=128, rms_norm_eps=1e-5, tie_word_embeddings=False,
    )
    base = transformers.LlamaForCausalLM(hf_cfg).eval()
    base.save_pretrained(root / "base", safe_serialization=True)
    for i, (name, kw) in enumerate({**ADAPTERS, **PACKED}.items()):
        torch.manual_seed(100 + i)
        fresh = transformers.LlamaForCausalLM.from_pretrained(root / "base")
        pm = peft.get_peft_model(fresh, peft.LoraConfig(init_lora_weights=False, **kw))
        with torch.no_grad():
            for n, p in pm.named_parameters():
                if "lora_B" in n:
                    p.mul_(3.0)  # make every adapter's effect plainly visible in the logits
        pm.save_pretrained(root / name)
    model = transformers.LlamaForCausalLM.from_pretrained(root / "base").eval()
    names = list(ADAPTERS) + list(PACKED)
    pm = peft.PeftModel.from_pretrained(model, root / names[0], adapter_name=names[0])
    for name in names[1:]:
        pm.load_adapter(root / name, adapter_name=name)
    pm.eval()
    cfg, tensors = read_hf_checkpoint(root / "base")
    jmodel = build_model(cfg, tensors)
    return root, cfg, jmodel, pm


def _tokens(bsz: int, t: int) -> np.ndarray:
    return np.random.default_rng(0).integers(0, 256, size=(bsz, t)).astype(np.int32)


def _jlora_logits(jmodel, cfg, lora_state, tokens, slots, lora_impl="auto"):
    """Full logits [B, T, V] from one jitted forward (jax.jit over nnx.split, as the engine does)."""
    bsz, t = tokens.shape
    positions = np.broadcast_to(np.arange(t, dtype=np.int32), (bsz, t))
    graphdef, params = nnx.split(jmodel)
    return np.asarray(_forward(graphdef, params, tokens, positions, init_cache(cfg, bsz, t), lora_state,
                               np.asarray(slots, np.int32), lora_impl))


@functools.partial(jax.jit, static_argnums=(0, 7))
def _forward(graphdef, params, tokens, positions, cache, lora_state, slots, lora_impl):
    logits, _ = nnx.merge(graphdef, params)(tokens, positions, cache, lora_state, slots, logits_index=None,
                                            lora_impl=lora_impl)
    return logits


def _peft_logits(pm, tokens, row_adapters):
    with torch.no_grad():
        out = pm(input_ids=torch.from_numpy(tokens.astype(np.int64)), adapter_names=row_adapters)
    return out.logits.float().numpy()


def test_converted_ranks(setup):
    root, cfg, _, _ = setup
    ad = read_peft_adapter(root / "all_linear_patterns", cfg, MAX_RANK)
    assert ad.ranks == {"q_proj": 6, "k_proj": 2, "v_proj": 2, "o_proj": 2, "gate_proj": 3, "up_proj": 2,
                        "down_proj": 2}
    ad = read_peft_adapter(root / "layers", cfg, MAX_RANK)
    assert set(ad.weights) == {"q_proj", "gate_proj", "o_proj"}
    np.testing.assert_array_equal(ad.weights["q_proj"][0][0], 0)  # layer 0 not transformed


def test_mixed_batch_matches_peft(setup):
    root, cfg, jmodel, pm = setup
    names = list(ADAPTERS)
    slot_of = {"list": 2, "regex_rslora": 0, "all_linear_patterns": 4, "layers": 1}  # scrambled; slot 3 empty
    state = init_lora_state(cfg, 5, MAX_RANK)
    for name in names:
        ad = read_peft_adapter(root / name, cfg, MAX_RANK)
        state = set_slot(state, slot_of[name], padded_update(ad, cfg, MAX_RANK))
    rows = ["list", None, "regex_rslora", "all_linear_patterns", None, "layers", "list", "all_linear_patterns"]
    tokens = _tokens(len(rows), 8)
    got = _jlora_logits(jmodel, cfg, state, tokens, [-1 if r is None else slot_of[r] for r in rows])
    want = _peft_logits(pm, tokens, ["__base__" if r is None else r for r in rows])
    base = _peft_logits(pm, tokens, ["__base__"] * len(rows))
    for b, r in enumerate(rows):
        np.testing.assert_allclose(got[b], want[b], rtol=1e-4, atol=1e-4, err_msg=f"row {b} adapter {r}")
        effect = np.abs(want[b] - base[b]).max()
        if r is None:
            assert effect == 0
        else:
            assert effect > 0.05, f"adapter {r} barely changes the logits ({effect}); the test would be vacuous"


def test_manager_path_matches_peft(setup):
    """The same through AdapterManager (PEFT dirs straight from LoRARequest: prepare, acquire the
    handle, the queued writes applied to the slot arrays as the runner does), one slot short."""
    root, cfg, jmodel, pm = setup
    mgr = AdapterManager(cfg, max_loras=3, max_lora_rank=MAX_RANK)
    dev = LoRASlots(cfg, 3, MAX_RANK)
    rows = ["layers", "regex_rslora", None, "list"]
    slots = [mgr.acquire(None if r is None else mgr.prepare(LoRARequest(r, list(ADAPTERS).index(r) + 1, str(root / r))))
             for r in rows]
    dev.write(mgr.take_writes())
    tokens = _tokens(len(rows), 6)
    got = _jlora_logits(jmodel, cfg, dev.state, tokens, slots)
    want = _peft_logits(pm, tokens, ["__base__" if r is None else r for r in rows])
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
    # evict "layers" for "all_linear_patterns" and run again
    mgr.release(slots[0])
    slots[0] = mgr.acquire(mgr.prepare(LoRARequest("all_linear_patterns", 9, str(root / "all_linear_patterns"))))
    dev.write(mgr.take_writes())
    rows[0] = "all_linear_patterns"
    got = _jlora_logits(jmodel, cfg, dev.state, tokens, slots)
    want = _peft_logits(pm, tokens, ["__base__" if r is None else r for r in rows])
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
    jax.block_until_ready(dev.state)


@pytest.mark.parametrize("impl", ["gather", "laned", "grouped", "pallas"])
def test_packed_sub_modules_match_peft(setup, impl):
    """q/k/v and gate/up adapters in every combination, one mixed batch with base rows, per kernel."""
    root, cfg, jmodel, pm = setup
    names = list(PACKED)
    state = init_lora_state(cfg, len(names), MAX_RANK)
    slot_of = {name: (3 * k + 1) % len(names) for k, name in enumerate(names)}  # scrambled
    for name in names:
        ad = read_peft_adapter(root / name, cfg, MAX_RANK)
        assert set(ad.weights) == set(PACKED[name]["target_modules"])
        state = set_slot(state, slot_of[name], padded_update(ad, cfg, MAX_RANK))
    rows = names[:4] + [None] + names[4:] + [None]
    tokens = _tokens(len(rows), 5)
    got = _jlora_logits(jmodel, cfg, state, tokens, [-1 if r is None else slot_of[r] for r in rows], impl)
    want = _peft_logits(pm, tokens, ["__base__" if r is None else r for r in rows])
    base = _peft_logits(pm, tokens, ["__base__"] * len(rows))
    for b, r in enumerate(rows):
        np.testing.assert_allclose(got[b], want[b], rtol=1e-4, atol=1e-4, err_msg=f"row {b} adapter {r} ({impl})")
        if r is not None:
            assert np.abs(want[b] - base[b]).max() > 0.05, f"adapter {r} barely changes the logits"
