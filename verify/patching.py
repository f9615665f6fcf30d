"""Replacing attributes of torch's modules and classes, and putting back exactly what was there:
the one way the tool's plug-ins patch torch (the tracer, the sanitizer, the rehearsal, the
audit's join watch, the recorder's loss tap).

Several of them patch the same names in one process (the tracer wraps the collectives at rank
start, the sanitizer wraps them again). Each wraps whatever is installed when it installs, and
on restore puts back, name by name, what it replaced, but only where its own wrapper is still
the one installed: a tool that wrapped ours afterwards keeps its wrapper (which still calls
ours, now a pass-through).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

_MISSING = object()
# The code of every function the tool put in torch's place: a frame running one of them is a
# pass-through to torch, the script's call, not the tool's own work (`recording/capture.py`
# tells the script's ops from the tool's by the frames above them).
WRAPPERS: set = set()


class Patches:
    """The attributes replaced so far, in order."""

    def __init__(self) -> None:
        self._applied: list[tuple[object, str, object, object]] = []

    def __bool__(self) -> bool:
        return bool(self._applied)

    def apply(self, owner: object, name: str, ours: object) -> None:
        """Set `owner.name = ours`, remembering the attribute it replaced (or its absence:
        `vars`, not `getattr`, so an inherited attribute is restored as inherited, and a
        class's staticmethod as the staticmethod it was)."""
        self._applied.append((owner, name, vars(owner).get(name, _MISSING), ours))
        code = getattr(getattr(ours, "__func__", ours), "__code__", None)
        if code is not None:
            WRAPPERS.add(code)
        setattr(owner, name, ours)

    def replaced(self, owner: object, name: str) -> bool:
        """Whether `owner.name` was replaced through these patches."""
        return any(o is owner and n == name for o, n, _, _ in self._applied)

    def restore(self) -> None:
        """Put back what was replaced, in reverse order, where ours is still installed."""
        for owner, name, previous, ours in reversed(self._applied):
            if vars(owner).get(name) is not ours:
                continue  # wrapped again since: leave the newer wrapper in place
            if previous is _MISSING:
                delattr(owner, name)
            else:
                setattr(owner, name, previous)
        self._applied.clear()

    def wrap_collectives(self, names: Iterable[str], wrap: Callable[[str, Callable], Callable]):
        """Wrap `torch.distributed`'s collective functions, under both names users call them
        by (`dist.all_reduce` and `dist.distributed_c10d.all_reduce`); `wrap(name, previous)`
        returns the wrapper of `previous`."""
        import torch.distributed as dist

        c10d = dist.distributed_c10d
        for name in names:
            previous = getattr(c10d, name, None)
            if previous is None:
                continue  # not in this torch version
            wrapper = wrap(name, previous)
            self.apply(c10d, name, wrapper)
            if getattr(dist, name, None) is previous:
                self.apply(dist, name, wrapper)
            elif hasattr(dist, name):  # someone wrapped only the package's name: wrap theirs
                self.apply(dist, name, wrap(name, getattr(dist, name)))
