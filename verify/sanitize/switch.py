"""When the access check is on: only while memory is held, and through armed backward passes.

- A tracked work is issued: on (the `AccessMode` is pushed) unless already on.
- The last tracked work completes, or `end_step` drops the unwaited ones: off, unless inside
  an armed backward.
- `backward()` starts: armed (on for the whole pass) while no optimizer step has ended since
  install after a backward ran (the first step's backward passes, every micro-batch of it),
  and afterwards if any backward so far issued an async collective. Autograd runs every node
  with the thread-local state captured when backward started, so a mode pushed from a
  gradient hook would vanish at the end of that hook: only a mode already on at the start is
  seen by the whole pass. Why a whole step and not the first backward: a micro-batch under
  `no_sync()` issues nothing, and a step is the first unit that must synchronize; and why
  the decision is taken at every backward, from what every backward did, armed or not: once
  one unarmed pass issues, the next must be checked.

Every backward started on the owner thread runs single-threaded
(`torch.autograd.set_multithreading_enabled(False)`): on a GPU autograd otherwise runs the
nodes of each device on a thread of that device, and the gradient hooks that launch
all-reduces (overlap, bucketed, zero1) would issue them from a thread the sanitizer does not
own, untracked. On a CPU autograd already runs on the calling thread: nothing changes there.

Push and pop happen only on the thread that installed the sanitizer, outside backward
(changes made inside a node do not outlive it). A work completed from the backend's thread (a
future callback) leaves the mode on until the next such point; with nothing held it forwards at
once.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Callable, Iterator

import torch
from torch.utils._python_dispatch import (
    TorchDispatchMode,
    _get_current_dispatch_mode,
    _pop_mode,
    _push_mode,
)


def in_backward() -> bool:
    return torch._C._current_graph_task_id() != -1


class CheckSwitch:
    """Pushes `mode` while `holding()` is true or an armed backward runs, on `thread` only."""

    def __init__(self, mode: TorchDispatchMode, holding: Callable[[], bool]) -> None:
        self.mode = mode
        self.holding = holding
        self.thread: int | None = None  # the owner thread while started
        self.pushed = False
        self.armed = False  # inside an armed backward
        self.backwards = 0  # backward passes started on the owner thread
        self.settled = False  # a step ended after a backward: arm only on evidence from now
        self.backward_issues = 0  # async collectives issued inside any backward, armed or not
        self.windows = 0
        self.armed_backwards = 0

    def start(self) -> None:
        self.thread = threading.get_ident()

    def stop(self) -> None:
        """Switch off for good (until `start`); call on the owner thread."""
        self.armed = False
        self.sync(stopping=True)
        self.thread = None

    def owner(self) -> bool:
        return self.thread is not None and threading.get_ident() == self.thread

    def step_ended(self) -> None:
        """An optimizer step ended (any thread): if a backward ran before it, the first step is
        over, and from now on a backward is armed only if some backward issued."""
        if self.backwards:
            self.settled = True

    def arming(self) -> bool:
        """Whether the backward starting now is checked from its start (the policy above)."""
        return self.backward_issues > 0 or not self.settled

    def issued(self) -> None:
        """An async collective was issued: from inside backward, it arms the next ones."""
        if in_backward():
            self.backward_issues += 1

    def sync(self, *, stopping: bool = False) -> None:
        """Push or pop the mode to match what is held (owner thread, outside backward)."""
        if not self.owner() or in_backward():
            return
        want = not stopping and (self.armed or self.holding())
        if want and not self.pushed:
            self.mode.__enter__()
            self.pushed = True
            self.windows += 1
        elif not want and self.pushed and _get_current_dispatch_mode() is self.mode:
            # (Under a mode pushed after ours we cannot pop: it stays on, forwarding, until then.)
            self.mode.__exit__(None, None, None)
            self.pushed = False

    @contextlib.contextmanager
    def bypassed(self) -> Iterator[None]:
        """Take the mode off the stack for the duration, if it is on top: the backend's own
        `c10d` operators would otherwise box every argument (the process group, the work)
        through Python on their way past it, a quarter of a millisecond per collective."""
        ours = _get_current_dispatch_mode() is self.mode
        if ours:
            _pop_mode()
        try:
            yield
        finally:
            if ours:
                _push_mode(self.mode)

    def wrap_backward(self, previous: Callable) -> Callable:
        """Wrap autograd's entry point so that it arms the check per the policy above."""

        @functools.wraps(previous)
        def run_backward(*args, **kwargs):
            if in_backward() or not self.owner():
                return previous(*args, **kwargs)  # nested, or another thread
            with torch.autograd.set_multithreading_enabled(False):  # hooks on this thread
                self.backwards += 1
                if not self.arming():
                    return previous(*args, **kwargs)
                self.armed = True
                self.armed_backwards += 1
                self.sync()
                try:
                    return previous(*args, **kwargs)
                finally:
                    self.armed = False
                    self.sync()

        return run_backward
