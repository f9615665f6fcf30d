"""What a rehearsal mapped, inside one rank: each CUDA call the script made, where in its code,
how many times, and the first call it could not map.

A mapping is counted at the user's line that led to it (the innermost frame outside torch,
this tool, Python's own library and installed packages; `needs_cuda.path_kind`), so
`model.to(device)` is one call at that line, not one per parameter: a mapping made inside
another (`Module.to` moving each tensor) is not counted again (`quiet`). Answers the script
asks for (`is_available()`, `device_count()`) are counted only where the script asks them
itself (`direct`), not where torch asks on its behalf (GradScaler asking is_available).

The rank's file (`rank<r>.on_cpu.json`) is rewritten whenever a new call site is mapped
(rare: the first step meets them all) and at the end, so a rank that is killed at a hang
still leaves the sites it mapped; only the counts of its last step may be short.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import threading
from typing import NoReturn

from verify.launching.needs_cuda import LIBRARY, TORCH_OR_TOOL, USER, path_kind, shown
from verify.oncpu.unmappable import CannotMap, UnmappableCall

_HERE = os.path.dirname(os.path.abspath(__file__))


class Ledger:
    """The calls one rank mapped (module docstring); `path`: its report file (None: kept in
    memory only)."""

    def __init__(self, path: str | None, rank: int) -> None:
        self.path, self.rank = path, rank
        self.counts: dict[tuple[str, str, str], int] = {}  # (call, mapped to, where) -> n
        self.asked_: dict[tuple[str, str, str], int] = {}  # unmapped questions, as `counts`
        self.refused: CannotMap | None = None  # the first call it could not map
        self._local = threading.local()  # a mapping in progress on this thread: `quiet`

    def mapped(self, call: str, to: str, *, direct: bool = False) -> None:
        """Count `call`, mapped to `to`, at the user's line that made it; `direct`: only
        where the user's code called it itself."""
        if getattr(self._local, "quiet", 0):
            return
        where = _site(direct)
        if where is None:
            return
        key = (call, to, where)
        n = self.counts.get(key, 0)
        self.counts[key] = n + 1
        if not n:
            self.save()

    def asked(self, call: str, answer) -> None:
        """Count a device question the rehearsal left to torch (`standins.count_unmapped`),
        with the CPU build's `answer`, where the user's code asked it itself."""
        where = None if getattr(self._local, "quiet", 0) else _site(True)
        if where is None:
            return
        shown = repr(answer) if len(repr(answer)) <= 24 else type(answer).__name__
        key = (call, shown, where)
        n = self.asked_.get(key, 0)
        self.asked_[key] = n + 1
        if not n:
            self.save()

    def has_user_sites(self) -> bool:
        """Whether anything was counted at a line of the user's code (or a library's)."""
        return any(w != "?" for *_, w in (*self.counts, *self.asked_))

    @contextlib.contextmanager
    def quiet(self):
        """The mappings made inside this one (a module's tensors) are not counted again."""
        self._local.quiet = getattr(self._local, "quiet", 0) + 1
        try:
            yield
        finally:
            self._local.quiet -= 1

    def refuse(self, call: str, why: str) -> NoReturn:
        """Raise for a call the rehearsal cannot map, and keep it: a script that catches the
        raise still gets no verdict (exit 2: `report.py`)."""
        self.note_refused(CannotMap(call, _site(False) or "?", why))
        raise UnmappableCall(self.refused)

    def note_refused(self, what: CannotMap) -> None:
        if self.refused is None:
            self.refused = what
            self.save()

    def to_dict(self) -> dict:
        mapped = [
            {"call": c, "to": t, "where": w, "count": n} for (c, t, w), n in self.counts.items()
        ]
        unmapped = [
            {"call": c, "answer": a, "where": w, "count": n} for (c, a, w), n in self.asked_.items()
        ]
        refused = None if self.refused is None else self.refused.to_dict()
        return {"rank": self.rank, "mapped": mapped, "unmapped": unmapped, "refused": refused}

    def save(self) -> None:
        if self.path is None:
            return
        with contextlib.suppress(OSError):
            tmp = f"{self.path}.tmp"
            with open(tmp, "w") as f:
                json.dump(self.to_dict(), f, indent=1)
            os.replace(tmp, self.path)


_USER_SITES: dict[tuple, str] = {}  # (code, line) of a user's frame -> "path:line"


def _site(direct: bool) -> str | None:
    """`path:line` of the user's frame that led here (module docstring); with `direct`, None
    unless the first frame outside this package is the user's."""
    frame = sys._getframe(2)
    while frame is not None and frame.f_code.co_filename.startswith(_HERE):
        frame = frame.f_back
    if frame is not None:  # the common case, a call in the script itself: answered once a line
        known = _USER_SITES.get((frame.f_code, frame.f_lineno))
        if known is not None:
            return known
    if direct:
        if frame is None or path_kind(frame.f_code.co_filename) != USER:
            return None
        return f"{shown(frame.f_code.co_filename)}:{frame.f_lineno}"
    fallback = None
    while frame is not None:
        name = frame.f_code.co_filename
        kind = TORCH_OR_TOOL if name.startswith("<") else path_kind(name)
        if kind == USER:
            where = f"{shown(name)}:{frame.f_lineno}"
            _USER_SITES[frame.f_code, frame.f_lineno] = where
            return where
        if kind == LIBRARY and fallback is None:
            fallback = f"{shown(name)}:{frame.f_lineno}"
        frame = frame.f_back
    return fallback or "?"
