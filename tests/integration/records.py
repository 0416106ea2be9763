"""What a room record from examples/pd_rank.py must say to count as a clean success.

pd_rank records `verified` per room and per side: a decode rank checks every byte of a room
that succeeded against the pattern (True, or False with an "error"); a prefill rank has nothing
to check and always records None. So "bit-exact" is `verified is True` on a decode record, never
`is not False` (which a record that skipped the check would pass too).
"""

from __future__ import annotations


def exact(role: str, rec: dict) -> bool:
    """`rec` (a room of a rank whose role is `role`) succeeded, and its side's verification
    says so: every byte checked on a decode rank, no verification at all on a prefill rank."""
    if rec["state"] != "Success":
        return False
    if role == "decode":
        return rec["verified"] is True
    if role == "prefill":
        return rec["verified"] is None
    raise ValueError(f"unknown role {role!r}")


def assert_exact(role: str, rec: dict) -> None:
    assert exact(role, rec), (role, rec)


def assert_all_exact(results: list[dict], rooms: int | None = None) -> None:
    """Every room of every rank result (pd_rank's per-manager dicts, with their "role") is a
    clean success; with `rooms`, each rank recorded exactly that many (none missing)."""
    assert results, "no rank results"
    for res in results:
        assert not res.get("error"), f"{res['name']}: {res['error']}\n{res.get('traceback')}"
        if rooms is not None:
            assert len(res["rooms"]) == rooms, (res["name"], len(res["rooms"]), rooms)
        for rec in res["rooms"]:
            assert_exact(res["role"], rec)
