"""The run manifest: encoding round trip, validation of what the DHT returns, refusal messages."""

from __future__ import annotations

import pytest

from protocols import manifest
from protocols.errors import ConfigError
from protocols.manifest import PROTOCOL_VERSION, RunManifest, check_compatible, decode, fields_hash
from protocols.messages import MessageError

FIELDS = {"model.d_model": 64, "outer.lr": 0.7, "round.seconds": 10.0, "averaging.compression": "fp16",
          "outer.nesterov": True, "parameters": "abcd"}


def make(**changes) -> RunManifest:
    fields = {**FIELDS, **changes}
    return RunManifest.create("run-1", fields, start_time=1000.0, round_seconds=fields["round.seconds"])


def test_round_trip_keeps_every_field():
    ours = make()
    assert decode(ours.encode()) == ours
    assert ours.protocol == PROTOCOL_VERSION and ours.config_hash == fields_hash(FIELDS)


def test_hash_ignores_key_order():
    assert fields_hash(dict(reversed(list(FIELDS.items())))) == fields_hash(FIELDS)


def test_identical_configs_are_compatible():
    check_compatible(make(), decode(make().encode()).with_start(5.0))  # a different start is not a conflict


def test_a_differing_field_is_named_with_both_values():
    with pytest.raises(ConfigError, match=r"model\.d_model=128 \(this peer: 64\)"):
        check_compatible(make(), make(**{"model.d_model": 128}))


def test_a_missing_field_is_named():
    theirs = RunManifest.create("run-1", {k: v for k, v in FIELDS.items() if k != "parameters"},
                                start_time=1.0, round_seconds=10.0)
    with pytest.raises(ConfigError, match=r"parameters='<missing>'"):
        check_compatible(make(), theirs)


def test_another_protocol_version_is_refused_with_the_fix():
    theirs = decode({**make().encode(), "protocol": PROTOCOL_VERSION + 1})
    with pytest.raises(ConfigError, match="upgrade shoal"):
        check_compatible(make(), theirs)


def test_another_run_id_is_refused():
    theirs = RunManifest.create("run-2", FIELDS, start_time=1.0, round_seconds=10.0)
    with pytest.raises(ConfigError, match="--run-id run-2"):
        check_compatible(make(), theirs)


@pytest.mark.parametrize("mutate", [
    lambda v: "not a map",
    lambda v: {**v, "v": 99},
    lambda v: {**v, "hash": "0" * 32},  # fields tampered with / hash does not match
    lambda v: {**v, "fields": {**v["fields"], "outer.lr": 0.1}},
    lambda v: {**v, "protocol": "1"},
    lambda v: {**v, "protocol": True},
    lambda v: {**v, "start_time": float("nan")},
    lambda v: {**v, "round_seconds": 0},
    lambda v: {**v, "round_seconds": 1e9},
    lambda v: {**v, "run_id": "../etc"},
    lambda v: {**v, "fields": [1, 2]},
    lambda v: {**v, "fields": {f"k{i}": i for i in range(manifest.MAX_FIELDS + 1)}},
    lambda v: {**v, "fields": {"x" * 100: 1}},
    lambda v: {**v, "fields": {"a": {"nested": 1}}},
    lambda v: {**v, "fields": {"a": "x" * 1000}},
    lambda v: {**v, "fields": {"a": float("inf")}},
])
def test_malformed_manifests_are_refused(mutate):
    with pytest.raises(MessageError):
        decode(mutate(make().encode()))


def test_create_rejects_unsupported_local_fields_as_config_errors():
    with pytest.raises(ConfigError):
        RunManifest.create("run-1", {"a": object()}, start_time=0.0, round_seconds=1.0)
    with pytest.raises(ConfigError):
        RunManifest.create("bad id!", FIELDS, start_time=0.0, round_seconds=1.0)
