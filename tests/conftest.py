"""Shared pytest configuration.

- Tests marked `gpu` need CUDA and NCCL and skip cleanly without them (every CPU-only machine,
  CI included).
- Under `pytest -n auto` several workers launch ranks at once: each worker tells the tool how
  many jobs share the machine (DDP_VERIFY_JOBS), so every rank's thread budget is its share of
  the cores among all of them (`verify/launching/threads.py`), not of one worker's ranks.
"""

import os

import pytest
import torch

from verify.launching.threads import JOBS_ENV

if "PYTEST_XDIST_WORKER_COUNT" in os.environ:
    os.environ.setdefault(JOBS_ENV, os.environ["PYTEST_XDIST_WORKER_COUNT"])


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available() and torch.distributed.is_nccl_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device and NCCL")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
