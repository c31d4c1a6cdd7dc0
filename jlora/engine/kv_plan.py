"""What fits in a device's memory: a model's bytes, and how many full-length sequences of KV cache.

    shape_bytes(cfg, 2, "int8")                              weights, LoRA slots, one token's K and V
    kv_plan(cfg, "int8", 2048, 128, 4, 16, hbm_bytes=...)    sequences the KV cache can hold
    size_kv_cache(config, model_cfg, devices, dtype)         LLM(kv_cache_memory_fraction=...)

`shape_bytes` and `kv_plan` are arithmetic on a Hugging Face config dict (no JAX, no device): `jlora bench tpu` sizes its
engines with it (`--max-num-seqs auto`) from the chip's `memory_stats()`, and it says what a shape
needs before any weight is read. On a v5e chip (15.75 GiB) with int8 weights, the Llama-3.1-8B
shape holds 22 sequences of 2,048 positions after 2 GB of headroom (docs/tpu.md).
"""

from __future__ import annotations

from typing import Any, Sequence

SCALE_BYTES, SCALE_SUBLANES = 4, 8  # jlora.kernels.kv_quant's scales: float32, [KVH, bs] pages of 8-row tiles


def kv_bytes_per_token(layers: int, kv_heads: int, head_dim: int, dtype_bytes: int, kv_cache_dtype: str = "auto",
                       lanes: int | None = None) -> int:
    """Bytes one token's K and V take over every layer: rows of `lanes` (default KVH*Dh) elements of
    the model dtype, or for kv_cache_dtype="int8" one byte an element plus a float32 scale per KV
    head counted as a TPU stores them (the [KVH, bs] scale pages pad KVH to 8 rows; exact off the
    TPU for 8 KV heads, an overcount of at most 7 scales below that)."""
    row = lanes or kv_heads * head_dim
    if kv_cache_dtype == "int8":
        heads = row // head_dim
        return 2 * layers * (row + -(-heads // SCALE_SUBLANES) * SCALE_SUBLANES * SCALE_BYTES)
    return 2 * layers * row * dtype_bytes


# (in features, sub-modules, out features) of each packed projection (jlora.models.llama).
def _packed(cfg: dict[str, Any]) -> dict[str, tuple[int, int, int]]:
    d, f = cfg["hidden_size"], cfg["intermediate_size"]
    h, kvh, dh = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    return {"qkv_proj": (d, 3, (h + 2 * kvh) * dh), "o_proj": (h * dh, 1, d), "gate_up_proj": (d, 2, 2 * f),
            "down_proj": (f, 1, d)}


def held_packed(target_modules: Sequence[str]) -> tuple[str, ...]:
    """The packed modules slots hold for `target_modules` (EngineConfig.lora_target_modules): each with
    one of them among its sub-modules."""
    from jlora.models.config import PACKED_MODULES  # imports JAX: only for a subset

    return tuple(f for f, subs in PACKED_MODULES.items() if set(subs) & set(target_modules))


def shape_bytes(cfg: dict[str, Any], dtype_bytes: int = 2, quantization: str = "none", max_loras: int = 4,
                rank: int = 16, kv_cache_dtype: str = "auto", dora: bool = False,
                embedding_lora: bool = False, target_modules: Sequence[str] | None = None) -> dict[str, int]:
    """Device bytes of a shape's weights as jlora stores them (int8 projections and lm head, or the
    tied embedding, with float32 per-channel scales; the rest in the dtype), of the bytes a decode
    step reads of them (all but an untied embedding table), of `max_loras` LoRA slots of `rank` over
    every packed module (`init_lora_state`: with `dora`, EngineConfig.enable_dora, also their float32
    DoRA factors; with `embedding_lora`, enable_embedding_lora, also embed_tokens and lm_head slots;
    with `target_modules`, EngineConfig.lora_target_modules, only the packed modules holding one of
    them), and of one token's K and V (`kv_bytes_per_token`, for `kv_cache_dtype`)."""
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
    held = packed if target_modules is None else {m: packed[m] for m in held_packed(target_modules)}
    lora = L * max_loras * sum(i * s * rank + rank * o for i, s, o in held.values()) * dtype_bytes
    if dora:
        lora += L * max_loras * sum(o for _, _, o in held.values()) * 4  # the f32 DoRA factors (jlora.adapters.dora)
    if embedding_lora:  # embed_tokens A [V, R], B [R, D]; lm_head A [D, R], B [R, V] (jlora.models.vocab_lora)
        lora += max_loras * 2 * rank * (v + d) * dtype_bytes
    return dict(weights=weights, weights_read_per_step=weights - (0 if tied else embed), embedding=embed,
                lora_slots=lora, kv_per_token=kv_bytes_per_token(L, kvh, dh, dtype_bytes, kv_cache_dtype))


def kv_plan(cfg: dict[str, Any], quantization: str, max_model_len: int, block_size: int, max_loras: int, rank: int,
            hbm_bytes: int, in_use: int = 0, headroom: int = 2 * 10**9, cap: int = 64,
            dtype_bytes: int = 2, kv_cache_dtype: str = "auto", dora: bool = False,
            embedding_lora: bool = False, target_modules: Sequence[str] | None = None) -> dict[str, Any]:
    """How many max_model_len sequences the KV cache can hold on a device of `hbm_bytes` (`in_use`
    already taken) after the weights, the LoRA slots and `headroom` for the step's temporaries (a
    prefill step's activations and its prompt-logprob head over the chunk: ~1 GB at the 8B's
    512-token chunk), at most `cap`: {"max_num_seqs", "num_kv_blocks", "kv_bytes", ...} and
    `shape_bytes`'s figures. ValueError when not even one sequence fits."""
    b = shape_bytes(cfg, dtype_bytes, quantization, max_loras, rank, kv_cache_dtype, dora, embedding_lora,
                    target_modules)
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


def device_memory(device: Any) -> dict[str, int]:
    """A device's allocator stats (`bytes_limit`, `bytes_in_use`, ...); {} where the backend keeps
    none (XLA:CPU)."""
    try:
        stats = device.memory_stats() or {}
    except Exception:  # noqa: BLE001 (a backend without memory stats)
        stats = {}
    return {k: int(v) for k, v in stats.items() if isinstance(v, (int, float))}


def fit_kv_blocks(bytes_limit: int, in_use: int, fraction: float, slot_bytes: int, block_bytes: int,
                  min_blocks: int) -> int:
    """KV blocks that fit `fraction` of a device's `bytes_limit` beside what is `in_use` (the
    weights, placed) and the LoRA slots still to come; what the fraction leaves is for the steps'
    temporaries. ValueError when fewer than `min_blocks` (one full-length sequence) fit."""
    free = int(bytes_limit * fraction) - in_use - slot_bytes
    blocks = max(0, free) // block_bytes
    if blocks < min_blocks:
        raise ValueError(f"kv_cache_memory_fraction={fraction}: {max(0, free) / 1e9:.2f} GB left for the KV cache "
                         f"({bytes_limit / 1e9:.2f} GB x {fraction} - {in_use / 1e9:.2f} GB in use - {slot_bytes / 1e9:.2f} "
                         f"GB of LoRA slots) holds {blocks} blocks of {block_bytes} bytes; one max_model_len sequence "
                         f"needs {min_blocks}: raise the fraction, or lower max_model_len")
    return int(blocks)


def size_kv_cache(config: Any, model_cfg: Any, devices: Sequence[Any], kv_dtype: Any) -> tuple[Any, dict[str, Any]]:
    """`config` with `num_kv_blocks` sized to `config.kv_cache_memory_fraction` of the device's memory
    (the weights already on it), and what was chosen; `config` unchanged where the backend reports
    no memory limit (XLA:CPU: max_num_seqs full-length sequences, as without the option). `kv_dtype`:
    the model's dtype (the LoRA slots'; the cache's unless `config.kv_cache_dtype` is "int8")."""
    import dataclasses

    import jax
    import jax.numpy as jnp

    from jlora.engine.runner import resolve_attn_impl
    from jlora.kernels.paged_attention_tpu import cache_lanes
    from jlora.models import quant
    from jlora.models.llama import init_lora_state

    fraction = config.kv_cache_memory_fraction
    if len(devices) != 1:
        raise ValueError(f"kv_cache_memory_fraction sizes one device's KV cache; with {len(devices)} devices "
                         "(tensor or data parallel) give num_kv_blocks")
    mem = device_memory(devices[0])
    if "bytes_limit" not in mem:
        return config, dict(fraction=fraction, sized=False, num_kv_blocks=config.num_kv_blocks,
                            reason="the backend reports no memory limit: max_num_seqs full-length sequences")
    kvh, dh = model_cfg.num_key_value_heads, model_cfg.head_dim
    cache_dtype = jnp.int8 if config.kv_cache_dtype == "int8" else kv_dtype
    lanes = cache_lanes(kvh, dh) if resolve_attn_impl(config.attn_impl, 1, cache_dtype) == "pallas" else kvh * dh
    itemsize = jnp.dtype(quant.storage_dtype(kv_dtype)).itemsize
    block_bytes = config.block_size * kv_bytes_per_token(model_cfg.num_hidden_layers, kvh, dh, itemsize,
                                                         config.kv_cache_dtype, lanes)  # K and V, every layer
    slots = jax.eval_shape(lambda: init_lora_state(model_cfg, config.max_loras, config.max_lora_rank, kv_dtype,
                                                   modules=config.lora_modules, dora=config.enable_dora))
    slot_bytes = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(slots))
    blocks = fit_kv_blocks(mem["bytes_limit"], mem.get("bytes_in_use", 0), fraction, slot_bytes, block_bytes,
                           config.blocks_per_seq)
    plan = dict(fraction=fraction, sized=True, kv_cache_dtype=config.kv_cache_dtype, bytes_limit=mem["bytes_limit"], in_use=mem.get("bytes_in_use", 0),
                lora_slots=slot_bytes, block_bytes=block_bytes, num_kv_blocks=blocks, kv_bytes=blocks * block_bytes,
                full_length_sequences=blocks // config.blocks_per_seq)
    return dataclasses.replace(config, num_kv_blocks=blocks), plan
