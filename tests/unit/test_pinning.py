"""The one check both hivemind pin tables run: a function whose source changed is named."""

from __future__ import annotations

from protocols.pinning import changed_functions, source_digest


def reviewed() -> int:
    return 1


def edited() -> int:
    return 2


def test_a_function_whose_source_changed_is_named_and_an_unchanged_one_is_not():
    pins = {"reviewed": source_digest(reviewed), "edited": source_digest(reviewed)}
    assert changed_functions(pins, {"reviewed": reviewed, "edited": edited}) == ["edited"]
    assert len(source_digest(reviewed)) == 64 and source_digest(reviewed) != source_digest(edited)
