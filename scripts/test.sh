#!/usr/bin/env bash
# The suite as two pytest sessions side by side: the unit tests (one core, in-process) beside the
# integration tests, whose real swarms are throttled to leave about a core idle on average (13
# minutes one after the other here, on two cores). The light integration tests (no training swarm)
# go first (tests/integration/conftest.py), so the unit tests' core is taken while only those run.
set -uo pipefail
PY="${1:-.venv/bin/python}"
unit_log="$(mktemp)"
trap 'rm -f "$unit_log"' EXIT
"$PY" -m pytest tests/unit -p no:cacheprovider >"$unit_log" 2>&1 &
unit=$!
"$PY" -m pytest tests/integration
integration=$?
wait "$unit"
unit_rc=$?
echo "=== unit tests (run beside the integration tests) ==="
cat "$unit_log"
exit $(( integration != 0 || unit_rc != 0 ))
