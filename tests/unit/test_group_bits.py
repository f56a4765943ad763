"""``HivemindBackend`` sets each round's group bits with a bounded wait. hivemind's own wait has no
timeout: with the averager process killed, the prepare lane hung for good and the node, which had
noticed the dead process, hung in its shutdown (found by ``benchmarks.swarm.faults``' averager
fault). Tested on a stand-in averager whose reply never comes."""

from __future__ import annotations

import time
from concurrent.futures import Future

import pytest

from averaging.math.robust import RobustConfig
from averaging.network.hivemind import backend as backend_module
from averaging.network.hivemind.averager import leader_group_cap
from averaging.network.hivemind.backend import HivemindBackend, round_bits


class SilentAverager:
    """Takes the command, never answers (a dead process's pipe, or a very busy one)."""

    def __init__(self, alive: bool):
        self.alive, self.bits = alive, []

    def set_group_bits(self, group_bits: str, wait: bool = True):
        assert not wait, "an unbounded wait on the averager's reply"
        self.bits.append(group_bits)
        return Future()

    def is_alive(self) -> bool:
        return self.alive


def backend_with(averager) -> HivemindBackend:
    backend = HivemindBackend.__new__(HivemindBackend)  # no DHT, no process: only what _set_group_bits uses
    backend._averager = averager
    return backend


def test_a_dead_averager_fails_the_prepare_instead_of_hanging_it(monkeypatch):
    monkeypatch.setattr(backend_module, "GROUP_BITS_WAIT_S", 0.2)
    averager = SilentAverager(alive=False)
    started = time.monotonic()
    with pytest.raises(RuntimeError, match="averager process is gone: round 7"):
        backend_with(averager)._set_group_bits(7, round_bits(7))
    assert time.monotonic() - started < 2.0
    assert averager.bits == [round_bits(7)]


def test_a_slow_live_averager_gets_its_step_queued_behind_the_bits(monkeypatch):
    monkeypatch.setattr(backend_module, "GROUP_BITS_WAIT_S", 0.2)
    averager = SilentAverager(alive=True)
    backend_with(averager)._set_group_bits(3, round_bits(3))  # no error: the step goes down the same pipe after the bits
    assert averager.bits == [round_bits(3)]


def test_a_confirmed_change_returns_at_once():
    class Answering(SilentAverager):
        def set_group_bits(self, group_bits: str, wait: bool = True):
            done = super().set_group_bits(group_bits, wait)
            done.set_result(None)
            return done

    started = time.monotonic()
    backend_with(Answering(alive=True))._set_group_bits(1, round_bits(1))
    assert time.monotonic() - started < 0.5


def test_a_leader_stops_at_the_robust_cap_when_no_target_size_is_set():
    # No target size: every member refuses a group over the cap, so the leader must stop there.
    assert leader_group_cap(None, RobustConfig()) == RobustConfig().max_group_size == 64
    assert leader_group_cap(16, RobustConfig()) == 16  # a target below the cap is the cap
    assert leader_group_cap(128, RobustConfig()) == 64  # a target above it would only be refused
    assert leader_group_cap(None, None) is None and leader_group_cap(8, None) == 8  # no robust rules: hivemind's
