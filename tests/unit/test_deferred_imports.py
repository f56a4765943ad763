"""node.library.deferred_imports: hivemind's scipy.optimize is not loaded at start, yet anyone who
uses it gets the real module. Each case runs in a fresh interpreter (the suite has scipy loaded)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def run(code: str) -> str:
    result = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=REPO, capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    return result.stdout


def test_a_peer_start_does_not_load_scipy_optimize_and_a_caller_that_uses_it_gets_it():
    out = run("""
        import sys
        import node.process.peer, node.commands.common, hivemind  # what `shoal run` imports
        from hivemind.averaging.load_balancing import load_balance_peers
        from node.library.deferred_imports import _Deferred
        loaded = lambda: not isinstance(sys.modules["scipy.optimize"], _Deferred)
        print("start", loaded(), "scipy.optimize._optimize" in sys.modules)
        import inspect; inspect.getmodule(inspect)  # a scan of sys.modules reads __file__: no load
        print("scan", loaded())
        print("equal", load_balance_peers(1000, [None, None, 0]), loaded())  # shoal's case: no bandwidths
        print("lp", sum(load_balance_peers(1000, [1.0, 2.0, None])), loaded())  # the linear program
        import scipy, scipy.optimize
        print("same", scipy.optimize is sys.modules["scipy.optimize"], callable(scipy.optimize.linprog))
    """)
    assert out.splitlines() == ["start False False", "scan False", "equal (500, 500, 0) False", "lp 1000 True",
                                "same True True"]


def test_from_imports_and_submodules_load_the_real_package():
    out = run("""
        import sys
        import node
        import scipy.optimize._linprog as lp  # a submodule first
        print(lp.__name__, type(sys.modules["scipy.optimize"]).__name__)
    """)
    assert out.split() == ["scipy.optimize._linprog", "module"]
    out = run("""
        import node
        from scipy.optimize import minimize
        from scipy import optimize
        print(minimize(lambda x: (x[0] - 3.0) ** 2, [0.0]).x.round(3)[0], optimize.minimize is minimize)
    """)
    assert out.split() == ["3.0", "True"]
