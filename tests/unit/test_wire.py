"""averaging.math.wire: error feedback keeps the cumulative error within one residual, and with the
residual in the live parameters it is exact through folds, local rounds and re-syncs; fp16 returns keep anchors within the consistency tolerance over 100
rounds and int8/int4 returns (the quantized average) keep them identical; honest per-round byte counts."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from averaging.math import codecs, groups
from averaging.math.fingerprints import consensus
from averaging.math.flat import FlatLayout
from averaging.math.merge import merge_correction
from averaging.math.outer_step import OuterConfig, outer_step_
from averaging.math.wire import WireFormat, accounted_for, mix_code, returned, round_payload
from averaging.state.shared_state import SharedState
from node.library.config import AveragingConfig, RoundConfig, sync_shared_fields
from node.library.local_network import LocalNetwork, LocalSwarmHub
from protocols.errors import ConfigError


def fed(work: torch.Tensor, residual: torch.Tensor, wire: WireFormat) -> tuple[torch.Tensor, torch.Tensor]:
    """One averaged round of the engine's error feedback: the pseudo-gradient carries the residual
    (it lives in the parameters), the wire sends ``to_send`` of it, and what the anchor does not
    account for (``accounted_for``: what was sent) stays behind. (sent, next residual)."""
    pseudo_grad = work + residual
    sent = wire.to_send(pseudo_grad)
    accounted = accounted_for(pseudo_grad, sent, averaged=True, local=False, error_feedback=True)
    return sent, pseudo_grad - accounted


def buffered_feedback(pending: torch.Tensor, residual: torch.Tensor, code: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The textbook reference: a residual buffer, ``q = Q(g + r)``, ``r' = g + r - q``."""
    corrected = pending + residual
    sent = codecs.quantize(corrected, code)
    return sent, corrected - sent


ROUNDS = 200


def rounds_of_pseudo_grads(numel: int, seed: int = 0):
    """A persistent drift below int4's resolution in most blocks, plus noise and an outlier per block."""
    generator = torch.Generator().manual_seed(seed)
    drift = torch.full((numel,), 0.02)
    for _ in range(ROUNDS):
        g = drift + 0.01 * torch.randn(numel, generator=generator)
        g[::64] = 1.0  # one large entry per block: int4's step becomes 1/7, the drift rounds to 0
        yield g


@pytest.mark.parametrize("code", ["int8", "int4", "int2"])
def test_feedback_keeps_the_cumulative_error_within_one_residual(code):
    numel = 64 * 40 + 13
    residual = torch.zeros(numel)
    sent_total, true_total, plain_total = torch.zeros(numel), torch.zeros(numel), torch.zeros(numel)
    largest_residual = []
    for g in rounds_of_pseudo_grads(numel):
        sent, next_residual = fed(g, residual, WireFormat.of(code))
        assert torch.equal(codecs.quantize(sent, code), sent)  # on the grid: re-encoding is lossless
        corrected = g + residual
        if code != "int2":  # int codes: the residual is at most half a step (block absmax / L) per element
            padded = torch.nn.functional.pad(corrected.abs(), (0, -numel % 64)).view(-1, 64)
            step = padded.amax(1).repeat_interleave(64)[:numel] / codecs.CODES[code].max_level
            assert bool((next_residual.abs() <= (0.5 + 2**-11) * step).all())
        residual = next_residual
        sent_total += sent
        true_total += g
        plain_total += codecs.quantize(g, code)
        largest_residual.append(residual.abs().max().item())
    with_feedback = (sent_total - true_total).abs()
    without = (plain_total - true_total).abs()
    # The sum of what was sent is off by exactly the last residual, whatever the number of rounds.
    assert torch.allclose(sent_total - true_total, -residual, atol=1e-4)
    # Bounded, not growing: the residual of the last 100 rounds is no larger than of the first 100.
    assert max(largest_residual[100:]) <= 1.2 * max(largest_residual[:100])
    # int2 keeps one magnitude per block: a block's outlier is sent a bit at a time (about 10
    # rounds of it wait in the residual here), where int codes send it at once.
    assert with_feedback.max() < (12.0 if code == "int2" else 1.5)
    # Without feedback the dropped drift piles up: 200 rounds x 0.02 = 4 per element.
    if code != "int8":
        assert without.max() > 3.0
        assert without.norm() > 10 * with_feedback.norm()


def test_feedback_matters_even_for_unbiased_noise():
    numel = 4096
    generator = torch.Generator().manual_seed(1)
    residual = torch.zeros(numel)
    error_with, error_without = torch.zeros(numel), torch.zeros(numel)
    for _ in range(ROUNDS):
        g = torch.randn(numel, generator=generator)
        sent, residual = fed(g, residual, WireFormat.of("int4"))
        error_with += sent - g
        error_without += codecs.quantize(g, "int4") - g
    # Independent rounding errors random-walk (sqrt(200) ~ 14 steps of 1/sqrt(12)); fed back, one step.
    assert error_without.norm() > 5 * error_with.norm()


def test_config_spellings_resolve_to_a_wire_format():
    assert WireFormat.of("fp32") == WireFormat(code="fp32", return_code="fp32", error_feedback=False)
    assert WireFormat.of("fp16").quantized is False and WireFormat.of("fp16").block_size == 0
    assert WireFormat.of("int8").block_size == 64 and WireFormat.of("int4").block_size == 64
    assert WireFormat.of("int2").block_size == 256  # the default the codec's measurements chose
    assert WireFormat.of("int4", block_size=32, return_compression="int8").return_code == "int8"
    assert AveragingConfig(compression="int2").wire.block_size == 256
    assert AveragingConfig(compression="int4", error_feedback=False).wire.error_feedback is False
    assert WireFormat.of("int4", return_compression="int4").return_bytes_per_value() < 0.54
    with pytest.raises(ValueError, match="return code"):
        WireFormat.of("int4", return_compression="int2")  # too coarse for an average nobody error-feeds
    with pytest.raises(ConfigError, match="averaging.compression"):
        AveragingConfig(compression="int3")
    with pytest.raises(ConfigError, match='averaging.compression.*use "fp32"'):
        AveragingConfig(compression="none")  # the pre-release spelling of fp32
    with pytest.raises(ValueError, match="unknown code 'none'"):
        WireFormat.of("none")


def test_codec_settings_join_the_manifest():
    fp16 = sync_shared_fields(outer=OuterConfig(), rounds=_rounds(), averaging=AveragingConfig(compression="fp16"))
    assert fp16["averaging.block_size"] == 0 and fp16["averaging.return_compression"] == "fp16"
    int4 = sync_shared_fields(outer=OuterConfig(), rounds=_rounds(), averaging=AveragingConfig())  # the default
    assert int4["averaging.compression"] == "int4" and int4["averaging.block_size"] == 64
    assert int4["averaging.return_compression"] == "int4" and int4["averaging.target_group_size"] == 0
    # "auto" is resolved before it reaches the manifest: peers agree on the code, not on a spelling
    explicit = AveragingConfig(compression="int4", return_compression="int4")
    assert sync_shared_fields(outer=OuterConfig(), rounds=_rounds(), averaging=explicit) == int4
    assert AveragingConfig(compression="int2").wire.return_code == "int4"
    assert AveragingConfig(compression="int8").wire.return_code == "int8"
    # error feedback is per peer, never on the wire: not something peers must agree on
    assert "averaging.math.error_feedback" not in int4


def _rounds():
    from node.library.config import RoundConfig
    return RoundConfig()


@pytest.mark.parametrize(("ours", "theirs", "field"), [
    ({"compression": "fp16"}, {"compression": "int4"}, "averaging.compression"),
    ({}, {"compression": "fp16"}, "averaging.compression"),
    ({"compression": "int4"}, {"compression": "int4", "block_size": 32}, "averaging.block_size"),
    ({"compression": "int4"}, {"compression": "int4", "return_compression": "int8"}, "averaging.return_compression"),
])
def test_a_peer_with_another_codec_is_refused_at_join_naming_the_field(ours, theirs, field):
    from node.api import DiLoCoSwarm
    hub = LocalSwarmHub()
    fast = AveragingConfig(matchmaking_seconds=0.4, request_timeout=0.2, allreduce_timeout=5.0)
    model = torch.nn.Linear(4, 2)
    first = DiLoCoSwarm(model, run_id="codec-test", network=LocalNetwork(hub, "first"),
                        averaging=dataclasses.replace(fast, **ours))
    try:
        with pytest.raises(ConfigError, match=field):
            DiLoCoSwarm(torch.nn.Linear(4, 2), run_id="codec-test", network=LocalNetwork(hub, "second"),
                        averaging=dataclasses.replace(fast, **theirs))
    finally:
        first.close()


def test_accounted_for_each_way_a_round_ends():
    g, q = torch.tensor([1.0, 2.0]), torch.tensor([1.0, 1.5])
    assert accounted_for(g, q, averaged=True, local=False, error_feedback=True) is q
    assert accounted_for(g, q, averaged=True, local=False, error_feedback=False) is g
    assert accounted_for(g, q, averaged=False, local=True, error_feedback=True) is g  # nothing was sent
    assert accounted_for(g, q, averaged=False, local=False, error_feedback=True) is None  # folded: keep it all


# -- error feedback through folds, local rounds and re-syncs (pure, one peer's view) -----------------

@pytest.mark.parametrize("code", ["int8", "int4", "int2"])
def test_residual_in_the_parameters_is_error_feedback_committed_only_when_averaged(code):
    """Drive the round engine's arithmetic by hand (pseudo-gradient, send, outer step, merge) over a
    mix of round endings, and check it against the reference: a residual buffer that is committed
    only when a round is averaged, cleared by a local round, kept through a fold and a re-sync."""
    numel, wire = 64 * 7 + 5, WireFormat.of(code)
    generator = torch.Generator().manual_seed(1)
    anchor, momentum = torch.zeros(numel), torch.zeros(numel)
    params = anchor.clone()
    residual, pending = torch.zeros(numel), torch.zeros(numel)  # the reference's buffer, unsent work
    endings = ["averaged", "folded", "averaged", "local", "averaged", "resync", "folded", "folded", "averaged"]
    for ending in endings * 3:
        work = 0.01 * torch.randn(numel, generator=generator)
        params -= work  # inner steps: the pseudo-gradient grows by `work`
        pending += work
        # our engine
        pseudo_grad = anchor - params
        sent = wire.to_send(pseudo_grad)
        # the reference sends Q(pending + residual): the same vector
        reference_sent, reference_residual = buffered_feedback(pending, residual, code)
        assert torch.allclose(sent, reference_sent, atol=1e-6), ending
        old_anchor = anchor.clone()
        others = 0.01 * torch.randn(numel, generator=generator)  # another peer's send
        if ending in ("averaged", "resync"):
            outer_step_(anchor, (sent + others) / 2, momentum, lr=0.7, mu=0.9)
            residual, pending = reference_residual, torch.zeros(numel)
        elif ending == "local":
            outer_step_(anchor, pseudo_grad, momentum, lr=0.7, mu=0.9)  # alone: the full pseudo-gradient
            residual, pending = torch.zeros(numel), torch.zeros(numel)
        if ending == "resync":  # a donor's anchor replaces ours after the round
            anchor += 0.001 * torch.randn(numel, generator=generator)
        accounted = accounted_for(pseudo_grad, sent, averaged=ending in ("averaged", "resync"),
                                  local=ending == "local", error_feedback=True)
        params += merge_correction(anchor, old_anchor, accounted, contributed=accounted is not None)
        # the invariant: the parameters sit at anchor - (residual + unsent work), nothing else
        assert torch.allclose(anchor - params, residual + pending, atol=1e-5), ending
    assert residual.abs().max() > 0  # the test exercised a real residual


def test_without_feedback_the_residual_is_dropped():
    wire = WireFormat.of("int4", error_feedback=False)
    anchor = torch.zeros(256)
    params = anchor - torch.linspace(-1, 1, 256)
    pseudo_grad = anchor - params
    sent = wire.to_send(pseudo_grad)
    assert not torch.equal(sent, pseudo_grad)
    new_anchor = anchor - sent
    accounted = accounted_for(pseudo_grad, sent, averaged=True, local=False, error_feedback=wire.error_feedback)
    params += merge_correction(new_anchor, anchor, accounted, contributed=True)
    assert torch.equal(params, new_anchor)  # back on the shared point: the quantization error is gone


# -- return path: drift over 100 rounds -------------------------------------------------------------

def _delta_returns(code: str):
    """Reducers returning ``average - own`` re-encoded in ``code`` (hivemind's way; not offered for int codes)."""
    return lambda average, own: own + codecs.quantize(average - own, code)


def _drift_run(returns, rounds: int, *, peers: int = 3, numel: int = 4 * 4093) -> list[int]:
    """Peers with their own outer state average error-fed int4 sends; each ends the round with
    ``returns(avg, own)`` and applies it. Returns, per round, how many peers the consistency check
    (default tolerance) says diverged."""
    generator = torch.Generator().manual_seed(0)
    layout = FlatLayout.of([("w", torch.zeros(numel))])
    init = torch.randn(numel, generator=generator)
    states = [SharedState(layout, init.clone(), OuterConfig()) for _ in range(peers)]
    residuals = [torch.zeros(numel) for _ in range(peers)]
    diverged = []
    for round in range(1, rounds + 1):
        shared = torch.distributions.StudentT(4.0).sample((numel,)) * 0.01
        sends = []
        for j in range(peers):
            g = 0.5 * shared + 0.5 * 0.01 * torch.distributions.StudentT(4.0).sample((numel,))
            sent, residuals[j] = fed(g, residuals[j], WireFormat.of("int4"))
            sends.append(sent)
        average = sum(sends) / peers
        for state, own in zip(states, sends):
            state.apply(returns(average, own), round=round)
        verdict = consensus({str(j): s.claim() for j, s in enumerate(states)})
        diverged.append(len(verdict.diverged))
    return diverged


def test_fp16_returns_keep_anchors_within_the_tolerance_over_100_rounds():
    assert sum(_drift_run(lambda average, own: returned(average, own, "fp16"), 100)) == 0


@pytest.mark.parametrize("code", ["int8", "int4"])
def test_quantized_returns_carry_the_average_so_anchors_never_drift(code):
    assert sum(_drift_run(lambda average, own: returned(average, own, code), 100)) == 0
    average, own = torch.randn(1000), torch.randn(1000)
    assert torch.equal(returned(average, own, code), returned(average, -own, code))  # the same for every member


def test_int4_deltas_would_trip_the_check_which_is_why_returns_carry_the_average():
    assert sum(_drift_run(_delta_returns("int4"), 10)) > 0  # the drift tests above can fail


# -- bytes ----------------------------------------------------------------------------------------

def test_round_payload_counts_sends_and_returns_in_their_codes():
    int4 = WireFormat.of("int4", return_compression="fp16")
    sent, received = round_payload(1_000_000, 4, send_bytes_per_value=int4.send_bytes_per_value(),
                                   return_bytes_per_value=int4.return_bytes_per_value())
    assert sent == received == round(3 / 4 * 1_000_000 * (0.53125 + 2))
    both = WireFormat.of("int4")  # the default: int4 returns of the average
    assert round_payload(1_000_000, 4, send_bytes_per_value=both.send_bytes_per_value(),
                         return_bytes_per_value=both.return_bytes_per_value()) == (796_875, 796_875)
    client = round_payload(1_000_000, 4, send_bytes_per_value=0.53125, return_bytes_per_value=2, client_mode=True)
    assert client == (531_250, 2_000_000)
    assert round_payload(1_000, 1, send_bytes_per_value=2, return_bytes_per_value=2) == (0, 0)
    assert round_payload(1000, 4, send_bytes_per_value=2, return_bytes_per_value=2) == (3000, 3000)  # fp16
    assert round_payload(1000, 3, send_bytes_per_value=2, return_bytes_per_value=2, client_mode=True) == (2000, 2000)
    assert WireFormat.of("fp32").send_bytes_per_value() == 4
    assert WireFormat.of("int2").send_bytes_per_value() == codecs.bytes_per_value("int2", 256)


def test_sub_groups_send_a_compact_state_only_where_every_member_takes_the_same_bytes():
    """``mix_code``: the lattice code (1 byte a parameter each way; fp16 on request, 2) where
    reducers return the mean itself; fp32 where they return deltas (each member would keep its own
    rounding) or where the inner optimizer's moments ride (fp16 flushes a second moment's small
    entries). The code is a manifest field of every sub-group run, so peers that would decode
    otherwise are refused."""
    assert mix_code(WireFormat.of("int4"), with_inner_state=False) == "lat8"
    assert mix_code(WireFormat.of("int8"), with_inner_state=False) == "lat8"
    assert mix_code(WireFormat.of("int4"), with_inner_state=False, requested="fp16") == "fp16"
    assert mix_code(WireFormat.of("int4"), with_inner_state=False, requested="fp32") == "fp32"
    assert mix_code(WireFormat.of("int4", return_compression="fp16"), with_inner_state=False) == "fp32"
    assert mix_code(WireFormat.of("fp16"), with_inner_state=False) == "fp32"
    assert mix_code(WireFormat.of("int4"), with_inner_state=True) == "fp32"
    shared = lambda **kw: sync_shared_fields(outer=OuterConfig(), rounds=RoundConfig(),  # noqa: E731
                                             averaging=AveragingConfig(**kw))
    assert shared(target_group_size=8)["averaging.state_code"] == "lat8"
    assert shared(target_group_size=8, state_compression="fp16")["averaging.state_code"] == "fp16"
    assert shared(target_group_size=8, average_inner_state=True)["averaging.state_code"] == "fp32"
    assert shared()["averaging.sub_groups"] == groups.RULE and shared()["averaging.target_group_size"] == 0
    # An anchor's fp16 round trip under the part's power-of-two scale: within 2**-11 of the part's
    # largest value, whatever its magnitude (weights of size 1e-3 or 1e3 alike).
    for size in (1e-3, 1.0, 1e3):
        anchor = torch.randn(4096, generator=torch.Generator().manual_seed(0)) * size
        back = codecs.decode(codecs.encode(anchor, "fp16"), max_numel=4096)
        assert float((back - anchor).abs().max()) <= 2**-11 * float(anchor.abs().max())
