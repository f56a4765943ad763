"""A stranger's malformed message costs a peer that message, never the process (issue: hostile
swarm). Real processes: a ``shoal bootstrap`` entry peer and an attacker running plain hivemind."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from tests.integration.swarm import REPO, wait_until

pytestmark = pytest.mark.integration

# A plain hivemind peer whose own serializer writes a 300-deep nest of msgpack tuples (1.4 KB) as the
# subkey of a store: an unprotected hivemind DHT node dies with SIGSEGV decoding it. Then a fresh
# client checks the target still answers.
ATTACKER = """
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
def test_a_msgpack_bomb_does_not_kill_a_dht_node(bootstrap, tmp_path):
    victim, address_file = bootstrap
    wait_until(address_file.exists, 90, "the bootstrap peer wrote its address")
    target = address_file.read_text().split()[0]
    attacker = subprocess.run([sys.executable, "-c", ATTACKER, target], cwd=REPO, capture_output=True,
                              text=True, timeout=150, start_new_session=True)
    assert "sent" in attacker.stdout, attacker.stderr[-3000:]
    time.sleep(1.0)
    log_text = (tmp_path / "bootstrap.log").read_text(errors="replace")
    assert victim.poll() is None, f"the DHT node died (exit {victim.returncode}):\n{log_text[-3000:]}"
    assert "answered True" in attacker.stdout, attacker.stdout + attacker.stderr[-3000:]
