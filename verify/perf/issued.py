"""Which collectives a step issued, by kind, and in which phase: read from the dispatcher.

The backend's ranges (`gloo:<op>` on gloo's worker threads) say when a collective is on the
wire, but not always which collective the code called: gloo runs a reduce-scatter
(`dist.reduce_scatter_tensor`) as an all-reduce of the whole input buffer, each rank then
keeping its part, so its range reads `gloo:all_reduce` with the input's full size. The
dispatcher's operator on the thread that issued it (`c10d::_reduce_scatter_base_`) names the
call. This module counts those operators (`c10d::` and functional `_c10d_functional::`), each
under the phase range of the trainer (`forward`, `backward`, `grad_sync`, `optimizer_step`;
`traces.PHASES`) that was open when it started, `other` outside them. A trace of ZeRO-3 or
FSDP2 then says how many all-gathers ran in forward and in backward, and where the
reduce-scatters were issued: beside which compute.

Operators from any thread count (on a GPU autograd runs gradient hooks on a thread of its
own); the phase is found by time, from the training thread's ranges. Waits (`wait_tensor`)
are not collectives and are not counted.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

OTHER = "other"
_PREFIXES = ("c10d::", "_c10d_functional::", "c10d_functional::")
# the operator's name without its namespace and underscores -> the collective it is
_KINDS = (
    ("allgather", "all_gather"),
    ("reducescatter", "reduce_scatter"),
    ("allreduce", "all_reduce"),
    ("broadcast", "broadcast"),
    ("alltoall", "all_to_all"),
    ("monitoredbarrier", "barrier"),
)
_NOT_COLLECTIVES = ("wait", "waittensor")


def kind(op_name: str) -> str | None:
    """The collective a dispatcher operator issues (`c10d::_allgather_base_` -> `all_gather`,
    `c10d::_reduce_scatter_base_` -> `reduce_scatter`); its bare name for a collective without
    a family here (`barrier`, `send`); None for anything that is not a collective."""
    prefix = next((p for p in _PREFIXES if op_name.startswith(p)), None)
    if prefix is None:
        return None
    core = op_name[len(prefix) :].replace("_", "").lower()
    if core in _NOT_COLLECTIVES:
        return None
    return next((k for start, k in _KINDS if core.startswith(start)), core)


def count(
    events: Iterable[dict], phases: Sequence[tuple[str, float, float]], lo: float, hi: float
) -> dict[str, dict[str, int]]:
    """{kind: {phase: operators}} of the collective operators starting in [lo, hi); `phases`
    are (name, start, end) of the training thread's phase ranges."""
    out: dict[str, dict[str, int]] = {}
    for e in events:
        k = kind(e["name"])
        if k is None or not lo <= e["ts"] < hi:
            continue
        phase = next((name for name, s, end in phases if s <= e["ts"] < end), OTHER)
        per_phase = out.setdefault(k, {})
        per_phase[phase] = per_phase.get(phase, 0) + 1
    return out


def mean(counts: Sequence[dict[str, dict[str, int]]]) -> dict[str, dict[str, float]]:
    """Counts per step averaged over `counts` (steps of every rank), kinds and phases absent
    from a step counting 0 there."""
    total: dict[str, dict[str, float]] = {}
    for c in counts:
        for k, per_phase in c.items():
            for phase, n in per_phase.items():
                total.setdefault(k, {})[phase] = total.get(k, {}).get(phase, 0) + n
    n = max(len(counts), 1)
    return {k: {p: v / n for p, v in per_phase.items()} for k, per_phase in total.items()}
