"""Hostile input to cukern.models: corrupt GGUF files, wrong-typed metadata, bad tokenizer input,
bad generate() arguments. Every case must end in a clear error (GGUFError / TokenizerError /
ValueError / TypeError) naming what is wrong, quickly, before anything is mutated.

The fuzz test mutates a tiny model's bytes (truncations, byte flips and huge counts in the header,
the metadata and the tensor infos) from the run's seed (``CUKERN_TEST_SEED`` replays it).
"""

from __future__ import annotations

import math
import os
import struct
import time
import tracemalloc

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT

from cukern.models.gguf_loader import GGUFError, load_gguf, required_tensors
from cukern.models.gguf_parse import _Reader
from cukern.models.tiny import TinySpec, write_tiny_gguf
from cukern.models.tokenizer import StreamDecoder, Tokenizer, TokenizerError

VT = gguf.GGUFValueType
# small shapes (the loader does not care about kernel block sizes): a file of about 100 KB
SMALL = dict(n_layers=2, d_model=64, n_heads=4, n_kv_heads=2, head_dim=16, d_ff=64)


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    d = tmp_path_factory.mktemp("small")
    return {"llama": write_tiny_gguf(d / "llama.gguf", TinySpec("llama", **SMALL)),
            "gemma3": write_tiny_gguf(d / "gemma3.gguf", TinySpec("gemma3", **SMALL)),
            "qwen2": write_tiny_gguf(d / "qwen2.gguf", TinySpec("qwen2", **SMALL)),
            "freqs": write_tiny_gguf(d / "freqs.gguf", TinySpec("llama", rope_freqs=True, **SMALL))}


def _value_pos(data: bytes, key: str) -> int:
    """Byte offset of the value of scalar metadata key ``key`` (after its length, name and type)."""
    k = key.encode()
    at = data.index(struct.pack("<Q", len(k)) + k)
    return at + 8 + len(k) + 4


def _info_pos(data: bytes, name: str) -> tuple[int, int]:
    """Byte offsets of tensor ``name``'s type word and data-offset word in its tensor info."""
    n = name.encode()
    at = data.index(struct.pack("<Q", len(n)) + n) + 8 + len(n)
    n_dims = struct.unpack_from("<I", data, at)[0]
    type_at = at + 4 + 8 * n_dims
    return type_at, type_at + 4


def _patched(src, dst, *patches) -> str:
    """Copy ``src`` to ``dst`` with ``(offset, struct format, value)`` patches applied."""
    data = bytearray(open(src, "rb").read())
    for at, fmt, value in patches:
        struct.pack_into(fmt, data, at, value)
    dst.write_bytes(bytes(data))
    return str(dst)


def _rewrite(src, dst, set_keys: dict | None = None, drop_keys=()) -> str:
    """Copy a GGUF with keys replaced (``key: (value, GGUFValueType)``) or dropped."""
    r = gguf.GGUFReader(src)
    w = gguf.GGUFWriter(str(dst), r.fields["general.architecture"].contents())
    set_keys = dict(set_keys or {})
    for k, f in r.fields.items():
        if k.startswith("GGUF.") or k == "general.architecture" or k in drop_keys:
            continue
        if k in set_keys:
            w.add_key_value(k, *set_keys.pop(k))
        elif f.types[0] == VT.ARRAY:
            w.add_array(k, f.contents())
        else:
            w.add_key_value(k, f.contents(), f.types[0])
    for k, (v, t) in set_keys.items():
        w.add_key_value(k, v, t)
    for t in r.tensors:
        w.add_tensor(t.name, np.asarray(t.data), raw_dtype=None if t.tensor_type in (QT.F32, QT.F16) else t.tensor_type)
    w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()
    return str(dst)


def _load_fast(path, match: str):
    t0 = time.perf_counter()
    with pytest.raises(GGUFError, match=match) as e:
        load_gguf(path)
    assert time.perf_counter() - t0 < 1.0, "the loader took over a second on a 100 KB file"
    assert os.path.basename(path) in str(e.value)
    return e.value


# ----------------------------------------------------------------------------- hangs

def test_huge_array_count_fails_fast(small, tmp_path):
    data = open(small["llama"], "rb").read()
    k = b"tokenizer.ggml.scores"
    count_at = data.index(struct.pack("<Q", len(k)) + k) + 8 + len(k) + 4 + 4
    p = _patched(small["llama"], tmp_path / "scores.gguf", (count_at, "<Q", 2**40))
    _load_fast(p, r"array 'tokenizer\.ggml\.scores' .* claims 1099511627776 items")


def test_huge_block_count_fails_fast(small, tmp_path):
    data = open(small["llama"], "rb").read()
    p = _patched(small["llama"], tmp_path / "blocks.gguf", (_value_pos(data, "llama.block_count"), "<I", 2**32 - 1))
    _load_fast(p, r"'llama\.block_count' must be in \[1, \d+\], got 4294967295")


@pytest.mark.parametrize("what", ["tensor count", "metadata key count"])
def test_huge_header_counts_fail_fast(small, tmp_path, what):
    at = 8 if what == "tensor count" else 16
    p = _patched(small["llama"], tmp_path / "counts.gguf", (at, "<Q", 2**63))
    _load_fast(p, r"truncated or corrupt header: .* cannot fit in the \d+ bytes after byte 24")


# ----------------------------------------------------------------------------- time and memory bound

def _key(name: str, vtype, payload: bytes) -> bytes:
    """One metadata key/value as GGUF stores it: the name's length and bytes, the type, the value."""
    k = name.encode()
    return struct.pack("<Q", len(k)) + k + struct.pack("<I", vtype) + payload


def _tiny_strings(n: int) -> bytes:
    """The items of a string array of ``n`` one-byte strings (9 bytes each)."""
    items = np.zeros((n, 9), np.uint8)
    items[:, 0], items[:, 8] = 1, ord("a")
    return items.tobytes()


def _with_keys(src, dst, kvs: list[bytes]) -> str:
    """Copy the GGUF ``src`` with the key/values ``kvs`` after its own, then a padding key that moves
    the data section by whole alignments (tensor offsets are relative to it, so they stay right)."""
    data, r = open(src, "rb").read(), _Reader(src)
    n_extra = sum(len(kv) for kv in kvs)
    pad = -(n_extra + len(_key("test.padding", VT.STRING, b"")) + 8) % r.alignment
    kvs = [*kvs, _key("test.padding", VT.STRING, struct.pack("<Q", pad) + b"x" * pad)]
    head = bytearray(data[:r.tensor_info_offset])
    struct.pack_into("<Q", head, 16, struct.unpack_from("<Q", head, 16)[0] + len(kvs))
    with open(dst, "wb") as f:
        f.write(head)
        f.writelines(kvs)
        f.write(data[r.tensor_info_offset:])
    return str(dst)


def _hostile(src, dst, n_keys: int, n_strings: int) -> str:
    """``src`` with ``n_keys`` tiny keys, a 24 MB byte array and ``n_strings`` one-byte strings."""
    kvs = [_key(f"test.k{i:05d}", VT.UINT8, b"\x01") for i in range(n_keys)]
    kvs.append(_key("test.bytes", VT.ARRAY, struct.pack("<IQ", VT.UINT8, 24 << 20) + bytes(24 << 20)))
    kvs.append(_key("test.strings", VT.ARRAY, struct.pack("<IQ", VT.STRING, n_strings) + _tiny_strings(n_strings)))
    return _with_keys(src, dst, kvs)


def test_hostile_header_loads_within_the_time_bound(small, tmp_path):
    """16,000 tiny keys, a 24 MB byte array and a million one-byte strings (a 35 MB file): the load
    takes at most 3 s per 100 MB plus 1 s (the bound is 1 s per 100 MB; the margin is for a loaded
    CI machine) and decodes no array until it is read."""
    p = _hostile(small["llama"], tmp_path / "hostile.gguf", 16_000, 1_000_000)
    size = os.path.getsize(p)
    t0 = time.perf_counter()
    m = load_gguf(p)
    seconds = time.perf_counter() - t0
    assert seconds < 3 * size / 100e6 + 1, f"{seconds:.2f} s for {size / 1e6:.0f} MB"
    assert len(m.reader.fields["test.strings"]) == 1_000_000 and m.metadata["test.k00007"] == 1
    assert m.metadata["test.strings"][:2] == ["a", "a"] and "tokenizer.ggml.tokens" not in m.metadata
    assert set(m.metadata) == set(m.reader.fields) - {"tokenizer.ggml.tokens", "tokenizer.ggml.scores",
                                                      "tokenizer.ggml.token_type"}


def test_hostile_header_loads_within_the_memory_bound(small, tmp_path):
    """The same kind of file, smaller (tracemalloc makes every allocation slow): the load allocates
    less than the file's size (arrays stay views of the memory map until read)."""
    p = _hostile(small["llama"], tmp_path / "hostile.gguf", 2_000, 100_000)
    tracemalloc.start()
    try:
        load_gguf(p)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    size = os.path.getsize(p)
    assert peak < size, f"peak {peak / 1e6:.0f} MB allocated for a {size / 1e6:.0f} MB file"


def test_more_strings_than_the_file_size_allows_fails_fast(small, tmp_path):
    """Two million one-byte strings in an 18 MB file: more than one per 64 bytes (and more than the
    million allowed to any file), refused from the count, before the walk."""
    n = 2_000_000
    p = _with_keys(small["llama"], tmp_path / "strings.gguf",
                   [_key("test.strings", VT.ARRAY, struct.pack("<IQ", VT.STRING, n) + _tiny_strings(n))])
    _load_fast(p, r"array 'test\.strings' at byte \d+ claims 2000000 strings, past the 1048576 that string arrays")


@pytest.mark.parametrize("at,what", [(8, "tensors"), (16, "metadata keys")])
def test_more_keys_or_tensors_than_the_loader_reads_fails_fast(small, tmp_path, at, what):
    data = bytearray(open(small["llama"], "rb").read())
    struct.pack_into("<Q", data, at, (1 << 14) + 1)
    p = tmp_path / "many.gguf"
    p.write_bytes(bytes(data) + bytes(2 << 20))   # room for them, so the count is not refused as truncated
    _load_fast(str(p), rf"the header claims .*16385 {what}.*at most 16384 keys and 16384 tensors")


# ----------------------------------------------------------------------------- tensor layout

@pytest.mark.parametrize("how", ["overlap", "misaligned", "wrap", "header"])
def test_tensor_offsets_are_checked(small, tmp_path, how):
    data = open(small["llama"], "rb").read()
    r = _Reader(small["llama"])
    first, second = r.tensors[0], r.tensors[1]
    _, off_at = _info_pos(data, second.name)
    value = {"overlap": first.data_offset - r.data_offset, "misaligned": second.data_offset - r.data_offset + 1,
             "wrap": 2**64 - r.data_offset, "header": 0}[how]
    p = _patched(small["llama"], tmp_path / f"{how}.gguf", (off_at, "<Q", value))
    _load_fast(p, rf"tensor '{second.name}' has data offset {value}, expected "
                  rf"{second.data_offset - r.data_offset}")


@pytest.mark.parametrize("last", [False, True])
def test_changed_type_word_is_not_reinterpreted(small, tmp_path, last):
    data = open(small["llama"], "rb").read()
    r = _Reader(small["llama"])
    q8 = [t for t in r.tensors if t.tensor_type == QT.Q8_0]
    t = q8[-1] if last else q8[0]
    type_at, _ = _info_pos(data, t.name)
    p = _patched(small["llama"], tmp_path / "retyped.gguf", (type_at, "<I", int(QT.Q4_0)))
    _load_fast(p, "expected" if t is not r.tensors[-1] else "bytes after the last tensor")


def test_truncated_header_says_where(small, tmp_path):
    data = open(small["llama"], "rb").read()
    r = _Reader(small["llama"])
    for cut in (0, 3, 10, 30, r.tensor_info_offset - 3, r.tensor_info_offset + 10, r.data_offset - 1):
        (tmp_path / "cut.gguf").write_bytes(data[:cut])
        _load_fast(tmp_path / "cut.gguf", r"truncated" + ("" if cut == 0 else r".* byte \d+"))


# ----------------------------------------------------------------------------- metadata values

BAD_VALUES = [
    ("llama.attention.layer_norm_rms_epsilon", math.nan, VT.FLOAT32, r"must be finite"),
    ("llama.attention.layer_norm_rms_epsilon", math.inf, VT.FLOAT32, r"must be finite"),
    ("llama.attention.layer_norm_rms_epsilon", 0.0, VT.FLOAT32, r"> 0\.0, got 0\.0"),
    ("llama.attention.layer_norm_rms_epsilon", -1e-6, VT.FLOAT32, r"> 0\.0"),
    ("llama.rope.freq_base", math.nan, VT.FLOAT32, r"must be finite"),
    ("llama.rope.freq_base", 0.0, VT.FLOAT32, r"> 0\.0, got 0\.0"),
    ("llama.context_length", 0, VT.UINT32, r"must be in \[1, 2147483647\], got 0"),
    ("llama.context_length", -5, VT.INT32, r"got -5"),
    ("llama.block_count", 2.0, VT.FLOAT32, r"must be an int, the file stores FLOAT32"),
    ("llama.embedding_length", "64", VT.STRING, r"must be an int, the file stores STRING"),
    ("llama.attention.head_count", True, VT.BOOL, r"must be an int, the file stores BOOL"),
    ("llama.attention.layer_norm_rms_epsilon", "1e-6", VT.STRING, r"must be a float, the file stores STRING"),
    ("llama.feed_forward_length", 2**63, VT.UINT64, r"got 9223372036854775808"),
    ("general.architecture", 3, VT.UINT32, r"must be a str"),
]


@pytest.mark.parametrize("key,value,vtype,match", BAD_VALUES, ids=[f"{k}={v!r}" for k, v, *_ in BAD_VALUES])
def test_bad_metadata_values_are_named(small, tmp_path, key, value, vtype, match):
    p = _rewrite(small["llama"], tmp_path / "bad.gguf", {key: (value, vtype)})
    err = _load_fast(p, match)
    assert repr(key) in str(err)


@pytest.mark.parametrize("window,vtype,match", [(-1, VT.INT32, r"got -1"), (1.5, VT.FLOAT32, "must be an int")])
def test_bad_sliding_window(small, tmp_path, window, vtype, match):
    p = _rewrite(small["gemma3"], tmp_path / "win.gguf", {"gemma3.attention.sliding_window": (window, vtype)})
    _load_fast(p, r"'gemma3\.attention\.sliding_window' .*" + match)


@pytest.mark.parametrize("factor", [math.inf, 0.0, math.nan])
def test_bad_rope_scale(small, tmp_path, factor):
    p = _rewrite(small["llama"], tmp_path / "scale.gguf", {"llama.rope.scaling.type": ("linear", VT.STRING),
                                                          "llama.rope.scaling.factor": (factor, VT.FLOAT32)})
    _load_fast(p, r"'llama\.rope\.scaling\.factor' must be")


@pytest.mark.parametrize("value", [math.nan, 0.0, -2.0, math.inf])
def test_bad_rope_freqs_values(small, tmp_path, value):
    r = _Reader(small["freqs"])
    t = next(t for t in r.tensors if t.name == "rope_freqs.weight")
    p = _patched(small["freqs"], tmp_path / "freqs.gguf", (t.data_offset + 4, "<f", value))
    _load_fast(p, r"'rope_freqs\.weight' must hold finite values > 0")


# ----------------------------------------------------------------------------- tokenizer

@pytest.mark.parametrize("key,value,vtype,match", [
    ("tokenizer.ggml.add_bos_token", "false", VT.STRING, r"add_bos_token' must be a bool, the file stores STRING"),
    ("tokenizer.ggml.bos_token_id", 10**6, VT.UINT32, r"bos_token_id' must be in \[0, \d+\], got 1000000"),
    ("tokenizer.ggml.eos_token_id", 1.0, VT.FLOAT32, r"eos_token_id' must be an int"),
    ("tokenizer.ggml.model", 7, VT.UINT32, r"model' must be a str"),
])
def test_tokenizer_metadata_is_typed(small, tmp_path, key, value, vtype, match):
    p = _rewrite(small["llama"], tmp_path / "tok.gguf", {key: (value, vtype)})
    with pytest.raises(TokenizerError, match=match) as e:
        Tokenizer.from_gguf(load_gguf(p))
    assert "tok.gguf" in str(e.value)


def test_tokenizer_invalid_utf8_token_is_replaced(small, tmp_path):
    data = open(small["llama"], "rb").read()
    at = data.index(struct.pack("<Q", 5) + b"hello") + 8
    p = _patched(small["llama"], tmp_path / "utf8.gguf", (at, "<B", 0xFF))
    tok = Tokenizer.from_gguf(load_gguf(p))
    assert "\ufffdello" in tok.tokens
    assert tok.decode(tok.encode("hello world")) == "hello world"


def test_tokenizer_rejects_lone_surrogates_and_bad_ids(small):
    tok = Tokenizer.from_gguf(load_gguf(small["llama"]))
    with pytest.raises(TokenizerError, match=r"lone surrogate U\+DCE9 at index 1"):
        tok.encode("a\udce9b")
    with pytest.raises(TypeError, match="encode takes a str"):
        tok.encode(b"abc")
    for bad in (1.7, "5", True, None):
        with pytest.raises(TypeError, match="token id must be an integer"):
            tok.decode([2, bad])
        with pytest.raises(TypeError, match="token id must be an integer"):
            StreamDecoder(tok).push(bad)
    with pytest.raises(TokenizerError, match="outside the vocabulary"):
        tok.decode([len(tok)])
    assert tok.decode([np.int64(tok.encode("hello", add_bos=False)[0])]) == "hello"


# ----------------------------------------------------------------------------- fuzz

def _check_valid(m) -> None:
    """What a model that loads must satisfy: sane hyperparameters, every needed tensor of its shape
    and exactly the bytes its type and shape take."""
    c = m.config
    assert c.n_layers >= 1 and math.isfinite(c.rms_eps) and c.rms_eps > 0
    assert math.isfinite(c.rope_base) and c.rope_base > 0 and math.isfinite(c.rope_scale) and c.rope_scale > 0
    assert c.context_length >= 1 and c.sliding_window >= 0
    for name, shape in required_tensors(c).items():
        t = m.tensors[name]
        block, size = gguf.GGML_QUANT_SIZES[t.qtype]
        assert t.shape == shape and t.n_bytes == math.prod(shape) // block * size


def _mutate(data: bytes, r, rng: np.random.Generator) -> tuple[str, bytes]:
    """One mutation of ``data``: a truncation, byte flips, or a huge 8-byte count, in the header,
    the metadata or the tensor infos."""
    regions = {"header": (0, 24), "metadata": (24, r.tensor_info_offset),
               "tensor infos": (r.tensor_info_offset, r.data_offset)}
    kind = rng.choice(["truncate", "flip", "count"], p=[0.2, 0.5, 0.3])
    if kind == "truncate":
        cut = int(rng.integers(0, r.data_offset + 64)) if rng.random() < 0.8 else int(rng.integers(0, len(data)))
        return f"truncate at {cut}", data[:cut]
    region = str(rng.choice(list(regions)))
    lo, hi = regions[region]
    out = bytearray(data)
    if kind == "flip":
        at = [int(a) for a in rng.integers(lo, hi, size=int(rng.integers(1, 4)))]
        for a in at:
            out[a] = int(rng.integers(0, 256)) if rng.random() < 0.5 else out[a] ^ (1 << int(rng.integers(0, 8)))
        return f"flip {region} bytes {at}", bytes(out)
    at = int(rng.integers(lo, hi - 8))
    value = [2**32 - 1, 2**40, 2**63, 2**64 - 1, int(rng.integers(0, 2**31))][int(rng.integers(0, 5))]
    struct.pack_into("<Q", out, at, value)
    return f"u64 {value} at {region} byte {at}", bytes(out)


def test_fuzz_mutated_files_end_in_a_clear_error_or_a_valid_model(small, tmp_path, rng):
    """About 3000 mutated tiny models (three architectures): each ends in GGUFError/TokenizerError or
    loads a valid model, in well under a second; the whole test is bounded to 25 s."""
    cases, loaded, start = 0, 0, time.perf_counter()
    p = tmp_path / "fuzz.gguf"
    for arch in ("llama", "gemma3", "qwen2"):
        data, r = open(small[arch], "rb").read(), _Reader(small[arch])
        for _ in range(1000):
            what, mutated = _mutate(data, r, rng)
            p.write_bytes(mutated)
            t0 = time.perf_counter()
            try:
                m = load_gguf(p)
                _check_valid(m)
                Tokenizer.from_gguf(m)
                loaded += 1
            except (GGUFError, TokenizerError) as e:
                assert "fuzz.gguf" in str(e), (arch, what, e)
            except Exception as e:   # noqa: BLE001 - anything else is the bug this test looks for
                raise AssertionError(f"{arch}: {what}: {type(e).__name__}: {e}") from e
            assert time.perf_counter() - t0 < 0.5, (arch, what)
            cases += 1
            if time.perf_counter() - start > 25:
                break
    assert cases >= 1000 and 0 < loaded < cases


@pytest.mark.parametrize("flag,value", [("--temperature", "nan"), ("--temperature", "inf"), ("--temperature", "1e-40"),
                                        ("--top-p", "nan"), ("--seed", "-1"), ("--top-k", "0")])
def test_cli_generate_rejects_bad_sampling_flags(flag, value):
    import subprocess
    import sys
    r = subprocess.run([sys.executable, "-m", "cukern", "generate", "--prompt", "x", flag, value],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and r.stderr.startswith(f"error: {flag}") and len(r.stderr.splitlines()) == 1, r.stderr
