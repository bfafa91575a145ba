"""cukern.models.gguf_loader: reading config and tensors, and refusing bad files.

CPU tests write tiny random-weight GGUF files with gguf.GGUFWriter (cukern.models.tiny).
"""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT

from cukern.models.gguf_loader import GGUFError, load_gguf, required_tensors
from cukern.models.tiny import write_tiny_gguf
from models_helpers import ARCHS


# ----------------------------------------------------------------------------- loader

@pytest.mark.parametrize("arch", ARCHS)
def test_loader_reads_config_and_tensors(tiny, arch):
    m = load_gguf(tiny[arch])
    c = m.config
    assert (c.arch, c.n_layers, c.d_model, c.n_heads, c.n_kv_heads, c.head_dim, c.d_ff) == (arch, 2, 256, 4, 2, 64, 512)
    assert c.qk_norm == (arch in ("gemma3", "qwen3")) and c.qkv_bias == (arch == "qwen2")
    assert c.rope_neox == (arch != "llama") and c.tied_output == (arch == "gemma3")
    if arch == "gemma3":
        assert c.sliding_window == 8 and c.local_layers == (True, False)
        assert c.embed_scale == pytest.approx(16.0) and c.rope_base_local == 10000.0
    else:
        assert c.sliding_window == 0 and not any(c.local_layers)
    assert set(required_tensors(c)) <= set(m.tensors)
    assert m["blk.1.ffn_down.weight"].qtype == QT.Q6_K and m["blk.1.ffn_down.weight"].shape == (256, 512)
    assert m.metadata["general.architecture"] == arch
    w = m["blk.0.attn_output.weight"].dequantize()
    assert w.shape == (256, 256) and np.isfinite(w).all() and w.std() > 0


def test_loader_reads_rope_scaling_and_frequency_factors(tiny_rope):
    c = load_gguf(tiny_rope["gemma3-linear8"]).config
    d = np.arange(0, 64, 2) / 64
    assert c.rope_scale == 8.0 and not c.rope_freq_factors
    np.testing.assert_allclose(c.rope_inv_freq(local=False), 1e6 ** -d / 8.0)       # global: scaled
    np.testing.assert_allclose(c.rope_inv_freq(local=True), 1e4 ** -d)               # local: plain
    assert c.rope_is_plain(True) and not c.rope_is_plain(False)
    m = load_gguf(tiny_rope["llama-freqs"])
    f = m["rope_freqs.weight"].dequantize(np.float64)
    assert m.config.rope_freq_factors and f.shape == (32,) and f.min() >= 1.0
    np.testing.assert_allclose(m.config.rope_inv_freq(False, f), 1e4 ** -d / f)


def test_gemma3_270m_preset_has_the_real_models_shapes_and_types(tmp_path):
    """profile_decode --tiny gemma3-270m stands in for the real model: same layer shapes and types."""
    from cukern.models.tiny import PRESETS
    m = load_gguf(write_tiny_gguf(tmp_path / "g.gguf", PRESETS["gemma3-270m"]()))
    c = m.config
    assert (c.n_layers, c.d_model, c.n_heads, c.n_kv_heads, c.head_dim, c.d_ff, c.sliding_window) == \
        (18, 640, 4, 1, 256, 2048, 512)
    assert c.local_layers[:6] == (True,) * 5 + (False,)
    types = {name.split(".", 2)[-1]: m[name].qtype.name for name in m.tensors if name.startswith("blk.0.")}
    assert types["attn_q.weight"] == "Q5_0" and types["attn_output.weight"] == "Q4_K"
    assert types["ffn_down.weight"] == "Q6_K" and types["attn_v.weight"] == "Q8_0"


def test_loader_rejects_missing_file(tmp_path):
    with pytest.raises(GGUFError, match="no such file"):
        load_gguf(tmp_path / "nope.gguf")


def test_loader_rejects_garbage(tmp_path):
    p = tmp_path / "garbage.gguf"
    p.write_bytes(b"this is not a gguf file at all" * 10)
    with pytest.raises(GGUFError, match="garbage.gguf"):
        load_gguf(p)


def test_loader_rejects_truncated_file(tiny, tmp_path):
    p = tmp_path / "cut.gguf"
    data = open(tiny["llama"], "rb").read()
    p.write_bytes(data[: len(data) - 1000])
    with pytest.raises(GGUFError, match=r"cut\.gguf.*tensor 'blk\.1\.ffn_down\.weight'.*truncated"):
        load_gguf(p)


def test_loader_rejects_unsupported_architecture(tmp_path):
    import gguf
    p = tmp_path / "mamba.gguf"
    w = gguf.GGUFWriter(str(p), "mamba")
    w.add_tensor("token_embd.weight", np.ones((4, 32), np.float32))
    w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()
    with pytest.raises(GGUFError, match=r"mamba\.gguf: unsupported architecture 'mamba'"):
        load_gguf(p)


def _rewrite_without(src, dst, drop=None, retype=None):
    """Copy a GGUF, leaving out tensor ``drop`` and/or storing tensor ``retype`` as Q4_1."""
    import gguf
    r = gguf.GGUFReader(src)
    arch = r.fields["general.architecture"].contents()
    w = gguf.GGUFWriter(str(dst), arch)
    for k, f in r.fields.items():
        if k.startswith("GGUF.") or k == "general.architecture":
            continue
        vt = f.types[0]
        if vt == gguf.GGUFValueType.ARRAY:
            w.add_array(k, f.contents())
        else:
            w.add_key_value(k, f.contents(), vt)
    for t in r.tensors:
        if t.name == drop:
            continue
        if t.name == retype:
            x = np.ones(tuple(int(s) for s in reversed(t.shape.tolist())), np.float32)
            w.add_tensor(t.name, gguf.quants.quantize(x, QT.Q4_1), raw_dtype=QT.Q4_1)
        else:
            w.add_tensor(t.name, np.asarray(t.data), raw_dtype=None if t.tensor_type in (QT.F32, QT.F16) else t.tensor_type)
    w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()
    return dst


def test_loader_rejects_missing_tensor(tiny, tmp_path):
    p = _rewrite_without(tiny["qwen2"], tmp_path / "hole.gguf", drop="blk.1.attn_k.bias")
    with pytest.raises(GGUFError, match=r"hole\.gguf: missing tensor 'blk\.1\.attn_k\.bias'"):
        load_gguf(p)


def test_loader_rejects_unsupported_tensor_type(tiny, tmp_path):
    p = _rewrite_without(tiny["llama"], tmp_path / "q41.gguf", retype="blk.0.ffn_up.weight")
    with pytest.raises(GGUFError, match=r"q41\.gguf: tensor 'blk\.0\.ffn_up\.weight' has unsupported type Q4_1"):
        load_gguf(p)


def test_loader_rejects_missing_hyperparameter(tiny, tmp_path):
    import gguf
    r = gguf.GGUFReader(tiny["llama"])
    w = gguf.GGUFWriter(str(tmp_path / "nohp.gguf"), "llama")
    for k, f in r.fields.items():
        if k.startswith("GGUF.") or k in ("general.architecture", "llama.block_count"):
            continue
        if f.types[0] == gguf.GGUFValueType.ARRAY:
            w.add_array(k, f.contents())
        else:
            w.add_key_value(k, f.contents(), f.types[0])
    for t in r.tensors:
        w.add_tensor(t.name, np.asarray(t.data), raw_dtype=None if t.tensor_type in (QT.F32, QT.F16) else t.tensor_type)
    w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()
    with pytest.raises(GGUFError, match=r"nohp\.gguf: missing metadata key 'llama\.block_count'"):
        load_gguf(tmp_path / "nohp.gguf")
