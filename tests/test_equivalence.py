"""The equivalence check, on real gloo ranks: right implementations pass, wrong ones fail at
the step, tensor and phase where they go wrong.

Each world size is one launch whose ranks run every cell through `run_equivalence_on_rank`,
the function the certification matrix calls (spawning per cell would cost ~2 s a cell); the
tests of that world size share its reports, across xdist workers too (the `reports` fixture).

Why the tolerances (`verify/checks/tolerances.py`) pass right implementations: the reference
computes each rank's shard as that rank does, so the only difference left is the rounding of
the all-reduce's average, bounded per element in the gradient's own dtype: eps x (n S + |a|),
S the mean of the shards' magnitudes, a the average. Parameters: the reference is re-anchored
to the replica after every step; AdamW's update moves by at most ~tau / |g| for a gradient
error tau, and by two lr-sized steps only where the gradient is below its own rounding.

Why they still fail wrong ones: a forgotten or hard-coded division, or a dropped rank, is off
by 30-200% of the scale, ~1e6 times the float32 tolerance; a state dict that lost other
ranks' moments changes AdamW's next update by ~lr, far above the parameters' tolerance.
"""

from __future__ import annotations

import functools
import json
import pickle
import re
from pathlib import Path

import pytest
from filelock import FileLock

from impls.registry import REGISTRY
from verify.checks.equivalence import EquivalenceOptions, EquivalenceReport, run_equivalence_on_rank
from verify.launching import launch
from verify.training.workloads import HARD_CASES

ROOT = Path(__file__).resolve().parent.parent
BROKEN = str(ROOT / "tests/fixtures/equivalence_broken.py")
CORRECT = tuple(n for n, impl in REGISTRY.items() if impl.kind in ("builtin", "reference"))
SMALL_BUCKET_MB = 0.001  # several multi-parameter buckets even in the small models


def cell_options(world_size: int) -> dict[str, EquivalenceOptions]:
    """Every cell one launch of `world_size` ranks runs, by name."""
    cells = {}
    for wl in HARD_CASES:
        for impl in CORRECT:
            if impl == "torch-zero" and wl == "mixed":
                continue  # ZeroRedundancyOptimizer rejects models with several dtypes
            if impl in ("torch-fsdp", "zero3") and wl in ("unused", "buffers"):
                # Parameter sharding needs every unit's forward on every rank (refused at
                # construction), and the buffers workload reads fc1.weight outside fc1's
                # forward, where only the shard is there (FSDP2: DTensor mixed with Tensor)
                continue
            cells[f"{impl}/{wl}"] = EquivalenceOptions(
                impl=impl, workload=wl, world_size=world_size, steps=2, bucket_mb=SMALL_BUCKET_MB
            )
    for broken in ("SumsWithoutDividing", "DividesByTwo", "DropsLastRank"):
        cells[broken] = EquivalenceOptions(
            impl=f"{BROKEN}:{broken}", workload="mlp", world_size=world_size, steps=2
        )
    # A sharded optimizer whose state_dict() keeps only the local shard: the round trip
    # after step 2 must show it at step 3.
    cells["LocalStateDict"] = EquivalenceOptions(
        impl=f"{BROKEN}:LocalStateDict", workload="mlp", world_size=world_size, steps=4
    )
    # The matrix's knobs: no_sync() accumulation, set_to_none=False, SGD.
    for impl in ("bucketed", "zero1", "torch-ddp"):
        cells[f"{impl}/accumulate"] = EquivalenceOptions(
            impl=impl, workload="unused", world_size=world_size, accumulate=2, set_to_none=False
        )
    cells["overlap/sgd"] = EquivalenceOptions(
        impl="overlap", workload="tied", world_size=world_size, optimizer="sgd"
    )
    cells["no no_sync()"] = EquivalenceOptions(
        impl=f"{BROKEN}:AllReduceAfterBackward", workload="mlp", world_size=world_size, accumulate=2
    )
    return cells


def rank_cells(ctx) -> dict[str, EquivalenceReport]:
    return {
        name: run_equivalence_on_rank(ctx, options.train_spec())
        for name, options in cell_options(ctx.world_size).items()
    }


@pytest.fixture(scope="session")
def reports(tmp_path_factory, worker_id):
    """`reports(world_size)`: every cell's report, from one launch per world size that all
    xdist workers share (the first to ask runs it, the others wait for its file)."""
    shared = None if worker_id == "master" else tmp_path_factory.getbasetemp().parent

    def run(world_size: int) -> dict[str, EquivalenceReport]:
        result = launch(rank_cells, world_size=world_size, timeout_s=240)
        assert result.ok, result.summary()
        return result.values[0]

    @functools.cache
    def get(world_size: int) -> dict[str, EquivalenceReport]:
        if shared is None:
            return run(world_size)
        path = shared / f"equivalence-cells-{world_size}.pickle"
        with FileLock(f"{path}.lock"):
            if not path.exists():
                path.write_bytes(pickle.dumps(run(world_size)))
            return pickle.loads(path.read_bytes())

    return get


WORLD_SIZES = [2, 3]


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_every_correct_implementation_matches_one_process(reports, world_size):
    got = reports(world_size)
    failed = [
        f"{name}: {got[name].describe()}"
        for name in [*cell_options(world_size)]
        if name.split("/")[0] in CORRECT and not got[name].passed
    ]
    assert not failed, "\n".join(failed)
    assert "round trip after step 1" in " ".join(got["zero1/mlp"].notes)


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_a_wrong_average_fails_at_the_first_gradient_check(reports, world_size):
    got = reports(world_size)
    wrong = ["SumsWithoutDividing", "DropsLastRank"]
    if world_size == 2:
        # Dividing by a hard-coded 2 is right on 2 ranks: the check judges the math.
        assert got["DividesByTwo"].passed, got["DividesByTwo"].describe()
    else:
        wrong.append("DividesByTwo")
    for name in wrong:
        report = got[name]
        first = report.first_divergence
        assert not report.passed and first is not None, name
        assert (first.step, first.kind, first.tensor) == (1, "gradients", "fc1.weight"), name
        assert first.max_rel > 0.3 and first.ratio > 1e4, f"{name}: {first.describe()}"
        assert "FAULT: first divergence at step 1 gradients: fc1.weight" in report.describe()


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_a_state_dict_without_the_other_shards_fails_after_the_round_trip(reports, world_size):
    report = reports(world_size)["LocalStateDict"]
    first = report.first_divergence
    assert first is not None, "the round trip lost state and nobody noticed"
    # Saved after step 2 (steps // 2), loaded into a fresh optimizer: step 3 is the first
    # update from the restored state. Gradients stay right: only the update is wrong.
    assert (first.step, first.kind) == (3, "parameters"), first.describe()
    assert all(e.passed for e in report.rows if e.kind == "gradients" and e.step < 3)


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_accumulation_keep_grads_and_sgd_pass_and_a_wrapper_without_no_sync_is_not_claimed(
    reports, world_size
):
    got = reports(world_size)
    for name in ("bucketed/accumulate", "zero1/accumulate", "torch-ddp/accumulate", "overlap/sgd"):
        assert got[name].passed, f"{name}: {got[name].describe()}"
    assert got["no no_sync()"].unsupported == "gradient accumulation: the wrapper has no no_sync()"
    assert not got["no no_sync()"].passed


# --- the CLI -------------------------------------------------------------------------------


def test_cli_pass_prints_the_table_and_exits_0(run_cli):
    proc = run_cli("equivalence", "--impl", "zero1", "--world-size", "1", "--steps", "2")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert re.search(r"^gradients +fc1\.weight ", proc.stdout, re.MULTILINE), proc.stdout
    assert "PASS: gradients and parameters match one process on the one rank" in proc.stdout


def test_cli_fault_exits_1_naming_step_tensor_and_phase_in_json(run_cli):
    # On one rank, dividing by a hard-coded 2 halves every gradient.
    proc = run_cli(
        "equivalence",
        "--impl",
        f"{BROKEN}:DividesByTwo",
        "--world-size",
        "1",
        "--steps",
        "1",
        "--json",
    )
    assert proc.returncode == 1, proc.stdout + proc.stderr
    doc = json.loads(proc.stdout)
    assert doc["check"] == "equivalence" and doc["passed"] is False
    first = doc["report"]["first_divergence"]
    assert (first["step"], first["kind"], first["tensor"]) == (1, "gradients", "fc1.weight")
    assert doc["verdict"] == "fault"
    assert doc["headline"].startswith("FAULT: first divergence at step 1 gradients: fc1.weight")
    (finding,) = doc["findings"]  # one bug: one finding (every tensor halved)
    assert (finding["phase"], finding["step"], finding["tensor"]) == ("gradients", 1, "fc1.weight")
