"""Bounded decoding of everything hivemind reads from the network, in every process.

Two holes in hivemind 1.1.12 let one stranger end a peer (both reproduced; docs/hivemind.md):

- **Nested ExtTypes crash the process.** ``MSGPackSerializer`` decodes a tuple (ExtType 0x40) by
  calling ``msgpack.unpackb`` again from its ext hook, through the C unpacker, without a depth
  limit: ~200 nested tuples (~714 bytes) overflow the C stack and the process dies with SIGSEGV,
  not an exception. Every DHT node decodes subkeys of ``rpc_store`` requests this way, and every
  averager the gathered metadata of its group.
- **Unbounded stream messages.** ``P2P.receive_raw_data`` reads an 8-byte length and then buffers
  that many bytes before anything looks at them.

hivemind has no hook for either, so ``install()`` replaces the two functions (at import of the
library, before hivemind forks its DHT and averager processes, which then inherit the bounded
versions). ``check_hivemind()`` fails when a hivemind upgrade changed the code replaced here: the
patch must then be re-derived, not silently kept. A message that breaks a limit raises an
ordinary exception inside hivemind's handler, which drops that request; the process lives on.
"""

from __future__ import annotations

import hashlib
import inspect
import threading

import msgpack
from hivemind.p2p.p2p_daemon import P2P
from hivemind.utils.serializer import MSGPackSerializer

MAX_EXT_DEPTH = 16  # nested tuples in one message; hivemind's own messages nest fewer than 4
MAX_MESSAGE_BYTES = 16 * 2**20  # one framed p2p message; hivemind streams tensors in 64 KiB chunks
MAX_CONTAINER_LEN = 1 << 20  # items in one msgpack array or map

# sha256 of the source of each hivemind function replaced here, as reviewed (hivemind 1.1.12).
REVIEWED = {
    "MSGPackSerializer.loads": "e34bc04a8ccfe78289a34b7a6fd1487a91c7ff16d6ed0e2073c1613c8ce85e13",
    "MSGPackSerializer._decode_ext_types": "0f563675ee1f459aee2e24c79d3c221425297534ce758d83e1776d35f9b3e6e7",
    "P2P.receive_raw_data": "353ef452baab5a810ac2152ac9939a6f4c3a1abb52927993d1b66f1bf91827b6",
}

_depth = threading.local()
_installed = False
_lock = threading.Lock()


class DecodingLimitError(ValueError):
    """A received message breaks a decoding limit; it is dropped."""


def source_digest(function) -> str:
    return hashlib.sha256(inspect.getsource(function).encode()).hexdigest()


# hivemind's own functions, taken at import (before ``install`` replaces them).
ORIGINALS = {
    "MSGPackSerializer.loads": MSGPackSerializer.loads,
    "MSGPackSerializer._decode_ext_types": MSGPackSerializer._decode_ext_types,
    "P2P.receive_raw_data": P2P.receive_raw_data,
}


def check_hivemind() -> list[str]:
    """Names of the replaced hivemind functions whose code differs from what was reviewed."""
    return [name for name, digest in REVIEWED.items() if source_digest(ORIGINALS[name]) != digest]


def bounded_loads(buf: bytes) -> object:
    """``MSGPackSerializer.loads`` with limits: size, container lengths and ExtType nesting."""
    if len(buf) > MAX_MESSAGE_BYTES:
        raise DecodingLimitError(f"msgpack message of {len(buf)} bytes exceeds {MAX_MESSAGE_BYTES}")
    return msgpack.unpackb(buf, ext_hook=_bounded_ext_hook, raw=False,
                           max_array_len=MAX_CONTAINER_LEN, max_map_len=MAX_CONTAINER_LEN)


def _bounded_ext_hook(type_code: int, data: bytes) -> object:
    depth = getattr(_depth, "value", 0)
    if depth >= MAX_EXT_DEPTH:
        raise DecodingLimitError(f"msgpack ExtTypes nested deeper than {MAX_EXT_DEPTH}")
    _depth.value = depth + 1
    try:
        if type_code == MSGPackSerializer._TUPLE_EXT_TYPE_CODE:
            return tuple(bounded_loads(data))
        # A registered ext type (e.g. hivemind's DHT values) decodes through its own ``unpackb``,
        # which calls the (bounded) ``MSGPackSerializer.loads`` again: still counted here.
        return ORIGINALS["MSGPackSerializer._decode_ext_types"](type_code, data)
    finally:
        _depth.value = depth


async def bounded_receive_raw_data(reader) -> bytes:
    """``P2P.receive_raw_data`` that refuses a length above ``MAX_MESSAGE_BYTES`` before reading it."""
    header = await reader.readexactly(P2P.HEADER_LEN)
    content_length = int.from_bytes(header, P2P.BYTEORDER)
    if content_length > MAX_MESSAGE_BYTES:
        raise DecodingLimitError(f"p2p message of {content_length} bytes exceeds {MAX_MESSAGE_BYTES}")
    return await reader.readexactly(content_length)


def install() -> None:
    """Replace hivemind's unbounded decoders in this process (and in the processes it forks later).
    Idempotent. Raises ``RuntimeError`` if hivemind's code is not the code this was written for."""
    global _installed
    with _lock:
        if _installed:
            return
        changed = check_hivemind()
        if changed:
            raise RuntimeError(f"hivemind changed {', '.join(changed)} since shoal's decoding limits were written; "
                               "re-check protocols/safe_decoding.py against it before running")
        MSGPackSerializer.loads = classmethod(lambda cls, buf: bounded_loads(buf))
        MSGPackSerializer._decode_ext_types = classmethod(lambda cls, type_code, data: _bounded_ext_hook(type_code, data))
        P2P.receive_raw_data = staticmethod(bounded_receive_raw_data)
        _installed = True
