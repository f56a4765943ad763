"""Anchor fingerprints: exactness, the RMS estimate, the fp16-vs-failure tolerance, and consensus."""

import itertools

import pytest
import torch

from averaging.math.fingerprints import (
    NUM_PROJECTIONS,
    PERSISTENT_DIVERGENCE,
    REPEAT_WARNING_EVERY,
    SIGN_PERIOD,
    AnchorClaim,
    Consensus,
    DivergenceWatch,
    _sign_table,
    agree,
    chunk_length,
    chunk_rms,
    claim_of,
    consensus,
    encode_claim,
    fingerprint,
    rms_difference,
    tie_rank,
)
from averaging.math.outer_step import outer_step_
from protocols.messages import ClaimMessage

NUM_CHUNKS = 40
NUMEL = NUM_CHUNKS * SIGN_PERIOD  # small enough to be fast, large enough for one chunk per sign period


def randn(numel: int, seed: int, std: float = 1.0) -> torch.Tensor:
    return torch.randn(numel, generator=torch.Generator().manual_seed(seed)) * std


def fp16_rounded(pseudo_grad: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    """What a peer applies after an fp16-compressed all-reduce: its local part plus fp16(avg - local)."""
    return local + (pseudo_grad - local).half().float()


def after_outer_step(anchor: torch.Tensor, pseudo_grad: torch.Tensor) -> torch.Tensor:
    anchor = anchor.clone()
    outer_step_(anchor, pseudo_grad, torch.zeros_like(anchor), lr=0.7, mu=0.9)
    return anchor


# -- fingerprints and the RMS estimate ---------------------------------------------------------
def test_chunk_length_is_a_multiple_of_the_sign_period_and_caps_the_chunk_count():
    assert chunk_length(1) == SIGN_PERIOD
    assert chunk_length(64 * SIGN_PERIOD) == SIGN_PERIOD
    assert chunk_length(64 * SIGN_PERIOD + 1) == 2 * SIGN_PERIOD
    numel = 10**7
    length = chunk_length(numel)
    assert length % SIGN_PERIOD == 0
    assert -(-numel // length) <= 64
    assert -(-numel // (length - SIGN_PERIOD)) > 64  # the smallest such length


def test_fingerprint_matches_its_definition_including_a_partial_last_chunk():
    # projections[c, k] = sum_i sign[i mod P, k] * chunk_c[i]; here chunks are two sign periods long.
    numel = 2 * SIGN_PERIOD * 3 + 100
    flat = randn(numel, seed=1)
    fp = fingerprint(flat, max_chunks=4)
    assert (fp.numel, fp.chunk_len, fp.num_chunks) == (numel, 2 * SIGN_PERIOD, 4)
    assert fp.projections.dtype == torch.float64 and fp.projections.shape == (4, NUM_PROJECTIONS)
    signs = _sign_table()
    for c in range(4):
        chunk = flat[c * fp.chunk_len : (c + 1) * fp.chunk_len].double()
        expected = (signs[torch.arange(chunk.numel()) % SIGN_PERIOD] * chunk[:, None]).sum(dim=0)
        assert torch.allclose(fp.projections[c], expected, rtol=1e-12, atol=1e-9)
    assert fp.chunk_sizes().tolist() == [2 * SIGN_PERIOD] * 3 + [100]


def test_fingerprint_of_identical_vectors_is_identical_and_of_different_ones_differs():
    flat = randn(NUMEL + 7, seed=2)
    a, b = fingerprint(flat), fingerprint(flat.clone())
    assert torch.equal(a.projections, b.projections)
    assert torch.equal(rms_difference(a, b), torch.zeros(a.num_chunks, dtype=torch.float64))
    nudged = flat.clone()
    nudged[12345] += 1e-3
    assert not torch.equal(fingerprint(nudged).projections, a.projections)


def test_fingerprint_is_linear():
    a, b = randn(NUMEL, seed=3), randn(NUMEL, seed=4)
    difference = fingerprint(a).projections - fingerprint(b).projections
    assert torch.allclose(difference, fingerprint(a.double() - b.double()).projections, rtol=0, atol=1e-9)


def test_rms_difference_estimates_the_true_per_chunk_rms_difference():
    # Per chunk the estimate of the mean square is ~ chi2(K)/K times the truth (K = 4): below
    # 0.02**2 with probability ~3e-7 and above 4**2 with ~1e-12, so the per-chunk bounds are wide
    # on purpose; the average over 40 chunks (chi2(160)/160, sd 0.11) is held much tighter.
    a, b = randn(NUMEL, seed=5), randn(NUMEL, seed=6)
    # Different scales per chunk, so a mix-up of chunks or of chunk sizes shows.
    b = a + (b - a) * torch.linspace(0.1, 10.0, NUM_CHUNKS).repeat_interleave(SIGN_PERIOD)
    fa, fb = fingerprint(a), fingerprint(b)
    estimate = rms_difference(fa, fb)
    truth = chunk_rms(a - b, fa.chunk_len)
    assert estimate.shape == truth.shape == (NUM_CHUNKS,)
    ratio = estimate / truth
    assert ratio.min() > 0.02 and ratio.max() < 4.0, ratio
    assert 0.6 < float(ratio.square().mean()) < 1.5


def test_rms_difference_uses_the_size_of_a_partial_last_chunk():
    # Only the 40-element last chunk differs. Its estimate must be relative to 40 elements, not to
    # a full chunk (that would be 100x too small in mean square); averaged over 50 differences the
    # mean-square ratio is ~ chi2(200)/200, within 0.5..2 with overwhelming probability.
    numel = 3 * SIGN_PERIOD + 40
    a = randn(numel, seed=7)
    ratios = []
    for trial in range(50):
        b = a.clone()
        b[-40:] += randn(40, seed=100 + trial, std=2.0)
        estimate = rms_difference(fingerprint(a), fingerprint(b))
        assert estimate[:3].tolist() == [0.0, 0.0, 0.0]
        ratios.append(float(estimate[3]) ** 2 / float((a - b)[-40:].square().mean()))
    assert 0.5 < sum(ratios) / len(ratios) < 2.0


def test_a_difference_confined_to_one_chunk_shows_in_that_chunk_only():
    a = randn(NUMEL, seed=9)
    b = a.clone()
    b[5 * SIGN_PERIOD : 6 * SIGN_PERIOD] += randn(SIGN_PERIOD, seed=10)
    estimate = rms_difference(fingerprint(a), fingerprint(b))
    others = torch.cat([estimate[:5], estimate[6:]])
    assert torch.equal(others, torch.zeros_like(others))
    assert 0.02 < float(estimate[5]) < 4.0


# -- the tolerance: fp16 noise agrees, a failed part does not ----------------------------------
def test_agree_tolerates_fp16_rounding_but_not_a_part_that_kept_its_local_value():
    anchor = randn(NUMEL, seed=11, std=0.02)
    averaged = randn(NUMEL, seed=12, std=1e-3)  # the group's pseudo-gradient
    local = randn(NUMEL, seed=13, std=1e-3)  # this peer's own, same scale
    reference = after_outer_step(anchor, averaged)
    reference_fp = fingerprint(reference)
    scale = chunk_rms(averaged, reference_fp.chunk_len)

    noisy_grad = fp16_rounded(averaged, local)
    noisy = after_outer_step(anchor, noisy_grad)
    assert not torch.equal(noisy, reference)  # the noise is there ...
    noisy_fp = fingerprint(noisy)
    assert agree(reference_fp, noisy_fp, scale, chunk_rms(noisy_grad, reference_fp.chunk_len))
    # ... and far below the tolerance, not just under it.
    assert float((rms_difference(reference_fp, noisy_fp) / scale).max()) < 0.01

    # One contiguous 10% slice, not aligned with chunks, kept the local pseudo-gradient.
    start, length = int(0.37 * NUMEL), NUMEL // 10
    failed_grad = averaged.clone()
    failed_grad[start : start + length] = local[start : start + length]
    failed_fp = fingerprint(after_outer_step(anchor, failed_grad))
    failed_scale = chunk_rms(failed_grad, reference_fp.chunk_len)
    assert not agree(reference_fp, failed_fp, scale, failed_scale)
    assert not agree(failed_fp, reference_fp, failed_scale, scale)  # symmetric
    # Exactly the chunks the slice covers are flagged.
    flagged = rms_difference(reference_fp, failed_fp) > 0.25 * torch.maximum(scale, failed_scale)
    covered = torch.zeros(NUM_CHUNKS, dtype=torch.bool)
    covered[start // SIGN_PERIOD + 1 : (start + length) // SIGN_PERIOD] = True  # fully covered chunks
    assert flagged[covered].all()
    touched = torch.zeros(NUM_CHUNKS, dtype=torch.bool)
    touched[start // SIGN_PERIOD : (start + length - 1) // SIGN_PERIOD + 1] = True
    assert not flagged[~touched].any()


def test_fp16_drift_over_many_rounds_stays_within_the_tolerance():
    # Two peers with their own momentum, each applying the group's average through its own fp16
    # rounding for 30 rounds: the errors accumulate through momentum but stay far below rel_tol.
    anchors = [randn(NUMEL, seed=14, std=0.02) for _ in range(2)]
    momenta = [torch.zeros(NUMEL) for _ in range(2)]
    for round in range(30):
        averaged = randn(NUMEL, seed=100 + round, std=1e-3)
        for peer in range(2):
            local = randn(NUMEL, seed=1000 * (peer + 1) + round, std=1e-3)
            outer_step_(anchors[peer], fp16_rounded(averaged, local), momenta[peer], lr=0.7, mu=0.9)
    a, b = fingerprint(anchors[0]), fingerprint(anchors[1])
    scale = chunk_rms(averaged, a.chunk_len)
    assert float(rms_difference(a, b).max()) > 0  # they did drift apart
    assert agree(a, b, scale, scale)


def test_agree_before_any_round_only_tolerates_abs_tol():
    a = randn(SIGN_PERIOD, seed=15)
    zero = torch.zeros(1, dtype=torch.float64)
    assert agree(fingerprint(a), fingerprint(a + 1e-8), zero, zero)
    assert not agree(fingerprint(a), fingerprint(a + 1e-4), zero, zero)
    assert agree(fingerprint(a), fingerprint(a + 1e-4), zero, zero, abs_tol=1e-3)


# -- consensus ---------------------------------------------------------------------------------
def make_claim(anchor: torch.Tensor, scale_source: torch.Tensor, rounds_done: int) -> AnchorClaim:
    fp = fingerprint(anchor)
    return AnchorClaim(fp, chunk_rms(scale_source, fp.chunk_len), rounds_done)


@pytest.fixture
def anchors():
    """A shared anchor, three fp16-noisy copies of it and one that diverged by a pseudo-gradient."""
    anchor = randn(NUMEL, seed=20, std=0.02)
    grad = randn(NUMEL, seed=21, std=1e-3)
    noisy = [anchor + randn(NUMEL, seed=22 + i, std=1e-3 * 2**-11) for i in range(3)]
    return grad, noisy, anchor + 1.5 * randn(NUMEL, seed=30, std=1e-3)


def test_consensus_flags_exactly_the_one_diverged_peer(anchors):
    grad, noisy, diverged = anchors
    claims = {f"peer{i}": make_claim(a, grad, rounds_done=5) for i, a in enumerate(noisy)}
    claims["peer9"] = make_claim(diverged, grad, rounds_done=50)  # claims to be a veteran, but alone
    verdict = consensus(claims, salt="7")
    assert verdict.diverged == frozenset({"peer9"})
    assert verdict.agreeing == frozenset({"peer0", "peer1", "peer2"})
    assert not verdict.contested  # three against one: a majority, not a tie
    # Equal agreement: the reference is the agreeing peer of smallest tie rank, never the claimant.
    assert verdict.reference == min(("peer0", "peer1", "peer2"), key=lambda p: tie_rank(p, "7"))


def test_consensus_all_agree():
    grad = randn(NUMEL, seed=31, std=1e-3)
    anchor = randn(NUMEL, seed=32)
    claims = {p: make_claim(anchor, grad, rounds_done=r) for p, r in (("a", 3), ("b", 7), ("c", 7))}
    verdict = consensus(claims, salt="3")
    assert (verdict.agreeing, verdict.diverged, verdict.contested) == (frozenset("abc"), frozenset(), False)
    assert verdict.reference == min("abc", key=lambda p: tie_rank(p, "3"))


@pytest.mark.parametrize("claimed", [(3, 5), (5, 3), (4, 4), (0, 2**40)])
def test_a_two_peer_tie_is_broken_by_a_hash_never_by_a_claimed_step_count(anchors, claimed):
    """Consensus hijack (issue 11): a claimed step count decided ties, so a peer claiming the most
    steps won every tie it was in. Now the hash of (round, peer id) does, whatever is claimed."""
    grad, noisy, far = anchors
    winners = set()
    for round in range(40):
        claims = {"p0": make_claim(noisy[0], grad, claimed[0]), "p1": make_claim(far, grad, claimed[1])}
        verdict = consensus(claims, salt=str(round))
        assert verdict.contested
        assert verdict.reference == min(("p0", "p1"), key=lambda p: tie_rank(p, str(round)))
        assert verdict.agreeing == frozenset({verdict.reference})
        assert verdict.diverged == frozenset({"p0", "p1"} - {verdict.reference})
        winners.add(verdict.reference)
    assert winners == {"p0", "p1"}  # the hash changes with the round: no peer id wins every tie


def test_consensus_is_the_same_for_every_insertion_order(anchors):
    grad, noisy, far = anchors
    claims = {
        "zed": make_claim(noisy[0], grad, 2),
        "amy": make_claim(far, grad, 9),
        "bob": make_claim(noisy[1], grad, 2),
        "kim": make_claim(far + randn(NUMEL, seed=40, std=1e-8), grad, 9),
    }
    verdicts = {consensus(dict(order), salt="11") for order in itertools.permutations(claims.items())}
    assert len(verdicts) == 1
    (verdict,) = verdicts
    # Two pairs of two: a tie, won by the peer of smallest tie rank, with its pair.
    assert verdict.contested
    reference = min(claims, key=lambda p: tie_rank(p, "11"))
    pair = {"amy", "kim"} if reference in ("amy", "kim") else {"zed", "bob"}
    assert (verdict.reference, verdict.agreeing) == (reference, frozenset(pair))


# -- the claim on the wire ---------------------------------------------------------------------
@pytest.mark.parametrize("numel", [1, SIGN_PERIOD, 3 * SIGN_PERIOD + 17, 64 * SIGN_PERIOD + 5])
def test_claim_round_trips_exactly_through_the_round_report(numel):
    anchor = randn(numel, seed=41)
    fp = fingerprint(anchor)
    claim = AnchorClaim(fp, chunk_rms(randn(numel, seed=42, std=1e-3), fp.chunk_len), rounds_done=17)
    report = encode_claim(claim, round=23)
    assert (report.round, report.rounds_done, report.num_chunks, report.num_projections) == (23, 17, fp.num_chunks, 4)
    decoded = ClaimMessage.decode(report.encode(), numel=numel, chunk_len=fp.chunk_len, num_projections=NUM_PROJECTIONS)
    assert decoded == report
    back = claim_of(decoded)
    assert (back.fingerprint.numel, back.fingerprint.chunk_len, back.rounds_done) == (numel, fp.chunk_len, 17)
    assert torch.equal(back.fingerprint.projections, fp.projections)
    assert torch.equal(back.scale, claim.scale)
    assert torch.equal(rms_difference(back.fingerprint, fp), torch.zeros(fp.num_chunks, dtype=torch.float64))


def test_a_member_that_stays_off_the_anchor_is_named_then_warned_of():
    def verdict(agreeing, diverged, contested=False):
        return Consensus(reference=sorted(agreeing)[0], agreeing=frozenset(agreeing), diverged=frozenset(diverged),
                       contested=contested)

    watch = DivergenceWatch()
    seen = []
    for _ in range(PERSISTENT_DIVERGENCE + REPEAT_WARNING_EVERY):
        seen.append([(r.peer, r.streak, r.persistent) for r in watch.observe(verdict({"me", "b"}, {"x"}), "me")])
    assert seen[0] == [("x", 1, False)]  # named at once
    assert seen[PERSISTENT_DIVERGENCE - 1] == [("x", PERSISTENT_DIVERGENCE, True)]
    assert seen[-1] == [("x", PERSISTENT_DIVERGENCE + REPEAT_WARNING_EVERY, True)]
    assert sum(map(len, seen)) == 3  # and not every round in between

    # An honest member that folded once: named once, and its streak ends when it agrees again.
    watch = DivergenceWatch()
    assert len(watch.observe(verdict({"me", "b"}, {"y"}), "me")) == 1
    assert watch.observe(verdict({"me", "b", "y"}, set()), "me") == []
    assert [(r.streak) for r in watch.observe(verdict({"me", "b"}, {"y"}), "me")] == [1]

    # We judge only from the majority: off the anchor ourselves, or in a tie, we may be the odd one.
    watch = DivergenceWatch()
    assert watch.observe(verdict({"x", "b"}, {"me"}), "me") == []
    assert watch.observe(verdict({"me"}, {"x"}, contested=True), "me") == []
    assert watch.observe(None, "me") == []
