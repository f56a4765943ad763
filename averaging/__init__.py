"""The outer loop of DiLoCo over the internet, by role. This docstring is the map.

Four layers; each imports only the ones below it (``tests/unit/test_layers.py`` enforces it)::

    engine/    the round engine: the training-thread loop, the join/stay-out policy, the worker's
               round frame and its two kinds (whole swarm, sub-groups), recovery, the clock, stats
    network/   the one seam to the network: the interface, an in-process fake, the state-slice
               scheduler; network/hivemind/ holds every hivemind-facing piece and is the only
               place in averaging/ that imports hivemind
    state/     one peer's shared state behind its lock (anchor, momentum, history of outer steps),
               what it accepts from others, and the verdict that judges a round
    math/      pure functions on tensors (torch and protocols only): flat buffers, outer step,
               merge, codecs, wire format and error feedback, robust aggregation, fingerprints

One overlap round, top to bottom:

- ``engine/loop.py`` ``RoundEngine.after_step``: an inner step done; join or stay out
  (``engine/policy.py`` ``JoinPolicy.decide``); at the deadline, ``begin_sync`` snapshots and hands
  one ``RoundJob`` to the worker;
- ``engine/round.py`` ``RoundRunner``: matchmaking with our claim (``prepare``, the prepare lane),
  then pseudo-gradient, codec and all-reduce (``run``; the averager process is
  ``network/hivemind/``), then the weight carried forward (``carried_weight``);
- ``engine/kind.py``: from "group formed" to "anchor moved", by kind: ``engine/whole_swarm.py``
  (judge, catch up, step, re-sync, partial rounds, a split's reunion) or ``engine/subgroups.py``
  (far members, check, mix);
- ``engine/loop.py`` ``try_merge`` at a later step boundary (``math/merge.py``); the round's record
  is ``engine/stats.py`` ``RoundStats``.

Off the happy path: a peer that missed steps replays them (``Recovery.catch_up``, served by
``network/hivemind/serving.py``); one that cannot re-syncs (``Recovery.resync`` ->
``network/slices.py``, each slice checked by ``state/accept.py``).

Words, one per concept:

- **anchor**: the parameters after the last outer step, the same on every peer; with the outer
  momentum it is the **shared state** (``SharedState``), what a peer downloads.
- **outer step**: one Nesterov step of the anchor on an averaged pseudo-gradient (``OuterConfig``);
  ``rounds_done`` counts them.
- **round**: a wall-clock window of the run's schedule; its **sync** is the averaging job that ends
  it, from the snapshot to the merge (``SyncMode``: overlap or blocking).
- **claim**: what a member says about its anchor each round (``AnchorClaim``); the **consensus**
  is the anchor most members claim; the **verdict** is what a peer must do about it.
- **catch up**: replay missed outer steps (2 bytes/param each); **re-sync**: download the shared
  state (8 bytes/param).
- **stay out** of a round: a ``Decision`` not to join its sync; its work is **folded** into the
  next contribution (``Applied.FOLDED``), as is the work of a failed sync.
"""
