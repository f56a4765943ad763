"""The README is checked against the code: a newcomer follows it literally, so a stale flag, a
dead link or a changed benchmark table is a bug.

- the CLI reference block is exactly what ``scripts/cli_reference.py`` generates from the app;
- every ``shoal <command> --flag`` in the docs is a flag of that command;
- Quick start is exactly ``make demo`` and ``make test``;
- relative links and images point at files that exist, ``#anchors`` at headings that exist;
- benchmark table rows are copied verbatim from ``benchmarks/results/*.md``.
"""

from __future__ import annotations

import importlib.util
import re
from functools import cache
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
README = REPO / "README.md"
# Docs whose `shoal ...` command lines must parse (docker/README.md too: its commands are copied).
DOCS = [README, *sorted((REPO / "examples").glob("*.md")), REPO / "docker" / "README.md"]
FIX_REFERENCE = "run .venv/bin/python scripts/cli_reference.py --write"


@cache
def cli_reference():
    spec = importlib.util.spec_from_file_location("cli_reference", REPO / "scripts" / "cli_reference.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@cache
def command_flags() -> dict[str, frozenset[str]]:
    """Every spelling of every option of every ``shoal`` subcommand (plus ``--help``)."""
    reference = cli_reference()
    group = reference.shoal_command()
    return {name: frozenset(f for p in command.params for f in reference.flags(p)) | {"--help"}
            for name, command in group.commands.items()}


def section(text: str, title: str) -> str:
    """The body of the ``## title`` section (up to the next level-2 heading)."""
    match = re.search(rf"^## {re.escape(title)}\s*$(.*?)(?=^## |\Z)", text, flags=re.M | re.S)
    assert match, f"README.md has no '## {title}' section"
    return match.group(1)


def without_code_blocks(text: str) -> str:
    return re.sub(r"^```.*?^```", "", text, flags=re.M | re.S)


# -- (a) the generated CLI reference ---------------------------------------------------------------
def test_cli_reference_block_is_generated_from_the_app():
    reference = cli_reference()
    block = reference.readme_block(README.read_text(encoding="utf-8"))
    assert block == reference.reference(), f"README.md's CLI reference is stale: {FIX_REFERENCE}"


def test_cli_reference_lists_every_command_and_flag():
    """The generator itself: a section per command, a row per option, pipes escaped."""
    reference = cli_reference()
    text = reference.reference()
    for name, flags in command_flags().items():
        body = text.split(f"### shoal {name}\n", 1)[1].split("### shoal ", 1)[0]
        assert f"```text\nshoal {name}" in body
        for flag in flags - {"--help"}:
            assert re.search(rf"^\| `[^`]*(?<![\w-]){re.escape(flag)}(?![\w-])", body, flags=re.M), f"{name} {flag}"
        for row in body.splitlines():
            if row.startswith("| `"):
                assert len(re.findall(r"(?<!\\)\|", row)) == 5, f"a cell holds an unescaped '|': {row}"
    assert "`SHOAL_INITIAL_PEERS` (space-separated)" in text  # repeatable flags read a list from the env


def test_write_replaces_only_the_block(tmp_path):
    reference = cli_reference()
    text = f"# t\n\nbefore\n{reference.START}\nold\n{reference.END}\nafter\n"
    new = reference.with_block(text, "new\n")
    assert new == f"# t\n\nbefore\n{reference.START}\nnew\n{reference.END}\nafter\n"
    assert reference.readme_block(new) == "new\n"
    with pytest.raises(ValueError, match="exactly one"):
        reference.readme_block("no markers here")


# -- (b) every `shoal <command> --flag` in the docs exists ------------------------------------------
# `shoal`, `.venv/bin/shoal` or an image `shoal:cpu`, a word, then the rest of that command: up to
# the end of the line (after joining `\` continuations), a closing backtick, a table's `|`, a shell
# separator or a comment.
COMMAND = re.compile(r"(?<![\w-])shoal(?::[\w.-]+)? +([a-z][\w-]*)([^\n`|;&]*)")
FLAG = re.compile(r"(?<![\w-])(--?[a-zA-Z][\w-]*)")


def mentioned_flags(text: str) -> list[tuple[str, str, str]]:
    """(command, flag, the line's text) for every flag given to a `shoal <command>` in ``text``."""
    text = re.sub(r"\\\n\s*", " ", text)
    found = []
    for match in COMMAND.finditer(text):
        command, rest = match.group(1), match.group(2).split(" #", 1)[0]
        for flag in FLAG.findall(rest):
            found.append((command, flag, match.group(0).strip()))
    return found


def test_the_flag_scanner_finds_flags_and_nothing_else():
    text = ("run `shoal status --initial-peer ... [--watch] [--json]` then\n"
            "```\n.venv/bin/shoal run --config a.toml \\\n    --run-id my-run-2026 --max-rounds 3  # --not-this\n```\n"
            "docker run -v shoal-data:/data shoal:cpu bootstrap --announce /dns4/x/tcp/1 | grep --nope\n"
            "shoal plot m.jsonl -o out.png; ls --also-not\n")
    assert [(c, f) for c, f, _ in mentioned_flags(text)] == [
        ("status", "--initial-peer"), ("status", "--watch"), ("status", "--json"),
        ("run", "--config"), ("run", "--run-id"), ("run", "--max-rounds"),
        ("bootstrap", "--announce"), ("plot", "-o")]


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(REPO)))
def test_every_documented_flag_exists(doc):
    commands = command_flags()
    found = mentioned_flags(doc.read_text(encoding="utf-8"))
    stale = [f"{line!r}: {'no command shoal ' + command if command not in commands else f'shoal {command} has no {flag}'}"
             for command, flag, line in found if flag not in commands.get(command, ())]
    assert not stale, f"{doc.relative_to(REPO)} mentions flags the CLI does not have:\n" + "\n".join(stale)
    if doc == README:  # the scanner saw the README's commands at all
        assert {command for command, _, _ in found} >= set(commands)


def test_flags_named_alone_in_the_readme_exist():
    """A code span that starts with a flag (`--use-relay`, `--sync-mode blocking`) names a shoal flag."""
    known = frozenset().union(*command_flags().values())
    spans = re.findall(r"`(--[a-zA-Z][^`]*)`", without_code_blocks(README.read_text(encoding="utf-8")))
    assert len(spans) > 20, "the span pattern found (almost) no flags"
    unknown = sorted({flag for span in spans for flag in FLAG.findall(span) if flag.startswith("--")} - known)
    assert not unknown, f"README.md names flags no shoal command has: {unknown}"


# -- (c) Quick start --------------------------------------------------------------------------------
def test_quick_start_is_make_demo_and_make_test():
    body = section(README.read_text(encoding="utf-8"), "Quick start")
    blocks = re.findall(r"^```[^\n]*\n(.*?)^```", body, flags=re.M | re.S)
    assert len(blocks) == 1, "Quick start must have one code block (the two set-up commands)"
    commands = [line.split("#", 1)[0].strip() for line in blocks[0].splitlines()]
    assert [c for c in commands if c] == ["make demo", "make test"]
    makefile = (REPO / "Makefile").read_text(encoding="utf-8")
    assert re.search(r"^demo:", makefile, flags=re.M) and re.search(r"^test:", makefile, flags=re.M)


# -- (d) links and images ---------------------------------------------------------------------------
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
HTML_LINK = re.compile(r"<(?:img|a)\b[^>]*?\b(?:src|href)=\"([^\"]+)\"", flags=re.I)


def github_anchor(heading: str) -> str:
    """GitHub's id for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[`*_]|<[^>]+>", "", heading).strip().lower()
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", text)
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def test_relative_links_and_images_exist():
    text = README.read_text(encoding="utf-8")
    prose = without_code_blocks(text)
    targets = LINK.findall(prose) + HTML_LINK.findall(prose)
    anchors = {github_anchor(h) for h in re.findall(r"^#{1,6} +(.+?)\s*$", prose, flags=re.M)}
    assert targets, "the link pattern found no links at all"
    missing = []
    for target in targets:
        if re.match(r"^[a-z][a-z0-9+.-]*:", target, flags=re.I):  # http:, https:, mailto:
            continue
        path, _, fragment = target.partition("#")
        if not path:
            if fragment not in anchors:
                missing.append(f"{target} (no heading with that anchor)")
        elif not (README.parent / path).exists():
            missing.append(target)
    assert not missing, "README.md links to nothing at: " + ", ".join(missing)


def test_the_picture_is_the_benchmark_plot():
    assert re.search(r"!\[[^\]]+\]\(benchmarks/results/sync_modes\.png\)", README.read_text(encoding="utf-8"))


# -- benchmark tables are the measured ones -----------------------------------------------------------
def test_benchmark_tables_are_copied_verbatim_from_the_results():
    rows = [line for line in section(README.read_text(encoding="utf-8"), "Benchmarks").splitlines()
            if line.startswith("|")]
    results = {line for path in (REPO / "benchmarks" / "results").glob("*.md")
               for line in path.read_text(encoding="utf-8").splitlines()}
    assert rows, "the Benchmarks section has no table"
    changed = [row for row in rows if row not in results]
    assert not changed, ("benchmark rows in README.md differ from benchmarks/results/*.md (copy the tables from "
                         "there, do not retype them):\n" + "\n".join(changed))
