"""Three real `shoal run` processes on loopback train a tiny `LlamaForCausalLM` together, on
documents from a parquet file tokenized with a BPE tokenizer (real DHT, real butterfly all-reduce of
error-fed int4 sends, reducers returning the int4-quantized average, through shoal's codecs and
runner; the byte GPT and the default fp16 path run in every other swarm test); one of them in client
mode, as behind a NAT, and throttled to a third of its speed (a slower GPU): in overlap mode it does
not hold the fast ones back, and it contributes anyway. Then `shoal export` hands the swarm's model
to `transformers`, which loads it and gives shoal's logits. (One swarm for all of it: each costs over
a minute of the CI's budget.)"""

from __future__ import annotations

import itertools
import subprocess
from pathlib import Path

import pytest
import torch

from averaging.math.wire import WireFormat, round_payload
from node.library.checkpoint import load_latest_valid
from node.observe.metrics import read_metrics
from node.process.config import load_config
from node.training.export import trained_model
from node.training.model import build_model
from tests.integration.swarm import (
    REPO,
    TINY,
    anchor_at,
    every_round_checkpoints,
    found_no_group,
    is_partial,
    rounds_of,
    shoal_command,
    train_then_interrupt,
)

pytestmark = pytest.mark.integration

# Rounds in which all three train from the start of the round: the run lasts as long as start-up
# needs (on a loaded 2-core machine peers can start several rounds late), then 3 more rounds.
FULL_ROUNDS = 3
# tiny's 10 s rounds: shorter ones leave too little room, on a loaded machine, for what a fast peer
# does between its steps (eval, a checkpoint, the merge) to stay under 20% of the round.
ROUND = ("--round-seconds", "10")
FP16_UNIT_ROUNDOFF = 2.0**-11
# A Llama of the tiny GPT's size (~180k parameters with a 400-token vocabulary; untied head).
LLAMA = """[model]
kind = "hf"
architecture = "LlamaForCausalLM"
seq_len = 64

[model.hf]
hidden_size = 64
intermediate_size = 192
num_hidden_layers = 2
num_attention_heads = 4
num_key_value_heads = 2
"""


def llama_config(root, text: str):
    """tiny.toml with the Llama above, a BPE tokenizer and a parquet file of stdlib modules as documents."""
    import sysconfig

    from tests.unit.text_fixtures import train_tokenizer, write_parquet

    tokenizer = train_tokenizer(root / "bpe")
    stdlib = sysconfig.get_paths()["stdlib"]
    modules = sorted(Path(stdlib).glob("*.py"))[:120]
    write_parquet(root / "data" / "stdlib.parquet", [m.read_text(encoding="utf-8", errors="replace") for m in modules])
    model = text[text.index("\n[model]\n") + 1:text.index("\n[data]\n") + 1]
    data = (f'[data]\ntokenizer = "{tokenizer}"\npaths = ["{root / "data" / "*.parquet"}"]\n'
            f'cache_dir = "{root / "cache"}"\n')
    # The byte GPT's inner lr (3e-3) made this Llama diverge once in two CI-like runs (eval 6.0 ->
    # 4.4 -> 6.2 -> 10.1 over four rounds of ~100 steps, with outer lr 1.0 / momentum 0.5): 1e-3, the
    # order of lr a Llama of this width is trained with.
    assert "\nlr = 3e-3\n" in text
    return text.replace(model, LLAMA + "\n").replace("[data]\npaths = []", data).replace("\nlr = 3e-3\n", "\nlr = 1e-3\n")


def background(command: list[str], request) -> subprocess.Popen:
    proc = subprocess.Popen(command, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    request.addfinalizer(proc.kill)  # a no-op once it has been read
    return proc


def finished(proc: subprocess.Popen) -> subprocess.CompletedProcess:
    stdout, stderr = proc.communicate(timeout=120)
    return subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)


@pytest.mark.timeout(400)
# int4 only: the default fp16 path runs in every other swarm test (churn: 4 peers, anchors compared),
# and one 3-peer run costs over a minute of the CI's budget.
@pytest.mark.parametrize(("compression", "returns"), [("int4", "int4")])
def test_three_peers_train_one_model(swarm, compression, returns, request):
    config_path = every_round_checkpoints(
        swarm.root / f"llama-{compression}.toml",
        text=llama_config(swarm.root, TINY.read_text().replace(
            'compression = "fp16"', f'compression = "{compression}"\nreturn_compression = "{returns}"')))
    assert load_config(config_path).averaging.wire.return_code == returns
    first = swarm.start("a", *ROUND, config=config_path)
    # c is behind a NAT as far as it knows: client mode, outgoing connections only; and slow.
    others = [swarm.start_joining(first, "b", *ROUND, config=config_path),
              swarm.start_joining(first, "c", *ROUND, "--client-mode", "--throttle", "3", config=config_path)]
    swarm.share_address(first)
    peers = [first, *others]
    # Peers start while the run is already going (process start-up is slow on 2 shared cores):
    # from the first round every peer took part in, every group must hold all three.
    common = train_then_interrupt(peers, full_rounds=FULL_ROUNDS, timeout=300)
    last = common[-1]
    # `shoal plot` and `shoal export` read what the peers left: both start now, beside each other and
    # the checks below (each is an interpreter start-up, seconds on two cores); read where checked.
    png = peers[0].workdir.parent / "swarm.png"
    exported = swarm.root / "exported"
    plotting = background([*shoal_command(), "plot", *(str(p.metrics_path) for p in peers), "-o", str(png)], request)
    exporting = background([*shoal_command(), "export", "--checkpoint-dir", str(first.checkpoint_dir),
                            "--output", str(exported)], request)
    per_peer = {peer.name: rounds_of(peer) for peer in peers}
    assert len(common) >= 3, {name: sorted(r) for name, r in per_peer.items()}
    config = load_config(config_path)
    initial = build_model(config.model, seed=config.train.seed, vocab_size=400)
    assert type(initial.hf).__name__ == "LlamaForCausalLM"
    init = torch.cat([p.detach().flatten() for p in initial.parameters()])
    wire = WireFormat.of(compression, return_compression=returns)
    # A member that got part of the average back (a reducer's answer stream ended short:
    # docs/limitations.md) does not apply it, and is one step behind in the next round, where it
    # replays the step: a fault of the transport, handled, and shown here if it happens.
    ids = {name: rounds[min(rounds)]["peer"] for name, rounds in per_peer.items()}
    partial = {(ids[name], r) for name, rounds in per_peer.items() for r, record in rounds.items()
               if is_partial(record)}
    # A joiner of a young run replays the steps its donors served; a donor that steps alone just
    # after serving them leaves it a step behind, which its first averaged round finds (it is
    # listed as diverged there) and repairs by replaying that step.
    caught_up = {(ids[name], r) for name, rounds in per_peer.items() for r, record in rounds.items()
                 if record["caught_up"]}
    # A member whose matchmaking found no group in time (CI, two starved cores: the throttled
    # follower missed its leader's answer once) folds, and the others average without it: a fault
    # of the load, handled (checked below: it replays the step next round), shown here if it
    # happens. How often the load causes it is not this test's to bound; a peer that never finds a
    # group (a clock or matchmaking bug) still fails: each peer is in its group in most rounds.
    no_group = {(ids[name], r) for name, rounds in per_peer.items() for r in common if found_no_group(rounds[r])}
    for name in per_peer:
        assert sum(peer == ids[name] for peer, _ in no_group) < len(common) / 2, (name, sorted(no_group))
    for name, rounds in per_peer.items():
        for r in common:
            shown = (name, r, rounds[r]["applied"], rounds[r]["error"], rounds[r]["diverged"], sorted(partial),
                     sorted(caught_up), sorted(no_group))
            if (ids[name], r) in no_group:
                assert (rounds[r]["bytes_sent"], rounds[r]["bytes_received"]) == (0, 0), shown
                after = rounds.get(r + 1)  # the next round replays the step it missed, or averages
                assert after is None or after["caught_up"] or after["applied"] == "averaged", shown
                continue
            members = 3 - sum(rnd == r for _, rnd in no_group)
            # A group the leader assembled with the member that then gave up (its answer came too late
            # for it) is one of 3 to the others: they wait out that member's parts and average without
            # them. Partial when it was a reducer; complete when it was the client-mode peer c, which
            # reduces no part (seen in CI: a averaged "of 3" while c folded).
            assert rounds[r]["group_size"] == members or (members < 3 and rounds[r]["group_size"] == 3), shown
            # Each round record says what the all-reduce moved, sends and returns each in their code.
            expected = round_payload(init.numel(), rounds[r]["group_size"],
                                     send_bytes_per_value=wire.send_bytes_per_value(),
                                     return_bytes_per_value=wire.return_bytes_per_value(), client_mode=name == "c")
            assert (rounds[r]["bytes_sent"], rounds[r]["bytes_received"]) == expected, shown
            assert rounds[r]["applied"] == "averaged" or (ids[name], r) in partial, shown
            assert all((peer, r - 1) in partial or (peer, r - 1) in no_group or (peer, r) in caught_up
                       for peer in rounds[r]["diverged"]), shown
        assert set(range(min(rounds), last + 1)) <= set(rounds), f"{name} skipped a round: {sorted(rounds)}"

    # Overlap: the all-reduce runs in the background while the fast peers train, whatever the slow one
    # does: the loop never waits for it, and trains through the run (over the common rounds: what a
    # fast peer does between steps, eval, a checkpoint, the merge, can take a loaded round's second).
    for name in ("a", "b"):
        records = [per_peer[name][r] for r in common]
        assert all(record["wait_s"] < 0.5 for record in records), records  # near zero
        assert sum(x["compute_s"] for x in records) > 0.8 * sum(x["wall_s"] for x in records), records
    # The slow peer did fewer steps in the same wall-clock rounds, and contributed anyway (above).
    fast_steps = sum(per_peer["a"][r]["inner_steps"] for r in common)
    slow_steps = sum(per_peer["c"][r]["inner_steps"] for r in common)
    assert slow_steps < 0.6 * fast_steps, (slow_steps, fast_steps)

    # `shoal plot` draws these real metrics files (loss vs wall-clock and tokens, utilization).
    plotted = finished(plotting)
    assert plotted.returncode == 0, plotted.stderr[-2000:]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000

    start_c = next(r for r in read_metrics(others[1].metrics_path) if r["event"] == "start")
    assert start_c["mode"] == "client" and "client mode (--client-mode)" in others[1].log()

    # Eval loss of the shared model went down over the run.
    evals = [per_peer["a"][r]["eval_loss"] for r in sorted(per_peer["a"]) if per_peer["a"][r]["eval_loss"] is not None]
    print("eval losses of a:", evals)
    assert evals[-1] < evals[0], evals

    # The anchors agree. Every reducer averages the same int4 values (error-fed sends are on the
    # codec's grid). With fp16 returns each peer adds fp16(avg - local) to its own local value, so
    # the averaged pseudo-gradients differ by at most 2^-11 of |avg - local| per element, and an
    # error e in one round moves the anchor by lr/(1-mu) * e (2e at 1.0 / 0.5) in total: over the common rounds
    # far below 1% of how far the anchor moved from its init. With int4 returns every peer gets
    # the same quantized average, so they differ only by the fp32 rounding of local + (avg - local)
    # (2^-24 relative), which the step kept in fp16 hides except where it straddles an fp16 rounding
    # boundary (about 2^-13 of the values, by 2^-11): under 2^-17 of a step in RMS. A failed part (a
    # peer keeping its own pseudo-gradient) would be of the order of the anchor's movement. A step
    # replayed from a donor's history (a joiner's, or one a member missed) is the step kept: exact.
    # A member that did not apply the last round's average (it found no group, or got part of it
    # back) replays that step only after the run ends: compare at the round before.
    compared = last - 1 if any(rounds[last]["applied"] != "averaged" for rounds in per_peer.values()) else last
    anchors = {}
    for peer in peers:
        checkpoint = load_latest_valid(peer.checkpoint_dir)  # the one written when it left
        # A peer that did not apply the last round's average (no group, or part of it back) left a
        # step behind: it would have replayed that step in the next round (CI: 3 vs 4, int4 run).
        behind = per_peer[peer.name][last]["applied"] != "averaged"
        assert checkpoint is not None and checkpoint.round >= last - behind, (
            peer.name, checkpoint.round if checkpoint else None, per_peer[peer.name][last])
        anchors[peer.name] = anchor_at(peer, compared)
    moved = (anchors["a"] - init).square().mean().sqrt()
    gain = config.outer.lr / (1 - config.outer.momentum)
    pair_bound = gain * 2 * (FP16_UNIT_ROUNDOFF if wire.return_code == "fp16" else 2**-17) * len(common)
    for x, y in itertools.combinations(anchors, 2):
        rms_diff = (anchors[x] - anchors[y]).square().mean().sqrt()
        print(f"anchors {x}-{y}: rms diff {rms_diff:.3e}, max diff {(anchors[x] - anchors[y]).abs().max():.3e}, "
              f"anchor moved {moved:.3e} (ratio {rms_diff / moved:.2e}, bound {pair_bound:.2e})")
        assert rms_diff <= pair_bound * moved, (x, y, float(rms_diff), float(moved))
        assert rms_diff < 1e-3, (x, y, float(rms_diff))  # the noise is ~1e-4 here; a failed part ~1e-2
    # Average returns give every member the same average, and every step is applied as it is kept:
    # the joiners (from the initial weights, or replaying the organiser's first steps at join) hold
    # the organiser's anchor exactly. A catch-up in a round may first undo a step (not exact): with
    # one, or a re-sync, the bound above is the check.
    undone = any(r["caught_up"] or r["resynced"] for rounds in per_peer.values() for r in rounds.values())
    if wire.return_code != "fp16" and not undone:
        assert all(torch.equal(anchors["a"], anchors[name]) for name in ("b", "c")), "the anchors differ"

    # `shoal export` writes the swarm's model in the Hugging Face format: transformers loads it with
    # its tokenizer, gives the logits shoal's own model gives on the same input, and generates.
    from transformers import AutoModelForCausalLM, AutoTokenizer

    result = finished(exporting)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    checkpoint = load_latest_valid(first.checkpoint_dir)
    ours = trained_model(checkpoint.params, config.model, 400).eval()
    theirs = AutoModelForCausalLM.from_pretrained(exported).eval()
    tokenizer = AutoTokenizer.from_pretrained(exported)
    ids = torch.tensor([tokenizer("def main(argv):\n    return argv")["input_ids"]])
    with torch.no_grad():
        torch.testing.assert_close(theirs(ids).logits, ours(ids)[0], atol=1e-5, rtol=1e-4)
        assert theirs.generate(ids, max_new_tokens=8, do_sample=False).shape == (1, ids.shape[1] + 8)
