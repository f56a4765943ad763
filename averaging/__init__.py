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

One overlap round, top to bottom (a file per step; the round's own two files read end to end):

====================================================  =========================================
step                                                  where
====================================================  =========================================
inner step done: ``after_step``; join or stay out     engine/loop.py ``RoundEngine``,
                                                      engine/policy.py ``JoinPolicy.decide``
matchmaking with our claim (the prepare lane)         engine/round.py ``RoundRunner.prepare``
the deadline: snapshot, one ``RoundJob`` handed over  engine/loop.py ``begin_sync``
pseudo-gradient, codec, all-reduce                    engine/round.py ``RoundRunner.run``;
                                                      network/hivemind/backend.py (the averager
                                                      process: averager.py, allreduce.py)
group formed -> anchor moved, by kind of round:       engine/kind.py (the protocol)
  the whole swarm: judge, catch up, step, re-sync,    engine/whole_swarm.py
  account, partial rounds, a split's reunion
  sub-groups: far members, check, mix, account        engine/subgroups.py
the weight carried into the next contribution         engine/round.py ``carried_weight``
merge at a later step boundary (``try_merge``)        engine/loop.py; math/merge.py
the round's record                                    engine/stats.py ``RoundStats``
====================================================  =========================================

Off the happy path: a peer that missed steps replays them (``Verdict.catch_up`` ->
``Recovery.catch_up``, steps served by ``network/hivemind/serving.py`` and fetched by
``fetching.py``); one that cannot re-syncs (``Recovery.resync`` -> ``network/slices.py``, each slice
checked by ``state/accept.py``). A joiner's first download is ``RoundEngine.initial_sync``.

Words, one per concept:

- **anchor**: the parameters after the last outer step, the same on every peer; with the outer
  momentum it is the **shared state** (``SharedState``), what a peer downloads.
- **outer step**: one Nesterov step of the anchor on an averaged pseudo-gradient
  (``OuterConfig``); ``rounds_done`` counts them.
- **round**: a wall-clock window of the run's schedule; its **sync** is the averaging job that
  ends it, from the snapshot to the merge (``SyncMode``: overlap or blocking).
- **claim**: what a member says about its anchor each round (``AnchorClaim``: a fingerprint, a
  scale and its outer-step count), sent as a ``ClaimMessage``; the **consensus** is the anchor
  most members claim; the **verdict** is what a peer must do about it.
- **catch up**: replay missed outer steps (2 bytes/param each); **re-sync**: download the
  shared state (8 bytes/param).
- **stay out** of a round: a ``Decision`` not to join its sync; its work is **folded**, carried
  into the next contribution (``Applied.FOLDED``), as is the work of a sync that failed.
"""
