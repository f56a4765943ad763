"""The README and the docs/ pages it links are checked against the code: a newcomer follows them
literally, so a stale flag, a dead link or a changed benchmark table is a bug.

- the README keeps its sections, in order, on a few screens, and links every docs/ page;
- the CLI reference block (in docs/cli.md) is exactly what ``scripts/cli_reference.py`` generates;
- every ``shoal <command> --flag`` in the README, docs/, examples/ and docker/ is a flag of that command;
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
CLI_PAGE = REPO / "docs" / "cli.md"
BENCHMARKS_PAGE = REPO / "docs" / "benchmarks.md"
# The README and the pages it sends readers to: links, anchors and flags named alone are checked here.
PAGES = [README, *sorted((REPO / "docs").glob("*.md"))]
# Docs whose `shoal ...` command lines must parse (docker/README.md too: its commands are copied).
DOCS = [*PAGES, *sorted((REPO / "examples").glob("*.md")), REPO / "docker" / "README.md"]
FIX_REFERENCE = "run .venv/bin/python scripts/cli_reference.py --write"
# The README's level-2 sections, in this order (the rest lives in docs/).
README_SECTIONS = ["Quick start", "Train across machines", "Watch a run", "Configuration", "How it works",
                   "Library API", "Where to read more"]
README_MAX_LINES = 350  # a few screens; move detail into a docs/ page and link it


def page_id(path: Path) -> str:
    return str(path.relative_to(REPO))


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


def section(text: str, title: str, level: int = 2) -> str:
    """The body of the ``## title`` section (``level`` #s), up to the next heading of that level or above."""
    marks = "#" * level
    match = re.search(rf"^{marks} {re.escape(title)}\s*$(.*?)(?=^#{{1,{level}}} |\Z)", text, flags=re.M | re.S)
    assert match, f"no '{marks} {title}' section"
    return match.group(1)


def without_code_blocks(text: str) -> str:
    return re.sub(r"^```.*?^```", "", text, flags=re.M | re.S)


def headings(text: str) -> list[tuple[int, str]]:
    """(level, title) of every markdown heading outside code blocks."""
    return [(len(m.group(1)), m.group(2))
            for m in re.finditer(r"^(#{1,6}) +(.+?)\s*$", without_code_blocks(text), flags=re.M)]


# -- the README's shape ---------------------------------------------------------------------------
def test_the_readme_has_its_sections_in_order():
    text = README.read_text(encoding="utf-8")
    assert [title for level, title in headings(text) if level == 2] == README_SECTIONS
    lines = text.count("\n")
    assert lines <= README_MAX_LINES, (f"README.md has {lines} lines (at most {README_MAX_LINES}): move detail "
                                       "into a docs/ page and link it from the README")


def test_the_readme_links_every_docs_page():
    """Every docs/ page is one link away from the README, so nothing moved there is lost."""
    linked = {(README.parent / target.partition("#")[0]).resolve()
              for target in LINK.findall(without_code_blocks(README.read_text(encoding="utf-8")))}
    unlinked = [page_id(page) for page in PAGES[1:] if page.resolve() not in linked]
    assert PAGES[1:], "no docs/*.md pages found"
    assert not unlinked, f"README.md does not link: {', '.join(unlinked)}"


# -- (a) the generated CLI reference ---------------------------------------------------------------
def test_cli_reference_block_is_generated_from_the_app():
    reference = cli_reference()
    assert reference.TARGET == CLI_PAGE, "scripts/cli_reference.py --write must write the page checked here"
    block = reference.block_of(CLI_PAGE.read_text(encoding="utf-8"))
    assert block == reference.reference(), f"docs/cli.md's CLI reference is stale: {FIX_REFERENCE}"


def test_the_cli_reference_block_lives_in_one_place():
    reference = cli_reference()
    elsewhere = [page_id(doc) for doc in DOCS if doc != CLI_PAGE and reference.START in doc.read_text(encoding="utf-8")]
    assert not elsewhere, f"only docs/cli.md holds the generated CLI reference, not: {', '.join(elsewhere)}"


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
    assert reference.block_of(new) == "new\n"
    with pytest.raises(ValueError, match="exactly one"):
        reference.block_of("no markers here")


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


@pytest.mark.parametrize("doc", DOCS, ids=page_id)
def test_every_documented_flag_exists(doc):
    commands = command_flags()
    found = mentioned_flags(doc.read_text(encoding="utf-8"))
    stale = [f"{line!r}: {'no command shoal ' + command if command not in commands else f'shoal {command} has no {flag}'}"
             for command, flag, line in found if flag not in commands.get(command, ())]
    assert not stale, f"{doc.relative_to(REPO)} mentions flags the CLI does not have:\n" + "\n".join(stale)
    if doc == README:  # the scanner saw the README's commands at all
        assert {command for command, _, _ in found} >= set(commands)


@pytest.mark.parametrize("page", PAGES, ids=page_id)
def test_flags_named_alone_exist(page):
    """A code span that starts with a flag (`--use-relay`, `--sync-mode blocking`) names a shoal flag."""
    known = frozenset().union(*command_flags().values())
    spans = re.findall(r"`(--[a-zA-Z][^`]*)`", without_code_blocks(page.read_text(encoding="utf-8")))
    if page == README:
        assert len(spans) > 10, "the span pattern found (almost) no flags"
    unknown = sorted({flag for span in spans for flag in FLAG.findall(span) if flag.startswith("--")} - known)
    assert not unknown, f"{page_id(page)} names flags no shoal command has: {unknown}"


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


@cache
def anchors_of(page: Path) -> frozenset[str]:
    return frozenset(github_anchor(title) for _, title in headings(page.read_text(encoding="utf-8")))


def test_github_anchor_matches_githubs_ids():
    assert github_anchor("3. Can others reach you? (NAT, firewalls, ports)") == "3-can-others-reach-you-nat-firewalls-ports"
    assert github_anchor("`averaging/`, by role") == "averaging-by-role"
    assert github_anchor("Weighting by tokens; missed rounds fold") == "weighting-by-tokens-missed-rounds-fold"


@pytest.mark.parametrize("page", PAGES, ids=page_id)
def test_relative_links_and_images_exist(page):
    """Links are relative to the page's folder; ``page.md#anchor`` needs that heading in that page."""
    prose = without_code_blocks(page.read_text(encoding="utf-8"))
    targets = LINK.findall(prose) + HTML_LINK.findall(prose)
    if page == README:
        assert targets, "the link pattern found no links at all"
    missing = []
    for target in targets:
        if re.match(r"^[a-z][a-z0-9+.-]*:", target, flags=re.I):  # http:, https:, mailto:
            continue
        path, _, fragment = target.partition("#")
        linked = (page.parent / path) if path else page
        if not linked.exists():
            missing.append(target)
        elif fragment and linked.suffix == ".md" and fragment not in anchors_of(linked.resolve()):
            missing.append(f"{target} (no heading with that anchor)")
    assert not missing, f"{page_id(page)} links to nothing at: " + ", ".join(missing)


def test_the_picture_is_the_benchmark_plot():
    assert re.search(r"!\[[^\]]+\]\(benchmarks/results/sync_modes\.png\)", README.read_text(encoding="utf-8"))


# -- benchmark tables are the measured ones -----------------------------------------------------------
def benchmark_rows(page: Path) -> list[str]:
    """Table rows of docs/benchmarks.md (all of it), or of the README's short "### Benchmarks" summary."""
    text = page.read_text(encoding="utf-8")
    if page == README:
        text = section(section(text, "Where to read more"), "Benchmarks", level=3)
    return [line for line in without_code_blocks(text).splitlines() if line.startswith("|")]


@pytest.mark.parametrize("page", [README, BENCHMARKS_PAGE], ids=page_id)
def test_benchmark_tables_are_copied_verbatim_from_the_results(page):
    rows = benchmark_rows(page)
    results = {line for path in (REPO / "benchmarks" / "results").glob("*.md")
               for line in path.read_text(encoding="utf-8").splitlines()}
    assert rows, f"{page_id(page)} has no benchmark table"
    changed = [row for row in rows if row not in results]
    assert not changed, (f"benchmark rows in {page_id(page)} differ from benchmarks/results/*.md (copy the tables "
                         "from there, do not retype them):\n" + "\n".join(changed))
