"""Repeated calls of a dispatch method: the launches of a call remembered and issued again.

A notebook or an eager decode loop calls the same methods on the same arrays again and again; the
checks, the struct packing and the grid of such a call come out the same every time. A method
marked :func:`repeatable` remembers the launches a successful call made (detached: pointers, not the
caller's arrays), keyed by its arguments (an array by its pointer, shape, strides and dtype, a torch
tensor by those and its device; a number by its type and exact value; a frozen dataclass by its
fields; an object whose class sets ``_repeat_by_identity``, such as a PagedKVCache, by identity) and
the dispatch's settings, and a later call with an equal key issues them again without the Python work
in between (``Dispatch._launch`` appends each launch to :data:`recording` while a call is recorded).
"""

from __future__ import annotations

import dataclasses
import functools
import threading
import weakref

import cupy
import numpy as np

from cukern.interop import TORCH_TYPES, wrap_inside
from cukern.streams import resolve_stream

__all__ = ["repeatable", "recording"]

_dispatch = None  # cukern.dispatch (Dispatch, the profiling switches, bounded_put), which imports this module


def _dispatch_module():
    global _dispatch
    if _dispatch is None:
        from cukern import dispatch
        _dispatch = dispatch
    return _dispatch

recording = threading.local()  # .launches: the list the launches of the call being recorded go to
_NDARRAY = cupy.ndarray
_REPEAT_LIMIT = 512  # calls remembered per dispatch object


class _NotKeyable(Exception):
    pass


def _arg_key(v):
    """A hashable value that is equal for two arguments exactly when a repeatable method's checks and
    launches come out the same for both (a frozen dataclass by its fields); _NotKeyable for a type it
    does not know."""
    t = type(v)
    if t is _NDARRAY or isinstance(v, _NDARRAY):
        return (t, v.data.ptr, v.shape, v.strides, v.dtype.char)
    if t is float:  # equal nonzero floats have equal bits (a NaN equals only itself); zeros by sign too
        return (t, v) if v else (t, v.hex())
    if v is None or t in (int, bool, str):
        return (t, v)
    if t in TORCH_TYPES:  # a torch tensor (cukern.interop): its own fields, no CuPy view made
        return (t, v.data_ptr(), v.shape, v.stride(), v.dtype, v.get_device())
    if isinstance(v, np.generic):
        return (t, v.tobytes())
    if t in (tuple, list):
        return (t, tuple(_arg_key(x) for x in v))
    if getattr(t, "_repeat_by_identity", False):
        # by identity, through a weak reference: equal only while the object lives (a dead one's entry
        # never matches an object made later at its address) and not kept alive by the cache
        return weakref.ref(v)
    names = _FROZEN.get(t)
    if names is None and dataclasses.is_dataclass(t) and t.__dataclass_params__.frozen:
        names = _FROZEN[t] = tuple(f.name for f in dataclasses.fields(t))
    if names is None:
        raise _NotKeyable(t)
    # a frozen dataclass (QWeight, NormedX, ...): by its fields, made once per instance and kept on it
    # (its fields cannot be rebound, and an array's pointer, shape, strides and dtype never change);
    # an instance holding a list is keyed afresh each time, since the list may change
    kept = getattr(v, "__dict__", None)  # None for a slotted dataclass: keyed afresh each time
    key = kept.get(_KEY_ATTR) if kept is not None else None
    if key is None:
        fields = [getattr(v, n) for n in names]
        key = (t, *map(_arg_key, fields))
        if kept is not None and not any(type(f) is list for f in fields):
            kept[_KEY_ATTR] = key
    return key


_FROZEN: dict = {}  # frozen dataclass type -> its field names
_KEY_ATTR = "_repeat_key"  # where a frozen dataclass instance keeps its key


class _Replay:
    """The launches one call made (detached; each one's driver arguments prepared on first replay) and
    where its return value was among the arguments."""

    __slots__ = ("launches", "prepared", "ret")

    def __init__(self, launches: list, ret):
        self.launches = tuple(launches)
        self.prepared: list = [None] * len(self.launches)  # dispatch._PreparedLaunch per launch
        self.ret = ret

    def issue(self, stream) -> None:
        d = _dispatch or _dispatch_module()
        dispatch = d.Dispatch
        if d._nvtx_on or d._launch_timer is not None:  # profiled: ranges and events kept
            for launch in self.launches:
                dispatch.relaunch(launch, stream)
            return
        for i in range(len(self.launches)):
            dispatch._replay(self, i, stream)


class _Field(tuple):
    """Where a result is a field of a frozen dataclass argument: (argument's index or keyword, field name)."""


def _find(result, args: tuple, kwargs: dict):
    """Where ``result`` is among the arguments (by identity), or among the fields of a frozen dataclass
    argument (a plan's buffers): an index, a keyword, a _Field, a tuple of those for a tuple result,
    None for None; raises _NotKeyable when it is none of them."""
    if result is None:
        return None
    if type(result) is tuple:
        return tuple(_find(r, args, kwargs) for r in result)
    places = (*enumerate(args), *kwargs.items())
    for where, a in places:
        if a is result:
            return where
    for where, a in places:
        for name in _FROZEN.get(type(a), ()):
            if getattr(a, name) is result:
                return _Field((where, name))
    raise _NotKeyable(type(result))


def _pick(where, args: tuple, kwargs: dict):
    if where is None:
        return None
    t = type(where)
    if t is _Field:
        return getattr(_pick(where[0], args, kwargs), where[1])
    if t is tuple:
        return tuple(_pick(w, args, kwargs) for w in where)
    return args[where] if t is int else kwargs[where]


def repeatable(method):
    """Mark a dispatch method whose checks and launches depend on nothing but its arguments and the
    dispatch's settings (``Dispatch._repeat_state``: its ``pdl``; no other host state, no allocation
    the launches keep pointing to after the call): a call whose arguments equal an earlier
    successful call's (:func:`_arg_key`) issues that call's launches again on the given stream and
    returns the same argument. Arguments of other types make the call go through in full. On a method
    wrapped by ``interop.tensors`` the cache goes between its two layers (``interop.wrap_inside``): it
    sees the launch stream and the outputs the outer layer chose and keys torch tensors themselves."""
    if hasattr(method, "__cukern_tensors__"):
        return wrap_inside(method, repeatable)

    name = method.__name__

    @functools.wraps(method)
    def call(self, *args, **kwargs):
        stream = kwargs.pop("stream", None)
        try:  # keywords in the caller's order: another order is another key (a miss, never a wrong hit)
            key = [name, self._repeat_state()]  # a list appended to: the cheapest build of an eager call's key
            for a in args:
                key.append(_arg_key(a))
            for k, v in kwargs.items():
                key.append((k, _arg_key(v)))
            key = tuple(key)
        except _NotKeyable:
            return method(self, *args, stream=stream, **kwargs)
        cache = self.__dict__.get("_repeats")
        if cache is None:
            cache = self._repeats = {}
        outer = getattr(recording, "launches", None)
        rec = cache.get(key)
        if rec is not None:
            rec.issue(resolve_stream(stream))
            if outer is not None:
                outer.extend(rec.launches)
            return _pick(rec.ret, args, kwargs)
        recording.launches = launches = []
        try:
            result = method(self, *args, stream=stream, **kwargs)
        finally:
            recording.launches = outer
        if outer is not None:
            outer.extend(launches)
        try:
            replay = _Replay(launches, _find(result, args, kwargs))
            (_dispatch or _dispatch_module()).bounded_put(cache, key, replay, _REPEAT_LIMIT)
        except _NotKeyable:
            pass
        return result

    return call
