"""What ``DiLoCoSwarm`` needs from the network, behind one seam.

A ``Network`` gives this peer an id and addresses, a ``RunDirectory`` for each run (manifests
and progress records) and builds its ``AveragingBackend`` (averaging's own seam,
``averaging.network.interface``: the all-reduce and state download) from the run's config, and
knows which processes to clean up. ``HivemindNetwork`` is the real one (hivemind's DHT and butterfly
all-reduce, forked processes); ``node.library.local_network.LocalNetwork`` runs peers as threads
of one process, so the library and ``shoal run``'s process are tested in milliseconds (integration
tests always use the real one).
"""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

import psutil
from hivemind import DHT

from averaging.math.wire import EXTRA_CODE
from averaging.network.hivemind.backend import HivemindBackend
from averaging.network.interface import AveragingBackend, StateProvider, UpdateProvider
from node.library.config import AveragingConfig
from node.library.dht import Reachability, RecordRules, start_dht, stop_dht
from node.library.run_record import DhtDirectory, RunDirectory
from protocols.admission import admission_key
from protocols.keys import averager_prefix


class Network(Protocol):
    peer_id: str
    maddrs: list[str]

    def directory(self, run_id: str) -> RunDirectory: ...

    def backend(self, *, run_id: str, numel: int, state_provider: StateProvider, averaging: AveragingConfig,
                client_mode: bool, update_provider: UpdateProvider | None = None,
                share_state: bool = True, extra_numel: int = 0, extra_code: str = EXTRA_CODE) -> AveragingBackend:
        """The averaging backend (created once, before our own threads start); ``extra_numel``: a
        second vector averaged with every round, in ``extra_code`` (the inner optimizer's moments;
        with sub-groups the anchor and momentum before them: ``averaging.engine.subgroups``)."""

    def pids(self) -> list[int | None]:
        """Processes this network started (and whose descendants must not outlive us)."""

    def dead(self) -> str | None:
        """Which of this network's processes has died (one phrase), or None while all run."""

    def close(self) -> None: ...


class HivemindNetwork:
    """hivemind's DHT (a forked process with its p2pd) and, once asked for, the averager process."""

    def __init__(self, dht: DHT, *, swarm_key: bytes | None = None):
        self.dht = dht
        self.swarm_key = swarm_key  # a private swarm: the averager admits only peers proving it
        self.peer_id = str(dht.peer_id)
        self.maddrs = [str(m) for m in dht.get_visible_maddrs()]
        self._backend: HivemindBackend | None = None
        self._p2pd: int | None = None

    @classmethod
    def start(cls, *, initial_peers: list[str], listen: list[str], announce: list[str], timeout: float,
              identity: Path | None, reachability: Reachability, rules: RecordRules = RecordRules()) -> HivemindNetwork:
        """Start our DHT node (``NetworkError`` if no initial peer answers within ``timeout``)."""
        return cls(start_dht(initial_peers=initial_peers, listen=listen, announce=announce, timeout=timeout,
                             identity=identity, reachability=reachability, rules=rules), swarm_key=rules.swarm_key)

    def directory(self, run_id: str) -> RunDirectory:
        return DhtDirectory(self.dht, run_id, owner=self.dht.shoal_key.public)

    def backend(self, *, run_id: str, numel: int, state_provider: StateProvider, averaging: AveragingConfig,
                client_mode: bool, update_provider: UpdateProvider | None = None,
                share_state: bool = True, extra_numel: int = 0, extra_code: str = EXTRA_CODE) -> AveragingBackend:
        avg = averaging
        self._backend = HivemindBackend(
            self.dht, numel=numel, prefix=averager_prefix(run_id), state_provider=state_provider,
            update_provider=update_provider,
            # No cap below the hard one: with sub-groups each group meets under its own key, and
            # a member's view of the live records may put it in a larger one (averaging.math.groups).
            wire=avg.wire, target_group_size=None,
            min_group_size=avg.min_group_size, min_matchmaking_time=avg.matchmaking_seconds,
            request_timeout=avg.request_timeout, allreduce_timeout=avg.allreduce_timeout, client_mode=client_mode,
            robust=avg.robust, admission=admission_key(self.swarm_key) if self.swarm_key is not None else None,
            signer=self.dht.shoal_key, share_state=share_state, extra_numel=extra_numel, extra_code=extra_code,
            mixing=bool(avg.target_group_size),  # sub-groups: the extra vector leads with the anchors
        )
        return self._backend

    def pids(self) -> list[int | None]:
        return [self.dht.pid, self._backend.pid if self._backend is not None else None]

    def processes(self) -> dict[str, int]:
        """Our processes by role: the DHT node, the averager, and the p2pd daemon both of them talk
        through (a child of the DHT's process), for the ``start`` record and ``dead``."""
        found = {"dht": self.dht.pid}
        if self._backend is not None and self._backend.pid is not None:
            found["averager"] = self._backend.pid
        if self._p2pd is None:
            self._p2pd = _p2pd_of(self.dht.pid)
        if self._p2pd is not None:
            found["p2pd"] = self._p2pd
        return found

    def dead(self) -> str | None:
        """A process of ours that is gone. The DHT and the averager are our children: ``is_alive``
        reaps and asks the kernel. p2pd is the DHT's child: a pid that is gone or a zombie."""
        if not self.dht.is_alive():
            return f"DHT process (pid {self.dht.pid}) exited with {_exit(self.dht.exitcode)}"
        if self._backend is not None and not self._backend.alive:
            return f"averager process (pid {self._backend.pid}) exited with {_exit(self._backend.exitcode)}"
        p2pd = self.processes().get("p2pd")
        if p2pd is not None and not _running(p2pd):
            return f"p2pd daemon (pid {p2pd}) exited"
        return None

    def close(self) -> None:
        stop_dht(self.dht)


def _p2pd_of(dht_pid: int | None) -> int | None:
    """The p2pd daemon the DHT process started (hivemind runs one per DHT; the averager reuses it)."""
    try:
        children = psutil.Process(dht_pid).children()
    except (psutil.Error, ValueError, TypeError):
        return None
    return next((c.pid for c in children if "p2pd" in _name(c)), None)


def _name(process: psutil.Process) -> str:
    try:
        return process.name()
    except psutil.Error:
        return ""


def _running(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _exit(code: int | None) -> str:
    return f"signal {-code}" if code is not None and code < 0 else f"code {code}"
