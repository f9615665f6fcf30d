"""Verdicts on evidence, with real ranks: each rank's thread budget, a rank that
computes is not hung (and the report says where it was), a rank that is parked is, a user's
script shows its output as it trains, and a script with nothing distributed is not a pass
that rests on silence.

Stall timeouts are 2 s. A rank that computes for 3 stall timeouts must not be flagged; one
that sleeps as long must be, within the stall timeout plus the CPU window (1 s) on an idle
machine. Detection is asserted with slack (stall + 8 s), since the suite shares the cores.
"""

from __future__ import annotations

import json
import os
import re
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.fixtures import deadline_loops
from tests.processes import alive, session_members
from verify.checks.hang import HangOptions, check_hang
from verify.checks.script_audit import AuditOptions, check_audit
from verify.checks.verdict import EXIT_CODES
from verify.launching import supervisor, thread_budget
from verify.launching.threads import JOBS_ENV

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = str(ROOT / "tests" / "fixtures" / "hang_script.py")
DDP_FILE = "tests/fixtures/ddp_sleep_script.py"  # as a headline names it
DDP_SCRIPT = str(ROOT / DDP_FILE)
STALL_S = 2.0


def _script(tmp_path, *argv, console="stdout", stall=STALL_S):
    options = HangOptions(
        script=(SCRIPT, *argv), nproc=2, stall_timeout_s=stall, out=str(tmp_path), console=console
    )
    return check_hang(options)


def _line(text: str) -> int:
    """The line of hang_script.py that holds `text`."""
    return next(
        i for i, line in enumerate(Path(SCRIPT).read_text().splitlines(), 1) if text in line
    )


def test_thread_budget_shares_the_cores(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.delenv(JOBS_ENV, raising=False)
    cores = len(os.sched_getaffinity(0))
    assert thread_budget(1).per_rank == cores
    assert thread_budget(2).per_rank == max(1, cores // 2)
    assert thread_budget(64).per_rank == 1  # never 0
    monkeypatch.setenv(JOBS_ENV, "4")  # four pytest workers share the machine
    assert thread_budget(2).per_rank == max(1, cores // 8)
    assert "4 jobs" in thread_budget(2).describe()
    monkeypatch.setenv("OMP_NUM_THREADS", "3")  # the user (or torchrun) decided
    assert thread_budget(2).per_rank == 3 and "OMP_NUM_THREADS" in thread_budget(2).why
    assert thread_budget(2, requested=5).per_rank == 5  # --threads-per-rank wins
    with pytest.raises(ValueError, match="must be >= 1"):
        thread_budget(2, requested=0)


def test_a_script_shows_its_output_and_its_ranks_get_their_share(tmp_path, capsys):
    """hang_script.py's correct loop (its twin that hangs: tests/test_hang.py): a pass, no
    finding, no rank left, and the script's output on the console as it trains."""
    result = _script(tmp_path, "ok")
    out = capsys.readouterr().out
    assert result.verdict == "pass" and result.passed, result.diagnosis.text()
    assert result.diagnosis.verdict == "ok", result.diagnosis.text()
    assert result.pids and not [p for p in result.pids.values() if alive(p)]
    budget = thread_budget(2)
    for rank in (0, 1):  # streamed to the console with a rank prefix, as training runs
        assert f"[rank {rank}] rank {rank}: threads={budget.per_rank}" in out, out
        assert re.search(rf"\[rank {rank}\] step 3 loss \d", out), out
        kept = (Path(result.report_dir) / f"rank{rank}.stdout").read_text()
        assert f"rank {rank}: threads={budget.per_rank}" in kept  # and kept, unprefixed
    assert result.threads == budget.describe()


def computing_problems(out: str, stall: float = STALL_S) -> list[str]:
    """A rank that computes for three stall timeouts while its peer waits: a pass, with a note
    that names where it computed (the evaluation pass, by its line), and no rank left. What is
    wrong (none); the hog window's `computing` job too (tests/test_load.py)."""
    result = _script(out, "compute", str(3 * stall), console="none", stall=stall)
    d = result.diagnosis
    if result.verdict != "pass" or d.verdict != "ok":
        return [f"computing: {result.verdict}: {d.text()}"]
    notes = [n for n in result.notes if "computing" in n]
    if len(notes) != 1 or not notes[0].startswith("rank 1 spent") or "not a hang" not in notes[0]:
        return [f"computing: the notes {result.notes}"]
    where = re.search(r"computing at (\S+):(\d+) \((\w+)\)", notes[0])
    if not where or not where.group(1).endswith("hang_script.py") or where.group(3) != "evaluate":
        return [f"computing: not named at the evaluation pass: {notes[0]}"]
    left = [p for p in result.pids.values() if alive(p)]
    return [f"computing: left running: {left}"] if left else []


@pytest.mark.under_load
def test_a_rank_that_computes_is_a_note_not_a_hang(tmp_path):
    problems = computing_problems(str(tmp_path))
    assert not problems, "\n".join(problems)


def test_a_parked_rank_is_hung_in_seconds(tmp_path):
    result = _script(tmp_path, "sleep", "60", console="none")
    d = result.diagnosis
    assert result.verdict == "fault" and d.verdict == "hang" and d.culprit == 1, d.text()
    assert d.detection_s is not None and d.detection_s < STALL_S + 8, d.detection_s
    assert "outside any collective" in d.headline and "train" in d.headline, d.headline
    assert f"hang_script.py:{_line('dist.all_reduce(p.grad)')}" in d.site
    assert result.elapsed_s < 40  # not the 60 s sleep, not the 600 s timeout


def blocked_in_ddp_problems(out: str, stall: float = STALL_S) -> list[str]:
    """PyTorch DDP all-reduces from C++, where the trace sees nothing: rank 0 waits in its
    reducer while rank 1 sleeps. No traced collective is pending, yet the run is hung, and the
    parked rank is named (it used to run to the timeout with no verdict). What is wrong
    (none); the hog window's `blind-script` job too (tests/test_load.py)."""
    options = HangOptions(script=(DDP_SCRIPT, "60"), nproc=2, stall_timeout_s=stall, out=out,
                          console="none")  # fmt: skip
    result = check_hang(options)
    d = result.diagnosis
    if result.verdict != "fault" or d.verdict != "hang" or d.culprit != 1:
        return [f"blocked in DDP: {result.verdict}: {d.text()}"]
    head = d.headline
    problems = [
        f"blocked in DDP: {what} not in the headline: {head}"
        for what, ok in (
            ("rank 1's line", head.startswith(f"rank 1 at train ({DDP_FILE}:21)")),
            ("parked", "parked outside any collective" in head),
            ("rank 0's line", f"rank 0 at train ({DDP_FILE}:23)" in head),
            ("the reducer", "PyTorch DDP's reducer" in head),
        )
        if not ok
    ]
    if result.elapsed_s >= 40:  # not the 60 s sleep, not the timeout
        problems.append(f"blocked in DDP: {result.elapsed_s:.1f} s")
    left = [p for p in result.pids.values() if alive(p)]
    return problems + ([f"blocked in DDP: left running: {left}"] if left else [])


@pytest.mark.under_load
def test_ranks_blocked_inside_pytorch_ddp_where_the_trace_is_blind_are_a_hang(tmp_path):
    problems = blocked_in_ddp_problems(str(tmp_path))
    assert not problems, "\n".join(problems)


UNEVEN = str(ROOT / "tests" / "fixtures" / "uneven_shards.py")


def uneven_problems(out: str) -> list[str]:
    """tests/fixtures/uneven_shards.py, its three ways at once: rank 1 runs out of batches
    while rank 0 is in DDP's next all-reduce (inside torch's C++). Returning, it makes rank
    0's all-reduce fail: a CRASH whose headline names rank 1, not the victim (a HANG naming
    rank 1, when rank 1's process is slow to go and close its connection); waiting in a
    barrier, a HANG naming rank 1, whose lines agree that rank 0 is blocked inside torch's
    C++; under DDP's join(), no finding. (Before: "CRASH: rank 0 raised RuntimeError ...
    Connection closed by peer", and "rank 0 is outside any collective" in a headline whose
    ranks said it was blocked inside torch's C++.)"""
    cases = {"returns": (), "barrier": ("--barrier",), "join": ("--join", "--barrier")}
    with ThreadPoolExecutor(max_workers=len(cases)) as pool:
        runs = {
            name: pool.submit(
                check_hang,
                HangOptions(
                    script=(UNEVEN, *argv),
                    nproc=2,
                    stall_timeout_s=STALL_S,
                    out=out,
                    console="none",
                ),
            )  # fmt: skip
            for name, argv in cases.items()
        }
        results = {name: run.result() for name, run in runs.items()}
    problems = []
    lines = Path(UNEVEN).read_text().splitlines()
    backward = next(i for i, line in enumerate(lines, 1) if "loss.backward()" in line)
    d = results["returns"].diagnosis  # a crash once its connection closes; a hang before that
    if not (
        d.verdict in ("crash", "hang") and d.culprit == 1 and "rank 1 left early" in d.headline
    ):
        problems.append(f"returns: {d.text()}")
    elif "inside torch's C++" not in d.headline or f"shards.py:{backward}" not in d.headline:
        problems.append(f"returns: where rank 0 was is not said: {d.headline}")
    d = results["barrier"].diagnosis
    if not (
        d.verdict == "hang" and d.culprit == 1 and d.headline.startswith("rank 1 left the loop")
    ):
        problems.append(f"barrier: {d.text()}")
    elif "rank 0 is blocked inside torch's C++" not in d.headline or "outside" in d.headline:
        problems.append(f"barrier: the headline and the lines disagree: {d.text()}")
    elif not d.ranks[0].startswith("rank 0 [timeout]: blocked inside torch's C++"):
        problems.append(f"barrier: {d.ranks}")
    ok = results["join"]
    if ok.verdict != "pass" or ok.diagnosis.verdict != "ok":
        problems.append(f"join: {ok.diagnosis.text()}")
    pids = [p for r in results.values() for p in r.pids.values()]
    if [p for p in pids if alive(p)]:
        problems.append(f"left running: {pids}")
    return problems


@pytest.mark.under_load
def test_uneven_data_names_the_rank_that_left_early(tmp_path):
    problems = uneven_problems(str(tmp_path))
    assert not problems, "\n".join(problems)


SPAWN = str(ROOT / "tests" / "fixtures" / "spawn_workers.py")


def own_ranks_problems(out: str) -> list[str]:
    """Scripts whose rank starts processes, at once: tests/fixtures/spawn_workers.py
    (mp.spawn, as pytorch/examples' multigpu.py) under `audit` with the tutorial's port is
    UNWATCHED (exit 2) once its workers wait, within the stall timeout (before: nothing for
    600 s, then TIMEOUT "no rank was hung"); with the port from the environment its workers
    meet at the tool's store and train, untraced: UNWATCHED at the end, never a pass. A DDP
    script whose ranks load batches in DataLoader workers (processes, not ranks) passes
    under `audit`, under DDP's join() (the steps after rank 1 joined counted, not audited)."""
    audit = lambda *argv: check_audit(AuditOptions(  # noqa: E731
        script=argv, nproc=1, stall_timeout_s=STALL_S, out=out, console="none", timeout_s=300
    ))  # fmt: skip
    workers = AuditOptions(
        script=(UNEVEN, "--join", "--barrier", "--workers", "2"), nproc=2,
        stall_timeout_s=STALL_S, out=out, console="none", timeout_s=300,
    )  # fmt: skip
    with ThreadPoolExecutor(max_workers=3) as pool:
        spawn = pool.submit(audit, SPAWN, "2")
        env_port = pool.submit(audit, SPAWN, "1", "--port", "env")
        ok = check_audit(workers)
        results = {"spawn": spawn.result(), "spawn-env-port": env_port.result()}
    problems = []
    for name, r in results.items():
        d = r.run.diagnosis
        if r.verdict != "unwatched" or EXIT_CODES[r.verdict] != 2 or d.culprit != 0:
            problems.append(f"{name}: {r.verdict}: {d.text()}")
        elif "torch.multiprocessing.spawn of 2 processes at" not in d.headline:
            problems.append(f"{name}: {d.headline}")
        elif "spawn_workers.py:" not in (d.site or ""):
            problems.append(f"{name}: the call site is not named: {d.site}")
        elif "run it as its own launcher, without --nproc" not in d.headline:
            problems.append(f"{name}: the launcher form is not offered: {d.headline}")
    d = results["spawn"].run.diagnosis
    if (
        "used CPU for the stall timeout" not in d.headline
        or "store nobody serves" not in d.headline
    ):
        problems.append(f"spawn: why they wait is not said: {d.headline}")
    elif d.detection_s is None or d.detection_s > STALL_S + 8:
        problems.append(f"spawn: detected {d.detection_s}s after its processes went still")
    if ok.verdict != "pass" or not ok.audit.joined:
        problems.append(f"workers: {ok.verdict}: {ok.run.diagnosis.text()}")
    pids = [p for r in results.values() for p in r.run.pids.values()] + list(ok.run.pids.values())
    # each rank leads a session of its own: its spawned workers are in it
    left = [p for p in pids if alive(p)] + [q for p in pids for q in session_members(p)]
    if left:
        problems.append(f"left running: {left}")
    return problems


@pytest.mark.under_load
def test_a_script_that_starts_its_own_ranks_is_said_to_be_unwatched(tmp_path):
    problems = own_ranks_problems(str(tmp_path))
    assert not problems, "\n".join(problems)


def test_a_script_that_starts_no_process_group_is_not_silently_passed(tmp_path):
    result = _script(tmp_path, "local", console="none")
    d = result.diagnosis
    assert d.verdict == "ok" and d.headline.startswith("no collective was observed"), d.text()
    from verify.cli.text_checks import hang

    assert "NO COLLECTIVES: no collective was observed" in hang(result)


@pytest.mark.under_load
def test_cut_short_a_rank_behind_is_no_fault_and_one_that_skipped_is_named():
    """Student-style loops never seen elsewhere (tests/fixtures/deadline_loops.py): a correct
    one cut short by the deadline while rank 0 evaluates is a timeout with no finding (it
    was reported "DESYNC: never issued"); a buggy one whose rank 1 skipped a collective, and
    was killed after rank 0 gave up waiting for it, still names rank 1."""
    problems = deadline_loops.verdict_problems()
    assert not problems, "\n".join(problems)


SLOW_RAISE = str(ROOT / "tests" / "fixtures" / "slow_raise.py")


@pytest.mark.parametrize("reports", [True, False], ids=["reports", "never-reports"])
def test_a_rank_slow_to_report_its_raise_is_a_crash_not_a_hang(tmp_path, monkeypatch, reports):
    """A student's script: rank 0 raises an exception whose message takes longer to form
    than the stall timeout, while rank 1 waits for it in an all-reduce. The run is a crash
    of rank 0 naming its error, not a hang with rank 0 "outside any collective" in the
    tool's launcher (before: a HANG, whenever a rank's failure report took longer than the
    time left to the stall timeout, as when a peer's exit closed its connection just then).
    A rank whose report does not come within the supervisor's time for it (shortened here)
    is a crash all the same, never a run with no verdict."""
    if not reports:
        monkeypatch.setattr(supervisor, "FAILING_S", 3.0)  # (10 s)
    slow = str(STALL_S * 2 if reports else 60)
    options = HangOptions(
        script=(SLOW_RAISE, slow), nproc=2, stall_timeout_s=STALL_S, out=str(tmp_path),
        console="none",
    )  # fmt: skip
    result = check_hang(options)
    d = result.diagnosis
    assert result.verdict == "fault" and d.verdict == "crash" and d.culprit == 0, d.text()
    if reports:
        assert "ShapeError" in d.headline and "wrong shape" in d.headline, d.headline
    else:
        assert "rank 0 raised, and sent no report within" in d.headline, d.headline
    assert not [p for p in result.pids.values() if alive(p)]


@pytest.mark.parametrize("reports", [True, False], ids=["reports", "never-reports"])
def test_under_torchrun_a_rank_slow_to_report_its_raise_is_a_crash(run_cli, tmp_path, reports):
    """The same script as a torchrun job under `hang --`: the node watchdog reads the
    rank's `failing` mark and waits for its failure, rather than calling the job hung with
    rank 0 "outside any collective, at __str__" (before: a HANG). A rank that leaves no
    failure within the supervisor's FAILING_S (10 s) is a crash all the same, as on one
    machine (before: a HANG once the mark expired)."""
    slow = str(STALL_S * 2 if reports else 60)
    command = ["torchrun", "--standalone", "--nproc-per-node", "2", SLOW_RAISE, slow]
    ran = run_cli("hang", "--json", "--stall-timeout", str(STALL_S), "--out", str(tmp_path),
                  "--", *command)  # fmt: skip
    report = json.loads(ran.stdout)
    assert (ran.returncode, report["verdict"]) == (1, "fault"), ran.stderr
    d = report["diagnosis"]
    assert d["verdict"] == "crash" and d["culprit"] == 0, d
    want = "ShapeError: batch has the wrong shape" if reports else "sent no report within"
    assert want in d["headline"], d["headline"]
    assert not [p for p in report["pids"].values() if alive(p)]
