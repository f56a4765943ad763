"""What the benchmarks share: ``results`` (where results go, the commit and machine each records,
command lines), ``swarm`` (starting real peers, entry peers and DDP ranks; evaluation; CPU meters),
``netns`` (hosts with capped links) and ``cpu_throttle`` (a peer slowed by its step's CPU time)."""
