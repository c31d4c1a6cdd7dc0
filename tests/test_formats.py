"""The one safetensors reader and the one GGUF reader, held to the reference libraries (`safetensors`,
`gguf.GGUFReader`), with the errors a broken file gives."""

import json
import struct

import ml_dtypes
import numpy as np
import pytest

from jlora.formats import read_gguf_fields, read_gguf_header, read_gguf_tensors, read_safetensors, write_safetensors


def _some_tensors() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    return {"f32": rng.standard_normal((3, 5)).astype(np.float32),
            "bf16": rng.standard_normal((7,)).astype(ml_dtypes.bfloat16),
            "f16": rng.standard_normal((2, 2, 2)).astype(np.float16),
            "i64": np.arange(4, dtype=np.int64), "u8": np.arange(3, dtype=np.uint8),
            "scalar": np.array(2.5, np.float32), "empty": np.zeros((0, 4), np.float32)}


def test_safetensors_library_files_read_here_and_ours_read_there(tmp_path):
    from safetensors import safe_open
    from safetensors.numpy import save_file

    plain = {k: v for k, v in _some_tensors().items() if k != "bf16"}  # safetensors.numpy cannot hold bf16
    save_file(plain, str(tmp_path / "lib.safetensors"), metadata={"format": "pt"})
    back = read_safetensors(tmp_path / "lib.safetensors")
    assert sorted(back) == sorted(plain)
    for k, v in plain.items():
        assert back[k].dtype == v.dtype and back[k].shape == v.shape and np.array_equal(back[k], v), k
        assert not back[k].flags.writeable  # views of the mmap, not copies

    ours = tmp_path / "ours.safetensors"
    write_safetensors(ours, _some_tensors())
    with safe_open(str(ours), framework="flax") as f:
        assert sorted(f.keys()) == sorted(_some_tensors())
        for k, v in _some_tensors().items():
            np.testing.assert_array_equal(np.asarray(f.get_tensor(k)), v)


@pytest.mark.parametrize("damage, detail", [
    ("empty", "shorter than a safetensors header"),
    ("huge_header", "runs past the end"),
    ("not_json", "Expecting"),
    ("json_list", "not an object"),
    ("truncated", "does not fit"),
    ("trailing", "header accounts for"),
    ("bad_dtype", "does not fit"),
    ("bad_shape", "does not fit"),
    ("past_end", "does not fit"),
])
def test_a_broken_safetensors_file_is_a_value_error_naming_it(tmp_path, damage, detail):
    file = tmp_path / "t.safetensors"
    write_safetensors(file, {"a": np.ones((2, 3), np.float32)})
    data = file.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + n])

    def with_header(h):
        raw = json.dumps(h).encode()
        return struct.pack("<Q", len(raw)) + raw + data[8 + n:]

    data = {"empty": b"", "huge_header": b"\x05garbage", "not_json": struct.pack("<Q", 4) + b"{not",
            "json_list": with_header([1]), "truncated": data[:-4], "trailing": data + b"\0",
            "bad_dtype": with_header({"a": {**header["a"], "dtype": "Q7"}}),
            "bad_shape": with_header({"a": {**header["a"], "shape": [3, 3]}}),
            "past_end": with_header({"a": {**header["a"], "data_offsets": [4, 28]}})}[damage]
    file.write_bytes(data)
    with pytest.raises(ValueError, match=f"t.safetensors is not a readable safetensors file \\(corrupt or truncated\\?\\): .*{detail}"):
        read_safetensors(file)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        read_safetensors(tmp_path / "missing.safetensors")


def test_gguf_reader_equals_gguf_package(tmp_path):
    """Every quant type the tiny GGUF writer makes: our header and dequantized tensors equal GGUFReader's."""
    import gguf

    from test_quant import write_gguf

    path = tmp_path / "tiny.gguf"
    write_gguf(path, {"embed": "Q8_0", "q_proj": "Q4_0", "k_proj": "Q4_1", "v_proj": "F16", "o_proj": "Q8_0",
                      "gate_proj": "F32", "up_proj": "Q4_1", "down_proj": "Q4_0"})
    reader = gguf.GGUFReader(str(path))
    fields, infos = read_gguf_header(path)
    assert fields == read_gguf_fields(path)
    theirs = {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}
    assert fields == theirs and {type(v) for v in fields.values()} == {type(v) for v in theirs.values()}
    assert list(infos) == [t.name for t in reader.tensors]
    fields2, tensors = read_gguf_tensors(path)
    assert fields2 == fields
    for t in reader.tensors:
        ref = np.asarray(gguf.quants.dequantize(t.data, t.tensor_type), np.float32).reshape(
            tuple(int(s) for s in reversed(t.shape)))
        info = infos[t.name]
        assert (info.shape, info.ggml_type, info.offset) == (ref.shape, int(t.tensor_type), t.data_offset), t.name
        assert tensors[t.name].dtype == np.float32 and np.array_equal(tensors[t.name], ref), t.name
        assert tensors[t.name].flags.writeable  # dequantized or copied: nothing holds the file open


def test_a_broken_gguf_file_is_a_value_error_naming_it(tmp_path):
    from test_quant import write_gguf

    path = tmp_path / "tiny.gguf"
    write_gguf(path, {"embed": "Q8_0", **{m: "Q4_0" for m in ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                              "up_proj", "down_proj")}})
    good = path.read_bytes()
    for data, detail in [(b"not a gguf file, but long enough for a header", "magic"), (good[:200], "runs past the end|unpack"),
                         (good[:-100], "runs past the end of the file")]:
        path.write_bytes(data)
        with pytest.raises(ValueError, match=f"tiny.gguf is not a readable GGUF file: .*({detail})"):
            read_gguf_tensors(path)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        read_gguf_header(tmp_path / "missing.gguf")
