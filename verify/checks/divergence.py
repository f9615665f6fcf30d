"""The equivalence check's findings: the distinct divergences among every rank's failed
comparisons with the reference, each with its kind and what was measured (`hints/kinds.py`).

What a divergence measures, for its hint (`hint_rules.gradients_diverge`):
- `scale`: the one factor c with which every failed tensor of the finding, on every rank
  that failed, is c x the reference (`measure.fitted_scale`), else None;
- `ranks_off`: the ranks over tolerance at that step, of `world_size`;
- `ranks_agree`: every rank failed and holds the same bits (fingerprints) in each of the
  finding's tensors: a wrong value computed alike everywhere, rather than gradients that
  never met in a reduction;
- `first_gradient_step`: the run's first gradient divergence, so a later one can be told
  for an echo (the replicas parted there).
"""

from __future__ import annotations

import math

from verify.checks.reference import TensorError
from verify.checks.verdict import Finding
from verify.hints import kinds
from verify.replica_audit.measure import common_scale

_DIVERGE = {
    "gradients": kinds.GRADIENTS_DIVERGE,
    "parameters": kinds.PARAMETERS_DIVERGE,
    "buffers": kinds.BUFFERS_DIVERGE,
}
_MISSING = {
    "here": kinds.NO_GRAD_HERE,
    "reference": kinds.GRAD_NOT_IN_REFERENCE,
    "shape": kinds.SHAPE_DIFFERS,
}


def divergences(failed: list[TensorError], world_size: int) -> list[Finding]:
    """The distinct divergences among the failed checks (sorted by step): each tensor's
    first failure of each kind; a parameter that diverges at or after its gradient did is
    the echo of that gradient, not a finding of its own; the tensors that first failed at
    the same step and kind are one finding ("... and 5 more tensors there")."""
    firsts: dict[tuple[str, str], TensorError] = {}
    steps: dict[tuple[str, str], set[int]] = {}
    ranks: dict[tuple[str, str], set[int]] = {}
    for e in failed:
        key = (e.kind, e.tensor)
        firsts.setdefault(key, e)
        steps.setdefault(key, set()).add(e.step)
        ranks.setdefault(key, set()).add(e.rank)
    grad_at = {t: e.step for (k, t), e in firsts.items() if k == "gradients"}
    first_grad = min(grad_at.values(), default=None)
    groups: dict[tuple[str, int], list[tuple[str, str]]] = {}
    for key, e in firsts.items():
        if e.kind != "gradients" and grad_at.get(e.tensor, math.inf) <= e.step:
            continue
        groups.setdefault((e.kind, e.step), []).append(key)
    out = []
    for (kind, step), keys in groups.items():
        e = firsts[keys[0]]
        more = f" (and {len(keys) - 1} more tensors there)" if len(keys) > 1 else ""
        phase = "construction" if step == 0 else "gradients" if kind == "gradients" else "step"
        at = [f for f in failed if f.step == step and (f.kind, f.tensor) in keys]
        numbers = _measured(at, step, world_size) | {"first_gradient_step": first_grad}
        if e.missing:
            found = _MISSING[e.missing]
        elif step == 0:  # replicas that start apart: the broadcast at construction
            found = kinds.NOT_BROADCAST
            numbers["buffers_only"] = kind == "buffers"
        else:
            found = _DIVERGE[kind]
        out.append(
            Finding(
                "equivalence",
                phase,
                step,
                e.describe() + more,
                e.tensor,
                tuple(sorted(set().union(*(ranks[k] for k in keys)))),
                tuple(sorted(set().union(*(steps[k] for k in keys)))),
                kind=found,
                numbers=numbers,
            )  # fmt: skip
        )
    return out


def _measured(at: list[TensorError], step: int, world_size: int) -> dict:
    """What the failed checks `at` one step show (module docstring)."""
    off = sorted({e.rank for e in at})
    digests: dict[str, set] = {}
    for e in at:
        digests.setdefault(e.tensor, set()).add(e.digest)
    agree = len(off) == world_size and all(len(d) == 1 and None not in d for d in digests.values())
    first = at[0] if at else None
    return {
        "step": step,
        "tensors": len(digests),
        "ranks_off": off,
        "world_size": world_size,
        "ranks_agree": agree,
        "scale": common_scale(e.scale for e in at),
        "max_rel": first.max_rel if first is not None else None,
    }
