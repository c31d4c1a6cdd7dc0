"""DoRA (use_dora=True) adapters against the real `peft`, in batches that mix DoRA rows, plain
LoRA rows and base rows.

Adapters are made by peft on the tiny random Llama (`tiny_dir`), with B scaled up and the
magnitudes moved off their initial value (at init, m = ||W + s B A|| and the factor is exactly 1,
which would test nothing). peft refuses `adapter_names=` with DoRA, so each reference row runs
alone with its adapter set (or with adapters disabled for base rows).
"""

from __future__ import annotations

import functools

import jax
import numpy as np
import peft
import pytest
import torch
import transformers
from flax import nnx

from jlora import LLM, LoRARequest, SamplingParams, compile_stats
from jlora.adapters import padded_update, read_peft_adapter, set_slot
from jlora.adapters.dora import dora_factor
from jlora.models import build_model, init_cache, init_lora_state, quant, read_hf_checkpoint
from adapter_edits import edited_adapter

MAX_RANK = 8
ADAPTERS = {
    "dora_all": dict(r=4, lora_alpha=8, target_modules="all-linear", use_dora=True),
    # DoRA on some sub-modules of the packed q|k|v and gate|up, one layer only, per-module ranks
    "dora_part": dict(r=6, lora_alpha=12, target_modules=["q_proj", "v_proj", "up_proj"], use_dora=True,
                      layers_to_transform=[1], rank_pattern={"v_proj": 3}, use_rslora=True),
    "plain": dict(r=4, lora_alpha=8, target_modules=["q_proj", "down_proj", "gate_proj"]),
}
ENGINE = dict(max_model_len=128, max_num_seqs=4, max_num_batched_tokens=32, max_loras=2, max_lora_rank=MAX_RANK,
              token_buckets=(16, 32), enable_dora=True)


def _spread(pm, b_scale: float, magnitude: tuple[float, float]) -> None:
    """Moves a fresh peft model's adapters away from their init: B scaled, magnitudes jittered."""
    with torch.no_grad():
        for n, p in pm.named_parameters():
            if "lora_B" in n:
                p.mul_(b_scale)
            if "lora_magnitude_vector" in n:
                p.mul_(torch.empty_like(p).uniform_(*magnitude))


@pytest.fixture(scope="module")
def dora(tiny_dir, tmp_path_factory):
    """(root, adapter paths, PeftModel holding them all) for the tiny model."""
    base_path, _ = tiny_dir
    root = tmp_path_factory.mktemp("dora")
    for i, (name, kw) in enumerate(ADAPTERS.items()):
        torch.manual_seed(200 + i)
        fresh = transformers.LlamaForCausalLM.from_pretrained(base_path)
        pm = peft.get_peft_model(fresh, peft.LoraConfig(init_lora_weights=False, **kw))
        _spread(pm, b_scale=3.0, magnitude=(0.5, 1.5))
        pm.save_pretrained(root / name)
    model = transformers.LlamaForCausalLM.from_pretrained(base_path).eval()
    names = list(ADAPTERS)
    pm = peft.PeftModel.from_pretrained(model, root / names[0], adapter_name=names[0])
    for name in names[1:]:
        pm.load_adapter(root / name, adapter_name=name)
    return root, {n: root / n for n in names}, pm.eval()


def _peft_row(pm, ids: np.ndarray, name: str | None) -> np.ndarray:  # logits [T, V] of one row
    x = torch.from_numpy(ids[None].astype(np.int64))
    with torch.no_grad():
        if name is None:
            with pm.disable_adapter():
                return pm(input_ids=x).logits[0].float().numpy()
        pm.set_adapter(name)
        return pm(input_ids=x).logits[0].float().numpy()


@functools.partial(jax.jit, static_argnums=(0, 6))
def _forward(graphdef, params, tokens, positions, cache, lora_state_and_slots, lora_impl):
    lora_state, slots = lora_state_and_slots
    logits, _ = nnx.merge(graphdef, params)(tokens, positions, cache, lora_state, slots, logits_index=None,
                                            lora_impl=lora_impl)
    return logits


def test_converter_reads_magnitudes(tiny_dir, dora):
    _, paths, _ = dora
    cfg, _ = read_hf_checkpoint(tiny_dir[0])
    ad = read_peft_adapter(paths["dora_part"], cfg, MAX_RANK)
    assert set(ad.magnitudes) == {"q_proj", "v_proj", "up_proj"}
    assert np.all(np.isnan(ad.magnitudes["q_proj"][0])) and np.all(np.isfinite(ad.magnitudes["q_proj"][1]))
    assert read_peft_adapter(paths["plain"], cfg, MAX_RANK).magnitudes == {}


@pytest.mark.parametrize("lora_impl", ["gather", "laned", "grouped", "pallas"])
def test_mixed_batch_logits_match_peft(tiny_dir, dora, lora_impl):
    _, paths, pm = dora
    cfg, tensors = read_hf_checkpoint(tiny_dir[0])
    jmodel = build_model(cfg, tensors)
    state = init_lora_state(cfg, 4, MAX_RANK, dora=True)
    slot_of = {"dora_part": 0, "plain": 1, "dora_all": 3}  # slot 2 stays empty
    for name, slot in slot_of.items():
        upd = padded_update(read_peft_adapter(paths[name], cfg, MAX_RANK), cfg, MAX_RANK, dora=True)
        state = set_slot(state, slot, upd, model=jmodel)
    rows = ["dora_all", None, "plain", "dora_part", None, "dora_all"]
    tokens = np.random.default_rng(1).integers(0, cfg.vocab_size, size=(len(rows), 12)).astype(np.int32)
    positions = np.broadcast_to(np.arange(12, dtype=np.int32), tokens.shape)
    slots = np.asarray([-1 if r is None else slot_of[r] for r in rows], np.int32)
    graphdef, params = nnx.split(jmodel)
    got = np.asarray(_forward(graphdef, params, tokens, positions, init_cache(cfg, len(rows), 12),
                              (state, slots), lora_impl))
    for i, r in enumerate(rows):
        want = _peft_row(pm, tokens[i], r)
        np.testing.assert_allclose(got[i], want, atol=2e-4, rtol=2e-4, err_msg=f"row {i} ({r})")
        assert (got[i].argmax(-1) == want.argmax(-1)).all()
    # DoRA moved the logits (the factor is not 1): a DoRA row without its factor would differ
    plain_only = {m: {**s, "M": np.zeros_like(s["M"])} for m, s in state.items()}
    off = np.asarray(_forward(graphdef, params, tokens, positions, init_cache(cfg, len(rows), 12),
                              (plain_only, slots), lora_impl))
    assert np.abs(off[0] - got[0]).max() > 1e-2
    np.testing.assert_array_equal(off[2], got[2])  # a plain row reads a factor of exactly 1


def test_factor_uses_the_int8_weights_the_engine_multiplies_by():
    rng = np.random.default_rng(0)
    L, d_in, d_out, r = 2, 16, 12, 3
    w = rng.normal(size=(L, d_in, d_out)).astype(np.float32)
    q, scale = quant.quantize_np(np.swapaxes(w, 1, 2))  # rows = output channels
    qw = quant.QArray(jax.numpy.asarray(q), jax.numpy.asarray(scale))
    a, b = rng.normal(size=(L, d_in, r)).astype(np.float32), rng.normal(size=(L, r, d_out)).astype(np.float32)
    mag = rng.uniform(0.5, 2, size=(L, d_out)).astype(np.float32)
    mag[0, :4] = np.nan  # columns without DoRA
    got = np.asarray(jax.jit(dora_factor, static_argnums=4)(qw, a, b, mag, None))
    wq = np.swapaxes(quant.dequantize_np(q, scale), 1, 2)  # [L, in, out] as the engine multiplies
    want = mag / np.linalg.norm(wq + a @ b, axis=1) - 1
    want[0, :4] = 0
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    assert np.abs(want - (mag / np.linalg.norm(w + a @ b, axis=1) - 1))[1].max() > 1e-5  # int8 != float


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_factor_is_applied_in_the_compute_dtype(dtype):
    """`lora_linear` scales y = x W + delta by its row's factor in y's dtype (bfloat16 on a TPU), as
    y + y * M: within one bfloat16 step of y * (1 + M) computed exactly; float32 stays float32."""
    from jlora.models.llama import lora_linear

    rng = np.random.default_rng(0)
    t, d_in, d_out, n, r = 64, 32, 48, 3, 4
    dt = jax.numpy.dtype(dtype)
    x = jax.numpy.asarray(rng.normal(size=(t, d_in)), dt)
    w = jax.numpy.asarray(rng.normal(size=(d_in, d_out)) / np.sqrt(d_in), dt)
    pool = {"A": jax.numpy.asarray(rng.normal(size=(n, d_in, r)) * 0.3, dt),
            "B": jax.numpy.asarray(rng.normal(size=(n, r, d_out)) * 0.3, dt)}
    mag = rng.uniform(-0.5, 0.5, size=(n, d_out)).astype(np.float32)
    mag[1] = 0  # a plain adapter's slot
    ids = jax.numpy.asarray(rng.integers(-1, n, size=t), jax.numpy.int32)
    run = jax.jit(lambda p: lora_linear(x, w, p, ids, "gather"))
    y0 = np.asarray(run(pool).astype(jax.numpy.float32), np.float64)  # without factors ("M")
    got = run({**pool, "M": jax.numpy.asarray(mag)})
    assert got.dtype == dt
    ids_np = np.asarray(ids)
    want = y0 * (1 + np.where((ids_np >= 0)[:, None], mag[np.maximum(ids_np, 0)], 0))
    err = np.abs(np.asarray(got.astype(jax.numpy.float32), np.float64) - want)
    assert (err <= (2.0 ** -7 if dtype == "bfloat16" else 1e-6) * np.abs(want) + 1e-6).all(), err.max()
    eqns = jax.make_jaxpr(lambda p: lora_linear(x, w, p, ids, "gather"))({**pool, "M": jax.numpy.asarray(mag)}).eqns
    muls = [e.outvars[0].aval.dtype for e in eqns if e.primitive.name == "mul" and e.outvars[0].aval.shape == (t, d_out)]
    assert muls == [dt]  # the factor's one multiply of [T, out], in y's dtype
    keep = (ids_np < 0) | (ids_np == 1)  # base rows and the plain slot: y exactly
    np.testing.assert_array_equal(np.asarray(got.astype(jax.numpy.float32))[keep], y0[keep].astype(np.float32))


def test_set_slot_refuses_dora_without_base_weights(tiny_dir, dora):
    _, paths, _ = dora
    cfg, _ = read_hf_checkpoint(tiny_dir[0])
    upd = padded_update(read_peft_adapter(paths["dora_all"], cfg, MAX_RANK), cfg, MAX_RANK, dora=True)
    with pytest.raises(ValueError, match="DoRA magnitudes; pass model="):
        set_slot(init_lora_state(cfg, 2, MAX_RANK, dora=True), 0, upd)
    with pytest.raises(ValueError, match=r"no 'M'.*dora=True"):  # a state made without DoRA factors
        set_slot(init_lora_state(cfg, 2, MAX_RANK), 0, upd)


def _peft_greedy(pm, ids: list[int], name: str | None, n: int) -> list[int]:
    x = torch.tensor([ids])
    kw = dict(max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        if name is None:
            with pm.disable_adapter():
                out = pm.generate(input_ids=x, **kw)
        else:
            pm.set_adapter(name)
            out = pm.generate(input_ids=x, **kw)
    return out[0, len(ids):].tolist()


@pytest.mark.parametrize("slot_ranks", [None, (4, 8)])  # (4, 8): two slot pools, updates narrowed to rank 4
def test_engine_greedy_matches_peft_with_churn_and_no_recompiles(tiny_dir, dora, slot_ranks):
    _, paths, pm = dora
    llm = LLM(str(tiny_dir[0]), progress=False, lora_slot_ranks=slot_ranks, **ENGINE)  # 2 slots, 3 adapters: churn
    reqs = {n: LoRARequest(n, i + 1, str(p)) for i, (n, p) in enumerate(paths.items())}
    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    prompts = ["Hello there", "Once upon a time", "1 2 3 4", "The cat"]
    before = compile_stats.compile_count()
    for order in (["dora_all", None, "plain", "dora_part"], ["plain", "dora_part", None, "dora_all"]):
        outs = llm.generate(prompts, greedy, [reqs[n] if n else None for n in order])
        for o, n in zip(outs, order):
            assert o.outputs[0].token_ids == _peft_greedy(pm, list(o.prompt_token_ids), n, 8), n
    assert compile_stats.compile_count() == before
    assert llm.engine.adapters.stats["evictions"] > 0
    llm.close()


def test_bad_dora_adapters_are_refused_and_the_engine_keeps_serving(tiny_dir, dora, tmp_path):
    import json

    from safetensors.numpy import load_file

    root, paths, _ = dora
    cfg, _ = read_hf_checkpoint(tiny_dir[0])

    def variant(name: str, edit_tensors=None, edit_config=None):
        return edited_adapter(paths["dora_all"], tmp_path / name, edit_tensors, edit_config)

    key = next(k for k in load_file(str(paths["dora_all"] / "adapter_model.safetensors")) if "magnitude" in k)
    cases = {
        "short": (variant("short", lambda t: t.update({key: t[key][:-1]})), "expected"),
        "missing": (variant("missing", lambda t: t.pop(key)), "no lora_magnitude_vector"),
        "not_dora": (variant("not_dora", edit_config=lambda c: c.update(use_dora=False)), "use_dora=False"),
        "nan": (variant("nan", lambda t: t[key].__setitem__(0, np.nan)), "NaN"),
    }
    for name, (path, msg) in cases.items():
        with pytest.raises(ValueError, match=msg):
            read_peft_adapter(path, cfg, MAX_RANK)
    # DoRA (and LoRA) on the embedding is refused by name
    torch.manual_seed(0)
    fresh = transformers.LlamaForCausalLM.from_pretrained(tiny_dir[0])
    peft.get_peft_model(fresh, peft.LoraConfig(r=2, target_modules=["embed_tokens", "q_proj"], use_dora=True,
                                               init_lora_weights=False)).save_pretrained(tmp_path / "embed")
    with pytest.raises(ValueError, match="embed_tokens"):
        read_peft_adapter(tmp_path / "embed", cfg, MAX_RANK)

    llm = LLM(str(tiny_dir[0]), progress=False, **ENGINE)
    greedy = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    good = LoRARequest("dora_all", 1, str(paths["dora_all"]))
    want = llm.generate(["Hello"], greedy, good)[0].outputs[0].token_ids
    with pytest.raises(ValueError, match="lora_magnitude_vector' has shape"):
        llm.generate(["Hello"], greedy, LoRARequest("bad", 2, str(cases["short"][0])))
    assert llm.generate(["Hello"], greedy, good)[0].outputs[0].token_ids == want
    # A DoRA adapter at another scale, or in a combination, is refused (its factor is made for scale 1)
    with pytest.raises(ValueError, match="LoRARequest.scale.*DoRA"):
        llm.generate(["Hello"], greedy, LoRARequest("dora_all", 1, str(paths["dora_all"]), scale=0.5))
    plain = LoRARequest("plain", 3, str(paths["plain"]))
    with pytest.raises(ValueError, match="DoRA adapters cannot be combined.*dora_all"):
        llm.generate(["Hello"], greedy, LoRARequest.combine(good, plain, weights=(0.5, 0.5)))
    assert llm.generate(["Hello"], greedy, good)[0].outputs[0].token_ids == want
    assert llm.generate(["Hello"], greedy, LoRARequest("plain", 3, str(paths["plain"]), scale=0.5))[0].outputs
    llm.close()


def test_engine_without_enable_dora_holds_no_factors_and_refuses_dora_adapters(tiny_dir, dora):
    import json

    from safetensors.numpy import load_file

    _, paths, pm = dora
    llm = LLM(str(tiny_dir[0]), progress=False, **{**ENGINE, "enable_dora": False})
    runner = llm.engine.runner
    assert all(set(s) == {"A", "B"} for s in runner.lora_state.values())  # no "M": no factor in any graph
    assert runner.lora.base is None  # nor the base weights a DoRA write would read
    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    prompts, plain = ["Hello there", "The cat"], LoRARequest("plain", 3, str(paths["plain"]))
    before = compile_stats.compile_count()
    outs = llm.generate(prompts, greedy, [plain, None])
    for o, name in zip(outs, ["plain", None]):  # plain and base rows as peft has them
        assert o.outputs[0].token_ids == _peft_greedy(pm, list(o.prompt_token_ids), name, 8), name
    want = [o.outputs[0].token_ids for o in outs]
    dora_dir = paths["dora_all"]
    in_memory = LoRARequest("dora_mem", 5, tensors=load_file(str(dora_dir / "adapter_model.safetensors")),
                            config=json.loads((dora_dir / "adapter_config.json").read_text()))
    for req in (LoRARequest("dora_all", 1, str(dora_dir)), in_memory):
        with pytest.raises(ValueError, match=rf"'{req.lora_name}'.*DoRA adapter.*enable_dora=True.*--enable-dora"):
            llm.generate(prompts, greedy, [req, None])
        with pytest.raises(ValueError, match="enable_dora=True"):
            llm.engine.adapters.prepare(req)  # the server's load path
    assert "dora_all" not in llm.engine.adapters.list_adapters()
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, greedy, [plain, None])] == want
    assert compile_stats.compile_count() == before
    llm.close()


@pytest.mark.slow  # the real default model (SmolLM2-135M, tied embeddings), an engine of its own
def test_real_model_dora_and_plain_rows_match_peft(hf_real, tmp_path):
    from conftest import TEST_ENGINE

    model, _ = hf_real
    real_llm = LLM(progress=False, enable_dora=True, **TEST_ENGINE)
    specs = {"dora": dict(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj", "down_proj"], use_dora=True),
             "plain": dict(r=8, lora_alpha=16, target_modules=["q_proj", "o_proj"])}
    for i, (name, spec) in enumerate(specs.items()):
        torch.manual_seed(300 + i)
        pm = peft.get_peft_model(model, peft.LoraConfig(init_lora_weights=False, lora_dropout=0.0, **spec),
                                 adapter_name=name)
        _spread(pm, b_scale=0.3, magnitude=(0.8, 1.2))
        pm.save_pretrained(tmp_path, selected_adapters=[name])
        pm.unload()
    reqs = {n: LoRARequest(f"real-{n}", 700 + i, str(tmp_path / n)) for i, n in enumerate(specs)}
    order = ["dora", None, "plain", "dora"]
    prompts = ["What is the capital of France?", "Name a fruit.", "Write a haiku.", "2 + 2 ="]
    greedy = SamplingParams(temperature=0.0, max_tokens=12)  # stops at EOS, which is not in token_ids

    def hf_greedy(m, ids):  # up to 12 tokens, stopping at EOS (2), without it
        out = m.generate(input_ids=torch.tensor([ids]), max_new_tokens=12, do_sample=False, eos_token_id=2,
                         pad_token_id=2)[0, len(ids):].tolist()
        return out[:-1] if out and out[-1] == 2 else out

    before = compile_stats.compile_count()
    outs = real_llm.generate(prompts, greedy, [reqs[n] if n else None for n in order])
    assert compile_stats.compile_count() == before
    for o, n in zip(outs, order):
        ids = list(o.prompt_token_ids)
        with torch.no_grad():
            if n is None:
                assert o.outputs[0].token_ids == hf_greedy(model, ids)
                continue
            pm = peft.PeftModel.from_pretrained(model, str(tmp_path / n)).eval()
            try:
                assert o.outputs[0].token_ids == hf_greedy(pm, ids), n
            finally:
                pm.unload()
    real_llm.close()


@pytest.mark.slow  # two engines in a subprocess with 2 forced CPU devices
def test_tensor_parallel_dora_rows_match_one_device(tiny_dir, dora):
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    _, paths, _ = dora
    worker = Path(__file__).with_name("dora_tp_worker.py")
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).resolve().parents[1]), env.get("PYTHONPATH", "")])
    proc = subprocess.run([sys.executable, str(worker), str(tiny_dir[0]), str(paths["dora_all"]), str(paths["plain"]),
                           str(paths["dora_part"])], capture_output=True, text=True, timeout=900, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    assert r["tp"] == r["one"] and r["tp_reversed"] == r["one"]
    assert r["compiles"] == 0


def test_int8_engine_takes_the_norm_of_its_int8_weights(tiny_dir, dora):
    _, paths, _ = dora
    llm = LLM(str(tiny_dir[0]), progress=False, quantization="int8", **ENGINE)
    greedy = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    before = compile_stats.compile_count()
    req = LoRARequest("dora_all", 1, str(paths["dora_all"]))
    out = llm.generate(["Hello there", "Hi"], greedy, [req, None])
    assert compile_stats.compile_count() == before and all(len(o.outputs[0].token_ids) == 4 for o in out)
    runner, mgr = llm.engine.runner, llm.engine.adapters
    slot = mgr.slot_of("dora_all")
    w = runner.lora.base["o_proj"]  # a QArray: q i8[L, out, in], scale [L, out]
    assert isinstance(w, quant.QArray)
    wq = np.asarray(w.q, np.float32) * np.asarray(w.scale)[..., None]  # [L, out, in], as the projection uses
    ad = read_peft_adapter(paths["dora_all"], llm.engine.adapters.model_cfg, MAX_RANK)
    a, b = ad.weights["o_proj"]
    want = ad.magnitudes["o_proj"] / np.linalg.norm(np.swapaxes(wq, 1, 2) + a @ b, axis=1) - 1
    np.testing.assert_allclose(np.asarray(runner.lora_state["o_proj"]["M"][:, slot]), want, rtol=1e-4, atol=1e-5)
    llm.close()


def test_option_is_off_by_default_and_reaches_llm_from_the_cli(cli_llm_kwargs):
    from jlora.engine.config import EngineConfig

    assert EngineConfig().enable_dora is False
    with pytest.raises(ValueError, match="enable_dora must be a bool"):
        EngineConfig(enable_dora="yes")
    generate, serve = cli_llm_kwargs
    assert generate(["--enable-dora"])["enable_dora"] is True
    assert "enable_dora" not in generate([])  # LLM's default (off)
    assert serve(["--enable-dora"])["enable_dora"] is True
    assert serve([])["enable_dora"] is False
