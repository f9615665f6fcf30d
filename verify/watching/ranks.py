"""What each rank was doing, in words: the part of a diagnosis that is not a comparison.

`instead` says what a rank that did not reach a collective is doing instead (dead, finished,
waiting elsewhere, outside any collective and where); `where` gives one line per rank for the
report; `failure_finding` and `stall_finding` explain a run that failed or stalled when no
collective mismatch does.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

from verify.watching import stacks
from verify.watching.findings import TraceFinding
from verify.watching.trace_file import Trace

if TYPE_CHECKING:
    from verify.launching.outcome import RankOutcome


def _ranks(ranks) -> str:
    return ",".join(str(r) for r in ranks)


# A collective that failed because a peer went away: an echo of what that peer did.
_ECHO = re.compile(r"closed by peer|reset by peer|remote worker|Broken pipe|did not take part")
# What a rank blocked inside torch's C++ is doing (`stacks.dump_in_torch`).
BLIND = "a collective torch issues itself, such as PyTorch DDP's reducer in backward"


def is_echo(error: str | None) -> bool:
    """Whether a rank's error says a peer closed its connection (gloo's "Connection closed
    by peer", a reset, a broken pipe): the peer's doing, not this rank's."""
    return bool(_ECHO.search(error or ""))


def instead(state: RankOutcome, trace: Trace | None, colls) -> tuple[str, str | None]:
    """What a rank that did not reach a collective is doing instead, and where."""
    last = trace.records[-1] if trace and trace.records else None
    pending = [r for r in (trace.records if trace else ()) if r.pending]
    if state.status == "crashed":
        after = f" after {last.describe()} {stacks.at(last.site)}" if last else ""
        return f"{state.error or 'crashed'}{after}", last.site if last else None
    if state.status == "error":
        where = stacks.traceback_site(state.traceback)
        return f"raised {state.error}" + (f" at {where}" if where else ""), where
    if state.status == "ok":
        return "returned without issuing it (its work finished)", None
    if pending:
        p = pending[-1]
        return f"is waiting in {p.describe()} {stacks.at(p.site)}", p.site
    frames = stacks.innermost_frames(state.stack) or None
    # The same words as its line in the report (`where`): inside torch's C++ a collective
    # the trace cannot see may be running.
    what = (
        f"is blocked inside torch's C++ ({BLIND})"
        if stacks.dump_in_torch(state.stack)
        else "is outside any collective"
    )
    if frames:
        return f"{what}, at {frames}", frames.split(" <- ")[0]
    return f"{what} (no stack was captured)", None


def left_early(root: RankOutcome, finished: list[RankOutcome]) -> TraceFinding | None:
    """`root` failed because a peer closed its connection (`is_echo`) while no rank crashed,
    and the ranks `finished` returned: they left while `root` was still in a collective with
    them (different numbers of steps on different ranks: uneven data, one rank running out
    of batches first). The first of them is the culprit; None when the failure is no echo
    or no rank finished."""
    if not finished or not is_echo(root.error):
        return None
    site = stacks.traceback_site(root.traceback)
    inside = f" inside torch's C++ ({BLIND})" if stacks.traceback_in_torch(root.traceback) else ""
    at = f" at {site}" if site else ""
    gone = _ranks(r.rank for r in finished)
    message = (
        f"rank {gone} left early: it finished while rank {root.rank} was still in a collective "
        f"with it{',' if inside else ''}{inside}{',' if inside and at else ''}{at} (the ranks ran different numbers of steps: uneven data, one rank "
        f"running out of batches first?); rank {root.rank} then raised {root.error}"
    )
    return TraceFinding("left early", finished[0].rank, message, None, site, None)


def failure_finding(root: RankOutcome, traces, now) -> TraceFinding:
    """A rank raised or died and no collective mismatch explains it."""
    trace = traces[root.rank] if root.rank < len(traces) else None
    waiting = []
    for t in traces:
        if t and t.rank != root.rank:
            waiting += [r for r in t.records if r.pending][-1:]
    doing = instead(root, trace, {})
    wait = f"; rank(s) {_ranks(sorted(t.rank for t in traces if t and t.rank != root.rank))} "
    if waiting:
        w = waiting[0]
        wait += f"were waiting in {w.describe()} {stacks.at(w.site)}"
        collective, site = w.describe(), w.site
    else:
        wait, collective, site = "", None, doing[1]
    kind = "raised" if root.status == "error" else "crashed"
    return TraceFinding(kind, root.rank, f"rank {root.rank} {doing[0]}{wait}", collective, site,
                   doing[1])  # fmt: skip


def stall_finding(ranks, traces) -> TraceFinding:
    """No rank progressed, yet the records agree: name who waits where and who is elsewhere."""
    waiting = {}
    for t in traces:
        pending = [r for r in t.records if r.pending] if t else []
        if pending:
            waiting[t.rank] = pending[-1]
    return _stalled_waiting(ranks, traces, waiting) if waiting else _stalled_blind(ranks)


def _stalled_waiting(ranks, traces, waiting: dict) -> TraceFinding:
    """A stall in which ranks wait in traced collectives (`waiting`: rank -> its last pending
    record): a rank that waits in none and did not finish is the culprit; else the rank that
    issued the latest (a send or recv: one its peer never matched)."""
    idle = [r for r in ranks if r.rank not in waiting and r.status not in ("ok",)]
    if idle:
        culprit = idle[0]
        doing = instead(culprit, traces[culprit.rank], {})
        w = next(iter(waiting.values()))
        message = (
            f"rank {culprit.rank} {doing[0]}, while rank(s) {_ranks(waiting)} wait in "
            f"{w.describe()} {stacks.at(w.site)}"
        )
        return TraceFinding("stuck outside collectives", culprit.rank, message, w.describe(), w.site,
                       doing[1])  # fmt: skip
    rank, w = max(waiting.items(), key=lambda kv: kv[1].t_issue)
    if w.p2p:
        message = (
            f"rank {rank} waits in {w.describe()} {stacks.at(w.site)}, which its peer never matched"
        )
    else:
        message = f"every rank waits in a collective and none progresses; rank {rank}: " + (
            f"{w.describe()} {stacks.at(w.site)}"
        )
    return TraceFinding("stalled", rank, message, w.describe(), w.site, w.site)


def _stalled_blind(ranks) -> TraceFinding:
    """A stall in which no traced collective is pending: the watchdog saw ranks blocked inside
    torch's C++ (a collective torch issues itself, such as PyTorch DDP's reducer's) while
    none worked. A rank parked elsewhere (a sleep, a lock) is the one they wait for; with
    none, ranks that finished left early, or ranks all still in `init_process_group` never
    met."""
    live = [r for r in ranks if r.status != "ok"]
    blocked = [r for r in live if stacks.dump_in_torch(r.stack)]
    parked = [r for r in live if r not in blocked]
    finished = [r for r in ranks if r.status == "ok"]
    blind = f"blocked inside torch's C++, where the trace is blind ({BLIND})"
    if blocked and finished and not parked:
        # Nobody parked: the ranks blocked inside torch wait for ranks that have finished
        # (their processes not gone yet, or gone without closing the connection).
        message = (
            f"rank {_ranks(r.rank for r in finished)} left early: it finished while "
            f"{_each_at(blocked)}: {blind}, still waits for it (the ranks ran "
            "different numbers of steps: uneven data, one rank running out of batches first?)"
        )
        return TraceFinding("left early", finished[0].rank, message)
    if parked and blocked:
        culprit = parked[0].rank
        message = (
            f"{_each_at(parked)}: parked outside any collective with no CPU "
            f"progress, while {_each_at(blocked)}: {blind}"
        )
    elif live and all(stacks.dump_in_rendezvous(r.stack) for r in live):
        # Every rank still inside init_process_group: they never met (a store at an address
        # no launcher hosts, another port or world size on some rank). torchrun's ranks, and
        # the tool's, meet at MASTER_ADDR:MASTER_PORT; with TORCHELASTIC_USE_AGENT_STORE set
        # no rank hosts a store of its own, so a tcp:// address of the script's waits forever.
        culprit = live[0].rank
        message = (
            "the ranks never met: every rank is still inside init_process_group, "
            f"{_each_at(live)}. Are they given one address, port and world "
            "size? Under torchrun (and this tool) ranks meet at MASTER_ADDR:MASTER_PORT with "
            "init_method='env://', the default: a tcp:// or file:// address of the script's "
            "own is not where they meet"
        )
    else:
        culprit = live[0].rank if live else 0
        message = (
            "no rank progressed or worked for the stall timeout, and none waits in a "
            f"collective the trace saw: {blind}; {_each_at(live)}"
        )
    return TraceFinding("stalled", culprit, message)


def _each_at(states: list[RankOutcome]) -> str:
    """`rank R at FRAMES; ...`: each rank with the innermost frames of its stack dump."""
    said = []
    for state in states:
        frames = stacks.innermost_frames(state.stack)
        said.append(f"rank {state.rank}" + (f" at {frames}" if frames else ""))
    return "; ".join(said)


def where(state: RankOutcome, trace: Trace | None, now: float) -> str:
    pending = [r for r in trace.records if r.pending] if trace else []
    last = trace.records[-1] if trace and trace.records else None
    n = len(trace.records) if trace else 0
    head = f"rank {state.rank} [{state.status}]"
    if state.status == "crashed":
        said = _last_words(state.stderr)
        return (
            f"{head}: {state.error}; last collective: "
            + (f"{last.describe()} {stacks.at(last.site)}" if last else "none")
            + (f"; its stderr ended with: {said}" if said else "")
        )
    if state.status == "error":
        site = stacks.traceback_site(state.traceback)
        return f"{head}: {state.error}" + (f" at {site}" if site else "")
    if pending:
        p = pending[-1]
        return f"{head}: waiting {now - p.t_issue:.1f}s in {p.describe()} {stacks.at(p.site)}"
    if state.status == "ok":
        return f"{head}: finished; {n} collective(s) traced"
    frames = stacks.innermost_frames(state.stack)
    # Inside torch's C++ (PyTorch DDP's reducer, say), a collective may be running untraced.
    what = (
        "blocked inside torch's C++"
        if stacks.dump_in_torch(state.stack)
        else "outside any collective"
    )
    return f"{head}: {what}" + (f", at {frames}" if frames else "")


def _last_words(stderr: str | None) -> str | None:
    """The backend's reason for killing a rank: the last stderr line that is not a log line."""
    if not stderr:
        return None
    lines = [ln.strip() for ln in stderr.splitlines() if ln.strip()]
    lines = [ln for ln in lines if not ln.startswith(("[I", "[W")) and "Warning" not in ln]
    return lines[-1][:300] if lines else None
