"""Donors' claims bounded by what a joiner can check (issue 29, item 2): one hostile donor among
honest ones can no longer hand a fresh joiner a huge scale (it widened every later comparison), or
serve the true anchor with poisoned momentum; and donors are no longer asked in the order of the
round their own records claim."""

from __future__ import annotations

import random
import struct

import pytest
import torch

from averaging.network.slices import default_slice_count, download_slices, slice_alignment, slice_bounds
from averaging.state import accept
from averaging.state.served import DownloadedState
from node.library.swarm import donor_order
from protocols.messages import MessageError
from protocols.progress import ProgressRecord
from tests.unit.test_diloco import NUMEL, donor_state, new_state


def inflated(metadata: dict, scale: float = 1e300) -> dict:
    """The donor's metadata with its claimed scale (in the claim and beside it) set to ``scale``."""
    claim = dict(metadata["claim"])
    chunks = len(claim["scale"]) // 8
    claim["scale"] = struct.pack(f"<{chunks}d", *[scale] * chunks)
    return {**metadata, "claim": claim, "scale": claim["scale"]}


def download(joiner, donors: dict[str, tuple[dict, list[torch.Tensor]]]):
    flat = {name: (metadata, torch.cat(tensors)) for name, (metadata, tensors) in donors.items()}
    align = slice_alignment(NUMEL)
    count = default_slice_count(len(donors), 2 * NUMEL, align)

    def fetch(donor: str, index: int, count: int):
        metadata, values = flat[donor]
        start, stop = slice_bounds(2 * NUMEL, index, count, align)
        return metadata, values[start:stop].clone()

    return download_slices(list(donors), lengths=[NUMEL, NUMEL], count=count, fetch=fetch,
                           same_state=lambda a, b: accept.same_state(joiner, a, b), align=align,
                           check=accept.slice_check(joiner))


def test_a_donor_claiming_a_huge_scale_serves_no_slice_of_an_honest_download():
    honest = donor_state()
    metadata, tensors = honest.shared_state()
    joiner = new_state(anchor_seed=40)  # fresh: no scale of its own to cap a claim with
    assert not accept.same_state(joiner, metadata, inflated(metadata))
    assert accept.same_state(joiner, metadata, inflated(metadata, 1.0) | {"claim": metadata["claim"],
                                                                            "scale": metadata["scale"]})
    # The attacker answers first, and its slices carry the true anchor: the audit's joiner took
    # slices from it and adopted a scale of 1e300. Now it serves a lineage of its own (one vote).
    result = download(joiner, {"mallory": (inflated(metadata), tensors), "honest-1": (metadata, tensors),
                               "honest-2": (metadata, tensors)})
    assert result is not None and "mallory" not in result.served
    joiner.adopt(DownloadedState("swarm", result.metadata, result.tensors), require_claim=True)
    assert torch.equal(joiner.scale, honest.scale)


def test_scales_agree_only_when_they_are_one_steps():
    a = torch.tensor([1e-3, 2e-3, 0.0])
    assert accept.scales_agree(a, a * 1.5)
    assert not accept.scales_agree(a, a * 3)
    assert not accept.scales_agree(a, torch.tensor([1e-3, 2e-3, 1e-9]))  # zero is only zero's
    assert not accept.scales_agree(a, a[:2])


def test_the_adopted_scale_is_the_claims_not_a_number_beside_it():
    donor = donor_state()
    metadata, tensors = donor.shared_state()
    chunks = len(donor.scale)
    joiner = new_state(anchor_seed=40)
    joiner.adopt(DownloadedState("d", {**metadata, "scale": struct.pack(f"<{chunks}d", *[1e300] * chunks)}, tensors),
                 require_claim=True)
    assert torch.equal(joiner.scale, donor.scale)


@pytest.mark.parametrize("resync", [False, True])
def test_a_donor_serving_the_true_anchor_with_poisoned_momentum_is_refused(resync):
    donor = donor_state()
    metadata, (anchor, momentum) = donor.shared_state()
    poisoned = momentum.clone()
    poisoned[::2] = 1e6  # the audit's re-sync: about half the momentum values served as 1e6
    joiner = donor_state() if resync else new_state(anchor_seed=40)
    reference = donor.claim() if resync else None
    with pytest.raises(MessageError, match="momentum"):
        joiner.adopt(DownloadedState("mallory", metadata, [anchor, poisoned]), require_claim=True, reference=reference)
    # The honest state passes, and so does honest momentum after a last step much smaller than the
    # earlier ones (a short round after a stall)
    joiner.adopt(DownloadedState("honest", metadata, [anchor, momentum]), require_claim=True, reference=reference)
    donor.apply(torch.full((NUMEL,), 1e-6), round=7)  # 1,000x smaller than the last two
    metadata, tensors = donor.shared_state()
    new_state(anchor_seed=40).adopt(DownloadedState("honest", metadata, tensors), require_claim=True)


def record(peer: str, rounds_done: int, round: int, mode: str = "full") -> ProgressRecord:
    return ProgressRecord(peer_id=peer, round=round, tokens_per_s=1.0, loss=None, eval_loss=None, device="cpu",
                          utilization=1.0, bytes_sent=0, bytes_received=0, mode=mode, version="x", tokens=0, time=0.0,
                          phase="training", rounds_done=rounds_done)


def test_donors_are_ordered_by_outer_steps_no_more_than_the_schedule_allows_shuffled_among_equals():
    records = {"me": record("me", 9, 10), "mallory": record("mallory", 2**30, 2**30), "behind": record("behind", 3, 10),
               **{f"honest-{i}": record(f"honest-{i}", 9, 10) for i in range(3)},
               "client": record("client", 9, 10, mode="client")}
    orders = [donor_order(records, me="me", max_rounds_done=9, rng=random.Random(seed)) for seed in range(30)]
    assert all(order[-1] == "behind" and "client" not in order and "me" not in order for order in orders)
    firsts = {order[0] for order in orders}
    assert "mallory" in firsts and len(firsts) > 1  # it ties with the newest honest donors, never heads every join
