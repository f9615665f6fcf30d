"""Replacing an attribute of torch for the length of a rehearsal, and putting it back."""

from __future__ import annotations

from typing import Any

_MISSING = object()


class Patches:
    """The attributes replaced so far, to restore in reverse order (`restore`)."""

    def __init__(self) -> None:
        self._done: list[tuple[Any, str, Any]] = []

    def set(self, owner: Any, name: str, new: Any) -> Any:
        """Replace `owner.name` by `new`; returns what was there (None when nothing was)."""
        old = getattr(owner, name, _MISSING)
        self._done.append((owner, name, old))
        setattr(owner, name, new)
        return None if old is _MISSING else old

    def replaced(self, owner: Any, name: str) -> bool:
        """Whether `owner.name` was replaced by this rehearsal."""
        return any(o is owner and n == name for o, n, _ in self._done)

    def restore(self) -> None:
        while self._done:
            owner, name, old = self._done.pop()
            if old is _MISSING:
                delattr(owner, name)
            else:
                setattr(owner, name, old)
