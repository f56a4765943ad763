"""The hivemind code shoal overrides or relies on, pinned: one check before an averager starts.

- ``REVIEWED``: the sha256 of the source of every hivemind 1.1.12 function we override or copy; a
  mismatch means the override must be re-derived against the new code.
- ``RELIED_ON``: lines the codec registration depends on, looked up (whitespace-insensitive) in
  the functions that hold them, which are called, not overridden.

``check()`` raises ``HivemindChanged`` naming every pin that no longer holds (``changes()``); the
averager and the codec registration call it.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable

from hivemind.averaging import allreduce, averager, matchmaking, partition
from hivemind.averaging.allreduce import AllReduceRunner
from hivemind.averaging.averager import DecentralizedAverager
from hivemind.averaging.matchmaking import Matchmaking, PotentialLeaders
from hivemind.averaging.partition import TensorPartContainer, TensorPartReducer
from hivemind.compression import serialization
from hivemind.p2p import P2P

from protocols.pinning import changed_functions


class HivemindChanged(RuntimeError):
    """hivemind no longer looks like the version shoal's overrides were written against."""


# sha256 of the source of every hivemind function shoal overrides or copies, as reviewed (hivemind 1.1.12).
REVIEWED = {
    "DecentralizedAverager._aggregate_with_group": "c297d8a435ce2b1c0ca36b8e6bc318a23b1c696ef1624dabc654cee803650868",
    "DecentralizedAverager._run_allreduce_inplace_": "914d57cffc7d69e1ce16b384f3fc0783fbbf08b7fa839634da9571f9c4143925",
    "AllReduceRunner.__init__": "597a0c8dbbeabbe366c28a471d7bc1452a9e4d17520942aa61c7b52de22799f4",
    "AllReduceRunner._communicate_with_peer": "d910885e9727ed48e117de0b94731d74ac1abd11340c903622367d35e1b6f374",
    "AllReduceRunner._accumulate_parts_streaming": "6c5a3c72660603033d98a698d8debccf860244979008d06f3bff943fcc2a47fc",
    "AllReduceRunner._ban_sender": "3a3d52ad781b64d74381f3f78cf07b8dfe8de2d4bc1b89ece40ed8de1335a245",
    "TensorPartReducer.accumulate_part": "1d64a8bd77052ac43ed43003ec04ade86d07114ac5b50ec0a023470896d21793",
    "TensorPartReducer.reset_accumulators": "5d3dc36f344a342e981250bfaa2d6b9cd0562b7938fe4c881ff0c5e11c2e7693",
    "TensorPartReducer.on_sender_failed": "8a7de53789ffecb17e6bdc3a2346864e9c44152f8b4bf251b7de81de7b168276",
    "TensorPartReducer.check_current_part_finished": "ec9b059c42f3ca271d3e89ff63177006d66e0fc4a6bb99427eb08ab25d3d3640",
    "TensorPartContainer.register_processed_part": "ff5ebad6141c4a8886c1e661b81c22ae87dd54e624dc016ee30d94ca72285089",
    # counts a failed reducer's parts in failed_size: how the host learns a result is partial
    "TensorPartContainer.register_failed_reducer": "89b41b9d7f2259687a2fc1fce7460b96d97f8af368c72b22bd01079c194a89f1",
    "Matchmaking.follower_assemble_group": "2fc9715f5e6de487d880a919217efea5ae3d917cba393fcbe30301e72df4df3d",
    "Matchmaking._request_join_group": "df823040a94d1c1ddb28c15536b631502954dd03024ac943820a21075e335b43",
    "Matchmaking._check_reasons_to_reject": "c694e8194862154f80c71315a9a91813d01c907668a4fba8d1f29c88fe7618d3",
    "PotentialLeaders._declare_averager_periodically": "36280203c3a0aca00f4592ce13e4bac4f04c3177cae282101acce4c81458c501",
    "PotentialLeaders._update_queue_periodically": "13036c7d743da89efd85ef93befc61463e1e45d87bdb6d07e97b46fa7e4ba580",
    # shoal's joiner reads donors' answers itself, in hivemind's framing (fetching.StateFetching._download);
    # a donor's serving deadline exists because send_raw_data drains without a timeout
    "P2P.send_protobuf": "4f5a437c202da6a91decbddddd8db8405b41993ef41ed8a6c0f2f4b292d4bd40",
    "P2P.receive_protobuf": "9d870718fbdc1c4fd296e7a45c7b8b81e9b748609d61381d87d4b194df03ac4a",
    "P2P._iterate_protobuf_stream_handler": "132d50ef5ecd4e13ad2886337e87cc47983abf9dae05afe9f6f9deee74401bf7",
    "P2P.send_raw_data": "af42f4c0998a71e1ffac3672514a3525b90cf540de191b352f179e76acdd19d1",
}
ORIGINALS: dict[str, Callable] = {
    "DecentralizedAverager._aggregate_with_group": DecentralizedAverager._aggregate_with_group,
    "DecentralizedAverager._run_allreduce_inplace_": DecentralizedAverager._run_allreduce_inplace_,
    "AllReduceRunner.__init__": AllReduceRunner.__init__,
    "AllReduceRunner._communicate_with_peer": AllReduceRunner._communicate_with_peer,
    "AllReduceRunner._accumulate_parts_streaming": AllReduceRunner._accumulate_parts_streaming,
    "AllReduceRunner._ban_sender": AllReduceRunner._ban_sender,
    "TensorPartReducer.accumulate_part": TensorPartReducer.accumulate_part,
    "TensorPartReducer.reset_accumulators": TensorPartReducer.reset_accumulators,
    "TensorPartReducer.on_sender_failed": TensorPartReducer.on_sender_failed,
    "TensorPartReducer.check_current_part_finished": TensorPartReducer.check_current_part_finished,
    "TensorPartContainer.register_processed_part": TensorPartContainer.register_processed_part,
    "TensorPartContainer.register_failed_reducer": TensorPartContainer.register_failed_reducer,
    "Matchmaking.follower_assemble_group": Matchmaking.follower_assemble_group,
    "Matchmaking._request_join_group": Matchmaking._request_join_group,
    "Matchmaking._check_reasons_to_reject": Matchmaking._check_reasons_to_reject,
    "PotentialLeaders._declare_averager_periodically": PotentialLeaders._declare_averager_periodically,
    "PotentialLeaders._update_queue_periodically": PotentialLeaders._update_queue_periodically,
    "P2P.send_protobuf": P2P.send_protobuf,
    "P2P.receive_protobuf": P2P.receive_protobuf,
    "P2P._iterate_protobuf_stream_handler": P2P._iterate_protobuf_stream_handler,
    "P2P.send_raw_data": P2P.send_raw_data,
}

# Lines of hivemind the codec registration relies on (the facts in averaging.network.hivemind.codecs).
RELIED_ON: tuple[tuple[str, object, str, str], ...] = (
    ("receivers look codecs up by enum name", serialization, "deserialize_torch_tensor",
     "_BASE_COMPRESSION_TYPES[runtime_pb2.CompressionType.Name(serialized_tensor.compression)]"),
    ("serialize_torch_tensor looks codecs up by enum name", serialization, "serialize_torch_tensor",
     "_BASE_COMPRESSION_TYPES[runtime_pb2.CompressionType.Name(compression_type)]"),
    ("reducers decode parts through the registry", allreduce.AllReduceRunner, "_accumulate_parts_streaming",
     "deserialize_torch_tensor(msg.tensor_part), msg.weight, msg.tensor_part.compression"),
    ("reducers re-encode deltas with the sender's type", allreduce.AllReduceRunner, "_accumulate_parts_streaming",
     "serialize_torch_tensor(averaged_part - tensor_part, part_compression)"),
    ("senders decode returned deltas through the registry", allreduce.AllReduceRunner, "_communicate_with_peer",
     "deserialize_torch_tensor(msg.tensor_part)"),
    ("part sizes come from estimate_compression_ratio", partition.TensorPartContainer, "__init__",
     "part_size_values = int(part_size_bytes / bytes_per_value)"),
    ("senders compress parts with the averager's compression", partition.TensorPartContainer,
     "iterate_input_parts_for", "self.compression.compress(*x_and_info)"),
    # A payload of several tensors (``PayloadCompression``): the runner finds which tensor each of its
    # parts is from by counting parts tensor by tensor, then peer by peer (``RobustAllReduceRunner``).
    ("each tensor is cut on its own, in order, its parts counted", partition.TensorPartContainer, "__init__",
     "self.num_parts_by_tensor.append(len(tensor_parts))"),
    ("parts go to peers in order, a contiguous run each", partition.TensorPartContainer, "__init__",
     "self._input_parts_by_peer[current_peer_index].append((part, part_info))"),
    ("each part is compressed with its tensor's info (its key)", partition.TensorPartContainer, "__init__",
     "part_info = info.get_part(part_index, part_size_values)"),
    # How long ShoalAverager.rpc_aggregate_part waits for an unknown group id (``registration_wait``):
    # a group is registered only after matchmaking returned it and its trigger fired, so an honest
    # part for a group we do not know arrives only while we are still looking for a group.
    ("a step matches its group before it waits for its trigger", averager.DecentralizedAverager, "_step",
     "group_info = await self._matchmaking.look_for_group(step)"),
    ("a step registers its group only once triggered", averager.DecentralizedAverager, "_step",
     "await step.wait_for_trigger()"),
    ("registering a group wakes every waiting handler", averager.DecentralizedAverager,
     "_register_allreduce_group", "self._pending_groups_registered.set()"),
    ("matchmaking says while it looks for a group", matchmaking.Matchmaking, "look_for_group",
     "async with self.looking_for_group(step):"),
)


def _source(owner: object, attribute: str) -> str:
    try:
        return inspect.getsource(getattr(owner, attribute))
    except (AttributeError, OSError, TypeError):
        return ""


def _squash(text: str) -> str:
    return "".join(text.split())


def changes() -> list[str]:
    """Every pin that no longer holds, named (empty: hivemind is the version reviewed)."""
    changed = [f"{name} (its code)" for name in changed_functions(REVIEWED, ORIGINALS)]
    changed += [f"{what} (expected `{line}` in {attribute})" for what, owner, attribute, line in RELIED_ON
                if _squash(line) not in _squash(_source(owner, attribute))]
    if not isinstance(getattr(serialization, "_BASE_COMPRESSION_TYPES", None), dict):
        changed.append("compression._BASE_COMPRESSION_TYPES is no longer a dict")
    return changed


def check() -> None:
    """Raise ``HivemindChanged`` naming every pin that no longer holds."""
    if changed := changes():
        raise HivemindChanged(f"hivemind changed since shoal's overrides were written: {'; '.join(changed)}. "
                              "Re-check averaging/network/hivemind/ against it (docs/hivemind.md) before upgrading")
