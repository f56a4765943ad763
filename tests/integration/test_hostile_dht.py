"""A stranger's malformed message costs a DHT node that message, never the process, and a stranger
cannot rewrite the run's records in the DHT (issue: hostile swarm). Real processes on loopback: one
``shoal bootstrap`` entry peer for this module (each start and Ctrl+C of one costs seconds of CI
time), attackers running plain hivemind (test-only code below), an organiser and two joiners."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from node.observe.metrics import read_metrics
from tests.integration.conftest import start_bootstrap, stop_bootstrap
from tests.integration.swarm import REPO, wait_until

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def entry_peer(tmp_path_factory):
    """The module's ``shoal bootstrap`` (the conftest's ``bootstrap``, shared: the bomb leaves it as it
    was, and the records below live under a run id of their own). Yields (process, address file, log)."""
    root = tmp_path_factory.mktemp("entry")
    address_file = root / "bootstrap.maddr"
    proc = start_bootstrap(root, address_file)
    try:
        wait_until(address_file.exists, 90, "the bootstrap peer wrote its address")
        yield proc, address_file, root / "bootstrap.log"
    finally:
        stop_bootstrap(proc)


# A plain hivemind peer whose own serializer writes a 300-deep nest of msgpack tuples (1.4 KB) as the
# subkey of a store: an unprotected hivemind DHT node dies with SIGSEGV decoding it. Then a fresh
# client checks the target still answers.
BOMB_ATTACKER = """
import sys, msgpack
from hivemind import DHT
from hivemind.utils import get_dht_time
from hivemind.utils.serializer import MSGPackSerializer

payload = msgpack.packb([])
for _ in range(300):
    payload = msgpack.packb([msgpack.ExtType(0x40, payload)])
BOMB = msgpack.packb(msgpack.ExtType(0x40, payload))
honest_dumps = MSGPackSerializer.dumps
MSGPackSerializer.dumps = classmethod(lambda cls, obj: BOMB if obj == "BOMB" else honest_dumps(obj))

target = sys.argv[1]
attacker = DHT(initial_peers=[target], host_maddrs=["/ip4/127.0.0.1/tcp/0"], start=True)
for attempt in range(3):
    attacker.store("victim-key", subkey="BOMB", value=1, expiration_time=get_dht_time() + 60)
print("sent", flush=True)
attacker.shutdown()
MSGPackSerializer.dumps = honest_dumps
check = DHT(initial_peers=[target], host_maddrs=["/ip4/127.0.0.1/tcp/0"], start=True)
check.store("after-the-attack", value=42, expiration_time=get_dht_time() + 60)
found = check.get("after-the-attack", latest=True)
print("answered", found is not None and found.value == 42, flush=True)
check.shutdown()
"""


@pytest.mark.timeout(240)
def test_a_msgpack_bomb_does_not_kill_a_dht_node(entry_peer):
    victim, address_file, log = entry_peer
    target = address_file.read_text().split()[0]
    attacker = subprocess.run([sys.executable, "-c", BOMB_ATTACKER, target], cwd=REPO, capture_output=True,
                              text=True, timeout=150, start_new_session=True)
    assert "sent" in attacker.stdout, attacker.stderr[-3000:]
    time.sleep(1.0)
    log_text = log.read_text(errors="replace")
    assert victim.poll() is None, f"the DHT node died (exit {victim.returncode}):\n{log_text[-3000:]}"
    assert "answered True" in attacker.stdout, attacker.stdout + attacker.stderr[-3000:]

# The attacker: (1) a far-future expiration and (2) an unsigned value under the organiser's own
# progress subkey, (3) a plain value under the run key, (4) a well-signed record of its own identity
# carrying a manifest of the same config that starts an hour earlier, signed by its own run key.
ATTACKER = """
import os, sys, tempfile, json
from hivemind import DHT
from hivemind.utils import get_dht_time
from protocols import records
from protocols.identity import PeerKey, RunKey
from protocols.keys import peers_key, run_key
from protocols.manifest import decode_signed

target, run = sys.argv[1], sys.argv[2]
me = PeerKey.generate()
path = os.path.join(tempfile.mkdtemp(), "id.key")
open(path, "wb").write(me.identity_bytes())
dht = DHT(initial_peers=[target], host_maddrs=["/ip4/127.0.0.1/tcp/0"], identity_path=path,
          record_validators=[records.ShoalRecordValidator([run], me)], check_if_identity_free=False, start=True)
print("attacker", dht.peer_id, flush=True)
found = dht.get(peers_key(run), latest=True)
victim = next(iter(found.value))
now = get_dht_time()
bogus = {"v": 1, "round": 10**9, "mode": "full"}
results = {
    "frozen": dht.store(peers_key(run), bogus, now + 10 * 365 * 86400, subkey=victim),
    "foreign": dht.store(peers_key(run), bogus, now + 10, subkey=victim),
    "plain": dht.store(run_key(run), "plain", now + 300),
}
theirs = decode_signed(next(iter(dht.get(run_key(run), latest=True).value.values())).value)
rewritten = theirs.with_start(theirs.start_time - 3600).signed_by(RunKey.generate())
results["manifest"] = dht.store(run_key(run), rewritten.signed_value(), now + 300, subkey=me.public)
print("results", json.dumps(results), flush=True)
dht.shutdown()
"""


# A quarter of a core for each peer that trains: an unthrottled organiser took a whole core while the
# attacker and both joiners started. How fast it trains is not what this test is about.
THROTTLE = ("--throttle", "4")


@pytest.mark.timeout(300)
def test_an_attacker_cannot_freeze_forge_or_reschedule_the_runs_records(entry_peer, swarm):
    _, address_file, _ = entry_peer
    entry = address_file.read_text().split()[:1]
    organiser = swarm.start("organiser", *THROTTLE, initial=entry)
    address = organiser.wait_for_address()
    join_line = next(line for line in organiser.log().splitlines() if "to join:" in line)
    run_key_text = join_line.split("--run-key ")[1].split()[0]

    attack = subprocess.run([sys.executable, "-c", ATTACKER, address[0], swarm.run_id], cwd=REPO,
                            capture_output=True, text=True, timeout=120, start_new_session=True)
    assert "results" in attack.stdout, attack.stdout + attack.stderr[-3000:]
    attacker_id = attack.stdout.split("attacker ")[1].split()[0]
    results = json.loads(attack.stdout.split("results ")[1].splitlines()[0])
    assert results["frozen"] is False, results  # a far-future expiration: refused by every honest node

    pinned = swarm.start("pinned", "--run-key", run_key_text, *THROTTLE, initial=address[:1])
    unpinned = swarm.start("unpinned", initial=address[:1])
    pinned.wait_for_address()
    assert unpinned.wait(timeout=120) != 0, unpinned.log()[-3000:]
    # The unpinned joiner sees two organisers of the run and refuses to guess, in one line.
    assert "error: run '" in unpinned.log() and "--run-key" in unpinned.log(), unpinned.log()[-2000:]

    def start_record(peer):
        return next(r for r in read_metrics(peer.metrics_path) if r["event"] == "start")

    wait_until(lambda: pinned.metrics_path.exists() and any(True for _ in read_metrics(pinned.metrics_path)), 60,
               "the pinned joiner wrote its start record")
    assert start_record(pinned)["schedule_start"] == start_record(organiser)["schedule_start"]
    assert organiser.proc.poll() is None and pinned.proc.poll() is None, organiser.log()[-3000:]
    # The organiser's DHT refused the forged and plain records and named who sent them.
    assert f"refused a DHT record from {attacker_id}" in organiser.log(), organiser.log()[-3000:]
    assert "a plain value under a subkeyed key" in organiser.log()
    assert "not signed by this run's --run-key" in pinned.log() or "ignored 1 manifest" in pinned.log()


@pytest.mark.timeout(120)
def test_a_peer_without_the_swarm_key_is_refused_in_one_line():
    from hivemind.utils import get_dht_time

    from node.library.dht import RecordRules, shutdown_dht, start_dht
    from node.library.run_record import DhtDirectory, join_run
    from protocols.errors import ConfigError
    from protocols.manifest import RunManifest

    rules = RecordRules(run_ids=("private",), swarm_key=b"s" * 32)
    member = start_dht(initial_peers=[], listen=["/ip4/127.0.0.1/tcp/0"], announce=[], timeout=30, rules=rules)
    stranger = None
    try:
        ours = RunManifest.create("private", {"model.d_model": 64}, start_time=get_dht_time(), round_seconds=10.0)
        join_run(DhtDirectory(member, "private", owner=member.shoal_key.public), ours, record_ttl=60)
        address = [str(m) for m in member.get_visible_maddrs()]
        stranger = start_dht(initial_peers=address, listen=["/ip4/127.0.0.1/tcp/0"], announce=[], timeout=30,
                             rules=RecordRules(run_ids=("private",)))
        with pytest.raises(ConfigError, match="this swarm is private"):
            join_run(DhtDirectory(stranger, "private", owner=stranger.shoal_key.public), ours, record_ttl=60,
                     settle_s=0)
        # ...and nothing it stores reaches the member: not stored there, not believed when read back.
        stranger.store("elsewhere", 1, get_dht_time() + 30)
        assert member.get("elsewhere", latest=True) is None
    finally:
        for dht in (stranger, member):
            if dht is not None:
                shutdown_dht(dht)
