"""One diagnosis for a torchrun job, on one node or across nodes (`-m verify.hang_run` on every
node; on one node it is the same path, with one node).

Each node's watchdog (a thread of its LOCAL_RANK 0 process) reads only its own ranks' trace
files; a job's verdict needs every rank's. The nodes meet in the job's key-value store:
torchrun's agent store at MASTER_ADDR:MASTER_PORT, which every rank of the job already
reaches, under keys of the tool's own (`ddp-verify/job/<name>/`, the name derived from the
job's secret):

1. Every SAMPLE_S each node publishes a `NodeStatus`: a few numbers (its ranks' collective
   events, whether one waits in a collective, whether one works or starts outside them,
   whether all have ended). Every POSITION_S, when they moved, its ranks' positions (the
   last collective each issued and completed): all that is left of a node whose watchdog
   died with its rank. A position is not a trace: it is never compared (a rank whose
   position is a second old may have issued more since), only reported.
2. Rank 0's node applies the watchdog's rule (`watching/watchdog.py`) to the whole job: no
   event on any node for the stall timeout, a rank waiting in a collective, and no rank of
   any node working or starting. Where the trace is blind (PyTorch DDP's reducer issues its
   collectives from C++, so a DDP job records none), the wait is a rank blocked inside
   torch's C++ instead, and the stall is every rank of every node having been still for
   the stall timeout (`watching/blind.py`). Progress is timed on that node's clock alone,
   and how long a node's ranks have been still on that node's own, so the nodes' clocks
   never have to agree.
3. A verdict is claimed once (`compare_set` on one key): by rank 0's node at a hang or when
   every node's ranks have ended, by the first node one of whose ranks raised. The claimant
   asks every node for its `NodeReport` (its ranks' last records, stacks, how each ended:
   `node_ranks.py`), runs the single-machine `diagnose()` over all ranks, and prints it;
   every other node prints one line pointing to it. Every node's report folder holds its
   own ranks' files and the job's diagnosis.

That store listens on every interface, and any process that reaches it can write there:
every value is inert data sealed with the job's secret, under keys named after it
(`board.py`), and one that does not check out is ignored and said.

The store lives in torchrun's agent on the first node: a rank there that the backend aborts
(gloo's "Is there a distributed collective mismatch" is a C++ abort) takes it down within a
fraction of a second. The survivor that claims the verdict then diagnoses from what it holds,
and a skip still shows from one side: its rank's history says which collective it skipped
(`history.pattern_break`).
"""

from __future__ import annotations

import contextlib
import os
import socket
import sys
import threading
import time
from dataclasses import dataclass, replace

from verify.launching.board import Board
from verify.launching.node_ranks import POLL_S, NodeRanks, NodeReport, NodeStatus
from verify.launching.outcome import RankOutcome
from verify.launching.supervisor import GRACE_S, root_cause_order
from verify.watching.diagnose import diagnose
from verify.watching.findings import Diagnosis
from verify.watching.history import pattern_break
from verify.watching.trace_file import Trace
from verify.watching.watchdog import STARTUP_S

SAMPLE_S = 0.25  # status period: the hang verdict lags the last event by at most 2 of these
POSITION_S = 1.0
ANSWER_S = 3.0  # how long the claimant waits for every node's report


class NodeWatch:
    """The node watchdog of a job that spans nodes (module docstring): `run()` in a thread
    of the node's LOCAL_RANK 0 process, `wait(code)` in that process once its script ended."""

    def __init__(
        self, report_dir: str, stall_timeout_s: float, tool: str = "verify.hang_run"
    ) -> None:
        env = os.environ
        self.tool = tool  # the module the job runs, which names the lines printed
        self.report_dir, self.stall_timeout_s = report_dir, stall_timeout_s
        self.node, self.nodes = int(env["GROUP_RANK"]), int(env["GROUP_WORLD_SIZE"])
        self.world = int(env["WORLD_SIZE"])
        first = int(env["RANK"]) - int(env.get("LOCAL_RANK", "0"))
        local = list(range(first, first + int(env["LOCAL_WORLD_SIZE"])))
        self.local = NodeRanks(report_dir, local, stall_timeout_s)
        self.host = socket.gethostname()
        run = f"{env.get('TORCHELASTIC_RUN_ID', 'none')}/{env.get('TORCHELASTIC_RESTART_COUNT', 0)}"
        self._meeting = f"ddp-verify/job/{run}/seal/"  # where the nodes agree their secret
        self.board: Board | None = None  # once the job's store is met (`run`)
        self._seen: dict[int, int] = {}  # the last status number read of each node
        self.detection_s: float | None = None
        self._exit_code = 0
        self._finished = threading.Event()
        self._positions: dict[int, str] = {}  # of the ranks of nodes that did not answer
        self._last_events: tuple | None = None
        self._last_change = time.monotonic()

    def wait(self, code: int) -> int:
        """The exit code of this process once its script ended with `code`: it waits for
        the job's verdict (the store lives as long as the first node's processes), and
        exits 1 when that found a fault."""
        self._finished.wait()
        return code or self._exit_code

    # ---------------------------------------------------------------- the loop

    def run(self) -> None:
        try:
            self.board = Board.connect(
                self._meeting, self.node, self.nodes, STARTUP_S, ANSWER_S,
                f"{self.tool} (node {self.node})",
            )  # fmt: skip
            start, sampled, placed, at, sent = time.monotonic(), 0.0, 0.0, -1, 0
            while True:
                now = time.monotonic()
                if self.local.failed():
                    self._claim("crash")
                if now - sampled >= SAMPLE_S:  # the store hears from a node 4 times a second
                    sampled = now
                    status = self.local.status(now - start)
                    sent += 1
                    self.board.set(f"status/{self.node}", _Published(sent, status))
                    if now - placed >= POSITION_S and status.events != at:
                        placed, at = now, status.events
                        self.board.set(f"position/{self.node}", self.local.positions())
                    if self.node == 0:
                        self._judge(now)
                    if self.board.claimed() is not None:
                        break
                time.sleep(POLL_S)
            self._verdict()
        except Exception as exc:  # the store is gone: its node (the first) ended
            self._alone(exc)
        finally:
            self._finished.set()

    def _judge(self, now: float) -> None:
        """Rank 0's node: the watchdog's hang rule over every node's status."""
        keys = [f"status/{n}" for n in range(self.nodes)]
        if not self.board.has(*keys):
            return  # a node not up yet is starting
        statuses = [self._status(n, b) for n, b in enumerate(self.board.raw(keys))]
        if None in statuses:
            return  # a status that did not check out: as if that node had said nothing yet
        events = tuple(s.events for s in statuses)
        if events != self._last_events:
            self._last_events, self._last_change = events, now
        if all(s.ended for s in statuses):
            self._claim("end")
            return
        if now - self._last_change < self.stall_timeout_s or any(s.busy for s in statuses):
            return
        if any(s.waiting for s in statuses):
            # From the last event on any node, by the nodes' own clocks (exact on one
            # machine; across machines as good as their clock sync), to the verdict.
            last = max(s.last_event for s in statuses)
            self.detection_s = time.time() - last if last else now - self._last_change
            self._claim("hang")
            return
        # Where the trace is blind (PyTorch DDP's reducer issues its collectives from C++),
        # every rank of every node still for the stall timeout, one blocked inside torch:
        # timed from the last rank to go still, each node by its own clock.
        still = [s.still_s for s in statuses]
        if None not in still and min(still) >= self.stall_timeout_s:
            if any(s.blocked for s in statuses):
                self.detection_s = min(still)
                self._claim("hang")

    def _claim(self, reason: str) -> None:
        self.board.claim(reason, self.node)

    def _status(self, node: int, blob: bytes) -> NodeStatus | None:
        """Node `node`'s status from its key, None where it does not check out or is older
        than one read before (a replay)."""
        published = self.board.open(f"status/{node}", blob, _Published)
        if published is None:
            return None
        if published.seq < self._seen.get(node, 0):
            self.board.ignore(f"status/{node}", "an older status than one read before")
            return None
        self._seen[node] = published.seq
        return published.status

    # ---------------------------------------------------------------- the verdict

    def _verdict(self) -> None:
        reason, claimant = self.board.claimed() or ("crash", -1)  # (a claim seen is never unmade)
        own = self.local.report(reason, self.node, self.host)
        with contextlib.suppress(Exception):
            self.board.set(f"report/{self.node}", own)
        if claimant == self.node:
            diag = self._diagnose(reason, self._gather(own))
            with contextlib.suppress(Exception):
                self.board.set("diagnosis", diag)
            job = f"job of {self.nodes} nodes" if self.nodes > 1 else "node watchdog"
            text = f"{self.tool} ({job}): {diag.text()}"
            if diag.verdict != "ok":
                every = " (every node's folder holds the diagnosis)" if self.nodes > 1 else ""
                text += f"\nreport: {self.report_dir}{every}"
            print(text, file=sys.stderr, flush=True)
            others = [f"ack/{n}" for n in range(self.nodes) if n != self.node]
            with contextlib.suppress(Exception):  # they read it before this node's store goes
                self.board.wait(others, ANSWER_S)
        else:
            self.board.wait(["diagnosis"], 3 * ANSWER_S)
            diag = self.board.get("diagnosis", Diagnosis)
            if diag is None:
                raise Unsealed("the job's diagnosis in its store did not check out")
            text = (
                f"{self.tool} (node {self.node}): the job's diagnosis is printed by node "
                f"{claimant}: {diag.verdict.upper()}: {diag.headline}\nreport: {self.report_dir}"
            )
            if diag.verdict != "ok":
                print(text, file=sys.stderr, flush=True)
            with contextlib.suppress(Exception):
                self.board.set(f"ack/{self.node}", 1)
        self._finish(reason, diag, text)

    def _gather(self, own: NodeReport) -> dict[int, NodeReport]:
        """Every node's report; a node that does not answer within ANSWER_S is gone (its
        ranks died with its watchdog, or its store did): its last positions are kept."""
        for n in range(self.nodes):  # read first: the store may not outlive the wait
            with contextlib.suppress(Exception):
                if n != self.node and self.board.has(f"position/{n}"):
                    self._positions.update(self.board.get(f"position/{n}", dict[int, str]) or {})
        others = [n for n in range(self.nodes) if n != self.node]
        with contextlib.suppress(Exception):
            self.board.wait([f"report/{n}" for n in others], ANSWER_S)
        reports = {self.node: own}
        for n in others:
            with contextlib.suppress(Exception):
                if self.board.has(f"report/{n}"):
                    report = self.board.get(f"report/{n}", NodeReport)
                    if report is not None and report.node == n:
                        reports[n] = report
        return reports

    def _diagnose(self, reason: str, reports: dict[int, NodeReport]) -> Diagnosis:
        """The single-machine diagnosis over every rank, each rank's node named."""
        traces: list[Trace | None] = [None] * self.world
        per_node = len(self.local.ranks)  # torchrun starts as many ranks on every node
        node_of = {r: (r // per_node, "?") for r in range(self.world)}
        outcomes = [self._lost(r, r // per_node) for r in range(self.world)]
        failures, answered = [], set()
        for report in reports.values():
            for r, outcome in report.outcomes.items():
                traces[r], outcomes[r] = report.traces.get(r), outcome
                node_of[r] = (report.node, report.host)
                answered.add(r)
            failures += [(t, r) for r, t in report.failed_at.items()]
        failures += [(0.0, r) for r in range(self.world) if r not in answered]
        order = root_cause_order(failures, outcomes)
        diag = diagnose(traces, outcomes, stalled=reason == "hang", failure_order=order,
                        stall_timeout_s=self.stall_timeout_s, detection_s=self.detection_s)  # fmt: skip
        diag = _as_desync(diag, traces)
        return _with_nodes(diag, node_of) if self.nodes > 1 else diag

    def _lost(self, rank: int, node: int) -> RankOutcome:
        """A rank whose node did not answer: its last reported position, never compared."""
        why = f"ended with node {node}'s watchdog, which never answered"
        if rank in self._positions:
            why += f"; its last reported collective: {self._positions[rank]}"
        return RankOutcome(rank, "crashed", error=why)

    def _alone(self, exc: Exception) -> None:
        """The store went away before the verdict (its node, the first, ended: usually one of
        its ranks died): if one of this node's ranks fails within a grace, diagnose the crash
        from this node's ranks alone; otherwise say so and leave the ranks to torchrun."""
        end = time.monotonic() + GRACE_S
        while not self.local.failed() and time.monotonic() < end:
            time.sleep(POLL_S)
        lost = (
            str(exc)
            if isinstance(exc, Unsealed)
            else f"the job's store is gone ({type(exc).__name__})"
        )
        why = f"{lost}: only this node's ranks were seen"
        if not self.local.failed():
            print(f"{self.tool} (node {self.node}): {why}; no verdict", file=sys.stderr)
            return
        own = self.local.report("crash", self.node, self.host)
        diag = self._diagnose("crash", {self.node: own})
        text = f"{self.tool} (node {self.node}; {why}): {diag.text()}\nreport: {self.report_dir}"
        print(text, file=sys.stderr, flush=True)
        self._finish("crash", diag, text)

    def _finish(self, reason: str, diag: Diagnosis, text: str) -> None:
        self.local.write(diag, text)
        self._exit_code = 1 if diag.faulty else 0
        self.local.end(reason)


@dataclass(frozen=True)
class _Published:
    """A node's status, numbered: a reader takes none older than one it read (a replay)."""

    seq: int
    status: NodeStatus


class Unsealed(Exception):
    """A value the verdict needs did not check out (another process wrote the store)."""


def _as_desync(diag: Diagnosis, traces: list[Trace | None]) -> Diagnosis:
    """A crash no comparison of records explains, because a rank's records went with its
    node, where a survivor broke its own pattern in the collective it was in: a skip the
    backend aborted on, reported as the desync it is, the failures below it. (With every
    rank's records the comparison itself names a skip; a pattern all ranks changed alike,
    an evaluation after the loop, is no skip, so this is only asked when some are missing.)"""
    head = diag.findings[0] if diag.findings else None
    if diag.verdict != "crash" or head is None or head.kind not in ("raised", "crashed"):
        return diag
    if all(t is not None for t in traces):
        return diag
    for trace in traces:
        found = pattern_break(trace) if trace is not None else None
        if found is not None:
            found = replace(found, message=f"{found.message}; the backend aborted on the mismatch")
            return replace(diag, headline=found.message, culprit=found.rank,
                           collective=found.collective, site=found.site,
                           findings=(found, *diag.findings))  # fmt: skip
    return diag


def _with_nodes(diag: Diagnosis, node_of: dict[int, tuple[int, str]]) -> Diagnosis:
    """Each rank's node in the headline and the per-rank lines."""
    lines = []
    for line in diag.ranks:
        r = int(line.split()[1])
        node, host = node_of.get(r, ("?", "?"))
        where = f"node {node}" + (f", {host}" if host != "?" else "")
        lines.append(line.replace(f"rank {r} ", f"rank {r} ({where}) ", 1))
    headline, findings = diag.headline, diag.findings
    if diag.culprit is not None:
        node, host = node_of.get(diag.culprit, ("?", "?"))
        headline += f" [rank {diag.culprit} runs on node {node}" + (
            f", {host}]" if host != "?" else "]"
        )
        findings = tuple(
            replace(f, message=headline) if f.message == diag.headline else f for f in findings
        )
    return replace(diag, headline=headline, findings=findings, ranks=tuple(lines))
