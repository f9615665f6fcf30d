"""Bitwise replica audit: are parameters, buffers, gradients and optimizer state identical on
every rank? Decided by exchanging per-tensor fingerprints, not tensors.

Each tensor's fingerprint is the replica audit's one (`verify/replica_audit/fingerprint.py`):
three int64 values (dtype-and-shape code, word sum, position-weighted sum) from the tensor's
raw bits, so one ULP anywhere, moved values and exactly cancelling changes are caught.

The ranks agree first on which tensors they hold (one fixed-size reduction of a count and a
digest of the names; the names are gathered only when they differ), then take the min and the
max of every fingerprint over the ranks (the engine's one agreement reduction,
`verify/replica_audit/group.py`: one all-reduce, whose size does not grow with the world
size): equal means every rank holds the same bits. Only for the tensors that mismatch
do they gather every rank's fingerprint (to find the majority value), and for at most
`max_detail` of those the tensor itself, to say which ranks differ, by how much, in how many
elements, and where first.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from verify.checks import kinds
from verify.replica_audit.finding import TensorDiff
from verify.replica_audit.fingerprint import MISSING, fingerprint, fingerprint_table, text_bits
from verify.replica_audit.group import WorldGroup, agree, comm_device, min_max, who_differs
from verify.replica_audit.measure import common_scale, elements, fitted_scale
from verify.replica_audit.measure import unequal as unequal_elements

# `fingerprint`, `min_max` and `comm_device` are the engine's (`verify/replica_audit/`),
# named here too for the callers that import them from the audit.
__all__ = ["Auditor", "Checkpoint", "TensorDiff", "comm_device", "fingerprint", "min_max"]

MOVED = (
    "the fingerprints differed, but the values gathered right after are equal on every rank: "
    "they changed between the two reads, so a collective on this tensor was still in flight "
    "(a race: run with --sanitize, the default unless --no-sanitize, to name it)"
)


@dataclass(frozen=True)
class Checkpoint:
    """What one audit looked at and how long it took."""

    label: str
    tensors: int
    mismatched: int
    seconds: float


class Auditor:
    """Audits named tensors of a model (and optionally a replicated optimizer's state).

    Collective: `audit` must be called on all ranks at the same checkpoints with the same
    tensor names, or it hangs.

    Args:
        model: the *unwrapped* model (names are its `named_parameters()` names).
        optimizer: a replicated optimizer whose state should be identical on every rank, or
            None (sharded optimizers keep different state per rank by design).
        process_group: the group whose ranks are compared.
        max_detail: at most this many mismatched tensors are gathered for a detailed report.
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
        self.process_group = process_group if process_group is not None else dist.group.WORLD
        self.world_size = dist.get_world_size(self.process_group)
        self.max_detail = max_detail
        self.param_names = {id(p): n for n, p in model.named_parameters()}

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
        self, label: str, named: list[tuple[str, torch.Tensor | None]]
    ) -> tuple[Checkpoint, list[TensorDiff]]:
        """Compare `named` tensors across ranks; every rank returns the same answer.

        The tool's own collectives never depend on what a rank holds: the ranks first agree
        on the names (a tensor some ranks hold and others do not, such as optimizer state
        for a parameter that got a gradient on one rank only, is a mismatch of its own),
        then compare the fingerprints of the names every rank holds."""
        if self.world_size > 1:
            # Ranks arrive at different times; the timer must not count waiting for the slowest.
            dist.barrier(group=self.process_group)
        start = time.perf_counter()
        if self.world_size == 1:
            return Checkpoint(label, len(named), 0, time.perf_counter() - start), []
        named, absent = self._common(label, named)
        device = comm_device(self.process_group)
        # One table on the device, copied to the host once: a copy per tensor is a GPU sync each.
        local = fingerprint_table([t for _, t in named], device)
        low, high = min_max(local, self.process_group)
        bad = [i for i in range(len(named)) if not bool((low[i] == high[i]).all())]
        seen = who_differs(WorldGroup(self.process_group), local[bad])  # after a mismatch
        mismatches = absent + [
            self._explain(label, named[i], *seen[k], detailed=k < self.max_detail)
            for k, i in enumerate(bad)
        ]
        seconds = time.perf_counter() - start
        return Checkpoint(label, len(named) + len(absent), len(mismatches), seconds), mismatches

    def _common(self, label: str, named: list) -> tuple[list, list[TensorDiff]]:
        """The tensors every rank holds, in rank 0's order, and a mismatch for each name
        held by some ranks only. One fixed-size reduction when the names agree (the usual
        case); the names themselves are gathered only when they do not."""
        names = [n for n, _ in named]
        # The names' digest is the script audit's digest of its keys (`text_bits`).
        if all(agree([len(names), text_bits("\0".join(names))], self.process_group)):
            return named, []
        every: list = [None] * self.world_size
        dist.all_gather_object(every, names, group=self.process_group)
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
                f"held on rank{'s' if len(have) > 1 else ''} {_list(have)} only, not on "
                f"rank{'s' if len(lack) > 1 else ''} {_list(lack)} (tensors held: {counts})"
            )
            absent.append(
                TensorDiff(name, differ, reference, how="absent", detail=detail, at=label)
            )
        return [(n, t) for n, t in named if n in common], absent

    def _explain(
        self,
        label: str,
        item: tuple[str, torch.Tensor | None],
        reference: int,
        differ: tuple[int, ...],
        keys: list[tuple],
        *,
        detailed: bool,
    ) -> TensorDiff:
        """What one disagreeing tensor is: missing or a different dtype or shape on some
        ranks (from every rank's fingerprint, `keys`), else, when `detailed`, measured."""
        name, tensor = item
        missing = [r for r in range(len(keys)) if keys[r][0] == MISSING]
        if missing:
            s = "s" if len(missing) > 1 else ""
            detail = f"the tensor is None on rank{s} {missing}"
            return TensorDiff(name, differ, reference, how="missing", detail=detail, at=label)
        if len({k[0] for k in keys}) > 1:
            detail = "dtype or shape differs between ranks"
            return TensorDiff(name, differ, reference, how="shape", detail=detail, at=label)
        if not detailed:
            return TensorDiff(name, differ, reference, at=label)
        return compare_gathered(label, name, tensor, differ, reference, self.process_group)


def compare_gathered(label, name, tensor, differ, reference, process_group) -> TensorDiff:
    """Gather `tensor` from every rank and measure how the differing ranks differ from the
    reference rank's (`measure.py`): the largest difference on any of them, the elements that
    differ on at least one, the first of those, and the one factor they all are of it."""
    device = comm_device(process_group)
    t = tensor.detach().contiguous().to(device)
    copies = [torch.empty_like(t) for _ in range(dist.get_world_size(process_group))]
    dist.all_gather(copies, t, group=process_group)
    ref = elements(copies[reference])
    differs = torch.zeros(ref.numel(), dtype=torch.bool)
    worst = 0.0
    scales = []
    for r in differ:
        other = elements(copies[r])
        mask, largest = unequal_elements(ref, other)
        differs |= mask
        worst = max(worst, largest)
        scales.append(fitted_scale(other, ref))
    if not differs.any():
        # What differed a moment ago is equal now: a collective on it was still in flight when
        # the fingerprint was taken (a race), and has landed since. No number to report.
        return TensorDiff(name, differ, reference, detail=MOVED, moved=True, at=label)
    first = int(differs.nonzero()[0])
    shape = tuple(copies[reference].shape)
    if copies[reference].is_complex():
        shape = (*shape, 2)
    index = tuple(int(i) for i in torch.unravel_index(torch.tensor(first), shape)) if shape else ()
    return TensorDiff(
        name, differ, reference, max_abs_diff=worst, differing=int(differs.sum()),
        numel=ref.numel(), first_index=index, scale=common_scale(scales), at=label,
    )  # fmt: skip


_DIFFER = {"grad": kinds.GRADIENTS_DIFFER, "param": kinds.PARAMETERS_DIFFER,
           "buffer": kinds.BUFFERS_DIFFER, "optim": kinds.STATE_DIFFERS}  # fmt: skip


def measured(found: list[TensorDiff], phase: str, step: int) -> tuple[str, dict]:
    """A checkpoint's differences as a finding's kind and numbers (`kinds.py`): what differs
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


def _list(ranks: list[int]) -> str:
    return ", ".join(map(str, ranks))
