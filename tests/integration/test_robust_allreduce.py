"""Poisoned all-reduce (issue 11, item 3): three honest ``HivemindBackend`` peers and one hostile
peer (``tests/integration/hostile_peer.py``) on loopback, real averager processes, one round per
attack. For each: the honest peers stay alive, finish well before hivemind's sender timeout (no
stall), end near the honest mean (never at the attacker's values) or, when the attacker's share
of the result is refused, with a failed round and their vector untouched, and name the attacker
in the log. Then the ban list: a banned sender is kept out of the next groups, and a reducer that
ends its answer streams early (issue 29, item 10) is struck in each round, then banned."""

from __future__ import annotations

import logging
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import hivemind
import pytest
import torch

from averaging.math.robust import RobustConfig
from averaging.network.hivemind.backend import HivemindBackend
from averaging.network.hivemind.parts import OPEN_GROUP_PARTS
from averaging.network.interface import PARTIAL_ERROR
from tests.integration import hostile_peer
from tests.integration.averagers import loopback_averagers
from tests.integration.hostile_peer import ATTACK, HostileBackend

pytestmark = pytest.mark.integration

NUMEL = 4 * 262_144  # in OPEN_GROUP_PARTS parts: three per reducer
HONEST = 3
ALLREDUCE_TIMEOUT = 20.0  # hivemind's sender timeout is then 8 s: a stalled round takes at least that
ATTACKS = ("scale", "flip", "nan", "shape", "weight", "lie")


def no_state():
    return {}, [torch.zeros(1)]


@pytest.mark.timeout(240)
def test_honest_peers_survive_every_attack(tmp_path):
    log_path = tmp_path / "robust.log"
    handler = logging.FileHandler(log_path)
    handler.setFormatter(logging.Formatter("%(process)d %(name)s %(levelname)s %(message)s"))
    loggers = [logging.getLogger(name) for name in ("averaging.math.robust", "averaging.network.hivemind.allreduce",
                                                    "averaging.network.hivemind.backend")]
    for logger in loggers:  # before the averagers fork: they inherit the handler
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)

    generator = torch.Generator().manual_seed(11)
    common = torch.randn(NUMEL, generator=generator)
    vectors = [common + 0.05 * torch.randn(NUMEL, generator=generator) for _ in range(HONEST + 1)]
    honest_mean = torch.stack(vectors[:HONEST]).double().mean(0)

    prefix = f"robust-{uuid.uuid4().hex[:8]}"
    robust = RobustConfig(ban_rounds=0)  # every attack meets the validation, not the ban list

    def make(i: int, dht: hivemind.DHT) -> HivemindBackend:
        backend_type = HostileBackend if i == HONEST else HivemindBackend
        return backend_type(dht, numel=NUMEL, prefix=prefix, state_provider=no_state, target_group_size=HONEST + 1,
                            min_group_size=HONEST + 1, min_matchmaking_time=2.0, request_timeout=1.0,
                            allreduce_timeout=ALLREDUCE_TIMEOUT, robust=robust)

    try:
        with loopback_averagers(HONEST + 1, make) as backends:
            attacker = backends[HONEST].peer_id

            honest_ids = [backend.peer_id for backend in backends[:HONEST]]

            def play(round: int) -> tuple[list, list[torch.Tensor], str]:
                """One round of the current attack: outcomes, results, and what the log gained."""
                logged = log_path.stat().st_size
                scheduled = time.time() + 4.0
                for backend in backends:
                    backend.prepare(round=round, scheduled_time=scheduled, gather={"round": round}, timeout=30)
                results = [vector.clone() for vector in vectors]
                futures = [pool.submit(backend.average, result, weight=1.0, timeout=60)
                           for backend, result in zip(backends, results)]
                outcomes = [future.result(timeout=90) for future in futures]
                handler.flush()
                with log_path.open() as log_file:
                    log_file.seek(logged)
                    return outcomes, results, log_file.read()

            with ThreadPoolExecutor(HONEST + 1) as pool:
                round = 0
                for attack in ATTACKS:
                    ATTACK.value = attack.encode()
                    # The event each attack needs: a group of all four. Under load a member's matchmaking
                    # can give up after the leader assembled the group (it answers the others' parts with
                    # BAD_GROUP_ID, and every result misses its share): that round is played again, up to
                    # three times; what the round's all-reduce did is never a reason to play it again.
                    for _ in range(3):
                        round += 1
                        outcomes, results, logged = play(round)
                        if all(len(o.group) == HONEST + 1 for o in outcomes[:HONEST]) and "sent BAD_GROUP_ID" not in logged:
                            break
                    else:
                        pytest.fail(f"{attack}: no group of all four formed in three rounds:\n{logged[-3000:]}")
                    # An honest reducer's answer stream can end a part short, with no error on either
                    # side (docs/limitations.md: about one member-round in 15-20 on a busy machine,
                    # cause not found): that member's result is partial, not applied, its vector
                    # untouched. The attack is judged on the members that got the whole average
                    # (at least one: an attack that makes rounds partial fails here).
                    short = {i for i in range(HONEST) if attack != "lie" and outcomes[i].partial}
                    if short:
                        assert any(f"reducer {peer} failed" in logged and "but we expected" in logged
                                   for peer in honest_ids), f"{attack}: a partial round, not the known stream shortfall:\n{logged[-3000:]}"
                    assert len(short) < HONEST, f"{attack}: no honest peer got the whole average: {outcomes}"

                    for i in range(HONEST):
                        outcome = outcomes[i]
                        assert attacker in outcome.group
                        if i in short:  # (it may have waited out a part's timeout: not the attack's doing)
                            assert not outcome.ok and torch.equal(results[i], vectors[i]), (attack, i, outcome)
                            continue
                        # hivemind's sender timeout (0.4 x allreduce_timeout) is how long a stalled part waits.
                        assert outcome.allreduce_s < 0.4 * ALLREDUCE_TIMEOUT, f"{attack}: stalled {outcome.allreduce_s:.1f}s"
                        if attack == "lie":
                            # The liar's share of the average is refused: a partial result, which is
                            # not applied (each member's own values there would set it apart). The
                            # round fails with the vector untouched; the node folds it.
                            assert not outcome.ok and outcome.partial > 0, (attack, i, outcome)
                            assert outcome.error.startswith(PARTIAL_ERROR), outcome.error
                            assert torch.equal(results[i], vectors[i]), f"honest peer {i}: a partial result leaked"
                            continue
                        assert outcome.ok, f"{attack}: honest peer {i} failed: {outcome.error}"
                        error = float((results[i].double() - honest_mean).norm() / honest_mean.norm())
                        assert error < 0.1, f"{attack}: honest peer {i} is {error:.3f} away from the honest mean"
                    assert all(backend._averager.is_alive() for backend in backends)
    finally:
        for logger in loggers:
            logger.removeHandler(handler)
        handler.close()

    log = log_path.read_text()
    for needle in ("has norm", "NaN", "shape", "returned an average"):  # scale/flip, nan, shape, lie
        assert any(needle in line and attacker in line for line in log.splitlines()), f"no line naming {attacker} for {needle!r}:\n{log[-3000:]}"
    counters = [backend.robustness() for backend in backends[:HONEST]]
    assert all(c["refused_parts"] >= 3 and c["refused_returns"] >= 1 for c in counters), counters
    assert hostile_peer.ATTACKS  # the module under test is the hostile one


@pytest.mark.timeout(240)
def test_a_banned_peer_is_kept_out_of_the_next_groups():
    """Once the honest peers ban a sender, its report is dropped from the round's gather (it has no
    say in the consistency check), and they neither follow it nor accept it as a follower: the
    next groups are the honest peers alone, and they end with the same average (a banned peer kept
    inside a group is a reducer whose share every member keeps at its local values: apart). The ban
    lasts ``ban_rounds`` averaging rounds, then the peer (honest by now) is in the group again."""
    generator = torch.Generator().manual_seed(12)
    common = torch.randn(NUMEL, generator=generator)
    vectors = [common + 0.05 * torch.randn(NUMEL, generator=generator) for _ in range(HONEST + 1)]
    honest_mean = torch.stack(vectors[:HONEST]).double().mean(0)
    prefix = f"banned-{uuid.uuid4().hex[:8]}"

    def make(i: int, dht: hivemind.DHT) -> HivemindBackend:
        backend_type = HostileBackend if i == HONEST else HivemindBackend
        return backend_type(dht, numel=NUMEL, prefix=prefix, state_provider=no_state, target_group_size=HONEST + 1,
                            min_group_size=HONEST, min_matchmaking_time=2.0, request_timeout=1.0,
                            allreduce_timeout=ALLREDUCE_TIMEOUT, robust=RobustConfig(ban_rounds=2))

    ATTACK.value = b"flip"
    with loopback_averagers(HONEST + 1, make) as backends, ThreadPoolExecutor(HONEST + 1) as pool:
        attacker = backends[HONEST].peer_id
        for round in (1, 2, 3, 4):
            if round == 4:  # the ban (rounds 2 and 3) is over; the peer now sends honest parts
                ATTACK.value = b"honest"
            scheduled = time.time() + 4.0
            # The attacker gives up sooner; banned (rounds 2 and 3) and turned away by everyone, it waits out
            # its whole timeout: a second after the others' group formed (it was 10 s: CI time).
            attacker_timeout = {1: 10, 2: 5, 3: 5}.get(round, 30)
            for backend in backends:
                backend.prepare(round=round, scheduled_time=scheduled, gather={"round": round},
                                timeout=attacker_timeout if backend is backends[HONEST] else 30)
            results = [vector.clone() for vector in vectors]
            futures = [pool.submit(backend.average, result, weight=1.0, timeout=60)
                       for backend, result in zip(backends, results)]
            outcomes = [future.result(timeout=90) for future in futures]
            honest = outcomes[:HONEST]
            # An honest reducer's answer stream can end a part short (docs/limitations.md; seen here
            # with the unit tests running beside): that member's result is partial, not applied, its
            # vector untouched; the others' results are checked (at least one got the whole average).
            short = {i for i, o in enumerate(honest) if not o.ok and o.partial}
            assert all(o.ok or i in short for i, o in enumerate(honest)), [o.error for o in honest]
            assert len(short) < HONEST and all(torch.equal(results[i], vectors[i]) for i in short), [o.error for o in honest]
            if round == 1:
                assert all(attacker in o.group for o in honest)  # the attack: refused, and banned
                assert all(b.robustness()["bans"] == 1 for b in backends[:HONEST])
                # ... and its report is dropped: it has no say in the round's consistency check.
                assert all(sorted(o.gathered) == sorted(b.peer_id for b in backends[:HONEST]) for o in honest), \
                    [sorted(o.gathered) for o in honest]
                continue
            if round == 4:
                assert all(attacker in o.group and len(o.group) == HONEST + 1 for o in honest), \
                    [len(o.group) for o in honest]
                assert outcomes[HONEST].ok or outcomes[HONEST].partial, outcomes[HONEST].error
                everyone = torch.stack(vectors).double().mean(0)
                assert all(float((r.double() - everyone).norm() / everyone.norm()) < 1e-3
                           for i, r in enumerate(results) if i not in short)
                continue
            for i, outcome in enumerate(honest):
                assert attacker not in outcome.group, f"round {round}: the banned peer is in peer {i}'s group"
                assert len(outcome.group) == HONEST
                if i in short:
                    continue
                error = float((results[i].double() - honest_mean).norm() / honest_mean.norm())
                assert error < 1e-3, f"round {round}: honest peer {i} is {error:.2e} away from the honest mean"
            assert not outcomes[HONEST].ok or len(outcomes[HONEST].group) == 1


@pytest.mark.timeout(180)
def test_a_reducer_that_ends_its_streams_early_is_struck_then_banned():
    """A member whose reducer ends its answer streams early (``short``: its last part goes unsent)
    leaves every member's result without that part: a partial round, applied by nobody. Honest
    reducers fail now and then too, so one failure only strikes it (no ban before ``strike_limit``
    rounds); once every honest member has banned it, their next group is themselves alone, whose
    round applies with the honest mean. A member that keeps partial results (sub-groups) gets the
    group's average with its own values on the missing share.

    Under load an honest reducer can fail in the same round (seen in CI: a third of the average
    missing, not a twelfth); such a round strikes nobody (``robust.struck_reducers``), so the ban
    may come a round later, never earlier, and never on an honest peer."""
    limit = 2
    generator = torch.Generator().manual_seed(13)
    common = torch.randn(NUMEL, generator=generator)
    vectors = [common + 0.05 * torch.randn(NUMEL, generator=generator) for _ in range(HONEST + 1)]
    honest_mean = torch.stack(vectors[:HONEST]).double().mean(0)
    prefix = f"short-{uuid.uuid4().hex[:8]}"
    robust = RobustConfig(ban_rounds=10, strike_limit=limit, strike_window=10)

    def make(i: int, dht: hivemind.DHT) -> HivemindBackend:
        backend_type = HostileBackend if i == HONEST else HivemindBackend
        return backend_type(dht, numel=NUMEL, prefix=prefix, state_provider=no_state, target_group_size=HONEST + 1,
                            min_group_size=HONEST, min_matchmaking_time=2.0, request_timeout=1.0,
                            allreduce_timeout=ALLREDUCE_TIMEOUT, robust=robust)

    def play(backends, pool, round: int, banned: bool) -> tuple[list, list[torch.Tensor]]:
        scheduled = time.time() + 3.0
        for backend in backends:  # once banned, the attacker (turned away by everyone) gives up sooner
            backend.prepare(round=round, scheduled_time=scheduled, gather={"round": round},
                            timeout=5 if backend is backends[HONEST] and banned else 30)
        results = [vector.clone() for vector in vectors]
        # Member 0 keeps a partial result, as sub-groups do (averaging.engine.subgroups)
        futures = [pool.submit(backend.average, result, weight=1.0, timeout=60, keep_partial=i == 0)
                   for i, (backend, result) in enumerate(zip(backends, results))]
        return [future.result(timeout=90) for future in futures], results

    ATTACK.value = b"short"
    with loopback_averagers(HONEST + 1, make) as backends, ThreadPoolExecutor(HONEST + 1) as pool:
        attacker = backends[HONEST].peer_id
        for round in range(1, limit + 4):
            outcomes, results = play(backends, pool, round, banned=False)
            for i, outcome in enumerate(outcomes[:HONEST]):
                assert attacker in outcome.group and 0 < outcome.partial, (round, i, outcome)
                if outcome.ok:  # only the keeper: the missing share holds our own values, the rest the average
                    assert i == 0 and outcome.partial <= 0.5, (round, i, outcome)
                    unchanged = float(results[0].eq(vectors[0]).double().mean())
                    assert abs(unchanged - outcome.partial) < 0.01, (round, unchanged, outcome.partial)
                else:
                    assert torch.equal(results[i], vectors[i]), f"round {round}: a partial result leaked"
                if outcome.partial <= 1 / OPEN_GROUP_PARTS + 1e-6:  # the attacker's last part alone: no stall
                    assert outcome.allreduce_s < 0.4 * ALLREDUCE_TIMEOUT, f"round {round}: stalled {outcome.allreduce_s:.1f}s"
            bans = [b.robustness()["bans"] for b in backends[:HONEST]]
            assert all(ban <= 1 for ban in bans) and (round >= limit or not any(bans)), (round, bans)
            if all(bans):
                break
        else:
            pytest.fail(f"the attacker was not banned by every honest member in {round} rounds")
        outcomes, results = play(backends, pool, round + 1, banned=True)
        for i, outcome in enumerate(outcomes[:HONEST]):
            assert outcome.ok, f"honest peer {i}: {outcome.error}"
            assert attacker not in outcome.group and len(outcome.group) == HONEST, outcome.group
            error = float((results[i].double() - honest_mean).norm() / honest_mean.norm())
            assert error < 1e-3, f"honest peer {i} is {error:.2e} away from the honest mean"


@pytest.mark.timeout(120)
def test_more_peers_than_the_group_cap_average_in_groups_at_the_cap():
    """With no target group size, a hivemind leader gathers everyone under the round's key, and
    every member refuses a group over the robust cap: a swarm of more than 64 peers formed no group
    at all (the scale simulation found it). The leader now stops at the cap, and the key splits into
    several groups. Here the cap is 2 and four peers look for a group: pairs, not a refused four."""
    generator = torch.Generator().manual_seed(3)
    vectors = [torch.randn(NUMEL, generator=generator) for _ in range(4)]
    prefix = f"capped-{uuid.uuid4().hex[:8]}"

    def make(i: int, dht: hivemind.DHT) -> HivemindBackend:
        return HivemindBackend(dht, numel=NUMEL, prefix=prefix, state_provider=no_state, target_group_size=None,
                               min_group_size=2, min_matchmaking_time=2.0, request_timeout=1.0,
                               allreduce_timeout=ALLREDUCE_TIMEOUT, robust=RobustConfig(max_group_size=2))

    with loopback_averagers(4, make) as backends, ThreadPoolExecutor(4) as pool:
        scheduled = time.time() + 4.0
        for backend in backends:
            backend.prepare(round=1, scheduled_time=scheduled, gather={"round": 1}, timeout=20)
        results = [vector.clone() for vector in vectors]
        futures = [pool.submit(backend.average, result, weight=1.0, timeout=40)
                   for backend, result in zip(backends, results)]
        outcomes = [future.result(timeout=60) for future in futures]
    errors = [o.error for o in outcomes if not o.ok]
    assert not any("over the cap" in (e or "") for e in errors), errors
    pairs = [o for o in outcomes if o.ok]
    assert len(pairs) >= 2 and all(len(o.group) == 2 for o in pairs), [(o.ok, o.group, o.error) for o in outcomes]
    by_id = {b.peer_id: v for b, v in zip(backends, vectors)}
    for outcome, result in zip(outcomes, results):
        if outcome.ok:  # the pair's mean
            mean = torch.stack([by_id[p] for p in outcome.group]).mean(0)
            assert float((result - mean).norm() / mean.norm()) < 1e-2, outcome.group
