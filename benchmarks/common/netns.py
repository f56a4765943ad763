"""Separate hosts on one machine: network namespaces joined by a bridge, each link capped.

Each peer gets a namespace ``shoalb<i>`` with one veth link to the bridge ``shoalbr0``, address
``10.213.0.<i+1>/24``, and a ``tc ... tbf`` token bucket on both ends of its link (upload and
download capped at the same rate). netem is not available here, so there is no added latency.
Everything is removed on exit, also after an error. Needs root; ``available()`` says.
``split`` cuts some hosts off the others (their links moved to a second bridge, ``<bridge>x``,
where they still reach each other) and ``heal`` joins them again: an outage between two halves.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import threading
import time
from dataclasses import dataclass
from pathlib import Path

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

    def split(self, indices: list[int]) -> None:
        """Move these hosts' links to the second bridge: they reach each other, not the rest."""
        other = f"{BRIDGE}x"
        _ip("link", "add", other, "type", "bridge", check=False)  # exists after an earlier split
        _ip("link", "set", other, "up")
        for i in indices:
            _ip("link", "set", f"{PREFIX}v{i}", "master", other)

    def heal(self) -> None:
        """Every host's link back on the first bridge."""
        for i in range(self.count):
            _ip("link", "set", f"{PREFIX}v{i}", "master", BRIDGE)

    def teardown(self) -> None:
        for i in range(max(self.count, 8)):
            _ip("netns", "del", f"{PREFIX}{i}", check=False)
            _ip("link", "del", f"{PREFIX}v{i}", check=False)
        _ip("link", "del", BRIDGE, check=False)
        _ip("link", "del", f"{BRIDGE}x", check=False)


_SENT = re.compile(r"Sent (\d+) bytes \d+ pkt \(dropped (\d+)")


def _qdisc_sent(command: list[str]) -> tuple[int, int]:
    """(bytes sent, packets dropped) of the tbf on one end of a link, from ``tc -s qdisc show``."""
    out = subprocess.run(command, capture_output=True, text=True).stdout
    match = _SENT.search(out)
    return (int(match[1]), int(match[2])) if match else (0, 0)


class LinkTimeline:
    """Bytes through every link, sampled every ``period`` seconds over a ``with`` block:
    whether the links were full during given windows (an all-reduce slower than its bound on idle
    CPU either leaves its links idle at times, or fills them with more than its payload)."""

    def __init__(self, net: Network, period: float = 0.1):
        self.net, self.period = net, period
        # (time.time(), [(upload bytes, download bytes) per host])
        self.samples: list[tuple[float, list[tuple[int, int]]]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _sample(self) -> list[tuple[int, int]]:
        """Bytes from the root namespace's sysfs, no subprocess (sampling must not cost the CPU it
        measures): what the host's end sent arrives at the bridge's end (its upload), and what the
        bridge's end sends is its download. Drops are read with ``tc`` at the ends only (``drops``)."""
        counts = []
        for i in range(len(self.net.hosts)):
            stats = Path(f"/sys/class/net/{PREFIX}v{i}/statistics")
            counts.append((int((stats / "rx_bytes").read_text()), int((stats / "tx_bytes").read_text())))
        return counts

    def drops(self) -> tuple[int, int]:
        """Packets dropped at the caps so far, (uploads, downloads) over all links."""
        up = sum(_qdisc_sent([*host.prefix(), "tc", "-s", "qdisc", "show", "dev", f"{PREFIX}p{i}"])[1]
                 for i, host in enumerate(self.net.hosts))
        down = sum(_qdisc_sent(["tc", "-s", "qdisc", "show", "dev", f"{PREFIX}v{i}"])[1]
                   for i in range(len(self.net.hosts)))
        return up, down

    def rates(self, start: float, end: float) -> list[tuple[float, list[float]]]:
        """Upload use (fraction of the cap) per host between consecutive samples in [start, end],
        as (seconds since start, [use per host]): where an all-reduce left its links idle."""
        inside = [s for s in self.samples if start <= s[0] <= end]
        cap = self.net.mbit * 1e6 / 8
        return [(round(t1 - start, 2), [round((b[0] - a[0]) / cap / (t1 - t0), 2) for a, b in zip(c0, c1)])
                for (t0, c0), (t1, c1) in zip(inside, inside[1:])]

    def between(self, start: float, end: float) -> dict | None:
        """Link use between the samples nearest inside [start, end]: mean fraction of the cap used
        per direction (over all links) and bytes moved; None with fewer than two samples."""
        inside = [s for s in self.samples if start <= s[0] <= end]
        if len(inside) < 2 or inside[-1][0] <= inside[0][0]:
            return None
        (t0, first), (t1, last) = inside[0], inside[-1]
        capacity = self.net.mbit * 1e6 / 8 * (t1 - t0) * len(first)
        up, down = (sum(b[k] - a[k] for a, b in zip(first, last)) for k in range(2))
        return {"upload_use": up / capacity, "download_use": down / capacity, "upload_bytes": up, "download_bytes": down}

    def _run(self) -> None:
        while True:
            self.samples.append((time.time(), self._sample()))
            if self._stop.wait(self.period):
                return

    def __enter__(self) -> LinkTimeline:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


# A plain TCP all-to-all: what the kernel's TCP alone achieves moving an all-reduce's bytes over
# these links (one flow per ordered pair of hosts, all at once, as a butterfly all-reduce's streams).
_DRAIN = """
import socket, threading
server = socket.socket()
server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
server.bind(("0.0.0.0", {port}))
server.listen(16)
def drain(conn):
    while conn.recv(1 << 20):
        pass
    conn.close()
while True:
    threading.Thread(target=drain, args=(server.accept()[0],), daemon=True).start()
"""
_SEND = """
import socket, sys, time
address, size, start = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
conn = socket.create_connection((address, {port}))
time.sleep(max(0.0, start - time.time()))
block = bytes(1 << 16)
for offset in range(0, size, len(block)):
    conn.sendall(block[:min(len(block), size - offset)])
conn.shutdown(socket.SHUT_WR)
conn.recv(1)  # the receiver's close: everything arrived
print(time.time())
"""
TCP_PORT = 5291


def tcp_all_to_all(net: Network, bytes_per_flow: int, python: str) -> float:
    """Seconds until the last of the flows (every host to every other, ``bytes_per_flow`` each,
    started at once) has been received."""
    drains = [subprocess.Popen([*host.prefix(), python, "-c", _DRAIN.format(port=TCP_PORT)]) for host in net.hosts]
    try:
        time.sleep(1.0)
        start = time.time() + 1.5  # every sender connected
        senders = [subprocess.Popen([*a.prefix(), python, "-c", _SEND.format(port=TCP_PORT), b.address,
                                     str(bytes_per_flow), str(start)], stdout=subprocess.PIPE, text=True)
                   for a in net.hosts for b in net.hosts if a is not b]
        ends = [float(sender.communicate(timeout=600)[0]) for sender in senders]
        return max(ends) - start
    finally:
        for drain in drains:
            drain.kill()
            drain.wait()
