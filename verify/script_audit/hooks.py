"""The audit inside a rank of a user's script: PyTorch's global optimizer step hooks.

`StepHooks.install()` runs before the script's first line (`launching/rank_script.py`). From
then on, every `step()` of every optimizer the script creates is audited by the replica
audit's one `Auditor` (`verify/replica_audit/compare.py`), over the audit's own group, on
every rank in the same order (a step is a point all ranks reach together in data-parallel
training):

    before step N   the first audited step: the parameters (did the replicas start equal?);
                    every param group's settings (lr, betas, ...); the GradScaler's scale;
                    the buffers (as DDP broadcast them at the forward, when it does; else
                    compared as they are, a note when they differ); the gradients. For
                    `step(closure)` (Lightning's automatic optimization, LBFGS) this point
                    runs when the closure returns, where this step's gradients are final
                    (`closures.py`)
    after step N    the parameters; the optimizer state, at the first audited step, every
                    STATE_EVERY-th one, and at any step whose parameters differ (to say
                    whether the state differs too): what every rank holds is compared, what
                    one rank holds by design is counted (`owners.py`)

The optimizer state is not read at every step because it is the largest thing a step holds
(AdamW's two moments are twice the parameters) and what it carries shows in the parameters
of the same step: an update computed from a state that differs gives parameters that differ.
A state that differs but leaves this step's parameters bitwise alike (a moment one ULP off,
absorbed by the rounding of the update) is seen at the next state point, at most
STATE_EVERY audited steps later, or as soon as it moves a parameter. This halves the audit's
cost (docs/audit.md, "What it costs").

An optimizer stepped from inside another's step (`ZeroRedundancyOptimizer` steps a local
optimizer over this rank's shard) is not audited: only the outermost step counts. With
`every=K` only steps 0, K, 2K, ... are audited; the script's step count is kept per optimizer.

Under PyTorch's `join()` (uneven data), a step taken after some rank has joined (run out of
data) is taken by the ranks still training only: it is counted for the report and never
audited, and the audit's step numbers count the steps every rank took (`joins.py`, which
learns it from join()'s own all-reduce, without a collective of the audit's).

The audit never changes what the script computes: it reads tensors (fingerprints, and a
copy of a differing tensor) and never writes one, draws nothing from a random generator, and
talks over its own group (`side_group.py`). An error inside the audit stops the audit, with
the reason in the report, and never reaches the script.

A rank that cannot write its report (a full disk, a run folder removed) goes on taking part
in the audit's collectives and says so at the next audit point, in the header the ranks
agree on anyway (`compare`'s `stop`): there every rank stops together, "the audit stopped at
step k: no space left on device (...)", and the training goes on unaudited. A rank that
stopped alone would leave the others waiting for it in the audit's next collective.
"""

from __future__ import annotations

import os
import sys
import time
import traceback
import weakref

import torch
from torch.optim.optimizer import (
    register_optimizer_step_post_hook,
    register_optimizer_step_pre_hook,
)

from verify.recording.capture import capture_for
from verify.recording.recorder import recorder_for
from verify.replica_audit.compare import Auditor, Entry, Outcome
from verify.script_audit import closures, owners, report
from verify.script_audit.book import Book
from verify.script_audit.buffers import BroadcastBuffers
from verify.script_audit.collect import Collector, described
from verify.script_audit.joins import PARTIAL, SHADOW, Joins
from verify.script_audit.motion import Motion
from verify.script_audit.naming import Modules
from verify.script_audit.report import STATE_EVERY, AuditReport, AuditSettings
from verify.script_audit.side_group import SideGroup

BEFORE, AFTER, STATE = 0, 1, 2  # the audit points of a step


class _Stopped(Exception):
    """Every rank stops the audit here, alike (module docstring); its text says why."""


class StepHooks:
    """The hooks and what they found so far (module docstring)."""

    def __init__(self, settings: AuditSettings) -> None:
        self.settings = settings
        self.modules = Modules()
        self.collect = Collector(self.modules)
        self.group = SideGroup()
        self.auditor = Auditor(self.group)
        self.joins = Joins()
        self.book = Book()
        self.motion = Motion()  # did the script train anything? (`motion.py`)
        self.scalers: weakref.WeakSet = weakref.WeakSet()
        # Keyed by the objects, weakly: an id is reused once the script drops an optimizer.
        # -> steps every rank took (under join(), not those after some rank joined)
        self.steps: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self.labels: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # -> (index, label)
        self.started: weakref.WeakSet = weakref.WeakSet()  # first audited step seen
        self.buffers = BroadcastBuffers(self._guard)  # as DDP broadcast them (`buffers.py`)
        self.buffers.active = lambda: self.stopped is None
        self.optimizers = 0  # optimizers seen so far: numbers them in the order they step
        self.finished_steps: dict[str, int] = {}  # label -> steps, also of dropped optimizers
        # label -> steps taken under join() that not every rank took (or may not have): never
        # audited (`joins.py`); `self.steps` counts the others, the steps every rank took
        self.joined: dict[str, int] = {}
        self.unseen: dict[str, int] = {}
        self._skip: str | None = None  # why the step in progress is not every rank's
        # the "before" point of the step in progress, waiting for its closure (`closures.py`)
        self._deferred: closures.Deferred | None = None
        self.depth = 0
        self.audits = self.audited_steps = self.tensors = self.sharded = 0
        self.seconds = 0.0  # time spent inside the audit, in all
        self.sharded_state: dict[str, int] = {}  # label -> state entries held by one rank each
        self.stopped: str | None = None
        self._io_error: OSError | None = None  # this rank's report could not be written
        self._handles: list = []
        self._scaler_init = None
        # `audit --record/--against`: every audit point's entries also become rows of a
        # recording (verify/recording/), at world size 1 too, where nothing is compared
        self.recorder = recorder_for(settings)
        # `compare --drill`'s re-run: one step, op by op (verify/recording/capture.py)
        self.capture = capture_for(settings, self.modules)

    # ------------------------------------------------------------ set-up

    def install(self) -> None:
        """Note the modules and GradScalers the script builds, and audit its steps."""
        self.modules.on_wrap = self.buffers.on_wrap
        self.modules.install()
        self.joins.install()
        self.attach()
        if self.recorder is not None:
            self.recorder.install()
        if self.capture is not None:
            self.capture.install()
        from torch.amp import grad_scaler

        original, scalers = grad_scaler.GradScaler.__init__, self.scalers

        def __init__(scaler, *args, **kwargs):
            original(scaler, *args, **kwargs)
            scalers.add(scaler)

        grad_scaler.GradScaler.__init__ = __init__
        self._scaler_init = original

    def attach(self) -> None:
        """Audit optimizer steps from now on (the global step hooks)."""
        if not self._handles:
            self._handles = [
                register_optimizer_step_pre_hook(self._before),
                register_optimizer_step_post_hook(self._after),
            ]

    def detach(self) -> None:
        """No longer audit steps (the benchmark's plain arm); `attach()` resumes."""
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def remove(self) -> None:
        self.modules.remove()
        self.joins.remove()
        self.detach()
        if self.recorder is not None:
            self.recorder.remove()
        if self.capture is not None:
            self.capture.remove()
        if self._scaler_init is not None:
            from torch.amp import grad_scaler

            grad_scaler.GradScaler.__init__ = self._scaler_init

    # ------------------------------------------------------------ the hooks

    def _before(self, opt: torch.optim.Optimizer, args, kwargs) -> tuple | None:
        """The step's pre-hook: None, or the step's (args, kwargs) with its closure wrapped."""
        self.depth += 1
        if self.depth != 1:
            return None
        self._skip, self._deferred = None, None
        if self.stopped is None and self.group.ready():
            self._guard(self._joined_now)
        step = self.steps.get(opt, 0)
        if self._skip is None and self._due(step):
            # Where this step's gradients are final: when its closure returns, if it has one.
            late = closures.defer(args, kwargs, lambda: self._guard(self._audit_before, opt, step))
            if late is None:
                self._guard(self._audit_before, opt, step)
            else:
                self._deferred, substituted = late
                self._stepping(opt, True)
                return substituted
        self._stepping(opt, True)
        return None

    def _stepping(self, opt: torch.optim.Optimizer, begins: bool) -> None:
        if self.capture is not None:
            self.capture.optimizer_step(self._label(opt)[0], begins)

    def _joined_now(self) -> None:
        """Under join(), is this a step only the ranks still training take? (`joins.py`)"""
        self._skip = self.joins.step()

    def _after(self, opt: torch.optim.Optimizer, args, kwargs) -> None:
        self.depth = max(0, self.depth - 1)
        if self.depth > 0:
            return
        self._stepping(opt, False)
        skip, self._skip = self._skip, None
        if skip == SHADOW:  # a joined rank's join hook stepping: not the script's step
            return
        _, label = self._label(opt)
        self.finished_steps[label] = self.finished_steps.get(label, 0) + 1
        if skip is not None:  # not a step of every rank: counted, never audited
            counts = self.joined if skip == PARTIAL else self.unseen
            counts[label] = counts.get(label, 0) + 1
            self.write()
            return
        step = self.steps.get(opt, 0)
        self.steps[opt] = step + 1
        deferred, self._deferred = self._deferred, None
        if deferred is not None:  # a closure the step never called: its point is due now
            deferred.run()
        if self._due(step):
            self._guard(self._audit_after, opt, step)
        if self.capture is not None:  # may end the script: the captured step is taken
            self.capture.stepped(self._label(opt)[0], step)

    def _due(self, step: int) -> bool:
        alone_recording = self.recorder is not None  # one rank: recorded, not compared
        return (
            self.stopped is None
            and step % self.settings.every == 0
            and (self.group.ready() or alone_recording)
        )

    def _audit_before(self, opt: torch.optim.Optimizer, step: int) -> None:
        self.collect.sharded = 0
        self.modules.refresh()
        entries = []
        if opt not in self.started:
            self.started.add(opt)
            entries += self.collect.parameters(opt, report.PARAMS_FIRST)
        entries += self.collect.settings(opt)
        entries += self.collect.scalers(list(self.scalers))
        for root in self.modules.owners_of([p for _, p in self.collect.params(opt)]):
            entries += self.buffers.entries(root, self.collect)
        entries += self.collect.gradients(opt)
        self._check(opt, step, BEFORE, entries)

    def _audit_after(self, opt: torch.optim.Optimizer, step: int) -> None:
        self.audited_steps += self.group.ready()  # (alone, a recorded step is not audited)
        self.collect.sharded = 0
        self.modules.refresh()
        params = self._check(opt, step, AFTER, self.collect.parameters(opt, report.PARAMS_AFTER))
        # Every rank takes the same branch: the outcome is what the ranks agreed on.
        if (step // self.settings.every) % STATE_EVERY == 0 or params.mismatched:
            if params.layout:  # the ranks step different parameters: match the state as is
                self._check(opt, step, STATE, self.collect.state(opt))
            else:
                self._audit_state(opt, step)
        # Every audited step is on disk (a small JSON, atomically replaced): a run that hangs
        # or is killed later still reports the steps it took and the audit checked.
        self.write()

    def _audit_state(self, opt: torch.optim.Optimizer, step: int) -> None:
        """The optimizer state: who holds what first (`owners.py`), then what every rank
        holds, bitwise. State held by one rank by design (an owner-rank optimizer, ZeRO's
        local optimizer, FSDP2's shards) is counted for the report's note."""
        if not self.group.ready():  # alone, recording: no one to split ownership with
            self._check(opt, step, STATE, self.collect.state(opt))
            return
        dtensors = self.collect.sharded
        per_param = self.collect.state_by_param(opt)
        names = [n for n, _ in self.collect.params(opt)]
        held = owners.split(self.group, names, per_param)
        zero = self.collect.local_shard(opt)
        if zero is not None:  # every rank holds its own shard's: the sum is the optimizer's
            zero = self.group.sum([zero])[0]
        _, label = self._label(opt)
        shards = held.sharded + (zero or 0) + self.collect.sharded - dtensors
        if shards:
            self.sharded_state[label] = shards
        if held.problem and self.book.add(label, step, [], Outcome(layout=held.problem)):
            self.write()
        self._check(opt, step, STATE, held.replicated)

    def _check(self, opt, step: int, point: int, entries: list[Entry]) -> Outcome:
        index, label = self._label(opt)
        if self._io_error is not None and not self.group.ready():  # alone: no one to tell
            raise _Stopped(self._why_stopped(step))
        if self.recorder is not None:
            self.recorder.optimizer_types.setdefault(index, described(opt))
            roots = self.modules.roots() if point == BEFORE else ()
            self.recorder.add(self.group, roots, index, label, step, point, entries)
            if not self.group.ready():
                self.recorder.settle(self.group, agreed=True)
                return Outcome()
        outcome = self.auditor.check(
            entries,
            (index, step, point),
            lambda e: self.book.known(label, e.phase, e.name),
            stop=self._io_error is not None,
        )
        if outcome.stop:  # some rank cannot write its report: every rank stops here
            raise _Stopped(self._why_stopped(step))
        if self.recorder is not None:  # the ranks have just compared: in step, and told
            self.recorder.settle(self.group, agreed=not outcome.layout)  # the layouts agree
        self.motion.saw(label, entries, outcome)
        self.audits += 1
        self.tensors = max(self.tensors, len(entries))
        self.sharded = max(self.sharded, self.collect.sharded)
        if self.book.add(label, step, entries, outcome) or self.audits == 1:
            self.write()
        return outcome

    def _label(self, opt: torch.optim.Optimizer) -> tuple[int, str]:
        if opt not in self.labels:
            index, self.optimizers = self.optimizers, self.optimizers + 1
            name = type(opt).__name__ + (f" #{index + 1}" if index else "")
            self.labels[opt] = (index, name)
        return self.labels[opt]

    def _why_stopped(self, step: int) -> str:
        """Why the audit stops at `step`, alike on every rank (a collective where there are
        ranks to compare with): the worst error, of the lowest rank that met it."""
        exc = self._io_error
        code = (exc.errno or 1) if exc is not None else 0
        worst, who = code, self.group.rank
        if self.group.ready():
            size = self.group.size  # (the max of size - rank is the lowest rank)
            worst, low = self.group.max([code, size - self.group.rank if code else 0])
            who = size - low
        what = os.strerror(worst) if worst > 1 else "its report could not be written"
        where = f"rank {who} could not write its report"
        if exc is not None and who == self.group.rank and exc.filename:
            where = f"rank {who} could not write {exc.filename}"
        return f"the audit stopped at step {step}: {what[0].lower() + what[1:]} ({where})"

    def _guard(self, fn, *args) -> None:
        start = time.perf_counter()
        if self.capture is not None:  # the audit's own ops are not the script's
            self.capture.paused += 1
        try:
            fn(*args)
        except _Stopped as why:  # agreed by every rank, at the same audit point
            self.stopped = str(why)
            if self.group.rank == 0:  # said once, in the script's output, as it happens
                print(f"ddp-verify: {why}; the training goes on, unaudited", file=sys.stderr)
            self.write()
        except Exception as exc:  # the audit's own failure never becomes the script's
            frame = traceback.extract_tb(exc.__traceback__)[-1]
            where = f"{frame.filename.rsplit('/', 1)[-1]}:{frame.lineno}"
            self.stopped = f"{type(exc).__name__}: {exc} (at {where})"
            self.write()
        finally:
            self.seconds += time.perf_counter() - start
            if self.capture is not None:
                self.capture.paused -= 1

    # ------------------------------------------------------------ the report

    def report(self, finished: bool = False) -> AuditReport:
        return AuditReport(
            every=self.settings.every, steps=dict(self.finished_steps), audits=self.audits,
            audited_steps=self.audited_steps, tensors=self.tensors,
            sharded=self.sharded, sharded_state=dict(self.sharded_state),
            seconds=self.seconds, findings=tuple(self.book.findings),
            joined=dict(self.joined), unseen=dict(self.unseen),
            joined_ranks=self.joins.fewest,
            zero_gradients=self.motion.zero_gradients(), unchanged=self.motion.unchanged(),
            stopped=self.stopped,
            finished=finished,
        )  # fmt: skip

    def write(self, finished: bool = False) -> None:
        """This rank's report, on disk; never raises. A report that cannot be written (a
        full disk, a removed run folder) stops the audit at the next audit point, on every
        rank (module docstring)."""
        if not self.settings.path:
            return
        try:
            self.report(finished).write(self.settings.path)
        except OSError as exc:
            self._io_error = self._io_error or exc

    def finish(self) -> None:
        """The script ended: write the final report (and the recording, if one is made)."""
        self.write(finished=True)
        if self.recorder is not None:
            self.recorder.stopped = self.stopped
            self.recorder.finish()
