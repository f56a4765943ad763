"""``shoal plot``: a PNG from synthetic metrics files, and one-line errors for bad input."""

from __future__ import annotations

import json
import sys

import pytest
from typer.testing import CliRunner

from node.commands.plot import plot
from node.observe.metrics import MetricsWriter
from node.observe.plot import draw, load_rounds
from protocols.errors import ConfigError
from tests.rounds import round_record

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def write_peer(path, peer: str, rounds: int, *, start: float = 1_000.0, eval_every: int = 2):
    with MetricsWriter(path, peer) as writer:
        writer.write("start", run_id="r", maddrs=[], device="cpu", parameters=1, shard=0, config_hash="x",
                     schedule_start=start)
        for r in range(1, rounds + 1):
            record = writer.write_round(round_record(
                round=r, group_size=2, inner_steps=10, tokens=1024, compute_s=8.0 + r * 0.1, wait_s=0.0,
                sync_s=0.5, wall_s=10.0, loss=4.0 - 0.1 * r, eval_loss=4.1 - 0.1 * r if r % eval_every == 0 else None))
            record["time"] = start + 10.0 * r  # the writer stamps time.time(); make the clock synthetic
            rewritten = path.read_text().splitlines()[:-1] + [json.dumps(record)]
            path.write_text("\n".join(rewritten) + "\n")


def test_many_peers_into_one_png(tmp_path):
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    write_peer(a, "12D3KooWaaaaaaaaaaaa", 6)
    write_peer(b, "12D3KooWbbbbbbbbbbbb", 4, start=1_020.0)
    peers, origin = load_rounds([a, b])
    assert [p.peer for p in peers] == ["12D3KooWaaaaaaaaaaaa", "12D3KooWbbbbbbbbbbbb"]
    assert [len(p.rounds) for p in peers] == [6, 4]
    assert origin == 1_000.0  # the earliest record of all files
    output = draw(peers, origin, tmp_path / "out.png")
    data = output.read_bytes()
    assert data.startswith(PNG_MAGIC) and len(data) > 10_000


def test_the_command_writes_and_says_so(tmp_path):
    a = tmp_path / "a.jsonl"
    write_peer(a, "12D3KooWaaaaaaaaaaaa", 3)
    out = tmp_path / "plot.png"
    result = CliRunner().invoke(_app(), [str(a), "-o", str(out)])
    assert result.exit_code == 0, result.output
    assert f"wrote {out} (1 peer, 3 rounds)" in result.output
    assert out.read_bytes().startswith(PNG_MAGIC)


def test_a_truncated_last_line_is_tolerated(tmp_path):
    a = tmp_path / "a.jsonl"
    write_peer(a, "12D3KooWaaaaaaaaaaaa", 3)
    with a.open("a") as f:
        f.write('{"event": "round", "rou')  # the peer crashed mid-write
    peers, _ = load_rounds([a])
    assert len(peers[0].rounds) == 3


@pytest.mark.parametrize(
    "content, needle",
    [
        (None, "does not exist"),
        ("", "is empty"),
        ("\n\n", "is empty"),
        ("not json\n{}\n", "not a JSON line"),
        ('[1, 2]\n{"event": "start"}\n', "not a shoal metrics record"),
        ('{"event": "start", "peer": "p", "time": 1.0}\n', "has no round records yet"),
        ('{"event": "round", "peer": "p", "time": 1.0, "round": 1}\n', "has no valid tokens, compute_s, wall_s"),
        ('{"event": "round", "peer": "p", "time": 1.0, "round": 1, "tokens": 1, "compute_s": 1, "wall_s": 1, '
         '"loss": "low"}\n', "has no valid loss"),
    ],
)
def test_bad_files_are_one_line_errors(tmp_path, content, needle):
    path = tmp_path / "m.jsonl"
    if content is not None:
        path.write_text(content)
    with pytest.raises(ConfigError, match=needle) as excinfo:
        load_rounds([path])
    assert "\n" not in str(excinfo.value) and str(path) in str(excinfo.value)
    result = CliRunner().invoke(_app(), [str(path), "-o", str(tmp_path / "x.png")])
    assert result.exit_code == ConfigError.exit_code and needle in result.output
    assert not (tmp_path / "x.png").exists()


def test_a_directory_and_an_unwritable_output(tmp_path):
    with pytest.raises(ConfigError, match="is not a file"):
        load_rounds([tmp_path])
    a = tmp_path / "a.jsonl"
    write_peer(a, "12D3KooWaaaaaaaaaaaa", 2)
    with pytest.raises(ConfigError, match="cannot write .*folder .* does not exist"):
        draw(*load_rounds([a]), tmp_path / "no" / "such" / "dir" / "out.png")


def test_missing_matplotlib_says_how_to_install(tmp_path, monkeypatch):
    a = tmp_path / "a.jsonl"
    write_peer(a, "12D3KooWaaaaaaaaaaaa", 2)
    for name in [m for m in sys.modules if m == "matplotlib" or m.startswith("matplotlib.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    with pytest.raises(ConfigError, match=r"pip install 'shoal\[plot\]'"):
        draw(*load_rounds([a]), tmp_path / "out.png")


def test_cli_help_does_not_import_matplotlib():
    import subprocess

    code = "import sys, node.cli; assert not any(m.startswith('matplotlib') for m in sys.modules), 'matplotlib'"
    subprocess.run([sys.executable, "-c", code], check=True)


def _app():
    import typer

    app = typer.Typer()
    app.command()(plot)
    return app
