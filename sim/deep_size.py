"""How many bytes an object graph holds of its own: sys.getsizeof summed over everything
reachable, less what it shares with others.

Used to tell the memory a room holds while in flight. Objects reached through `shared` (the
layout, the timeouts, the peer keys: one per rank or per engine, not per room) and classes,
modules, functions and enum members (one object per member in the whole process, such as a
flow's FlowState: each was counted per room before, about 540 bytes) are not counted. numpy
arrays count their buffer (getsizeof does, for arrays owning their data; a view counts its
base once).

An instance of a plain class (no __slots__) keeps its attributes in a dictionary that CPython
makes only when asked for; until then the values live in an array getsizeof does not count.
deep_size asks for it (`obj.__dict__`), so the values count, plus the dictionary's header: a
few dozen bytes more than the object really holds, never less. That makes the dictionary."""

from __future__ import annotations

import enum
import gc
import sys
import types
from collections.abc import Iterable

_SKIP = (type, types.ModuleType, types.FunctionType, types.BuiltinFunctionType, types.MethodType,
         types.CodeType, types.FrameType, enum.Enum)


def shared_ids(roots: Iterable[object]) -> set[int]:
    """Ids of every object reachable from `roots`: what deep_size must not count."""
    seen: set[int] = set()
    stack = list(roots)
    while stack:
        obj = stack.pop()
        if id(obj) in seen or isinstance(obj, _SKIP):
            continue
        seen.add(id(obj))
        stack.extend(gc.get_referents(obj))
    return seen


def deep_size(root: object, exclude: set[int] = frozenset()) -> int:   # type: ignore[assignment]
    """Bytes of `root` and of everything it reaches that is not in `exclude`."""
    seen: set[int] = set()
    total = 0
    stack = [root]
    while stack:
        obj = stack.pop()
        i = id(obj)
        if i in seen or i in exclude or isinstance(obj, _SKIP) or obj is None or obj is True or obj is False:
            continue
        seen.add(i)
        total += sys.getsizeof(obj)
        if getattr(type(obj), "__dictoffset__", 0):
            getattr(obj, "__dict__", None)   # made now, so get_referents reaches it
        stack.extend(gc.get_referents(obj))
    return total
