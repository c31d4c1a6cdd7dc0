"""LlamaConfig: the static (hashable) description of a Llama-family model.

One config covers the families whose decoder block is Llama's up to a few switches: Llama 2/3.x
(rope scaling), Mistral (sliding window), Qwen2/2.5 (q/k/v biases) and Qwen3 (per-head q/k
RMSNorm, explicit head_dim). Anything else is refused by name before a weight is read.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

# Packed modules (vLLM's term): linear layers that read the same input run as one GEMM, and their
# LoRA slots as one shrink. Fused name -> its sub-modules (PEFT / Hugging Face names), in the
# order their output columns appear in the fused weight [L, in, sum(out)].
PACKED_MODULES: dict[str, tuple[str, ...]] = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "o_proj": ("o_proj",),
    "gate_up_proj": ("gate_proj", "up_proj"),
    "down_proj": ("down_proj",),
}
FUSED_OF = {sub: fused for fused, subs in PACKED_MODULES.items() for sub in subs}  # sub-module -> fused name
# The one list of LoRA-targetable modules (PEFT names), derived from the table above: the
# converter, the LoRA state, the manager and the loaders all read it from here.
LORA_MODULES: tuple[str, ...] = tuple(FUSED_OF)  # q, k, v, o, gate, up, down
MODULE_PARENT: dict[str, str] = {  # module -> its parent block in HF Llama naming
    sub: "mlp" if fused in ("gate_up_proj", "down_proj") else "self_attn" for sub, fused in FUSED_OF.items()}
# LoRA on the token embedding and the output head (PEFT names): one per model, not per layer, held
# by an engine's LoRA state only with `EngineConfig.enable_embedding_lora` (vocabulary-sized slots).
VOCAB_MODULES: tuple[str, ...] = ("embed_tokens", "lm_head")
EMBEDDING_LORA_OPTION = "enable_embedding_lora"  # what a refusal names
# DoRA adapters (use_dora) are served only by an engine with `EngineConfig.enable_dora`: their
# per-column factor is a slot array "M" and a multiply in every LoRA projection of every step.
DORA_OPTION = "enable_dora"  # what a refusal names
# An engine's slots hold only the packed projections its `EngineConfig.lora_target_modules` names.
TARGET_MODULES_OPTION = "lora_target_modules"  # what a refusal names


def check_dora_fit(where: str, is_dora: bool, enabled: bool) -> None:
    """ValueError naming `where` and the option when a DoRA adapter meets an engine without DoRA."""
    if is_dora and not enabled:
        raise ValueError(f"{where} is a DoRA adapter (use_dora=True); this engine holds no DoRA factors: turn "
                         f"them on with {DORA_OPTION}=True (LLM({DORA_OPTION}=True), --enable-dora). Off by "
                         f"default: the per-column factor costs every LoRA step")


def check_lora_fit(
    where: str,  # who is checked, e.g. "adapter 'sql' at '/path'"
    ranks: dict[str, int],  # module (PEFT name, or a full per-layer name) -> rank
    max_lora_rank: int | None = None,
    holds: tuple[str, ...] | None = None,  # the modules the LoRA state holds (None: any of LORA_MODULES)
) -> None:
    """The one check that an adapter fits an engine: known modules, held by its LoRA state, and
    no rank above `max_lora_rank`. ValueError naming `where`, the modules and the limit."""
    short = {m: m.rsplit(".", 1)[-1] for m in ranks}
    unknown = sorted(m for m in ranks if short[m] not in LORA_MODULES + VOCAB_MODULES)
    if unknown:
        raise ValueError(f"{where}: unknown LoRA modules {unknown}; known: {list(LORA_MODULES + VOCAB_MODULES)}")
    if holds is not None:
        extra = sorted({short[m] for m in ranks} - set(holds))
        vocab = [m for m in extra if m in VOCAB_MODULES]
        if vocab:
            raise ValueError(f"{where} has LoRA on {vocab}; this engine holds no embedding / output-head LoRA "
                             f"slots: turn them on with {EMBEDDING_LORA_OPTION}=True "
                             f"(LLM({EMBEDDING_LORA_OPTION}=True), --enable-embedding-lora)")
        if extra:
            raise ValueError(f"{where} targets modules {extra} that this engine's LoRA state does not hold "
                             f"(it holds {list(holds)}): the engine option {TARGET_MODULES_OPTION} chooses them "
                             f"(LLM({TARGET_MODULES_OPTION}=...), --lora-target-modules; None: every module)")
    if max_lora_rank is not None:
        for m, r in ranks.items():
            if r > max_lora_rank:
                raise ValueError(f"{where}: module {m!r} has rank r={r}, above max_lora_rank={max_lora_rank}")

# Hugging Face `model_type` / GGUF `general.architecture` values this decoder serves.
MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")
GGUF_ARCHITECTURES = ("llama", "qwen2", "qwen3")  # llama.cpp writes Mistral as "llama"


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
    vocab_size: int
    hidden_size: int  # D
    intermediate_size: int  # F
    num_hidden_layers: int  # L
    num_attention_heads: int  # H
    num_key_value_heads: int  # KVH
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    # Llama 3 rope scaling as a hashable tuple of (key, value) pairs, or None.
    rope_scaling: tuple[tuple[str, Any], ...] | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    bos_token_id: int | None = 1
    eos_token_id: int | None = 2
    model_type: str = "llama"
    qkv_bias: bool = False  # biases on q/k/v (Qwen2/2.5 always; Llama/Qwen3 with attention_bias)
    o_bias: bool = False  # bias on o_proj (Llama/Qwen3 attention_bias; Qwen2 has none)
    qk_norm: bool = False  # Qwen3: RMSNorm over each head of q and k, before RoPE
    # Sliding-window attention: each layer's window in positions (a query sees the keys with
    # position > its own - window), None for a full-attention layer; None overall = no window.
    sliding_windows: tuple[int | None, ...] | None = None

    def __post_init__(self) -> None:
        if self.model_type not in MODEL_TYPES:
            raise ValueError(f"model_type={self.model_type!r} is not supported; supported: {list(MODEL_TYPES)}")
        if self.sliding_windows is not None and len(self.sliding_windows) != self.num_hidden_layers:
            raise ValueError(f"sliding_windows has {len(self.sliding_windows)} entries for "
                             f"{self.num_hidden_layers} layers")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads={self.num_attention_heads} must be a multiple of "
                f"num_key_value_heads={self.num_key_value_heads}"
            )
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "head_dim"):
            if getattr(self, name) <= 0:
                raise ValueError(f"LlamaConfig.{name} must be positive, got {getattr(self, name)}")

    @property
    def has_sliding_window(self) -> bool:
        return self.sliding_windows is not None and any(w is not None for w in self.sliding_windows)

    @property
    def rope_scaling_dict(self) -> dict[str, Any] | None:
        return dict(self.rope_scaling) if self.rope_scaling else None

    def module_shapes(self) -> dict[str, tuple[int, int]]:
        """(in, out) features of each LoRA-targetable linear layer."""
        d, f = self.hidden_size, self.intermediate_size
        q = self.num_attention_heads * self.head_dim
        kv = self.num_key_value_heads * self.head_dim
        return {
            "q_proj": (d, q), "k_proj": (d, kv), "v_proj": (d, kv), "o_proj": (q, d),
            "gate_proj": (d, f), "up_proj": (d, f), "down_proj": (f, d),
        }

    def vocab_shapes(self) -> dict[str, tuple[int, int]]:
        """(in, out) of the LoRA factors of VOCAB_MODULES: embed_tokens maps a token (one of V) to D
        features, lm_head D features to V logits."""
        return {"embed_tokens": (self.vocab_size, self.hidden_size), "lm_head": (self.hidden_size, self.vocab_size)}

    def packed_shapes(self) -> dict[str, tuple[int, tuple[int, ...]]]:
        """Fused module -> (in features, out features of each sub-module in column order)."""
        shapes = self.module_shapes()
        return {f: (shapes[subs[0]][0], tuple(shapes[m][1] for m in subs)) for f, subs in PACKED_MODULES.items()}

    # ---- constructors -------------------------------------------------------------

    @classmethod
    def from_hf_dict(cls, cfg: dict[str, Any]) -> "LlamaConfig":
        required = ["vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads"]
        missing = [k for k in required if k not in cfg]
        if missing:
            raise ValueError(f"config.json is missing required fields {missing}")
        heads = int(cfg["num_attention_heads"])
        scaling = cfg.get("rope_scaling") or None
        rope_theta = cfg.get("rope_theta")
        # transformers >= 5 may keep theta and scaling under "rope_parameters".
        params = cfg.get("rope_parameters") or {}
        if rope_theta is None:
            rope_theta = params.get("rope_theta", 10000.0)
        if scaling is None and params.get("rope_type", "default") != "default":
            scaling = {k: v for k, v in params.items() if k != "rope_theta"}
        if scaling is not None:
            scaling = _normalize_rope_scaling(scaling)
        eos = cfg.get("eos_token_id")
        if isinstance(eos, list):
            eos = eos[0] if eos else None
        model_type = cfg.get("model_type") or "llama"
        check_model_type(model_type, "config.json model_type")
        if cfg.get("mlp_bias"):
            raise ValueError("config.json mlp_bias=true: biases on the MLP projections are not supported")
        attention_bias = bool(cfg.get("attention_bias", False))
        layers = int(cfg["num_hidden_layers"])
        return cls(
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=int(cfg["hidden_size"]),
            intermediate_size=int(cfg["intermediate_size"]),
            num_hidden_layers=int(cfg["num_hidden_layers"]),
            num_attention_heads=heads,
            num_key_value_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(cfg.get("head_dim") or cfg["hidden_size"] // heads),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope_theta),
            rope_scaling=scaling,
            max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_id=eos,
            model_type=model_type,
            qkv_bias=attention_bias or model_type == "qwen2",
            o_bias=attention_bias and model_type != "qwen2",
            qk_norm=model_type == "qwen3",
            sliding_windows=_hf_sliding_windows(cfg, model_type, layers),
        )

    @classmethod
    def from_json_file(cls, path: str | Path) -> "LlamaConfig":
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"no config.json at {path}")
        try:
            cfg = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"malformed config.json at {path}: {e}") from e
        if not isinstance(cfg, dict):
            raise ValueError(f"malformed config.json at {path}: expected a JSON object")
        try:
            return cls.from_hf_dict(cfg)
        except ValueError as e:
            raise ValueError(f"config.json at {path}: {e}") from None

    @classmethod
    def from_gguf_fields(cls, fields: dict[str, Any], vocab_size: int, tied: bool, qkv_bias: bool = False,
                         o_bias: bool = False, qk_norm: bool = False) -> "LlamaConfig":
        """From GGUF metadata; the switches llama.cpp does not write as fields (biases, q/k norms)
        come from which tensors the file holds."""
        arch = fields.get("general.architecture", "llama")
        if arch not in GGUF_ARCHITECTURES:
            raise ValueError(f"GGUF general.architecture={arch!r} is not supported; supported: "
                             f"{list(GGUF_ARCHITECTURES)}")
        p = f"{arch}."
        heads = int(fields[p + "attention.head_count"])
        hidden = int(fields[p + "embedding_length"])
        head_dim = fields.get(p + "attention.key_length") or fields.get(p + "rope.dimension_count")
        window = fields.get(p + "attention.sliding_window")
        layers = int(fields[p + "block_count"])
        scaling = None
        if fields.get(p + "rope.scaling.type") == "llama3":  # rarely present; llama.cpp bakes rope_freqs instead
            scaling = _normalize_rope_scaling({
                "rope_type": "llama3",
                "factor": fields.get(p + "rope.scaling.factor", 8.0),
                "original_max_position_embeddings": fields.get(p + "rope.scaling.original_context_length", 8192),
            })
        return cls(
            vocab_size=vocab_size,
            hidden_size=hidden,
            intermediate_size=int(fields[p + "feed_forward_length"]),
            num_hidden_layers=layers,
            num_attention_heads=heads,
            num_key_value_heads=int(fields.get(p + "attention.head_count_kv", heads)),
            head_dim=int(head_dim or hidden // heads),
            rms_norm_eps=float(fields.get(p + "attention.layer_norm_rms_epsilon", 1e-5)),
            rope_theta=float(fields.get(p + "rope.freq_base", 10000.0)),
            rope_scaling=scaling,
            max_position_embeddings=int(fields.get(p + "context_length", 2048)),
            tie_word_embeddings=tied,
            bos_token_id=fields.get("tokenizer.ggml.bos_token_id"),
            eos_token_id=fields.get("tokenizer.ggml.eos_token_id"),
            model_type=arch,
            qkv_bias=qkv_bias,
            o_bias=o_bias,
            qk_norm=qk_norm,
            sliding_windows=(int(window),) * layers if window else None,
        )

    def to_json_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json_dict(cls, raw: dict[str, Any]) -> "LlamaConfig":
        """The inverse of `to_json_dict` after a JSON round trip (lists back to hashable tuples)."""
        raw = dict(raw)
        if raw.get("rope_scaling"):
            raw["rope_scaling"] = tuple(tuple(kv) for kv in raw["rope_scaling"])
        if raw.get("sliding_windows") is not None:
            raw["sliding_windows"] = tuple(raw["sliding_windows"])
        return cls(**raw)

    @classmethod
    def preset(cls, name: str) -> "LlamaConfig":
        if name not in PRESETS:
            raise ValueError(f"unknown LlamaConfig preset {name!r}; known: {sorted(PRESETS)}")
        return PRESETS[name]


def check_model_type(model_type: Any, field: str) -> None:
    if model_type not in MODEL_TYPES:
        raise ValueError(f"{field}={model_type!r} is not supported; supported: {list(MODEL_TYPES)}")


def _hf_sliding_windows(cfg: dict[str, Any], model_type: str, layers: int) -> tuple[int | None, ...] | None:
    """Per-layer sliding windows as transformers applies them (None = full attention)."""
    window = cfg.get("sliding_window")
    if not window:
        return None
    types = cfg.get("layer_types")
    if types is not None:  # transformers >= 4.53 spells every layer out
        if len(types) != layers:
            raise ValueError(f"layer_types has {len(types)} entries for {layers} layers")
        bad = sorted(set(types) - {"full_attention", "sliding_attention"})
        if bad:
            raise ValueError(f"layer_types {bad} are not supported (only full_attention, sliding_attention)")
        out = tuple(int(window) if t == "sliding_attention" else None for t in types)
    elif model_type in ("qwen2", "qwen3"):  # older configs: use_sliding_window from max_window_layers on
        if not cfg.get("use_sliding_window", False):
            return None
        first = int(cfg.get("max_window_layers", layers))
        out = tuple(int(window) if i >= first else None for i in range(layers))
    else:  # Mistral: every layer
        out = (int(window),) * layers
    return out if any(w is not None for w in out) else None


def _normalize_rope_scaling(scaling: dict[str, Any]) -> tuple[tuple[str, Any], ...] | None:
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return None
    if kind != "llama3":
        raise ValueError(f"rope_scaling type {kind!r} is not supported (only 'default' and 'llama3')")
    keep = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
    out = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
           "original_max_position_embeddings": 8192}
    out.update({k: scaling[k] for k in keep if k in scaling})
    return tuple(sorted(out.items()))


PRESETS: dict[str, LlamaConfig] = {
    # Tiny random model for unit tests: fast to compile, exercises GQA and Llama 3 rope.
    "tiny": LlamaConfig(
        vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-5,
        rope_theta=10000.0, max_position_embeddings=256, tie_word_embeddings=False,
        rope_scaling=(("factor", 8.0), ("high_freq_factor", 4.0), ("low_freq_factor", 1.0),
                      ("original_max_position_embeddings", 64), ("rope_type", "llama3")),
    ),
    "smollm2-135m": LlamaConfig(
        vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
        num_attention_heads=9, num_key_value_heads=3, head_dim=64, rms_norm_eps=1e-5,
        rope_theta=100000.0, max_position_embeddings=8192, tie_word_embeddings=True,
        bos_token_id=1, eos_token_id=2,
    ),
}
