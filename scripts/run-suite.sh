#!/usr/bin/env bash
# `make test`'s suite, in two stages for a 2-core machine (run alone, the suite keeps about one core
# busy):
#   1. three streams at once: the CPU-bound unit tests; the unit tests marked ``wall_clock``
#      (in-process swarms waiting on real rounds); the integration tests marked ``wall_clock``
#      (light processes, mostly waiting on rounds or timeouts);
#   2. the other integration tests, one at a time: their swarms are sized for both cores.
# The first stream prints as it runs, the other two when stage 1 ends. Any failure fails the run;
# Ctrl+C stops every stream. Usage: scripts/run-suite.sh PYTHON [pytest args...]
set -uo pipefail
py=$1
shift
cd "$(dirname "$0")/.."
logs=$(mktemp -d)
trap 'kill 0 2>/dev/null; rm -rf "$logs"' INT TERM
trap 'rm -rf "$logs"' EXIT

"$py" -m pytest tests -m "wall_clock and not integration" "$@" >"$logs/unit_wall_clock.txt" 2>&1 &
unit_waits=$!
"$py" -m pytest tests -m "wall_clock and integration" "$@" >"$logs/integration_wall_clock.txt" 2>&1 &
integration_waits=$!
"$py" -m pytest tests -m "not integration and not wall_clock" "$@"
codes=("unit $?")
wait "$unit_waits"
codes+=("unit_wall_clock $?")
wait "$integration_waits"
codes+=("integration_wall_clock $?")
for stream in unit_wall_clock integration_wall_clock; do
    echo "--- stage 1, beside the unit tests: $stream ---"
    cat "$logs/$stream.txt"
done
"$py" -m pytest tests -m "integration and not wall_clock" "$@"
codes+=("integration $?")
echo "suite (pytest exit codes): ${codes[*]}"
for code in "${codes[@]}"; do
    [ "${code##* }" -eq 0 ] || exit 1
done
