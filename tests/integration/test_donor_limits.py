"""Resource exhaustion (issue 11, item 8): a donor serves a bounded number of requests per peer at
once, and requests that arrive within a few seconds share one copy of its state instead of
costing its host a full copy each. Two real averagers on loopback."""

from __future__ import annotations

import logging
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import hivemind
import pytest
import torch

from averaging.network.hivemind.backend import HivemindBackend
from averaging.network.hivemind.serving import MAX_SERVES_PER_PEER, STATE_COPY_REUSE_S
from averaging.network.slices import slice_alignment, slice_bounds
from tests.integration.averagers import loopback_averagers

pytestmark = pytest.mark.integration

NUMEL = 50_000
COUNT = 4
COPY_S = 1.0  # the donor's host takes this long to copy its state: requests overlap


@pytest.mark.timeout(180)
def test_a_donor_bounds_requests_per_peer_and_copies_its_state_once_per_period(tmp_path):
    state = torch.randn(2 * NUMEL, generator=torch.Generator().manual_seed(3))
    copies: list[float] = []
    lock = threading.Lock()

    def donor_state():
        with lock:
            copies.append(time.monotonic())
        time.sleep(COPY_S)
        return {"v": 1, "numel": NUMEL}, [state[:NUMEL].clone(), state[NUMEL:].clone()]

    def no_state():
        return {}, [torch.zeros(1)]

    log_path = tmp_path / "donor.log"
    handler = logging.FileHandler(log_path)
    handler.setFormatter(logging.Formatter("%(process)d %(levelname)s %(message)s"))
    logger = logging.getLogger("averaging.network.hivemind")  # the averager and its backend
    logger.addHandler(handler)  # before the averagers fork: they inherit it
    prefix = f"limits-{uuid.uuid4().hex[:8]}"

    def make(i: int, dht: hivemind.DHT) -> HivemindBackend:
        return HivemindBackend(dht, numel=NUMEL, prefix=prefix, state_provider=donor_state if i == 0 else no_state)

    def fetch(index: int):
        start, stop = slice_bounds(2 * NUMEL, index, COUNT, slice_alignment(NUMEL))
        try:
            metadata, tensor = joiner.fetch_slice(donor, index, COUNT, expected_numel=stop - start,
                                                  stall_timeout=10.0, deadline_s=20.0)
        except RuntimeError as e:
            return str(e)
        assert torch.equal(tensor, state[start:stop])
        return "served"

    try:
        with loopback_averagers(2, make) as backends:
            donor, joiner = backends[0].peer_id, backends[1]._averager
            # 1. Four requests at once from one peer: MAX_SERVES_PER_PEER are served, the rest get
            #    an empty answer at once; the served ones share one copy of the state.
            with ThreadPoolExecutor(COUNT) as pool:
                outcomes = list(pool.map(fetch, range(COUNT)))
            assert outcomes.count("served") == MAX_SERVES_PER_PEER, outcomes
            assert all(o == "served" or "did not share its state" in o for o in outcomes), outcomes
            assert len(copies) == 1, f"{len(copies)} copies for {MAX_SERVES_PER_PEER} overlapping requests"
            # 2. One after the other, within the period: the same copy again.
            assert fetch(2) == "served" and fetch(3) == "served"
            assert len(copies) == 1
            # 3. After the period, a request makes a fresh copy (the copy was released).
            time.sleep(STATE_COPY_REUSE_S + 0.5)
            assert fetch(0) == "served"
            assert len(copies) == 2
    finally:
        logger.removeHandler(handler)
        handler.close()
    log = log_path.read_text()
    assert any("refused a state slice to" in line and joiner.peer_id.to_base58() in line
               for line in log.splitlines()), log[-2000:]
