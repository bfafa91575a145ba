"""Hostile arguments to the dispatch layer, on the CPU (tests/host_dispatch.py where arrays are
involved): integer arguments of every integer type range-checked without overflow, bools refused,
the sizes that relate a dispatch's arrays to each other checked, and a failed call changes nothing.
The page allocator's property test draws from the run's seed (``CUKERN_TEST_SEED`` replays it)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, seed, settings
from hypothesis import strategies as st

from conftest import RUN_SEED
from cukern.attention import PageAllocator
from cukern.params import check_int, check_real, load_header

INTS = [int, np.int8, np.int32, np.int64, np.uint32, np.uint64]


def test_check_int_and_check_real():
    for t in INTS:
        assert check_int("x", t(5), 0, 9) == 5 and type(check_int("x", t(5))) is int
    for bad in (True, np.bool_(False), 1.0, "3", None):
        with pytest.raises(TypeError, match="x must be an integer"):
            check_int("x", bad)
    with pytest.raises(ValueError, match=r"x must be in \[0, 9\], got 10"):
        check_int("x", np.int64(10), 0, 9)
    assert check_real("t", np.float32(0.5)) == 0.5
    for bad, exc in ((True, TypeError), ("1", TypeError), (float("nan"), ValueError), (float("inf"), ValueError),
                     (10**400, ValueError)):
        with pytest.raises(exc, match="t must be"):
            check_real("t", bad)


def test_pack_rejects_an_int_past_a_double():
    s = load_header("elementwise/params.cuh")
    name, struct = next((n, st_) for n, st_ in s.items() if any(f.ctype == "float" for f in st_.fields))
    f = next(f for f in struct.fields if f.ctype == "float")
    values = {g.name: (0 if g.ctype != "float" and g.ctype != "double" else 1.0) if g.count == 1 else [0] * g.count
              for g in struct.fields}
    values[f.name] = 10**400
    with pytest.raises(ValueError, match=f"{name}.{f.name} .*overflows"):
        struct.pack(**values)


# ----------------------------------------------------------------------------- page allocator

def _state(a: PageAllocator):
    return (a.page_table.copy(), a.lengths.copy(), a.active.copy(), a.refs.copy(), list(a._free))


def _same(s0, s1) -> bool:
    return all(np.array_equal(x, y) for x, y in zip(s0, s1))


def test_allocator_numpy_int_overflow_is_refused():
    a = PageAllocator(8, 4, 2)
    s, _ = a.add(5), a.add(4)
    before = _state(a)
    with pytest.raises(ValueError, match="exceed"):
        a.extend(s, np.int32(2**31 - 1))
    assert _same(before, _state(a)) and a.lengths[s] == 5
    a.free(s)
    assert a.n_free_pages == 7
    with pytest.raises(ValueError, match="int32"):
        PageAllocator(np.int32(2**23), np.int32(256), 1)   # 2**31 positions: the int32 product would wrap
    for bad in (True, 4.0, "4"):
        with pytest.raises(TypeError, match="page_size"):
            PageAllocator(8, bad, 2)
    with pytest.raises(TypeError, match="sequence id"):
        a.extend(True, 1)


def _check_invariants(a: PageAllocator) -> None:
    held = {}
    for s in a.active_slots():
        assert a.lengths[s] >= 0
        for p in a.pages(s):
            held[p] = held.get(p, 0) + 1
    assert all(a.refs[p] == n for p, n in held.items())                 # no double allocation
    assert set(held).isdisjoint(a._free) and len(set(a._free)) == len(a._free)
    assert len(held) + a.n_free_pages == a.n_pages                     # no leak


SIZES = st.one_of(st.integers(-3, 40), st.sampled_from([2**31 - 1, 2**32, 2**63 - 1]),
                  st.builds(lambda t, v: t(v), st.sampled_from([np.int32, np.int64, np.uint32, np.int8]),
                            st.integers(0, 127)),
                  st.builds(np.int32, st.sampled_from([2**31 - 1, -2**31])), st.sampled_from([True, 1.0]))
OPS = st.lists(st.tuples(st.sampled_from(["add", "extend", "fork", "free"]), st.integers(-1, 4), SIZES),
               max_size=40)


@seed(RUN_SEED)
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=OPS)
def test_allocator_property_no_leak_no_double_allocation_failed_calls_change_nothing(ops):
    a = PageAllocator(16, 4, 4, 6)
    for op, slot, n in ops:
        before = _state(a)
        try:
            if op == "add":
                a.add(n)
            elif op == "extend":
                a.extend(slot, n)
            elif op == "fork":
                a.fork(slot)
            else:
                a.free(slot)
        except (ValueError, TypeError):
            assert _same(before, _state(a)), (op, slot, n)
        _check_invariants(a)
    for s in a.active_slots():
        a.free(s)
    assert a.n_free_pages == a.n_pages and not a.refs.any()


# ----------------------------------------------------------------------------- KV writes, tokens

def test_kv_writes_relate_their_arrays(host_if_no_gpu):
    import cupy
    from cukern.attention import AttentionDispatch, PagedKVCache
    from cukern.elementwise import ElementwiseDispatch
    attn = AttentionDispatch()
    cache = PagedKVCache(1, 4, 16, 2, 64, max_seqs=2)
    s = cache.add(8)
    k, v = cupy.zeros((8, 2, 64), cupy.float16), cupy.zeros((7, 2, 64), cupy.float16)
    with pytest.raises(ValueError, match=r"v must have shape \(8, 2, 64\)"):
        attn.write_kv_run(cache, 0, k, v, s, 0)
    ids = cupy.zeros(8, cupy.int32)
    with pytest.raises(ValueError, match=r"v must have shape \(8, 2, 64\)"):
        attn.write_kv(cache, 0, k, v, ids, ids)
    with pytest.raises(TypeError, match="pos0"):
        attn.write_kv_run(cache, 0, k, k, s, 0.0)
    with pytest.raises(TypeError, match="layer"):
        attn.write_kv_run(cache, False, k, k, s, 0)
    with pytest.raises(ValueError, match="outside sequence"):
        attn.write_kv_run(cache, 0, k, k, s, np.int32(2**31 - 1))
    ew = ElementwiseDispatch()
    src = cupy.zeros((3, 2, 64), cupy.float32)
    pool = cupy.zeros((4, 16, 2, 64), cupy.float32)
    pos = cupy.zeros(1, cupy.int32)
    with pytest.raises(ValueError, match="empty cache or page table"):
        ew.kv_write(src, pool, cupy.zeros((0, 4), cupy.int32), pos, pos)


def test_advance_positions_rejects_empty_lengths(host_if_no_gpu):
    import cupy
    from cukern.tokens import TokensDispatch
    td = TokensDispatch()
    p = cupy.zeros(2, cupy.int32)
    with pytest.raises(ValueError, match="lengths must be non-empty"):
        td.advance_positions(p, cupy.zeros(0, cupy.int32), p)


@pytest.mark.parametrize("kwargs,exc,match", [
    (dict(temperature=float("nan")), ValueError, "temperature must be finite"),
    (dict(temperature=float("inf")), ValueError, "temperature must be finite"),
    (dict(temperature=1e-40), ValueError, r"temperature must be 0 \(greedy\) or in"),
    (dict(temperature="0.7"), TypeError, "temperature must be a real number"),
    (dict(top_k=0), ValueError, "top_k must be in"),
    (dict(top_k=True), TypeError, "top_k must be an integer"),
    (dict(top_p=float("nan")), ValueError, "top_p must be finite"),
    (dict(top_p=1.5), ValueError, r"top_p must be in \(0, 1\]"),
    (dict(seed=-1), ValueError, "seed must be in"),
    (dict(seed=1.5), TypeError, "seed must be an integer"),
])
def test_check_sampling(kwargs, exc, match):
    from cukern.tokens import check_sampling
    args = dict(temperature=0.7, top_k=40, top_p=0.9, seed=0) | kwargs
    with pytest.raises(exc, match=match):
        check_sampling(**args)
    assert check_sampling(0.7, np.int32(40), np.float32(1.0), np.uint64(2**64 - 1)) == (0.7, 40, 1.0, 2**64 - 1)


# ----------------------------------------------------------------------------- generate

@pytest.mark.parametrize("kwargs,exc,match", [
    (dict(temperature=float("nan")), ValueError, "temperature"),
    (dict(temperature=float("inf")), ValueError, "temperature"),
    (dict(temperature=1e-40), ValueError, "temperature"),
    (dict(temperature=0.7, top_p=0.0), ValueError, "top_p"),
    (dict(temperature=0.7, seed=-1), ValueError, "seed"),
    (dict(temperature=0.7, seed="1"), TypeError, "seed"),
    (dict(top_k=0), ValueError, "top_k"),
    (dict(stop_ids=[10**6]), ValueError, "stop id"),
    (dict(stop_ids=["1"]), TypeError, "stop id"),
    (dict(stop_ids=1), TypeError, "stop_ids"),
    (dict(max_new_tokens=np.int64(0)), ValueError, "max_new_tokens"),
    (dict(prompts=[[1, 2.5]]), TypeError, "token ids of a prompt"),
])
def test_generate_validates_before_it_touches_the_cache(tmp_path, monkeypatch, kwargs, exc, match):
    from host_dispatch import patch
    from cukern.models.gguf_loader import load_gguf
    from cukern.models.tiny import TinySpec, write_tiny_gguf
    from cukern.models.transformer import Transformer
    launches = patch(monkeypatch)
    lm = Transformer(load_gguf(write_tiny_gguf(tmp_path / "m.gguf", TinySpec("llama"))), max_seqs=2,
                     max_tokens=32, page_size=4)
    lm.generate([[5, 6, 7]], 2)
    before, n_launches = _state(lm.cache.alloc), sum(launches.values())
    args = dict(prompts=[[5, 6]], max_new_tokens=2) | kwargs
    with pytest.raises(exc, match=match):
        lm.generate(args.pop("prompts"), args.pop("max_new_tokens"), **args)
    assert _same(before, _state(lm.cache.alloc)) and sum(launches.values()) == n_launches


def test_repeat_keys_of_frozen_dataclasses_and_identity_objects():
    """cukern.repeat's argument keys: a frozen dataclass by its fields, the key kept on the instance
    unless a field is a list (which may change); an object of a ``_repeat_by_identity`` class by
    identity, a dead one's key never equal to a later object's."""
    import dataclasses
    from cukern.repeat import _KEY_ATTR, _arg_key

    @dataclasses.dataclass(frozen=True, eq=False)
    class Plan:
        n: int
        scale: float
        ids: object = None

    a, b = Plan(3, 0.5), Plan(3, 0.5)
    assert _arg_key(a) == _arg_key(b) != _arg_key(Plan(3, 0.25))
    assert a.__dict__[_KEY_ATTR] == _arg_key(a)
    listed = Plan(3, 0.5, [1, 2])
    key = _arg_key(listed)
    listed.ids.append(3)
    assert _KEY_ATTR not in listed.__dict__ and _arg_key(listed) != key

    class Cache:
        _repeat_by_identity = True

    c, other = Cache(), Cache()
    assert _arg_key(c) == _arg_key(c) != _arg_key(other)
    old = _arg_key(Plan(1, 1.0, c))
    addr = id(c)
    del c
    for _ in range(1000):  # CPython hands a freed object's address to the next object of its size
        new = Cache()
        if id(new) == addr:
            assert _arg_key(Plan(1, 1.0, new)) != old
            break
