"""shoal's benchmarks, run as modules from the repository root (``.venv/bin/python -m benchmarks.sim.speedup
--help``); each writes ``benchmarks/results/<name>.{md,json}`` recording the commit and machine it ran on.

- ``sim``: simulated swarms in one process (real trainers, shoal's round math, no network);
- ``swarm``: real ``shoal run`` peers (and DDP ranks) on this machine, on loopback or in network
  namespaces with capped links;
- ``micro``: one component timed or checked alone (model speed, codecs, the UI, robust reducers, the GPU path);
- ``common``: what they share (results and provenance, launching peers, namespaces, the CPU throttle).

docs/benchmarks.md indexes them by the claim each backs. Not installed with shoal (pyproject's
package list names node, protocols and averaging only).
"""
