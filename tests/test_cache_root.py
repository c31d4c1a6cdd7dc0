"""One cache root (`jlora.caches`): every cache in its own folder under JLORA_CACHE_DIR, a size cap with
least-recently-used eviction for each, `jlora cache list/clear`, and no cache loaded from a folder
that is not the user's own. Fast: fake entries, no model."""

import logging
import os
from pathlib import Path

import numpy as np
import pytest

from jlora import caches, cli
from jlora.adapters import disk_cache as dc
from jlora.engine import executables
from jlora.models import weights_cache as wc

DIR_VARS = ("JLORA_WEIGHTS_CACHE_DIR", "JLORA_ADAPTER_CACHE_DIR", "JLORA_EXECUTABLE_CACHE_DIR")


@pytest.fixture
def root(tmp_path, monkeypatch):
    """JLORA_CACHE_DIR in tmp_path, no per-cache folder variable, no cap variable."""
    for var in DIR_VARS + tuple(c.cap_env for c in caches.CACHES.values()):
        monkeypatch.delenv(var, raising=False)
    r = tmp_path / "root"
    monkeypatch.setenv("JLORA_CACHE_DIR", str(r))
    return r


def _defaults() -> dict[str, Path]:
    from jlora import llm

    return {"xla": caches.cache_dir("xla"), "weights": wc.default_cache_dir(), "adapters": dc.default_cache_dir(),
            "executables": executables.default_dir(), "llm.weights": llm.weights_cache_dir(),
            "llm.adapters": llm.adapter_cache_dir()}


def test_every_cache_is_a_folder_of_one_root(root, monkeypatch, tmp_path):
    assert _defaults() == {"xla": root / "xla", "weights": root / "weights", "adapters": root / "adapters",
                           "executables": root / "executables", "llm.weights": root / "weights",
                           "llm.adapters": root / "adapters"}
    monkeypatch.delenv("JLORA_CACHE_DIR")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert caches.root() == tmp_path / "home" / ".cache" / "jlora"
    assert wc.default_cache_dir() == tmp_path / "home" / ".cache" / "jlora" / "weights"
    monkeypatch.setenv("JLORA_WEIGHTS_CACHE_DIR", str(tmp_path / "w"))  # a per-cache override still wins
    assert wc.default_cache_dir() == tmp_path / "w"
    with pytest.raises(ValueError, match="unknown cache 'nope'"):
        caches.cache_dir("nope")


def test_a_root_under_home_keeps_every_cache_inside_it(root, monkeypatch, tmp_path):
    """JLORA_CACHE_DIR=~/x used to put the weights in ~/weights (a sibling of the XLA folder)."""
    home = tmp_path / "home"
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setenv("JLORA_CACHE_DIR", "~/x")
    for name, folder in _defaults().items():
        assert folder.parent == home / "x", name


def test_enable_compilation_cache_uses_the_xla_folder_and_jax_cap(root, monkeypatch):
    import jax

    from jlora.llm import enable_compilation_cache

    names = ("jax_compilation_cache_dir", "jax_compilation_cache_max_size",
             "jax_persistent_cache_min_compile_time_secs", "jax_persistent_cache_min_entry_size_bytes")
    before = {n: getattr(jax.config, n) for n in names}
    try:
        jax.config.update("jax_compilation_cache_max_size", -1)
        monkeypatch.setenv("JLORA_CACHE_MAX_XLA_GB", "0.5")
        assert enable_compilation_cache() == root / "xla"
        assert jax.config.jax_compilation_cache_dir == str(root / "xla")
        assert jax.config.jax_compilation_cache_max_size == 500_000_000
        assert os.stat(root / "xla").st_mode & 0o777 == 0o700
        jax.config.update("jax_compilation_cache_max_size", -1)
        monkeypatch.setenv("JLORA_CACHE_MAX_XLA_GB", "none")  # no cap: eviction on (it writes -atime files)
        enable_compilation_cache()
        assert jax.config.jax_compilation_cache_max_size == 2**62
        jax.config.update("jax_compilation_cache_max_size", 123)  # set by the user: kept
        assert enable_compilation_cache(root / "elsewhere") == root / "elsewhere"  # LLM(compilation_cache_dir=)
        assert jax.config.jax_compilation_cache_max_size == 123
    finally:
        for n, v in before.items():
            jax.config.update(n, v)


def test_xla_entries_without_atime_get_one_so_jax_can_evict(tmp_path):
    """Entries written with eviction off have no -atime file; JAX's eviction fails on them."""
    from jax._src.lru_cache import LRUCache

    folder = tmp_path / "xla"
    LRUCache(str(folder), max_size=-1).put("old", b"x" * 600)  # eviction off: no -atime file
    assert sorted(os.listdir(folder)) == ["old-cache"]
    with pytest.raises(FileNotFoundError):
        LRUCache(str(folder), max_size=1000).put("new", b"y" * 600)
    caches.prepare_xla_eviction(folder)
    LRUCache(str(folder), max_size=1000).put("new", b"y" * 600)  # evicts "old"
    assert sorted(f for f in os.listdir(folder) if f.endswith("-cache")) == ["new-cache"]


def test_caps_from_the_environment(root, monkeypatch):
    assert caches.max_bytes("weights") == 20 * 10**9  # defaults
    assert [caches.max_bytes(n) for n in ("adapters", "executables", "xla")] == [5 * 10**9, 4 * 10**9, 5 * 10**9]
    monkeypatch.setenv("JLORA_CACHE_MAX_ADAPTERS_GB", "0.25")
    assert caches.max_bytes("adapters") == 250_000_000
    monkeypatch.setenv("JLORA_CACHE_MAX_ADAPTERS_GB", "none")
    assert caches.max_bytes("adapters") is None
    for bad in ("0", "-2", "lots", "inf"):
        monkeypatch.setenv("JLORA_CACHE_MAX_ADAPTERS_GB", bad)
        with pytest.raises(ValueError, match="JLORA_CACHE_MAX_ADAPTERS_GB"):
            caches.check_env()


def _fake_entry(folder: Path, name: str, size: int, used: float) -> Path:
    entry = folder / name
    entry.mkdir(parents=True)
    (entry / "data").write_bytes(b"\0" * size)
    os.utime(entry, (used, used))
    return entry


def test_lru_eviction_keeps_the_recent_the_written_and_the_held(root, monkeypatch, tmp_path):
    folder = tmp_path / "c"
    monkeypatch.setenv("JLORA_CACHE_MAX_ADAPTERS_GB", str(2500 / 1e9))  # 2,500 bytes
    old, mid, new = (_fake_entry(folder, n, 1000, t) for n, t in (("old", 100), ("mid", 200), ("new", 300)))
    _fake_entry(folder, "hashes", 10, 50)  # not an entry when skipped
    (folder / ".tmp-x").mkdir()  # a write in progress: never an entry
    assert caches.evict("adapters", folder, skip=["hashes"]) == [old]  # 3,000 > 2,500: the oldest goes
    assert caches.evict("adapters", folder, skip=["hashes"]) == []
    big = _fake_entry(folder, "big", 5000, 50)  # the entry being written: kept even over the cap alone
    assert caches.evict("adapters", folder, keep=[big], skip=["hashes"]) == [mid, new]
    assert sorted(os.listdir(folder)) == [".tmp-x", "big", "hashes"]
    caches.hold(big)  # held by this process: kept by every eviction here
    assert caches.evict("adapters", folder, skip=["hashes"]) == []
    monkeypatch.setenv("JLORA_CACHE_MAX_ADAPTERS_GB", "none")
    assert caches.evict("adapters", folder) == []


def test_content_cache_touches_on_read_and_evicts_on_write(root, monkeypatch, tmp_path):
    monkeypatch.setenv("JLORA_CACHE_MAX_ADAPTERS_GB", str(2500 / 1e9))
    cache = dc.open_cache(tmp_path / "a")
    arr = {"x": np.zeros(200, np.float32)}  # 800 bytes + header + meta.json: 983 bytes an entry
    keys = [cache.key(str(i)) for i in range(3)]
    for i, k in enumerate(keys[:2]):
        cache.put(k, arr, {})
        os.utime(cache.entry(k), (100 + i, 100 + i))
    assert cache.get(keys[0], lambda meta, t: t) is not None  # read: now the most recently used
    assert cache.entry(keys[0]).stat().st_mtime > 1000
    cache.put(keys[2], arr, {})  # over 2,500 bytes: the least recently used (keys[1]) goes
    assert not cache.entry(keys[1]).exists()
    assert cache.entry(keys[0]).exists() and cache.entry(keys[2]).exists()
    assert cache.stats["evicted"] == 1


def test_the_executable_store_prunes_by_size_never_its_own(root, monkeypatch, tmp_path):
    monkeypatch.setenv("JLORA_CACHE_MAX_EXECUTABLES_GB", str(2500 / 1e9))
    folder = tmp_path / "ex"
    others = [_fake_entry(folder, f"fp{i}", 1000, 100 + i) for i in range(3)]
    store = executables.ExecutableStore(folder, "mine")
    _fake_entry(folder, "mine", 1000, 10)  # the oldest, but this store's own
    store._prune()
    assert sorted(os.listdir(folder)) == ["fp2", "mine"] and not others[0].exists()


def _quiet_warned():
    caches._warned.clear()


def test_a_folder_others_can_write_is_not_used(root, tmp_path, caplog, monkeypatch):
    from jlora.llm import enable_compilation_cache

    _quiet_warned()
    folder = tmp_path / "shared"
    folder.mkdir()
    os.chmod(folder, 0o775)
    with caplog.at_level(logging.WARNING, logger="jlora.caches"):
        assert not caches.usable(folder)
        assert not caches.usable(folder)
    warnings = [r for r in caplog.records if "not using the cache" in r.getMessage()]
    assert len(warnings) == 1 and "group or others can write it" in warnings[0].getMessage()  # once

    cache = wc.open_cache(folder)
    assert cache.put(cache.key("a"), {"x": np.zeros(4, np.float32)}, {}) is None  # not written...
    assert os.listdir(folder) == []
    _fake_entry(folder, cache.key("b"), 10, 100)
    assert cache.get(cache.key("b"), lambda meta, t: t) is None  # ...and not read
    assert executables.open_store(folder, "k") is None  # pickles: never loaded from there
    assert enable_compilation_cache(folder) is None  # nor JAX's executables
    os.chmod(folder, 0o755)
    assert caches.usable(folder) and executables.open_store(folder, "k") is not None
    assert caches.usable(tmp_path / "not-yet")  # created by jlora, 0o700

    monkeypatch.setattr(os, "getuid", lambda: os.stat(folder).st_uid + 1)  # someone else's folder
    assert "owned by uid" in caches.refusal(folder)
    assert not caches.usable(folder)


def test_cli_cache_list_and_clear(root, capsys):
    _fake_entry(root / "weights", "w1", 1500, 100)
    _fake_entry(root / "adapters", "a1", 10, 100)
    _fake_entry(root / "adapters", "a2", 10, 100)
    (root / "xla").mkdir()
    (root / "xla" / "k-cache").write_bytes(b"\0" * 20)
    (root / "old-jax-entry-cache").write_bytes(b"")  # an old layout's file in the root
    assert cli.main(["cache"]) == 0
    out = capsys.readouterr().out
    rows = {line.split()[0]: line.split() for line in out.splitlines()[2:6]}
    assert rows["weights"][1:3] == ["1", "1.5"] and rows["weights"][-1] == str(root / "weights")
    assert rows["adapters"][1] == "2" and rows["xla"][1] == "1" and rows["executables"][1] == "0"
    assert "20.0 GB" in " ".join(rows["weights"])
    assert "old-jax-entry-cache" in out  # the stray is named, not used
    assert cli.main(["cache", "list"]) == 0
    assert capsys.readouterr().out == out

    assert cli.main(["cache", "clear", "weights"]) == 0
    assert "cleared weights: 1 entries" in capsys.readouterr().out
    assert not (root / "weights").exists() and (root / "adapters" / "a1").exists()
    assert cli.main(["cache", "clear", "all"]) == 0
    assert not any((root / n).exists() for n in caches.CACHES)
    assert (root / "old-jax-entry-cache").exists()  # only the cache folders are cleared

    for argv, message in ((["cache", "clear", "models"], "unknown cache 'models'"),
                          (["cache", "clear"], "name the cache to clear")):
        assert cli.main(argv) == 2
        err = capsys.readouterr().err
        assert err.startswith("jlora cache: error: ") and message in err
