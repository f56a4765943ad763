"""Imports a peer's start pays for and never uses, deferred until something uses them.

hivemind's averager module imports ``scipy.optimize`` at load (``hivemind.averaging.load_balancing``)
for one call: ``optimize_parts_lp``, the linear program that sizes each peer's part of the vector by
its declared bandwidth. shoal never declares a bandwidth and drops any a group declares
(``averaging.network.hivemind.allreduce.vet_group``), so ``load_balance_peers`` takes its equal-parts
branch and scipy.optimize is never called. Importing it is most of hivemind's import time
(docs/hivemind.md), paid by every ``shoal`` command and every peer of a many-peer start.

``importlib.util.LazyLoader`` does not survive here: torch's import walks ``sys.modules`` through
``inspect.getmodule``, which reads every module's ``__file__`` and so loads a lazy module at once.
So ``import scipy.optimize`` gets a stand-in module that has no attributes of its own: the first
attribute anyone reads (``linprog``, or a ``from scipy.optimize import ...``), and any import of a
submodule, imports the real package in its place and answers from it. Dunder reads (``__file__``)
find nothing and load nothing (the stand-in holds only its spec, ``__path__`` and loader).
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import threading
import types

DEFERRED = ("scipy.optimize",)
_lock = threading.RLock()


class _Deferred(types.ModuleType):
    """Stands in for a deferred module until an attribute is read; then holds the real one's names."""

    def __getattr__(self, name: str):
        if name.startswith("__"):  # module scans (inspect.getmodule) read these: not a use
            raise AttributeError(name)
        real = _load_real(self.__name__)
        self.__dict__.update(real.__dict__)
        return getattr(real, name)


def _load_real(name: str) -> types.ModuleType:
    """Import the real ``name`` in the stand-in's place (once; later callers get it from sys.modules)."""
    with _lock:
        current = sys.modules.get(name)
        if current is not None and not isinstance(current, _Deferred):
            return current
        _FINDER.released.add(name)
        sys.modules.pop(name, None)
        return importlib.import_module(name)  # sets sys.modules[name] and the parent's attribute


class _Finder(importlib.abc.MetaPathFinder):
    """Answers the first import of a deferred module with a stand-in; a submodule's import loads the
    real package first, then lets the normal finders go on."""

    def __init__(self) -> None:
        self.released: set[str] = set()

    def find_spec(self, fullname, path=None, target=None):
        parent = fullname.rpartition(".")[0]
        if parent in DEFERRED and isinstance(sys.modules.get(parent), _Deferred):
            _load_real(parent)
            return None
        if fullname not in DEFERRED or fullname in self.released:
            return None
        real = importlib.machinery.PathFinder.find_spec(fullname, path)
        if real is None:  # not installed: the normal import fails as it would have
            return None
        spec = importlib.machinery.ModuleSpec(fullname, _StandInLoader(), is_package=real.submodule_search_locations is not None)
        if real.submodule_search_locations is not None:  # a submodule import reaches find_spec above
            spec.submodule_search_locations = list(real.submodule_search_locations)
        return spec


class _StandInLoader(importlib.abc.Loader):
    def create_module(self, spec):
        return _Deferred(spec.name)

    def exec_module(self, module) -> None:
        pass


_FINDER = _Finder()


def defer_unused_imports() -> bool:
    """Stand in for the modules in ``DEFERRED`` not yet imported; returns whether the finder was
    installed now (it is installed once)."""
    with _lock:
        if _FINDER in sys.meta_path:
            return False
        _FINDER.released.update(name for name in DEFERRED if name in sys.modules)
        sys.meta_path.insert(0, _FINDER)
        return True
