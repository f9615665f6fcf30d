"""The checks on GPUs (issue 9): every check command on `--backend nccl`, at world size 1 on
one GPU and at 2 where there are two. Skipped without CUDA and NCCL (gpu-marked).

Every collective the tool itself issues (the audit's all-gathers, the reference's and the
shard check's object exchanges, the checkpoint round trip's broadcast, the usage maps) must
use the rank's device: a CPU tensor on an NCCL group fails ("No backend type associated with
device type cpu").
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from verify.checks.consistency import ConsistencyOptions, check_consistency
from verify.checks.detection import run_detection
from verify.checks.equivalence import EquivalenceOptions, check_equivalence
from verify.checks.hang import HangOptions, check_hang
from verify.checks.matrix import MatrixOptions, run_matrix

ROOT = Path(__file__).resolve().parents[1]
WORLDS = [1, 2]


def _world(n: int) -> int:
    if torch.cuda.device_count() < n:
        pytest.skip(f"needs {n} GPUs")
    return n


@pytest.mark.gpu
@pytest.mark.parametrize("world", WORLDS)
def test_consistency_and_equivalence_on_nccl(world):
    ws = _world(world)
    for impl in ("bucketed", "zero1", "torch-ddp", "torch-zero"):
        c = check_consistency(ConsistencyOptions(impl=impl, world_size=ws, backend="nccl"))
        assert c.passed, c.headline + (c.failure or "")
        e = check_equivalence(
            EquivalenceOptions(impl=impl, world_size=ws, backend="nccl", workload="transformer")
        )
        assert e.passed, e.headline + (e.failure or "")
    s = check_equivalence(
        EquivalenceOptions(impl="overlap", world_size=ws, backend="nccl", sanitize=True)
    )
    assert s.passed, s.headline + (s.failure or "")


@pytest.mark.gpu
@pytest.mark.parametrize("world", WORLDS)
def test_matrix_and_faults_on_nccl(world):
    ws = _world(world)
    rows = ("world-1", "world-2", "round-trip", "no-sync")
    result = run_matrix(MatrixOptions(impls=("zero1", "torch-zero"), rows=rows, backend="nccl"))
    assert result.passed, [c for c, r in result.results.items() if r.failed]
    if ws >= 2:
        faults = run_detection(("faulty:no-divide",), backend="nccl")
        assert faults.passed


@pytest.mark.gpu
@pytest.mark.parametrize("world", WORLDS)
def test_hang_on_nccl(world, tmp_path):
    ws = _world(world)
    result = check_hang(
        HangOptions(impl="bucketed", world_size=ws, backend="nccl", out=str(tmp_path))
    )
    assert result.verdict == "pass", result.diagnosis.text()
