"""Where a rank was: the user's frame in a traceback, a stack dump or a live frame.

"The user's code" is every frame outside torch, the standard library and this package
(`verify/`): a built-in of `impls/` or a class under test is user code, the launcher and the
trainer that call it are plumbing. Every report names a place the same way,
`path:line (function)`, with the path relative to the working directory when it lies below it.
One module, so a traceback, a faulthandler dump and a live frame are read by the same rules.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import re
import signal
import sys
import types

_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
# Where torch is installed, found without importing it (the launcher form's parent reads
# stacks before it imports torch, `launching/launcher.py`).
_TORCH = os.path.dirname(importlib.util.find_spec("torch").origin) + os.sep
_STDLIB = os.path.dirname(os.__file__) + os.sep
_PLUMBING = (_PACKAGE, _TORCH, _STDLIB)
_TB_FRAME = re.compile(r'^  File "(.+)", line (\d+), in (.+)$')
_DUMP_FRAME = re.compile(r'File "(.+)", line (\d+) in (\S+)')


def is_plumbing(path: str) -> bool:
    """True for frames of torch, the standard library and this tool."""
    # "<string>": the `python -c` line that starts every rank (`process.py` in launching/).
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


def at(place: str) -> str:
    """`at x.py:3 (f)`, or a place in words as it is ("in the tool's consistency audit")."""
    return place if place.startswith("in ") else f"at {place}"


def traceback_site(tb: str | None) -> str | None:
    """The innermost user frame of a formatted traceback, as `path:line (function)`."""
    frames = _traceback_frames(tb)
    users = [f for f in frames if not is_plumbing(f[0])]
    if not users:
        return None
    return site(*users[-1][:3])


def traceback_lines(tb: str | None) -> list[str]:
    """The innermost user frame of a traceback as it was printed (the `File ...` line and its
    source line), or, when none is the user's, what the tool was doing, in words."""
    frames = _traceback_frames(tb)
    if not frames:
        return []
    users = [f for f in frames if not is_plumbing(f[0])]
    if not users:
        words = in_words([f[:3] for f in reversed(frames)])
        return [f"  raised {words}, not in the code under test"] if words else []
    path, line, function, source = users[-1]
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


def traceback_in_torch(tb: str | None) -> bool:
    """Whether a formatted traceback was raised inside a call into torch that can block
    waiting for peers (its innermost frame is torch's distributed, DDP, autograd or optimizer
    code: `main_thread_in_torch`, read from a traceback)."""
    frames = _traceback_frames(tb)
    return bool(frames) and frames[-1][0].startswith(_BLOCKING_TORCH)


def dump_in_torch(stack: str | None) -> bool:
    """Whether a faulthandler dump shows the rank's work thread blocked inside torch's C++
    (`main_thread_in_torch`, read from a dump)."""
    frames = _main_thread_frames(stack)
    return bool(frames) and frames[0][0].startswith(_BLOCKING_TORCH)


def dump_in_rendezvous(stack: str | None) -> bool:
    """Whether a faulthandler dump shows the rank's work thread inside `init_process_group`:
    it has not met its peers yet (the store's connect, the backend's first handshake)."""
    return any(name == "init_process_group" and path.endswith("distributed_c10d.py")
               for path, _, name in _main_thread_frames(stack))  # fmt: skip


def innermost_frames(stack: str | None, depth: int = 3) -> str:
    """`f (file:line) <- g (file:line)`: the innermost user frames of the thread that runs the
    rank's work in a faulthandler dump (the thread that entered this tool's rank entry point;
    the last dump when the file holds several). With no user frame on it (a built-in
    workload inside torch's backward, say), what the tool was doing, in words: "in torch's
    backward(), called by the tool's training step" (`in_words`): the tool's own frames are
    never the place of a failure."""
    if not stack:
        return ""
    found = _main_thread_frames(stack)  # innermost first
    frames = [f for f in found if not is_plumbing(f[0])]
    if not frames:
        return in_words(found)
    return " <- ".join(f"{name} ({relpath(path)}:{line})" for path, line, name in frames[:depth])


# What the tool's own code does, by where it lies under verify/ (the first match).
_TOOL_WORDS = (
    ("training/trainer.py", "the tool's training step"),
    ("training/checkpoint.py", "the tool's optimizer state_dict round trip"),
    ("checks/consistency.py", "the tool's consistency audit"),
    ("checks/audit.py", "the tool's consistency audit"),
    ("replica_audit/", "the tool's replica audit"),
    ("checks/agreement.py", "the tool's agreement on a cell's outcome"),
    ("checks/reference.py", "the tool's single-process reference"),
    ("checks/", "the tool's check"),
    ("training/", "the tool's training loop"),
    ("perf/", "the tool's measurement"),
    ("launching/", "the tool's launcher"),
    ("", "the tool"),
)
# The tool's wrappers around torch's collectives: transparent, never what it was doing.
_WRAPPERS = (
    "watching/tracer.py",
    "watching/untraced.py",
    "sanitize" + os.sep,
    "replica_audit" + os.sep,  # the audit engine: its caller (consistency, the matrix) says what
)


def in_words(frames: list[tuple[str, str, str]]) -> str:
    """What the tool was doing on a stack with no user frame (`(path, line, function)`,
    innermost first): torch's entry point and the part of the tool that called it."""
    frames = [f for f in frames if not f[0].startswith(tuple(_PACKAGE + w for w in _WRAPPERS))]
    tool = next((i for i, f in enumerate(frames) if f[0].startswith(_PACKAGE)), None)
    if tool is None:
        return ""
    rel = frames[tool][0][len(_PACKAGE) :]
    who = next(words for prefix, words in _TOOL_WORDS if rel.startswith(prefix))
    inside = [f for f in frames[:tool] if f[0].startswith(_TORCH)]
    if not inside:
        return f"in {who} ({frames[tool][2]})"
    entry = inside[-1]  # torch's outermost frame: where the tool entered it
    what = next(
        (w for prefix, w in _TORCH_WORDS if entry[0][len(_TORCH) :].startswith(prefix)),
        f"torch's {entry[2]}()",
    )
    return f"in {what}, called by {who}"


# What torch does, by where its entry frame lies under torch/.
_TORCH_WORDS = (
    ("optim" + os.sep, "the optimizer's step()"),
    ("_tensor.py", "backward()"),
    ("autograd" + os.sep, "backward()"),
    ("nn" + os.sep + "modules" + os.sep, "the model's forward"),
    ("distributed" + os.sep, "a collective"),
)


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
    sanitizer ask at every collective). When the frame found is this tool's (its own loop
    called torch: `optimizer.step()` from the trainer), what the tool was doing, in words
    ("in the optimizer's step(), called by the tool's training step"): the tool's lines are
    never a site. Frames of code compiled from strings (`<string>`, `<frozen ...>`) are
    never a site."""

    def __init__(self, skip: tuple[str, ...]) -> None:
        self.skip = skip + ("<",)
        self._internal: dict[object, bool] = {}
        self._labels: dict[tuple, str] = {}

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
        if frame is None or frame.f_code.co_filename.startswith(_PACKAGE):
            return self._in_words(start, frame)
        key = (frame.f_code, frame.f_lineno)
        label = self._labels.get(key)
        if label is None:
            label = self._labels[key] = site(frame.f_code.co_filename, *key[1:], key[0].co_name)
        return label

    def _in_words(self, start: types.FrameType | None, found: types.FrameType | None) -> str:
        """The tool's own code issued it (its training step, its audit): what it was doing,
        in words (`in_words`), never the tool's line."""
        key = (start and start.f_code, found and found.f_code, found and found.f_lineno)
        label = self._labels.get(key)
        if label is None:
            chain, frame = [], start
            while frame is not None:
                chain.append((frame.f_code.co_filename, str(frame.f_lineno), frame.f_code.co_name))
                frame = frame.f_back
            label = self._labels[key] = in_words(chain) or "<unknown>"
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
