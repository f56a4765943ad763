"""Simulated swarms: real ``Trainer`` s in one process and shoal's own round between them, no network
(``peers``: the shared peers and data; ``swarm``: the engine's round per peer over an in-process hub;
``rules``: round rules only the simulation runs)."""
