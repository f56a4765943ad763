#!/usr/bin/env bash
# A swarm of shoal peers on this machine, with the CLI alone (the shell twin of local_swarm.py):
# one `shoal bootstrap` entry peer and N `shoal run` trainers that find it through its address
# file, train the tiny model together for a few rounds, leave and checkpoint.
#
#     examples/local_swarm.sh                       # 3 trainers, 5 rounds of 10 s
#     PEERS=2 ROUNDS=2 ROUND_SECONDS=6 examples/local_swarm.sh
#
# Knobs (environment): PEERS (3), ROUNDS (5), ROUND_SECONDS (10), CONFIG (examples/configs/tiny.toml),
# RUN_ID (local-<random>), WORKDIR (a temp dir, removed at the end unless you set it),
# SHOAL (the command: .venv/bin/shoal if present, else `shoal` on PATH).
#
# Ctrl+C once: every peer finishes its step, leaves the swarm and checkpoints. Twice: every peer
# and its processes (hivemind's DHT, averager, p2pd) are killed. No process is left behind.
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PEERS="${PEERS:-3}"
ROUNDS="${ROUNDS:-5}"
ROUND_SECONDS="${ROUND_SECONDS:-10}"
CONFIG="${CONFIG:-$REPO/examples/configs/tiny.toml}"
RUN_ID="${RUN_ID:-local-$RANDOM$RANDOM}"
if [ -z "${SHOAL:-}" ]; then
  if [ -x "$REPO/.venv/bin/shoal" ]; then SHOAL="$REPO/.venv/bin/shoal"; else SHOAL=shoal; fi
fi
read -r -a SHOAL_CMD <<< "$SHOAL"  # e.g. SHOAL="python -m node.cli"
KEEP_WORKDIR="${WORKDIR:+yes}"
WORKDIR="${WORKDIR:-$(mktemp -d "${TMPDIR:-/tmp}/shoal-local-XXXXXX")}"
mkdir -p "$WORKDIR"

# Each peer leads its own session (setsid), so that a terminal's Ctrl+C reaches only this script,
# which then interrupts every peer exactly once (a second SIGINT would mean "exit now" to a peer),
# and so that `kill -- -PID` reaches a peer's hivemind children and p2pd too.
# Without job control (the default in a script, made sure of here) a background child never leads
# a process group, so setsid starts the peer in place and $! is its session id.
set +m
if ! command -v setsid >/dev/null 2>&1; then
  echo "local_swarm.sh: needs setsid (util-linux)" >&2
  exit 2
fi

NAMES=()
PIDS=()
start() {  # start NAME ARGS...: one peer, its output in $WORKDIR/NAME/log.txt
  local name="$1"; shift
  mkdir -p "$WORKDIR/$name"
  setsid "${SHOAL_CMD[@]}" "$@" > "$WORKDIR/$name/log.txt" 2>&1 < /dev/null &
  NAMES+=("$name")
  PIDS+=("$!")
}

alive() { kill -0 "$1" 2>/dev/null; }

INTERRUPTS=0
on_interrupt() {
  INTERRUPTS=$((INTERRUPTS + 1))
  if [ "$INTERRUPTS" -eq 1 ]; then
    echo
    echo "stopping: every peer finishes its step, leaves and checkpoints (Ctrl+C again to kill)"
    for pid in "${PIDS[@]}"; do alive "$pid" && kill -INT "$pid" 2>/dev/null || true; done
  else
    kill_all
    exit 130
  fi
}

kill_all() {  # SIGKILL every peer's whole session: the node, its hivemind children and p2pd
  for pid in "${PIDS[@]}"; do kill -KILL -- "-$pid" 2>/dev/null || true; done
}

cleanup() {
  kill_all  # a no-op for peers that left cleanly
  if [ -z "$KEEP_WORKDIR" ]; then rm -rf "$WORKDIR"; else echo "logs, metrics and checkpoints: $WORKDIR"; fi
}
trap on_interrupt INT TERM
trap cleanup EXIT

# 1. The entry peer: DHT only, no model. It writes its multiaddrs to a file the trainers read.
ADDRESS_FILE="$WORKDIR/bootstrap.maddr"
start bootstrap bootstrap --listen /ip4/127.0.0.1/tcp/0 --identity "$WORKDIR/bootstrap/identity.key" \
  --address-file "$ADDRESS_FILE"

# 2. The trainers: `--initial-peer @FILE` waits for the bootstrap's address file.
for i in $(seq 1 "$PEERS"); do
  dir="$WORKDIR/peer-$i"
  start "peer-$i" run --no-ui --config "$CONFIG" --run-id "$RUN_ID" --initial-peer "@$ADDRESS_FILE" \
    --listen /ip4/127.0.0.1/tcp/0 --identity "$dir/identity.key" --max-rounds "$ROUNDS" \
    --round-seconds "$ROUND_SECONDS" --metrics-file "$dir/metrics.jsonl" --checkpoint-dir "$dir/checkpoints"
done
echo "run $RUN_ID: bootstrap + $PEERS peers, $ROUNDS rounds of ${ROUND_SECONDS}s; logs in $WORKDIR/<peer>/log.txt"

# 3. Wait for the trainers (bash's `wait` returns early when a trap runs: wait again).
STATUS=0
for i in $(seq 1 "$PEERS"); do
  pid="${PIDS[$i]}"
  while alive "$pid"; do wait "$pid" 2>/dev/null || true; done
  code=0; wait "$pid" 2>/dev/null || code=$?
  if [ "$code" -ne 0 ]; then
    STATUS=1
    echo "peer-$i exited with $code; the end of its log:" >&2
    tail -n 20 "$WORKDIR/peer-$i/log.txt" >&2
  fi
done

# 4. The trainers are done: the entry peer leaves too (SIGTERM is one Ctrl+C to shoal).
bootstrap_pid="${PIDS[0]}"
if alive "$bootstrap_pid"; then kill -TERM "$bootstrap_pid" 2>/dev/null || true; fi
while alive "$bootstrap_pid"; do wait "$bootstrap_pid" 2>/dev/null || true; done

# 5. A peer that exited by itself must have taken its DHT, averager and p2pd with it.
# Zombies do not count: they have exited and wait for init to reap them (a killed parent's
# orphans can take a moment). Give a peer's processes a few seconds to disappear.
live_members() {  # live_members SID: pid and name of every live process of that session
  ps -e -o sid=,pid=,stat=,comm= | awk -v sid="$1" '$1 == sid && $3 !~ /^Z/ {printf "%s %s ", $2, $4}'
}
for index in "${!PIDS[@]}"; do
  left=""
  for _ in 1 2 3 4 5 6 7 8 9 10; do
    left="$(live_members "${PIDS[$index]}")"
    [ -z "$left" ] && break
    sleep 0.5
  done
  if [ -n "$left" ]; then
    echo "warning: ${NAMES[$index]} left processes behind (killing them): $left" >&2
    STATUS=1
  fi
done

echo
echo "peer    last round  eval_loss"
for i in $(seq 1 "$PEERS"); do
  line="$(grep '"event": *"round"' "$WORKDIR/peer-$i/metrics.jsonl" 2>/dev/null | tail -n 1 || true)"
  round="$(sed -nE 's/.*"round": *([0-9]+).*/\1/p' <<< "$line")"
  eval_loss="$(sed -nE 's/.*"eval_loss": *([^,}]+).*/\1/p' <<< "$line")"
  printf "peer-%-3s %10s  %s\n" "$i" "${round:--}" "${eval_loss:--}"
done
exit "$STATUS"
