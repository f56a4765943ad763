"""Bounded decoding: a 1.4 KB message that kills an unprotected hivemind process with SIGSEGV is
an ordinary, dropped error once ``protocols.safe_decoding`` is installed; real messages still
decode; an oversized stream message is refused before it is buffered."""

from __future__ import annotations

import asyncio
import subprocess
import sys

import msgpack
import pytest
from hivemind.dht.storage import DictionaryDHTValue
from hivemind.p2p.p2p_daemon import P2P
from hivemind.utils.serializer import MSGPackSerializer

from protocols import safe_decoding
from protocols.safe_decoding import MAX_EXT_DEPTH, MAX_MESSAGE_BYTES, DecodingLimitError

BOMB_SOURCE = """
import msgpack
payload = msgpack.packb([])
for _ in range({depth}):
    payload = msgpack.packb([msgpack.ExtType(0x40, payload)])
BOMB = msgpack.packb(msgpack.ExtType(0x40, payload))
"""


def bomb(depth: int) -> bytes:
    scope: dict = {}
    exec(BOMB_SOURCE.format(depth=depth), scope)  # noqa: S102 - our own constant source
    return scope["BOMB"]


def decode_in_a_fresh_process(depth: int, protected: bool) -> subprocess.CompletedProcess:
    code = BOMB_SOURCE.format(depth=depth) + (
        "from protocols import safe_decoding; safe_decoding.install()\n" if protected else "") + """
from hivemind.utils.serializer import MSGPackSerializer
try:
    MSGPackSerializer.loads(BOMB)
except ValueError as e:
    print("refused:", e)
"""
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)


@pytest.fixture(scope="module", autouse=True)
def installed():
    safe_decoding.install()


def test_the_bomb_kills_an_unprotected_process_and_is_refused_by_a_protected_one():
    assert len(bomb(300)) < 1500
    unprotected = decode_in_a_fresh_process(300, protected=False)
    assert unprotected.returncode < 0, unprotected  # SIGSEGV: the threat is real
    protected = decode_in_a_fresh_process(300, protected=True)
    assert protected.returncode == 0 and "nested deeper than" in protected.stdout, protected


def test_nesting_up_to_the_limit_decodes_and_beyond_it_is_refused():
    assert isinstance(MSGPackSerializer.loads(bomb(MAX_EXT_DEPTH - 2)), tuple)
    with pytest.raises(DecodingLimitError, match="nested deeper"):
        MSGPackSerializer.loads(bomb(MAX_EXT_DEPTH + 1))
    assert MSGPackSerializer.loads(MSGPackSerializer.dumps((1, 2))) == (1, 2)  # the depth counter was reset


def test_hivemind_values_still_round_trip():
    value = DictionaryDHTValue()
    value.store("subkey", (1, ("nested", b"bytes")), expiration_time=2.0**31)
    again = MSGPackSerializer.loads(MSGPackSerializer.dumps(value))
    assert isinstance(again, DictionaryDHTValue) and again.get("subkey").value == (1, ("nested", b"bytes"))
    obj = {"a": [1, 2.5, None, "x"], "t": (1, (2, (3,))), "b": b"\x00" * 1000}
    assert MSGPackSerializer.loads(MSGPackSerializer.dumps(obj)) == obj


@pytest.mark.parametrize("payload", [msgpack.packb(list(range(10))) [:-1], b"\xc1", b"\xdd\xff\xff\xff\xff"])
def test_malformed_bytes_raise_an_exception_not_a_crash(payload):
    with pytest.raises((ValueError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError)):
        MSGPackSerializer.loads(payload)


def receive(data: bytes) -> bytes:
    async def read() -> bytes:
        reader = asyncio.StreamReader()
        reader.feed_data(data)  # and nothing after: a reader that waited for the body would hang
        return await asyncio.wait_for(P2P.receive_raw_data(reader), timeout=5)

    return asyncio.run(read())


def test_an_oversized_message_is_refused_before_it_is_read():
    with pytest.raises(DecodingLimitError, match="exceeds"):
        receive((MAX_MESSAGE_BYTES + 1).to_bytes(P2P.HEADER_LEN, P2P.BYTEORDER))
    assert receive((3).to_bytes(P2P.HEADER_LEN, P2P.BYTEORDER) + b"abc") == b"abc"


def test_the_replaced_hivemind_code_is_the_reviewed_code(monkeypatch):
    assert safe_decoding.check_hivemind() == []  # fails after a hivemind upgrade changed them
    monkeypatch.setitem(safe_decoding.ORIGINALS, "P2P.receive_raw_data", P2P.send_raw_data)
    assert safe_decoding.check_hivemind() == ["P2P.receive_raw_data"]
