"""Verdicts that hold under load: with a CPU hog on every core, the hang scenarios,
a rank that computes for a long time, a script that hangs, a consistency and an equivalence
run, `audit --record/--against` (a student's accumulation loop right and wrong, a resume:
tests/test_compare.py), two loops cut short (a correct one behind at the deadline, a buggy one that skipped a
collective: tests/fixtures/deadline_loops.py), classes whose bug shows on one rank only
(tests/test_agreement.py), a script whose ranks block inside PyTorch DDP's C++ reducer, a
matrix of sharded optimizers by slices and by trimmed param_groups, correct and buggy, beside
zero1 (tests/fixtures/sharded_styles.py), the shard layout check on zero3, FSDP2 and students'
sharded classes, right and wrong (tests/test_shard_layout.py), a student's hook DDP that
scales gradients while their all-reduce is in flight beside its twin that waits, in the
matrix's plain and no_sync() rows (tests/test_matrix.py), the replica audit of the
buggy training scripts (tests/test_script_audit.py), a rank whose large weight changed in
three rows in a pattern that keeps their index-weighted sum, beside a weight the same on
both ranks but held at an odd offset, and a difference both audits measure alike
(tests/test_replica_audit.py), and the hints of students' classes that
never send their last bucket or clip on one rank (tests/test_hints.py) give exactly the
verdicts they give on an idle machine, and
nothing is left running afterwards. So do two jobs of two torchrun agents (two nodes,
`tests/test_multinode.py`): the early exit is a hang named by rank 0's node, and a rank that
computes for twice the stall timeout on node 1 while node 0 waits is no finding; so do the
cases where the trace is blind (PyTorch DDP under torchrun, uneven data, a script that starts
its own ranks), in a test of their own, and so does `audit` under PyTorch's join() (uneven
data: a pass; a rank parked inside the join: a HANG naming it). The CPU
meters under them still read a process at `nice 19` that computes as busy and a waiting one as
idle (tests/test_procstat.py).

The hogs are started and killed by the test (bounded by its own time limit), and the test runs
alone (`alone`: no other test of the run at the same time, so the hogs are the whole load and
do not slow the rest of the suite). Under them each rank gets a fraction of a core, so
everything is slower: a rank that works must still read as working (its CPU time advances,
or its thread is runnable), never as hung, and a hang must still be called.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests import (
    test_agreement,
    test_compare,
    test_evidence,
    test_hang,
    test_hints,
    test_join_audit,
    test_launchers,
    test_matrix,
    test_procstat,
    test_replica_audit,
    test_shard_layout,
)
from tests.fixtures import deadline_loops, sharded_styles
from tests.processes import alive
from tests.test_script_audit import buggy_problems, run_buggy
from tests.torchrun_jobs import two_nodes
from verify.checks.consistency import ConsistencyOptions, check_consistency
from verify.checks.equivalence import EquivalenceOptions, check_equivalence
from verify.checks.hang import HangOptions, as_expected, check_hang

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = str(ROOT / "tests" / "fixtures" / "hang_script.py")
DDP_SCRIPT = str(ROOT / "tests" / "fixtures" / "ddp_sleep_script.py")
STALL_S = 3.0


@contextlib.contextmanager
def hogs():
    """One busy process per core, killed on the way out whatever happens."""
    procs = [
        subprocess.Popen([sys.executable, "-c", "while True: pass"])
        for _ in range(len(os.sched_getaffinity(0)))
    ]
    try:
        yield [p.pid for p in procs]
    finally:
        for p in procs:
            p.kill()
        for p in procs:
            p.wait()


@pytest.mark.alone  # the hogs would slow every other test of the run (tests/conftest.py)
def test_verdicts_hold_with_every_core_busy(tmp_path):
    out = str(tmp_path)

    def script(*argv, path=SCRIPT):
        options = HangOptions(
            script=(path, *argv), nproc=2, stall_timeout_s=STALL_S, out=out, console="none"
        )
        return check_hang(options)

    with hogs() as hog_pids:
        with ThreadPoolExecutor(max_workers=8) as pool:
            nodes_skip = pool.submit(two_nodes, tmp_path / "skip2", SCRIPT, "skip")
            nodes_compute = pool.submit(
                two_nodes, tmp_path / "compute2", SCRIPT, "compute", str(2 * STALL_S)
            )
            scenarios = pool.submit(
                check_hang, HangOptions(scenarios=True, stall_timeout_s=STALL_S, out=out, jobs=4)
            )
            computing = pool.submit(script, "compute", str(2 * STALL_S))
            one_rank = pool.submit(test_agreement.verdict_problems, *test_agreement.load_plan())
            blind = pool.submit(script, "60", path=DDP_SCRIPT)
            skipping = pool.submit(script, "skip")
            audited = pool.submit(run_buggy, out)
            meters = pool.submit(test_procstat.meter_problems)
            layouts = pool.submit(test_shard_layout.launch_and_check, 3)
            races = pool.submit(test_matrix.race_verdict_problems)
            hints = pool.submit(test_hints.hint_problems, out)
            rows = pool.submit(test_replica_audit.stencil_problems)
            measures = pool.submit(test_replica_audit.measure_problems)
            consistency = check_consistency(ConsistencyOptions(impl="bucketed", workload="unused"))
            equivalence = check_equivalence(EquivalenceOptions(impl="zero1", world_size=3))
            wrong = check_equivalence(EquivalenceOptions(impl="faulty:no-divide"))
            cut_short = deadline_loops.verdict_problems()
            sharded, _ = sharded_styles.verdict_problems()
            scenarios, computing, skipping, audited = (
                scenarios.result(),
                computing.result(),
                skipping.result(),
                audited.result(),
            )
    problems = [
        f"{r.options.impl}: {r.diagnosis.verdict} ({r.diagnosis.headline})"
        for r in scenarios.results
        if not as_expected(r)
    ]
    assert not problems, "\n".join(problems)
    assert computing.verdict == "pass", computing.diagnosis.text()
    assert any("computing" in n for n in computing.notes), computing.notes
    d = skipping.diagnosis
    assert skipping.verdict == "fault" and d.verdict == "hang" and d.culprit == 1, d.text()
    assert consistency.verdict == "pass", consistency.headline + (consistency.failure or "")
    assert equivalence.verdict == "pass", equivalence.headline + (equivalence.failure or "")
    assert wrong.verdict == "fault" and "first divergence" in wrong.headline, wrong.headline
    assert not cut_short, "\n".join(cut_short)
    assert not sharded, "\n".join(sharded)
    one_rank_problems, _ = one_rank.result()
    assert not one_rank_problems, "\n".join(one_rank_problems)
    b = blind.result().diagnosis
    assert b.verdict == "hang" and b.culprit == 1 and "parked" in b.headline, b.text()
    hang, computed = nodes_skip.result(), nodes_compute.result()
    said = [line for node in hang for line in node.ours()]
    assert "HANG: rank 1 skipped all_reduce #9" in hang[0].ours()[0], said
    assert "printed by node 0" in hang[1].ours()[0], said
    assert [n.returncode for n in computed] == [0, 0], computed[0].stderr[-3000:]
    assert "OK: no hang" in computed[0].ours()[0], computed[0].ours()
    assert not [p for node in (*hang, *computed) for p in node.leftover]
    assert not buggy_problems(audited), "\n".join(buggy_problems(audited))
    assert not meters.result(), "\n".join(meters.result())
    layouts.result()  # raises what the layout test would: a false alarm or a missed layout bug
    assert not races.result(), "\n".join(races.result())
    assert not hints.result(), "\n".join(hints.result())
    assert not rows.result(), "\n".join(rows.result())
    assert not measures.result(), "\n".join(measures.result())
    pids = [
        p
        for r in (*scenarios.results, computing, skipping, blind.result())
        for p in r.pids.values()
    ]
    pids += audited.run.pids.values()
    assert pids and not [p for p in pids + hog_pids if alive(p)]


@pytest.mark.alone
def test_compare_verdicts_hold_with_every_core_busy(tmp_path):
    """`audit --record/--against` under load: a student's accumulation loop right (within
    tolerance) and wrong (departs at step 0, the loss), a resume (bitwise, aligned at its
    step): the verdicts of an idle machine (tests/test_compare.py)."""
    with hogs():
        problems = test_compare.verdict_problems(tmp_path)
    assert not problems, "\n".join(problems)


@pytest.mark.alone
def test_verdicts_where_the_trace_is_blind_hold_with_every_core_busy(tmp_path):
    """Under the hogs: PyTorch DDP under torchrun on two nodes (a rank parked polling for a
    file while its peer waits inside DDP's C++ is a HANG naming both; a rank evaluating for
    twice the stall timeout while its peer waits there is no finding), uneven data (the rank
    that left early is named, returning or waiting in a barrier; under join() no finding),
    and scripts whose rank starts processes (mp.spawn: UNWATCHED; DataLoader workers: pass)
    give the verdicts they give on an idle machine, and leave nothing running."""
    with hogs() as hog_pids:
        with ThreadPoolExecutor(max_workers=3) as pool:
            blind = pool.submit(test_hang.blind_jobs, tmp_path / "blind", two_nodes)
            uneven = pool.submit(test_evidence.uneven_problems, str(tmp_path / "uneven"))
            own = pool.submit(test_evidence.own_ranks_problems, str(tmp_path / "own"))
            problems = test_hang.blind_problems(blind.result(), slack_s=20.0)
            problems += uneven.result() + own.result()
    assert not problems, "\n".join(problems)
    assert not [p for p in hog_pids if alive(p)]


@pytest.mark.alone
def test_the_audit_under_join_holds_with_every_core_busy(tmp_path):
    """Under the hogs: `audit` of a fresh DDP script with uneven files under `Join([model])`
    on 3 ranks (a pass, the steps all ranks took audited, the others counted), the same with
    one rank parked inside the join (a HANG naming it), and uneven data without join() (the
    rank that left early named): the verdicts of an idle machine (`tests/test_join_audit.py`),
    and nothing left running."""
    with hogs() as hog_pids:
        problems = test_join_audit.join_problems(str(tmp_path), ("fresh", "parked", "no-join"))
    assert not problems, "\n".join(problems)
    assert not [p for p in hog_pids if alive(p)]


@pytest.mark.alone
def test_the_launcher_form_holds_with_every_core_busy(tmp_path):
    """Under the hogs: `audit -- torchrun ...` of a hand-written loop that leaves one gradient
    un-averaged (named at step 0, rank 1), `audit -- python spawn_clean.py` (mp.spawn: a
    pass, every step audited), and `hang -- torchrun ...` with a rank parked while its peer
    waits in DDP's reducer (a HANG naming it): the verdicts of an idle machine
    (`tests/test_launchers.py`), and nothing left running."""
    with hogs() as hog_pids:
        problems = test_launchers.launcher_problems(str(tmp_path))
    assert not problems, "\n".join(problems)
    assert not [p for p in hog_pids if alive(p)]
