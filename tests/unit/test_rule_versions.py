"""Every rule peers must agree on carries a version, tied here to the rule's constants and code.

Members of a group each compute who is far, the group's lattice grid, the consensus anchor, where
parts and state slices are cut, which sub-group a peer is in, and each judges what it receives
against shared bounds. Two peers one commit apart that compute these differently disagree
silently; a version they compare at join (``PROTOCOL_VERSION`` in every manifest and claim, the
sub-group rule's ``averaging.math.groups.RULE`` in the manifest) refuses the mix instead. So this
test fingerprints the rules (constants, and the code of the few core rule functions, comments and
docstrings aside) and fails when a fingerprint changes while its version did not.

Rules are named ``module:attribute``: moving one is a one-line change here (the fingerprint holds
an attribute's name and value, never its module).
"""

from __future__ import annotations

import ast
import dataclasses
import hashlib
import importlib
import inspect
import struct
import textwrap
from typing import Any

import pytest

from averaging.math import fingerprints, groups
from protocols.version import PROTOCOL_VERSION

# -- the rules -----------------------------------------------------------------------------------

PROTOCOL_RULES: dict[str, tuple[str, ...]] = {
    # the anchor's fingerprint and the consensus on it (averaging.math.fingerprints)
    "fingerprint": (
        "averaging.math.fingerprints:SIGN_PERIOD", "averaging.math.fingerprints:NUM_PROJECTIONS",
        "averaging.math.fingerprints:MAX_CHUNKS", "averaging.math.fingerprints:SIGN_SEED",
        "averaging.math.fingerprints:DEFAULT_REL_TOL", "averaging.math.fingerprints:DEFAULT_ABS_TOL",
        "averaging.math.fingerprints:_sign_table", "averaging.math.fingerprints:chunk_length",
        "averaging.math.fingerprints:chunk_projections", "averaging.math.fingerprints:rms_difference",
        "averaging.math.fingerprints:agree", "averaging.math.fingerprints:chunks_agree",
        "averaging.math.fingerprints:consensus", "averaging.math.fingerprints:tie_rank",
    ),
    # who a sub-group's mean leaves out (the reducers and every member's check of the mean)
    "far rule": (
        "averaging.math.fingerprints:FAR_FACTOR", "averaging.math.fingerprints:FAR_STEPS",
        "averaging.math.fingerprints:FAR_RELATIVE", "averaging.math.fingerprints:far_members",
        "averaging.math.fingerprints:pooled_rms", "averaging.math.fingerprints:anchor_rms",
        "averaging.math.lattice:WITHIN_STEPS", "averaging.math.lattice:far", "averaging.math.lattice:left_out",
        "averaging.math.group_view:decode_claims", "averaging.math.group_view:group_view",
        "averaging.engine.subgroups:left_out", "averaging.engine.subgroups:donors_if_far",
    ),
    # the lattice code's grid (the 32-step rule) and its residues
    "lattice": (
        "averaging.math.lattice:LEVELS", "averaging.math.lattice:HALF", "averaging.math.lattice:RANGE_STEPS",
        "averaging.math.lattice:RANGE_SPREAD", "averaging.math.lattice:RANGE_CAP_STEPS",
        "averaging.math.lattice:MIN_HALF_RANGE", "averaging.math.lattice:_half_ranges",
        "averaging.math.lattice:group_lattice", "averaging.math.lattice:wrap", "averaging.math.lattice:unwrap",
        "averaging.math.lattice:reference_part", "averaging.math.lattice:to_residues_",
        "averaging.math.lattice:from_residues_",
    ),
    # the payload's formats and how hivemind cuts it into parts
    "codecs": (
        "averaging.math.codecs:MAGIC", "averaging.math.codecs:VERSION", "averaging.math.codecs:HEADER",
        "averaging.math.codecs:MAX_BLOCK_SIZE", "averaging.math.codecs:MIN_EXPONENT",
        "averaging.math.codecs:MAX_EXPONENT", "averaging.math.codecs:SCALE_TOP_BINADE",
        "averaging.math.codecs:TERNARY_THRESHOLD", "averaging.math.codecs:FP16_MAX_EXPONENT",
        "averaging.math.codecs:FP16_NONFINITE_BITS", "averaging.math.codecs:LATTICE_LEVELS",
        "averaging.math.codecs:CODES",
        "averaging.math.wire:FLOAT_CODES", "averaging.math.wire:QUANTIZED_CODES", "averaging.math.wire:RETURN_CODES",
        "averaging.math.wire:AVERAGE_RETURN_CODES", "averaging.math.wire:STATE_BYTES_PER_VALUE",
        "averaging.math.wire:EXTRA_CODE",
        "averaging.network.hivemind.codecs:SEND_CODES", "averaging.network.hivemind.codecs:DEFAULT_RETURN_CODE",
        "averaging.network.hivemind.codecs:EXTRA_CODES", "averaging.network.hivemind.codecs:MAX_PART_NUMEL",
        "averaging.network.hivemind.codecs:WIRE_TYPES",
        "averaging.network.hivemind.parts:HIVEMIND_PART_BYTES", "averaging.network.hivemind.parts:OPEN_GROUP_PARTS",
        "averaging.network.hivemind.parts:balanced_part_size", "averaging.network.hivemind.parts:part_values",
    ),
    # what a reducer refuses and how it aggregates
    "robust": ("averaging.math.robust:AGGREGATIONS", "averaging.math.robust:RobustConfig"),
    # what a member accepts into its state, and how states and outer steps are served
    "state": (
        "averaging.state.accept:MAX_AVERAGE_TO_LOCAL_RATIO", "averaging.state.accept:MAX_CLAIMED_SCALE_RATIO",
        "averaging.state.accept:MAX_CATCH_UP_TO_LAST_RATIO", "averaging.state.accept:MAX_MOMENTUM_TO_STEP_RATIO",
        "averaging.state.shared_state:HISTORY_ROUNDS", "averaging.state.served:STATE_VERSION",
        "averaging.math.outer_step:kept_step",
        "averaging.engine.subgroups:ESTIMATE_SLACK", "averaging.engine.subgroups:STEP_SLACK",
        "averaging.engine.subgroups:state_problem", "averaging.engine.subgroups:group_rounds_done",
        "averaging.network.slices:slice_bounds", "averaging.network.slices:slice_alignment",
        "averaging.network.slices:slice_units",
        "averaging.network.hivemind.fetching:UPDATE_VERSION", "averaging.network.hivemind.fetching:METADATA_CAP_BYTES",
        "averaging.network.hivemind.averager:STATE_REQUEST",
    ),
    # messages inside a round and between peers: schemas' versions and size limits
    "messages": (
        "protocols.messages:MAX_FINGERPRINT_VALUES", "protocols.messages:MAX_ROUND",
        "protocols.signed_claims:SIGNATURE_FIELD", "protocols.signed_claims:PUBLIC_KEY_FIELD",
        "protocols.signed_claims:UNSIGNED_FIELDS", "protocols.signed_claims:MAX_SIGNATURE_BYTES",
        "protocols.signed_claims:_DOMAIN", "protocols.admission:PROOF_BYTES",
        "protocols.identity:MAX_PUBLIC_KEY_BYTES", "protocols.identity:MIN_RSA_BITS",
        "protocols.identity:MAX_RSA_BITS", "protocols.identity:RUN_KEY_BYTES",
        "protocols.state_slices:MAX_SLICES", "protocols.state_slices:MAX_SLICE_REQUEST_BYTES",
        "protocols.state_slices:MAX_UPDATE_REQUEST_BYTES", "protocols.state_slices:MAX_STEPS",
        "protocols.safe_decoding:MAX_EXT_DEPTH", "protocols.safe_decoding:MAX_MESSAGE_BYTES",
        "protocols.safe_decoding:MAX_CONTAINER_LEN",
    ),
    # DHT records: the manifest, progress heartbeats, their envelopes and limits
    "records": (
        "protocols.manifest:MANIFEST_VERSION", "protocols.manifest:SIGNED_VERSION", "protocols.manifest:MAX_FIELDS",
        "protocols.manifest:MAX_KEY_CHARS", "protocols.manifest:MAX_VALUE_CHARS",
        "protocols.manifest:MAX_ROUND_SECONDS", "protocols.manifest:MIN_START_TIME", "protocols.manifest:START_SLACK",
        "protocols.manifest:fields_hash",
        "protocols.records:MAX_VALUE_BYTES", "protocols.records:EXPIRATION_SLACK", "protocols.records:MANIFEST_TTL",
        "protocols.records:MAX_PROGRESS_TTL", "protocols.records:MAX_ANY_TTL", "protocols.records:MAX_ANY_VALUE_BYTES",
        "protocols.records:SIGNED_TAG", "protocols.records:SEALED_TAG",
        "protocols.progress:PROGRESS_VERSION", "protocols.progress:MODES", "protocols.progress:MAX_TEXT",
        "protocols.progress:MAX_COUNT", "protocols.progress:MAX_RATE", "protocols.progress:MAX_LOSS",
        "protocols.progress:MAX_TIME", "protocols.progress:MAX_SUBKEY_BYTES", "protocols.progress:MAX_SHARDS",
        "protocols.progress:MAX_LATENESS", "protocols.progress:MAX_CLOCK_OFFSET", "protocols.progress:MAX_ADDRS",
        "protocols.progress:MAX_ADDR_CHARS", "protocols.progress:MAX_GROUPS",
        "protocols.keys:MAX_PROGRESS_SHARDS",
    ),
}

# The sub-group assignment (which group a peer is in, and under which matchmaking key), versioned
# on its own by ``averaging.math.groups.RULE`` (the manifest's ``averaging.sub_groups``).
GROUP_RULES: tuple[str, ...] = (
    "averaging.math.groups:ROUND_BITS", "averaging.math.groups:_HASH_BITS", "averaging.math.groups:_PERSON",
    "averaging.math.groups:group_count", "averaging.math.groups:settled_group_count",
    "averaging.math.groups:agreed_group_count", "averaging.math.groups:most_published",
    "averaging.math.groups:round_hash", "averaging.math.groups:balanced_groups", "averaging.math.groups:group_among",
    "averaging.math.groups:group_key_bits", "averaging.math.groups:members",
)

# -- the fingerprints each version stands for -----------------------------------------------------

# PROTOCOL_VERSION -> {part: fingerprint}
PROTOCOL_FINGERPRINTS: dict[int, dict[str, str]] = {
    6: {"fingerprint": "a11ed49042c2f057", "far rule": "f084301e951362a3", "lattice": "55be0abb80abab23",
        "codecs": "b52784ae1f9ae618", "robust": "50d021e6c96ce060", "state": "75044441c77a6f9d",
        "messages": "2810d9ca05ad3abf", "records": "93fb66f5631a10ee"},
}
# (PROTOCOL_VERSION, groups.RULE) -> fingerprint
GROUP_FINGERPRINTS: dict[tuple[int, int], str] = {
    (6, 2): "c4e6167c723af6f6",
}
# The fingerprints' sign table as drawn from torch's seeded generator (``fingerprints._sign_table``).
SIGN_TABLE_SHA256 = "3f8ae2aeacb9262e6c55a7ef2d84c29dce1de290fa10167f15bac13a070be39c"

# -- fingerprinting --------------------------------------------------------------------------------


def resolve(name: str) -> Any:
    """``module:attribute`` (the attribute possibly dotted) as the object it names."""
    module, attribute = name.split(":")
    value: Any = importlib.import_module(module)
    for part in attribute.split("."):
        value = getattr(value, part)
    return value


def code_digest(function: Any) -> str:
    """The function's code as its syntax tree, without its name, docstrings, comments or layout, so
    that only a change in what it computes (or in what it calls) changes the digest."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(inspect.unwrap(function))))
    definition = tree.body[0]
    assert isinstance(definition, ast.FunctionDef), f"{function.__qualname__} is not a plain function"
    return hashlib.sha256(repr(_tree(definition, top=True)).encode()).hexdigest()[:16]


def _tree(node: Any, *, top: bool = False) -> Any:
    if isinstance(node, list):
        body = node
        if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
                and isinstance(body[0].value.value, str):
            body = body[1:]  # a docstring
        return tuple(_tree(item) for item in body)
    if not isinstance(node, ast.AST):
        return repr(node)
    # Fields left out: the context (load/store), and empty or absent ones (Python versions add
    # fields such as type_params that are empty in this code).
    return (type(node).__name__, tuple((field, _tree(value)) for field, value in ast.iter_fields(node)
                                       if value not in (None, []) and field != "ctx"
                                       and not (top and field == "name")))


def canonical(value: Any) -> Any:
    """A value as plain nested tuples of strings, the same in every process."""
    if callable(value) and not isinstance(value, type):  # a function (or a cached or no_grad one)
        return ("code", code_digest(value))
    if isinstance(value, type) and dataclasses.is_dataclass(value):
        return ("defaults", tuple((f.name, "factory" if f.default is dataclasses.MISSING else canonical(f.default))
                                  for f in dataclasses.fields(value)))
    if dataclasses.is_dataclass(value):
        return tuple((f.name, canonical(getattr(value, f.name))) for f in dataclasses.fields(value))
    if isinstance(value, struct.Struct):
        return ("struct", value.format)
    if isinstance(value, dict):
        return tuple(sorted((repr(key), canonical(item)) for key, item in value.items()))
    if isinstance(value, set | frozenset):
        return tuple(sorted(repr(item) for item in value))
    if isinstance(value, list | tuple):
        return tuple(canonical(item) for item in value)
    if value is None or isinstance(value, bool | int | float | str | bytes):
        return repr(value)
    raise TypeError(f"no canonical form for {type(value).__name__}: add one to canonical()")


def fingerprint(names: tuple[str, ...]) -> str:
    """The rules' names (attribute only) and canonical values, hashed."""
    entries = [(name.split(":")[1], canonical(resolve(name))) for name in names]
    return hashlib.sha256(repr(entries).encode()).hexdigest()[:16]


def protocol_fingerprints() -> dict[str, str]:
    return {part: fingerprint(names) for part, names in PROTOCOL_RULES.items()}


def check(table: dict, version: Any, actual: Any, *, what: str, version_name: str) -> None:
    """Fail unless ``table[version]`` is ``actual``, naming the fix."""
    here = "tests/unit/test_rule_versions.py"
    if version not in table:
        pytest.fail(f"{version_name} = {version!r} has no fingerprint of {what}: add {version!r}: {actual!r} "
                    f"to {here}", pytrace=False)
    expected = table[version]
    if expected == actual:
        return
    if isinstance(actual, dict):
        what = f"{what} ({', '.join(sorted(part for part in actual if expected.get(part) != actual[part]))})"
    pytest.fail(f"{what} changed while {version_name} = {version!r} did not: peers one commit apart would "
                f"disagree silently. Bump PROTOCOL_VERSION in protocols/version.py (or the rule's own version) "
                f"and add the new fingerprint here ({here}) under the new version: {actual!r}", pytrace=False)


# -- tests ---------------------------------------------------------------------------------------


def test_the_rules_peers_agree_on_match_the_protocol_version():
    check(PROTOCOL_FINGERPRINTS, PROTOCOL_VERSION, protocol_fingerprints(), what="the rules peers agree on",
          version_name="PROTOCOL_VERSION")


def test_the_sub_group_rule_matches_its_version():
    check(GROUP_FINGERPRINTS, (PROTOCOL_VERSION, groups.RULE), fingerprint(GROUP_RULES),
          what="the sub-group assignment rule", version_name="(PROTOCOL_VERSION, groups.RULE)")


def test_the_sign_table_is_the_one_every_peer_draws():
    """The table comes from torch's seeded generator: another torch that drew other signs would make
    peers of one shoal version fingerprint differently, which no version here could refuse."""
    table = fingerprints._sign_table().numpy().tobytes()
    assert hashlib.sha256(table).hexdigest() == SIGN_TABLE_SHA256, (
        "torch's generator draws another sign table: store the table in averaging.math.fingerprints "
        "instead of drawing it, so that every peer keeps the same one")


def test_a_changed_far_rule_fails_the_check(monkeypatch):
    before = protocol_fingerprints()
    monkeypatch.setattr(fingerprints, "FAR_RELATIVE", fingerprints.FAR_RELATIVE * 1.2)
    after = protocol_fingerprints()
    assert [part for part in before if before[part] != after[part]] == ["far rule"]
    with pytest.raises(pytest.fail.Exception, match=r"\(far rule\) changed .*Bump PROTOCOL_VERSION"):
        check({PROTOCOL_VERSION: before}, PROTOCOL_VERSION, after, what="the rules peers agree on",
              version_name="PROTOCOL_VERSION")
    with pytest.raises(pytest.fail.Exception, match=f"PROTOCOL_VERSION = {PROTOCOL_VERSION + 1} has no fingerprint"):
        check({PROTOCOL_VERSION: before}, PROTOCOL_VERSION + 1, after, what="the rules peers agree on",
              version_name="PROTOCOL_VERSION")


def _rule(values, bar=0.5):
    return [v > bar for v in values]


def _documented_rule(values, bar=0.5):
    """The same rule, documented and laid out differently."""
    # a comment
    return [v > bar
            for v in values]


def _changed_rule(values, bar=0.5):
    return [v >= bar for v in values]


def test_a_rule_function_is_fingerprinted_by_what_it_computes():
    assert code_digest(_rule) == code_digest(_documented_rule)
    assert code_digest(_rule) != code_digest(_changed_rule)
