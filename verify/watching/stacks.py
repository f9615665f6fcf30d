"""Where a rank was: the user's frame in a traceback, a stack dump or a live frame.

"The user's code" is every frame outside torch, the standard library and this package
(`verify/`): a built-in of `impls/` or a class under test is user code, the launcher and the
trainer that call it are plumbing. Every report names a place the same way,
`path:line (function)`, with the path relative to the working directory when it lies below it.
One module, so a traceback, a faulthandler dump and a live frame are read by the same rules.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import sys
import types

import torch

_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
_TORCH = os.path.dirname(torch.__file__) + os.sep
_STDLIB = os.path.dirname(os.__file__) + os.sep
_PLUMBING = (_PACKAGE, _TORCH, _STDLIB)
_TB_FRAME = re.compile(r'^  File "(.+)", line (\d+), in (.+)$')
_DUMP_FRAME = re.compile(r'File "(.+)", line (\d+) in (\S+)')


def is_plumbing(path: str) -> bool:
    """True for frames of torch, the standard library and this tool."""
    # "<string>": the `python -c` line that starts every rank (launching/process.py).
    return path.startswith(_PLUMBING) or path.startswith("<frozen") or path == "<string>"


def relpath(path: str) -> str:
    """`path` relative to the working directory when it lies below it, else as given."""
    with contextlib.suppress(ValueError):
        rel = os.path.relpath(path)
        if not rel.startswith(".."):
            return rel
    return path


def site(path: str, line: int | str, function: str) -> str:
    return f"{relpath(path)}:{line} ({function})"


def traceback_site(tb: str | None) -> str | None:
    """The innermost user frame of a formatted traceback, as `path:line (function)`."""
    frames = _traceback_frames(tb)
    users = [f for f in frames if not is_plumbing(f[0])]
    if not users:
        return None
    return site(*users[-1][:3])


def traceback_lines(tb: str | None) -> list[str]:
    """The innermost user frame of a traceback as it was printed (the `File ...` line and its
    source line), or the innermost frame at all when none is the user's."""
    frames = _traceback_frames(tb)
    if not frames:
        return []
    users = [f for f in frames if not is_plumbing(f[0])]
    path, line, function, source = (users or frames)[-1]
    out = [f'  File "{path}", line {line}, in {function}']
    return out + ([f"    {source}"] if source else [])


def _traceback_frames(tb: str | None) -> list[tuple[str, str, str, str]]:
    if not tb:
        return []
    lines = tb.splitlines() + [""]
    frames = []
    for i, line in enumerate(lines):
        m = _TB_FRAME.match(line)
        if m:
            following = lines[i + 1]
            source = following.strip() if following.startswith("    ") else ""
            frames.append((m.group(1), m.group(2), m.group(3), source))
    return frames


def _main_thread_frames(stack: str | None) -> list[tuple[str, str, str]]:
    """(path, line, function) of the rank's work thread in a faulthandler dump, innermost
    first (see `innermost_frames`)."""
    if not stack:
        return []
    threads = [t for t in stack.split("\n\n") if "most recent call first" in t]
    mains = [t for t in threads if f'"{_PACKAGE}launching' in t or 'File "<string>"' in t]
    return _DUMP_FRAME.findall((mains or threads or [""])[-1])


def dump_in_torch(stack: str | None) -> bool:
    """Whether a faulthandler dump shows the rank's work thread blocked inside torch's C++
    (`main_thread_in_torch`, read from a dump)."""
    frames = _main_thread_frames(stack)
    return bool(frames) and frames[0][0].startswith(_BLOCKING_TORCH)


def innermost_frames(stack: str | None, depth: int = 3) -> str:
    """`f (file:line) <- g (file:line)`: the innermost user frames of the thread that runs the
    rank's work in a faulthandler dump (the thread that entered this tool's rank entry point;
    the last dump when the file holds several). With no user frame on it (a built-in
    implementation inside torch's backward, say), this tool's frames and torch's entry frame
    (the outermost of each run of torch frames): where it was is worth more than nothing."""
    if not stack:
        return ""
    found = _main_thread_frames(stack)  # innermost first
    frames = [f for f in found if not is_plumbing(f[0])]
    if not frames:  # torch's frames only where this tool's code entered torch
        kept = [
            f for f in found
            # torch first: site-packages often lies below the standard library's folder
            if f[0].startswith(_TORCH)
            or not f[0].startswith((_STDLIB, "<", _PACKAGE + "launching" + os.sep))
        ]  # fmt: skip
        frames = [
            f for f, outer in zip(kept, [*kept[1:], None])
            if not (f[0].startswith(_TORCH) and outer is not None and outer[0].startswith(_TORCH))
        ]  # fmt: skip
    return " <- ".join(f"{name} ({relpath(path)}:{line})" for path, line, name in frames[:depth])


def frame_site(frame: types.FrameType | None) -> str | None:
    """The innermost user frame at or above `frame` (a live frame), as `path:line (function)`."""
    while frame is not None and is_plumbing(frame.f_code.co_filename):
        frame = frame.f_back
    if frame is None:
        return None
    return site(frame.f_code.co_filename, frame.f_lineno, frame.f_code.co_name)


class SiteFinder:
    """`path:line (function)` of the innermost frame outside the `skip` directories, cached
    per code object and line: a few microseconds on a hot path (the tracer and the race
    sanitizer ask at every collective). When every frame is skipped (the tool's own loop
    called torch: `optimizer.step()` from the trainer), the innermost frame outside
    `fallback_skip` (default: `skip`). Frames of code compiled from strings (`<string>`,
    `<frozen ...>`) are never a site."""

    def __init__(self, skip: tuple[str, ...], fallback_skip: tuple[str, ...] | None = None) -> None:
        self.skip = skip + ("<",)
        self.fallback_skip = (fallback_skip or skip) + ("<",)
        self._internal: dict[object, bool] = {}
        self._labels: dict[tuple[object, int], str] = {}

    def __call__(self, frame: types.FrameType | None) -> str:
        start = frame
        while frame is not None:
            code = frame.f_code
            internal = self._internal.get(code)
            if internal is None:
                internal = self._internal[code] = code.co_filename.startswith(self.skip)
            if not internal:
                break
            frame = frame.f_back
        if frame is None:  # nothing but skipped frames: the innermost outside fallback_skip
            frame = start
            while frame is not None and frame.f_code.co_filename.startswith(self.fallback_skip):
                frame = frame.f_back
        if frame is None:
            return "<unknown>"
        key = (frame.f_code, frame.f_lineno)
        label = self._labels.get(key)
        if label is None:
            label = self._labels[key] = site(frame.f_code.co_filename, *key[1:], key[0].co_name)
        return label


def main_thread_site() -> str | None:
    """Where the main thread of this process is now (callable from any thread)."""
    import threading

    frame = sys._current_frames().get(threading.main_thread().ident)
    return frame_site(frame)


# Where a Python frame calls into torch's C++ and can block there, waiting for peers, with no
# Python frame below it: collectives torch issues from C++ (PyTorch DDP's reducer during
# backward, its constructor's broadcasts, ZeroRedundancyOptimizer), the autograd engine.
_BLOCKING_TORCH = tuple(
    _TORCH + part
    for part in ("distributed" + os.sep, "nn" + os.sep + "parallel" + os.sep,
                 "autograd" + os.sep, "_tensor.py", "optim" + os.sep)
)  # fmt: skip


def main_thread_in_torch() -> bool:
    """True when this process's main thread is inside a call into torch's C++ that can block
    waiting for peers (its innermost Python frame is torch's distributed, DDP, autograd or
    optimizer code): where the collective trace is blind. Callable from any thread."""
    import threading

    frame = sys._current_frames().get(threading.main_thread().ident)
    return frame is not None and frame.f_code.co_filename.startswith(_BLOCKING_TORCH)


def describe_exit(code: int | None) -> str:
    """`exited with code 3`, `killed by SIGKILL`."""
    if code is None:
        return "still running"
    if code >= 0:
        return f"exited with code {code}"
    with contextlib.suppress(ValueError):
        return f"killed by {signal.Signals(-code).name}"
    return f"killed by signal {-code}"


def last_lines(text: str | None, count: int = 3) -> list[str]:
    """The last `count` non-blank lines, without torch's import-time warnings."""
    lines = [line.rstrip() for line in (text or "").splitlines() if line.strip()]
    lines = [line for line in lines if "_conversion_method_template" not in line]
    return lines[-count:]
