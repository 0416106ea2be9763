"""Narrow parts (issue 50 item 4; transfer/engine/interfaces.py): the shared interface of the
role's side holds only what both roles do, each role has its own hooks and none of the other
role's (no hook that raises or does nothing because it belongs to the other role), and no part
of the engine takes the whole EngineContext: only the loop builds it and takes it apart."""

import ast
import importlib
import inspect
import pkgutil
from pathlib import Path

import pytest

import kvstage.transfer.engine as engine
from kvstage.transfer.engine.decode_side import DecodeSide
from kvstage.transfer.engine.interfaces import (
    DecodeRoomHooks,
    HeartbeatSink,
    HelloSink,
    PeerLossListener,
    PrefillRoomHooks,
    RoleSide,
    RoomHooks,
    TagSink,
)
from kvstage.transfer.engine.prefill_side import PrefillSide
from kvstage.transfer.engine.rooms import DecodeBook, PrefillBook
from kvstage.transfer.engine.stats import Stats
from kvstage.transfer.protocol.actions import PublishWatermark, SettleCredits

# each role's own interfaces, besides the shared RoleSide
OWN = {PrefillSide: (PrefillRoomHooks, HelloSink, HeartbeatSink), DecodeSide: (DecodeRoomHooks, TagSink)}
INSTANCE_ATTRS = {"handlers", "events"}   # set in the constructors


def _members(proto) -> set[str]:
    names = set()
    for cls in proto.__mro__:
        if cls is object or not getattr(cls, "_is_protocol", False) or cls.__name__ in ("Protocol", "Generic"):
            continue
        names |= {n for n in vars(cls) if not n.startswith("_")}
    return names


SHARED = _members(RoleSide)


def _own(side) -> set[str]:
    return set().union(*(_members(p) for p in OWN[side])) - SHARED


def test_both_sides_have_every_member_of_the_shared_role_side():
    assert _members(RoomHooks) | _members(PeerLossListener) <= SHARED
    assert {"handlers", "events", "tick", "closing", "stuck_rooms", "released"} <= SHARED
    for side in OWN:
        missing = {m for m in SHARED - INSTANCE_ATTRS if not hasattr(side, m)}
        assert not missing, (side.__name__, missing)


@pytest.mark.parametrize("side", list(OWN), ids=lambda s: s.__name__)
def test_each_side_has_its_own_hooks_and_none_of_the_other_roles(side):
    other = next(s for s in OWN if s is not side)
    assert _own(side), side.__name__
    assert not (_own(side) & _own(other))
    missing = {m for m in _own(side) if not hasattr(side, m)}
    assert not missing, (side.__name__, missing)
    foreign = {m for m in _own(other) if hasattr(side, m)}
    assert not foreign, f"{side.__name__} implements the other role's {sorted(foreign)}"


def _methods(cls) -> list[ast.FunctionDef]:
    tree = ast.parse(Path(inspect.getfile(cls)).read_text())
    node = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls.__name__)
    return [f for f in node.body if isinstance(f, ast.FunctionDef)]


@pytest.mark.parametrize("side", list(OWN), ids=lambda s: s.__name__)
def test_no_method_of_a_side_only_raises_or_does_nothing(side):
    """What a role does not do is not a method of its side (a hook of the other role's)."""
    for f in _methods(side):
        body = [s for s in f.body if not (isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant))]
        assert body, f"{side.__name__}.{f.name} has no body"
        only = body[0] if len(body) == 1 else None
        assert not isinstance(only, ast.Raise | ast.Pass), f"{side.__name__}.{f.name} only raises or passes"


# assembly helpers that read the whole context: called by the loop only, never kept by a part
ASSEMBLY = {("decode_planning", "decode_hello")}


def test_no_part_of_the_engine_takes_the_whole_engine_context():
    takers = set()
    for mod in pkgutil.iter_modules(engine.__path__):
        if mod.name in ("context", "loop"):   # the bag, and the one that builds it and takes it apart
            continue
        module = importlib.import_module(f"{engine.__name__}.{mod.name}")
        for name, obj in vars(module).items():
            if getattr(obj, "__module__", None) != module.__name__:
                continue
            funcs = [(name, obj)] if inspect.isfunction(obj) else (
                [(f"{name}.{n}", f) for n, f in vars(obj).items() if inspect.isfunction(f)] if inspect.isclass(obj)
                else [])
            for qual, f in funcs:
                if any("EngineContext" in str(p.annotation) for p in inspect.signature(f).parameters.values()):
                    takers.add((mod.name, qual))
    assert takers == ASSEMBLY


class Recorder:
    """Every hook call, by name."""

    def __init__(self):
        self.calls = []

    def __getattr__(self, name):
        return lambda *args: self.calls.append(name)


def test_each_book_carries_out_its_own_roles_actions_and_refuses_the_others():
    """Each book's `match` covers its role's union (protocol/actions.py): the other role's action
    is a type error (mypy, `make lint`), and should one come anyway, assert_never refuses it at
    run time with nothing carried out."""
    hooks = Recorder()
    prefill = PrefillBook(outbox=None, stats=Stats(), observer=None, hooks=lambda: hooks, writes=lambda: None)
    decode = DecodeBook(outbox=None, stats=Stats(), observer=None, hooks=lambda: hooks)
    settle, publish = SettleCredits(peer=None), PublishWatermark()
    prefill.apply(None, [settle])
    decode.apply(None, [publish])
    assert hooks.calls == ["settle_credits", "publish_watermark"]
    with pytest.raises(AssertionError, match="PublishWatermark"):
        prefill.apply(None, [publish])
    with pytest.raises(AssertionError, match="SettleCredits"):
        decode.apply(None, [settle])
    assert hooks.calls == ["settle_credits", "publish_watermark"]
