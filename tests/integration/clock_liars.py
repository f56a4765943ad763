"""Strangers who lie about the time (issue 54, item 1), for a test swarm: ``COUNT`` DHT nodes, each a
shoal DHT node (``node.library.dht.start_dht``) with an identity of its own, that publish a valid,
signed progress record under the run's key every few seconds and answer every DHT ping with the true
time + ``LIE`` seconds. They never average (their records say client mode, so nobody asks them for
the state either). Measured against every record (as before the fix), an honest peer among fewer
honest others moved its clock by ``LIE``.

    python -m tests.integration.clock_liars RUN_ID INITIAL_PEER COUNT LIE

Prints ``liars ready`` once every record is out, then runs until killed (SIGTERM).
"""

from __future__ import annotations

import functools
import signal
import sys
import threading

from hivemind.dht.protocol import DHTProtocol

from node.library.dht import RecordRules, start_dht
from node.library.run_record import DhtDirectory
from protocols import swarm_time
from protocols.progress import ProgressRecord

PERIOD_S = 3.0


def lie_in_pings(seconds: float) -> None:
    """Every ping this process's DHT nodes answer (forked after this) says true time + ``seconds``."""
    honest = DHTProtocol.rpc_ping

    @functools.wraps(honest)  # hivemind registers a handler by its annotations
    async def rpc_ping(self, request, context):
        response = await honest(self, request, context)
        if response.dht_time:
            response.dht_time += seconds
        return response

    DHTProtocol.rpc_ping = rpc_ping


def main(run_id: str, initial_peer: str, count: int, lie: float) -> None:
    lie_in_pings(lie)
    nodes = [start_dht(initial_peers=[initial_peer], listen=["/ip4/127.0.0.1/tcp/0"], announce=[], timeout=60,
                       rules=RecordRules(run_ids=(run_id,))) for _ in range(count)]
    directories = [DhtDirectory(dht, run_id, owner=dht.shoal_key.public) for dht in nodes]
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    first = True
    while not stop.is_set():
        for dht, directory in zip(nodes, directories, strict=True):
            record = ProgressRecord(peer_id=str(dht.peer_id), round=1, tokens_per_s=100.0, loss=None, eval_loss=None,
                                    device="cpu", utilization=0.5, bytes_sent=0, bytes_received=0, mode="client",
                                    version="0.1.0", tokens=0, time=swarm_time.now(), phase="training")
            directory.publish_progress(record, ttl=3 * PERIOD_S)
        if first:
            print("liars ready", " ".join(str(dht.peer_id) for dht in nodes), flush=True)
            first = False
        stop.wait(PERIOD_S)
    for dht in nodes:
        dht.shutdown()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), float(sys.argv[4]))
