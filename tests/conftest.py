import os
import shutil
import tempfile

import pytest

# Test swarms share two cores: one torch thread per process.
os.environ.setdefault("OMP_NUM_THREADS", "1")


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
