"""A test-only hostile peer: a real ``ShoalAverager`` (same protocol, prefix and group bits as the
honest ones) whose all-reduce runner corrupts what it sends or what it returns as a reducer.
Lives under tests/ so that nothing in the CLI can reach it.

The attack is read from ``ATTACK`` (shared memory, created at import, before any averager forks),
so a test can change it between rounds without restarting the peer:
- ``scale``: parts ×1000; ``flip``: parts ×-50; ``noise``: parts + 99× noise; ``nan``: a NaN per part;
- ``shape``: parts of shape [1] (hivemind's reducer would broadcast them);
- ``weight``: the sign-flipped vector with a declared weight of 1e30;
- ``lie``: honest sends, but as a reducer it returns averages + 1e4;
- ``short``: honest sends, but as a reducer it ends each answer stream one part early, so every
  member's result misses that part (with one part per reducer: its whole share).
"""

from __future__ import annotations

import multiprocessing as mp
from collections.abc import AsyncIterator
from contextlib import aclosing

import torch
from hivemind.averaging.allreduce import AllReduceRunner, AveragingMode
from hivemind.compression import deserialize_torch_tensor, serialize_torch_tensor
from hivemind.proto import averaging_pb2
from hivemind.utils import get_dht_time
from hivemind.utils.asyncio import as_aiter, azip

from averaging.network.hivemind.averager import ShoalAverager
from averaging.network.hivemind.backend import HivemindBackend

ATTACKS = ("scale", "flip", "noise", "nan", "shape", "weight", "lie", "short")
ATTACK = mp.Array("c", 16)


def current_attack() -> str:
    return ATTACK.value.decode()


def corrupt(part: torch.Tensor, attack: str) -> torch.Tensor:
    if attack == "scale":
        return part * 1000
    if attack == "flip":
        return part * -50
    if attack == "noise":
        return part + 99 * part.std() * torch.randn_like(part)
    if attack == "nan":
        part = part.clone()
        part[0] = float("nan")
        return part
    if attack == "shape":
        return part[:1]
    if attack == "weight":
        return -part
    return part


class HostileRunner(AllReduceRunner):
    async def _generate_input_for_peer(self, peer_index: int) -> AsyncIterator[averaging_pb2.AveragingData]:
        attack = current_attack()
        async for message in super()._generate_input_for_peer(peer_index):
            part = corrupt(deserialize_torch_tensor(message.tensor_part), attack)
            message.tensor_part.CopyFrom(serialize_torch_tensor(part, message.tensor_part.compression))
            if attack == "weight":
                message.weight = 1e30
            yield message

    async def _accumulate_parts_streaming(self, stream, sender_index: int):
        attack, answered = current_attack(), 0
        async with aclosing(super()._accumulate_parts_streaming(stream, sender_index)) as answers:
            async for message in answers:
                if attack == "short" and answered == self.tensor_part_reducer.num_parts - 1:
                    return  # every part was reduced (the others' averages are complete); the last goes unsent
                if attack == "lie" and message.code == averaging_pb2.AVERAGED_PART:
                    delta = deserialize_torch_tensor(message.tensor_part) + 1e4
                    message.tensor_part.CopyFrom(serialize_torch_tensor(delta, message.tensor_part.compression))
                answered += 1
                yield message


class HostileAverager(ShoalAverager):
    _rpc_handlers = None  # hivemind caches RPC tables per class (see ShoalAverager)
    _stub_type = None

    async def _run_allreduce_inplace_(self, tensors, group_info, group_id=None, **kwargs):
        group_id = group_info.group_id if group_id is None else group_id
        runner = HostileRunner(p2p=self._p2p, servicer_type=type(self), prefix=self.prefix, tensors=tensors,
                               group_id=group_id, ordered_peer_ids=group_info.peer_ids, **kwargs)
        self._running_groups[group_id].set_result(runner)
        if runner.modes[group_info.peer_ids.index(self.peer_id)] != AveragingMode.AUX:
            async for tensor, update in azip(as_aiter(*tensors), runner):
                tensor.add_(update, alpha=self._averaging_alpha)
                self.last_updated = get_dht_time()


# hivemind names RPC handlers after the servicer's class ("<prefix>::ShoalAverager.rpc_join_group"):
# to be reachable by honest peers the attacker takes the honest class's name, as a real one would.
HostileAverager.__name__ = HostileAverager.__qualname__ = ShoalAverager.__name__


class HostileBackend(HivemindBackend):
    averager_class = HostileAverager
