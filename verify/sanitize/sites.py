"""Words for a finding: where in the user's code, and which tensor.

"The user's code" is the innermost Python frame outside torch and outside this repository's
`verify/` package (`impls/`, tests and the user's own files count as user code), so a race
found inside `optimizer.step()` or inside autograd points at the line that called them.
"""

from __future__ import annotations

import os
import sys
import weakref
from collections.abc import Iterable

import torch

from verify.sanitize.access import span
from verify.watching.stacks import SiteFinder

_TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__)) + os.sep
# The user's code: every frame outside torch and this package (verify/); when the tool's own
# loop called torch (the trainer's `optimizer.step()`), what it was doing, in words.
_find = SiteFinder(
    (_TORCH_DIR, os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep)
)


def user_site() -> str:
    """'file:line (function)' of the innermost frame of user code calling this one."""
    return _find(sys._getframe(1))


def describe(t: torch.Tensor) -> str:
    """'a float32 (1024,) tensor'."""
    return f"a {str(t.dtype).removeprefix('torch.')} {tuple(t.shape)} tensor"


class TensorNames:
    """Names for memory, resolved only when a finding needs one (findings are rare).

    Holds weak references: naming a tensor never keeps it alive. A `Parameter` named `w` also
    names its current `.grad` `w.grad`, looked up when the finding is made, so parameters can
    be named once, before backward has created their gradients.
    """

    def __init__(self) -> None:
        self._refs: dict[str, weakref.ref] = {}

    def update(self, named: Iterable[tuple[str, torch.Tensor | None]]) -> None:
        """Add or replace names; a None tensor drops its name."""
        for name, t in named:
            if t is None:
                self._refs.pop(name, None)
            else:
                self._refs[name] = weakref.ref(t)

    def _alive(self) -> list[tuple[str, torch.Tensor]]:
        out = []
        for name, ref in list(self._refs.items()):
            t = ref()
            if t is None:
                continue
            out.append((name, t))
            grad = t.grad if isinstance(t, torch.nn.Parameter) else None
            if grad is not None and name + ".grad" not in self._refs:
                out.append((name + ".grad", grad))
        return out

    def name(self, t: torch.Tensor) -> str:
        """`t`'s name; 'part of w' inside a named tensor; what named tensors a larger buffer
        holds; else a description."""
        bounds = span(t)
        if bounds is None:
            return describe(t)
        lo, hi = bounds
        inside, holds = [], []
        for name, other in self._alive():
            other_bounds = span(other)
            if other_bounds is None or other.device != t.device:
                continue
            olo, ohi = other_bounds
            if (olo, ohi) == (lo, hi) and other.dtype == t.dtype:
                return name
            if olo <= lo and hi <= ohi:
                inside.append((ohi - olo, name))
            elif lo <= olo and ohi <= hi:
                holds.append(name)
        if inside:
            return "part of " + min(inside)[1]
        if holds:
            more = f" and {len(holds) - 2} more" if len(holds) > 2 else ""
            return f"{describe(t)} holding {', '.join(holds[:2])}{more}"
        return describe(t)
