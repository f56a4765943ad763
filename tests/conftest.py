import os

# Test swarms share two cores: one torch thread per process.
os.environ.setdefault("OMP_NUM_THREADS", "1")
