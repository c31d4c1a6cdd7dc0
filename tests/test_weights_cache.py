"""The converted-weights cache: a second load hits and gives identical arrays; a changed source or a
damaged entry does not serve stale or broken weights."""

import logging
import shutil

import jax
import numpy as np
import pytest
from flax import nnx

from jlora.content_cache import META_FILE, file_sha256
from jlora.formats import read_safetensors, write_safetensors
from jlora.models import weights_cache as wc
from jlora.models.loading import load_model


def _arrays(model) -> list[np.ndarray]:
    return [np.asarray(x) for x in jax.tree.leaves(nnx.state(model, nnx.Param))]


def _same(m1, m2) -> bool:
    a, b = _arrays(m1), _arrays(m2)
    return len(a) == len(b) and all(x.dtype == y.dtype and np.array_equal(x, y) for x, y in zip(a, b))


@pytest.fixture
def ckpt(tiny_dir, tmp_path):
    """A private copy of the tiny checkpoint, so editing it touches no other test."""
    src, _ = tiny_dir
    dst = tmp_path / "model"
    shutil.copytree(src, dst)
    return dst


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_second_load_hits_with_identical_arrays(ckpt, tmp_path, dtype):
    import jax.numpy as jnp

    jdtype = getattr(jnp, dtype)
    root = tmp_path / "weights"
    ref, _, _ = load_model(ckpt, jdtype, weights_cache=False)
    c1, c2 = wc.open_cache(root), wc.open_cache(root)  # stats are per cache, not per process
    first, _, _ = load_model(ckpt, jdtype, weights_cache=c1)
    second, _, _ = load_model(ckpt, jdtype, weights_cache=c2)
    (entry,) = [p for p in root.iterdir() if p.name != "hashes"]
    size = (entry / wc.TENSORS_FILE).stat().st_size
    assert dict(c1.stats) == {"misses": 1, "bytes_written": size}
    assert dict(c2.stats) == {"hits": 1, "bytes_read": size}
    assert _same(ref, first) and _same(ref, second)
    assert (entry / wc.TENSORS_FILE).is_file() and (entry / META_FILE).is_file()
    assert not [p for p in root.iterdir() if p.name.startswith(".tmp-")]  # no temporary left behind


def test_changed_source_misses(ckpt, tmp_path):
    root = tmp_path / "weights"
    load_model(ckpt, weights_cache=root)
    cfg = ckpt / "config.json"
    cfg.write_text(cfg.read_text() + "\n")  # same config, different bytes: a new key
    cache = wc.open_cache(root)
    load_model(ckpt, weights_cache=cache)
    assert cache.stats["misses"] == 1 and cache.stats["hits"] == 0
    assert len([p for p in root.iterdir() if p.name != "hashes"]) == 2


def test_dtype_is_part_of_the_key(ckpt, tmp_path):
    import jax.numpy as jnp

    root = tmp_path / "weights"
    load_model(ckpt, jnp.float32, weights_cache=root)
    cache = wc.open_cache(root)
    load_model(ckpt, jnp.bfloat16, weights_cache=cache)
    assert cache.stats["misses"] == 1 and cache.stats["hits"] == 0


@pytest.mark.parametrize("damage", ["truncate", "meta", "header", "delete_meta"])
def test_damaged_entry_is_detected_and_rebuilt(ckpt, tmp_path, damage, caplog):
    root = tmp_path / "weights"
    ref, _, _ = load_model(ckpt, weights_cache=root)
    (entry,) = [p for p in root.iterdir() if p.name != "hashes"]
    tensors = entry / wc.TENSORS_FILE
    if damage == "truncate":
        data = tensors.read_bytes()
        tensors.write_bytes(data[: len(data) // 2])
    elif damage == "meta":
        (entry / META_FILE).write_text("{not json")
    elif damage == "header":
        data = bytearray(tensors.read_bytes())
        data[8:16] = b"XXXXXXXX"
        tensors.write_bytes(bytes(data))
    else:
        (entry / META_FILE).unlink()
    cache = wc.open_cache(root)
    with caplog.at_level(logging.WARNING, logger="jlora.content_cache"):
        again, _, _ = load_model(ckpt, weights_cache=cache)
    assert cache.stats["rebuilds"] == 1 and cache.stats["misses"] == 1 and cache.stats["hits"] == 0
    assert any("weights cache entry" in r.getMessage() and "damaged" in r.getMessage() for r in caplog.records)
    assert _same(ref, again)
    third, _, _ = load_model(ckpt, weights_cache=cache)  # the rebuilt entry serves the next load
    assert cache.stats["rebuilds"] == 1 and cache.stats["hits"] == 1 and _same(ref, third)


def test_safetensors_written_here_are_read_by_the_library(tmp_path):
    import ml_dtypes
    from safetensors import safe_open

    rng = np.random.default_rng(0)
    tensors = {"a": rng.standard_normal((3, 5)).astype(np.float32),
               "b": rng.standard_normal((7,)).astype(ml_dtypes.bfloat16),
               "c": rng.standard_normal((2, 2, 2)).astype(np.float16)}
    file = tmp_path / "t.safetensors"
    write_safetensors(file, tensors)
    with safe_open(str(file), framework="flax") as f:
        assert sorted(f.keys()) == ["a", "b", "c"]
        for k, v in tensors.items():
            np.testing.assert_array_equal(np.asarray(f.get_tensor(k)), v)
    back = read_safetensors(file)
    for k, v in tensors.items():
        assert back[k].dtype == v.dtype
        np.testing.assert_array_equal(back[k], v)


def test_cache_dir_follows_env(monkeypatch, tmp_path):
    monkeypatch.delenv("JLORA_WEIGHTS_CACHE_DIR", raising=False)
    monkeypatch.setenv("JLORA_CACHE_DIR", str(tmp_path / "c"))
    assert wc.default_cache_dir() == tmp_path / "c" / "weights"  # a folder of the caches' root
    monkeypatch.setenv("JLORA_WEIGHTS_CACHE_DIR", str(tmp_path / "w"))
    assert wc.default_cache_dir() == tmp_path / "w"
    monkeypatch.setenv("JLORA_WEIGHTS_CACHE", "0")
    assert not wc.cache_enabled()


def test_hash_memo_is_keyed_by_size_and_mtime(tmp_path):
    import os

    f = tmp_path / "x.bin"
    f.write_bytes(b"a" * 100)
    root = tmp_path / "root"
    h1 = file_sha256(f, root)
    assert h1 == file_sha256(f, root) == file_sha256(f)
    f.write_bytes(b"b" * 100)
    os.utime(f, ns=(1, 1))  # a new mtime, as any edit gives
    assert file_sha256(f, root) != h1


@pytest.mark.slow
def test_default_gguf_cached_equals_dequantized(tmp_path):
    """The real Q4_1 GGUF: the cached tensors are the dequantized ones, bit for bit; the tokenizer metadata
    a cache hit reads from the file's head equals what the full reader returns."""
    from jlora.models.loading import _read_tensors, default_model_path, read_gguf
    from jlora.formats import read_gguf_fields

    path = default_model_path()
    cfg, ref, fields = read_gguf(path)
    root = tmp_path / "weights"
    cfg1, miss, hit1 = wc.cached_read(path, np.float32, _read_tensors, wc.open_cache(root))
    cfg2, hit, hit2 = wc.cached_read(path, np.float32, _read_tensors, wc.open_cache(root))
    assert (hit1, hit2) == (False, True) and cfg1 == cfg2 == cfg
    assert sorted(hit) == sorted(ref)
    for k in ref:
        assert hit[k].dtype == np.float32 and np.array_equal(hit[k], ref[k]), k
    head = read_gguf_fields(path)
    assert {k: v for k, v in fields.items() if k.startswith("tokenizer.")} == \
        {k: v for k, v in head.items() if k.startswith("tokenizer.")}
