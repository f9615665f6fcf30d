"""One diagnosis for a job that spans nodes: two torchrun agents on loopback, one rank each,
running `-m verify.hang_run` (`verify/launching/jobwide.py`).

Each node's watchdog sees only its own rank's trace; the verdict needs both. Four jobs, run
at once (each agent and rank is a fresh interpreter: a few seconds of CPU each), give the four
verdicts: a skip that gloo aborts on (a crash that is a desync: the survivor names the skip
before its traceback), the early exit of `hang_script.py skip` (a hang, named by rank 0's node
with the culprit on node 1), a reduce-op mismatch (a desync, found when both nodes end) and a
correct loop (no finding). Exactly one node prints the diagnosis; the other points to it; no
process of either agent is left. Under CPU hogs: tests/test_load.py.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path

import pytest

from tests.test_hang import blind_jobs, blind_problems
from tests.torchrun_jobs import Node, two_nodes
from verify.watching.history import pattern_break
from verify.watching.trace_file import Record, Trace

ROOT = Path(__file__).resolve().parents[1]
MULTINODE = str(ROOT / "tests" / "fixtures" / "multinode_script.py")
HANG = str(ROOT / "tests" / "fixtures" / "hang_script.py")
STALL_S = 3.0
LOSS_LINE, GRAD_LINE, HANG_LINE = 31, 33, 51  # the fixtures' all_reduce calls


def test_one_diagnosis_for_a_job_on_two_nodes(tmp_path):
    """The pair, the reduce-op mismatch and the correct loop (module docstring); the early
    exit is the hog window's (`test_the_early_exit_is_a_hang_named_by_rank_0s_node`)."""
    cases = {
        "pair": (MULTINODE, "pair"),
        "reduce-op": (MULTINODE, "reduce-op"),
        "ok": (MULTINODE, "ok"),
    }
    with ThreadPoolExecutor(max_workers=len(cases)) as pool:
        runs = {
            name: pool.submit(two_nodes, tmp_path / name, *argv, stall_s=STALL_S)
            for name, argv in cases.items()
        }
        jobs = {name: run.result() for name, run in runs.items()}
    for name, nodes in jobs.items():
        assert not any(n.killed for n in nodes), f"{name}: killed at the test's deadline"
        assert not any(n.leftover for n in nodes), (name, [n.leftover for n in nodes])
    assert_pair_reads_as_a_desync(jobs["pair"])
    desync = printed_once(jobs["reduce-op"], "DESYNC")
    assert "reduce-op mismatch" in desync and "rank 1 issued all_reduce" in desync, desync
    assert "MAX] at " in desync and f"multinode_script.py:{GRAD_LINE}" in desync, desync
    ok = jobs["ok"]
    assert [n.returncode for n in ok] == [0, 0], ok[0].stderr[-3000:] + ok[1].stderr[-3000:]
    assert ok[0].ours()[0].startswith("verify.hang_run (job of 2 nodes): OK: no hang"), ok[0].ours()
    assert ok[1].ours() == []
    for node in ok:
        assert json.loads((node.report() / "report.json").read_text())["verdict"] == "ok"


@pytest.mark.under_load
def test_the_early_exit_is_a_hang_named_by_rank_0s_node(tmp_path):
    """`hang_script.py skip` on two nodes (tests/test_load.py's `nodes-skip` job)."""
    nodes = two_nodes(tmp_path / "skip", HANG, "skip", stall_s=STALL_S)
    assert not any(n.killed for n in nodes), "killed at the test's deadline"
    assert not any(n.leftover for n in nodes), [n.leftover for n in nodes]
    assert_hang_named_by_one_node(nodes, STALL_S)


@pytest.mark.under_load
def test_a_job_whose_collectives_torch_issues_from_cpp(tmp_path):
    """PyTorch DDP on two nodes, its collectives untraced: rank 1 (node 1) parked polling for
    a file while rank 0 (node 0) waits inside DDP's backward is a HANG named by rank 0's node
    within the stall timeout, under verify.hang_run and verify.audit_run; rank 0 evaluating
    for twice the stall timeout while rank 1 waits there is no finding."""
    problems = blind_problems(blind_jobs(tmp_path, two_nodes))
    assert not problems, "\n".join(problems)


def printed_once(nodes: list[Node], verdict: str) -> str:
    """The one node that printed the job's diagnosis, the other pointing to it: the text."""
    texts = [n.stderr for n in nodes]
    assert all(n.returncode != 0 for n in nodes), texts
    full = [n for n in nodes if n.ours() and n.ours()[0].startswith("verify.hang_run (job of 2")]
    assert len(full) == 1 and f": {verdict}: " in full[0].ours()[0], texts
    (other,) = [n for n in nodes if n is not full[0]]
    assert f"the job's diagnosis is printed by node {nodes.index(full[0])}" in other.stderr, texts
    for node in nodes:  # every node's folder: its rank's records and the job's diagnosis
        report = json.loads((node.report() / "report.json").read_text())
        assert report["verdict"] == verdict.lower(), report
        assert list(node.report().glob("rank*.collectives.jsonl")), list(node.report().iterdir())
    return full[0].ours()[0]


def assert_hang_named_by_one_node(nodes: list[Node], stall_s: float) -> None:
    """Rank 1 (node 1) left its loop early: rank 0's node names it, within stall + 2 s."""
    text = printed_once(nodes, "HANG")
    assert nodes[0].ours()[0] == text, nodes[0].stderr[-3000:]
    assert "rank 1 skipped all_reduce #9" in text and f"hang_script.py:{HANG_LINE}" in text, text
    assert "[rank 1 runs on node 1," in text, text
    report = json.loads((nodes[1].report() / "report.json").read_text())
    assert report["culprit"] == 1 and report["detection_s"] <= stall_s + 2, report


def assert_pair_reads_as_a_desync(nodes: list[Node]) -> None:
    """gloo aborts rank 0 (node 0, which holds the job's store) on the size mismatch: node 1
    names rank 1's skip from its own history, before its traceback and torchrun's summary."""
    survivor = nodes[1]
    lines = survivor.ours()
    assert lines and "CRASH: rank 1 skipped all_reduce" in lines[0], survivor.stderr[-3000:]
    assert f"multinode_script.py:{LOSS_LINE}" in lines[0], lines[0]
    assert f"multinode_script.py:{GRAD_LINE} (main) in its place" in lines[0], lines[0]
    err = survivor.stderr
    assert err.index(lines[0]) < err.index("Traceback") < err.index("Root Cause"), err[-3000:]
    assert "collective mismatch" in nodes[0].stderr, nodes[0].stderr[-3000:]  # gloo's own
    assert all(n.returncode != 0 for n in nodes)


def test_a_skip_seen_from_one_side():
    """What node 1 holds when gloo's abort of rank 0 took node 0 and the job's store with it:
    rank 1's own records. Its history says it skipped the loss all-reduce (every earlier step
    issued one there) in the collective it failed in; a completed collective, or a pending
    one that follows the pattern, is no skip."""
    loss, grad = ("m.py:31", 1), ("m.py:33", 64)

    def trace(steps, last_state):
        records = [
            Record(index=i, seq=i + 1, op="all_reduce", group="world", reduce_op="SUM",
                   dtype="float32", numel=n, shape=f"({n},)", peer=None, p2p=False, site=site,
                   state="completed", t_issue=100.0 + i, t_done=100.5 + i)
            for i, (site, n) in enumerate(steps)
        ]  # fmt: skip
        records[-1] = replace(records[-1], state=last_state)
        return Trace(1, 1001, tuple(records), 2 * len(records), 0, 200.0, 0)

    found = pattern_break(trace([loss, grad] * 3 + [grad], "failed"))
    assert found is not None and (found.rank, found.site, found.culprit_site) == (
        1, "m.py:31", "m.py:33"
    ), found  # fmt: skip
    assert "skipped all_reduce on world [float32 (1,) SUM] at m.py:31" in found.message
    assert pattern_break(trace([loss, grad] * 3 + [grad], "completed")) is None
    assert pattern_break(trace([loss, grad] * 3 + [loss], "issued")) is None
