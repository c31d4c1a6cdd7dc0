"""PEFT LoRA adapters -> jlora's layout: per module A f32[L, in, r], B f32[L, r, out], scale in B.

A PEFT LoRA directory holds `adapter_config.json` and `adapter_model.safetensors` (or the pickled
`adapter_model.bin`). Its tensors are named
`base_model.model.model.layers.{i}.self_attn.q_proj.lora_A.weight` `[r, in]` and `...lora_B.weight`
`[out, r]` (optionally with the adapter name, `lora_A.default.weight`). This module reads them
through one explicit name pattern, checks every tensor's shape against the base model and the
config, and reproduces PEFT's scaling exactly:

    scale = alpha / r                (alpha / sqrt(r) with use_rslora)
    r, alpha per module from rank_pattern / alpha_pattern (peft's `get_pattern_key`)
    targeted modules from target_modules (list / regex / "all-linear"), exclude_modules,
    layers_to_transform (+ layers_pattern), as in peft's `check_target_module_exists`.

Layers a module does not target are zeros; modules no layer targets are absent. Where the rank
differs between layers of one module (rank_pattern naming a single layer), that module's arrays
have the largest rank and the smaller layers are zero-padded, which is exact.

`fan_in_fan_out` only describes the *base* layer's weight layout (GPT-2's Conv1D); PEFT's
lora_A/lora_B are always [r, in] / [out, r], and PEFT itself resets the flag for nn.Linear, so it
changes nothing here.

DoRA (`use_dora=True`): each targeted module also has `...lora_magnitude_vector` [out], kept as
`LoRAAdapter.magnitudes` (f32[L, out], NaN where a layer is not targeted). The slot write turns it
into the per-column factor m / ||W + s B A|| (jlora.adapters.dora).

LoRA on the token embedding and the output head (`embed_tokens` / `lm_head` in target_modules)
becomes weights["embed_tokens"] / weights["lm_head"] with one "layer" (`_vocab_weights` says how
peft's tensors map and what a tied model with ensure_weight_tying does); an engine serves them with
`enable_embedding_lora=True`. peft's saved copies of the base tables (`...base_layer.weight`, written
by save_embedding_layers) are shape-checked and not read: the engine's own base weights are served.

Anything that changes the math in a way jlora does not implement (modules_to_save,
trainable tokens, biases, DoRA on embed_tokens / lm_head, target_parameters, ...) is rejected with
a ValueError that names the field or tensor.

Converted adapters can be saved with orbax (`save_adapter` / `load_adapter`); `convert` does both
steps for `jlora convert SRC DST`.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping, Sequence

import numpy as np

from jlora.formats import read_safetensors

if TYPE_CHECKING:  # only in annotations: `check_adapter_dir` must not import the model (Flax)
    from jlora.models.config import LlamaConfig

VOCAB_MODULES = ("embed_tokens", "lm_head")  # = jlora.models.config.VOCAB_MODULES (not imported here: no Flax)
ADAPTER_CONFIG = "adapter_config.json"
SAFETENSORS_FILE = "adapter_model.safetensors"
BIN_FILE = "adapter_model.bin"
JLORA_ADAPTER_META = "jlora_adapter.json"  # marks a directory written by `save_adapter`
JLORA_ADAPTER_FORMAT = "jlora-lora-adapter"
JLORA_ADAPTER_VERSION = 1

# The modules and their parent blocks are `jlora.models.config.LORA_MODULES` / `MODULE_PARENT`
# (imported where a model config is at hand: importing this file must not import Flax).

# Config fields that change the forward pass in ways jlora does not implement: reject when set.
_UNSUPPORTED_FIELDS = {
    "modules_to_save": "full trained copies of modules (modules_to_save) are not supported",
    "trainable_token_indices": "trainable token embeddings are not supported",
    "lora_bias": "LoRA bias terms (lora_bias=true) are not supported",
    "target_parameters": "LoRA on raw parameters (target_parameters) is not supported",
    "layer_replication": "layer replication is not supported",
    "alora_invocation_tokens": "activated LoRA (alora_invocation_tokens) is not supported",
    "use_qalora": "QA-LoRA is not supported",
    "use_bdlora": "block-diagonal LoRA (use_bdlora) is not supported",
    "arrow_config": "Arrow routing (arrow_config) is not supported",
    "monteclora_config": "MonteCLoRA (monteclora_config) is not supported",
    "velora_config": "VeLoRA (velora_config) is not supported",
    "kasa_config": "KaSA (kasa_config) is not supported",
}
# init_lora_weights values whose adapters only work on a base model modified by the init itself.
_BASE_MODIFYING_INITS = ("pissa", "olora", "corda", "lora_ga")

_AB_KEY = re.compile(r"^(?P<module>.+)\.lora_(?P<ab>[AB])(?:\.(?P<adapter>[^.]+))?\.weight$")
# DoRA's magnitude: peft saves `lora_magnitude_vector` (in memory `lora_magnitude_vector.<adapter>.weight`).
_MAG_KEY = re.compile(r"^(?P<module>.+)\.lora_(?P<ab>magnitude_vector)(?:\.(?P<adapter>[^.]+))?(?:\.weight)?$")
# LoRA on the embedding (peft's `Embedding`: lora_embedding_A [r, V], lora_embedding_B [D, r]) and on
# the output head (a plain Linear: lora_A [r, D], lora_B [V, r]); `base_layer.weight` is the copy of the
# base table peft saves beside them (save_embedding_layers).
_VOCAB_KEY = re.compile(r"^(?:base_model\.model\.)?(?P<module>(?:.*\.)?(?P<short>embed_tokens|lm_head))\."
                        r"(?:(?P<kind>lora_embedding_A|lora_embedding_B|lora_A|lora_B|lora_magnitude_vector)"
                        r"(?:\.(?P<adapter>[^.]+))?(?:\.weight)?|(?P<base>base_layer\.weight))$")
_VOCAB_KINDS = {"embed_tokens": ("lora_embedding_A", "lora_embedding_B"), "lm_head": ("lora_A", "lora_B")}
_LAYER_MODULE = re.compile(
    r"^(?P<prefix>(?:.*\.)?)layers\.(?P<idx>\d+)\."
    r"(?P<parent>self_attn|mlp)\.(?P<module>\w+)$"  # a module of MODULE_PARENT
)


# ---- the converted adapter ------------------------------------------------------------------------


@dataclasses.dataclass
class LoRAAdapter:
    """One converted adapter, on the host.

    weights: module -> (A f32[L, in, r_m], B f32[L, r_m, out]) with the PEFT scale folded into B
    (embed_tokens / lm_head: L = 1, A [1, V, r] / [1, D, r], B [1, r, D] / [1, r, V]);
    ranks: module -> r_m (the largest rank of that module over layers). Modules the adapter does
    not target are absent; layers it does not target are zeros. magnitudes (DoRA only): module ->
    f32[L, out], PEFT's lora_magnitude_vector per layer, NaN for layers the module has no DoRA in.
    """

    name: str
    ranks: dict[str, int]
    weights: dict[str, tuple[np.ndarray, np.ndarray]]
    source: str = ""
    magnitudes: dict[str, np.ndarray] = dataclasses.field(default_factory=dict)

    @property
    def is_dora(self) -> bool:
        return bool(self.magnitudes)

    @property
    def rank(self) -> int:
        """The largest rank over all modules (what must fit `max_lora_rank`)."""
        return max(self.ranks.values(), default=0)

    @property
    def num_layers(self) -> int:
        return next((a.shape[0] for m, (a, _) in self.weights.items() if m not in VOCAB_MODULES), 0)

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes + b.nbytes for a, b in self.weights.values()) + sum(
            m.nbytes for m in self.magnitudes.values())

    def validate(self, model_cfg: LlamaConfig, max_lora_rank: int | None = None,
                 holds: Sequence[str] | None = None, dora: bool | None = None) -> None:
        """Raise ValueError unless every array fits `model_cfg`, the modules are known (and in `holds`,
        the modules an engine's LoRA state holds, when given), ranks fit `max_lora_rank` and, with
        `dora` False (an engine without DoRA factors), the adapter is not a DoRA adapter."""
        from jlora.models.config import check_dora_fit, check_lora_fit

        where = f"adapter {self.name!r}" + (f" ({self.source})" if self.source else "")
        if set(self.ranks) != set(self.weights):
            raise ValueError(f"adapter {self.name!r}: ranks name modules {sorted(self.ranks)} but weights "
                             f"name {sorted(self.weights)}")
        check_lora_fit(where, self.ranks, max_lora_rank, holds)
        if dora is not None:
            check_dora_fit(where, self.is_dora, dora)
        shapes = {**model_cfg.module_shapes(), **model_cfg.vocab_shapes()}
        for m, (a, b) in self.weights.items():
            d_in, d_out = shapes[m]
            r = self.ranks[m]
            L = 1 if m in VOCAB_MODULES else model_cfg.num_hidden_layers  # one embedding / head per model
            if a.shape != (L, d_in, r):
                raise ValueError(f"adapter {self.name!r}: {m}.A has shape {a.shape}, expected {(L, d_in, r)} "
                                 f"(layers, in_features, rank) for this base model")
            if b.shape != (L, r, d_out):
                raise ValueError(f"adapter {self.name!r}: {m}.B has shape {b.shape}, expected {(L, r, d_out)} "
                                 f"(layers, rank, out_features) for this base model")
        L = model_cfg.num_hidden_layers
        for m, mag in self.magnitudes.items():
            if m not in self.weights:
                raise ValueError(f"adapter {self.name!r}: a DoRA magnitude for {m!r}, which has no LoRA weights")
            if mag.shape != (L, shapes[m][1]):
                raise ValueError(f"adapter {self.name!r}: {m} magnitude has shape {mag.shape}, expected "
                                 f"{(L, shapes[m][1])} (layers, out_features) for this base model")


# ---- reading PEFT files -----------------------------------------------------------------------------


def read_peft_config(path: str | Path) -> dict[str, Any]:
    """adapter_config.json as a dict; FileNotFoundError if missing, ValueError if malformed."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"adapter path {str(path)!r} does not exist")
    if not path.is_dir():
        raise ValueError(f"adapter path {str(path)!r} is not a directory (expected a PEFT adapter directory "
                         f"with {ADAPTER_CONFIG})")
    cfg_file = path / ADAPTER_CONFIG
    if not cfg_file.is_file():
        raise FileNotFoundError(f"no {ADAPTER_CONFIG} in adapter directory {str(path)!r}")
    return _read_json_object(cfg_file)


def _read_json_object(file: Path) -> dict[str, Any]:
    """A JSON object from `file`; ValueError naming the file if it is not one."""
    try:
        obj = json.loads(file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"malformed {file}: {e}") from e
    if not isinstance(obj, dict):
        raise ValueError(f"malformed {file}: expected a JSON object, got {type(obj).__name__}")
    return obj


def check_adapter_dir(path: str | Path) -> None:
    """Everything about an adapter directory that needs no base model: it exists, its config parses and
    asks only for what jlora serves, and its weights file is there. FileNotFoundError / ValueError if not.

    Cheap (no tensors read, no JAX), so a CLI or server can reject a bad adapter before loading a model.
    """
    path = Path(path)
    if is_jlora_adapter_dir(path):
        meta_file = path / JLORA_ADAPTER_META
        meta = _read_json_object(meta_file)
        if meta.get("format") != JLORA_ADAPTER_FORMAT or meta.get("version") != JLORA_ADAPTER_VERSION:
            raise ValueError(f"{meta_file}: format={meta.get('format')!r} version={meta.get('version')!r}; this "
                             f"jlora reads {JLORA_ADAPTER_FORMAT!r} version {JLORA_ADAPTER_VERSION}")
        if not (path / "weights").is_dir():
            raise FileNotFoundError(f"no orbax 'weights' checkpoint in {str(path)!r}")
        return
    _check_config(read_peft_config(path), str(path / ADAPTER_CONFIG))
    if not (path / SAFETENSORS_FILE).is_file() and not (path / BIN_FILE).is_file():
        raise FileNotFoundError(f"no {SAFETENSORS_FILE} (or {BIN_FILE}) in adapter directory {str(path)!r}")


def read_peft_tensors(path: str | Path) -> tuple[dict[str, np.ndarray], Path]:
    """All tensors of adapter_model.safetensors (preferred) or adapter_model.bin, as NumPy f32."""
    path = Path(path)
    st, bin_ = path / SAFETENSORS_FILE, path / BIN_FILE
    if st.is_file():
        return _read_safetensors(st), st
    if bin_.is_file():
        return _read_torch_bin(bin_), bin_
    raise FileNotFoundError(f"no {SAFETENSORS_FILE} (or {BIN_FILE}) in adapter directory {str(path)!r}")


def _read_safetensors(file: Path) -> dict[str, np.ndarray]:
    """Every tensor as f32 (bfloat16 included); ValueError "... corrupt or truncated?" on a broken file."""
    return {k: v.astype(np.float32) for k, v in read_safetensors(file).items()}


def _read_torch_bin(file: Path) -> dict[str, np.ndarray]:
    try:
        import torch
    except ImportError as e:
        raise ImportError(f"{file} is a PyTorch pickle and needs torch to read; install torch, or re-save the "
                          f"adapter as {SAFETENSORS_FILE} (PEFT's default)") from e
    try:
        state = torch.load(str(file), map_location="cpu", weights_only=True)
    except Exception as e:
        raise ValueError(f"{file} is not a readable PyTorch weights file (corrupt or truncated?): {e}") from e
    if not isinstance(state, Mapping):
        raise ValueError(f"{file}: expected a dict of tensors, got {type(state).__name__}")
    out = {}
    for k, v in state.items():
        if not isinstance(v, torch.Tensor):
            raise ValueError(f"{file}: entry {k!r} is a {type(v).__name__}, not a tensor")
        out[k] = v.detach().to(torch.float32).numpy()
    return out


# ---- PEFT's matching rules -----------------------------------------------------------------------


def get_pattern_key(pattern_keys: Sequence[str], key_to_match: str) -> str:
    """peft.utils.other.get_pattern_key: the first pattern key that matches the module name's end."""
    for key in pattern_keys:
        if re.match(rf"(.*\.)?({key})$", key_to_match):
            return key
    return key_to_match


def is_targeted(config: Mapping[str, Any], name: str) -> bool:
    """peft.tuners.tuners_utils.check_target_module_exists for a Llama linear-layer name."""
    exclude = config.get("exclude_modules")
    if exclude:
        if isinstance(exclude, str):
            if re.fullmatch(exclude, name):
                return False
        elif name in exclude or any(name.endswith(f".{k}") for k in exclude):
            return False
    target = config.get("target_modules")
    if isinstance(target, str):
        if target.lower() == "all-linear":  # every linear layer but the output head: all of Llama's
            return True
        return re.fullmatch(target, name) is not None
    target = list(target or [])
    if name in target:  # named exactly: layers_to_transform does not apply (as in peft)
        return True
    if not any(name.endswith(f".{t}") for t in target):
        return False
    layer_indexes = config.get("layers_to_transform")
    if layer_indexes is None or (isinstance(layer_indexes, list) and not layer_indexes):
        return True
    layers_pattern = config.get("layers_pattern")
    match = None
    if not layers_pattern:
        match = re.match(r".*?\.[^.]*\.(?P<idx>\d+)\.", name)
    else:
        for pattern in [layers_pattern] if isinstance(layers_pattern, str) else layers_pattern:
            match = re.match(rf"(?:^|.*?\.){pattern}\.(?P<idx>\d+)\.", name)
            if match is not None:
                break
    if match is None:
        return False
    idx = int(match.group("idx"))
    return idx == layer_indexes if isinstance(layer_indexes, int) else idx in layer_indexes


def _check_config(cfg: Mapping[str, Any], where: str) -> None:
    peft_type = cfg.get("peft_type", "LORA")
    if str(peft_type).upper() != "LORA":
        raise ValueError(f"{where}: peft_type={peft_type!r}; only LORA adapters are supported")
    for field, why in _UNSUPPORTED_FIELDS.items():
        if cfg.get(field):
            raise ValueError(f"{where}: {field}={cfg[field]!r}: {why}")
    bias = cfg.get("bias", "none")
    if bias not in (None, "none"):
        raise ValueError(f"{where}: bias={bias!r}: trained bias terms are not supported (need bias='none')")
    init = cfg.get("init_lora_weights")
    if isinstance(init, str) and init.lower().startswith(_BASE_MODIFYING_INITS):
        raise ValueError(f"{where}: init_lora_weights={init!r}: this adapter only works on the base model as "
                         f"modified by that initialisation; re-save it from PEFT with "
                         f"path_initial_model_for_weight_conversion to get a plain LoRA adapter")
    r = cfg.get("r")
    if isinstance(r, bool) or not isinstance(r, int) or r < 1:
        raise ValueError(f"{where}: r={r!r} must be a positive integer")
    alpha = cfg.get("lora_alpha", 8)
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)):
        raise ValueError(f"{where}: lora_alpha={alpha!r} must be a number")
    for field in ("rank_pattern", "alpha_pattern"):
        pat = cfg.get(field) or {}
        if not isinstance(pat, dict):
            raise ValueError(f"{where}: {field} must be an object mapping module patterns to values, got {pat!r}")
        for k, v in pat.items():
            bad = isinstance(v, bool) or not isinstance(v, (int, float))
            if bad or (field == "rank_pattern" and (not isinstance(v, int) or v < 1)):
                raise ValueError(f"{where}: {field}[{k!r}]={v!r} must be a "
                                 f"{'positive integer' if field == 'rank_pattern' else 'number'}")
    target = cfg.get("target_modules")
    if target is not None and not isinstance(target, (str, list)):
        raise ValueError(f"{where}: target_modules must be a list, a regex string or 'all-linear', got {target!r}")
    if isinstance(target, str) and (cfg.get("layers_to_transform") is not None or cfg.get("layers_pattern")):
        raise ValueError(f"{where}: layers_to_transform/layers_pattern cannot be combined with a regex "
                         f"target_modules string (PEFT rejects this too)")
    regexes = [("target_modules", target)] if isinstance(target, str) else []
    if isinstance(cfg.get("exclude_modules"), str):
        regexes.append(("exclude_modules", cfg["exclude_modules"]))
    lp = cfg.get("layers_pattern")
    regexes += [("layers_pattern", p) for p in ([lp] if isinstance(lp, str) else lp or [])]
    regexes += [(f, rf"(.*\.)?({k})$") for f in ("rank_pattern", "alpha_pattern") for k in (cfg.get(f) or {})]
    for field, pattern in regexes:
        try:
            re.compile(pattern)
        except (re.error, TypeError) as e:
            raise ValueError(f"{where}: {field} holds an invalid regular expression {pattern!r}: {e}") from e
    lt = cfg.get("layers_to_transform")
    if lt is not None and not (isinstance(lt, int) or (isinstance(lt, list) and all(isinstance(i, int) for i in lt))):
        raise ValueError(f"{where}: layers_to_transform must be an int or a list of ints, got {lt!r}")


def module_rank_alpha(cfg: Mapping[str, Any], name: str) -> tuple[int, float]:
    """(r, alpha) PEFT gives the module called `name` (its full name in the base model)."""
    rank_pattern = cfg.get("rank_pattern") or {}
    alpha_pattern = cfg.get("alpha_pattern") or {}
    r = rank_pattern.get(get_pattern_key(list(rank_pattern), name), cfg["r"])
    alpha = alpha_pattern.get(get_pattern_key(list(alpha_pattern), name), cfg.get("lora_alpha", 8))
    return int(r), float(alpha)


def lora_scale(r: int, alpha: float, use_rslora: bool) -> float:
    return alpha / math.sqrt(r) if use_rslora else alpha / r


def _reject_tensor(key: str, file: str | Path) -> ValueError:
    """The error for a tensor that is not a Llama linear layer's lora_A/lora_B."""
    if "lora_embedding_" in key or ".embed_tokens." in f".{key}.":
        why = ("expected only embed_tokens.lora_embedding_{A,B} (LoRA) and embed_tokens.base_layer.weight on the "
               "token embedding")
    elif "lm_head" in key:
        why = "expected only lm_head.lora_{A,B}.weight (LoRA) and lm_head.base_layer.weight on the output head"
    elif "lora_magnitude_vector" in key:
        why = "DoRA magnitude vectors are supported on the decoder layers' linear modules only"
    elif "trainable_tokens" in key:
        why = "trainable token embeddings (trainable_token_indices) are not supported"
    elif "modules_to_save" in key:
        why = "full trained copies of modules (modules_to_save) are not supported"
    elif key.endswith(".bias"):
        why = "bias terms (bias / lora_bias) are not supported"
    else:
        why = ("expected only '...layers.{i}.self_attn.{q,k,v,o}_proj.lora_{A,B}.weight' and "
               "'...layers.{i}.mlp.{gate,up,down}_proj.lora_{A,B}.weight'")
    return ValueError(f"{file}: unsupported tensor {key!r}: {why}")


# ---- conversion -----------------------------------------------------------------------------------


def read_peft_adapter(
    path: str | Path,
    model_cfg: LlamaConfig,
    max_lora_rank: int | None = None,
    name: str | None = None,
) -> LoRAAdapter:
    """Convert a PEFT LoRA directory for the base model `model_cfg` (shapes are checked against it)."""
    path = Path(path)
    config = read_peft_config(path)
    where = str(path / ADAPTER_CONFIG)
    _check_config(config, where)
    tensors, file = read_peft_tensors(path)
    return _convert(tensors, config, model_cfg, max_lora_rank, name or path.name, str(path),
                    where=where, file=str(file), config_name=ADAPTER_CONFIG)


def convert_peft_state_dict(
    tensors: Mapping[str, Any],  # PEFT state dict: '...q_proj.lora_A.weight' -> [r, in], 'lora_B' -> [out, r]
    config: Mapping[str, Any],  # adapter_config.json content
    model_cfg: LlamaConfig,
    max_lora_rank: int | None = None,
    name: str = "adapter",
    source: str = "",
) -> LoRAAdapter:
    """Convert a PEFT adapter held in memory (NumPy / JAX arrays + its config dict).

    The same checks and arithmetic as `read_peft_adapter` (which reads the two files and calls the
    same code), so an adapter gives bit-identical weights either way; errors name `tensors[...]` /
    `config` instead of the files.
    """
    if not isinstance(config, Mapping):
        raise ValueError(f"adapter {name!r}: config must be the adapter_config.json content as a dict, got "
                         f"{type(config).__name__}")
    if not isinstance(tensors, Mapping):
        raise ValueError(f"adapter {name!r}: tensors must be a dict of name -> array, got {type(tensors).__name__}")
    where = f"adapter {name!r} config"
    _check_config(config, where)
    arrays: dict[str, np.ndarray] = {}
    for k, v in tensors.items():
        try:
            arrays[k] = np.asarray(v).astype(np.float32)  # as the file reader does (bf16 via ml_dtypes)
        except (TypeError, ValueError) as e:
            raise ValueError(f"adapter {name!r}: tensors[{k!r}] is not a float array: {e}") from e
    return _convert(arrays, dict(config), model_cfg, max_lora_rank, name, source,
                    where=where, file=f"adapter {name!r} tensors", config_name="config")


def _convert(
    tensors: dict[str, np.ndarray],
    config: Mapping[str, Any],  # already checked by `_check_config`
    model_cfg: LlamaConfig,
    max_lora_rank: int | None,
    name: str,
    source: str,
    *,
    where: str,  # names the config in errors
    file: str,  # names the tensors in errors
    config_name: str,
) -> LoRAAdapter:
    """PEFT tensors + config -> LoRAAdapter: the one conversion both the files and memory go through."""
    from jlora.models.config import LORA_MODULES, MODULE_PARENT, check_lora_fit

    if not tensors:
        raise ValueError(f"{file} holds no tensors")

    shapes = model_cfg.module_shapes()
    L = model_cfg.num_hidden_layers
    use_rslora = bool(config.get("use_rslora", False))

    # 1. Name table: every key must be a lora_A/lora_B of one Llama linear layer.
    found: dict[tuple[int, str], dict[str, tuple[str, np.ndarray]]] = {}
    names: dict[tuple[int, str], str] = {}  # (layer, module) -> module's full name in the base model
    prefixes: set[str] = set()
    adapter_names: set[str] = set()
    use_dora = bool(config.get("use_dora", False))
    vocab: dict[str, dict[str, tuple[str, np.ndarray]]] = {}  # embed_tokens / lm_head -> kind -> (key, array)
    for key, arr in tensors.items():
        v = _VOCAB_KEY.match(key)
        if v is not None:
            _read_vocab_tensor(v, key, arr, vocab, names, adapter_names, config, model_cfg, file, config_name)
            continue
        m = _AB_KEY.match(key) or _MAG_KEY.match(key)
        module_name = m.group("module") if m else None
        if module_name is not None and module_name.startswith("base_model.model."):
            module_name = module_name[len("base_model.model."):]
        lm = _LAYER_MODULE.match(module_name) if module_name else None
        if m is None or lm is None:
            raise _reject_tensor(key, file)
        if m.group("adapter"):
            adapter_names.add(m.group("adapter"))
        idx, mod = int(lm.group("idx")), lm.group("module")
        if MODULE_PARENT.get(mod) != lm.group("parent"):
            raise _reject_tensor(key, file)
        if idx >= L:
            raise ValueError(f"{file}: tensor {key!r} is for layer {idx}, but the base model has {L} layers")
        if config.get("target_modules") is not None and not is_targeted(config, module_name):
            raise ValueError(f"{file}: tensor {key!r} is for module {module_name!r}, which {config_name} does "
                             f"not target (target_modules={config.get('target_modules')!r}, layers_to_transform="
                             f"{config.get('layers_to_transform')!r}, exclude_modules="
                             f"{config.get('exclude_modules')!r})")
        if m.group("ab") == "magnitude_vector" and not use_dora:
            raise ValueError(f"{file}: tensor {key!r} is a DoRA magnitude, but {config_name} has use_dora="
                             f"{config.get('use_dora')!r}")
        slot = found.setdefault((idx, mod), {})
        if m.group("ab") in slot:
            raise ValueError(f"{file}: tensors {slot[m.group('ab')][0]!r} and {key!r} are both lora_{m.group('ab')} "
                             f"of module {module_name!r}")
        slot[m.group("ab")] = (key, arr)
        names[(idx, mod)] = module_name
        prefixes.add(lm.group("prefix"))
    if len(adapter_names) > 1:
        raise ValueError(f"{file} mixes tensors of several adapters {sorted(adapter_names)}; expected one")
    if len(prefixes) > 1:
        raise ValueError(f"{file}: tensors use different module name prefixes {sorted(prefixes)}")
    prefix = prefixes.pop() if prefixes else "model."  # an adapter of the head / embedding only

    # 2. Coverage: what the config targets must be there, with both halves.
    for i in range(L):
        for mod, parent in MODULE_PARENT.items():
            full = f"{prefix}layers.{i}.{parent}.{mod}"
            if (i, mod) not in found:
                if config.get("target_modules") is not None and is_targeted(config, full):
                    raise ValueError(f"{file} has no lora_A/lora_B tensors for {full!r}, which {config_name} "
                                     f"targets (target_modules={config.get('target_modules')!r})")
                continue
            for ab in ("A", "B"):
                if ab not in found[(i, mod)]:
                    raise ValueError(f"{file}: module {full!r} has lora_{'B' if ab == 'A' else 'A'} but no "
                                     f"lora_{ab} tensor")
            if use_dora and "magnitude_vector" not in found[(i, mod)]:
                raise ValueError(f"{file}: module {full!r} has no lora_magnitude_vector tensor, which DoRA "
                                 f"(use_dora=true in {config_name}) needs")

    # 3. Ranks, shapes and scale per (layer, module); then assemble [L, ...] stacks.
    per_module: dict[str, dict[int, tuple[np.ndarray, np.ndarray]]] = {}
    mags: dict[str, np.ndarray] = {}  # DoRA: module -> [L, out], NaN where a layer is not targeted
    ranks: dict[str, int] = {}
    for (i, mod), ab in sorted(found.items()):
        full = names[(i, mod)]
        r, alpha = module_rank_alpha(config, full)
        d_in, d_out = shapes[mod]
        check_lora_fit(where, {full: r}, max_lora_rank)
        (ka, a), (kb, b) = ab["A"], ab["B"]
        if a.shape != (r, d_in):
            raise ValueError(f"{file}: tensor {ka!r} has shape {tuple(a.shape)}, expected {(r, d_in)} "
                             f"(r={r} from {config_name}, in_features={d_in} of the base model's {mod})")
        if b.shape != (d_out, r):
            raise ValueError(f"{file}: tensor {kb!r} has shape {tuple(b.shape)}, expected {(d_out, r)} "
                             f"(out_features={d_out} of the base model's {mod}, r={r} from {config_name})")
        if not (np.all(np.isfinite(a)) and np.all(np.isfinite(b))):
            raise ValueError(f"{file}: tensors of module {full!r} contain NaN or Inf")
        if use_dora:
            km, mag = ab["magnitude_vector"]
            if mag.shape != (d_out,):
                raise ValueError(f"{file}: tensor {km!r} has shape {tuple(mag.shape)}, expected {(d_out,)} "
                                 f"(out_features of the base model's {mod})")
            if not np.all(np.isfinite(mag)):
                raise ValueError(f"{file}: DoRA magnitude {km!r} contains NaN or Inf")
            mags.setdefault(mod, np.full((L, d_out), np.nan, np.float32))[i] = mag
        scale = lora_scale(r, alpha, use_rslora)
        per_module.setdefault(mod, {})[i] = (a.T.astype(np.float32), (b.T * np.float32(scale)).astype(np.float32))
        ranks[mod] = max(ranks.get(mod, 0), r)

    vocab_weights = _vocab_weights(vocab, names, config, model_cfg, max_lora_rank, use_rslora, where=where,
                                   file=file, config_name=config_name)
    for mod, (a, b) in vocab_weights.items():
        ranks[mod] = a.shape[-1]
    weights: dict[str, tuple[np.ndarray, np.ndarray]] = {}
    for mod in LORA_MODULES:
        if mod not in per_module:
            continue
        r_m = ranks[mod]
        d_in, d_out = shapes[mod]
        A = np.zeros((L, d_in, r_m), np.float32)
        B = np.zeros((L, r_m, d_out), np.float32)
        for i, (a, b) in per_module[mod].items():
            A[i, :, : a.shape[1]] = a
            B[i, : b.shape[0], :] = b
        weights[mod] = (A, B)
    weights.update(vocab_weights)
    ranks = {m: ranks[m] for m in weights}
    return LoRAAdapter(name=name, ranks=ranks, weights=weights, source=source, magnitudes=mags)


def _read_vocab_tensor(v: re.Match, key: str, arr: np.ndarray, vocab: dict, names: dict, adapter_names: set,
                       config: Mapping[str, Any], model_cfg: LlamaConfig, file: str, config_name: str) -> None:
    """File one embed_tokens / lm_head tensor (`_VOCAB_KEY` match `v`) into `vocab`, after its checks."""
    short, module = v.group("short"), v.group("module")
    if module.startswith("base_model.model."):
        module = module[len("base_model.model."):]
    if v.group("base"):  # peft's saved copy of the base table: must be the base model's shape; not read
        want = (model_cfg.vocab_size, model_cfg.hidden_size)
        if tuple(arr.shape) != want:
            raise ValueError(f"{file}: tensor {key!r} has shape {tuple(arr.shape)}, expected {want} (the base "
                             f"model's {short} weight)")
        return
    kind = v.group("kind")
    if kind == "lora_magnitude_vector" or config.get("use_dora"):
        raise ValueError(f"{file}: tensor {key!r}: DoRA (use_dora) on {short} is not supported; DoRA is served on "
                         f"the decoder layers' linear modules only")
    if kind not in _VOCAB_KINDS[short]:
        raise _reject_tensor(key, file)
    if v.group("adapter"):
        adapter_names.add(v.group("adapter"))
    tied_head = (short == "lm_head" and config.get("ensure_weight_tying") and model_cfg.tie_word_embeddings)
    if config.get("target_modules") is not None and not tied_head and not _names_vocab(config, module):
        raise ValueError(f"{file}: tensor {key!r} is for module {module!r}, which {config_name} does not target "
                         f"(target_modules={config.get('target_modules')!r})")
    got = vocab.setdefault(short, {})
    ab = kind[-1]
    if ab in got:
        raise ValueError(f"{file}: tensors {got[ab][0]!r} and {key!r} are both {kind} of module {module!r}")
    got[ab] = (key, arr)
    names[short] = module


def _names_vocab(config: Mapping[str, Any], module: str) -> bool:
    """Whether target_modules names `module` (embed_tokens / lm_head, by its full name or its last part);
    "all-linear" leaves both out, as in peft."""
    target = config.get("target_modules")
    if isinstance(target, str):
        return target.lower() != "all-linear" and re.fullmatch(target, module) is not None
    short = module.rsplit(".", 1)[-1]
    return any(t in (module, short) or module.endswith(f".{t}") for t in target or [])


def _vocab_weights(vocab: dict, names: dict, config: Mapping[str, Any], model_cfg: LlamaConfig,
                   max_lora_rank: int | None, use_rslora: bool, *, where: str, file: str,
                   config_name: str) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """embed_tokens / lm_head as (A f32[1, in, r], B f32[1, r, out]) with the scale folded into B.

    embed_tokens: token t's delta is scale * lora_embedding_A[:, t] @ lora_embedding_B^T (peft's
    `Embedding`), so A = lora_embedding_A^T [V, r] (row t read by token id), B = scale * B^T [r, D].
    lm_head: A = lora_A^T [D, r], B = scale * lora_B^T [r, V]. On a tied model with
    ensure_weight_tying, peft's head adapter *is* the embedding's (lora_A = lora_embedding_B^T,
    lora_B = lora_embedding_A^T, at the head's own r / alpha); peft saves it too, and where a file
    lacks it, it is made from the embedding's the same way. Without ensure_weight_tying the two
    deltas are independent, tied base or not: peft adds the embedding's delta at the lookup only."""
    from jlora.models.config import check_lora_fit

    from_embedding = ("lm_head" not in vocab and "embed_tokens" in vocab and config.get("ensure_weight_tying")
                      and model_cfg.tie_word_embeddings)
    if from_embedding:
        (ka, ea), (kb, eb) = vocab["embed_tokens"]["A"], vocab["embed_tokens"]["B"]
        vocab = {**vocab, "lm_head": {"A": (kb, np.asarray(eb).T), "B": (ka, np.asarray(ea).T)}}
        names = {**names, "lm_head": "lm_head"}
    if isinstance(config.get("target_modules"), list):
        for short, full in (("embed_tokens", "model.embed_tokens"), ("lm_head", "lm_head")):
            if short not in vocab and _names_vocab(config, full):
                raise ValueError(f"{file} has no LoRA tensors for {full!r}, which {config_name} targets "
                                 f"(target_modules={config.get('target_modules')!r})")
    out = {}
    shapes = model_cfg.vocab_shapes()
    for short, got in vocab.items():
        full = names[short]
        kind_a, kind_b = _VOCAB_KINDS[short]
        if "A" not in got or "B" not in got:
            have, lack = (kind_a, kind_b) if "A" in got else (kind_b, kind_a)
            raise ValueError(f"{file}: module {full!r} has {have} but no {lack} tensor")
        r, alpha = module_rank_alpha(config, full)
        (ka, a), (kb, b) = got["A"], got["B"]
        d_in, d_out = shapes[short]  # peft's A is [r, in], B [out, r]
        ra = a.shape[0] if a.ndim == 2 else -1
        if a.ndim != 2 or b.ndim != 2 or a.shape[1] != d_in or b.shape != (d_out, ra):
            raise ValueError(f"{file}: tensors {ka!r} {tuple(a.shape)} and {kb!r} {tuple(b.shape)} do not fit the "
                             f"base model's {short}: expected {(r, d_in)} and {(d_out, r)} (r={r} from {config_name})")
        if a.shape[0] != r and not from_embedding:
            raise ValueError(f"{file}: tensor {ka!r} has rank {a.shape[0]}, but {config_name} gives {full} "
                             f"r={r}")
        check_lora_fit(where, {full: a.shape[0]}, max_lora_rank)
        if not (np.all(np.isfinite(a)) and np.all(np.isfinite(b))):
            raise ValueError(f"{file}: tensors of module {full!r} contain NaN or Inf")
        scale = np.float32(lora_scale(r, alpha, use_rslora))
        out[short] = (np.ascontiguousarray(a.T, np.float32)[None],
                      np.ascontiguousarray(b.T * scale, np.float32)[None])
    return out


# ---- orbax save / load ------------------------------------------------------------------------------


def save_adapter(adapter: LoRAAdapter, path: str | Path) -> None:
    """Write a converted adapter: jlora_adapter.json + an orbax checkpoint of its arrays."""
    import orbax.checkpoint as ocp

    if adapter.is_dora:
        raise ValueError(f"adapter {adapter.name!r} is a DoRA adapter: the converted format does not hold DoRA "
                         f"magnitudes; serve its PEFT directory directly")

    path = Path(path).absolute()
    path.mkdir(parents=True, exist_ok=True)
    tree = {m: {"A": np.ascontiguousarray(a, np.float32), "B": np.ascontiguousarray(b, np.float32)}
            for m, (a, b) in adapter.weights.items()}
    with ocp.StandardCheckpointer() as ckpt:
        ckpt.save(path / "weights", tree, force=True)
    meta = {
        "format": JLORA_ADAPTER_FORMAT, "version": JLORA_ADAPTER_VERSION, "name": adapter.name,
        "ranks": adapter.ranks, "source": adapter.source, "num_layers": adapter.num_layers,
        "shapes": {m: {"A": list(a.shape), "B": list(b.shape)} for m, (a, b) in adapter.weights.items()},
    }
    (path / JLORA_ADAPTER_META).write_text(json.dumps(meta, indent=1))


def load_adapter(
    path: str | Path,
    model_cfg: LlamaConfig | None = None,
    max_lora_rank: int | None = None,
    name: str | None = None,
) -> LoRAAdapter:
    """Read an adapter written by `save_adapter`; checked against `model_cfg` when given."""
    import orbax.checkpoint as ocp

    path = Path(path).absolute()
    meta_file = path / JLORA_ADAPTER_META
    if not meta_file.is_file():
        raise FileNotFoundError(f"no {JLORA_ADAPTER_META} in {str(path)!r} (not a converted jlora adapter)")
    meta = _read_json_object(meta_file)
    fmt = meta.get("format")
    if fmt != JLORA_ADAPTER_FORMAT:
        raise ValueError(f"{meta_file}: not a jlora adapter (format={fmt!r}, expected {JLORA_ADAPTER_FORMAT!r})")
    if meta.get("version") != JLORA_ADAPTER_VERSION:
        raise ValueError(f"{meta_file}: version {meta.get('version')!r}; this jlora reads version "
                         f"{JLORA_ADAPTER_VERSION}")
    if not (path / "weights").is_dir():
        raise FileNotFoundError(f"no orbax 'weights' checkpoint in {str(path)!r}")
    try:
        with ocp.StandardCheckpointer() as ckpt:
            tree = ckpt.restore(path / "weights")
    except Exception as e:
        raise ValueError(f"{path / 'weights'} is not a readable orbax checkpoint: {e}") from e
    ranks = {str(m): int(r) for m, r in meta.get("ranks", {}).items()}
    try:
        weights = {m: (np.asarray(t["A"], np.float32), np.asarray(t["B"], np.float32)) for m, t in tree.items()}
    except (KeyError, TypeError) as e:
        raise ValueError(f"{path / 'weights'}: expected {{module: {{'A', 'B'}}}} arrays: {e}") from e
    adapter = LoRAAdapter(name=name or meta.get("name") or path.name, ranks=ranks, weights=weights,
                          source=str(meta.get("source", "")))
    if model_cfg is not None:
        adapter.validate(model_cfg, max_lora_rank)
    return adapter


def is_jlora_adapter_dir(path: str | Path) -> bool:
    return (Path(path) / JLORA_ADAPTER_META).is_file()


def read_adapter(
    path: str | Path,
    model_cfg: LlamaConfig,
    max_lora_rank: int | None = None,
    name: str | None = None,
) -> LoRAAdapter:
    """A PEFT directory or a converted jlora directory, whichever `path` is."""
    if is_jlora_adapter_dir(path):
        return load_adapter(path, model_cfg, max_lora_rank, name)
    return read_peft_adapter(path, model_cfg, max_lora_rank, name)


def convert(
    src: str | Path,
    dst: str | Path,
    model_cfg: LlamaConfig,
    max_lora_rank: int | None = None,
    name: str | None = None,
) -> LoRAAdapter:
    """PEFT directory `src` -> converted orbax adapter at `dst` (what `jlora convert SRC DST` does)."""
    adapter = read_peft_adapter(src, model_cfg, max_lora_rank, name)
    save_adapter(adapter, dst)
    return adapter


def convert_main(argv: Sequence[str] | None = None) -> int:
    """`jlora convert SRC DST [--model M] [--max-lora-rank R]`."""
    import argparse

    from jlora.models.loading import read_model_config

    p = argparse.ArgumentParser(prog="jlora convert", description="convert a PEFT LoRA adapter for jlora")
    p.add_argument("src", help="PEFT adapter directory (adapter_config.json + adapter_model.safetensors)")
    p.add_argument("dst", help="output directory (orbax checkpoint + jlora_adapter.json)")
    p.add_argument("--model", default=None, help="base model (GGUF file or checkpoint dir); default: SmolLM2-135M")
    p.add_argument("--max-lora-rank", type=int, default=None, help="reject adapters above this rank")
    p.add_argument("--name", default=None, help="adapter name stored with it (default: SRC's folder name)")
    args = p.parse_args(argv)
    adapter = convert(args.src, args.dst, read_model_config(args.model), args.max_lora_rank, args.name)
    print(f"converted {args.src} -> {args.dst} (modules: {sorted(adapter.weights)}, "
          f"ranks: {sorted(set(adapter.ranks.values()))})")
    return 0
