"""One cell of the certification matrix, as one rank runs it: an implementation trained under
one behaviour (`behaviours.py`), judged by one check.

The checks are the standalone ones, attached to the same trainer (`training/trainer.py`):

- *consistency*: `consistency.AuditHooks` (bitwise equal on every rank at every checkpoint);
- *equivalence*: `reference.Reference` (against one process on the global batch);
- *shard* (sharded optimizers): after training, each rank's optimizer-state bytes against
  the unsharded optimizer's (`check_shard_sizes`).

A behaviour the wrapper does not offer (no `no_sync()` for accumulation, no bucket size for
the bucket rows) is "not claimed", decided on the constructed wrapper by `ClaimHooks` on every
rank alike; one that does not apply at all (a sharded-optimizer row for a DDP wrapper) is
"n/a". Cells follow each other in one process (`matrix.py` runs many per launch): each builds
what it uses, seeds explicitly and restores torch's random state on return.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from impls.registry import Implementation, resolve, takes_bucket_size
from verify.checks.behaviours import Behaviour
from verify.checks.consistency import AuditHooks
from verify.checks.equivalence import merged
from verify.checks.memory import MemoryHooks
from verify.checks.reference import PLAYED, Reference
from verify.checks.sanitizing import training
from verify.checks.verdict import Finding, Refusal, collapse
from verify.hints import kinds
from verify.hints.table import Situation, situation_of, with_hints
from verify.launching import RankContext
from verify.training.hooks import Hooks
from verify.training.interface import InterfaceError
from verify.training.optim_state import local_state_bytes
from verify.training.plain_state import PlainState, unsharded_state
from verify.training.trainer import Trainer

CHECKS = ("consistency", "equivalence", "shard")
STATUSES = ("pass", "fail", "not claimed", "n/a", "refused", "timeout")


@dataclass(frozen=True)
class CellResult:
    """How one check went on one cell.

    `status` is "pass", "fail" (the check found a fault: wrong result, desync, a rank that
    raised, crashed or hung), "not claimed" (the implementation does not offer what the
    behaviour needs: no `no_sync()`, no bucket size), "n/a" (the check or the behaviour does
    not apply, or the tool could not measure), or "refused" (the class cannot be driven as
    the contract says: a usage error for the whole run), or "timeout" (its launch ran out of
    time before the cell could decide: no verdict). `detail` says why (the finding, the
    launcher's diagnosis of a failed run, or what is not claimed); `headline` is one line;
    `where` is the user's file:line when an exception was raised; `findings` what a failed
    cell found, typed, each with its hint (`hints/table.py`), in report order.
    """

    status: str
    detail: str = ""
    seconds: float = 0.0
    where: str | None = None
    findings: tuple[Finding, ...] = ()

    @property
    def failed(self) -> bool:
        return self.status == "fail"

    @property
    def headline(self) -> str:
        """The most telling line of `detail`: for a launch that failed, the collective trace's
        diagnosis when it has one (it names the mismatch), else the first line; with the
        place in the user's code where an exception was raised."""
        lines = self.detail.splitlines() or [""]
        traced = [line for line in lines if line.startswith(_TRACE_SAYS)]
        head = traced[0].removeprefix(_TRACE_SAYS).strip() if traced else lines[0]
        return f"{head} (at {self.where})" if self.where and self.where not in head else head


_TRACE_SAYS = "collective trace says:"  # how LaunchResult.summary() cites the diagnosis


def not_applicable(impl: Implementation, behaviour: Behaviour, check: str) -> str | None:
    """Why this check or behaviour does not apply to `impl` at all, or None if it does."""
    if behaviour.sharded_only and not impl.sharded:
        return "sharded optimizers only"
    if check == "shard" and not impl.sharded:
        return "not a sharded optimizer"
    if check == "shard" and behaviour.world_size == 1:
        return "one rank: nothing to shard"
    if behaviour.workload == "buffers" and impl.shards_parameters:
        return "parameters sharded: the workload reads fc1.weight outside fc1's forward"
    return None


def not_claimed(wrapped: nn.Module, behaviour: Behaviour) -> str | None:
    """Why the wrapper does not claim this behaviour, or None if it does."""
    if behaviour.accumulate > 1 and not hasattr(wrapped, "no_sync"):
        return "gradient accumulation: the wrapper has no no_sync()"
    if behaviour.bucket_mb is not None:
        cls = type(wrapped)
        if not issubclass(cls, nn.parallel.DistributedDataParallel) and not takes_bucket_size(cls):
            return "bucket sizes: the wrapper takes no bucket_size_mb (or bucket_cap_mb)"
    return None


class _NotClaimed(Exception):
    """Raised the same way on every rank (the wrapper's type is the same everywhere)."""


class ClaimHooks(Hooks):
    def __init__(self, behaviour: Behaviour) -> None:
        self.behaviour = behaviour

    def after_build(self, run: Trainer) -> None:
        why = not_claimed(run.wrapped, self.behaviour)
        if why:
            raise _NotClaimed(why)


def run_cell_on_rank(
    ctx: RankContext,
    impl_name: str,
    behaviour: Behaviour,
    check: str,
    same_init: bool = False,
    sanitize: bool = False,
) -> CellResult | Refusal:
    """Run one check of one cell on this rank (a collective: every rank, same arguments).
    Every rank returns the same result, except a `Refusal`, which this rank reached alone. With
    `sanitize`, the race sanitizer's findings (this rank's) fail the cell too
    (`sanitizing.py`)."""
    impl = resolve(impl_name)
    why = not_applicable(impl, behaviour, check)
    if why:
        return CellResult("n/a", why)
    spec = behaviour.spec(impl_name, same_init=same_init)
    devices = [ctx.device.index or 0] if ctx.device.type == "cuda" else []
    judge = _JUDGES[check]() if check in _JUDGES else None
    hooks = [ClaimHooks(behaviour)] + ([judge] if judge is not None else [])
    guard = None
    with torch.random.fork_rng(devices=devices):
        try:
            with training(ctx, spec, hooks, sanitize=sanitize) as (trainer, guard):
                trainer.run()
        except _NotClaimed as exc:
            return CellResult("not claimed", str(exc))
        except InterfaceError as exc:  # this rank's own decision: the matrix has ranks agree
            return Refusal.of(exc, ctx.rank)
        situation = situation_of(behaviour)
        if check == "consistency":
            return _consistency(judge, guard, situation)
        if check == "equivalence":
            return _equivalence(merged(ctx, judge, guard, spec), situation)
        return _shard(ctx, trainer, guard, situation)


# the hooks that judge a check as the trainer runs (the shard check judges after it, alone)
_JUDGES = {"consistency": AuditHooks, "equivalence": Reference}


def _consistency(judge: AuditHooks, guard, situation: Situation) -> CellResult:
    """The consistency cell from its audit (and the race sanitizer's `guard`, if it ran)."""
    report = judge.report(guard)
    if report.findings:
        found = with_hints(collapse(list(report.findings)), situation)
        return CellResult("fail", _findings_text(report.findings), findings=found)
    n = len(report.checkpoints)
    empty = f"; {report.untrained}" if report.untrained else ""
    return CellResult("pass", f"replicas bitwise identical at all {n} checkpoints{empty}")


def _equivalence(report, situation: Situation) -> CellResult:
    """The equivalence cell from every rank's comparisons, merged (`equivalence.merged`)."""
    # How the round trip played the class's checkpoint: why it passed or failed.
    played = [n for n in report.notes if n.startswith(PLAYED)]
    if report.findings:
        more = [f.describe() for f in report.findings[1:]]
        found = with_hints(report.findings, situation)
        detail = "\n".join([report.describe(), *more, *played])
        return CellResult("fail", detail, findings=found)
    return CellResult("pass", "\n".join([report.describe(), *played]))


def _shard(ctx: RankContext, trainer: Trainer, guard, situation: Situation) -> CellResult:
    """The shard cell, a collective once training has ended: the race sanitizer's findings
    first; then for parameters sharded too, each kind of memory per rung (`MemoryHooks`);
    else the optimizer state's bytes on each rank (`check_shard_sizes`)."""
    races = guard.findings if guard is not None else []
    if races:
        return CellResult("fail", _findings_text(races), findings=with_hints(races, situation))
    if hasattr(trainer.wrapped, "full_parameters"):  # parameters sharded too: per rung
        memory = MemoryHooks().snapshot(trainer)
        # A failure names the kinds that are not sharded, the rest only when all pass.
        detail = "; ".join(memory.failures or [k.describe() for k in memory.kinds])
        found = with_hints(_not_sharded(memory), situation)
        return CellResult("fail" if memory.failures else "pass", detail, findings=found)
    return check_shard_sizes(trainer.model, trainer.optimizer, ctx.world_size)


def _not_sharded(memory) -> tuple[Finding, ...]:
    """Each kind of memory the rung promised to shard and did not, as a finding."""
    return tuple(
        Finding(
            "shard",
            "run",
            0,
            f"{k.describe()}: not sharded",
            kind=kinds.STATE_NOT_SHARDED if k.kind == "state" else kinds.NOT_SHARDED,
            numbers={"what": k.kind, "ratios": list(k.ratios)},
        )  # fmt: skip
        for k in memory.kinds
        if k.kind in memory.promised and not k.sharded
    )


def _findings_text(findings) -> str:
    lines = [f.describe() for f in findings]
    if len(lines) > 1:
        more = len(lines) - 1
        lines[0] += f" (and {more} more distinct finding{'s' if more > 1 else ''})"
    return "\n".join(lines)


# --- the shard check -----------------------------------------------------------------------


def check_shard_sizes(model: nn.Module, optimizer, world_size: int) -> CellResult:
    """Is each rank's optimizer state about 1/N of the unsharded optimizer's? A collective.

    Each rank's state is measured without guessing where the optimizer keeps it: every tensor
    reachable from the optimizer object that is neither a parameter nor a gradient
    (`training/optim_state.py`). The unsharded size is measured too: a plain AdamW stepped
    once on copies of the parameters that hold state on some rank (all of them when the
    state is not keyed by parameter, as with slices). The ranks exchange one fixed summary
    each (bytes, scalar bytes, owners, note, and where a rank holds its own state twice),
    whatever their shards' shapes; `shard_verdict` judges it, the same on every rank, and
    `_copies_named` says so when the excess is such a second copy.

    When the tool cannot measure (a note from the probe on some rank), the cell is "n/a" with
    the reason: a failure of the tool's own probe never reads as the optimizer's.
    """
    params = [p for p in model.parameters() if p.requires_grad]
    measured = local_state_bytes(optimizer, params)
    summary = (measured.bytes, measured.scalar_bytes, measured.owners, measured.note)
    gathered: list = [None] * world_size
    dist.all_gather_object(gathered, (*summary, (measured.copy, measured.copy_bytes)))
    notes = [note for *_, note, _ in gathered if note]
    if notes and not any(b for b, *_ in gathered):
        return CellResult("n/a", f"the tool could not measure the optimizer state: {notes[0]}")
    owned = [o for _, _, o, _, _ in gathered]
    if any(o is None for o in owned):  # state not keyed by parameter: count every parameter
        held = list(range(len(params)))
    else:
        held = sorted({i for o in owned for i in o})
    plain = unsharded_state([params[i] for i in held])
    verdict = shard_verdict([(b, s) for b, s, *_ in gathered], plain)
    return _copies_named(verdict, owned, [c for *_, c in gathered], world_size)


def _copies_named(verdict: CellResult, owned: list, copies: list, world_size: int) -> CellResult:
    """A "several ranks" failure told apart: when no parameter's state is held by two ranks,
    and the second copies some rank holds of its own (`StateBytes.copy`, `copy_bytes`) make
    up the whole excess over one copy, the state is sharded and the excess is those copies:
    said so, with two places one of them lives."""
    not_shared = all(o is not None for o in owned) and sum(map(len, owned)) == len(
        {i for o in owned for i in o}
    )
    twice = [(r, paths) for r, (paths, _) in enumerate(copies) if paths]
    found = verdict.findings[0] if verdict.findings else None
    if not (found and found.kind == kinds.STATE_NOT_SHARDED and not_shared and twice):
        return verdict
    excess = sum(found.numbers["bytes_per_rank"]) - found.numbers["one_copy"]
    if sum(n for _, n in copies) < excess:  # the copies found do not explain it
        return verdict
    (rank, (one, other)), more = twice[0], len(twice) - 1
    also = f" (and {more} more rank{'s' if more > 1 else ''})" if more else ""
    detail = verdict.detail.split(": ", 1)[1]
    message = (
        f"state held twice on a rank: every parameter's state is on one rank only, but rank "
        f"{rank}{also} keeps a second copy of its own, at {one} and at {other}: {detail}"
    )
    copy = Finding(
        "shard", "run", 0, message, kind=kinds.STATE_COPIED, numbers=dict(found.numbers or {})
    )
    return CellResult("fail", message, findings=with_hints([copy], Situation(world_size)))


def shard_verdict(per_rank: list[tuple[int, int]], plain: list[PlainState]) -> CellResult:
    """Judge each rank's (state bytes, scalar bytes of them) against the unsharded state.

    Scalars are set apart on both sides: a rank keeps one `step` per shard it holds, so a
    layout that gives every rank a slice of every parameter (DeepSpeed, FSDP) holds N copies
    of them, a whole-parameter partition one; they are O(parameters) bytes, say how many
    shards a rank holds rather than how much state, and are reported, not judged. What is
    judged is the vector state V_r of rank r (AdamW's moments), against the unsharded V =
    sum of v_p over the parameters p, with w_p the bytes of p's state per element (8 for
    AdamW in float32). Two conditions, both sound for any correct layout (whole parameters,
    slices, a flat buffer cut in N, or a mix):

    - one copy: sum_r V_r <= V + (N - 1) x sum_p w_p. A layout that pads a parameter to a
      multiple of N adds fewer than N elements of it in all (a slice is ceil(n/N) elements);
      without padding the sum is V exactly. An optimizer that does not shard holds N x V,
      over the limit as soon as one parameter has more than one element;
    - balance: max_r V_r <= (2 - 1/N) x B + sum_p w_p, where B = max(ceil(V/N), max_p v_p)
      is a lower bound on the largest rank of any partition into whole parameters. Greedy
      list scheduling (each parameter to the least-loaded rank, in any order: PyTorch's
      ZeroRedundancyOptimizer) never exceeds (2 - 1/N) x B (Graham, 1966); LPT (the built-in
      ZeRO-1) stays within 4/3 of optimal. Slices hold at most V/N + sum_p w_p (one element
      of padding per parameter), under the same limit; cutting pieces finer only helps.
    """
    world_size = len(per_rank)
    vector = [b - s for b, s in per_rank]
    total = sum(p.vector_bytes for p in plain)
    largest = max((p.vector_bytes for p in plain), default=0)
    padding = sum(p.element_bytes for p in plain)  # one element of every parameter's state
    bound = max(-(-total // world_size), largest)
    limit = (2 - 1 / world_size) * bound + padding
    copies = total + (world_size - 1) * padding
    scalars = [s for _, s in per_rank]
    detail = (
        f"state bytes per rank {vector} vs unsharded {total}, step scalars apart "
        f"(one copy <= {copies}; 1/N bound {bound}, limit {limit:.0f}; "
        f"scalars per rank {scalars} vs {sum(p.scalar_bytes for p in plain)} unsharded)"
    )
    numbers = {"bytes_per_rank": vector, "unsharded": total, "one_copy": copies,
               "limit": limit}  # fmt: skip
    if sum(vector) > copies:
        message = f"state kept on several ranks: {detail}"
        found = Finding("shard", "run", 0, message, kind=kinds.STATE_NOT_SHARDED, numbers=numbers)
        return CellResult("fail", message, findings=with_hints([found], Situation(world_size)))
    if max(vector) > limit:
        message = f"unbalanced: {detail}"
        found = Finding("shard", "run", 0, message, kind=kinds.STATE_UNBALANCED, numbers=numbers)
        return CellResult("fail", message, findings=(found,))
    share = max(vector) / bound if bound else 0.0
    return CellResult("pass", f"max {share:.2f} x the 1/N bound: {detail}")
