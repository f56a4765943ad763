"""The import graph follows the arrows: commands → process → {training, observe} → library →
averaging (engine → network → state → math) → protocols. Every import counts, lazy ones inside
functions and TYPE_CHECKING ones too: an arrow pointing up is how a "small" shortcut turns layers
back into one flat room. Inside averaging/, hivemind is imported only behind the network seam
(averaging/network/hivemind/), and the math imports nothing but the standard library, torch and
protocols."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

# (package prefix, layer, rank): a module may import its own layer and any lower rank; layers of
# equal rank (training, observe) do not import each other.
LAYERS = (
    ("node.commands", "commands", 9), ("node.cli", "commands", 9),
    ("node.process", "process", 8),
    ("node.training", "training", 7), ("node.observe", "observe", 7),
    ("node.library", "library", 6), ("node.api", "library", 6),
    ("averaging.engine", "averaging.engine", 5),
    ("averaging.network", "averaging.network", 4),
    ("averaging.state", "averaging.state", 3),
    ("averaging.math", "averaging.math", 2),
    ("averaging", "averaging", 5),  # the package itself: its docstring (the map) only
    ("protocols", "protocols", 0),
)
HIVEMIND_SEAM = "averaging.network.hivemind"
# What the pure math may import besides protocols and itself.
MATH_MAY_IMPORT = frozenset(sys.stdlib_module_names) | {"torch"}



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


def _within(module: str, prefix: str) -> bool:
    return module == prefix or module.startswith(prefix + ".")


def violations(source: str, module: str) -> list[str]:
    own = layer_of(module)
    assert own is not None, f"{module} belongs to no layer: add it to LAYERS"
    problems = []
    for line, target in imported_modules(source, module):
        if _within(module, "averaging") and _within(target, "hivemind") and not _within(module, HIVEMIND_SEAM):
            problems.append(f"{module}:{line} imports {target}: hivemind belongs behind {HIVEMIND_SEAM}")
            continue
        if own[0] == "averaging.math" and layer_of(target) is None and target.split(".")[0] not in MATH_MAY_IMPORT:
            problems.append(f"{module}:{line} imports {target}: the math imports only torch and protocols")
            continue
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
    ("averaging.state.shared_state", "from averaging.engine.loop import RoundEngine"),  # state → engine
    ("averaging.math.merge", "from averaging.state.shared_state import SharedState"),  # math → state
    ("averaging.state.verdict", "from averaging.network.interface import AverageOutcome"),  # state → network
    ("averaging.network.local", "def f():\n    from averaging.engine.worker import SyncWorker"),  # network → engine
    ("averaging.state.verdict", "import hivemind"),  # hivemind outside the seam
    ("averaging.engine.round", "from hivemind.p2p import PeerID"),
    ("averaging.network.slices", "from hivemind.utils import get_dht_time"),  # the seam is network/hivemind only
    ("averaging.math.codecs", "import numpy as np"),  # the math: torch and protocols only
    ("protocols.keys", "from averaging.math.flat import FlatLayout"),
    ("node.observe.ui", "from ..process import peer"),  # relative
])
def test_an_import_against_the_arrows_is_caught(module, source):
    assert violations(source, module)


def test_imports_along_the_arrows_pass():
    assert not violations("from node.api import DiLoCoSwarm\nfrom node.training.model import GPT", "node.process.peer")
    assert not violations("from protocols.errors import ConfigError", "averaging.state.shared_state")
    assert not violations("from averaging.state.served import AppliedUpdate", "averaging.network.interface")
    assert not violations("from averaging.math.flat import FlatLayout", "averaging.engine.loop")
    assert not violations("from hivemind import DHT", "averaging.network.hivemind.backend")
    assert not violations("import math\nimport torch\nfrom protocols.messages import MessageError", "averaging.math.codecs")
