"""Separate hosts on one machine: network namespaces joined by a bridge, each link capped.

Each peer gets a namespace ``shoalb<i>`` with one veth link to the bridge ``shoalbr0``, address
``10.213.0.<i+1>/24``, and a ``tc ... tbf`` token bucket on both ends of its link (upload and
download capped at the same rate). netem is not available here, so there is no added latency.
Everything is removed on exit, also after an error. Needs root; ``available()`` says.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import dataclass

BRIDGE = "shoalbr0"
PREFIX = "shoalb"
SUBNET = "10.213.0"


def available() -> bool:
    return os.geteuid() == 0 and shutil.which("ip") is not None and shutil.which("tc") is not None


def _ip(*args: str, check: bool = True) -> None:
    subprocess.run(["ip", *args], check=check, capture_output=True)


@dataclass
class Host:
    name: str
    address: str

    def prefix(self) -> list[str]:
        """Run a command inside this host's namespace."""
        return ["ip", "netns", "exec", self.name]


class Network:
    """``with Network(4, mbit=10) as net: net.hosts[i].address ...``"""

    def __init__(self, count: int, *, mbit: float):
        self.count, self.mbit = count, mbit
        self.hosts = [Host(f"{PREFIX}{i}", f"{SUBNET}.{i + 1}") for i in range(count)]

    def __enter__(self) -> Network:
        self.teardown()  # leftovers of an interrupted run
        try:
            _ip("link", "add", BRIDGE, "type", "bridge")
            _ip("link", "set", BRIDGE, "up")
            for i, host in enumerate(self.hosts):
                outside, inside = f"{PREFIX}v{i}", f"{PREFIX}p{i}"
                _ip("netns", "add", host.name)
                _ip("link", "add", outside, "type", "veth", "peer", "name", inside)
                _ip("link", "set", inside, "netns", host.name)
                _ip("link", "set", outside, "master", BRIDGE)
                _ip("link", "set", outside, "up")
                _ip("netns", "exec", host.name, "ip", "addr", "add", f"{host.address}/24", "dev", inside)
                _ip("netns", "exec", host.name, "ip", "link", "set", inside, "up")
                _ip("netns", "exec", host.name, "ip", "link", "set", "lo", "up")
                tbf = ["tbf", "rate", f"{self.mbit}mbit", "burst", "64kb", "latency", "200ms"]
                subprocess.run(["tc", "qdisc", "add", "dev", outside, "root", *tbf], check=True, capture_output=True)
                subprocess.run(["ip", "netns", "exec", host.name, "tc", "qdisc", "add", "dev", inside, "root", *tbf],
                               check=True, capture_output=True)
        except BaseException:
            self.teardown()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.teardown()

    def teardown(self) -> None:
        for i in range(max(self.count, 8)):
            _ip("netns", "del", f"{PREFIX}{i}", check=False)
            _ip("link", "del", f"{PREFIX}v{i}", check=False)
        _ip("link", "del", BRIDGE, check=False)
