"""The outer loop of DiLoCo over the internet, by role. This docstring is the map.

Four layers; each imports only the ones below it (``tests/unit/test_layers.py`` enforces it)::

    engine/    the round engine: the training-thread loop, the join/stay-out policy, the worker's
               round as phases, recovery, the clock, stats
    network/   the one seam to the network: the interface, an in-process fake, the state-slice
               scheduler; network/hivemind/ holds every hivemind-facing piece and is the only
               place in averaging/ that imports hivemind
    state/     one peer's shared state behind its lock (anchor, momentum, history of outer steps),
               what it accepts from others, and the verdict that judges a round
    math/      pure functions on tensors (torch and protocols only): flat buffers, outer step,
               merge, codecs, wire format and error feedback, robust aggregation, fingerprints

One overlap round, step by step (nothing going wrong):

====================================================  =========================================
step                                                  where
====================================================  =========================================
inner step done: ``after_step``                       engine/loop.py ``RoundEngine``
``prepare_lead`` before the deadline: join or stay    engine/policy.py ``JoinPolicy.decide``
matchmaking with our claim (the prepare lane)         engine/round.py ``RoundRunner.prepare``
  the claim: a fingerprint of the anchor              state/shared_state.py, math/fingerprints.py
  hivemind's averaging step                           network/hivemind/backend.py ``prepare``
the deadline: snapshot, hand over (``begin_sync``)    engine/loop.py, engine/worker.py
exchange: pseudo-gradient, quantize, all-reduce       engine/round.py ``_exchange``;
                                                      math/outer_step.py, math/wire.py,
                                                      math/codecs.py; network/hivemind/backend.py
  inside the averager process                         network/hivemind/averager.py, allreduce.py
                                                      (robust rules: math/robust.py),
                                                      matchmaking.py, codecs.py, parts.py
judge: the group's claims -> a ``Verdict``            state/verdict.py ``judge``
recover: catch up, apply the step, re-sync            engine/round.py ``conclude``,
                                                      engine/recover.py; state/accept.py
                                                      (``check_average``), state/shared_state.py
account: error feedback, merge correction, bytes      engine/round.py ``_account``;
                                                      math/wire.py, math/merge.py
merge at a later step boundary (``try_merge``)        engine/loop.py; math/merge.py
  (``average_inner_state``: the moments, too)         engine/inner_sync.py, math/inner_state.py
the round's record                                    engine/stats.py ``RoundStats``
====================================================  =========================================

Off the happy path: a peer that missed steps replays them (``Verdict.catch_up`` ->
``Recovery.catch_up`` -> ``SharedState.catch_up``, steps served by ``network/hivemind/serving.py``
and fetched by ``fetching.py``); one that cannot re-syncs (``Recovery.resync`` ->
``network/slices.py``, each slice checked by ``state/accept.py``). A joiner's first download is
``RoundEngine.initial_sync``.

Sub-groups (``averaging.target_group_size``): the prepare lane meets our group of the round under
its own key (``engine/mixing.py`` ``Mixing.key_bits``, math/groups.py), the exchange carries the
anchor and momentum in the extra vector, and ``engine/round.py`` ``conclude_mixed`` takes the
group's state and step in place of judge and recover (``SharedState.mix``).

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
