"""Starting Mooncake's TransferEngine (transfer/backends/mooncake_backend.py, start_engine): a
port taken between Mooncake's pick and its bind is a lost race, tried again with a new engine
up to BIND_ATTEMPTS times; any other failure is reported at once. (CI saw the race once: a
rank process failed with "bind: Address already in use" while others were starting.)"""

from __future__ import annotations

import pytest

from kvstage.transfer.backends.base import BackendError
from kvstage.transfer.backends.mooncake_backend import start_engine

TAKEN = RuntimeError("bind: Address already in use")


class Engines:
    """Engines whose initialize() answers from `answers` in turn (an exception is raised)."""

    def __init__(self, *answers: object):
        self.answers, self.made = list(answers), 0

    def __call__(self):
        self.made += 1
        answer = self.answers.pop(0)

        class Engine:
            def initialize(self, host, handshake, protocol, device):
                assert (host, handshake, protocol) == ("127.0.0.1", "P2PHANDSHAKE", "tcp")
                if isinstance(answer, BaseException):
                    raise answer
                return answer
        return Engine()


def test_a_lost_port_race_starts_a_new_engine():
    make = Engines(TAKEN, TAKEN, 0)
    engine = start_engine(make, "127.0.0.1", "tcp", "", attempts=5)
    assert make.made == 3 and engine is not None


def test_the_last_lost_race_is_reported_with_mooncakes_words():
    make = Engines(TAKEN, TAKEN, TAKEN)
    with pytest.raises(BackendError, match="attempt 3 of 3.*Address already in use"):
        start_engine(make, "127.0.0.1", "tcp", "", attempts=3)
    assert make.made == 3


@pytest.mark.parametrize("answer", [RuntimeError("no such device"), -1])
def test_any_other_failure_is_reported_at_once(answer):
    make = Engines(answer, 0)
    with pytest.raises(BackendError):
        start_engine(make, "127.0.0.1", "tcp", "")
    assert make.made == 1
