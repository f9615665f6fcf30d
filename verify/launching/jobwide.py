"""One diagnosis for a torchrun job that spans nodes (`-m verify.hang_run` on every node).

Each node's watchdog (a thread of its LOCAL_RANK 0 process) reads only its own ranks' trace
files; a job's verdict needs every rank's. The nodes meet in the job's key-value store:
torchrun's agent store at MASTER_ADDR:MASTER_PORT, which every rank of the job already
reaches, under keys of the tool's own (`ddp-verify/job/<run id>/<restart>/`):

1. Every SAMPLE_S each node publishes a `NodeStatus`: a few numbers (its ranks' collective
   events, whether one waits in a collective, whether one works or starts outside them,
   whether all have ended). Every TAIL_S, when they moved, its ranks' last records: they
   stand in for a node whose watchdog died with its rank.
2. Rank 0's node applies the watchdog's rule (`watching/watchdog.py`) to the whole job: no
   event on any node for the stall timeout, a rank waiting in a collective, and no rank of
   any node working or starting. Progress is timed on that node's clock alone, so the
   nodes' clocks never have to agree.
3. A verdict is claimed once (`compare_set` on one key): by rank 0's node at a hang or when
   every node's ranks have ended, by the first node one of whose ranks raised. The claimant
   asks every node for its `NodeReport` (its ranks' last TAIL records, stacks, how each
   ended), runs the single-machine `diagnose()` over all ranks, and prints it; every other
   node prints one line pointing to it. Every node's report folder holds its own ranks'
   files and the job's diagnosis.

The store lives in torchrun's agent on the first node: a rank there that the backend aborts
(gloo's "Is there a distributed collective mismatch" is a C++ abort) takes it down within a
fraction of a second. The survivor that claims the verdict then diagnoses from what it holds,
and a skip still shows from one side: its rank's history says which collective it skipped
(`diagnose.pattern_break`).
"""

from __future__ import annotations

import contextlib
import datetime
import faulthandler
import json
import os
import pickle
import signal
import socket
import sys
import threading
import time
from dataclasses import dataclass, replace

import torch.distributed as dist

from verify.launching.outcome import RankOutcome
from verify.launching.process import alive
from verify.launching.supervisor import GRACE_S, root_cause_order
from verify.watching import trace_file
from verify.watching.diagnose import diagnose, pattern_break
from verify.watching.findings import Diagnosis
from verify.watching.procstat import CpuMeter
from verify.watching.trace_file import Trace

SAMPLE_S = 0.25  # status period: the hang verdict lags the last event by at most 2 of these
TAIL = 256  # records per rank sent at a verdict (the history a skip is recognised by)
ANSWER_S = 3.0  # how long the claimant waits for every node's report
STARTUP_S = 60.0  # as the watchdog: a rank that has issued nothing yet is still starting
_POLL_S = 0.1


@dataclass(frozen=True)
class NodeStatus:
    """What one node says every SAMPLE_S (a few dozen bytes: the job's store carries one per
    node and period, and only rank 0's node reads them)."""

    events: int  # issues and completions of its ranks' collectives
    waiting: bool  # one of its ranks waits in a collective
    busy: bool  # one of its ranks works (CPU) or starts outside any collective
    ended: bool  # every rank of the node has ended


@dataclass(frozen=True)
class NodeReport:
    """A node's answer at a verdict: its ranks' last TAIL records and how each ended."""

    node: int
    host: str
    traces: dict[int, Trace | None]
    outcomes: dict[int, RankOutcome]
    failed_at: dict[int, float]  # wall clock of each failure (root cause first, as on one node)


class NodeWatch:
    """The node watchdog of a job that spans nodes (module docstring); `run()` in a thread,
    `ranks_ended()` in every rank whose script ended."""

    def __init__(self, report_dir: str, stall_timeout_s: float) -> None:
        env = os.environ
        self.report_dir, self.stall_timeout_s = report_dir, stall_timeout_s
        self.node, self.nodes = int(env["GROUP_RANK"]), int(env["GROUP_WORLD_SIZE"])
        self.world = int(env["WORLD_SIZE"])
        first = int(env["RANK"]) - int(env.get("LOCAL_RANK", "0"))
        self.ranks = list(range(first, first + int(env.get("LOCAL_WORLD_SIZE", "1"))))
        self.host = socket.gethostname()
        run = f"{env.get('TORCHELASTIC_RUN_ID', 'none')}/{env.get('TORCHELASTIC_RESTART_COUNT', 0)}"
        self.prefix = f"ddp-verify/job/{run}/"
        self.exit_code = 0
        self.finished = threading.Event()
        self.detection_s: float | None = None
        self._pids: dict[int, int] = {}
        self._meters: dict[int, CpuMeter] = {}
        self._last_events: tuple | None = None
        self._last_change = time.monotonic()

    # ---------------------------------------------------------------- the loop

    def run(self) -> None:
        try:
            self.store = _Store(
                dist.TCPStore(
                    os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                    timeout=datetime.timedelta(seconds=ANSWER_S),
                )
            )  # fmt: skip
            start, sampled = time.monotonic(), 0.0
            while not self.store.check([self.prefix + "claim"]):
                now = time.monotonic()
                if now - sampled >= SAMPLE_S:
                    sampled = now
                    self._set(f"status/{self.node}", self._status(now - start))
                    if self.node == 0:
                        self._judge(now)
                if any(os.path.exists(_failed(self.report_dir, r)) for r in self.ranks):
                    self._claim("crash")
                time.sleep(_POLL_S)
            self._verdict()
        except Exception as exc:  # the store is gone: its node (the first) ended
            self._alone(exc)
        finally:
            self.finished.set()

    def _status(self, up_s: float) -> NodeStatus:
        headers = {r: trace_file.read_header(self._trace(r)) for r in self.ranks}
        self._pids.update({r: h.pid for r, h in headers.items() if h is not None})
        live = [r for r in self.ranks if not self._ended(r)]
        waiting = any(headers[r] is not None and headers[r].pending for r in live)
        busy = False
        for r in live:
            h = headers[r]
            if h is not None and h.pending:
                continue
            meter = self._meters.get(r)
            if h is not None and (meter is None or meter.pid != h.pid):
                meter = self._meters[r] = CpuMeter(h.pid)
            if meter is not None:
                meter.sample(time.monotonic())
            starting = (h is None or h.events == 0) and up_s < STARTUP_S
            busy = busy or starting or (meter is not None and meter.busy())
        events = sum(h.events for h in headers.values() if h is not None)
        return NodeStatus(events, waiting, busy, not live)

    def _judge(self, now: float) -> None:
        """Rank 0's node: the watchdog's hang rule over every node's status."""
        keys = [f"{self.prefix}status/{n}" for n in range(self.nodes)]
        if not self.store.check(keys):
            return  # a node not up yet is starting
        statuses: list[NodeStatus] = [pickle.loads(b) for b in self.store.multi_get(keys)]
        events = tuple(s.events for s in statuses)
        if events != self._last_events:
            self._last_events, self._last_change = events, now
        if all(s.ended for s in statuses):
            self._claim("end")
        elif (
            now - self._last_change >= self.stall_timeout_s
            and any(s.waiting for s in statuses)
            and not any(s.busy for s in statuses)
        ):
            self.detection_s = now - self._last_change
            self._claim("hang")

    def _claim(self, reason: str) -> None:
        self.store.compare_set(self.prefix + "claim", "", f"{reason}:{self.node}")

    # ---------------------------------------------------------------- the verdict

    def _verdict(self) -> None:
        reason, claimant = self.store.get(self.prefix + "claim").decode().split(":")
        own = self._report(reason)
        with contextlib.suppress(Exception):
            self._set(f"report/{self.node}", own)
        if int(claimant) == self.node:
            diag = self._diagnose(reason, self._gather(own))
            with contextlib.suppress(Exception):
                self._set("diagnosis", diag)
            text = f"verify.hang_run (job of {self.nodes} nodes): {diag.text()}"
            if diag.verdict != "ok":
                text += f"\nreport: {self.report_dir} (every node's folder holds the diagnosis)"
            print(text, file=sys.stderr, flush=True)
            self._write(diag, text)
            others = [f"{self.prefix}ack/{n}" for n in range(self.nodes) if n != self.node]
            with contextlib.suppress(Exception):  # they read it before this node's store goes
                self.store.wait(others, datetime.timedelta(seconds=ANSWER_S))
        else:
            self.store.wait([self.prefix + "diagnosis"], datetime.timedelta(seconds=3 * ANSWER_S))
            diag = pickle.loads(self.store.get(self.prefix + "diagnosis"))
            text = (
                f"verify.hang_run (node {self.node}): the job's diagnosis is printed by node "
                f"{claimant}: {diag.verdict.upper()}: {diag.headline}\nreport: {self.report_dir}"
            )
            if diag.verdict != "ok":
                print(text, file=sys.stderr, flush=True)
            self._write(diag, text)
            with contextlib.suppress(Exception):
                self._set(f"ack/{self.node}", 1)
        self._end(reason, diag)

    def _gather(self, own: NodeReport) -> dict[int, NodeReport]:
        """Every node's report; a node that does not answer within ANSWER_S is gone (its
        ranks died with its watchdog, or its store did)."""
        keys = [f"{self.prefix}report/{n}" for n in range(self.nodes) if n != self.node]
        with contextlib.suppress(Exception):
            self.store.wait(keys, datetime.timedelta(seconds=ANSWER_S))
        reports = {self.node: own}
        for key in keys:
            with contextlib.suppress(Exception):
                if self.store.check([key]):
                    report = pickle.loads(self.store.get(key))
                    reports[report.node] = report
        return reports

    def _diagnose(self, reason: str, reports: dict[int, NodeReport]) -> Diagnosis:
        """The single-machine diagnosis over every rank, each rank's node named."""
        traces: list[Trace | None] = [None] * self.world
        per_node = len(self.ranks)  # torchrun starts as many ranks on every node
        node_of = {r: (r // per_node, "?") for r in range(self.world)}
        outcomes = [
            RankOutcome(r, "crashed", error=f"ended with node {r // per_node}'s watchdog, "
                        "which never answered")
            for r in range(self.world)
        ]  # fmt: skip
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
        return _with_nodes(_as_desync(diag, traces), node_of)

    def _alone(self, exc: Exception) -> None:
        """The store went away before the verdict (its node, the first, ended: usually one of
        its ranks died): if one of this node's ranks fails within a grace, diagnose the crash
        from this node's ranks alone; otherwise say so and leave the ranks to torchrun."""
        end = time.monotonic() + GRACE_S
        failed = lambda: any(os.path.exists(_failed(self.report_dir, r)) for r in self.ranks)  # noqa: E731
        while not failed() and time.monotonic() < end:
            time.sleep(_POLL_S)
        why = f"the job's store is gone ({type(exc).__name__}): only this node's ranks were seen"
        if not failed():
            print(f"verify.hang_run (node {self.node}): {why}; no verdict", file=sys.stderr)
            return
        diag = self._diagnose("crash", {self.node: self._report("crash")})
        text = (
            f"verify.hang_run (node {self.node}; {why}): {diag.text()}\nreport: {self.report_dir}"
        )
        print(text, file=sys.stderr, flush=True)
        self._write(diag, text)
        self._end("crash", diag)

    # ---------------------------------------------------------------- this node's ranks

    def _trace(self, r: int) -> str:
        return os.path.join(self.report_dir, f"rank{r}.trace")

    def _ended(self, r: int) -> bool:
        if os.path.exists(_failed(self.report_dir, r)) or os.path.exists(_ok(self.report_dir, r)):
            return True
        pid = self._pids.get(r)
        return pid is not None and not alive(pid)

    def _report(self, reason: str) -> NodeReport:
        live = [r for r in self.ranks if r in self._pids and not self._ended(r)]
        for r in live:  # each dumps its stack into rank<r>.stack (faulthandler, SIGUSR1)
            if self._pids[r] == os.getpid():
                with open(os.path.join(self.report_dir, f"rank{r}.stack"), "w") as f:
                    faulthandler.dump_traceback(f, all_threads=True)
            else:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(self._pids[r], signal.SIGUSR1)
        time.sleep(0.5 if live else 0)
        outcomes, failed_at = {}, {}
        for r in self.ranks:
            stack = _read(os.path.join(self.report_dir, f"rank{r}.stack"))
            failed = _read(_failed(self.report_dir, r), binary=True)
            if failed is not None:
                error, tb, failed_at[r] = pickle.loads(failed)
                outcomes[r] = RankOutcome(r, "error", error=error, traceback=tb)
            elif os.path.exists(_ok(self.report_dir, r)):
                outcomes[r] = RankOutcome(r, "ok")
            elif r in live:
                status = "timeout" if reason == "hang" else "killed"
                why = "no rank of the job progressed" if reason == "hang" else "still running"
                outcomes[r] = RankOutcome(r, status, error=why, stack=stack)
            else:
                why = "exited without a report (a signal, or os._exit)"
                outcomes[r] = RankOutcome(r, "crashed", error=why, stack=stack)
                failed_at[r] = time.time()
        traces = {r: trace_file.read_trace(self._trace(r), TAIL) for r in self.ranks}
        return NodeReport(self.node, self.host, traces, outcomes, failed_at)

    def _write(self, diag: Diagnosis, text: str) -> None:
        for r in self.ranks:
            jsonl = os.path.join(self.report_dir, f"rank{r}.collectives.jsonl")
            trace_file.export_jsonl(self._trace(r), jsonl)
        with open(os.path.join(self.report_dir, "report.json"), "w") as f:
            json.dump(diag.to_dict(), f, indent=2, default=str)
        with open(os.path.join(self.report_dir, "report.txt"), "w") as f:
            f.write(text + "\n")

    def _end(self, reason: str, diag: Diagnosis) -> None:
        """After the verdict: failing ranks go on to print their tracebacks (below the
        diagnosis); at a hang or a crash the others are ended, so torchrun tears the job down
        now rather than at the collective timeout."""
        self.exit_code = 1 if diag.faulty else 0
        with open(_diagnosed(self.report_dir), "w"):
            pass
        if reason == "end":
            return
        time.sleep(GRACE_S if reason == "crash" else 0)  # let the failing ones print
        for r, pid in self._pids.items():
            if pid != os.getpid() and not os.path.exists(_failed(self.report_dir, r)):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        if not os.path.exists(_failed(self.report_dir, self.ranks[0])):
            os._exit(1)

    def _set(self, key: str, value) -> None:
        self.store.set(self.prefix + key, pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL))


class _Store:
    """The job's store until it is lost (it goes with the first node's agent): from then on
    every call fails at once, rather than each leaving the client's warning on stderr."""

    def __init__(self, store) -> None:
        self._store, self.gone = store, False

    def __getattr__(self, name: str):
        method = getattr(self._store, name)

        def call(*args):
            if self.gone:
                raise ConnectionError("the job's store is gone")
            try:
                return method(*args)
            except dist.DistNetworkError:
                self.gone = True
                raise

        return call


def _failed(report_dir: str, rank: int) -> str:
    return os.path.join(report_dir, f"rank{rank}.failed")


def _ok(report_dir: str, rank: int) -> str:
    return os.path.join(report_dir, f"rank{rank}.ended")


def _diagnosed(report_dir: str) -> str:
    return os.path.join(report_dir, "job.diagnosed")


def _read(path: str, binary: bool = False):
    with contextlib.suppress(OSError), open(path, "rb" if binary else "r") as f:
        return f.read() or None
    return None


def _as_desync(diag: Diagnosis, traces: list[Trace | None]) -> Diagnosis:
    """A crash no comparison of records explains, where one rank broke its own pattern: a
    skip the backend aborted on, reported as the desync it is, the failures below it."""
    head = diag.findings[0] if diag.findings else None
    if diag.verdict != "crash" or head is None or head.kind not in ("raised", "crashed"):
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


def rank_failed(report_dir: str, rank: int):
    """The hook a failing rank calls before its traceback is printed (`RankJob.on_failure`):
    leave the failure for the node watchdog, and wait (bounded) for the job's diagnosis, so
    that it comes first."""

    def hook(report: tuple) -> None:
        _, error, tb, when, *_ = report
        _leave(_failed(report_dir, rank), (error, tb, when))
        end = time.monotonic() + 3 * ANSWER_S + GRACE_S
        while not os.path.exists(_diagnosed(report_dir)) and time.monotonic() < end:
            time.sleep(_POLL_S)

    return hook


def rank_ended(report_dir: str, rank: int, code, watch: NodeWatch | None) -> int:
    """In every rank whose script ended without raising (its `sys.exit` code, None or 0 when
    it returned): a non-zero code is a failure; the node watchdog's process waits for the
    job's verdict and exits 1 when it found a fault. The exit code to leave with."""
    if code not in (None, 0):
        why = f"exited with code {code}" if isinstance(code, int) else str(code)
        rank_failed(report_dir, rank)(("error", why, None, time.time()))
        code = code if isinstance(code, int) else 1
    else:
        _leave(_ok(report_dir, rank), None)
        code = 0
    if watch is not None:
        watch.finished.wait()
        code = code or watch.exit_code
    return code


def _leave(path: str, value) -> None:
    with open(path + ".tmp", "wb") as f:
        pickle.dump(value, f)
    os.replace(path + ".tmp", path)
