"""The butterfly all-reduce of pseudo-gradients, on hivemind's ``DecentralizedAverager``.

Hazards this module owns (see shared/HIVEMIND_NOTES.md):
- The averager is a forked process sharing our buffer through shared memory. It must be created
  before CUDA is initialised and before other threads start, and it sets SIGINT to ignored in
  the parent: the caller restores its handler.
- The averager holds the ``get_tensors()`` lock for the whole all-reduce. We write the buffer
  before triggering the all-reduce and read it only after the step's future resolves; nothing
  else touches it (the loop never sees this buffer).
- A "successful" step can leave parts un-averaged; the gather carries anchor fingerprints so the
  next round can detect that (``averaging.consistency``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import torch
from hivemind import DHT, DecentralizedAverager
from hivemind.averaging.control import StepControl
from hivemind.compression import CompressionBase, Float16Compression, NoCompression, deserialize_tensor_stream
from hivemind.p2p import PeerID
from hivemind.proto import averaging_pb2
from hivemind.utils.asyncio import aiter_with_timeout
from hivemind.utils.mpfuture import MPFuture

from averaging.backend import AverageOutcome, DownloadedState

logger = logging.getLogger(__name__)

COMPRESSIONS: dict[str, Callable[[], CompressionBase]] = {"fp16": Float16Compression, "none": NoCompression}

StateProvider = Callable[[], tuple[dict, list[torch.Tensor]]]


class ShoalAverager(DecentralizedAverager):
    """hivemind's averager plus two things it lacks: a pluggable state provider and downloads
    from *chosen* peers (hivemind always picks by priority; a diverged peer must pick peers that
    agree with the group)."""

    def __init__(self, *args, state_provider: StateProvider, **kwargs):
        self._state_provider = state_provider
        super().__init__(*args, **kwargs)

    def get_current_state(self):
        # Runs in the host process, in hivemind's state-fetcher thread.
        metadata, tensors = self._state_provider()
        return metadata, tensors, None

    def download_state_from(self, peers: list[str], timeout: float) -> tuple[str, Any, list[torch.Tensor]] | None:
        future = MPFuture()
        self._outer_pipe.send(("_download_state_from", [], dict(peers=peers, timeout=timeout, future=future)))
        return future.result(timeout=timeout * max(1, len(peers)) + 5)

    async def _download_state_from(self, peers: list[str], timeout: float, future: MPFuture):
        # Runs in the averager process.
        try:
            for peer in peers:
                try:
                    stub = self.get_stub(self._p2p, PeerID.from_base58(peer), namespace=self.prefix)
                    stream = await stub.rpc_download_state(averaging_pb2.DownloadRequest())
                    metadata: list[Any] = []

                    async def parts(stream=stream, metadata=metadata) -> AsyncIterator[list]:
                        async for message in aiter_with_timeout(stream, timeout=timeout):
                            if message.metadata:
                                metadata.append(self.serializer.loads(message.metadata))
                            yield [message.tensor_part]

                    tensors = await deserialize_tensor_stream(parts())
                    if metadata:
                        future.set_result((peer, metadata[0], tensors))
                        return
                    logger.info(f"peer {peer} did not share its state")
                except Exception as e:  # a bad donor is skipped, the next one is tried
                    logger.warning(f"state download from {peer} failed: {e!r}")
        finally:
            if not future.done():
                future.set_result(None)


class HivemindBackend:
    """Owns one ``ShoalAverager``; used only from the sync worker's thread (one owner)."""

    def __init__(
        self,
        dht: DHT,
        *,
        numel: int,
        prefix: str,
        state_provider: StateProvider,
        compression: str = "fp16",
        target_group_size: int | None = None,
        min_group_size: int = 2,
        min_matchmaking_time: float = 3.0,
        request_timeout: float = 1.5,
        allreduce_timeout: float = 60.0,
        client_mode: bool = False,
    ):
        # request_timeout < min_matchmaking_time, or matchmaking can deadlock (HIVEMIND_NOTES).
        assert request_timeout < min_matchmaking_time
        self._averager = ShoalAverager(
            averaged_tensors=[torch.zeros(numel, dtype=torch.float32)],
            dht=dht,
            start=True,
            prefix=prefix,
            state_provider=state_provider,
            target_group_size=target_group_size,
            min_group_size=min_group_size,
            min_matchmaking_time=min_matchmaking_time,
            request_timeout=request_timeout,
            allreduce_timeout=allreduce_timeout,
            sender_timeout=allreduce_timeout * 0.4,  # hivemind requires sender < reducer timeout
            reducer_timeout=allreduce_timeout / 2,
            compression=COMPRESSIONS[compression](),
            state_compression=NoCompression(),  # shared state must arrive exact
            client_mode=client_mode,
            shutdown_timeout=3,
        )
        self.peer_id = str(dht.peer_id)
        self._request_timeout = request_timeout
        self._control: StepControl | None = None

    def prepare(self, *, round: int, scheduled_time: float, gather: dict, timeout: float) -> None:
        if self._control is not None and not self._control.done():
            self._control.cancel()
        # The round goes into the matchmaking key (hivemind's group bits), so a peer still
        # finishing round r-1 can never pull a peer of round r into its group (or wait for it).
        self._averager.set_group_bits(round_bits(round))
        self._control = self._averager.step(
            gather=gather,
            scheduled_time=scheduled_time,
            timeout=max(timeout, scheduled_time - time.time() + self._request_timeout),
            require_trigger=True,
            wait=False,
        )

    def average(self, vector: torch.Tensor, *, weight: float, timeout: float) -> AverageOutcome:
        control, self._control = self._control, None
        if control is None:
            return AverageOutcome(ok=False, error="no averaging step was prepared")
        if control.done():
            return AverageOutcome(ok=False, error=f"matchmaking ended early: {_reason(control)}")
        # 1. Fill the buffer while the averager cannot be using it (the step waits for our trigger).
        with self._averager.get_tensors() as (buffer,):
            buffer.copy_(vector)
        control.weight = float(weight)
        started, started_wall = time.perf_counter(), time.time()
        control.allow_allreduce()
        # 2. Wait for the group; a failure keeps the caller's vector as it was.
        try:
            gathered = control.result(timeout=timeout)
        except Exception as e:
            control.cancel()
            return AverageOutcome(ok=False, sync_s=time.perf_counter() - started, error=_describe(e))
        sync_s = time.perf_counter() - started
        allreduce_s = time.time() - max(started_wall, control.scheduled_time)
        if not gathered:
            return AverageOutcome(ok=False, sync_s=sync_s, error="averaging returned no group")
        # 3. Read the result only after the step finished (the averager released the lock).
        with self._averager.get_tensors() as (buffer,):
            vector.copy_(buffer)
        gathered_by_peer = {str(peer): data for peer, data in gathered.items()}
        return AverageOutcome(ok=True, group=tuple(sorted(gathered_by_peer)), gathered=gathered_by_peer, sync_s=sync_s,
                              allreduce_s=allreduce_s)

    def download_state(self, peers: list[str], *, timeout: float) -> DownloadedState | None:
        result = self._averager.download_state_from([p for p in peers if p != self.peer_id], timeout)
        if result is None:
            return None
        peer, metadata, tensors = result
        return DownloadedState(peer=peer, metadata=metadata, tensors=tensors)

    def shutdown(self) -> None:
        if self._control is not None and not self._control.done():
            self._control.cancel()
        if self._averager.is_alive():
            self._averager.shutdown()


def round_bits(round: int) -> str:
    """Matchmaking key bits for ``round``: neighbouring rounds always differ."""
    return format(round % 16, "04b")


def _describe(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0][:200]}" if text else type(e).__name__


def _reason(control: StepControl) -> str:
    try:
        control.result(timeout=0)
    except BaseException as e:  # noqa: BLE001 - we only describe it
        return _describe(e)
    return "finished without an all-reduce"
