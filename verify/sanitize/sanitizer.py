"""`Sanitizer`: the wrappers and the bookkeeping of works in flight.

Issue (`_collective`): number the call, check the memory it is handed against what other
collectives hold, substitute private clones (adversarial), call what was installed before us,
and hold the user's tensors until the work completes. Completion (`_complete`, from `wait()` or
the future's callback, on any thread, once per work): copy the private results back, then
release. `end_step` reports and drops what never completed. When the access check runs is
`switch.py`'s business.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import threading
import time
from collections.abc import Iterable, Iterator

import torch
import torch.autograd.graph
import torch.distributed as dist
from torch.optim.optimizer import register_optimizer_step_post_hook

from verify.patching import Patches
from verify.sanitize import collectives
from verify.sanitize.access import AccessMode, Held, HeldMemory
from verify.sanitize.collectives import Call, Flight, Numbering
from verify.sanitize.findings import (
    NEVER_WAITED,
    READ_WHILE_IN_FLIGHT,
    WRITE_WHILE_IN_FLIGHT,
    CollectiveRef,
    FindingLog,
    RaceFinding,
    SanitizerStats,
)
from verify.sanitize.sites import TensorNames, user_site
from verify.sanitize.switch import CheckSwitch


class Sanitizer:
    """Access checking + adversarial completion for this rank's async collectives.

    Args:
        rank: this process's rank, as findings report it.
        adversarial: give each async collective private copies of its tensors and write its
            result into the user's tensors only at completion (see `collectives.py`).

    Install after `init_process_group` and after any other tracer of `torch.distributed`
    (it wraps whatever is installed); use one per process, on the thread that issues the
    collectives. Call `end_step()` after each optimizer step. Also a context manager.

    On CUDA (untested here: no GPU) clones and copy-backs run on the current stream, which
    `wait()` orders after the collective and on which a future's callbacks run synchronized
    with its value; private clones keep the user's dtype and device.
    """

    def __init__(self, *, rank: int, adversarial: bool = True) -> None:
        if not isinstance(rank, int) or rank < 0:
            raise ValueError(f"rank must be an int >= 0, got {rank!r}")
        self.rank = rank
        self.adversarial = adversarial
        self._held = HeldMemory()
        self._mode = AccessMode(self._held, self._report, lambda: self._quiet)
        self._log = FindingLog()
        self._names = TensorNames()
        self._patches = Patches()
        self._step_hook = None  # the global optimizer-step hook that tells the switch
        self._flights: dict[int, Flight] = {}  # id(work) -> what it holds
        self._lock = threading.Lock()  # _flights and completion, across threads
        self._numbering = Numbering()
        self._switch = CheckSwitch(self._mode, lambda: bool(self._held))
        self._step = 0
        self._quiet = 0  # > 0 inside our own wrappers and copies (owner thread only)
        self._counts = dict(collectives=0, tracked=0, copy_ns=0)

    # ----- lifecycle -----

    def install(self) -> None:
        """Wrap the collectives of `torch.distributed`, `Work.wait`, `Work.get_future` and
        autograd's entry point, and hook every optimizer's step (where a step ends, for the
        switch: a script has no `end_step`). Idempotent."""
        if self._patches:
            return
        self._switch.start()
        patch = self._patches.apply
        self._patches.wrap_collectives(
            (*collectives.ROLES, *collectives.COUNTED_ONLY), self._wrap_collective
        )
        patch(dist.Work, "wait", self._wrap_wait(dist.Work.wait))
        patch(dist.Work, "get_future", self._wrap_get_future(dist.Work.get_future))
        run = getattr(torch.autograd.graph, "_engine_run_backward", None)
        if run is not None:  # what torch.autograd.backward and .grad call (torch 2.x)
            wrapper = self._switch.wrap_backward(run)
            patch(torch.autograd.graph, "_engine_run_backward", wrapper)
            if getattr(torch.autograd, "_engine_run_backward", None) is run:
                patch(torch.autograd, "_engine_run_backward", wrapper)
        self._step_hook = register_optimizer_step_post_hook(lambda *_: self._switch.step_ended())

    def uninstall(self) -> None:
        """Put back what `install` found, where our wrapper is still the one installed (a
        tracer installed after us keeps its own). Works still in flight are forgotten: their
        results are not written back. Idempotent."""
        self._patches.restore()
        if self._step_hook is not None:
            self._step_hook.remove()
            self._step_hook = None
        with self._lock:
            for flight in {id(f): f for f in self._flights.values()}.values():
                self._held.release(flight)
            self._flights.clear()
        self._switch.stop()

    def __enter__(self) -> Sanitizer:
        self.install()
        return self

    def __exit__(self, *exc) -> None:
        self.uninstall()

    # ----- what the training loop tells us -----

    def name_tensors(self, named: Iterable[tuple[str, torch.Tensor | None]]) -> None:
        """Name tensors for findings, e.g. `model.named_parameters()`; a Parameter's `.grad`
        is named `<name>.grad` automatically. Cheap (weak references); call it each step."""
        self._names.update(named)

    @contextlib.contextmanager
    def quiet(self) -> Iterator[None]:
        """Operators run inside (on this thread) are not checked: for a tool's own reads of
        tensors that may be in flight, e.g. a checker copying gradients, which are no race of
        the user's."""
        mine = self._switch.owner()
        self._quiet += mine
        try:
            yield
        finally:
            self._quiet -= mine

    def set_step(self, step: int) -> None:
        self._step = step

    def end_step(self) -> None:
        """Report every tracked work not waited on (nor its future completed) by now, and stop
        tracking it: under adversarial completion its result never lands."""
        with self._lock:  # (a claimed flight is being completed right now: let it land)
            pending = {id(f): f for f in self._flights.values() if not f.claimed}.values()
            for flight in pending:
                flight.claimed = True
                for w in flight.works:
                    del self._flights[id(w)]
        for flight in pending:
            self._held.release(flight)
            flight.landed.set()
            user = flight.main_tensor()
            tensor = "no tensor" if user is None else self._names.name(user)
            self._log.add(
                RaceFinding(
                    NEVER_WAITED, self.rank, flight.step, flight.collective.op,
                    tensor, flight.collective, flight.issued_at, None,
                )
            )  # fmt: skip
        self._switch.step_ended()
        self._switch.sync()

    @property
    def findings(self) -> tuple[RaceFinding, ...]:
        return self._log.findings()

    @property
    def stats(self) -> SanitizerStats:
        c, mode, switch = self._counts, self._mode, self._switch
        return SanitizerStats(
            collectives=c["collectives"], tracked=c["tracked"], windows=switch.windows,
            armed_backwards=switch.armed_backwards, ops_seen=mode.ops_seen,
            ops_checked=mode.ops_checked, check_s=mode.check_ns / 1e9,
            copy_s=c["copy_ns"] / 1e9, findings=len(self._log),
        )  # fmt: skip

    # ----- wrappers -----

    def _wrap_collective(self, name: str, previous):
        sig = inspect.signature(previous)  # follows __wrapped__ through other tracers

        @functools.wraps(previous)
        def sanitized(*args, **kwargs):
            if self._quiet or not self._switch.owner():
                return previous(*args, **kwargs)  # nested in ours, another thread, uninstalled
            try:
                call = Call(name, sig, args, kwargs)
            except TypeError:  # let torch say what is wrong with the arguments
                return previous(*args, **kwargs)
            return self._collective(call, previous)

        return sanitized

    def _collective(self, call: Call, previous):
        self._counts["collectives"] += 1
        ref = self._numbering.next(call)
        tracked = call.name in collectives.ROLES
        parts = call.parts() if tracked and (call.is_async or self._held) else []
        if self._held and parts:  # handing over memory another collective still holds
            site = user_site()
            for part in parts:
                for held in self._held.conflicts(part.user, part.written):
                    self._report(call.name, part.user, part.written, held, site)
        if not (tracked and call.is_async):
            with self._switch.bypassed():
                return self._quietly(call.invoke, previous)  # blocking: untouched
        issued_at = user_site()
        if self.adversarial:
            self._quietly(call.substitute, parts, timed=True)
        with self._switch.bypassed():
            out = self._quietly(call.invoke, previous)
        works = [w for w in (out if isinstance(out, list) else [out]) if w is not None]
        if works:
            self._track(ref, issued_at, parts, works)
        return out

    def _track(self, ref: CollectiveRef, issued_at: str, parts, works: list) -> None:
        # A batch whose backend returns one work per op: each op completes on its own.
        per_op = ref.op == "batch_isend_irecv" and len(works) == len(parts)
        groups = [([p], [w]) for p, w in zip(parts, works)] if per_op else [(parts, works)]
        with self._lock:
            for group_parts, group_works in groups:
                flight = Flight(ref, issued_at, self._step, group_parts, group_works)
                for part in group_parts:
                    self._held.hold(part.user, part.written, flight)
                for work in group_works:
                    self._flights[id(work)] = flight
        self._counts["tracked"] += 1
        self._switch.issued()
        self._switch.sync()

    def _complete(self, work) -> Flight | None:
        """`work` finished (waited on, or its future completed): write results back, release
        its memory. Any thread. The first caller to see the flight's last work finish copies;
        a concurrent one (a `wait()` racing the future's callback) waits until it has."""
        with self._lock:
            flight = self._flights.get(id(work))
            if flight is None:
                return None
            flight.unfinished.discard(id(work))
            copier = not flight.unfinished and not flight.claimed
            flight.claimed |= copier
        if not copier:
            if not flight.unfinished:
                flight.landed.wait()
            return flight
        copies = flight.copies()
        if copies:
            self._quietly(lambda: [user.copy_(private) for user, private in copies], timed=True)
        with self._lock:
            for w in flight.works:
                self._flights.pop(id(w), None)
        self._held.release(flight)  # after the copies: they are part of the collective
        flight.landed.set()
        self._switch.sync()
        return flight

    def _wrap_wait(self, previous):
        @functools.wraps(previous)
        def wait(work, *args, **kwargs):
            result = previous(work, *args, **kwargs)
            self._complete(work)
            return result

        return wait

    def _wrap_get_future(self, previous):
        @functools.wraps(previous)
        def get_future(work):
            future = previous(work)
            flight = self._flights.get(id(work))
            if flight is None:
                return future

            def landed(done):
                value = done.value()  # re-raises the collective's error into the chain
                self._complete(work)
                return flight.translate(value)

            return future.then(landed)

        return get_future

    # ----- helpers -----

    def _quietly(self, fn, *args, timed: bool = False):
        start = time.perf_counter_ns() if timed else 0
        with self.quiet():
            out = fn(*args)
        if timed:
            self._counts["copy_ns"] += time.perf_counter_ns() - start
        return out

    def _report(self, op: str, tensor, wrote: bool, held: Held, site: str | None = None) -> None:
        """`op` touched `tensor` (wrote it if `wrote`), which overlaps `held`."""
        kind = WRITE_WHILE_IN_FLIGHT if wrote else READ_WHILE_IN_FLIGHT
        flight, name = held.flight, self._names.name(tensor)
        site = site or user_site()
        self._log.add(
            RaceFinding(
                kind, self.rank, self._step, op, name, flight.collective, flight.issued_at, site
            )
        )
