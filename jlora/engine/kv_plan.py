"""What fits in a device's memory: a model's bytes, and how many full-length sequences of KV cache.

    shape_bytes(cfg, 2, "int8")                              weights, LoRA slots, one token's K and V
    kv_plan(cfg, "int8", 2048, 128, 4, 16, hbm_bytes=...)    sequences the KV cache can hold

Arithmetic on a Hugging Face config dict only (no JAX, no device): `jlora bench tpu` sizes its
engines with it (`--max-num-seqs auto`) from the chip's `memory_stats()`, and it says what a shape
needs before any weight is read. On a v5e chip (15.75 GiB) with int8 weights, the Llama-3.1-8B
shape holds 22 sequences of 2,048 positions after 2 GB of headroom (docs/tpu.md).
"""

from __future__ import annotations

from typing import Any

# (in features, sub-modules, out features) of each packed projection (jlora.models.llama).
def _packed(cfg: dict[str, Any]) -> dict[str, tuple[int, int, int]]:
    d, f = cfg["hidden_size"], cfg["intermediate_size"]
    h, kvh, dh = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    return {"qkv_proj": (d, 3, (h + 2 * kvh) * dh), "o_proj": (h * dh, 1, d), "gate_up_proj": (d, 2, 2 * f),
            "down_proj": (f, 1, d)}


def shape_bytes(cfg: dict[str, Any], dtype_bytes: int = 2, quantization: str = "none", max_loras: int = 4,
                rank: int = 16) -> dict[str, int]:
    """Device bytes of a shape's weights as jlora stores them (int8 projections and lm head, or the
    tied embedding, with float32 per-channel scales; the rest in the dtype), of the bytes a decode
    step reads of them (all but an untied embedding table), of `max_loras` LoRA slots of `rank` over
    every packed module, and of one token's K and V."""
    d, L = cfg["hidden_size"], cfg["num_hidden_layers"]
    kvh, dh, v = cfg["num_key_value_heads"], cfg["head_dim"], cfg["vocab_size"]
    q = quantization != "none"
    packed = _packed(cfg)
    proj = sum(i * o for i, _, o in packed.values())
    outs = sum(o for _, _, o in packed.values())
    layer = (proj + 4 * outs if q else proj * dtype_bytes) + 2 * d * dtype_bytes
    table = v * d + 4 * v if q else v * d * dtype_bytes  # a quantized [V, D] with its row scales
    tied = cfg["tie_word_embeddings"]
    embed = table if tied else v * d * dtype_bytes
    head = 0 if tied else table
    weights = L * layer + embed + head + d * dtype_bytes + dh // 2 * 4  # + final norm, rotary table
    lora = L * max_loras * sum(i * s * rank + rank * o for i, s, o in packed.values()) * dtype_bytes
    return dict(weights=weights, weights_read_per_step=weights - (0 if tied else embed), embedding=embed,
                lora_slots=lora, kv_per_token=2 * L * kvh * dh * dtype_bytes)


def kv_plan(cfg: dict[str, Any], quantization: str, max_model_len: int, block_size: int, max_loras: int, rank: int,
            hbm_bytes: int, in_use: int = 0, headroom: int = 2 * 10**9, cap: int = 64,
            dtype_bytes: int = 2) -> dict[str, Any]:
    """How many max_model_len sequences the KV cache can hold on a device of `hbm_bytes` (`in_use`
    already taken) after the weights, the LoRA slots and `headroom` for the step's temporaries (a
    prefill step's activations and its prompt-logprob head over the chunk: ~1 GB at the 8B's
    512-token chunk), at most `cap`: {"max_num_seqs", "num_kv_blocks", "kv_bytes", ...} and
    `shape_bytes`'s figures. ValueError when not even one sequence fits."""
    b = shape_bytes(cfg, dtype_bytes, quantization, max_loras, rank)
    blocks_per_seq = -(-max_model_len // block_size)
    per_seq = blocks_per_seq * block_size * b["kv_per_token"]
    free = hbm_bytes - in_use - b["weights"] - b["lora_slots"] - headroom
    n = min(cap, free // per_seq) if free > 0 else 0
    if n < 1:
        raise ValueError(f"not one {max_model_len}-token sequence fits: {hbm_bytes / 1e9:.2f} GB of device memory "
                         f"({in_use / 1e9:.2f} in use), weights {b['weights'] / 1e9:.2f} GB ({quantization}), LoRA slots "
                         f"{b['lora_slots'] / 1e9:.2f} GB, headroom {headroom / 1e9:.2f} GB, {per_seq / 1e9:.3f} GB per sequence")
    return dict(max_num_seqs=int(n), num_kv_blocks=int(n * blocks_per_seq), kv_bytes=int(n * per_seq),
                hbm_bytes=int(hbm_bytes), in_use=int(in_use), headroom=int(headroom), **b)
