"""The library's settings: how rounds end and how pseudo-gradients are averaged.

A library user passes these to ``DiLoCoSwarm``; ``shoal run`` reads them from the ``[round]`` and
``[averaging]`` sections of its TOML file. ``sync_shared_fields`` lists what every peer of a run
must agree on for the sync protocol itself, whatever the model and training loop.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from enum import Enum
from typing import Any

from averaging.engine.config import SyncMode, validate_sync
from averaging.math.fingerprints import DEFAULT_ABS_TOL, DEFAULT_REL_TOL
from averaging.math.groups import RULE as SUB_GROUPS_RULE
from averaging.math.outer_step import OuterConfig
from averaging.math.robust import AGGREGATIONS, RobustConfig
from averaging.math.wire import (
    COMPRESSIONS,
    RETURN_CODES,
    WireFormat,
    mix_code,
    state_compression_problem,
)
from protocols.errors import ConfigError
from protocols.keys import AUTO_SHARDS, validate_shards_setting


@dataclass(kw_only=True, slots=True)
class RoundConfig:
    """Rounds are wall-clock windows on a schedule every peer shares."""

    seconds: float = 10.0  # overlap mode: length of one round on the shared wall-clock schedule
    sync_mode: SyncMode = SyncMode.OVERLAP  # overlap (background sync) | blocking (H steps, then wait: the baseline)
    inner_steps: int = 100  # blocking mode: inner steps per round (H)

    def __post_init__(self):
        if not 1.0 <= self.seconds <= 86400:
            raise ConfigError(f"round.seconds ({self.seconds}) must be in [1, 86400]; use --round-seconds 10 for a CPU test run")
        self.sync_mode = validate_sync(self.sync_mode, self.inner_steps)


@dataclass(kw_only=True, slots=True)
class AveragingConfig:
    """How pseudo-gradients are averaged (hivemind butterfly all-reduce)."""

    # int4 sends with int4 returns of the average: the benchmarks' choice (docs/benchmarks.md, Compression).
    compression: str = "int4"  # fp32 | fp16 | int8 | int4 | int2 (docs/codecs.md)
    block_size: int = 0  # int codes: values per fp16 scale; 0 = the code's default (64 int8/int4, 256 int2)
    # int codes: how reducers return averages, fp16 (deltas) | int8 | int4 (the average itself) |
    # auto (int8 for int8 sends, int4 for int4 and int2)
    return_compression: str = "auto"
    error_feedback: bool = True  # int codes: what quantization drops re-enters the next round (per peer)
    # 0 = one group of everybody each round (up to 64). Else sub-groups of about this size (8-16 for
    # a large swarm) that change every round and also average their members' anchors and momenta
    # (averaging.engine.subgroups, docs/scale.md). Shared. Only partly hardened against strangers
    # (docs/security.md): prefer private swarms.
    target_group_size: int = 0
    # Sub-groups: the code of the anchors and momenta on the wire. "auto" (or "lat8"): the 1-byte
    # lattice code (averaging.math.lattice) where reducers return the average and no inner moments
    # ride, else fp32; "fp16" and "fp32" force those. Shared.
    state_compression: str = "auto"
    min_group_size: int = 2
    matchmaking_seconds: float = 3.0  # hivemind min_matchmaking_time
    request_timeout: float = 1.5  # must be < matchmaking_seconds
    allreduce_timeout: float = 60.0
    rel_tol: float = DEFAULT_REL_TOL  # anchors agree within rel_tol x RMS of the last pseudo-gradient
    abs_tol: float = DEFAULT_ABS_TOL
    # How a reducer combines its senders' parts (averaging/math/robust.py): centered_clip equals the weighted
    # mean when nobody is an outlier, and bounds what one stranger can move; "mean" is hivemind's.
    aggregation: str = "centered_clip"  # mean | centered_clip | trimmed_mean
    ban_rounds: int = 10  # a peer whose part or returned average was refused sits out this many rounds
    # A reducer whose answer stream fails in strike_limit of the last strike_window rounds is banned too
    # (honest ones fail now and then: docs/security.md, "Reducers that fail rounds"); 0 = never.
    strike_limit: int = 5
    strike_window: int = 20
    # The run's progress records under this many DHT keys, spreading the reads over more DHT nodes
    # (docs/scale.md): "auto" (follows the swarm's size: protocols.keys.auto_progress_shards) or a
    # fixed power of two. Shared.
    progress_shards: int | str = AUTO_SHARDS
    # Average the inner optimizer's moments (AdamW's two, Muon's one) with every round, in bf16. It
    # helped in simulation but not on the real swarm, and costs about 8.5x a round's bytes
    # (docs/benchmarks.md, "The inner state averaged"). Shared.
    average_inner_state: bool = False

    def __post_init__(self):
        if self.compression not in COMPRESSIONS:
            fix = '; use "fp32" for no compression' if self.compression == "none" else ""
            raise ConfigError(f"averaging.compression ({self.compression!r}) must be one of: "
                              f"{', '.join(COMPRESSIONS)}{fix}")
        if self.return_compression not in ("auto", *RETURN_CODES):
            raise ConfigError(f"averaging.return_compression ({self.return_compression!r}) must be one of: auto, "
                              f"{', '.join(RETURN_CODES)} (int2 is too coarse for the average)")
        if not 0 <= self.block_size <= 2**16:
            raise ConfigError(f"averaging.block_size ({self.block_size}) must be in [1, 65536], or 0 for the codec's "
                              "default (64 for int8/int4, 256 for int2)")
        if self.target_group_size < 0 or self.target_group_size == 1 or self.min_group_size < 2:
            raise ConfigError("averaging.target_group_size must be 0 (one group of everybody) or at least 2 "
                              "(sub-groups of about that many peers: 8-16 for a large swarm), and "
                              "averaging.min_group_size >= 2")
        problem = state_compression_problem(self.wire, with_inner_state=self.average_inner_state,
                                            requested=self.state_compression)
        if problem is not None:
            raise ConfigError(f"averaging.state_compression ({self.state_compression!r}) {problem}")
        if not 0 < self.request_timeout < self.matchmaking_seconds:
            raise ConfigError(
                f"averaging.request_timeout ({self.request_timeout}) must be below averaging.matchmaking_seconds "
                f"({self.matchmaking_seconds}), or matchmaking can deadlock"
            )
        if self.aggregation not in AGGREGATIONS:
            raise ConfigError(f"averaging.aggregation ({self.aggregation!r}) must be one of: {', '.join(AGGREGATIONS)}")
        if self.ban_rounds < 0:
            raise ConfigError(f"averaging.ban_rounds ({self.ban_rounds}) must be >= 0 (0 = never ban)")
        if self.strike_limit < 0 or self.strike_window < max(1, self.strike_limit):
            raise ConfigError(f"averaging.strike_limit ({self.strike_limit}) must be >= 0 (0 = never) and "
                              f"averaging.strike_window ({self.strike_window}) at least the limit and >= 1")
        validate_shards_setting(self.progress_shards)
        if self.allreduce_timeout <= 0 or self.rel_tol <= 0 or self.abs_tol < 0:
            raise ConfigError("averaging.allreduce_timeout and averaging.rel_tol must be > 0, averaging.abs_tol >= 0")


    @property
    def robust(self) -> RobustConfig:
        """The reducer's rules (``ShoalAverager`` also caps a group at target_group_size, when set)."""
        return RobustConfig(aggregation=self.aggregation, ban_rounds=self.ban_rounds,
                            strike_limit=self.strike_limit, strike_window=self.strike_window)

    @property
    def wire(self) -> WireFormat:
        """The payload's codec, with the block size resolved."""
        return WireFormat.of(self.compression, return_compression=self.return_compression,
                             block_size=self.block_size, error_feedback=self.error_feedback)


def sync_shared_fields(*, outer: OuterConfig, rounds: RoundConfig, averaging: AveragingConfig) -> dict[str, Any]:
    """What the sync protocol itself needs every peer to agree on (any model, any loop)."""
    wire = averaging.wire
    return {
        **{f"outer.{f.name}": getattr(outer, f.name) for f in dataclasses.fields(outer)},
        **{f"round.{f.name}": _plain(getattr(rounds, f.name)) for f in dataclasses.fields(rounds)},
        # the consistency verdict must be the same on every member of a group
        **{f"averaging.{name}": getattr(averaging, name) for name in ("compression", "rel_tol", "abs_tol")},
        # hivemind cuts parts from the codec's block size and the group size it balances for, and
        # re-encodes returns in the sender's return code: peers must cut and decode alike.
        "averaging.block_size": wire.block_size,
        "averaging.return_compression": wire.return_code,
        "averaging.target_group_size": averaging.target_group_size,
        "averaging.progress_shards": averaging.progress_shards,  # every peer reads and writes the same keys
        # Sub-groups change the all-reduce (anchors and momenta ride it) and the matchmaking keys.
        # ``sub_groups`` is the assignment rule's version (averaging.math.groups.RULE).
        "averaging.sub_groups": SUB_GROUPS_RULE,
        # the anchors' and momenta's code on the wire with sub-groups (members must decode alike)
        "averaging.state_code": mix_code(wire, with_inner_state=averaging.average_inner_state,
                                         requested=averaging.state_compression),
        "averaging.average_inner_state": averaging.average_inner_state,  # every member's all-reduce carries them
    }


def _plain(value: Any) -> Any:
    """Enums travel as their plain value: the manifest holds JSON scalars only."""
    return value.value if isinstance(value, Enum) else value
