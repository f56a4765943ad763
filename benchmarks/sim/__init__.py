"""Simulated swarms: real ``Trainer`` s in one process and shoal's own round math between them, no
network (``peers``: the shared peers and data; ``rules``: round rules only the simulation runs)."""
