import os
import shutil
import tempfile

import pytest

# Test swarms share two cores: one torch thread per process.
os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config):
    """A base temp dir of this session's own (removed at its end): under ``tmp_path_retention_policy
    = "none"`` pytest locks none of its numbered dirs, so another pytest session of the same user
    ending meanwhile (another checkout's suite on a shared machine) removed ours mid-run, and every
    test using ``tmp_path`` after that errored."""
    if config.option.basetemp is None:
        config.option.basetemp = config._shoal_basetemp = tempfile.mkdtemp(prefix="pytest-shoal-")


def pytest_unconfigure(config):
    if getattr(config, "_shoal_basetemp", None):
        shutil.rmtree(config._shoal_basetemp, ignore_errors=True)


@pytest.fixture(scope="session", autouse=True)
def corpus_cache():
    """One token cache for the whole session (built once), removed afterwards."""
    path = tempfile.mkdtemp(prefix="shoal-cache-")
    previous = os.environ.get("SHOAL_CACHE_DIR")
    os.environ["SHOAL_CACHE_DIR"] = path
    yield path
    if previous is None:
        os.environ.pop("SHOAL_CACHE_DIR", None)
    else:
        os.environ["SHOAL_CACHE_DIR"] = previous
    shutil.rmtree(path, ignore_errors=True)
