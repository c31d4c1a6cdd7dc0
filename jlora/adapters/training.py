"""Train adapters in the layout the engine serves, and export them as PEFT directories.

The trainable pytree is a LoRA state (`jlora.models.llama.LoRAState`): per packed module
{"A": [L, N, in, S*R], "B": [L, N, R, out]}, N adapters side by side, the PEFT scale folded into
B, exactly what the engine's slots hold. `Llama.train_logits(tokens, params, seq_slot_ids)` is
the differentiable forward, so a train step's output can be served (`LLM.update_adapter`) or
exported (`save_peft`) without converting anything in between.

Entries the config does not target (a sub-module, a layer, lanes beyond a module's rank) start
at zero in both A and B; their gradients are then exactly zero (dA = x^T dy B^T and dB =
(x A)^T dy), so they stay zero under any gradient-based optimizer without weight decay on them.

Note on the folded scale: training B here trains scale * B_peft. Adam-style optimizers are
invariant to that constant; plain SGD sees a learning rate scale^2 larger on B than PEFT's.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Mapping

import jax
import jax.numpy as jnp
import numpy as np

from jlora.adapters.peft import (ADAPTER_CONFIG, SAFETENSORS_FILE, LoRAAdapter, _check_config, is_targeted,
                                 lora_scale, module_rank_alpha)
from jlora.adapters.request import _snapshot_config
from jlora.models.config import MODULE_PARENT, PACKED_MODULES, LlamaConfig
from jlora.models.llama import LoRAState, lora_state_modules

# What `save_peft` writes besides the caller's fields (PEFT's LoraConfig defaults for a plain LoRA).
_PEFT_DEFAULTS = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "lora_alpha": 8, "lora_dropout": 0.0,
                  "bias": "none", "fan_in_fan_out": False, "use_rslora": False, "rank_pattern": {},
                  "alpha_pattern": {}, "init_lora_weights": True, "inference_mode": True}


def peft_config(config: Mapping[str, Any] | Any) -> dict[str, Any]:
    """A PEFT LoRA config (dict as in adapter_config.json, or a peft `LoraConfig`), checked."""
    cfg = _snapshot_config("training", config)
    if cfg.get("target_modules") is None:
        raise ValueError("config: target_modules is required (a list of module names, a regex or 'all-linear')")
    _check_config(cfg, "config")
    if cfg.get("use_dora"):  # served (jlora.adapters.dora), not trained: no magnitude parameters here
        raise ValueError("config: use_dora=True: training DoRA adapters is not supported (serving them is, "
                         "with enable_dora=True)")
    return cfg


def _targets(model_cfg: LlamaConfig, cfg: Mapping[str, Any]):
    """(layer, packed module, sub-module index, module, full name, rank, scale) for every target."""
    use_rslora = bool(cfg.get("use_rslora", False))
    for i in range(model_cfg.num_hidden_layers):
        for fused, subs in PACKED_MODULES.items():
            for s, m in enumerate(subs):
                full = f"model.layers.{i}.{MODULE_PARENT[m]}.{m}"
                if is_targeted(cfg, full):
                    r, alpha = module_rank_alpha(cfg, full)
                    yield i, fused, s, m, full, r, lora_scale(r, alpha, use_rslora)


def params_rank(model_cfg: LlamaConfig, config: Mapping[str, Any] | Any) -> int:
    """The lanes per sub-module (R) a config needs: its largest module rank."""
    return max((t[5] for t in _targets(model_cfg, peft_config(config))), default=0)


def init_lora_params(
    model_cfg: LlamaConfig,
    config: Mapping[str, Any] | Any,  # PEFT LoRA config: r, lora_alpha, target_modules, rank_pattern, ...
    key: jax.Array,
    *,
    num_adapters: int = 1,
    rank: int | None = None,  # lanes per sub-module; None = the config's largest rank
    dtype: Any = jnp.float32,
) -> LoRAState:
    """PEFT's default initialisation in the served layout: A kaiming-uniform (bound 1/sqrt(in),
    as torch's kaiming_uniform_(a=sqrt(5))), B zeros, on the targeted lanes only; N adapters."""
    cfg = peft_config(config)
    need = params_rank(model_cfg, cfg)
    rank = need if rank is None else rank
    if rank < need:
        raise ValueError(f"rank={rank} is below the config's largest module rank {need}")
    shapes = model_cfg.packed_shapes()
    L, N = model_cfg.num_hidden_layers, num_adapters
    masks = {f: np.zeros((L, 1, 1, len(shapes[f][1]) * rank), bool) for f in shapes}
    targets = list(_targets(model_cfg, cfg))
    for i, fused, s, _, _, r, _ in targets:
        masks[fused][i, 0, 0, s * rank: s * rank + r] = True
    out = {}
    for f in lora_state_modules(tuple(sorted({t[3] for t in targets}))):
        d_in, outs = shapes[f]
        key, sub = jax.random.split(key)
        bound = 1.0 / np.sqrt(d_in)
        a = jax.random.uniform(sub, (L, N, d_in, len(outs) * rank), jnp.float32, -bound, bound)
        out[f] = {"A": jnp.where(masks[f], a, 0.0).astype(dtype),
                  "B": jnp.zeros((L, N, rank, sum(outs)), dtype)}
    return out


def lora_params_from_adapter(adapter: LoRAAdapter, model_cfg: LlamaConfig, rank: int | None = None,
                             dtype: Any = jnp.float32) -> LoRAState:
    """A converted adapter (e.g. `read_peft_adapter`) as a one-adapter training pytree (N=1)."""
    from jlora.adapters.slots import padded_update

    if adapter.is_dora:  # its magnitudes have no place in these parameters: trained on as plain, they would be lost
        raise ValueError(f"adapter {adapter.name!r} is a DoRA adapter: training DoRA adapters is not supported "
                         f"(serving them is, with enable_dora=True)")
    rank = adapter.rank if rank is None else rank
    update = padded_update(adapter, model_cfg, rank, tuple(adapter.weights), np.float32)  # {"A", "B"} per module
    return {f: {k: jnp.asarray(v[:, None], dtype) for k, v in ab.items()} for f, ab in update.items()}


def peft_tensors(params: LoRAState, model_cfg: LlamaConfig, config: Mapping[str, Any] | Any,
                 adapter: int = 0) -> dict[str, np.ndarray]:
    """One adapter of `params` as PEFT's state dict (lora_A [r, in], lora_B [out, r], scale taken
    back out of B): the reverse of the converter, packed modules split into PEFT's modules.
    Weights outside what `config` targets must be zero (else they would be silently dropped)."""
    cfg = peft_config(config)
    host = {f: {k: np.asarray(jax.device_get(v), np.float32)[:, adapter] for k, v in ab.items()}
            for f, ab in params.items()}
    shapes = model_cfg.packed_shapes()
    kept = {f: {k: np.zeros(v.shape, bool) for k, v in ab.items()} for f, ab in host.items()}
    tensors: dict[str, np.ndarray] = {}
    for i, fused, s, m, full, r, scale in _targets(model_cfg, cfg):
        if fused not in host:
            raise ValueError(f"config targets {full!r}, but the params hold no {fused!r}")
        a, b = host[fused]["A"][i], host[fused]["B"][i]  # [in, S*R], [R, out]
        rank = b.shape[0]
        if r > rank:
            raise ValueError(f"config gives {full!r} rank {r}, above the params' {rank} lanes")
        col = sum(shapes[fused][1][:s])
        width = shapes[fused][1][s]
        tensors[f"base_model.model.{full}.lora_A.weight"] = np.ascontiguousarray(a[:, s * rank: s * rank + r].T)
        tensors[f"base_model.model.{full}.lora_B.weight"] = np.ascontiguousarray(
            (b[:r, col: col + width] / np.float32(scale)).T)
        kept[fused]["A"][i, :, s * rank: s * rank + r] = True
        kept[fused]["B"][i, :r, col: col + width] = True
    for f, ab in host.items():
        for k, v in ab.items():
            lost = np.abs(np.where(kept[f][k], 0.0, v)).max(initial=0.0)
            if lost > 0:
                raise ValueError(f"params hold non-zero {f}.{k} weights (max {lost:.3g}) that config does not "
                                 f"target (target_modules={cfg.get('target_modules')!r}, r={cfg.get('r')}); "
                                 f"exporting would drop them")
    return tensors


def save_peft(params: LoRAState, config: Mapping[str, Any] | Any, path: str | Path, model_cfg: LlamaConfig,
              *, adapter: int = 0, base_model_name_or_path: str | None = None) -> Path:
    """Write one adapter of `params` as a PEFT directory (adapter_config.json +
    adapter_model.safetensors) that `peft.PeftModel.from_pretrained` loads."""
    from safetensors.numpy import save_file

    cfg = {**_PEFT_DEFAULTS, **peft_config(config)}
    if base_model_name_or_path is not None:
        cfg["base_model_name_or_path"] = base_model_name_or_path
    tensors = peft_tensors(params, model_cfg, cfg, adapter)
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / SAFETENSORS_FILE), metadata={"format": "pt"})
    (path / ADAPTER_CONFIG).write_text(json.dumps(cfg, indent=2, sort_keys=True))
    return path
