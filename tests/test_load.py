"""Verdicts that hold under load: with a CPU hog on every core, the hang scenarios,
a rank that computes for a long time, a script that hangs, a consistency and an equivalence
run, `audit --record/--against` (a student's accumulation loop right and wrong, a resume:
tests/test_compare.py; a nanoGPT-style script under bf16 autocast, ZeRO-1 against AdamW, its
replicas diverging: tests/test_compare_fresh.py), `compare --drill` and `audit --drill`
(tests/test_drill.py), the audit's own files failing mid-run (a small
tmpfs filled, the run folder removed: tests/test_audit_io.py), two loops cut short (a correct one behind at the deadline, a buggy one that skipped a
collective: tests/fixtures/deadline_loops.py), classes whose bug shows on one rank only
(tests/test_agreement.py), classes that all-reduce in the order of a set, of parameters or of
names (tests/test_launch.py), a script whose ranks block inside PyTorch DDP's C++ reducer, a
matrix of sharded optimizers by slices and by trimmed param_groups, correct and buggy, beside
zero1 (tests/fixtures/sharded_styles.py), the matrix's round trip under the scheduler of a
ZeRO-1 that loses the scheduled lr on a reload beside its twin that reloads right
(tests/fixtures/zero1_reload.py), a class whose gradients are all zero (consistency: a pass
that says nothing trained, tests/test_audit.py), the shard layout check on zero3, FSDP2 and students'
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
its own ranks, a fixed rerun under a crashed run's torchrun run id), in a test of their own,
and so does `audit` under PyTorch's join() (uneven
data: a pass; a rank parked inside the join: a HANG naming it). The CPU
meters under them still read a process at `nice 19` that computes as busy and a waiting one as
idle (tests/test_procstat.py).

So do the launcher form's (`audit -- torchrun ...` and `audit -- python spawn_*.py` of a
clean loop and a buggy one, a hang through torchrun: tests/test_launchers.py), the `--on-cpu`
rehearsals of CUDA scripts beside their CPU copies, under --nproc and through torchrun and
mp.spawn (tests/test_on_cpu.py), the Lightning and L-BFGS scripts whose gradients are read
where final (tests/test_frameworks.py), and the verdicts of
`audit --nproc N -- train.py` on the scripts of
tests/test_script_verdicts.py (a hang after five steps, nothing audited, Muon's owned state,
right and wrong, an optimizer over a set of parameters, right and wrong (and right under
torchrun), a loss that trains nothing, and the usage errors of a script that needs CUDA).

Every loaded verdict runs in one hog window, all at once, in one test marked `alone` (while it
lasts no other test of the run does: tests/conftest.py): under the hogs each rank gets a
fraction of a core, so everything is slower, and a rank that works must still read as working
(its CPU time advances, or its thread is runnable), never as hung, and a hang must still be
called. One window, not one per test: what the hogs burn is lost to the suite, so the
windows' waits (stall timeouts, a rank computing for two of them) overlap each other rather
than follow each other, with every core busy all the same. (One test, not several sharing a
module fixture: xdist spread such tests over its workers, or set the fixture up again when a
worker's queue ran dry, and the window ran three times.) The hogs are started and killed by
the test, bounded by the jobs' own time limits, each in a session of its own as every rank is
(in the test's session they got 5% of the window's CPU: tests/processes.py `hogs`; the
window prints their share); then each check (`CHECKS`) asserts on its jobs' results, and
every check that fails is reported.

The window is the load tier (marker `load`): `pytest -m load`, a CI step of its own after the
default tier, which deselects it (pyproject.toml). A job's idle run, the same function and
assertions, is a test marked `under_load` in the file the job comes from: it runs in the
default tier, and is skipped only in a run that includes this window, which checks its
verdicts once (tests/conftest.py). The three ways a change to a verdict
is tested: its file alone (idle), this window (loaded), fresh code in both.
"""

from __future__ import annotations

import os
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests import (
    test_agreement,
    test_audit,
    test_audit_io,
    test_compare,
    test_compare_fresh,
    test_drill,
    test_evidence,
    test_hang,
    test_hints,
    test_join_audit,
    test_launch,
    test_launchers,
    test_matrix,
    test_on_cpu,
    test_procstat,
    test_replica_audit,
    test_script_verdicts,
    test_shard_layout,
)
from tests.fixtures import deadline_loops

try:  # here, in the main thread: an import inside the window's threads parses the module (its
    # assertions rewritten) beside other threads' parsing, and CPython 3.11's AST state is not
    # thread-safe ("SystemError: AST constructor recursion depth mismatch", gh-106905; seen
    # once when this file ran alone). It skips itself without the dev extra.
    from tests import test_frameworks
except pytest.skip.Exception:
    test_frameworks = None
from tests.processes import alive, hogs, report_pids
from tests.test_multinode import assert_hang_named_by_one_node
from tests.test_script_audit import buggy_problems, run_buggy
from tests.torchrun_jobs import two_nodes
from verify.checks.consistency import ConsistencyOptions, check_consistency
from verify.checks.equivalence import EquivalenceOptions, check_equivalence
from verify.checks.hang import HangOptions, as_expected, check_hang
from verify.watching.procstat import sample_tree

__all__ = ["hogs"]  # (its home is tests/processes.py; imported from here by older tests)

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = str(ROOT / "tests" / "fixtures" / "hang_script.py")
STALL_S = 3.0


# The window's pool: every job at once would start ~150 processes (the torchrun jobs' agents,
# the matrices' ranks), and ranks starved that much are no longer what "every core busy"
# means (a rank importing a module for seconds at a hundredth of a core read as hung). About
# as many at once as the first load test ran before the windows were merged, which keeps
# every core busy beside the hogs. The longest jobs first, mixed with the heaviest starts
# (the torchrun jobs' fresh interpreters), so that none starts last. The three heaviest in
# interpreters (--on-cpu through launchers, Lightning, --on-cpu) start once the first jobs,
# which time hang detection from their start, are under way, and run two cases at a time: all
# at once they held the detection of an mp.spawn script's stall to 13.6 s (bound: 11 s).
WORKERS = 8
LONGEST = (
    "own", "rerun", "launchers", "scenarios", "compare", "script:hang", "script:never-met", "blind", "script:muon-two-gpus", "uneven",
    "on-cpu-launcher", "frameworks", "on-cpu", "script:muon",
    "nodes-skip", "script:no-step", "hints", "script:no-step-after-init", "nodes-compute", "join",
)  # fmt: skip


def _script(out: str, *argv: str):
    options = HangOptions(
        script=(SCRIPT, *argv), nproc=2, stall_timeout_s=STALL_S, out=out, console="none"
    )
    return check_hang(options)


def _jobs(folder: Path) -> dict[str, dict[str, tuple]]:
    """Each check's jobs: check name (`CHECKS`) -> {job name: (callable, *args)}."""
    out = str(folder)
    for sub in ("compare", "launchers"):
        (folder / sub).mkdir(exist_ok=True)
    return {
        "script verdicts": {
            f"script:{name}": (test_script_verdicts.run_cli, folder / "scripts", name)
            for name in test_script_verdicts.CASES
        },
        "blind": {
            "blind": (test_hang.blind_jobs, folder / "blind", two_nodes),
            "uneven": (test_evidence.uneven_problems, str(folder / "uneven")),
            "own": (test_evidence.own_ranks_problems, str(folder / "own")),
            "rerun": (test_hang.rerun_problems, folder / "rerun"),
        },
        "verdicts": {
            "scenarios": (
                check_hang, HangOptions(scenarios=True, stall_timeout_s=STALL_S, out=out, jobs=4)
            ),
            "nodes-skip": (two_nodes, folder / "skip2", SCRIPT, "skip"),
            "nodes-compute": (two_nodes, folder / "compute2", SCRIPT, "compute", str(2 * STALL_S)),
            "computing": (test_evidence.computing_problems, out, STALL_S),
            "blind-script": (test_evidence.blocked_in_ddp_problems, out, STALL_S),
            "skipping": (_script, out, "skip"),
            "one-rank": (test_agreement.verdict_problems, *test_agreement.load_plan()),
            "set-order": (test_launch.set_order_problems, folder / "set-order"),
            "audited": (run_buggy, out),
            "meters": (test_procstat.meter_problems,),
            "layouts": (test_shard_layout.launch_and_check, 3),
            "races": (test_matrix.race_verdict_problems,),
            "hints": (test_hints.hint_problems, out),
            "rows": (test_replica_audit.stencil_problems,),
            "measures": (test_replica_audit.measure_problems,),
            "consistency": (
                check_consistency, ConsistencyOptions(impl="bucketed", workload="unused")
            ),
            "equivalence": (check_equivalence, EquivalenceOptions(impl="zero1", world_size=3)),
            "wrong": (check_equivalence, EquivalenceOptions(impl="faulty:no-divide")),
            "cut-short": (deadline_loops.verdict_problems,),
            "sharded": (test_matrix.sharded_problems,),
            "reload": (test_matrix.reload_problems,),
            "untrained": (test_audit.untrained_problems,),
            "set-order-torchrun": (
                test_script_verdicts.launcher_problems, folder / "set-order-torchrun"
            ),
        },
        "join": {
            "join": (test_join_audit.join_problems, out, test_join_audit.LOADED),
        },
        "compare": {
            "compare": (test_compare.verdict_problems, folder / "compare"),
            "compare-fresh": (test_compare_fresh.fresh_problems, folder / "compare-fresh"),
            "drill": (test_drill.drill_problems, folder / "drill"),
        },
        "audit io": {"audit-io": (test_audit_io.audit_io_problems, folder / "audit-io")},
        "launchers": {
            "launchers": (test_launchers.launch_problems, str(folder / "launchers")),
            "retry": (test_launchers.retry_problems, str(folder / "retry")),
            "killed": (test_launchers.killed_problems, str(folder / "killed")),
            "sigkill-torchrun": (test_launchers.sigkill_problems, folder / "sigkill-t", "torchrun"),
            "sigkill-spawn": (test_launchers.sigkill_problems, folder / "sigkill-s", "mp.spawn"),
            "unaudited": (test_launchers.unaudited_problems, str(folder / "unaudited")),
            "says-why": (test_launchers.launcher_says_why_problems, folder / "says-why"),
        },
        "on cpu": {
            "on-cpu": (test_on_cpu.loaded_problems, folder / "on-cpu"),
            "on-cpu-launcher": (test_on_cpu.launcher_loaded_problems, folder / "on-cpu-launcher"),
            "on-cpu-accelerator": (
                test_on_cpu.accelerator_loaded_problems, folder / "on-cpu-accelerator"
            ),
        },
        # without the dev extra there is no job (tests/test_frameworks.py skips itself too)
        "frameworks": {} if test_frameworks is None else {
            "frameworks": (_frameworks, folder / "frameworks")
        },
    }  # fmt: skip


def _frameworks(folder: Path) -> list[str]:
    """tests/test_frameworks.py's cases whose verdict hangs on timing (a job only with the dev
    extra's Lightning and accelerate: `_jobs`)."""
    folder.mkdir()
    return test_frameworks.loaded_problems(folder)


class Window:
    """The results of one hog window's jobs (`_run_window`): `window[name]` is a job's value, or
    raises what the job raised; `hogs` are the hogs' pids, `folder` the jobs' reports."""

    def __init__(self, done: dict, hog_pids: list[int], folder: Path) -> None:
        self._done, self.hogs, self.folder = done, hog_pids, folder

    def __getitem__(self, name: str):
        ok, value = self._done[name]
        if not ok:
            raise value
        return value


def _timed(name: str, since: float, fn, *args):
    """`(True, fn(*args))`, or `(False, what it raised)`; prints when it started and took
    (`pytest -s`: which jobs make the window long)."""
    start = time.monotonic()
    try:
        return True, fn(*args)
    except BaseException as exc:  # re-raised by the test that asserts on it
        return False, exc
    finally:
        took = time.monotonic() - start
        print(f"  {name:26s} from {start - since:6.1f}s for {took:6.1f}s")


def _run_window(folder: Path) -> Window:
    """Every check's jobs at once under one set of hogs (module docstring)."""
    jobs = {name: job for table in _jobs(folder).values() for name, job in table.items()}
    first = {name: i for i, name in enumerate(LONGEST)}
    jobs = dict(sorted(jobs.items(), key=lambda item: first.get(item[0], len(first))))
    start, busy = time.monotonic(), _busy_cpu_s()
    with hogs() as hog_pids:
        with ThreadPoolExecutor(max_workers=WORKERS) as pool:
            futures = {name: pool.submit(_timed, name, start, *job) for name, job in jobs.items()}
            done = {name: f.result() for name, f in futures.items()}
        hogged = sum((sample_tree(pid) or (0.0,))[0] for pid in hog_pids)
    worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
    print(f"{len(jobs)} jobs under the hogs in {time.monotonic() - start:.1f}s ({worker}); "
          f"the hogs had {hogged:.1f} of the machine's {_busy_cpu_s() - busy:.1f} CPU-s")  # fmt: skip
    return Window(done, hog_pids, folder)


def _busy_cpu_s() -> float:
    """CPU seconds the machine has spent busy since it started (/proc/stat)."""
    ticks = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    return (sum(ticks) - ticks[3] - ticks[4]) / os.sysconf("SC_CLK_TCK")  # less idle, iowait


def _check_verdicts(window: Window) -> None:
    scenarios, skipping = window["scenarios"], window["skipping"]
    problems = [
        f"{r.options.impl}: {r.diagnosis.verdict} ({r.diagnosis.headline})"
        for r in scenarios.results
        if not as_expected(r)
    ]
    assert not problems, "\n".join(problems)
    assert not window["computing"], "\n".join(window["computing"])
    d = skipping.diagnosis
    assert skipping.verdict == "fault" and d.verdict == "hang" and d.culprit == 1, d.text()
    consistency, equivalence, wrong = window["consistency"], window["equivalence"], window["wrong"]
    assert consistency.verdict == "pass", consistency.headline + (consistency.failure or "")
    assert equivalence.verdict == "pass", equivalence.headline + (equivalence.failure or "")
    assert wrong.verdict == "fault" and "first divergence" in wrong.headline, wrong.headline
    assert not window["cut-short"], "\n".join(window["cut-short"])
    assert not window["sharded"], "\n".join(window["sharded"])
    assert not window["reload"], "\n".join(window["reload"])
    assert not window["untrained"], "\n".join(window["untrained"])
    assert not window["set-order-torchrun"], "\n".join(window["set-order-torchrun"])
    one_rank_problems, _ = window["one-rank"]
    assert not one_rank_problems, "\n".join(one_rank_problems)
    assert not window["set-order"], "\n".join(window["set-order"])
    assert not window["blind-script"], "\n".join(window["blind-script"])
    hang, computed = window["nodes-skip"], window["nodes-compute"]
    said = [line for node in hang for line in node.ours()]
    late = [n.folder for n in (*hang, *computed) if n.killed]
    assert not late, f"killed at tests/torchrun_jobs.py's deadline: {late} {said}"
    assert_hang_named_by_one_node(hang, STALL_S)
    assert [n.returncode for n in computed] == [0, 0], computed[0].stderr[-3000:]
    assert "OK: no hang" in computed[0].ours()[0], computed[0].ours()
    assert not [p for node in (*hang, *computed) for p in node.leftover]
    audited = window["audited"]
    assert not buggy_problems(audited), "\n".join(buggy_problems(audited))
    assert not window["meters"], "\n".join(window["meters"])
    window["layouts"]  # raises what the layout test would: a false alarm or a missed layout bug
    assert not window["races"], "\n".join(window["races"])
    assert not window["hints"], "\n".join(window["hints"])
    assert not window["rows"], "\n".join(window["rows"])
    assert not window["measures"], "\n".join(window["measures"])
    pids = [p for r in (*scenarios.results, skipping) for p in r.pids.values()]
    pids += audited.run.pids.values()
    assert pids and not [p for p in pids + window.hogs if alive(p)]


def _check_blind(window: Window) -> None:
    """Under the hogs: PyTorch DDP under torchrun on two nodes (a rank parked polling for a
    file while its peer waits inside DDP's C++ is a HANG naming both; a rank evaluating for
    twice the stall timeout while its peer waits there is no finding), uneven data (the rank
    that left early is named, returning or waiting in a barrier; under join() no finding),
    and scripts whose rank starts processes (mp.spawn: UNWATCHED; DataLoader workers: pass),
    and a fixed rerun under a crashed run's `--rdzv-id` (a pass, in a folder of its own)
    give the verdicts they give on an idle machine, and leave nothing running."""
    problems = test_hang.blind_problems(window["blind"], slack_s=20.0)
    problems += window["uneven"] + window["own"] + window["rerun"]
    assert not problems, "\n".join(problems)
    assert not [p for p in window.hogs if alive(p)]


def _check_join(window: Window) -> None:
    """Under the hogs: `audit` of a fresh DDP script with uneven files under `Join([model])`
    on 3 ranks (a pass, the steps all ranks took audited, the others counted), the same with
    one rank parked inside the join (a HANG naming it), and uneven data without join() (the
    rank that left early named): the verdicts of an idle machine (`tests/test_join_audit.py`),
    and nothing left running."""
    problems = window["join"]
    assert not problems, "\n".join(problems)
    assert not [p for p in window.hogs if alive(p)]


def _check_script_verdicts(window: Window) -> None:
    """Under the hogs: every case of tests/test_script_verdicts.py gives its idle verdict, its
    exit code and its console, and no rank is left running."""
    cases = test_script_verdicts.CASES
    done = {name: window[f"script:{name}"] for name in cases}
    problems = test_script_verdicts.problems(done)
    problems += test_script_verdicts.log_problems(window.folder / "scripts")
    assert not problems, "\n\n".join(problems)
    pids = report_pids(window.folder / "scripts")
    assert pids and not [p for p in pids if alive(p)], "a rank left running"


def _check_compare(window: Window) -> None:
    """`audit --record/--against`: a student's accumulation loop right (within tolerance)
    and wrong (departs at step 0, the loss), a resume (bitwise, aligned at its step); a
    nanoGPT-style script 1 rank against 2 under bf16 autocast (within bfloat16's tolerance)
    and its loss not divided (departs), ZeRO-1 against plain AdamW (bitwise) and with another
    lr (departs), its replicas diverging (departs); `compare --drill` and `audit --drill` on
    fresh student scripts (a dropout mask drawn otherwise and a rank-0-only update named at
    their lines, a clock-jittered run refused at the replay): the verdicts of an idle machine
    (tests/test_compare.py, tests/test_compare_fresh.py, tests/test_drill.py)."""
    problems = window["compare"] + window["compare-fresh"] + window["drill"]
    assert not problems, "\n".join(problems)


def _check_audit_io(window: Window) -> None:
    """The audit's own files failing mid-run (a small tmpfs filled, the run folder removed):
    the audit stops on every rank together, the training runs to its end, exit 2; the same
    loop left alone passes (tests/test_audit_io.py)."""
    problems = window["audit-io"]
    assert not problems, "\n\n".join(problems)


def _check_launchers(window: Window) -> None:
    """`audit -- torchrun ...` and `audit -- python spawn_*.py` (mp.spawn) of a clean script
    (a pass, every step audited) and a buggy one (named at its step, tensor and rank), `hang
    -- torchrun ...` with a rank parked while its peer waits in DDP's reducer (a HANG naming
    it and its line), and a script that retries mp.spawn after a rank raised (the CRASH with
    the failed attempt's audit, not the retry's), a rank killed by a signal (the first to die
    named), `kill -9` of the tool (nothing of the run left), and a wrapper that starts a rank with a
    clean environment (that rank named as not audited, no TIMEOUT; kept, a pass and a
    divergence found), and a CUDA-only script under torchrun and mp.spawn and a misspelled
    one (the tool's one line): the verdicts of an idle machine (tests/test_launchers.py)."""
    names = ("launchers", "retry", "killed", "unaudited", "says-why", "sigkill-torchrun",
             "sigkill-spawn")  # fmt: skip
    problems = [p for name in names for p in window[name]]
    assert not problems, "\n".join(problems)


def _check_on_cpu(window: Window) -> None:
    """`--on-cpu`: CUDA scripts rehearsed on CPU ranks (the nanoGPT-style loop clean and with
    its sync bug, the DDP-series one clipping on rank 0) give their CPU copies' verdicts, and
    so does the launcher form (torchrun, mp.spawn), and a script on torch.accelerator (the
    verdicts, the line of one that leaves before joining): tests/test_on_cpu.py's idle
    verdicts."""
    problems = window["on-cpu"] + window["on-cpu-launcher"] + window["on-cpu-accelerator"]
    assert not problems, "\n\n".join(problems)


def _check_frameworks(window: Window) -> None:
    """Lightning (automatic optimization, clean and with gradient noise on one rank; manual
    optimization with BatchNorm) and L-BFGS's closure: the gradients are read where final,
    as on an idle machine (tests/test_frameworks.py); nothing to check without the dev extra."""
    if test_frameworks is None:
        return
    problems = window["frameworks"]
    assert not problems, "\n\n".join(problems)


CHECKS = {
    "verdicts": _check_verdicts,
    "blind": _check_blind,
    "join": _check_join,
    "script verdicts": _check_script_verdicts,
    "compare": _check_compare,
    "audit io": _check_audit_io,
    "launchers": _check_launchers,
    "on cpu": _check_on_cpu,
    "frameworks": _check_frameworks,
}


@pytest.mark.load  # the load tier: `pytest -m load` (pyproject.toml), not the default one
@pytest.mark.alone  # the hogs would slow every other test of the run (tests/conftest.py)
def test_verdicts_hold_with_every_core_busy(tmp_path):
    """One hog window for every loaded verdict (module docstring); each check's assertions on
    its jobs, every failing one reported."""
    window = _run_window(tmp_path)
    failed = []
    for name, check in CHECKS.items():
        try:
            check(window)
        except Exception as exc:  # an assertion, or what a job raised
            failed.append(f"{name}: {type(exc).__name__}: {exc}")
    assert not failed, "\n\n".join(failed)
