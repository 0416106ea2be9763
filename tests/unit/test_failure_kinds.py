"""docs/operations.md's failure table and FailureKind name the same kinds; kinds read as their values."""

import re
from pathlib import Path

import msgspec

from kvstage.transfer.protocol.kinds import REMOTE_PREFIX, FailureKind, remote_kind
from kvstage.transfer.protocol.messages import RoomFailed

DOC = Path(__file__).resolve().parents[2] / "docs" / "operations.md"


def documented_kinds() -> list[str]:
    text = DOC.read_text()
    table = text.split("## Failure kinds", 1)[1].split("\n## ", 1)[0]
    return [m.group(1) for m in re.finditer(r"^\| `([^`]+)` \|", table, re.M)]


def test_every_failure_kind_is_documented_and_nothing_else():
    rows = documented_kinds()
    assert len(rows) == len(set(rows)), rows
    assert f"{REMOTE_PREFIX}<kind>" in rows   # one row for every kind a peer reports
    assert set(rows) - {f"{REMOTE_PREFIX}<kind>"} == {k.value for k in FailureKind}


def test_a_kind_is_its_value_in_text_keys_and_on_the_wire():
    k = FailureKind.PEER_LOST
    assert f"{k}" == str(k) == "%s" % k == "peer_lost" and {k: 1}["peer_lost"] == 1
    plain = RoomFailed(src=1, dst=2, room=3, session=4, kind="peer_lost", reason="r")
    assert msgspec.msgpack.encode(msgspec.structs.replace(plain, kind=k)) == msgspec.msgpack.encode(plain)


def test_remote_kind_prefixes_once():
    assert remote_kind(FailureKind.ABORTED) == "remote_aborted"
    assert remote_kind("remote_aborted") == "remote_aborted"
    assert remote_kind("a_kind_of_a_newer_peer") == "remote_a_kind_of_a_newer_peer"
