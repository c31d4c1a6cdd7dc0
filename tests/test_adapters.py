"""Adapters without PyTorch: PEFT conversion rules and rejections on synthetic PEFT directories,
orbax round trip, the one-graph donated `set_slot`, and AdapterManager's slots, pins and caches;
adapters from memory (LoRARequest(tensors=, config=)), the disk cache of converted adapters and the
host cache's byte bound.

(Parity of the converted weights against the real `peft` library is in test_peft_parity_tiny.py.)
"""

from __future__ import annotations

import concurrent.futures
import json
import math
import os
import re
import shutil
from pathlib import Path

import jax
import numpy as np
import pytest
from safetensors.numpy import save_file

from jlora.adapters import (
    AdapterHandle, AdapterManager, LoRAAdapter, LoRARequest, LoRASlots, NoFreeSlotError, convert, convert_main,
    load_adapter, padded_update, read_adapter, read_peft_adapter, save_adapter, set_slot, slot_module,
)
from jlora.models import LlamaConfig, init_lora_state

CFG = LlamaConfig.preset("tiny")  # L=2, D=64, F=96, H=4 x 16, KVH=2
SHAPES = CFG.module_shapes()
PARENT = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
          "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}


def peft_key(layer: int, mod: str, ab: str, prefix: str = "base_model.model.", adapter: str = "") -> str:
    mid = f".{adapter}" if adapter else ""
    return f"{prefix}model.layers.{layer}.{PARENT[mod]}.{mod}.lora_{ab}{mid}.weight"


def write_peft(
    path: Path,
    modules=("q_proj", "v_proj"),
    r: int = 4,
    alpha: float = 8,
    layers=(0, 1),
    ranks: dict | None = None,  # (layer, module) -> rank, overrides r for the tensors
    config: dict | None = None,
    extra_tensors: dict | None = None,
    seed: int = 0,
    key_prefix: str = "base_model.model.",
    adapter_in_key: str = "",
) -> dict[str, np.ndarray]:
    """A PEFT-format LoRA directory with random tensors; returns the tensors."""
    rng = np.random.default_rng(seed)
    path.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for i in layers:
        for m in modules:
            rr = (ranks or {}).get((i, m), r)
            d_in, d_out = SHAPES[m]
            tensors[peft_key(i, m, "A", key_prefix, adapter_in_key)] = rng.normal(size=(rr, d_in)).astype(np.float32)
            tensors[peft_key(i, m, "B", key_prefix, adapter_in_key)] = rng.normal(size=(d_out, rr)).astype(np.float32)
    tensors.update(extra_tensors or {})
    cfg = {"peft_type": "LORA", "r": r, "lora_alpha": alpha, "target_modules": list(modules), "bias": "none",
           "use_rslora": False, "use_dora": False, "fan_in_fan_out": False, "modules_to_save": None,
           "rank_pattern": {}, "alpha_pattern": {}, "layers_to_transform": None, "layers_pattern": None}
    cfg.update(config or {})
    (path / "adapter_config.json").write_text(json.dumps(cfg))
    save_file(tensors, str(path / "adapter_model.safetensors"))
    return tensors


# ---- LoRARequest ------------------------------------------------------------------------------------


def test_lora_request_validation(tmp_path):
    write_peft(tmp_path)
    req = LoRARequest("sql", 1, tmp_path)
    assert req.lora_path == str(tmp_path) and req.adapter_id == 1 and req.name == "sql" and req.path == str(tmp_path)
    for bad in (0, -3, True, 1.0, "1"):
        with pytest.raises(ValueError, match="lora_int_id"):
            LoRARequest("sql", bad, "x")
    with pytest.raises(ValueError, match="lora_name"):
        LoRARequest("", 1, "x")
    with pytest.raises(ValueError, match="lora_path"):
        LoRARequest("a", 1, "")


def test_lora_request_checks_its_directory_when_made(tmp_path, monkeypatch):
    """A bad path fails when the request is made (as `jlora generate --lora` checks it), not at generate()."""
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(FileNotFoundError, match=r"LoRARequest 'x': no adapter_config.json in adapter directory"):
        LoRARequest("x", 1, str(empty))
    with pytest.raises(FileNotFoundError, match=r"LoRARequest 'x': adapter path .*nope' does not exist$"):
        LoRARequest("x", 1, str(tmp_path / "nope"))
    monkeypatch.chdir(tmp_path)
    with pytest.raises(FileNotFoundError, match="hub names are not supported"):
        LoRARequest("x", 1, "someorg/some-lora")
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match="is not a directory"):
        LoRARequest("x", 1, str(tmp_path / "file"))
    bad_json = tmp_path / "bad-json"
    bad_json.mkdir()
    (bad_json / "adapter_config.json").write_text("{not json")
    with pytest.raises(ValueError, match="malformed .*adapter_config.json"):
        LoRARequest("x", 1, bad_json)
    layer_replication = tmp_path / "layer-replication"
    write_peft(layer_replication, config={"layer_replication": [[0, 2]]})
    with pytest.raises(ValueError, match="layer_replication"):
        LoRARequest("x", 1, layer_replication)
    no_weights = tmp_path / "no-weights"
    write_peft(no_weights)
    (no_weights / "adapter_model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="no adapter_model.safetensors"):
        LoRARequest("x", 1, no_weights)
    ok = tmp_path / "ok"
    write_peft(ok)
    monkeypatch.setenv("HOME", str(tmp_path))
    assert LoRARequest("x", 1, "~/ok").lora_path == "~/ok"  # `~` as the adapter manager expands it
    # Adapters in memory carry no path and are not checked against the file system.
    t = write_peft(tmp_path / "mem")
    cfg = json.loads((tmp_path / "mem" / "adapter_config.json").read_text())
    assert LoRARequest("m", 2, tensors=t, config=cfg).in_memory


# ---- conversion rules -------------------------------------------------------------------------------


def test_convert_layout_and_scale(tmp_path):
    t = write_peft(tmp_path / "a", modules=("q_proj", "down_proj"), r=4, alpha=8)
    ad = read_peft_adapter(tmp_path / "a", CFG, max_lora_rank=8)
    assert ad.name == "a" and ad.ranks == {"q_proj": 4, "down_proj": 4} and ad.rank == 4
    assert set(ad.weights) == {"q_proj", "down_proj"}
    for m in ("q_proj", "down_proj"):
        A, B = ad.weights[m]
        d_in, d_out = SHAPES[m]
        assert A.shape == (2, d_in, 4) and B.shape == (2, 4, d_out) and A.dtype == B.dtype == np.float32
        for i in range(2):
            np.testing.assert_array_equal(A[i], t[peft_key(i, m, "A")].T)
            np.testing.assert_allclose(B[i], t[peft_key(i, m, "B")].T * 2.0, rtol=1e-6)  # alpha / r


def test_rank_alpha_patterns_and_rslora(tmp_path):
    # rank_pattern for one layer of q_proj; alpha_pattern for v_proj everywhere (peft's suffix match).
    cfg = {"rank_pattern": {"layers.1.self_attn.q_proj": 6}, "alpha_pattern": {"v_proj": 3}, "use_rslora": True}
    t = write_peft(tmp_path / "a", r=4, alpha=8, ranks={(1, "q_proj"): 6}, config=cfg)
    ad = read_peft_adapter(tmp_path / "a", CFG, max_lora_rank=8)
    assert ad.ranks == {"q_proj": 6, "v_proj": 4}
    A, B = ad.weights["q_proj"]
    assert A.shape == (2, 64, 6)
    np.testing.assert_array_equal(A[0, :, 4:], 0)  # layer 0 has rank 4: zero-padded
    np.testing.assert_array_equal(B[0, 4:], 0)
    np.testing.assert_allclose(B[0, :4], t[peft_key(0, "q_proj", "B")].T * (8 / math.sqrt(4)), rtol=1e-6)
    np.testing.assert_allclose(B[1], t[peft_key(1, "q_proj", "B")].T * (8 / math.sqrt(6)), rtol=1e-6)
    _, Bv = ad.weights["v_proj"]
    np.testing.assert_allclose(Bv[1], t[peft_key(1, "v_proj", "B")].T * (3 / math.sqrt(4)), rtol=1e-6)


def test_pattern_key_first_match_wins(tmp_path):
    # peft's get_pattern_key returns the first key (dict order) that matches.
    cfg = {"alpha_pattern": {"q_proj": 2, "layers.0.self_attn.q_proj": 100}}
    t = write_peft(tmp_path / "a", modules=("q_proj",), r=4, alpha=8, config=cfg)
    B = read_peft_adapter(tmp_path / "a", CFG).weights["q_proj"][1]
    np.testing.assert_allclose(B[0], t[peft_key(0, "q_proj", "B")].T * 0.5, rtol=1e-6)


@pytest.mark.parametrize("prefix,adapter", [("", ""), ("base_model.model.", "default"), ("", "default")])
def test_key_variants(tmp_path, prefix, adapter):
    t = write_peft(tmp_path / "a", modules=("k_proj",), key_prefix=prefix, adapter_in_key=adapter)
    A, _ = read_peft_adapter(tmp_path / "a", CFG).weights["k_proj"]
    np.testing.assert_array_equal(A[1], t[peft_key(1, "k_proj", "A", prefix, adapter)].T)


def test_layers_to_transform(tmp_path):
    for i, cfg in enumerate([{"layers_to_transform": [1]}, {"layers_to_transform": 1},
                             {"layers_to_transform": [1], "layers_pattern": "layers"}]):
        write_peft(tmp_path / f"a{i}", modules=("o_proj",), layers=(1,), config=cfg)
        A, B = read_peft_adapter(tmp_path / f"a{i}", CFG).weights["o_proj"]
        np.testing.assert_array_equal(A[0], 0)
        np.testing.assert_array_equal(B[0], 0)
        assert np.abs(A[1]).sum() > 0
    # A tensor for a layer the config does not transform is inconsistent.
    write_peft(tmp_path / "bad", modules=("o_proj",), layers=(0, 1), config={"layers_to_transform": [1]})
    with pytest.raises(ValueError, match="does not target"):
        read_peft_adapter(tmp_path / "bad", CFG)
    # ...and so is a targeted layer with no tensors.
    write_peft(tmp_path / "missing", modules=("o_proj",), layers=(1,))
    with pytest.raises(ValueError, match="no lora_A/lora_B tensors for 'model.layers.0.self_attn.o_proj'"):
        read_peft_adapter(tmp_path / "missing", CFG)


def test_target_modules_regex_all_linear_exclude(tmp_path):
    write_peft(tmp_path / "re", modules=("gate_proj", "up_proj"),
               config={"target_modules": r".*\.mlp\.(gate|up)_proj"})
    assert set(read_peft_adapter(tmp_path / "re", CFG).weights) == {"gate_proj", "up_proj"}
    all7 = tuple(PARENT)
    write_peft(tmp_path / "all", modules=all7, r=2, config={"target_modules": "all-linear"})
    ad = read_peft_adapter(tmp_path / "all", CFG)
    assert set(ad.weights) == set(all7) and set(ad.ranks.values()) == {2}
    write_peft(tmp_path / "ex", modules=("q_proj", "k_proj"),
               config={"target_modules": ["q_proj", "k_proj", "v_proj"], "exclude_modules": ["v_proj"]})
    assert set(read_peft_adapter(tmp_path / "ex", CFG).weights) == {"q_proj", "k_proj"}
    # no target_modules in the config (hand-written): the tensors present say what is targeted
    write_peft(tmp_path / "none", modules=("v_proj",), config={"target_modules": None})
    assert set(read_peft_adapter(tmp_path / "none", CFG).weights) == {"v_proj"}
    # fan_in_fan_out only concerns the base layer's layout; lora_A/B are the same.
    write_peft(tmp_path / "fifo", config={"fan_in_fan_out": True})
    read_peft_adapter(tmp_path / "fifo", CFG)


def test_bf16_safetensors(tmp_path):
    import ml_dtypes

    t = write_peft(tmp_path / "a", modules=("q_proj",))
    # Re-save as bfloat16 by hand (safetensors.numpy cannot write bf16): header + raw bytes.
    header, blobs, off = {}, [], 0
    for k, v in t.items():
        b = v.astype(ml_dtypes.bfloat16).tobytes()
        header[k] = {"dtype": "BF16", "shape": list(v.shape), "data_offsets": [off, off + len(b)]}
        blobs.append(b)
        off += len(b)
    h = json.dumps(header).encode()
    h += b" " * (-len(h) % 8)
    (tmp_path / "a" / "adapter_model.safetensors").write_bytes(len(h).to_bytes(8, "little") + h + b"".join(blobs))
    A, _ = read_peft_adapter(tmp_path / "a", CFG).weights["q_proj"]
    want = t[peft_key(0, "q_proj", "A")].astype(ml_dtypes.bfloat16).astype(np.float32).T
    np.testing.assert_array_equal(A[0], want)


def test_adapter_model_bin(tmp_path):
    import torch
    t = write_peft(tmp_path / "a", modules=("v_proj",))
    os.remove(tmp_path / "a" / "adapter_model.safetensors")
    torch.save({k: torch.from_numpy(v) for k, v in t.items()}, tmp_path / "a" / "adapter_model.bin")
    A, _ = read_peft_adapter(tmp_path / "a", CFG).weights["v_proj"]
    np.testing.assert_array_equal(A[0], t[peft_key(0, "v_proj", "A")].T)
    (tmp_path / "a" / "adapter_model.bin").write_bytes(b"not a pickle")
    with pytest.raises(ValueError, match="adapter_model.bin"):
        read_peft_adapter(tmp_path / "a", CFG)


# ---- rejections ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("field,value", [
    ("use_dora", True), ("modules_to_save", ["lm_head"]), ("trainable_token_indices", [1, 2]),
    ("lora_bias", True), ("bias", "all"), ("bias", "lora_only"), ("target_parameters", ["mlp.experts.weight"]),
    ("peft_type", "IA3"), ("target_modules", "(q_proj"), ("rank_pattern", {"[": 4}), ("layer_replication", [[0, 2]]), ("init_lora_weights", "pissa"), ("r", 0),
])
def test_rejects_config_fields(tmp_path, field, value):
    write_peft(tmp_path / "a", config={field: value})
    with pytest.raises(ValueError, match=field):
        read_peft_adapter(tmp_path / "a", CFG)


@pytest.mark.parametrize("key,shape,match", [
    ("base_model.model.model.embed_tokens.lora_embedding_A", (4, 256), "embed_tokens"),
    ("base_model.model.lm_head.lora_A.weight", (4, 64), "lm_head"),
    ("base_model.model.model.layers.0.self_attn.q_proj.lora_magnitude_vector", (64,), "DoRA"),
    ("base_model.model.model.embed_tokens.weight", (256, 64), "embed_tokens"),
    ("base_model.model.model.layers.0.self_attn.q_proj.lora_B.bias", (64,), "bias"),
    ("base_model.model.model.layers.0.input_layernorm.weight", (64,), "unsupported tensor"),
])
def test_rejects_tensors(tmp_path, key, shape, match):
    write_peft(tmp_path / "a", extra_tensors={key: np.zeros(shape, np.float32)})
    with pytest.raises(ValueError, match=match) as e:
        read_peft_adapter(tmp_path / "a", CFG)
    assert key in str(e.value)


def test_rejects_shape_mismatch_naming_tensor(tmp_path):
    t = write_peft(tmp_path / "a")
    key = peft_key(1, "v_proj", "B")
    t[key] = np.zeros((48, 4), np.float32)  # base v_proj has 32 outputs
    save_file(t, str(tmp_path / "a" / "adapter_model.safetensors"))
    with pytest.raises(ValueError, match=r"has shape \(48, 4\), expected \(32, 4\)") as e:
        read_peft_adapter(tmp_path / "a", CFG)
    assert key in str(e.value)
    # rank in the tensors disagreeing with r in the config
    write_peft(tmp_path / "b", r=4, ranks={(0, "q_proj"): 5})
    with pytest.raises(ValueError, match=r"expected \(4, 64\)"):
        read_peft_adapter(tmp_path / "b", CFG)


def test_rejects_rank_above_max(tmp_path):
    write_peft(tmp_path / "a", r=16, alpha=16)
    with pytest.raises(ValueError, match="max_lora_rank=8"):
        read_peft_adapter(tmp_path / "a", CFG, max_lora_rank=8)
    write_peft(tmp_path / "b", r=4, ranks={(1, "v_proj"): 12},
               config={"rank_pattern": {"model.layers.1.self_attn.v_proj": 12}})
    with pytest.raises(ValueError, match="rank r=12.*max_lora_rank=8"):
        read_peft_adapter(tmp_path / "b", CFG, max_lora_rank=8)


def test_rejects_missing_and_corrupt_files(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        read_peft_adapter(tmp_path / "nope", CFG)
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="adapter_config.json"):
        read_peft_adapter(tmp_path / "empty", CFG)
    write_peft(tmp_path / "a")
    data = (tmp_path / "a" / "adapter_model.safetensors").read_bytes()
    (tmp_path / "a" / "adapter_model.safetensors").write_bytes(data[:-10])  # truncated
    with pytest.raises(ValueError, match="corrupt or truncated"):
        read_peft_adapter(tmp_path / "a", CFG)
    (tmp_path / "a" / "adapter_model.safetensors").write_bytes(b"\x05garbage")
    with pytest.raises(ValueError, match="corrupt or truncated"):
        read_peft_adapter(tmp_path / "a", CFG)
    os.remove(tmp_path / "a" / "adapter_model.safetensors")
    with pytest.raises(FileNotFoundError, match="adapter_model.safetensors"):
        read_peft_adapter(tmp_path / "a", CFG)
    write_peft(tmp_path / "b")
    (tmp_path / "b" / "adapter_config.json").write_text("{not json")
    with pytest.raises(ValueError, match="malformed"):
        read_peft_adapter(tmp_path / "b", CFG)
    (tmp_path / "b" / "adapter_config.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match="JSON object"):
        read_peft_adapter(tmp_path / "b", CFG)


def test_rejects_inconsistent_tensors(tmp_path):
    t = write_peft(tmp_path / "a")
    del t[peft_key(0, "q_proj", "B")]
    save_file(t, str(tmp_path / "a" / "adapter_model.safetensors"))
    with pytest.raises(ValueError, match="no lora_B"):
        read_peft_adapter(tmp_path / "a", CFG)
    write_peft(tmp_path / "b", layers=(0, 1, 2), config={})  # tiny has 2 layers
    with pytest.raises(ValueError, match="layer 2"):
        read_peft_adapter(tmp_path / "b", CFG)
    t = write_peft(tmp_path / "c")
    t[peft_key(0, "q_proj", "A")][0, 0] = np.nan
    save_file(t, str(tmp_path / "c" / "adapter_model.safetensors"))
    with pytest.raises(ValueError, match="NaN"):
        read_peft_adapter(tmp_path / "c", CFG)


# ---- orbax round trip ---------------------------------------------------------------------------------


def test_orbax_round_trip_and_convert(tmp_path, capsys):
    write_peft(tmp_path / "src", modules=("q_proj", "up_proj"), r=4,
               ranks={(0, "up_proj"): 2}, config={"rank_pattern": {"layers.0.mlp.up_proj": 2}})
    ad = convert(tmp_path / "src", tmp_path / "dst", CFG, max_lora_rank=8)
    back = load_adapter(tmp_path / "dst", CFG, max_lora_rank=8)
    assert back.name == "src" and back.ranks == ad.ranks == {"q_proj": 4, "up_proj": 4}
    for m in ad.weights:
        for x, y in zip(ad.weights[m], back.weights[m]):
            assert y.dtype == np.float32
            np.testing.assert_array_equal(x, y)
    # read_adapter accepts either kind of directory
    np.testing.assert_array_equal(read_adapter(tmp_path / "dst", CFG).weights["q_proj"][0], ad.weights["q_proj"][0])
    # checked against the base model and max rank on load
    other = LlamaConfig(**{**CFG.__dict__, "hidden_size": 32, "head_dim": 8})
    with pytest.raises(ValueError, match="expected"):
        load_adapter(tmp_path / "dst", other)
    with pytest.raises(ValueError, match="max_lora_rank=2"):
        load_adapter(tmp_path / "dst", CFG, max_lora_rank=2)
    with pytest.raises(FileNotFoundError):
        load_adapter(tmp_path / "src")
    (tmp_path / "dst" / "jlora_adapter.json").write_text("{")
    with pytest.raises(ValueError, match="malformed"):
        load_adapter(tmp_path / "dst")


def test_convert_main(tmp_path, capsys):
    base = tmp_path / "base"
    base.mkdir()
    (base / "config.json").write_text(json.dumps({
        "model_type": "llama", "vocab_size": CFG.vocab_size, "hidden_size": CFG.hidden_size,
        "intermediate_size": CFG.intermediate_size, "num_hidden_layers": CFG.num_hidden_layers,
        "num_attention_heads": CFG.num_attention_heads, "num_key_value_heads": CFG.num_key_value_heads}))
    write_peft(tmp_path / "src")
    assert convert_main([str(tmp_path / "src"), str(tmp_path / "dst"), "--model", str(base),
                         "--max-lora-rank", "8"]) == 0
    assert "converted" in capsys.readouterr().out
    assert load_adapter(tmp_path / "dst", CFG).ranks == {"q_proj": 4, "v_proj": 4}


# ---- set_slot -----------------------------------------------------------------------------------------


def _random_adapter(seed: int, modules, rank: int, name: str = "x") -> LoRAAdapter:
    rng = np.random.default_rng(seed)
    w = {m: (rng.normal(size=(CFG.num_hidden_layers, SHAPES[m][0], rank)).astype(np.float32),
             rng.normal(size=(CFG.num_hidden_layers, rank, SHAPES[m][1])).astype(np.float32)) for m in modules}
    return LoRAAdapter(name=name, ranks={m: rank for m in modules}, weights=w)


class CompileCounter:
    def __init__(self):
        self.n = 0

    def __call__(self, event, duration, **kw):
        if event == "/jax/core/compile/backend_compile_duration":
            self.n += 1

    def __enter__(self):
        jax.monitoring.register_event_duration_secs_listener(self)
        return self

    def __exit__(self, *exc):
        jax.monitoring.unregister_event_duration_listener(self)


def test_set_slot_one_graph_donated_and_correct():
    N, R = 3, 8  # shapes used by no other test, so the first write compiles here
    state = init_lora_state(CFG, N, R)
    jax.block_until_ready(state)
    adapters = [_random_adapter(0, ("q_proj", "v_proj"), 4), _random_adapter(1, ("down_proj",), 8),
                _random_adapter(2, tuple(PARENT), 2), _random_adapter(3, ("k_proj",), 1)]
    dev_slot = jax.device_put(np.int32(1))  # a slot already on device (made outside the count)
    with CompileCounter() as cc:
        for k, (slot, ad) in enumerate([(0, adapters[0]), (2, adapters[1]), (1, adapters[2]), (0, adapters[3]),
                                        (np.int32(2), adapters[2]), (dev_slot, adapters[0])]):
            old = state
            state = set_slot(state, slot, padded_update(ad, CFG, R))
            assert old["qkv_proj"]["A"].is_deleted() and old["down_proj"]["B"].is_deleted()  # donated
            if k == 0:
                first = cc.n
    assert first <= 1 and cc.n == first, f"set_slot compiled {cc.n} times"
    # final contents: slot 0 = adapters[3], slot 1 = adapters[0], slot 2 = adapters[2]; others cleared
    for slot, ad in [(0, adapters[3]), (1, adapters[0]), (2, adapters[2])]:
        for m in PARENT:
            A, B = slot_module(state, CFG, slot, m)  # the module's lanes / columns of its packed module
            if m in ad.weights:
                r = ad.ranks[m]
                np.testing.assert_array_equal(A[..., :r], ad.weights[m][0])
                np.testing.assert_array_equal(B[:, :r], ad.weights[m][1])
                np.testing.assert_array_equal(A[..., r:], 0)
            else:
                np.testing.assert_array_equal(A, 0)
                np.testing.assert_array_equal(B, 0)


def test_set_slot_validates():
    state = init_lora_state(CFG, 2, 4)
    upd = padded_update(None, CFG, 4)
    with pytest.raises(ValueError, match="slot=2"):
        set_slot(state, 2, upd)
    with pytest.raises(ValueError, match="slot=-1"):
        set_slot(state, -1, upd)
    bad = padded_update(None, CFG, 8)
    with pytest.raises(ValueError, match=r"update\['qkv_proj'\]\['A'\] has shape \(2, 64, 24\)"):
        set_slot(state, 0, bad)
    with pytest.raises(ValueError, match="modules"):
        set_slot(state, 0, {"qkv_proj": upd["qkv_proj"]})
    assert not state["qkv_proj"]["A"].is_deleted()  # nothing was donated on a rejected call


def test_padded_update_rejects():
    with pytest.raises(ValueError, match=r"^adapter 'x': module 'q_proj' has rank r=8, above max_lora_rank=4$"):
        padded_update(_random_adapter(0, ("q_proj",), 8), CFG, 4)
    with pytest.raises(ValueError, match=r"^adapter 'x' targets modules \['q_proj'\] that this engine's LoRA state does "
                                         r"not hold \(it holds \['v_proj'\]\): the engine option "
                                         r"lora_target_modules chooses them"):
        padded_update(_random_adapter(0, ("q_proj",), 2), CFG, 4, modules=("v_proj",))


def test_one_fit_check_for_files_converted_adapters_and_the_manager(tmp_path):
    """Rank and module fit are checked by one function (`check_lora_fit`) wherever an adapter meets
    an engine; each caller says who is checked, so the message names the file, module or source."""
    from jlora.models.config import LORA_MODULES, MODULE_PARENT, PACKED_MODULES

    assert LORA_MODULES == tuple(m for subs in PACKED_MODULES.values() for m in subs) == tuple(PARENT)
    assert MODULE_PARENT == PARENT and set(SHAPES) == set(LORA_MODULES)
    write_peft(tmp_path / "big", r=8)
    with pytest.raises(ValueError, match=r"adapter_config.json: module 'model.layers.0.self_attn.q_proj' has rank "
                                         r"r=8, above max_lora_rank=4$"):
        read_peft_adapter(tmp_path / "big", CFG, max_lora_rank=4)
    ad = _random_adapter(0, ("down_proj",), 8, name="sql")
    with pytest.raises(ValueError, match=r"^adapter 'sql': module 'down_proj' has rank r=8, above max_lora_rank=4$"):
        ad.validate(CFG, 4)
    odd = LoRAAdapter("odd", {"score": 2}, {"score": (np.zeros((2, 64, 2)), np.zeros((2, 2, 64)))})
    with pytest.raises(ValueError, match=r"^adapter 'odd': unknown LoRA modules \['score'\]; known: \['q_proj', "):
        odd.validate(CFG)
    write_peft(tmp_path / "q", modules=("q_proj", "o_proj"), r=2)
    mgr = AdapterManager(CFG, max_loras=1, max_lora_rank=8, modules=("v_proj", "o_proj"))
    with pytest.raises(ValueError, match=rf"^adapter 'q' \({re.escape(str(tmp_path / 'q'))}\) targets modules "
                                         r"\['q_proj'\] that this engine's LoRA state does not hold"):
        mgr.prepare(LoRARequest("q", 1, str(tmp_path / "q")))
    assert mgr.list_adapters() == []


@pytest.mark.parametrize("max_loras", [1, 2, 4, 5])
def test_one_max_cpu_loras_default(max_loras):
    from jlora.engine_args import engine_config
    from jlora.engine.config import EngineConfig, default_max_cpu_loras

    want = max(4 * max_loras, 8)
    assert default_max_cpu_loras(max_loras) == want
    assert EngineConfig(max_loras=max_loras).max_cpu_loras == want
    assert engine_config(max_loras=max_loras).max_cpu_loras == want
    assert AdapterManager(CFG, max_loras=max_loras, max_lora_rank=4).max_cpu_loras == want


# ---- AdapterManager -----------------------------------------------------------------------------------


@pytest.fixture
def adapters(tmp_path):
    """Five PEFT dirs a0..a4 with distinct weights and ranks."""
    paths = []
    for i in range(5):
        p = tmp_path / f"a{i}"
        write_peft(p, modules=("q_proj", "v_proj") if i % 2 else ("o_proj",), r=1 + i, alpha=2, seed=i)
        paths.append(p)
    return paths


def _req(i: int, paths, name=None, int_id=None, path=None) -> LoRARequest:
    return LoRARequest(name or f"a{i}", int_id or i + 1, str(path or paths[i]))


def _device(mgr: AdapterManager) -> LoRASlots:
    """The slot arrays beside `mgr`, as the engine's ModelRunner holds them."""
    return LoRASlots(CFG, mgr.max_loras, mgr.max_lora_rank, modules=mgr.modules)


def _acquire(mgr: AdapterManager, dev: LoRASlots, req: LoRARequest | AdapterHandle | None, protect=()) -> int:
    """As the engine acquires: through a handle (`prepare` unless given one), then the runner
    applies the queued writes before the step."""
    handle = mgr.prepare(req) if isinstance(req, LoRARequest) else req
    slot = mgr.acquire(handle, protect)
    dev.write(mgr.take_writes())
    return slot


def _slot_matches(mgr: AdapterManager, dev: LoRASlots, slot: int, path) -> bool:
    ad = read_peft_adapter(path, CFG)
    upd = padded_update(ad, CFG, mgr.max_lora_rank)
    return all(np.array_equal(np.asarray(dev.state[m][k])[:, slot], upd[m][k])
               for m in upd for k in ("A", "B"))


def _snapshot(dev: LoRASlots):
    return {m: {k: np.asarray(v) for k, v in s.items()} for m, s in dev.state.items()}


def test_manager_acquire_reuse_pins_lru(adapters):
    mgr = AdapterManager(CFG, max_loras=2, max_lora_rank=8, max_cpu_loras=4)
    dev = _device(mgr)
    dev.warmup()
    assert _acquire(mgr, dev, None) == -1
    s0 = _acquire(mgr, dev, _req(0, adapters))
    s1 = _acquire(mgr, dev, _req(1, adapters))
    assert {s0, s1} == {0, 1} and mgr.resident() == {s0: "a0", s1: "a1"}
    assert _acquire(mgr, dev, _req(0, adapters)) == s0 and mgr.pins(s0) == 2  # resident: same slot, pinned twice
    assert _slot_matches(mgr, dev, s0, adapters[0]) and _slot_matches(mgr, dev, s1, adapters[1])

    # all pinned -> NoFreeSlotError, nothing changes
    snap = _snapshot(dev)
    with pytest.raises(NoFreeSlotError, match="pinned"):
        _acquire(mgr, dev, _req(2, adapters))
    assert isinstance(NoFreeSlotError("x"), RuntimeError)
    assert mgr.resident() == {s0: "a0", s1: "a1"}
    assert all(np.array_equal(snap[m][k], np.asarray(dev.state[m][k])) for m in snap for k in ("A", "B"))

    # release: ref-counted; a1 released first, then a0 (fully) -> a1 is least recently used
    mgr.release(s1)
    mgr.release(s0)
    assert mgr.pins(s0) == 1
    with pytest.raises(NoFreeSlotError):  # a0 still pinned once; a1 unpinned -> evicted, so this works:
        _acquire(mgr, dev, _req(2, adapters)), _acquire(mgr, dev, _req(3, adapters))
    assert mgr.resident() == {s0: "a0", s1: "a2"}  # a2 took a1's slot
    assert _slot_matches(mgr, dev, s1, adapters[2])
    mgr.release(s0)
    mgr.release(s1)
    _acquire(mgr, dev, _req(0, adapters))  # touch a0: now a2 is LRU
    mgr.release(s0)
    s3 = _acquire(mgr, dev, _req(3, adapters))
    assert s3 == s1 and mgr.resident() == {s0: "a0", s1: "a3"} and _slot_matches(mgr, dev, s1, adapters[3])
    assert mgr.stats["evictions"] == 2
    with pytest.raises(ValueError, match="not pinned"):
        mgr.release(s0)
    with pytest.raises(ValueError, match="slot=7"):
        mgr.release(7)
    mgr.release(-1)


def test_manager_host_cache_lru(adapters):
    mgr = AdapterManager(CFG, max_loras=1, max_lora_rank=8, max_cpu_loras=2)
    dev = _device(mgr)
    for i in (0, 1, 0, 2, 0, 1):  # host cache keeps 2: a0 stays hot, a1 falls out when a2 arrives
        mgr.release(_acquire(mgr, dev, _req(i, adapters)))
    assert mgr.stats["disk_loads"] == 4 and mgr.stats["host_hits"] == 2
    assert mgr.list_adapters() == ["a0", "a1"]
    assert _slot_matches(mgr, dev, 0, adapters[1])
    mgr.prepare(_req(3, adapters))  # into the host cache only
    assert mgr.resident() == {0: "a1"} and "a3" in mgr.list_adapters()
    loads = mgr.stats["disk_loads"]
    mgr.release(_acquire(mgr, dev, _req(3, adapters)))
    assert mgr.stats["disk_loads"] == loads


def test_manager_bad_adapter_changes_nothing(adapters, tmp_path):
    mgr = AdapterManager(CFG, max_loras=2, max_lora_rank=4, max_cpu_loras=4)
    dev = _device(mgr)
    s = _acquire(mgr, dev, _req(0, adapters))
    mgr.release(s)
    snap, res = _snapshot(dev), mgr.resident()
    # The requests are made on good directories (LoRARequest checks its path), which then change under
    # them: the manager checks again when it reads them.
    for name in ("dora", "gone"):
        write_peft(tmp_path / name)
    write_peft(tmp_path / "big", r=8)
    reqs = [LoRARequest(name, 10 + i, str(tmp_path / name)) for i, name in enumerate(("dora", "big", "gone"))]
    write_peft(tmp_path / "dora", config={"use_dora": True})
    shutil.rmtree(tmp_path / "gone")
    for req, exc in zip(reqs, (ValueError, ValueError, FileNotFoundError)):
        with pytest.raises(exc):
            _acquire(mgr, dev, req)
        with pytest.raises(exc):
            mgr.prepare(req)
    assert mgr.resident() == res and mgr.list_adapters() == ["a0"]
    assert all(np.array_equal(snap[m][k], np.asarray(dev.state[m][k])) for m in snap for k in ("A", "B"))
    with pytest.raises(ValueError, match="LoRARequest"):
        mgr.prepare("a0")
    with pytest.raises(ValueError, match="AdapterHandle"):
        mgr.acquire(_req(0, adapters))  # the handle is the only way in


def test_manager_versions_never_stale(adapters, tmp_path):
    mgr = AdapterManager(CFG, max_loras=3, max_lora_rank=8, max_cpu_loras=4)
    dev = _device(mgr)
    old = _acquire(mgr, dev, _req(0, adapters, name="sql"))  # pinned by a "running request"
    # same name, new path: new weights in a new slot; the running request keeps the old slot
    new = _acquire(mgr, dev, _req(0, adapters, name="sql", path=adapters[1]))
    assert new != old and _slot_matches(mgr, dev, new, adapters[1]) and _slot_matches(mgr, dev, old, adapters[0])
    assert mgr.resident() == {new: "sql"} and mgr.slot_of("sql") == new
    mgr.release(old)  # the retired version's slot is freed on its last release
    assert mgr.pins(old) == 0
    # same name and path, new int id: a new version too
    assert _acquire(mgr, dev, _req(0, adapters, name="sql", int_id=7, path=adapters[1])) != new
    # files rewritten on disk under the same request: reloaded, never served stale
    p = tmp_path / "live"
    write_peft(p, seed=1)
    req = LoRARequest("live", 20, str(p))
    s = _acquire(mgr, dev, req)
    mgr.release(s)
    write_peft(p, seed=2)
    st = os.stat(p / "adapter_model.safetensors")
    os.utime(p / "adapter_model.safetensors", ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    s2 = _acquire(mgr, dev, req)
    assert _slot_matches(mgr, dev, s2, p)
    # one int id for two names is ambiguous
    with pytest.raises(ValueError, match="lora_int_id=20 is already used by adapter 'live'"):
        _acquire(mgr, dev, LoRARequest("other", 20, str(adapters[2])))


def test_manager_unload(adapters):
    mgr = AdapterManager(CFG, max_loras=2, max_lora_rank=8)
    dev = _device(mgr)
    s0 = _acquire(mgr, dev, _req(0, adapters))
    s1 = _acquire(mgr, dev, _req(1, adapters))
    mgr.release(s1)
    assert mgr.unload("a1") and mgr.resident() == {s0: "a0"}
    assert mgr.unload("a0") and mgr.resident() == {} and mgr.pins(s0) == 1  # pinned: freed on release
    mgr.release(s0)
    assert mgr.pins(s0) == 0 and mgr.list_adapters() == []
    assert not mgr.unload("nope")
    # both slots free again
    assert {_acquire(mgr, dev, _req(2, adapters)), _acquire(mgr, dev, _req(3, adapters))} == {0, 1}


def test_unload_while_the_same_name_converts_stays_unloaded(adapters, monkeypatch):
    """The prepare that was converting when `unload` came must not bring the name back."""
    import threading

    mgr = AdapterManager(CFG, max_loras=2, max_lora_rank=8)
    dev = _device(mgr)
    started, go = threading.Event(), threading.Event()
    real = mgr.host.convert

    def slow(version, req):
        started.set()
        go.wait(30)
        return real(version, req)

    monkeypatch.setattr(mgr.host, "convert", slow)
    result = {}
    t = threading.Thread(target=lambda: result.update(handle=mgr.prepare(_req(0, adapters))))
    t.start()
    assert started.wait(30)
    assert not mgr.unload("a0")  # nothing known under the name yet
    go.set()
    t.join(30)
    assert mgr.list_adapters() == [] and "a0" not in mgr._current
    slot = _acquire(mgr, dev, result["handle"])  # the request that asked is still served
    assert _slot_matches(mgr, dev, slot, adapters[0])
    mgr.release(slot)
    assert mgr.resident() == {}  # as a retired version: gone once released
    again = mgr.prepare(_req(0, adapters))  # a load after the unload brings it back
    assert mgr.list_adapters() == ["a0"] and _acquire(mgr, dev, again) == slot and mgr.resident() == {slot: "a0"}


def test_unload_while_a_second_prepare_waits_on_the_conversion(adapters, monkeypatch):
    """Two prepares of one version (the second waits on the first's conversion) and an unload of the
    name between: neither brings it back, both get the converted handle, it was converted once."""
    import threading

    gate, started, calls = _blocking_reads(monkeypatch)
    mgr = AdapterManager(CFG, max_loras=2, max_lora_rank=8)
    first = mgr.prepare_async(_req(1, adapters))
    assert started.wait(10)
    waiting, handles = threading.Event(), {}
    real_wait = concurrent.futures.Future.result

    def result(fut, timeout=None):
        waiting.set()
        return real_wait(fut, timeout)

    monkeypatch.setattr(concurrent.futures.Future, "result", result)
    t = threading.Thread(target=lambda: handles.update(second=mgr.prepare(_req(1, adapters))))
    t.start()
    assert waiting.wait(10)  # the second prepare waits on the first's Future
    assert not mgr.unload("a1")
    gate.set()
    t.join(10)
    h = first.result(10)
    assert handles["second"] is h and len(calls) == 1
    assert mgr.list_adapters() == []
    slot = mgr.acquire(h)  # the requests that asked are served, from a retired slot: the name stays gone
    assert slot >= 0 and mgr.resident() == {} and mgr.slot_of("a1") is None


def test_acquire_queues_the_padded_write_and_the_runner_applies_it(adapters):
    """Device state has one owner: acquire changes no array, it queues (slot, update already padded
    when the adapter was prepared); the slot arrays change only when the queue is applied."""
    mgr = AdapterManager(CFG, max_loras=1, max_lora_rank=8)
    dev = _device(mgr)
    assert not hasattr(mgr, "lora_state")
    h0, h1 = mgr.prepare(_req(0, adapters)), mgr.prepare(_req(1, adapters))
    assert {m: {k: x.shape for k, x in u.items()} for m, u in h0.update.items()} == \
        {m: {k: x.shape for k, x in u.items()} for m, u in padded_update(None, CFG, 8).items()}
    before = _snapshot(dev)
    assert mgr.acquire(h0) == 0
    (w,) = mgr.take_writes()
    assert (w.slot, w.update is h0.update) == (0, True) and mgr.take_writes() == ()
    assert all(np.array_equal(before[m][k], np.asarray(dev.state[m][k])) for m in before for k in ("A", "B"))
    dev.write([w])
    assert _slot_matches(mgr, dev, 0, adapters[0]) and dev.num_writes == 1
    assert mgr.acquire(h0) == 0 and mgr.take_writes() == ()  # resident: nothing to write
    mgr.release(0)
    mgr.release(0)
    # The slot changes hands twice before a step applies the queue: only the last write is kept.
    assert mgr.acquire(h1) == 0
    mgr.release(0)
    assert mgr.acquire(h0) == 0
    (w,) = mgr.take_writes()
    assert w.update is h0.update and mgr.stats["evictions"] == 2


def test_a_bfloat16_slot_holds_the_adapter_rounded_once(adapters):
    """The handle's copy is already in the slots' storage dtype (bf16, kept as its uint16 bits on
    XLA:CPU); the write must not convert it again."""
    import jax.numpy as jnp

    from jlora.models import quant

    mgr = AdapterManager(CFG, max_loras=2, max_lora_rank=8, dtype=jnp.bfloat16)
    dev = LoRASlots(CFG, 2, 8, jnp.bfloat16)
    slot = _acquire(mgr, dev, _req(1, adapters))
    want = padded_update(read_peft_adapter(adapters[1], CFG), CFG, 8, dtype=jnp.bfloat16)
    for m in want:
        for k in ("A", "B"):
            got = np.asarray(dev.state[m][k])[:, slot]
            assert got.dtype == np.dtype(quant.storage_dtype(jnp.bfloat16))
            got = got.view(jnp.bfloat16) if got.dtype == np.uint16 else got
            np.testing.assert_array_equal(got.astype(np.float32), want[m][k].astype(np.float32))
    assert np.abs(want["qkv_proj"]["A"].astype(np.float32)).max() > 0


def test_protected_slots_are_evicted_last(adapters):
    """Eviction order: free slots (lowest index), then unpinned slots of adapters the queue no longer
    needs, least recently used first, then the queue's own (least recently used first); pinned never."""
    mgr = AdapterManager(CFG, max_loras=3, max_lora_rank=8)
    dev = _device(mgr)
    handles = [mgr.prepare(_req(i, adapters)) for i in range(5)]
    slots = [_acquire(mgr, dev, handles[i]) for i in range(3)]
    assert slots == [0, 1, 2]
    for s in (0, 1, 2):  # released in slot order: a0 is the least recently used
        mgr.release(s)
    # a0 and a1 are still needed by the queue: a2's slot goes, though a0 is older
    assert _acquire(mgr, dev, handles[3], protect={"a0", "a1"}) == 2
    assert mgr.resident() == {0: "a0", 1: "a1", 2: "a3"} and _slot_matches(mgr, dev, 2, adapters[3])
    mgr.release(2)
    # everything unpinned is needed: the least recently used of them goes (a0), not a3 (newest)
    assert _acquire(mgr, dev, handles[4], protect={"a0", "a1", "a3"}) == 0
    assert mgr.resident() == {0: "a4", 1: "a1", 2: "a3"}
    # pinned slots are never taken, protected or not
    _acquire(mgr, dev, handles[1])
    _acquire(mgr, dev, handles[3])
    with pytest.raises(NoFreeSlotError, match="pinned"):
        _acquire(mgr, dev, handles[2])
    assert mgr.take_writes() == () and mgr.resident() == {0: "a4", 1: "a1", 2: "a3"}


def test_a_stale_handle_gets_a_retired_slot(adapters):
    """A handle whose name moved on (a newer version prepared, or the name unloaded) is still served
    its own weights, in a retired slot: never handed to the current version, freed on last release."""
    mgr = AdapterManager(CFG, max_loras=3, max_lora_rank=8)
    dev = _device(mgr)
    old = mgr.prepare(_req(0, adapters, name="sql"))
    new = mgr.prepare(_req(0, adapters, name="sql", path=adapters[1]))  # "sql" is this version now
    s_old = _acquire(mgr, dev, old)
    assert _slot_matches(mgr, dev, s_old, adapters[0]) and mgr.resident() == {} and mgr.slot_of("sql") is None
    assert _acquire(mgr, dev, old) == s_old and mgr.pins(s_old) == 2  # holders of the old handle share it
    s_new = _acquire(mgr, dev, new)
    assert s_new != s_old and mgr.resident() == {s_new: "sql"} and _slot_matches(mgr, dev, s_new, adapters[1])
    assert _slot_matches(mgr, dev, s_old, adapters[0])  # the current version did not take the retired slot
    mgr.release(s_old)
    mgr.release(s_old)
    assert mgr.pins(s_old) == 0 and mgr.resident() == {s_new: "sql"}
    assert mgr.acquire(old) == s_old and len(mgr.take_writes()) == 1  # it was freed: written again
    mgr.release(s_old)
    mgr.release(s_new)
    # Unloaded after prepare: served once more as a retired slot, the name stays gone.
    h = mgr.prepare(_req(2, adapters))
    assert mgr.unload("a2")
    s = _acquire(mgr, dev, h)
    assert _slot_matches(mgr, dev, s, adapters[2]) and "a2" not in mgr.list_adapters() and mgr.slot_of("a2") is None
    mgr.release(s)
    assert mgr.pins(s) == 0 and "a2" not in mgr.resident().values()


def test_manager_serves_converted_dir(adapters, tmp_path):
    save_adapter(read_peft_adapter(adapters[1], CFG), tmp_path / "conv")
    mgr = AdapterManager(CFG, max_loras=1, max_lora_rank=8)
    dev = _device(mgr)
    s = _acquire(mgr, dev, LoRARequest("conv", 1, str(tmp_path / "conv")))
    assert _slot_matches(mgr, dev, s, adapters[1]) and mgr.resident() == {0: "conv"}


# ---- adapters from memory -------------------------------------------------------------------------------


def _as_state_dict(path: Path) -> tuple[dict[str, np.ndarray], dict]:
    from safetensors.numpy import load_file

    return load_file(str(path / "adapter_model.safetensors")), json.loads((path / "adapter_config.json").read_text())


def _assert_same_adapter(a: LoRAAdapter, b: LoRAAdapter) -> None:
    assert a.ranks == b.ranks and set(a.weights) == set(b.weights)
    for m in a.weights:
        for x, y in zip(a.weights[m], b.weights[m]):
            assert x.dtype == y.dtype == np.float32
            np.testing.assert_array_equal(x, y)


def test_lora_request_in_memory_validation(tmp_path):
    t = write_peft(tmp_path / "a")
    _, cfg = _as_state_dict(tmp_path / "a")
    req = LoRARequest("mine", 3, tensors=t, config=cfg)
    assert req.in_memory and req.lora_path is None and len(req.content_hash) == 64
    assert "tensors" not in repr(req)
    # equal content, new objects: equal and same hash; other content: a different request
    same = LoRARequest("mine", 3, tensors={k: v.copy() for k, v in t.items()}, config=dict(cfg))
    assert same == req and hash(same) == hash(req) and len({req, same}) == 1
    t2 = {k: v * 2 for k, v in t.items()}
    assert LoRARequest("mine", 3, tensors=t2, config=cfg) != req
    assert LoRARequest("mine", 3, tensors=t, config={**cfg, "lora_alpha": 16}) != req
    # a snapshot: changing the caller's arrays afterwards changes nothing
    key = next(iter(t))
    before = req.tensors[key].copy()
    t[key][0, 0] += 1.0
    np.testing.assert_array_equal(req.tensors[key], before)
    assert not req.tensors[key].flags.writeable
    # JAX arrays and peft's set-valued target_modules are accepted
    jreq = LoRARequest("mine", 3, tensors={k: jax.numpy.asarray(v) for k, v in same.tensors.items()},
                       config={**cfg, "target_modules": set(cfg["target_modules"])})
    assert jreq.config["target_modules"] == sorted(cfg["target_modules"])
    # exactly one of lora_path / tensors
    with pytest.raises(ValueError, match="exactly one of lora_path or tensors"):
        LoRARequest("mine", 3)
    with pytest.raises(ValueError, match="exactly one of lora_path or tensors"):
        LoRARequest("mine", 3, str(tmp_path / "a"), tensors=t, config=cfg)
    with pytest.raises(ValueError, match="tensors need config"):
        LoRARequest("mine", 3, tensors=t)
    with pytest.raises(ValueError, match="config is given without tensors"):
        LoRARequest("mine", 3, config=cfg)
    with pytest.raises(ValueError, match="tensors must be a dict"):
        LoRARequest("mine", 3, tensors=[1, 2], config=cfg)
    with pytest.raises(ValueError, match="tensors is empty"):
        LoRARequest("mine", 3, tensors={}, config=cfg)
    with pytest.raises(ValueError, match="config must be"):
        LoRARequest("mine", 3, tensors=t, config="adapter_config.json")
    with pytest.raises(ValueError, match="JSON-serializable"):
        LoRARequest("mine", 3, tensors=t, config={"r": object()})


@pytest.mark.parametrize("as_jax", [False, True])
def test_in_memory_conversion_equals_files(tmp_path, as_jax):
    from jlora.adapters import convert_peft_state_dict

    cfg = {"rank_pattern": {"layers.1.self_attn.q_proj": 6}, "alpha_pattern": {"v_proj": 3}, "use_rslora": True}
    write_peft(tmp_path / "a", r=4, alpha=8, ranks={(1, "q_proj"): 6}, config=cfg)
    tensors, config = _as_state_dict(tmp_path / "a")
    if as_jax:
        tensors = {k: jax.numpy.asarray(v) for k, v in tensors.items()}
    want = read_peft_adapter(tmp_path / "a", CFG, max_lora_rank=8)
    _assert_same_adapter(convert_peft_state_dict(tensors, config, CFG, max_lora_rank=8, name="a"), want)
    req = LoRARequest("a", 1, tensors=tensors, config=config)
    _assert_same_adapter(convert_peft_state_dict(req.tensors, req.config, CFG, 8), want)


def test_in_memory_bfloat16_arrays(tmp_path):
    from jlora.adapters import convert_peft_state_dict

    write_peft(tmp_path / "a")
    tensors, config = _as_state_dict(tmp_path / "a")
    bf16 = {k: jax.numpy.asarray(v, jax.numpy.bfloat16) for k, v in tensors.items()}
    rounded = {k: np.asarray(v, np.float32) for k, v in bf16.items()}
    req = LoRARequest("b", 1, tensors=bf16, config=config)
    assert req.tensors[next(iter(req.tensors))].dtype.name == "bfloat16"
    assert req.content_hash != LoRARequest("b", 1, tensors=rounded, config=config).content_hash
    _assert_same_adapter(convert_peft_state_dict(req.tensors, req.config, CFG, 8, name="b"),
                         convert_peft_state_dict(rounded, config, CFG, 8, name="b"))


def test_in_memory_rejections_match_files(tmp_path):
    from jlora.adapters import convert_peft_state_dict

    t = write_peft(tmp_path / "a")
    _, cfg = _as_state_dict(tmp_path / "a")
    cases = [
        ({**t, peft_key(1, "v_proj", "B"): np.zeros((48, 4), np.float32)}, cfg, None,
         r"has shape \(48, 4\), expected \(32, 4\)"),
        ({k: v for k, v in t.items() if k != peft_key(0, "q_proj", "B")}, cfg, None, "no lora_B"),
        (t, {**cfg, "use_dora": True}, None, "use_dora"),
        ({**t, "base_model.model.model.layers.0.self_attn.q_proj.lora_magnitude_vector": np.zeros(64, np.float32)},
         cfg, None, "DoRA"),
        (t, cfg, 2, "max_lora_rank=2"),
        (t, {**cfg, "target_modules": ["q_proj"]}, None, "does not target"),
    ]
    for tensors, config, max_rank, match in cases:
        req = LoRARequest("m", 1, tensors=tensors, config=config)
        with pytest.raises(ValueError, match=match) as e:
            convert_peft_state_dict(req.tensors, req.config, CFG, max_rank, name="m")
        assert "'m'" in str(e.value)  # names the adapter, not a file
        mgr = AdapterManager(CFG, max_loras=1, max_lora_rank=max_rank or 8)
        with pytest.raises(ValueError, match=match):
            mgr.prepare(req)
        assert mgr.list_adapters() == [] and mgr.resident() == {}


def test_manager_in_memory_versions(adapters):
    mgr = AdapterManager(CFG, max_loras=3, max_lora_rank=8, max_cpu_loras=4)
    dev = _device(mgr)
    t0, c0 = _as_state_dict(adapters[1])
    t1, c1 = _as_state_dict(adapters[3])
    old = _acquire(mgr, dev, LoRARequest("mine", 5, tensors=t0, config=c0))  # pinned by a "running request"
    assert _slot_matches(mgr, dev, old, adapters[1])
    # the same content in a new request object: the same version, the same slot, no conversion
    conv = mgr.stats["conversions"]
    assert _acquire(mgr, dev, LoRARequest("mine", 5, tensors=dict(t0), config=dict(c0))) == old
    assert mgr.stats["conversions"] == conv
    mgr.release(old)
    # new tensors under the same name: a new version in a new slot; the running request keeps its weights
    new = _acquire(mgr, dev, LoRARequest("mine", 5, tensors=t1, config=c1))
    assert new != old and _slot_matches(mgr, dev, new, adapters[3]) and _slot_matches(mgr, dev, old, adapters[1])
    assert mgr.resident() == {new: "mine"}
    mgr.release(old)
    assert mgr.pins(old) == 0 and mgr.resident() == {new: "mine"}


# ---- disk cache and host byte bound -----------------------------------------------------------------------


def _weights_equal(a: LoRAAdapter, path) -> bool:
    b = read_peft_adapter(path, CFG)
    return a.ranks == b.ranks and all(np.array_equal(x, y)
                                      for m in a.weights for x, y in zip(a.weights[m], b.weights[m]))


def test_disk_cache_second_manager_reads_instead_of_converting(adapters, tmp_path):
    cache = tmp_path / "cache"
    first = AdapterManager(CFG, max_loras=2, max_lora_rank=8, disk_cache=cache)
    h = first.prepare(_req(1, adapters))
    assert first.stats["conversions"] == 1 and first.stats["disk_cache_misses"] == 1
    assert first.stats["disk_cache_hits"] == 0 and len([p for p in cache.iterdir() if len(p.name) == 32]) == 1
    second = AdapterManager(CFG, max_loras=2, max_lora_rank=8, disk_cache=cache)
    dev2 = _device(second)
    s = _acquire(second, dev2, _req(1, adapters))
    assert second.stats["disk_cache_hits"] == 1 and second.stats["conversions"] == 0
    assert _slot_matches(second, dev2, s, adapters[1]) and _weights_equal(h.adapter, adapters[1])
    # a copy of the same files elsewhere hits too; another max_lora_rank or base model misses
    import shutil

    shutil.copytree(adapters[1], tmp_path / "copy")
    third = AdapterManager(CFG, max_loras=1, max_lora_rank=8, disk_cache=cache)
    third.prepare(LoRARequest("copy", 9, str(tmp_path / "copy")))
    assert third.stats["disk_cache_hits"] == 1
    other = AdapterManager(CFG, max_loras=1, max_lora_rank=16, disk_cache=cache)
    other.prepare(_req(1, adapters))
    assert other.stats["disk_cache_hits"] == 0 and other.stats["conversions"] == 1
    # in-memory adapters are cached by content too
    t, c = _as_state_dict(adapters[3])
    mem_req = LoRARequest("m", 4, tensors=t, config=c)
    AdapterManager(CFG, max_loras=1, max_lora_rank=8, disk_cache=cache).prepare(mem_req)
    mem = AdapterManager(CFG, max_loras=1, max_lora_rank=8, disk_cache=cache)
    assert _weights_equal(mem.prepare(LoRARequest("m", 4, tensors=t, config=c)).adapter, adapters[3])
    assert mem.stats["disk_cache_hits"] == 1 and mem.stats["conversions"] == 0


def test_disk_cache_invalidated_by_changed_files(tmp_path):
    cache = tmp_path / "cache"
    p = tmp_path / "live"
    write_peft(p, seed=1)
    AdapterManager(CFG, max_loras=1, max_lora_rank=8, disk_cache=cache).prepare(LoRARequest("live", 1, str(p)))
    write_peft(p, seed=2)  # same names and shapes, new weights
    mgr = AdapterManager(CFG, max_loras=1, max_lora_rank=8, disk_cache=cache)
    h = mgr.prepare(LoRARequest("live", 1, str(p)))
    assert mgr.stats["disk_cache_hits"] == 0 and mgr.stats["conversions"] == 1 and _weights_equal(h.adapter, p)
    cfg = json.loads((p / "adapter_config.json").read_text())
    (p / "adapter_config.json").write_text(json.dumps({**cfg, "lora_alpha": 3}))  # config only
    mgr = AdapterManager(CFG, max_loras=1, max_lora_rank=8, disk_cache=cache)
    h = mgr.prepare(LoRARequest("live", 1, str(p)))
    assert mgr.stats["disk_cache_hits"] == 0 and _weights_equal(h.adapter, p)


@pytest.mark.parametrize("damage", ["truncate", "meta", "delete_tensors", "shape"])
def test_disk_cache_damaged_entry_is_rebuilt(adapters, tmp_path, damage):
    from jlora.formats import write_safetensors

    cache = tmp_path / "cache"
    AdapterManager(CFG, max_loras=1, max_lora_rank=8, disk_cache=cache).prepare(_req(1, adapters))
    (entry,) = [p for p in cache.iterdir() if len(p.name) == 32]
    st = entry / "adapter.safetensors"
    if damage == "truncate":
        st.write_bytes(st.read_bytes()[:-7])
    elif damage == "meta":
        (entry / "meta.json").write_text("{")
    elif damage == "delete_tensors":
        st.unlink()
    else:  # a well-formed file whose arrays do not fit the model
        meta = json.loads((entry / "meta.json").read_text())
        tensors = {n: np.zeros((1, 2), np.float32) for n in meta["tensors"]}
        meta["file_size"] = write_safetensors(st, tensors)
        (entry / "meta.json").write_text(json.dumps(meta))
    mgr = AdapterManager(CFG, max_loras=1, max_lora_rank=8, disk_cache=cache)
    dev = _device(mgr)
    s = _acquire(mgr, dev, _req(1, adapters))
    assert mgr.stats["disk_cache_rebuilds"] == 1 and mgr.stats["conversions"] == 1
    assert _slot_matches(mgr, dev, s, adapters[1])
    again = AdapterManager(CFG, max_loras=1, max_lora_rank=8, disk_cache=cache)
    again.prepare(_req(1, adapters))
    assert again.stats["disk_cache_hits"] == 1 and again.stats["conversions"] == 0


def test_disk_cache_off(adapters, tmp_path, monkeypatch):
    from jlora.adapters import disk_cache

    cache = tmp_path / "cache"
    mgr = AdapterManager(CFG, max_loras=1, max_lora_rank=8)  # a bare manager: off unless asked
    assert mgr.disk_cache_dir is None
    monkeypatch.setenv("JLORA_ADAPTER_CACHE", "0")
    mgr = AdapterManager(CFG, max_loras=1, max_lora_rank=8, disk_cache=cache)
    mgr.prepare(_req(1, adapters))
    assert mgr.disk_cache_dir is None and not cache.exists()
    monkeypatch.delenv("JLORA_ADAPTER_CACHE")
    monkeypatch.setenv("JLORA_CACHE_DIR", str(tmp_path))  # the root: every cache in its own folder
    assert disk_cache.default_cache_dir() == tmp_path / "adapters"
    monkeypatch.setenv("JLORA_ADAPTER_CACHE_DIR", str(tmp_path / "elsewhere"))
    assert AdapterManager(CFG, max_loras=1, max_lora_rank=8, disk_cache=True).disk_cache_dir == tmp_path / "elsewhere"
    with pytest.raises(ValueError, match="disk_cache"):
        AdapterManager(CFG, max_loras=1, max_lora_rank=8, disk_cache=3)


def test_host_cache_byte_bound_evicts_lru(adapters):
    # An entry's bytes are the converted adapter's and its copy padded to the slot shape.
    handles = [AdapterManager(CFG, max_loras=1, max_lora_rank=8).prepare(_req(i, adapters)) for i in range(5)]
    padded = sum(a.nbytes for u in padded_update(None, CFG, 8).values() for a in u.values())
    sizes = [h.nbytes for h in handles]
    assert sizes == [read_peft_adapter(p, CFG).nbytes + padded for p in adapters]
    # room for a2 + a3 + a4 (the last three) but not for a1 as well
    bound = sizes[2] + sizes[3] + sizes[4]
    assert sizes[1] + bound > bound
    mgr = AdapterManager(CFG, max_loras=1, max_lora_rank=8, max_cpu_loras=10, max_cpu_lora_bytes=bound)
    dev = _device(mgr)
    for i in (1, 2, 3):
        mgr.prepare(_req(i, adapters))
    assert mgr.list_adapters() == ["a1", "a2", "a3"] and mgr.host_bytes() == sizes[1] + sizes[2] + sizes[3]
    mgr.prepare(_req(1, adapters))  # touch a1: a2 is now the least recently used
    mgr.prepare(_req(4, adapters))
    assert mgr.host_bytes() <= bound and "a2" not in mgr.list_adapters() and "a4" in mgr.list_adapters()
    assert mgr.stats["host_evictions"] == 4 - len(mgr.list_adapters())  # every one of a1..a4 not listed
    # lowering the bound evicts at once; an adapter larger than the bound is served but not kept
    mgr.set_max_cpu_lora_bytes(sizes[4])
    assert mgr.list_adapters() == ["a4"] and mgr.host_bytes() == sizes[4]
    mgr.set_max_cpu_lora_bytes(1)
    h = mgr.prepare(_req(3, adapters))
    assert _weights_equal(h.adapter, adapters[3]) and mgr.list_adapters() == [] and mgr.host_bytes() == 0
    s = _acquire(mgr, dev, _req(3, adapters))
    assert _slot_matches(mgr, dev, s, adapters[3])
    for bad in (-1, 1.5, True, "1GB"):
        with pytest.raises(ValueError, match="max_cpu_lora_bytes"):
            AdapterManager(CFG, max_loras=1, max_lora_rank=8, max_cpu_lora_bytes=bad)


# ---- conversion off the step loop's path ---------------------------------------------------------------


def _blocking_reads(monkeypatch):
    """Make the manager's conversions wait for `gate` (and count them), so a test can hold one open."""
    import threading

    from jlora.adapters import host_store

    gate, started, calls = threading.Event(), threading.Event(), []
    real = host_store.read_adapter

    def slow_read(*args, **kwargs):
        calls.append(args[0])
        started.set()
        assert gate.wait(10), "test gate never opened"
        return real(*args, **kwargs)

    monkeypatch.setattr(host_store, "read_adapter", slow_read)
    return gate, started, calls


def test_prepare_async_converts_without_blocking_acquire(adapters, monkeypatch):
    mgr = AdapterManager(CFG, max_loras=2, max_lora_rank=8, max_cpu_loras=4)
    dev = _device(mgr)
    s0 = _acquire(mgr, dev, _req(0, adapters))  # resident before the slow conversions begin
    mgr.release(s0)
    gate, started, calls = _blocking_reads(monkeypatch)
    fut = mgr.prepare_async(_req(1, adapters))
    twin = mgr.prepare_async(_req(1, adapters))  # the same version: converted once
    assert started.wait(10) and not fut.done()
    # While a1 converts, the step loop's calls on resident adapters go through at once.
    assert _acquire(mgr, dev, _req(0, adapters)) == s0
    mgr.release(s0)
    gate.set()
    handle = fut.result(10)
    assert twin.result(10).adapter is handle.adapter and len(calls) == 1
    s1 = _acquire(mgr, dev, handle)
    assert _slot_matches(mgr, dev, s1, adapters[1]) and mgr.stats["conversions"] == 2
    done = mgr.prepare_async(_req(1, adapters))  # already converted: a finished Future, no new work
    assert done.done() and done.result().adapter is handle.adapter and len(calls) == 1


def test_prepare_async_bad_adapter_fails_only_its_future(adapters, tmp_path):
    mgr = AdapterManager(CFG, max_loras=2, max_lora_rank=4, max_cpu_loras=4)
    dev = _device(mgr)
    write_peft(tmp_path / "big", r=8)
    (tmp_path / "torn").mkdir()
    write_peft(tmp_path / "torn", r=2)
    st = tmp_path / "torn" / "adapter_model.safetensors"
    st.write_bytes(st.read_bytes()[:100])  # a truncated weights file
    good = mgr.prepare_async(_req(0, adapters))
    big = mgr.prepare_async(LoRARequest("big", 11, str(tmp_path / "big")))
    torn = mgr.prepare_async(LoRARequest("torn", 12, str(tmp_path / "torn")))
    with pytest.raises(ValueError, match="above max_lora_rank=4"):
        big.result(10)
    with pytest.raises(ValueError, match="torn"):
        torn.result(10)
    with pytest.raises(FileNotFoundError):  # a missing path is known at once
        mgr.prepare_async(LoRARequest("gone", 13, str(tmp_path / "gone")))
    slot = _acquire(mgr, dev, good.result(10))
    assert _slot_matches(mgr, dev, slot, adapters[0]) and mgr.list_adapters() == ["a0"]
