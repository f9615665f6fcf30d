"""The collective tracer: every `torch.distributed` collective a rank issues, in a file the
parent can read while the rank is stuck.

`install(path)` replaces the collective functions of `torch.distributed` (all_reduce,
broadcast, all_gather, reduce_scatter, barrier, send/recv, the *_object helpers, ...) with
thin wrappers. Each call appends one fixed-size binary record to a ring buffer in an mmap'ed
file `path` and updates the file's header; a collective launched with `async_op=True` is marked
completed when the user's `Work.wait()` returns or a later traced call finds it finished
(`is_completed()`), so a rank stuck in `wait()` shows that collective as pending. A record
holds:

    per-group sequence number, op, reduce op, dtype, element count, shape, src/dst rank,
    process group, the user's call site (file:line of the first frame outside torch and this
    file), issue and completion times, and its state (issued / completed / failed).

Strings (ops, shapes, call sites, groups) are interned: each new one is appended once to
`path + ".strings"`, so the hot path writes numbers only. Why a file and not a pipe: a rank
hung inside the backend's C++ cannot answer anything, but the pages it wrote are in the page
cache, and the parent (`read_trace`) sees them even after the rank was SIGKILLed.

Cost: one frame walk (cached per code object), a dict lookup or two, a record and a header
written per collective, a few microseconds; `python benchmarks/tracer_cost.py` measures it against a
training step. Collectives that torch issues from C++ (PyTorch DDP's reducer) never pass
through Python and are not recorded: the returns of the calls that issue them count as events
(`untraced.py`).

Process groups are named by their global ranks ("world", or "pg[0,2]"); collectives are
numbered per group from 1, point-to-point ops per (group, peer) pair, so records of different
ranks line up by (group, seq).
"""

from __future__ import annotations

import functools
import inspect
import os
import sys
import threading

import torch
import torch.distributed as dist

from verify import private
from verify.patching import Patches
from verify.watching import untraced
from verify.watching.ops import OPS as _OPS
from verify.watching.stacks import SiteFinder
from verify.watching.trace_file import (
    COMPLETED,
    DEFAULT_CAPACITY,
    FAILED,
    Record,
    Trace,
    Writer,
    names_line,
    read_header,
    read_trace,
)

# The user's call site: outside torch, this file, the wrappers that count DDP's progress
# (a collective DDP's join hook issues inside its forward), the race sanitizer and the
# audit's wrapper of join()'s notify all-reduce (`script_audit/joins.py`).
_HERE = os.path.dirname(os.path.abspath(__file__))
_find_site = SiteFinder(
    (os.path.dirname(torch.__file__) + os.sep, os.path.abspath(__file__),
     os.path.join(_HERE, "untraced.py"), os.path.join(os.path.dirname(_HERE), "sanitize") + os.sep,
     os.path.join(os.path.dirname(_HERE), "script_audit", "joins.py"))
)  # fmt: skip


_writer: Writer | None = None
_patches = Patches()
_wrapped: dict[tuple[str, int], object] = {}  # (name, id(function)) -> its wrapper, once made
# 1 inside a traced call: collectives that one issues (all_gather_object's all_gathers) are not
# recorded again. One flag for all threads: collectives are issued from one thread in practice.
_depth = 0
_seq: dict[tuple, int] = {}
_groups: dict[int, str] = {}
_tensor_kinds: dict[tuple, tuple[int, int]] = {}  # (dtype, shape) -> interned ids
_in_flight: dict[int, tuple] = {}  # id(work) -> (work, [record, works left]) for async ops
_work_wait = dist.Work.wait
_lock = threading.Lock()


def install(path: str, *, rank: int | None = None, capacity: int = DEFAULT_CAPACITY) -> None:
    """Trace every collective of this process into `path` (idempotent per process)."""
    global _writer
    if _writer is not None:
        return
    if rank is None:
        rank = dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", "0"))
    _writer = Writer(path, rank, capacity)
    resume()
    untraced.install(_writer)


def pause() -> None:
    """Put the original functions back (the trace file stays open): `resume()` undoes it
    (benchmarks/bench_tracer.py measures the traced and untraced step in one process)."""
    _patches.restore()


def resume() -> None:
    if not _patches:
        _patches.wrap_collectives(_OPS, _wrapper)
        _patches.apply(dist.Work, "wait", _traced_wait(_work_wait))


def _wrapper(name: str, function):
    """The traced wrapper of `function`, the collective `name`: made once, the same again at
    each `resume`."""
    key = (name, id(function))
    if key not in _wrapped:
        _wrapped[key] = _make_wrapper(name, function)
    return _wrapped[key]


def uninstall() -> None:
    """Restore the original functions and close the trace (tests and benchmarks)."""
    global _writer
    pause()
    untraced.uninstall()
    _wrapped.clear()
    _tensor_kinds.clear()
    _in_flight.clear()
    if _writer is not None:
        os.close(_writer.strings_fd)
        _writer.map.close()
    _writer = None


def installed() -> bool:
    return _writer is not None


def records_written() -> int:
    """How many records this process's trace holds so far (0 when not installed): what a
    stretch of code issued is the difference across it (`bench-tracer`: collectives a step)."""
    return _writer.written if _writer is not None else 0


def wrapped(name: str, fn):
    """`fn` wrapped as `install` wraps the collective `name` (one of `torch.distributed`'s):
    `bench-tracer` times the wrapper around a stand-in that does nothing, for the tracer's
    price of a call. Records go to the installed trace, like any traced call's."""
    return _make_wrapper(name, fn)


def name_shapes(named) -> None:
    """Record the dtype and shape of named tensors (a model's parameters), so the diagnosis can
    say which parameter a collective's tensor is shaped like (`fc1.weight`, where the record
    alone says `float32 (32, 16)`). Once per model, replacing the names of the one before (the
    matrix trains one model after another in a rank); nothing when not installed."""
    if _writer is None:
        return
    lines = "".join(
        names_line(str(t.dtype).replace("torch.", ""), str(tuple(t.shape)), name)
        for name, t in named
    )
    with os.fdopen(private.create(_writer.path + ".names"), "w", encoding="utf-8") as f:
        f.write(lines)


def _make_wrapper(name: str, original):
    tensor_arg, peer_arg, p2p = _OPS[name]
    params = list(inspect.signature(original).parameters.values())
    index = {p.name: i for i, p in enumerate(params)}
    defaults = {p.name: p.default for p in params if p.default is not inspect.Parameter.empty}
    op_id = None

    def arg(args, kwargs, key):
        i = index.get(key)
        if i is not None and i < len(args):
            return args[i]
        return kwargs.get(key, defaults.get(key))

    @functools.wraps(original)
    def traced(*args, **kwargs):
        nonlocal op_id
        global _depth
        writer = _writer
        if writer is None or _depth:
            return original(*args, **kwargs)
        try:
            if op_id is None:
                op_id = writer.intern(name)
            group = arg(args, kwargs, "group")
            fields = _describe(writer, op_id, name, args, kwargs, arg, group, tensor_arg, peer_arg)
            rec = writer.issue(fields + (p2p,))
        except Exception:  # never let tracing break the user's collective
            return original(*args, **kwargs)
        _depth = 1
        try:
            out = original(*args, **kwargs)
        except BaseException:
            writer.done(rec, FAILED)
            raise
        finally:
            _depth = 0
        if out is None or isinstance(out, int):  # a blocking call returned (recv: the src)
            writer.done(rec)
        else:
            _complete_when_done(writer, rec, out)
        return out

    return traced


def _describe(writer, op_id, name, args, kwargs, arg, group, tensor_arg, peer_arg) -> tuple:
    group_id, group_name = _group(writer, group)
    tensor = arg(args, kwargs, tensor_arg) if tensor_arg else None
    dtype = shape = 0
    numel = -1
    if isinstance(tensor, torch.Tensor):
        key = (tensor.dtype, tensor.shape)
        ids = _tensor_kinds.get(key)
        if ids is None:
            ids = _tensor_kinds[key] = (
                writer.intern(str(tensor.dtype).replace("torch.", "")),
                writer.intern(str(tuple(tensor.shape))),
            )
        dtype, shape = ids
        numel = tensor.numel()
    reduce_op = -1
    if "op" in _OPS_WITH_REDUCE.get(name, ()):
        op = arg(args, kwargs, "op")
        reduce_op = int(op) if op is not None else -1
    peer = -1
    if peer_arg:
        value = arg(args, kwargs, peer_arg)
        if value is None:  # group_src / group_dst: a rank within the group
            local = arg(args, kwargs, "group_" + peer_arg)
            if local is not None:
                value = dist.get_global_rank(group or dist.group.WORLD, local)
        peer = -1 if value is None else int(value)
    key = (group_name, peer) if _OPS[name][2] else group_name
    seq = _seq[key] = _seq.get(key, 0) + 1
    return (seq, numel, op_id, dtype, shape, group_id, _site(writer), reduce_op, peer)


_OPS_WITH_REDUCE = {
    n: ("op",)
    for n in ("all_reduce", "all_reduce_coalesced", "reduce", "reduce_scatter")
    + ("reduce_scatter_tensor", "_reduce_scatter_base")
}


def _group(writer, group) -> tuple[int, str]:
    key = id(group)
    name = _groups.get(key)
    if name is None:
        if group is None or group is dist.group.WORLD:
            name = "world"
        else:
            name = "pg" + str(dist.get_process_group_ranks(group)).replace(" ", "")
        _groups[key] = name
    return writer.intern(name), name


def _site(writer) -> int:
    """Interned 'file:line (function)' of the innermost frame outside torch and this file."""
    return writer.intern(_find_site(sys._getframe(3)))


def _complete_when_done(writer: Writer, rec: int, out) -> None:
    """Mark `rec` completed now (a blocking call returned), or when its Work is found done.

    No completion callback on the Work's future: it would run Python on the backend's worker
    thread, which then waits for the GIL (up to the 5 ms switch interval) before it can start
    the next collective, a real slowdown. Instead an async record is completed when the user's
    `wait()` returns, or when a later traced call finds `is_completed()` true.
    """
    works = out if isinstance(out, list) else [out]
    works = [w for w in works if hasattr(w, "is_completed")]
    if not works:
        writer.done(rec)
        return
    _sweep(writer)
    entry = [rec, len(works)]
    for work in works:
        _in_flight[id(work)] = (work, entry)


def _sweep(writer: Writer) -> None:
    """Complete the records of async works the backend has finished."""
    for key, (work, _) in list(_in_flight.items()):
        try:
            finished = work.is_completed()
        except Exception:
            finished = True
        if finished:
            _finish_work(writer, key)


def _finish_work(writer: Writer, key: int, state: int = COMPLETED) -> None:
    item = _in_flight.pop(key, None)
    if item is None:
        return
    entry = item[1]
    entry[1] -= 1
    if entry[1] == 0:
        writer.done(entry[0], state)


def _traced_wait(original):
    @functools.wraps(original)
    def wait(self, *args, **kwargs):
        try:
            result = original(self, *args, **kwargs)
        except BaseException:
            if _writer is not None:
                _finish_work(_writer, id(self), FAILED)
            raise
        if _writer is not None:
            _finish_work(_writer, id(self))
        return result

    return wait


__all__ = ["Record", "Trace", "install", "read_header", "read_trace", "uninstall"]
