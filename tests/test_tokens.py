"""Tokens family: embedding gather by device ids, greedy and top-k/top-p sampling, position advance.

References: cukern/reference/tokens.py (float64) and gguf.quants for the block formats."""

from __future__ import annotations

import numpy as np
import pytest

from cukern.reference import tokens as ref

gpu = pytest.mark.gpu


@pytest.fixture(scope="module")
def td():
    from cukern.tokens import TokensDispatch
    return TokensDispatch()


def _table(rng, qtype, rows, cols):
    from cukern.models.tiny import random_blocks
    import gguf
    raw = random_blocks(rng, rows, cols, gguf.GGMLQuantizationType(qtype), 1.0)
    f64 = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType(qtype)).reshape(rows, cols).astype(np.float64)
    return raw, f64


@gpu
@pytest.mark.parametrize("qtype,cols", [(0, 100), (1, 36), (2, 96), (6, 160), (8, 640), (12, 256), (13, 512),
                                        (14, 768)])
def test_embed_matches_reference(td, rng, qtype, cols):
    import cupy
    from cukern.testing import assert_close, poison
    raw, f64 = _table(rng, qtype, 37, cols)
    ids = np.array([0, 36, 5, 5, -1, 37, 12], np.int32)          # repeats and two ids outside the table
    out = poison(cupy.empty((ids.size, cols), cupy.float32))
    td.embed(cupy.asarray(raw), qtype, cols, cupy.asarray(ids), out, scale=1.5)
    assert_close(out, ref.embed(f64, ids, scale=1.5), atol=1e-6, rtol=1e-6)  # f32 dequantization of f16 scales


def test_embed_validates_before_launch(td, host_if_no_gpu):
    import cupy
    t = cupy.zeros((4, 34), cupy.uint8)
    ids = cupy.zeros(2, cupy.int32)
    out = cupy.zeros((2, 32), cupy.float32)
    with pytest.raises(ValueError, match="unsupported table type"):
        td.embed(t, 3, 32, ids, out)
    with pytest.raises(ValueError, match="34 bytes"):
        td.embed(t, 8, 64, ids, cupy.zeros((2, 64), cupy.float32))
    with pytest.raises(TypeError, match="ids"):
        td.embed(t, 8, 32, ids.astype(cupy.int64), out)
    with pytest.raises(ValueError, match="out"):
        td.embed(t, 8, 32, ids, cupy.zeros((3, 32), cupy.float32))


@gpu
@pytest.mark.parametrize("rows,vocab", [(1, 262144), (3, 151936), (2, 1000), (5, 1)])
def test_greedy_matches_argmax(td, rng, rows, vocab):
    import cupy
    from cukern.tokens import SamplePlan
    x = rng.standard_normal((rows, vocab)).astype(np.float32)
    if vocab > 10:
        x[0, [3, vocab - 2]] = 50.0                                   # a tie: the lower id wins
        x[-1, 7] = np.nan                                             # NaN counts as -inf
    plan = SamplePlan(rows, vocab, sampling=False, history_len=4)
    plan.next_ids.fill(-5)
    got = td.sample(plan, cupy.asarray(x)).get()
    np.testing.assert_array_equal(got, ref.greedy(x))
    assert plan.draws.get().tolist() == [1] * rows and plan.history.get()[:, 0].tolist() == got.tolist()


@gpu
@pytest.mark.parametrize("vocab", [50, 4099, 262144])
def test_sampling_top_k_1_and_tiny_temperature_are_greedy(td, rng, vocab):
    import cupy
    from cukern.tokens import SamplePlan
    x = rng.standard_normal((4, vocab)).astype(np.float32)
    plan = SamplePlan(4, vocab, sampling=True)
    np.testing.assert_array_equal(td.sample(plan, cupy.asarray(x), temperature=1.0, top_k=1).get(), ref.greedy(x))
    np.testing.assert_array_equal(td.sample(plan, cupy.asarray(x), temperature=1e-3).get(), ref.greedy(x))


@gpu
@pytest.mark.slow
@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, 64, 1.0), (0.7, 10, 1.0), (1.3, 64, 0.8)])
def test_sampling_distribution(td, rng, temperature, top_k, top_p):
    """Many rows holding the same logits (vocabulary 3000, spread so that the top 64 matter): the
    frequencies of the draws match the reference probabilities within 5 binomial standard deviations
    (plus 1e-3), and no draw falls outside the candidate set."""
    import cupy
    from cukern.tokens import SamplePlan
    rows, vocab = 8192, 3000
    base = (rng.standard_normal(vocab) * 2).astype(np.float32)
    x = cupy.asarray(np.tile(base, (rows, 1)))
    plan = SamplePlan(rows, vocab, sampling=True)
    counts = np.zeros(vocab)
    for seed in range(4):
        got = td.sample(plan, x, temperature=temperature, top_k=top_k, top_p=top_p, seed=seed).get()
        counts += np.bincount(got, minlength=vocab)
    ids, p = ref.candidate_probs(base, temperature=temperature, top_k=top_k, top_p=top_p)
    n = counts.sum()
    outside = np.setdiff1d(np.flatnonzero(counts), ids)
    assert outside.size == 0, f"draws outside the candidate set: {outside[:10]}"
    freq = counts[ids] / n
    bound = 5 * np.sqrt(p * (1 - p) / n) + 1e-3
    bad = np.flatnonzero(np.abs(freq - p) > bound)
    assert bad.size == 0, f"ids {ids[bad][:5]}: frequency {freq[bad][:5]} vs probability {p[bad][:5]}"


@gpu
def test_sampling_is_reproducible_and_advances_draws(td, rng):
    import cupy
    from cukern.tokens import SamplePlan
    x = cupy.asarray(rng.standard_normal((2, 500)).astype(np.float32))
    a, b = SamplePlan(2, 500, sampling=True, history_len=3), SamplePlan(2, 500, sampling=True, history_len=3)
    for _ in range(3):
        td.sample(a, x, temperature=2.0, seed=7)
        td.sample(b, x, temperature=2.0, seed=7)
    np.testing.assert_array_equal(a.history.get(), b.history.get())
    assert len(set(a.history.get()[0].tolist())) > 1           # fresh draws per call (T = 2 over 64 candidates)
    assert a.draws.get().tolist() == [3, 3]


def test_sample_validates_before_launch(td, host_if_no_gpu):
    import cupy
    from cukern.tokens import SamplePlan
    plan = SamplePlan(2, 100, sampling=False)
    x = cupy.zeros((2, 100), cupy.float32)
    with pytest.raises(ValueError, match="sampling=True"):
        td.sample(plan, x, temperature=1.0)
    with pytest.raises(ValueError, match="temperature"):
        td.sample(plan, x, temperature=-1.0)
    with pytest.raises(ValueError, match="top_k"):
        td.sample(SamplePlan(2, 100, sampling=True), x, temperature=1.0, top_k=65)
    with pytest.raises(ValueError, match="top_p"):
        td.sample(plan, x, top_p=0.0)
    with pytest.raises(ValueError, match="logits"):
        td.sample(plan, cupy.zeros((2, 99), cupy.float32))
    with pytest.raises(ValueError, match="at most"):
        SamplePlan(1, 262144 * 4, sampling=True)
    assert plan.draws.get().tolist() == [0, 0]


@gpu
def test_advance_positions(td):
    import cupy
    pos = cupy.asarray(np.array([4, 9], np.int32))
    lengths = cupy.asarray(np.array([0, 5, 7, 10], np.int32))
    td.advance_positions(pos, lengths, cupy.asarray(np.array([1, 3], np.int32)))
    assert pos.get().tolist() == [5, 10] and lengths.get().tolist() == [0, 6, 7, 11]


def test_reference_candidates():
    ids, p = ref.candidate_probs(np.array([0.0, 3.0, 3.0, 1.0, np.nan]), temperature=1.0, top_k=3, top_p=1.0)
    assert ids.tolist() == [1, 2, 3] and np.isclose(p.sum(), 1.0)
    ids, _ = ref.candidate_probs(np.array([0.0, 10.0, 1.0]), temperature=1.0, top_k=3, top_p=0.5)
    assert ids.tolist() == [1]


@pytest.mark.parametrize("arch", [80, 90])
def test_tokens_family_compiles_with_struct_sizes(arch):
    """NVRTC alone (no GPU): every kernel compiles, takes its struct last, and the PTX parameter size
    matches the parsed struct; the params header's static_asserts hold."""
    from cukern import check
    from cukern.tokens import FAMILY
    rows = check.check_family(FAMILY, arch) + [check.check_header(FAMILY.params_header, arch)]
    assert rows and all(r.ok for r in rows), [r.error for r in rows if not r.ok]
    assert {r.kernel for r in rows} >= {k.name for k in FAMILY.kernels}
