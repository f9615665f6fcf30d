"""The CUDA/NCCL paths: every implementation on GPUs, one per rank. Skipped without CUDA.

On CPU machines this file still checks the guard: asking for NCCL without enough GPUs is a
one-line usage error (exit 2), never an attempt to use CUDA.
"""

import pytest
import torch

from impls.registry import names
from verify.checks.consistency import ConsistencyOptions, check_consistency
from verify.cli import main


@pytest.mark.gpu
@pytest.mark.parametrize("impl", names({"builtin", "reference"}))
@pytest.mark.parametrize("workload", ["unused", "mixed", "transformer"])
def test_every_impl_is_consistent_on_nccl(impl, workload):
    world = min(2, torch.cuda.device_count())
    if impl == "torch-zero" and workload == "mixed":
        pytest.skip("ZeroRedundancyOptimizer rejects models with several dtypes")
    options = ConsistencyOptions(impl=impl, workload=workload, world_size=world, backend="nccl")
    result = check_consistency(options)
    assert result.passed, result.verdict


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only guard")
def test_nccl_without_gpus_is_a_usage_error(capsys):
    assert main(["consistency", "--impl", "bucketed", "--backend", "nccl"]) == 2
    err = capsys.readouterr().err
    assert "backend nccl needs one GPU per rank" in err and err.count("\n") == 1
