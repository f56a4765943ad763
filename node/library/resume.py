"""Saving the shared state to ``--checkpoint-dir`` and resuming from the newest valid checkpoint.

A checkpoint holds the anchor (by parameter name), the outer momentum and the outer state's
counters; turning it back into the flat state goes through the same validation as a state
downloaded from a peer (``SharedState.adopt``), so a checkpoint can never inject NaNs or a
different layout. A checkpoint of another run or config is refused, not silently mixed in.
"""

from __future__ import annotations

import logging
import struct
from collections.abc import Callable
from pathlib import Path

import torch

from averaging.math.flat import FlatLayout
from averaging.state.served import DownloadedState
from node.library.checkpoint import Checkpoint, list_checkpoints, load_latest_valid, save_checkpoint
from protocols.errors import CheckpointError, ConfigError

logger = logging.getLogger(__name__)

MOMENTUM_PREFIX = "momentum."


def outer_meta(metadata: dict) -> dict:
    """The outer state's counters as JSON for ``meta.json`` (the consistency scale as floats)."""
    scale = metadata["scale"]
    return {"v": metadata["v"], "round": metadata["round"], "rounds_done": metadata["rounds_done"],
            "scale": list(struct.unpack(f"<{len(scale) // 8}d", scale))}


def save_shared_state(checkpoint_dir: Path, layout: FlatLayout, state: tuple[dict, list[torch.Tensor]], *,
                      meta: dict, local_state: dict[str, torch.Tensor] | None = None) -> tuple[Path, int]:
    """Write one consistent copy of the shared state (``SharedState.shared_state()``: metadata,
    [anchor, momentum]) as a checkpoint, with the peer's own ``local_state`` if given; returns its
    path and round."""
    metadata, (anchor, momentum) = state
    params = dict(layout.views(anchor))
    outer_state = {f"{MOMENTUM_PREFIX}{k}": v for k, v in layout.views(momentum).items()}
    path = save_checkpoint(checkpoint_dir, round=metadata["round"], params=params, outer_state=outer_state,
                           meta={**meta, "rounds_done": metadata["rounds_done"], "outer": outer_meta(metadata)},
                           local_state=local_state)
    return path, metadata["round"]


def find_resume_point(checkpoint_dir: Path, on_invalid: Callable[[CheckpointError], None]) -> Checkpoint | None:
    """The newest checkpoint that verifies; each newer broken one is reported. A directory whose
    checkpoints are all broken is an error (resuming from nothing would silently lose the run)."""
    found = load_latest_valid(checkpoint_dir, on_invalid=on_invalid)
    if found is None and list_checkpoints(checkpoint_dir):
        raise CheckpointError(f"no valid checkpoint in {checkpoint_dir} (every one failed verification, see above); "
                              "delete the broken ones to start fresh, or use another --checkpoint-dir")
    return found


def state_from_checkpoint(checkpoint: Checkpoint, layout: FlatLayout, *, run_id: str,
                          config_hash: str | None) -> DownloadedState:
    """The checkpoint as a shared state for ``SharedState.adopt`` (which validates values)."""
    meta = checkpoint.meta
    if meta.get("run_id") != run_id:
        raise ConfigError(f"checkpoint {checkpoint.path} belongs to run {meta.get('run_id')!r}, not {run_id!r}; "
                          "pass that run's --run-id or another --checkpoint-dir")
    if config_hash is not None and meta.get("config_hash") != config_hash:
        raise ConfigError(f"checkpoint {checkpoint.path} was written with another config (hash "
                          f"{meta.get('config_hash')}, this run {config_hash}); use the config it was trained with "
                          "or another --checkpoint-dir")
    outer = meta.get("outer")
    if not isinstance(outer, dict) or not isinstance(outer.get("scale"), list):
        raise CheckpointError(f"checkpoint {checkpoint.path}/meta.json has no outer state; it cannot be resumed")
    momentum = {name[len(MOMENTUM_PREFIX):]: t for name, t in checkpoint.outer_state.items()
                if name.startswith(MOMENTUM_PREFIX)}
    for what, tensors in (("model", checkpoint.params), ("momentum", momentum)):
        if set(tensors) != set(layout.names):
            missing, extra = set(layout.names) - set(tensors), set(tensors) - set(layout.names)
            raise ConfigError(f"checkpoint {checkpoint.path} {what} tensors do not match this model "
                              f"(missing {sorted(missing)[:3]}, unexpected {sorted(extra)[:3]})")
    for name, shape in zip(layout.names, layout.shapes):
        for what, tensors in (("model", checkpoint.params), ("momentum", momentum)):
            if tuple(tensors[name].shape) != tuple(shape):
                raise ConfigError(f"checkpoint {checkpoint.path} {what} tensor {name} has shape "
                                  f"{tuple(tensors[name].shape)}, this model {tuple(shape)}; use the config it was "
                                  "trained with or another --checkpoint-dir")
    try:
        anchor = layout.pack(checkpoint.params, layout.new_buffer())
        flat_momentum = layout.pack(momentum, layout.new_buffer())
    except (RuntimeError, ValueError) as e:
        raise ConfigError(f"checkpoint {checkpoint.path} does not fit this model: {e}") from None
    try:
        scale = struct.pack(f"<{len(outer['scale'])}d", *outer["scale"])
    except struct.error:
        raise CheckpointError(f"checkpoint {checkpoint.path}/meta.json has a corrupt outer scale") from None
    metadata = {"v": outer.get("v"), "numel": layout.numel, "round": outer.get("round"),
                "rounds_done": outer.get("rounds_done"), "scale": scale}
    return DownloadedState(peer=f"checkpoint {checkpoint.path}", metadata=metadata,
                           tensors=[anchor.to(torch.float32), flat_momentum.to(torch.float32)])
