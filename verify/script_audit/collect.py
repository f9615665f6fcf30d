"""What is meant to be replicated at an optimizer step, as named entries.

An `Entry` (the replica audit's, `verify/replica_audit/compare.py`) is one thing every rank
should hold bitwise alike: a tensor (compared by its fingerprint) or a setting (a number or
a string, compared exactly). Its `key` (name, dtype, shape) is what the ranks first agree
on: the ranks compare values only once they hold the same list of keys.

Sharded tensors are never compared across ranks: a `DTensor` (FSDP2, tensor parallelism) is
compared only when every placement is `Replicate()` (its local tensor is then the whole
value); any other placement is counted as sharded and skipped. `ZeroRedundancyOptimizer`
keeps its state in a local optimizer over this rank's shard: its steps run nested inside the
outer step and are not audited (`hooks.py`), and the outer optimizer holds no state (its
local state is counted, `local_shard`). State that a plain optimizer keeps on some ranks
only is sorted out by `owners.py`.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable

import torch
from torch import nn

from verify.replica_audit.compare import Entry
from verify.script_audit import report
from verify.script_audit.naming import Modules, strip


class Collector:
    """Builds the entries of each phase for one optimizer; counts the sharded tensors it
    skipped (`sharded`, reset by the caller)."""

    def __init__(self, modules: Modules) -> None:
        self.modules = modules
        self.sharded = 0

    def params(self, opt: torch.optim.Optimizer) -> list[tuple[str, torch.Tensor]]:
        """(qualified name, parameter) for every parameter of the optimizer, group by group,
        each group's in the order the model names them (`Modules.place_of`), the parameters
        no module owns after them in the group's order. Not in the group's own order: an
        optimizer built over a Python set (`Lion(set(model.parameters()) - frozen)`) lists
        them in each process's hash order, and the same parameters are the same entries
        whatever order a rank lists them in. Where that order changes the numbers (a flat
        buffer packed in it), the tensors themselves differ."""
        out = []
        for g, group in enumerate(opt.param_groups):
            names = [self.modules.name_of(p) for p in group["params"]]  # (may rebuild them)
            places = [self.modules.place_of(p) for p in group["params"]]
            order = sorted(range(len(names)), key=lambda i: (0, places[i]) if names[i] else (1, i))
            out += [(names[i] or f"param_groups[{g}][{i}]", group["params"][i]) for i in order]
        return out

    def tensors(self, phase: str, named: Iterable[tuple[str, torch.Tensor | None]]) -> list[Entry]:
        entries = []
        for name, t in named:
            local = self.replicated(t)
            if local is not None or t is None:
                entries.append(Entry(phase, name, tensor=local))
        return entries

    def replicated(self, t: torch.Tensor | None) -> torch.Tensor | None:
        """The tensor to compare, or None when there is none or it is sharded."""
        if t is None:
            return None
        if type(t).__name__ == "DTensor":
            from torch.distributed.tensor import Replicate

            if all(isinstance(p, Replicate) for p in t.placements):
                return t.to_local()
            self.sharded += 1
            return None
        return t

    def gradients(self, opt: torch.optim.Optimizer) -> list[Entry]:
        return self.tensors(report.GRADS, ((n, p.grad) for n, p in self.params(opt)))

    def parameters(self, opt: torch.optim.Optimizer, phase: str) -> list[Entry]:
        return self.tensors(phase, self.params(opt))

    def state(self, opt: torch.optim.Optimizer) -> list[Entry]:
        return [e for entries in self.state_by_param(opt) for e in entries]

    def state_by_param(self, opt: torch.optim.Optimizer) -> list[list[Entry]]:
        """The optimizer state, one list of entries per parameter (in `params` order)."""
        out = []
        for name, p in self.params(opt):
            entries = []
            for key, value in sorted(opt.state.get(p, {}).items(), key=lambda kv: str(kv[0])):
                label = f"{name} {key}"
                if isinstance(value, torch.Tensor):
                    entries += self.tensors(report.STATE, [(label, value)])
                elif isinstance(value, (int, float, bool)):
                    entries.append(Entry(report.STATE, label, setting=float(value)))
            out.append(entries)
        return out

    def local_shard(self, opt: torch.optim.Optimizer) -> int | None:
        """State tensors of this rank's shard that the optimizer keeps in a local optimizer
        of its own (`ZeroRedundancyOptimizer.optim`, stepped inside the outer step and not
        audited): sharded by design. None for any other optimizer (the same on every rank:
        the ranks run the same script)."""
        zero = sys.modules.get("torch.distributed.optim.zero_redundancy_optimizer")
        if zero is None or not isinstance(opt, zero.ZeroRedundancyOptimizer):
            return None  # (a script that uses it has imported it)
        return sum(
            isinstance(v, torch.Tensor) for st in opt.optim.state.values() for v in st.values()
        )

    def settings(self, opt: torch.optim.Optimizer) -> list[Entry]:
        """Every hyperparameter of every param group (lr, betas, weight_decay, ...), as the
        optimizer that steps applies them (`_applied`)."""
        entries = []
        for g, group in enumerate(_applied(opt)):
            for key in sorted(k for k in group if k != "params"):
                value = group[key]
                items = enumerate(value) if isinstance(value, (tuple, list)) else [(None, value)]
                for i, v in items:
                    name = f"param_groups[{g}].{key}" + ("" if i is None else f"[{i}]")
                    entries.append(Entry(report.SETTINGS, name, setting=_setting(v)))
        return entries

    def buffers(self, roots: list[nn.Module], phase: str) -> list[Entry]:
        named = [(strip(r, n), b) for r in roots for n, b in r.named_buffers()]
        return self.tensors(phase, named)

    def scalers(self, scalers: list) -> list[Entry]:
        entries = []
        for i, s in enumerate(scalers):
            scale = getattr(s, "_scale", None)
            if not getattr(s, "_enabled", False) or scale is None:
                continue
            name = "GradScaler" + (f" #{i + 1}" if len(scalers) > 1 else "")
            entries.append(Entry(report.SCALER, f"{name} scale", tensor=scale))
            tracker = getattr(s, "_growth_tracker", None)
            if tracker is not None:
                entries.append(Entry(report.SCALER, f"{name} growth tracker", tensor=tracker))
        return entries


def described(opt: torch.optim.Optimizer) -> str:
    """The optimizer's class, and the class of the local optimizer that steps for it, if it
    has one (`ZeroRedundancyOptimizer over AdamW`)."""
    inner = getattr(opt, "optim", None)
    if isinstance(inner, torch.optim.Optimizer) and inner is not opt:
        return f"{type(opt).__name__} over {type(inner).__name__}"
    return type(opt).__name__


def _applied(opt: torch.optim.Optimizer) -> list[dict]:
    """The param groups' settings the step applies. `ZeroRedundancyOptimizer` steps a local
    optimizer of its own (`.optim`), copying its groups' keys onto the local groups first,
    and the local groups hold the rest: a group added with `add_param_group` holds only the
    keys it was given until the first step copies the local optimizer's full group back
    (amsgrad, eps, ... then appear). Its groups are the local ones overlaid with its own,
    where the two line up one to one (on every rank: ZeRO gives each rank a local group per
    group). Another class's inner optimizer is not read: its groups may differ by rank, and
    the ranks would then audit different keys."""
    zero = sys.modules.get("torch.distributed.optim.zero_redundancy_optimizer")
    if zero is None or not isinstance(opt, zero.ZeroRedundancyOptimizer):
        return opt.param_groups  # (a script that uses it has imported it)
    local = getattr(getattr(opt, "optim", None), "param_groups", None)  # (built later
    if local is None or len(local) != len(opt.param_groups):  # under overlap_with_ddp=True)
        return opt.param_groups
    return [{**mine, **own} for mine, own in zip(local, opt.param_groups)]


def _setting(v) -> float | str:
    if isinstance(v, bool) or v is None or isinstance(v, str):
        return repr(v)
    if isinstance(v, (int, float)):
        return float(v)
    if isinstance(v, torch.Tensor) and v.numel() == 1:
        return float(v.item())
    return repr(v)
