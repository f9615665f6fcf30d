"""What the tests ask about processes: is one still alive, and what runs below one."""

from __future__ import annotations

from pathlib import Path

from verify.launching.process import alive

__all__ = ["alive", "descendants"]


def descendants(pid: int) -> set[int]:
    """Every process below `pid` (ranks may be the tool's children or its zygote's)."""
    parents: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text().rsplit(")", 1)[1].split()
                parents[int(entry.name)] = int(stat[1])
            except (OSError, ValueError, IndexError):
                continue
    out, todo = set(), [pid]
    while todo:
        parent = todo.pop()
        kids = [p for p, pp in parents.items() if pp == parent and p not in out]
        out.update(kids)
        todo.extend(kids)
    return out
