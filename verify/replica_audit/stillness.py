"""Did training move anything? Replicas that never moved agree bitwise, and a verdict on
them is true but empty: a loss whose gradients are exactly zero (a cross-entropy over one
class), a learning rate of 0, a step that never reaches the parameters.

`Stillness` follows one optimizer (or one class's model) through the audit points it is
shown, with no collective of its own: what it reads is what the audit already holds on this
rank (the gradients it fingerprints, the fingerprints of the parameters), and where the
replicas agree bitwise every rank reads the same. It stops looking once it has seen a
nonzero gradient and a parameter that changed, so a run that trains costs it one read of a
gradient, and one comparison of a fingerprint, each.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch


class Stillness:
    """Whether every gradient shown was exactly zero (or None), and whether any parameter's
    fingerprint changed from the first one shown (module docstring)."""

    def __init__(self) -> None:
        self.gradient_points = 0  # audit points whose gradients were shown
        self.nonzero = False  # some gradient held a nonzero element
        self.first: dict[str, int] | None = None  # name -> the first fingerprint shown
        self.compared = 0  # later points whose parameters were compared with the first
        self.moved = False  # some parameter's fingerprint differed from its first

    def gradients(self, grads: Iterable[torch.Tensor | None]) -> None:
        """One audit point's gradients (-0.0 is zero here: an exactly zero gradient)."""
        self.gradient_points += 1
        if not self.nonzero:
            self.nonzero = any(g is not None and bool(g.any()) for g in grads)

    def parameters(self, prints: dict[str, int]) -> None:
        """One audit point's parameters, by name, as their fingerprints."""
        if self.first is None:
            self.first = dict(prints)
            return
        self.compared += 1
        if not self.moved:
            self.moved = any(self.first.get(n, p) != p for n, p in prints.items())

    @property
    def zero_gradients(self) -> bool:
        """Every gradient shown, at every point, was exactly zero or None."""
        return self.gradient_points > 0 and not self.nonzero

    @property
    def unchanged(self) -> bool:
        """No parameter changed from the first point to any later one shown."""
        return self.compared > 0 and not self.moved


def nothing_trained(zero_gradients: bool, unchanged: bool, whose: str = "", why: str = "") -> str:
    """The note for a run that trained nothing ("" when it trained): `whose` names what did
    not train where only some of the run's optimizers did not ("SGD #2"); `why`, the likely
    cause in the caller's words, replaces the script's."""
    if not (zero_gradients or unchanged):
        return ""
    head = f"nothing trained{f' by {whose}' if whose else ''}: "
    if zero_gradients and unchanged:
        return head + (
            "the loss's gradients were exactly zero at every audited step and no parameter "
            "changed over the run, so the replicas agree because nothing moved them "
            + (why or "(a loss that does not depend on the parameters, such as a "
               "cross-entropy over one class)")
        )  # fmt: skip
    if zero_gradients:
        return head + (
            "the loss's gradients were exactly zero at every audited step "
            + (why or "(the parameters moved by the optimizer's own terms only, such as "
               "weight decay)")
        )  # fmt: skip
    return head + (
        "no parameter changed over the run, though the gradients were not all zero "
        + (why or "(a learning rate of 0, or a step that never reaches the parameters)")
    )
