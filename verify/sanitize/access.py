"""Access checking: which memory collectives in flight hold, and which operators touch it.

Three pieces, all cheap on the hot path:

- `op_plan(func)`: which arguments of an aten operator it reads and which it writes, from its
  schema (`Tensor(a!)` and `Tensor(a!)[]` are writes, `out=` arguments included), computed
  once per `OpOverload`. Views and metadata-only operators (`view`, `t`, `detach`,
  `_unsafe_view`, `empty_like`, ...) touch no data and get no plan; nor do the `c10d`
  collective ops, which the wrappers in `collectives.py` check instead.
- `HeldMemory`: byte ranges held by collectives in flight, by storage. Readers never lock: the
  entries of a storage are an immutable tuple replaced on every change, so a completion on the
  backend's thread (a future callback) never invalidates a check running on the main thread.
- `AccessMode`: the `TorchDispatchMode` that sees every operator, including those autograd
  and the optimizers run from C++, and compares its arguments with the held ranges: a lookup
  by storage, then a range overlap. A tensor a collective only reads conflicts with writes; one
  it writes conflicts with reads and writes.

A tensor's bytes are taken as the span from its first to its last element, so a strided view
interleaved with an in-flight one (every other column) counts as overlapping: conservative.
"""

from __future__ import annotations

import threading
import time
from typing import NamedTuple

import torch
from torch.utils._python_dispatch import TorchDispatchMode

# Operators that read only metadata (shape, dtype, device) of their tensor arguments, or change
# only metadata, though their schema does not say so.
_METADATA_ONLY = frozenset(
    {
        "_unsafe_view", "empty_like", "zeros_like", "ones_like", "full_like", "rand_like",
        "randn_like", "randint_like", "new_empty", "new_empty_strided", "new_zeros",
        "new_ones", "new_full", "size", "stride", "storage_offset", "sym_size", "sym_stride",
        "sym_numel", "sym_storage_offset", "is_same_size", "record_stream", "detach_",
        "squeeze_", "unsqueeze_", "t_", "transpose_", "swapdims_", "swapaxes_", "as_strided_",
    }
)  # fmt: skip

# One entry per tensor-typed argument: (position or -1 if keyword-only, name, is written).
OpPlan = tuple[tuple[int, str, bool], ...]
_plans: dict[object, OpPlan | None] = {}


def op_plan(func) -> OpPlan | None:
    """The tensor arguments `func` reads or writes; None if it touches no tensor data."""
    try:
        return _plans[func]
    except KeyError:
        plan = _plans[func] = _classify(func)
        return plan


def _classify(func) -> OpPlan | None:
    schema = getattr(func, "_schema", None)  # higher-order operators have none
    if schema is None or getattr(func, "namespace", None) == "c10d":
        return None
    if func.overloadpacket.__name__ in _METADATA_ONLY:
        return None
    plan = []
    for i, arg in enumerate(schema.arguments):
        if "Tensor" not in str(arg.type):
            continue
        write = bool(arg.alias_info is not None and arg.alias_info.is_write)
        plan.append((-1 if arg.kwarg_only else i, arg.name, write))
    writes = any(w for _, _, w in plan)
    if not writes and any(r.alias_info is not None for r in schema.returns):
        return None  # a view: it returns an alias and touches no data
    return tuple(plan) or None


def span(t: torch.Tensor) -> tuple[int, int] | None:
    """[first byte, last byte + 1) of `t`'s elements; None if it has none or no plain memory."""
    if t.layout is not torch.strided or t.numel() == 0:
        return None
    last = sum((n - 1) * s for n, s in zip(t.shape, t.stride()))
    lo = t.data_ptr()
    return lo, lo + (last + 1) * t.element_size()


def storage_key(t: torch.Tensor) -> int:
    """Where `t`'s storage starts: equal for every view of one storage."""
    return t.data_ptr() - t.storage_offset() * t.element_size()


class Held(NamedTuple):
    lo: int
    hi: int
    written: bool  # the collective writes this memory (else it only reads it)
    flight: object  # collectives.Flight: the collective that holds it
    tensor: torch.Tensor  # the user's tensor, as handed to the collective


class HeldMemory:
    """Memory held by collectives in flight, by storage (see the module docstring)."""

    def __init__(self) -> None:
        self.by_storage: dict[int, tuple[Held, ...]] = {}
        self._lock = threading.Lock()  # among writers only

    def __bool__(self) -> bool:
        return bool(self.by_storage)

    def hold(self, t: torch.Tensor, written: bool, flight: object) -> None:
        bounds = span(t)
        if bounds is None:
            return
        key = storage_key(t)
        with self._lock:
            held = Held(bounds[0], bounds[1], written, flight, t)
            self.by_storage[key] = self.by_storage.get(key, ()) + (held,)

    def release(self, flight: object) -> None:
        with self._lock:
            for key, held in list(self.by_storage.items()):
                kept = tuple(h for h in held if h.flight is not flight)
                if len(kept) == len(held):
                    continue
                if kept:
                    self.by_storage[key] = kept
                else:
                    del self.by_storage[key]

    def conflicts(self, t: torch.Tensor, write: bool) -> list[Held]:
        """The holdings an access to `t` (a write if `write`) races with."""
        try:
            held = self.by_storage.get(storage_key(t))
        except RuntimeError:  # no data pointer (sparse, meta): nothing we can compare
            return []
        if held is None:
            return []
        bounds = span(t)
        if bounds is None:
            return []
        lo, hi = bounds
        return [h for h in held if lo < h.hi and h.lo < hi and (write or h.written)]


class AccessMode(TorchDispatchMode):
    """Checks every operator against `held`; calls `report(op name, tensor, wrote, held)` per
    race.

    It is pushed only while something is held (or a backward is armed, see `switch.py`);
    with nothing held it forwards at once. `quiet` (a callable) silences the sanitizer's own
    snapshots and copy-backs.
    """

    def __init__(self, held: HeldMemory, report, quiet) -> None:
        super().__init__()
        self.held = held
        self.report = report
        self.quiet = quiet
        self.ops_seen = 0
        self.ops_checked = 0
        self.check_ns = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        self.ops_seen += 1
        if self.held.by_storage and not self.quiet():
            plan = op_plan(func)
            if plan is not None:
                self._check(func, plan, args, kwargs)
        return func(*args, **kwargs)

    def _check(self, func, plan: OpPlan, args, kwargs) -> None:
        start = time.perf_counter_ns()
        self.ops_checked += 1
        by_storage = self.held.by_storage
        races = []
        for pos, name, write in plan:
            value = args[pos] if 0 <= pos < len(args) else kwargs.get(name)
            if isinstance(value, torch.Tensor):
                value = (value,)
            elif not isinstance(value, (list, tuple)):
                continue  # None, or a Python number standing in for a wrapped scalar tensor
            for t in value:
                if not isinstance(t, torch.Tensor):  # None in Tensor?[] (index_put_'s indices)
                    continue
                try:  # storage_key, inlined: this loop is the hot path
                    key = t.data_ptr() - t.storage_offset() * t.element_size()
                except RuntimeError:  # no data pointer (sparse, meta): nothing to compare
                    continue
                if key in by_storage:
                    races += [(t, write, h) for h in self.held.conflicts(t, write)]
        self.check_ns += time.perf_counter_ns() - start
        for tensor, write, held in races:  # rare: the frame walk and naming are not timed
            self.report(func.overloadpacket.__name__, tensor, write, held)
