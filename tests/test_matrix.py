"""The certification matrix: a built-in passes every row that applies, a user class without
`no_sync()` is "not claimed" there (not a pass, not a fault), and the CLI's exit codes.

The matrix runs every cell of one world size in one launch (`matrix.py`); the full matrix of
one built-in is 4 launches (world sizes 1-4). zero1 is the built-in certified here: it is a
bucketed wrapper (bucket sizes, `no_sync()`) with a sharded optimizer, so it meets every row.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from torch import nn

from tests.fixtures import overlap_scaled, sharded_styles, zero1_reload
from verify.checks.behaviours import (
    BEHAVIOUR,
    BEHAVIOURS,
    SMALLEST_PARAMETER,
    Behaviour,
    smallest_parameter_mb,
)
from verify.checks.cells import CHECKS, CellResult, not_claimed, shard_verdict
from verify.checks.matrix import CERTIFIED, MatrixOptions, MatrixResult, run_matrix, run_plan
from verify.cli.text_matrix import matrix as format_matrix
from verify.training.plain_state import PlainState
from verify.training.workloads import get_workload

ROOT = Path(__file__).resolve().parent.parent
STUDENT = f"{ROOT}/docs/examples/student_ddp.py:StudentDDP"


def test_the_rows_the_issue_asks_for_are_there():
    keys = [b.key for b in BEHAVIOURS]
    assert len(keys) == len(set(keys))
    assert {1, 2, 3, 4} <= {b.world_size for b in BEHAVIOURS}
    workloads = {b.workload for b in BEHAVIOURS}
    assert {"frozen", "tied", "unused", "buffers", "bf16", "mixed", "bf16-compute"} <= workloads
    assert any(b.accumulate > 1 for b in BEHAVIOURS)
    assert any(not b.set_to_none for b in BEHAVIOURS)
    assert {25.0, SMALLEST_PARAMETER, 0.0045} <= {b.bucket_mb for b in BEHAVIOURS}
    # One knob a row: the rows that test zero_grad and bucket sizes train the plain MLP, so a
    # class without unused-parameter support does not fail them for that reason.
    for key in ("keep-grads", "one-bucket", "bucket-per-param"):
        assert BEHAVIOUR[key].workload == "mlp", key
    # One bucket per parameter, in a size a class that validates it accepts (not 1e-9 MB).
    spec = BEHAVIOUR["bucket-per-param"].spec("bucketed")
    assert spec.bucket_mb == smallest_parameter_mb("mlp") > 1e-5
    sharded = {b.key for b in BEHAVIOURS if b.sharded_only}
    assert sharded == {
        "param-groups",
        "add-param-group",
        "scheduler",
        "round-trip",
        "more-ranks-than-params",
    }
    assert set(CERTIFIED) == {"naive", "flat", "overlap", "bucketed", "zero1", "zero2"} | {
        "zero3",
        "torch-ddp",
        "torch-zero",
        "torch-fsdp",
    }


def test_options_fail_before_any_rank_starts():
    with pytest.raises(ValueError, match="unknown behaviour 'nope'"):
        MatrixOptions(impls=("naive",), rows=("nope",))
    with pytest.raises(ValueError, match="unknown implementation"):
        MatrixOptions(impls=("nope",))
    with pytest.raises(ValueError, match="checks must be among"):
        MatrixOptions(impls=("naive",), checks=("speed",))
    with pytest.raises(ValueError, match="round trip needs steps >= 2"):
        Behaviour(key="x", title="x", round_trip=True, steps=1)


class _Plain(nn.Module):
    def __init__(self, module):
        super().__init__()


class _Bucketed(nn.Module):
    def __init__(self, module, bucket_size_mb=25.0):
        super().__init__()

    def no_sync(self):
        raise NotImplementedError


def test_claims_are_read_from_the_wrapper():
    plain, bucketed = _Plain(nn.Linear(1, 1)), _Bucketed(nn.Linear(1, 1))
    assert not_claimed(plain, BEHAVIOUR["world-2"]) is None
    assert "has no no_sync()" in not_claimed(plain, BEHAVIOUR["no-sync"])
    assert "takes no bucket_size_mb" in not_claimed(plain, BEHAVIOUR["one-bucket"])
    assert not_claimed(bucketed, BEHAVIOUR["no-sync"]) is None
    assert not_claimed(bucketed, BEHAVIOUR["one-bucket"]) is None


def test_a_builtin_passes_every_row():
    """zero1 on every row; the sharded checkpoints of zero3 (row shards, per rank) and FSDP2
    (DTensors) on the model round trip, in the same world-size-2 launch."""
    options = MatrixOptions(impls=("zero1", "zero3", "torch-fsdp"))
    trip = BEHAVIOUR["model-round-trip"]
    plan = [("zero1", b, options.checks) for b in BEHAVIOURS]
    plan += [(name, trip, ("equivalence",)) for name in ("zero3", "torch-fsdp")]
    # FSDP2's state is DTensors: measured by each rank's local shard, never read as nothing
    plan += [("torch-fsdp", BEHAVIOUR[key], ("shard",)) for key in ("world-2", "world-4")]
    result = run_plan(options, plan)
    failed = {k: r.detail for k, r in result.results.items() if r.status != "pass"}
    # Only the shard check at world size 1 does not apply; zero1 claims everything else.
    assert failed == {
        ("zero1", "world-1", "shard"): "one rank: nothing to shard",
    }, failed
    assert result.passed
    assert result.launches == 4  # one per world size: cells share ranks
    for key in ("world-2", "world-4"):
        detail = result.result("torch-fsdp", key, "shard").detail
        per_rank = re.search(r"state bytes per rank \[([\d, ]+)\]", detail).group(1)
        assert all(int(b) > 0 for b in per_rank.split(",")), detail
    # How each checkpoint was played: zero1's model full, the sharded ones per rank.
    played = {
        name: result.result(name, "model-round-trip", "equivalence").detail.splitlines()[-1]
        for name in ("zero1", "zero3", "torch-fsdp")
    }
    assert "the model's as full: MLP.state_dict(): identical on every rank" in played["zero1"]
    assert "the model's as per-rank: MLP.state_dict(): it differs" in played["zero3"]
    assert (
        "the model's as per-rank: FSDPMLP.state_dict(): it holds DTensors" in (played["torch-fsdp"])
    )


def test_a_user_class_without_no_sync_does_not_claim_accumulation():
    """StudentDDP (no no_sync(), no bucket_size_mb) next to a broken implementation, in one
    launch: not claimed is neither a pass nor a fault, and the table names the failed cell."""
    rows = ("world-2", "no-sync", "one-bucket", "scheduler")
    result = run_matrix(MatrixOptions(impls=(STUDENT, "faulty:no-divide"), rows=rows))
    status = {(k, c): r.status for (i, k, c), r in result.results.items() if i == STUDENT}
    assert status == {
        ("world-2", "consistency"): "pass",
        ("world-2", "equivalence"): "pass",
        ("world-2", "shard"): "n/a",
        ("no-sync", "consistency"): "not claimed",
        ("no-sync", "equivalence"): "not claimed",
        ("no-sync", "shard"): "n/a",
        ("one-bucket", "consistency"): "not claimed",
        ("one-bucket", "equivalence"): "not claimed",
        ("one-bucket", "shard"): "n/a",
        ("scheduler", "consistency"): "n/a",
        ("scheduler", "equivalence"): "n/a",
        ("scheduler", "shard"): "n/a",
    }
    assert not any(r.failed for (i, _, _), r in result.results.items() if i == STUDENT)
    assert [c for c, r in result.results.items() if r.failed] == [
        ("faulty:no-divide", "world-2", "equivalence"),
        ("faulty:no-divide", "no-sync", "equivalence"),
    ]
    assert not result.passed and result.launches == 1
    table = format_matrix(result)
    assert "faulty:no-divide / world size 2 / equivalence: FAULT: first divergence" in table
    assert f"{STUDENT}: gradient accumulation: the wrapper has no no_sync()" in table
    assert "FAULT: 4 pass, 2 fail, 6 not claimed, 4 n/a  (" in table
    doc = json.loads(json.dumps(result.to_dict()))  # what --json prints
    assert not doc["passed"] and len(doc["cells"]) == 2 * len(rows) * 3


OVERLAP = Path(overlap_scaled.__file__)
RACY = f"{OVERLAP}:ScaleInHookDDP"
WAITS = f"{OVERLAP}:ScaleAfterWaitDDP"


def race_verdict_problems() -> list[str]:
    """A student's hook DDP that scales each gradient right after launching its all-reduce,
    beside its twin that scales after wait(), on the plain row and the no_sync() row, in one
    launch with the matrix's defaults: every racy cell names the race at the scaling line
    (the no_sync() row too: its first micro-batch issues nothing), every twin's cell passes.
    What is wrong, or nothing; used idle and under load (tests/test_load.py)."""
    rows = ("world-2", "no-sync")
    result = run_matrix(MatrixOptions(impls=(RACY, WAITS), rows=rows))
    line = next(i for i, text in enumerate(OVERLAP.read_text().splitlines(), 1) if "# BUG:" in text)
    race = ("`mul_` wrote fc2.bias.grad at ", f"{OVERLAP.name}:{line} (on_grad_ready) while")
    problems = [] if result.launches == 1 else [f"{result.launches} launches, not 1"]
    for key in rows:
        for check in ("consistency", "equivalence"):
            racy, waits = result.result(RACY, key, check), result.result(WAITS, key, check)
            if not (racy.failed and all(part in racy.detail for part in race)):
                problems.append(f"racy {key} / {check}: {racy.status}: {racy.detail}")
            if waits.status != "pass":
                problems.append(f"waits {key} / {check}: {waits.status}: {waits.detail}")
    return problems


@pytest.mark.under_load
def test_a_race_is_named_by_default_after_a_no_sync_micro_batch_too():
    """The matrix sanitizes by default, and a race under no_sync() is named, not only its
    symptom. (Without the sanitizer the racy class's cells passed or failed by timing: 24, then
    22 failing cells of 34 on the full matrix, with hints pointing elsewhere.)"""
    problems = race_verdict_problems()
    assert not problems, "\n".join(problems)


def test_the_report_says_whether_races_were_checked():
    """The note under the table: what the sanitizer cannot see, or what --no-sanitize gives
    up (no launch: the text of a result)."""
    for sanitize, note in (
        (True, "note: every cell ran under the race sanitizer (--no-sanitize to skip it)"),
        (False, "note: --no-sanitize: races on async collectives were not checked; a racy"),
    ):
        options = MatrixOptions(impls=("naive",), rows=("world-2",), sanitize=sanitize)
        cells = {("naive", "world-2", c): CellResult("pass") for c in CHECKS}
        assert note in format_matrix(MatrixResult(options, cells, 1.0, 1))


def test_the_shard_bound_takes_whole_parameters_and_slices():
    """The issue's numbers, on the MLP's real yardstick (AdamW: 5920 bytes of moments, 24 of
    `step`): slices of every parameter hold [2984, 2984] bytes, the 24-byte excess being one
    `step` per slice; that passes, as the whole-parameter split does, and holding everything
    everywhere or on one rank does not."""
    mlp = get_workload("mlp").build().parameters()
    # AdamW in float32: two moments and a `step` (what unsharded_state measures,
    # tests/test_optim_state.py; written out here to spare an optimizer's first step).
    plain = [PlainState(8 * p.numel() + 4, 4, p.numel()) for p in mlp]
    assert (sum(p.bytes for p in plain), sum(p.scalar_bytes for p in plain)) == (5944, 24)
    cases = {
        "whole parameters": [(4100, 4), (1844, 20)],
        "slices": [(2984, 24), (2984, 24)],
        "slices on 4 ranks": [(1480 + 4 * 8 + 24, 24)] * 4,  # padded: a slice is ceil(n/4)
        "kept everywhere": [(5944, 24), (5944, 24)],
    }
    got = {name: shard_verdict(ranks, plain) for name, ranks in cases.items()}
    assert [r.status for r in got.values()] == ["pass", "pass", "pass", "fail"]
    assert got["kept everywhere"].detail.startswith("state kept on several ranks")
    assert "state bytes per rank [2960, 2960] vs unsharded 5920" in got["slices"].detail
    # Eight equal parameters: a rank holding all of them is unbalanced (a whole-parameter
    # split holds 4 each, slices 4 x 1000 / 2 + one element of padding each).
    eight = [PlainState(8004, 4, 1000)] * 8
    assert shard_verdict([(64032, 32), (0, 0)], eight).headline.startswith("unbalanced")
    assert shard_verdict([(32016, 16), (32016, 16)], eight).status == "pass"


def sharded_problems() -> list[str]:
    """tests/fixtures/sharded_styles.py: ZeRO-1 by slices and by trimmed param_groups, each
    correct and buggy, in one matrix with zero1 (3 launches, one per world size): the correct
    ones pass every cell, the one that keeps everything fails only the shard check, the one
    whose load forgets the moments only the round trip's equivalence, the one whose load
    keeps a second copy only the round trip's shard check, which names the two copies. What
    is wrong (none); the hog window's `sharded` job too (tests/test_load.py)."""
    problems, result = sharded_styles.verdict_problems()
    if problems:
        return problems
    here = f"{sharded_styles.__file__}:"
    slices = result.result(here + "SliceShardedAdamW", "world-2", "shard").detail
    kept = result.result(here + "SliceShardedKeepsEverything", "world-3", "shard").detail
    copied = result.result(here + "TrimsItsGroupsCopiesOnLoad", "round-trip", "shard")
    played = {
        name: result.result(here + name, "round-trip", "equivalence").detail.splitlines()[-1]
        for name in ("SliceShardedAdamW", "TrimsItsGroups", "TrimsItsGroupsLosesState")
    }
    lists = "per-rank: rank 0's state_dict() lists 1 of the 6 parameters passed"
    checks = {
        f"{result.launches} launches, not 3": result.launches == 3,
        f"slices: {slices}": "state bytes per rank [2960, 2960] vs unsharded 5920" in slices,
        f"kept: {kept}": kept.startswith(
            "state kept on several ranks: state bytes per rank [5920, 5920, 5920]"
        ),
        f"copied: {copied.detail}": copied.detail.startswith(
            "state held twice on a rank: every parameter's state is on "
        )
        and ".state[param 0]['exp_avg'] and at .inner.state[param 0]['exp_avg']" in copied.detail,
        f"copied's hint: {copied.findings[0].hint}": "into the wrapper's own .state leaves two"
        in (copied.findings[0].hint or ""),
        f"played: {played}": "per-rank: the ranks' state_dict()s differ and rank 0's holds slices"
        in played["SliceShardedAdamW"]
        and all(lists in played[name] for name in ("TrimsItsGroups", "TrimsItsGroupsLosesState")),
    }
    return [f"sharded: {what}" for what, ok in checks.items() if not ok]


@pytest.mark.under_load
def test_slice_sharded_and_per_rank_checkpoint_classes_beside_a_builtin():
    problems = sharded_problems()
    assert not problems, "\n".join(problems)


def reload_problems() -> list[str]:
    """The round-trip row is a resume: the round trip runs under the LR scheduler. A student's
    ZeRO-1 that shares its param groups with its inner optimizer and loses them on a reload
    (tests/fixtures/zero1_reload.py: the scheduler's next lr never reaches the optimizer that
    steps) fails the row's equivalence, with the hint that names the reload, where it once
    passed every cell; its twin that takes the inner's new groups as its own again, and
    zero1, pass every cell. What is wrong (none); the hog window's `reload` job
    too (tests/test_load.py)."""
    here = f"{zero1_reload.__file__}:"
    buggy, right = here + "SharesItsGroups", here + "SharesItsGroupsAgainOnLoad"
    result = run_matrix(MatrixOptions(impls=(buggy, right, "zero1"), rows=("round-trip",)))
    problems = []
    for (name, row, check), cell in result.results.items():
        expected = "fail" if (name, check) == (buggy, "equivalence") else "pass"
        if cell.status != expected:
            problems.append(
                f"{name} / {row} / {check}: {cell.status}, not {expected}: {cell.detail}"
            )
    hints = [f.hint or "" for f in result.result(buggy, "round-trip", "equivalence").findings]
    if not any("did not reach the inner optimizer after the state_dict() round trip" in h
               for h in hints):  # fmt: skip
        problems.append(f"no hint names the reload: {hints}")
    if result.passed:
        problems.append("the matrix passed")
    return [f"reload: {p}" for p in problems]


@pytest.mark.under_load
def test_a_sharded_optimizer_that_loses_the_scheduled_lr_on_a_reload_fails_the_matrix():
    assert BEHAVIOUR["round-trip"].scheduler and BEHAVIOUR["round-trip"].round_trip
    problems = reload_problems()
    assert not problems, "\n".join(problems)


def test_cli_exit_codes(monkeypatch, capsys):
    """End to end in-process, on one rank (the cheapest launch): exit 0 when the detection
    matrix holds, with one JSON document; 2 on bad input, before any rank starts. (Exit 1 is
    `not result.passed`, asserted above on the result itself.)"""
    from verify.cli import main

    monkeypatch.chdir(ROOT)
    assert main(["faults", "--fault", "faulty:divide-by-two", "--no-controls", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    (fault,) = doc["faults"]
    assert fault["caught"] and fault["checks"]["equivalence"]["status"] == "fail"
    assert fault["checks"]["consistency"]["status"] == "pass"  # the ranks agree: on 2x
    assert main(["matrix", "--impl", "naive", "--rows", "nope"]) == 2
    assert "unknown behaviour 'nope'" in capsys.readouterr().err
