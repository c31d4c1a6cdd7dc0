"""The one content-addressed cache both the weights and the adapter caches use: keys, verify on read,
rebuild of a damaged entry, atomic writes, a cache that cannot be written, and per-instance stats."""

import json
import logging
import os
import threading

import numpy as np
import pytest

from jlora.adapters import disk_cache as dc
from jlora.content_cache import META_FILE, ContentCache, content_key
from jlora.models import weights_cache as wc


def _tensors(seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {"a": rng.standard_normal((3, 4)).astype(np.float32), "b": np.arange(6, dtype=np.int8).reshape(2, 3)}


def _decode(meta, tensors):
    return meta["note"], {k: np.array(v) for k, v in tensors.items()}


def test_put_then_get_round_trips_and_counts_per_instance(tmp_path):
    writer, reader = ContentCache(tmp_path, "test", "t.safetensors"), ContentCache(tmp_path, "test", "t.safetensors")
    key = writer.key("x", "y")
    assert writer.get(key, _decode) is None
    entry = writer.put(key, _tensors(), {"note": "hello"})
    assert entry == tmp_path / key and not [p for p in tmp_path.iterdir() if p.name.startswith(".tmp-")]
    note, back = reader.get(key, _decode)
    assert note == "hello" and all(np.array_equal(back[k], v) and back[k].dtype == v.dtype for k, v in _tensors().items())
    size = (entry / "t.safetensors").stat().st_size
    assert dict(writer.stats) == {"misses": 1, "bytes_written": size}
    assert dict(reader.stats) == {"hits": 1, "bytes_read": size}


def test_keys_separate_kinds_and_parts_and_keep_the_existing_on_disk_keys():
    assert content_key("weights", "float32") != content_key("adapter", "float32") != content_key("weights", "bf16")
    assert len(content_key("weights")) == 32
    # The keys entries written before the caches shared this module were stored under (format 1):
    # the weights of `<dtype>` from one source file, and an adapter; an upgrade keeps hitting them.
    import hashlib

    old = hashlib.sha256(b"jlora-weights-v1|float32|m.gguf|" + b"0" * 64).hexdigest()[:32]
    assert content_key("weights", "float32", "m.gguf|" + "0" * 64) == old
    old = hashlib.sha256(b"jlora-adapter-v1|float32|max_lora_rank=8|model=f|content=c").hexdigest()[:32]
    assert content_key("adapter", "float32", "max_lora_rank=8", "model=f", "content=c") == old


@pytest.mark.parametrize("damage", ["truncate", "meta_json", "meta_key", "no_tensors", "extra_tensor", "decode"])
def test_a_damaged_entry_is_logged_removed_and_missed(tmp_path, damage, caplog):
    cache = ContentCache(tmp_path, "test", "t.safetensors")
    key = cache.key("k")
    entry = cache.put(key, _tensors(), {"note": "n"})
    st, meta_file = entry / "t.safetensors", entry / META_FILE
    meta = json.loads(meta_file.read_text())
    decode = _decode
    if damage == "truncate":
        st.write_bytes(st.read_bytes()[:-3])
    elif damage == "meta_json":
        meta_file.write_text("[")
    elif damage == "meta_key":
        meta_file.write_text(json.dumps({**meta, "key": "0" * 32}))
    elif damage == "no_tensors":
        st.unlink()
    elif damage == "extra_tensor":
        from jlora.formats import write_safetensors

        meta["file_size"] = write_safetensors(st, {**_tensors(), "c": np.zeros(2, np.float32)})
        meta_file.write_text(json.dumps(meta))
    else:  # well-formed, but the user rejects what it holds
        def decode(meta, tensors):
            raise ValueError("arrays do not fit the model")
    with caplog.at_level(logging.WARNING, logger="jlora.content_cache"):
        assert cache.get(key, decode) is None
    assert not entry.exists() and (cache.stats["rebuilds"], cache.stats["misses"], cache.stats["hits"]) == (1, 1, 0)
    assert [r.getMessage() for r in caplog.records if "test cache entry" in r.getMessage() and "damaged" in r.getMessage()]
    cache.put(key, _tensors(), {"note": "again"})  # the rebuild
    assert cache.get(key, _decode)[0] == "again" and cache.stats["hits"] == 1


def test_an_unwritable_root_serves_uncached(tmp_path, caplog):
    (tmp_path / "file").write_text("")  # a root below a plain file cannot be made
    cache = ContentCache(tmp_path / "file" / "cache", "test", "t.safetensors")
    with caplog.at_level(logging.WARNING, logger="jlora.content_cache"):
        assert cache.put(cache.key("k"), _tensors(), {}) is None
    assert cache.stats["write_errors"] == 1 and any("could not write" in r.getMessage() for r in caplog.records)


def test_concurrent_puts_of_one_key_leave_one_whole_entry(tmp_path):
    cache = ContentCache(tmp_path, "test", "t.safetensors")
    key = cache.key("k")
    barrier = threading.Barrier(4)

    def put():
        barrier.wait()
        assert cache.put(key, _tensors(), {"note": "n"}) == tmp_path / key

    threads = [threading.Thread(target=put) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(os.listdir(tmp_path)) == [key]
    assert cache.get(key, _decode)[0] == "n"


def test_weights_and_adapters_are_two_kinds_of_one_cache(tmp_path, monkeypatch):
    w, a = wc.open_cache(tmp_path / "w"), dc.open_cache(tmp_path / "a")
    assert (w.kind, w.tensors_file) == ("weights", "model.safetensors")
    assert (a.kind, a.tensors_file) == ("adapter", "adapter.safetensors")
    monkeypatch.delenv("JLORA_WEIGHTS_CACHE_DIR", raising=False)
    monkeypatch.delenv("JLORA_ADAPTER_CACHE_DIR", raising=False)
    monkeypatch.setenv("JLORA_CACHE_DIR", str(tmp_path / "root"))  # the root of every cache (jlora.caches)
    assert wc.default_cache_dir() == tmp_path / "root" / "weights"
    assert dc.default_cache_dir() == tmp_path / "root" / "adapters"
    monkeypatch.setenv("JLORA_ADAPTER_CACHE_DIR", str(tmp_path / "mine"))
    assert dc.default_cache_dir() == tmp_path / "mine"
