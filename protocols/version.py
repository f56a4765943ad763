"""Versions, defined once: the wire protocol peers speak and the shoal release installed."""

from __future__ import annotations

from functools import cache
from importlib import metadata

# Bump when peers of two versions can no longer average together (message schemas, state layout,
# or a rule every member of a group must compute alike: tests/unit/test_rule_versions.py ties them).
# Carried in every claim message and run manifest; a joiner with another version is refused.
PROTOCOL_VERSION = 6  # 2: balanced fp16/fp32 parts, the outer-update RPC (catch-up); 3: claims in state metadata;
# 4: state slices cut at the anchor's fingerprint chunks (download.slice_bounds with slice_alignment);
# 5: int8 returns carry the quantized average, not a delta (averaging.network.hivemind.codecs), int4 returns
# 6: far_members' FAR_RELATIVE bar over the whole anchor, not per chunk (a5d300d); every manifest field unconditional


@cache
def shoal_version() -> str:
    """The installed shoal release (progress records, checkpoints, the exporter's info metric)."""
    try:
        return metadata.version("shoal")
    except metadata.PackageNotFoundError:
        return "0+unknown"
