"""A user's sharded class plugs in by `full_parameters()` / `full_gradients()`, and its bugs
are caught by the check that should catch them (tests/fixtures/student_fsdp.py).

One launch of 3 ranks (the MLP's 32 rows do not split evenly: the last shard is padded) runs
the equivalence check on a student's fully sharded wrapper written in the style of a course
solution, right and with three bugs, and the consistency check on the right one:

- right: matches one process, and its per-rank optimizer state is played per-rank;
- a reduce-scatter without the division: the gradients at step 1 are N times too large;
- parameters gathered once and kept: the shards the optimizer updates never come back, so
  the gradients of step 2 are computed on stale weights;
- `full_gradients()` returning the rank's shard: a shape the reference does not have.
"""

from __future__ import annotations

from pathlib import Path

from verify.checks.consistency import run_consistency_on_rank
from verify.checks.equivalence import EquivalenceOptions, run_equivalence_on_rank
from verify.launching import launch

FIXTURE = str(Path(__file__).resolve().parent / "fixtures/student_fsdp.py")
CLASSES = ("StudentFSDP", "ReduceScatterWithoutDividing", "GathersOnce", "ForgetsFullGradients")


def rank_cells(ctx) -> dict:
    out = {}
    for cls in CLASSES:
        spec = EquivalenceOptions(impl=f"{FIXTURE}:{cls}", world_size=3, steps=2).train_spec()
        out[cls] = run_equivalence_on_rank(ctx, spec)
    spec = EquivalenceOptions(impl=f"{FIXTURE}:StudentFSDP", world_size=3, steps=2).train_spec()
    out["consistency"] = run_consistency_on_rank(ctx, spec)
    return out


def test_a_students_sharded_class_is_judged_on_full_tensors():
    run = launch(rank_cells, world_size=3, timeout_s=240)
    assert run.ok, run.summary()
    got = run.values[0]
    right = got["StudentFSDP"]
    assert right.passed, right.describe()
    assert not got["consistency"].findings, got["consistency"].findings
    first = {cls: got[cls].first_divergence for cls in CLASSES[1:]}
    assert first["ReduceScatterWithoutDividing"].kind == "gradients"
    assert first["ReduceScatterWithoutDividing"].step == 1
    assert (first["GathersOnce"].kind, first["GathersOnce"].step) == ("gradients", 2)
    assert "vs reference" in first["ForgetsFullGradients"].detail
