"""Three real hivemind averagers (``ShoalAverager``) on loopback average error-fed int4 (fp16
returns: hivemind's deltas) and int8 (int4 returns: the quantized average, shoal's runner)
pseudo-gradients through ``averaging.network.hivemind.codecs``: every peer ends
within the return code's bound of the exact weighted mean of what was sent (with int4 returns, all
at the same values), and shared counters (forked into the averager processes) show our codec
encoded every part sent and every delta or average returned."""

from __future__ import annotations

import multiprocessing as mp
import signal
import time
import uuid

import hivemind
import psutil
import pytest
import torch
from hivemind.averaging.matchmaking import MatchmakingException
from hivemind.averaging.partition import AllreduceException
from hivemind.compression import serialization

from averaging.math import codecs
from averaging.math.robust import RobustConfig
from averaging.network.hivemind import codecs as hivemind_codecs
from averaging.network.hivemind.averager import ShoalAverager
from averaging.network.hivemind.codecs import ReturnCodec, ShoalCodec
from averaging.network.hivemind.parts import balanced_part_size
from tests.integration.averagers import loopback_averagers

# A few averagers, mostly waiting on matchmaking: run beside the unit tests (scripts/run-suite.sh).
pytestmark = [pytest.mark.integration, pytest.mark.wall_clock]

NUMEL = 30_000
PEERS = 3
WEIGHTS = (1.0, 2.0, 0.5)
CASES = {"int4": ("int4", "fp16"), "int8": ("int8", "int4")}


class Counter:
    """Calls and bytes, in shared memory: the averagers are forked processes."""

    def __init__(self):
        self.calls, self.bytes = mp.Value("q", 0), mp.Value("q", 0)

    def add(self, nbytes: int) -> None:
        with self.calls.get_lock():
            self.calls.value += 1
            self.bytes.value += nbytes


def counting_codec(code: str, ret: str, part_values: int, sends: Counter) -> ShoalCodec:
    class CountingShoalCodec(ShoalCodec):
        def compress(self, tensor, info, allow_inplace=False):
            message = super().compress(tensor, info, allow_inplace)
            sends.add(len(message.buffer))
            return message

    return CountingShoalCodec(code, return_code=ret, part_values=part_values)


class CountingReturnCodec(ReturnCodec):
    counter: Counter

    def compress(self, tensor, info, allow_inplace=False):
        message = super().compress(tensor, info, allow_inplace)
        self.counter.add(len(message.buffer))
        return message


def p2pd_descendants() -> set[int]:
    found = set()
    for child in psutil.Process().children(recursive=True):
        try:
            if child.name() == "p2pd" and child.status() != psutil.STATUS_ZOMBIE:
                found.add(child.pid)
        except psutil.Error:
            pass
    return found


def _group_or_none(control):
    """A step's gathered group, or None if the round did not complete: its matchmaking found no group,
    or its all-reduce failed (hivemind wraps that in MatchmakingException "Unable to run All-Reduce";
    seen once in the suite: one sender's part never reached a reducer, which gave up at the timeout)."""
    try:
        return control.result(timeout=60)
    except (AllreduceException, MatchmakingException):
        return None


@pytest.mark.timeout(180)
def test_int4_and_int8_allreduce_through_registered_codecs(monkeypatch):
    part_values = balanced_part_size(NUMEL, PEERS, 64, bytes_per_value=codecs.bytes_per_value("int4"))
    part_lengths = [min(part_values, NUMEL - start) for start in range(0, NUMEL, part_values)]
    assert len(part_lengths) == PEERS  # one part per reducer: every peer reduces

    # 1. Count every returned delta or average: the registry and hivemind_codecs are forked into
    #    the averagers with this module state.
    returns = {}
    for name, (code, ret) in CASES.items():
        number = hivemind_codecs.wire_type(code, ret)
        returns[name] = CountingReturnCodec(number, ret)
        returns[name].counter = Counter()
        monkeypatch.setitem(serialization._BASE_COMPRESSION_TYPES, hivemind_codecs.WIRE_NAMES[number], returns[name])
    averages_sent = Counter()
    original_message = hivemind_codecs.message

    def counting_message(data, tensor, compression_type):  # what shoal's runner sends a member
        averages_sent.add(len(data))
        return original_message(data, tensor, compression_type)

    monkeypatch.setattr(hivemind_codecs, "message", counting_message)
    returns["int8"].counter = averages_sent  # int4 returns go out as averages, not through compress
    sends = {name: Counter() for name in CASES}

    # 2. Error-fed pseudo-gradients: what each peer sends is on the codec's grid.
    generator = torch.Generator().manual_seed(7)
    pseudo_grads = [torch.randn(NUMEL, generator=generator) * (1 + i) for i in range(PEERS)]
    to_send = {name: [codecs.quantize(g, code) for g in pseudo_grads]  # a first round: no residual yet
               for name, (code, _) in CASES.items()}

    sigint = signal.getsignal(signal.SIGINT)  # every averager sets SIGINT to ignored in its parent
    dhts, averagers = [], {name: [] for name in CASES}
    prefix = f"codecs-{uuid.uuid4().hex[:8]}"
    try:
        for _ in range(PEERS):
            initial = [str(a) for a in dhts[0].get_visible_maddrs()] if dhts else []
            dhts.append(hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"], initial_peers=initial))
        p2pd = p2pd_descendants()
        for name, (code, ret) in CASES.items():
            for dht, vector in zip(dhts, to_send[name]):
                # shoal's averager, as a node runs it (average returns need its runner). A plain
                # DecentralizedAverager for the fp16-return case failed in CI: a part arrived before
                # its group was registered (hivemind refuses it: docs/hivemind.md), and that result,
                # missing a share, could not be told from a whole one (GroupResult.partial is shoal's).
                # No bans: a retried round (below) must not start with a peer refused in the first.
                averagers[name].append(ShoalAverager(
                    averaged_tensors=[vector.clone()], dht=dht, prefix=f"{prefix}-{name}", start=True,
                    target_group_size=PEERS, min_group_size=PEERS, min_matchmaking_time=2.0, request_timeout=1.0,
                    allreduce_timeout=10.0, compression=counting_codec(code, ret, part_values, sends[name]),
                    state_provider=lambda: ({}, []), robust=RobustConfig(aggregation="mean", ban_rounds=0)))

        # 3. One round per codec, all three peers at once.
        for name, (code, ret) in CASES.items():
            for _attempt in range(3):
                # 15 s: a round takes ~2.5 s; a matchmaking race that finds no group ends at the step's
                # timeout: this bounds what its replay costs the suite (with 40 s this test once took 33 s).
                controls = [averager.step(weight=weight, wait=False, timeout=15)
                            for averager, weight in zip(averagers[name], WEIGHTS)]
                groups = [_group_or_none(control) for control in controls]
                if all(groups) and not any(group.partial for group in groups):
                    break
                # A partial result (a reducer's share never arrived: docs/limitations.md; seen
                # once in CI) is not applied by shoal and the round is replayed: so here, from what
                # was sent (hivemind's own runner, for fp16 returns, does not say). So is a round
                # whose matchmaking failed ("could not find a group", hivemind's leader/follower
                # races: docs/hivemind.md; seen once here with the suite on both cores).
                for averager, vector in zip(averagers[name], to_send[name]):
                    with averager.get_tensors() as (tensor,):
                        tensor.copy_(vector)
            assert all(group is not None and len(group.gathered) == PEERS for group in groups), groups
            results = []
            for averager in averagers[name]:
                with averager.get_tensors() as (tensor,):
                    results.append(tensor.clone())

            # 4. Within the return bound of the exact weighted mean of what was sent.
            sent = [q.double() for q in to_send[name]]
            exact = sum(w * q for w, q in zip(WEIGHTS, sent)) / sum(WEIGHTS)
            bounds = []
            for q, result in zip(sent, results):
                delta = exact - q
                if ret == "fp16":
                    bound = 2**-11 * delta.abs()
                else:  # int4 blocks of 64 of the average (not the delta), each part encoded on its own
                    absmax = torch.cat([block.abs().max().view(1) for part in exact.split(part_values)
                                        for block in part.split(64)])
                    bound = ((0.5 + 2**-11) / 7 * absmax).repeat_interleave(64)[:NUMEL]
                bound = bound + 1e-6 * exact.abs().max()  # fp32 accumulation in the reducer
                bounds.append(bound)
                error = (result.double() - exact).abs()
                assert bool((error <= bound).all()), f"{name}: max excess {(error - bound).max().item():.3g}"
            for i in range(PEERS):
                for j in range(i):
                    gap = (results[i].double() - results[j].double()).abs()
                    if ret == "fp16":  # each member's own return error
                        assert bool((gap <= bounds[i] + bounds[j]).all())
                    else:  # the same average for everyone: one fp32 rounding of own + (average - own) apart
                        assert float(gap.max()) <= 2**-22 * float(exact.abs().max()), float(gap.max())
                        assert float(gap.max()) < 1e-3 * float(bounds[i].max())
            if ret == "fp16":  # the bound tells what was sent: the mean of the raw vectors is far outside it
                raw = sum(w * g.double() for w, g in zip(WEIGHTS, pseudo_grads)) / sum(WEIGHTS)
                assert (results[0].double() - raw).abs().max() > 10 * bounds[0].max()

            # 5. Our codec was on the wire: each peer sent its 2 foreign parts in `code` and each
            #    reducer returned 2 deltas or averages in `ret` (a reducer's own part never leaves it).
            expected_sends = sum(codecs.encoded_size(n, code) for n in part_lengths) * (PEERS - 1)
            expected_returns = sum(codecs.encoded_size(n, ret) for n in part_lengths) * (PEERS - 1)
            #    hivemind retries a step whose all-reduce failed (a peer late on a loaded machine), and a
            #    retry encodes its parts again (seen: 11 sends for 6): at least that many; exactly when none was.
            for counter, calls, total in ((sends[name], PEERS * (PEERS - 1), expected_sends),
                                          (returns[name].counter, PEERS * (PEERS - 1), expected_returns)):
                assert counter.calls.value >= calls and counter.bytes.value >= total, (name, counter.calls.value)
                if counter.calls.value == calls:
                    assert counter.bytes.value == total
    finally:
        for group in averagers.values():
            for averager in group:
                averager.shutdown()
        for dht in dhts:
            dht.shutdown()
        signal.signal(signal.SIGINT, sigint)
    deadline = time.monotonic() + 10
    while (leftover := p2pd_descendants()) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not leftover, f"p2pd left running: {sorted(leftover)}"
    assert p2pd, "expected a p2pd per DHT"


@pytest.mark.timeout(90)
def test_a_malformed_part_bans_its_sender_and_the_others_average(monkeypatch):
    """One peer's codec puts garbage on the wire (a broken or hostile peer). The reducers' decode
    raises ``MessageError``; hivemind catches it as a failed sender (``_ban_sender``: its parts leave
    the average) and the honest peers' round completes, with no crash in any averager process."""
    from hivemind.averaging.allreduce import AllReduceRunner

    bans = Counter()
    original_ban = AllReduceRunner._ban_sender

    async def counting_ban(self, peer_id):  # runs in the forked averager processes
        bans.add(0)
        await original_ban(self, peer_id)

    monkeypatch.setattr(AllReduceRunner, "_ban_sender", counting_ban)
    part_values = balanced_part_size(NUMEL, PEERS, 64, bytes_per_value=codecs.bytes_per_value("int4"))

    class GarbageCodec(ShoalCodec):
        def compress(self, tensor, info, allow_inplace=False):
            message = super().compress(tensor, info, allow_inplace)
            message.buffer = b"SHQ\x00" + bytes(len(message.buffer) - 4)  # version 0: refused by decode
            return message

    generator = torch.Generator().manual_seed(3)
    vectors = [codecs.quantize(torch.randn(NUMEL, generator=generator), "int4") for _ in range(PEERS)]
    prefix = f"garbage-{uuid.uuid4().hex[:8]}"

    def make(i: int, dht: hivemind.DHT) -> hivemind.DecentralizedAverager:
        codec_type = GarbageCodec if i == PEERS - 1 else ShoalCodec
        return hivemind.DecentralizedAverager(
            averaged_tensors=[vectors[i].clone()], dht=dht, prefix=prefix, start=True,
            target_group_size=PEERS, min_group_size=PEERS, min_matchmaking_time=2.0, request_timeout=1.0,
            allreduce_timeout=30.0, compression=codec_type("int4", part_values=part_values))

    with loopback_averagers(PEERS, make) as averagers:
        controls = [averager.step(wait=False, timeout=40) for averager in averagers]
        honest = [control.result(timeout=60) for control in controls[:-1]]  # raises if the round crashed
        assert all(group is not None and len(group) == PEERS for group in honest), honest
        try:
            controls[-1].result(timeout=60)  # the faulty peer's own round may fail; it must not hang
        except Exception:  # noqa: BLE001 - either outcome is fine for the peer that sent garbage
            pass
        assert bans.calls.value >= PEERS - 1  # each honest reducer banned the garbage sender
        assert all(averager.is_alive() for averager in averagers)
        for averager in averagers[:-1]:
            with averager.get_tensors() as (tensor,):
                assert bool(torch.isfinite(tensor).all())  # the garbage never reached a result
