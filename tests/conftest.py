"""Shared pytest configuration: tests marked `gpu` need CUDA and NCCL and skip cleanly
without them (every CPU-only machine, CI included)."""

import pytest
import torch


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available() and torch.distributed.is_nccl_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device and NCCL")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
