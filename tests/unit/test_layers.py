"""The import graph follows the arrows: commands → process → {training, observe} → library →
averaging → protocols. Every import counts, lazy ones inside functions and TYPE_CHECKING ones too:
an arrow pointing up is how a "small" shortcut turns layers back into one flat room."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

# (package prefix, layer, rank): a module may import its own layer and any lower rank; layers of
# equal rank (training, observe) do not import each other.
LAYERS = (
    ("node.commands", "commands", 5), ("node.cli", "commands", 5),
    ("node.process", "process", 4),
    ("node.training", "training", 3), ("node.observe", "observe", 3),
    ("node.library", "library", 2), ("node.api", "library", 2),
    ("averaging", "averaging", 1),
    ("protocols", "protocols", 0),
)


def layer_of(module: str) -> tuple[str, int] | None:
    for prefix, layer, rank in LAYERS:
        if module == prefix or module.startswith(prefix + "."):
            return layer, rank
    return None


def imported_modules(source: str, module: str) -> list[tuple[int, str]]:
    """(line, module) for every import in ``source``, relative ones resolved against ``module``."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = module.split(".")[: -node.level]
                base = ".".join([*parent, base] if base else parent)
            found.append((node.lineno, base))
            # `from node import api` imports node.api
            found += [(node.lineno, f"{base}.{alias.name}") for alias in node.names if layer_of(f"{base}.{alias.name}")]
    return found


def violations(source: str, module: str) -> list[str]:
    own = layer_of(module)
    assert own is not None, f"{module} belongs to no layer: add it to LAYERS"
    problems = []
    for line, target in imported_modules(source, module):
        theirs = layer_of(target)
        if theirs is None or theirs[0] == own[0]:
            continue
        if theirs[1] >= own[1]:
            problems.append(f"{module}:{line} ({own[0]}) imports {target} ({theirs[0]})")
    return problems


def package_modules() -> list[tuple[str, Path]]:
    modules = []
    for package in ("node", "averaging", "protocols"):
        for path in sorted((REPO / package).rglob("*.py")):
            parts = path.relative_to(REPO).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            if name != "node":  # the package's own docstring module
                modules.append((name, path))
    return modules


def test_every_import_follows_the_arrows():
    problems = [p for name, path in package_modules() for p in violations(path.read_text(), name)]
    assert not problems, "imports against the layer arrows:\n" + "\n".join(problems)


@pytest.mark.parametrize("module, source", [
    ("node.library.swarm", "from node.process.config import RunConfig"),  # library → process
    ("node.library.monitor", "def f():\n    from node.observe.ui import CONSOLE"),  # lazy, still counted
    ("node.training.trainer", "from node.observe import metrics"),  # sibling layers
    ("averaging.engine.worker", "import node.api"),
    ("protocols.keys", "from averaging.math.flat import FlatLayout"),
    ("node.observe.ui", "from ..process import peer"),  # relative
])
def test_an_import_against_the_arrows_is_caught(module, source):
    assert violations(source, module)


def test_imports_along_the_arrows_pass():
    assert not violations("from node.api import DiLoCoSwarm\nfrom node.training.model import GPT", "node.process.peer")
    assert not violations("from protocols.errors import ConfigError", "averaging.state.shared_state")
