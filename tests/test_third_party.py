"""No false alarms on real code: designs written outside this project
(`tests/fixtures/third_party/`, in the styles of public course solutions and picotron) get the
verdict their code earns, and every bug they have is reported, not only the first.

Before the fixes these were wrong: the shard check failed every sharded optimizer that keeps
its inner optimizer under another name (the tool's own probe raised); a design that seeds
every rank alike stopped every check at construction and hid the bug behind it; a per-rank
checkpoint failed with a size mismatch; a float64 gradient averaged in float32 passed; a
bucket size of 1e-9 MB was refused as a 0-byte bucket; a class needing a framework's set-up
was a FAULT (exit 1) instead of a usage error; a crashed cell did not say where.

The cells share launches (one matrix run per seeding), so this costs a few launches.
"""

from __future__ import annotations

from pathlib import Path

from verify.checks.equivalence import EquivalenceOptions, check_equivalence
from verify.checks.matrix import MatrixOptions, run_matrix

ROOT = Path(__file__).resolve().parents[1]
CS336 = "tests.fixtures.third_party.cs336_style"
PICOTRON = "tests.fixtures.third_party.picotron_style"
MORE = "tests.fixtures.third_party.more_styles"


def _status(result, impl: str) -> dict[tuple[str, str], str]:
    return {(k, c): r.status for (i, k, c), r in result.results.items() if i == impl}


def test_designs_from_outside_get_the_verdict_their_code_earns():
    dot, local, inopt = (f"{CS336}:{n}" for n in ("ShardedOptimizerDotOptimizer",
                         "ShardedOptimizerLocalName", "ShardedOptimizerInopt"))  # fmt: skip
    bucketed, f32 = f"{CS336}:DDPBucketed", f"{CS336}:DDPBucketedFloat32Buffer"
    cap, raises = f"{MORE}:BucketCapDDP", f"{MORE}:RaisesInFinish"
    rows = ("world-2", "mixed", "scheduler", "round-trip", "bucket-per-param")
    result = run_matrix(
        MatrixOptions(impls=(dot, local, inopt, bucketed, f32, cap, raises), rows=rows)
    )
    # Optimizer state under .optimizer / ._local_optimizer / .inopt: measured, not guessed.
    for impl in (dot, local, inopt):
        assert result.result(impl, "world-2", "shard").status == "pass", result.result(
            impl, "world-2", "shard"
        ).detail
    # A per-rank checkpoint (each rank's state_dict is its own shard) resumes exactly.
    assert _status(result, local)[("round-trip", "equivalence")] == "pass"
    # The scheduler's lr never reaching the shard is still found, by equivalence.
    assert _status(result, inopt)[("scheduler", "equivalence")] == "fail"
    assert _status(result, inopt)[("world-2", "equivalence")] == "pass"
    # A float64 gradient averaged in a float32 buffer: caught on the float64 layer alone.
    mixed = result.result(f32, "mixed", "equivalence")
    assert mixed.status == "fail" and "fc3" in mixed.detail, mixed.detail
    assert result.result(bucketed, "mixed", "equivalence").status == "pass"
    assert result.result(f32, "world-2", "equivalence").status == "pass"  # float32 only: right
    # bucket_cap_mb is a bucket size; the smallest parameter's size is accepted (not 1e-9 MB).
    assert _status(result, cap)[("bucket-per-param", "equivalence")] == "pass"
    assert _status(result, bucketed)[("bucket-per-param", "equivalence")] == "pass"
    # A crashed cell says where the exception was raised, in the user's code.
    crashed = result.result(raises, "world-2", "consistency")
    assert crashed.status == "fail" and "KeyError" in crashed.headline
    assert "more_styles.py:" in crashed.headline and "finish_gradient_synchronization" in (
        crashed.headline
    ), crashed.headline
    assert "the first step" not in crashed.detail  # no state_dict round trip in this row
    failed = {c for c, r in result.results.items() if r.failed}
    # The round trip runs under the scheduler, as a resume does: the course's in-optimizer
    # design, which the scheduler never reaches, fails it too (tests/test_matrix.py).
    expected = {(inopt, row, "equivalence") for row in ("scheduler", "round-trip")}
    expected |= {(f32, "mixed", "equivalence")}
    expected |= {(raises, k, c) for (i, k, c) in result.results if i == raises}
    expected = {c for c in expected if result.results[c].status not in ("n/a", "not claimed")}
    assert failed == expected, sorted(failed ^ expected)


def test_identical_seeding_instead_of_a_broadcast():
    """Without --same-init a design that never broadcasts is a finding with the hint, and the
    check goes on (resynchronized from rank 0), so the bug behind it still shows; with
    --same-init the correct one passes and the buggy one is caught (picotron issue #39)."""
    naive, reduces = f"{PICOTRON}:DataParallelNaive", f"{PICOTRON}:DataParallelNaiveReducesParam"
    plain = run_matrix(MatrixOptions(impls=(naive, reduces), rows=("world-2",)))
    same = run_matrix(MatrixOptions(impls=(naive, reduces), rows=("world-2",), same_init=True))
    for check in ("consistency", "equivalence"):
        naive_plain = plain.result(naive, "world-2", check)
        assert naive_plain.status == "fail" and "not broadcast from rank 0" in naive_plain.detail
        assert "--same-init" in naive_plain.detail
        assert naive_plain.detail.count("\n") == 0  # nothing else wrong with it
        assert same.result(naive, "world-2", check).status == "pass"
        hidden = plain.result(reduces, "world-2", check)
        assert hidden.status == "fail" and "not broadcast" in hidden.detail
        assert hidden.detail.count("\n") >= 1, hidden.detail  # the bug behind it, reported too
        assert same.result(reduces, "world-2", check).status == "fail"


def test_one_finding_does_not_hide_the_next():
    """A sharded optimizer whose state_dict() raises and whose scheduler never reaches the
    shard: the checkpoint finding, then the scheduler's divergence after it."""
    options = EquivalenceOptions(impl=f"{MORE}:TwoBugsShardedOptimizer", steps=4)
    result = check_equivalence(options)
    phases = [f.phase for f in result.findings]
    assert result.verdict == "fault" and "checkpoint" in phases, result.findings
    checkpoint = next(f for f in result.findings if f.phase == "checkpoint")
    assert "state_dict() raised NotImplementedError" in checkpoint.message
    diverged = [f for f in result.findings if f.phase == "step"]
    assert diverged and max(diverged[0].steps) > checkpoint.step, [
        f.describe() for f in result.findings
    ]


def test_a_class_needing_a_frameworks_setup_is_a_usage_error(run_cli):
    proc = run_cli("consistency", "--impl", f"{MORE}:NeedsGlobalSetup")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert "constructing the wrapper raised AttributeError" in proc.stderr
    assert "more_styles.py:" in proc.stderr and "Cls(module)" in proc.stderr
