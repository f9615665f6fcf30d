"""Bitwise replica audit of a class: are parameters, buffers, gradients and optimizer state
identical on every rank at each checkpoint? Decided by the replica audit's one comparison
(`verify/replica_audit/compare.py`, through its one `Auditor`), which exchanges per-tensor
fingerprints, not tensors: at steady state one all-reduce of fixed size, per-rank detail only
where the ranks disagree.

What is a class's and not a script's: the tensors are named by the model (`param:`,
`buffer:`, `grad:`, `optim:`), keyed by name alone, so that a gradient that is None on some
ranks, or a tensor of another dtype or shape, is a finding of that tensor (`how`: "missing",
"shape"); a name that only some ranks hold (optimizer state for a parameter that got a
gradient on one rank only) is one too ("absent"), and the tensors every rank holds are
compared all the same, where a script's audit reports the layout and stops.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist
from torch import nn

from verify.hints import kinds
from verify.replica_audit.compare import Auditor, Entry
from verify.replica_audit.finding import TensorDiff, rank_list
from verify.replica_audit.fingerprint import text_bits
from verify.replica_audit.group import WorldGroup, gather_whole_texts
from verify.replica_audit.measure import common_scale

__all__ = ["Checkpoint", "ModelAudit", "TensorDiff", "measured", "unique_names"]


@dataclass(frozen=True)
class Checkpoint:
    """What one audit looked at and how long it took."""

    label: str
    tensors: int
    mismatched: int
    seconds: float


class ModelAudit:
    """Audits named tensors of a model (and optionally a replicated optimizer's state).

    Collective: `audit` must be called on all ranks at the same checkpoints with the same
    tensor names, or it hangs.

    Args:
        model: the *unwrapped* model (names are its `named_parameters()` names).
        optimizer: a replicated optimizer whose state should be identical on every rank, or
            None (sharded optimizers keep different state per rank by design).
        process_group: the group whose ranks are compared.
        max_detail: at most this many mismatched tensors are measured for a detailed report.
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer | None = None,
        *,
        process_group: dist.ProcessGroup | None = None,
        max_detail: int = 8,
    ) -> None:
        self.model = model
        self.optimizer = optimizer
        self.group = WorldGroup(process_group)
        self.process_group = self.group.process_group
        self.world_size = self.group.size
        self.param_names = {id(p): n for n, p in model.named_parameters()}
        self.auditor = Auditor(self.group, max_detail=max_detail, per_phase=max_detail)

    def follow(self, model: nn.Module, optimizer: torch.optim.Optimizer | None) -> None:
        """Audit `model` from now on, and `optimizer` when this auditor audits one (both
        rebuilt by a state_dict round trip)."""
        self.model = model
        self.param_names = {id(p): n for n, p in model.named_parameters()}
        if self.optimizer is not None:
            self.optimizer = optimizer

    def state_tensors(self) -> list[tuple[str, torch.Tensor | None]]:
        """Parameters, buffers and replicated optimizer state, by name."""
        named = [(f"param:{n}", p) for n, p in self.model.named_parameters()]
        named += [(f"buffer:{n}", b) for n, b in self.model.named_buffers()]
        if self.optimizer is not None:
            for param, state in self.optimizer.state.items():
                name = self.param_names.get(id(param), "?")
                for key in sorted(state):
                    value = state[key]
                    if not isinstance(value, torch.Tensor):
                        value = torch.tensor(value)
                    named.append((f"optim:{name}.{key}", value))
        return named

    def grad_tensors(self) -> list[tuple[str, torch.Tensor | None]]:
        """Gradients of trainable parameters, by name (None where a rank has no gradient)."""
        return [(f"grad:{n}", p.grad) for n, p in self.model.named_parameters() if p.requires_grad]

    def audit(
        self,
        label: str,
        named: list[tuple[str, torch.Tensor | None]],
        *,
        step: int = 0,
        phase: str = "",
    ) -> tuple[Checkpoint, list[TensorDiff]]:
        """Compare `named` tensors across ranks at checkpoint `label` (of `step`, in `phase`:
        "gradients", "step", ...); every rank returns the same answer.

        The tool's own collectives never depend on what a rank holds: when the ranks hold
        different names, they agree on the names first (a tensor some ranks hold and others
        do not is a mismatch of its own), then compare the tensors every rank holds."""
        if self.world_size > 1:
            # Ranks arrive at different times; the timer must not count waiting for the slowest.
            dist.barrier(group=self.process_group)
        start = time.perf_counter()
        if self.world_size == 1:
            return Checkpoint(label, len(named), 0, time.perf_counter() - start), []
        entries = [
            Entry(n.split(":", 1)[0], n, tensor=t, typed_key=False) for n, t in unique_names(named)
        ]
        where = (0, step, text_bits(phase or label))
        outcome, absent = self.auditor.check(entries, where), []
        if outcome.layout:  # names some ranks hold and others do not, or in another order
            entries, absent = self._common(label, entries)
            outcome = self.auditor.check(entries, where)
            if outcome.layout:  # never: the ranks now hold the same names in one order
                raise RuntimeError(f"the replica audit at {label}: {outcome.layout}")
        found = absent + [
            replace(outcome.diffs.get(i) or outcome.undescribed[i], at=label)
            for i in outcome.mismatched
        ]
        seconds = time.perf_counter() - start
        return Checkpoint(label, len(entries) + len(absent), len(found), seconds), found

    def _common(self, label: str, entries: list[Entry]) -> tuple[list[Entry], list[TensorDiff]]:
        """The entries every rank holds, in rank 0's order (an optimizer's state is in the
        order its parameters first stepped, which can differ by rank), and a mismatch for
        each name held by some ranks only (every rank's names gathered: only once the ranks
        found they differ)."""
        # (one name a line: a name is a tensor's key, which holds no line break)
        texts = gather_whole_texts(self.group, "\n".join(e.name for e in entries))
        every = [t.split("\n") if t else [] for t in texts]
        held = [set(n) for n in every]
        common = set.intersection(*held)
        absent = []
        for name in dict.fromkeys(n for ns in every for n in ns):
            if name in common:
                continue
            have = [r for r in range(self.world_size) if name in held[r]]
            lack = [r for r in range(self.world_size) if name not in held[r]]
            # The odd ranks out are the minority; on a tie, the ranks that hold it.
            differ = tuple(have if len(have) <= len(lack) else lack)
            reference = next(r for r in range(self.world_size) if r not in differ)
            counts = ", ".join(f"rank {r}: {len(every[r])}" for r in range(self.world_size))
            detail = (
                f"held on rank{'s' if len(have) > 1 else ''} {rank_list(have)} only, not on "
                f"rank{'s' if len(lack) > 1 else ''} {rank_list(lack)} (tensors held: {counts})"
            )
            absent.append(
                TensorDiff(name, differ, reference, how="absent", detail=detail, at=label)
            )
        mine = {e.name: e for e in entries}
        return [mine[n] for n in every[0] if n in common], absent


_DIFFER = {"grad": kinds.GRADIENTS_DIFFER, "param": kinds.PARAMETERS_DIFFER,
           "buffer": kinds.BUFFERS_DIFFER, "optim": kinds.STATE_DIFFERS}  # fmt: skip


def measured(found: list[TensorDiff], phase: str, step: int) -> tuple[str, dict]:
    """A checkpoint's differences as a finding's kind and numbers (`hints/kinds.py`): what differs
    (by the first tensor's prefix), how, and the one factor every differing tensor is of the
    reference rank's, when there is one."""
    first = found[0]
    prefix = first.name.split(":", 1)[0]
    numbers = {
        "step": step, "phase": phase, "tensors": len(found), "how": first.how,
        "ranks": list(first.ranks), "reference_rank": first.reference_rank,
        "scale": common_scale(m.scale for m in found),
    }  # fmt: skip
    if any(m.moved for m in found):
        return kinds.VALUES_MOVED, numbers
    if phase == "construction":
        return kinds.NOT_BROADCAST, {**numbers, "buffers_only": prefix == "buffer"}
    if prefix == "optim" and first.how == "absent":
        return kinds.STATE_ON_SOME, numbers
    return _DIFFER.get(prefix, kinds.STATE_DIFFERS), numbers


def unique_names(named: list[tuple[str, torch.Tensor | None]]) -> list:
    """`named` with every name made unique by its occurrence (`optim:?.step #2`: the state of
    a parameter the model does not name), so that the ranks can match tensors by name."""
    seen: dict[str, int] = {}
    out = []
    for name, t in named:
        seen[name] = seen.get(name, 0) + 1
        out.append((name if seen[name] == 1 else f"{name} #{seen[name]}", t))
    return out
