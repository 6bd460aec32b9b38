"""Test-session settings shared by every test module.

Under pytest-xdist each worker process gets an equal share of the cores for torch (and for the scans the
tests start as subprocesses, through ``OMP_NUM_THREADS``): two workers with torch's default of one thread
per core each oversubscribe a 2-core machine, and the small models of the tests then run 2–3× slower
(measured on tests/test_negative_fixture.py, test_consistency.py and test_refine.py with ``-n 2``: 333 s
with the default threads, 138 s with one thread per worker).
"""
from __future__ import annotations

import os

import torch

_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0") or 0)
if _WORKERS > 1:
    _THREADS = max(1, (os.cpu_count() or 1) // _WORKERS)
    os.environ["OMP_NUM_THREADS"] = os.environ["MKL_NUM_THREADS"] = str(_THREADS)
    torch.set_num_threads(_THREADS)
