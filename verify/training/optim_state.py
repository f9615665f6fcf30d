"""How many bytes of optimizer state one rank holds, measured without guessing attribute names.

A sharded optimizer written by someone else keeps its local optimizer wherever its author put
it (`.optim` in PyTorch's ZeroRedundancyOptimizer, `.inner` in ours, `.optimizer`,
`._local_optimizer`, `.inopt` in course solutions). Rather than guess, `local_state_bytes`
walks everything reachable from the optimizer object and counts the tensors that are neither
parameters nor gradients: what is left is state, wherever it lives.

Three rules make the count right for ZeRO-style designs:

- A tensor is compared with parameters and gradients by *storage*, not identity: ZeRO-1
  implementations make every parameter a view into a flat buffer that the optimizer holds, so
  the buffer shares the parameters' storage and is not state.
- Each storage is counted once, at its full size: two views of one state buffer (a flat
  `exp_avg` and its per-parameter slices) are one allocation.
- The parameters of an optimizer found inside (and their gradients) are not state either: a
  design that shards by slices gives an inner optimizer copies of this rank's slices, a shard
  of the parameters, not of the state.

The walk reads `__dict__`/`__slots__` and the base methods of the built-in containers only,
so no property, `__getattr__` or `__iter__` of the user's code runs; whatever still fails is
recorded in `StateBytes.note`, never raised.

`plain_state.unsharded_state` is the yardstick: each parameter's state under a plain
optimizer.

Both sides count *scalars* apart (a storage of at most one element: AdamW's `step`): a design
that shards by slices keeps one per slice, so scalars say how many shards a rank holds, not how
much of the state (`verify/checks/cells.py`, the shard check).
"""

from __future__ import annotations

import collections
import types
from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import nn

from verify.launching.outcome import one_line

MAX_DEPTH = 16  # optimizer -> wrapper -> inner -> state -> {param: {name: tensor}} is 5
MAX_OBJECTS = 200_000  # containers and tensors visited; a 1B-parameter model has ~10^3 tensors
_PATH_EXAMPLES = 5
_NOTES = 3

# Never walked into: no state lives there that an optimizer owns (a module's tensors are the
# model's, a function's closure is code), and walking them would reach the whole program.
_OPAQUE = (
    nn.Module,
    type,
    types.ModuleType,
    types.FunctionType,
    types.BuiltinFunctionType,
    types.MethodType,
    types.CodeType,
    types.FrameType,
    str,
    bytes,
    bytearray,
    int,
    float,
    complex,
    type(None),
)


@dataclass(frozen=True)
class StateBytes:
    """The optimizer state one rank holds.

    Attributes:
        bytes: size of every distinct storage of state tensors.
        tensors: number of distinct state tensor objects.
        owners: indices into `params` of the parameters with state found in a dict keyed by the
            parameter (`optimizer.state[p]`, at any depth); None when state was found but none
            of it was keyed by a parameter (the layout does not say whose it is).
        note: why the count may be incomplete (a tensor that could not be measured, an object
            that could not be read, the walk's limits); empty when nothing was skipped.
        paths: where a few state tensors were found, e.g. `.inner.state[param 3]['exp_avg']`.
        scalar_bytes: the part of `bytes` in storages of at most one element (per-shard
            scalars such as AdamW's `step`).
        copy: two paths where one parameter's state of one name (the path after the
            parameter's key: `['exp_avg']`, `['Q'][0]`) lives in two storages of more than
            one element (`.state[param 0]['exp_avg']` and `.optim.state[param 0]['exp_avg']`):
            a second copy of it; empty when none.
        copy_bytes: the bytes of every such second (third...) storage.
    """

    bytes: int
    tensors: int
    owners: tuple[int, ...] | None
    note: str = ""
    paths: tuple[str, ...] = ()
    scalar_bytes: int = 0
    copy: tuple[str, ...] = ()
    copy_bytes: int = 0


def local_state_bytes(
    optimizer: object,
    params: Iterable[torch.Tensor],
    grads: Iterable[torch.Tensor | None] | None = None,
) -> StateBytes:
    """Bytes of optimizer state reachable from `optimizer` on this rank. Never raises.

    Args:
        optimizer: any object (a `torch.optim.Optimizer`, a wrapper around one).
        params: the model's parameters; `owners` indexes this list.
        grads: extra gradient tensors to exclude (a wrapper's gradient buckets, say); every
            `.grad` of `params` and of the optimizer's own `param_groups` is always excluded.

    A tensor is state unless it is a parameter or gradient or shares storage with one. Walked:
    attributes (`__dict__`, `__slots__`), dicts (keys and values), lists, tuples, sets, deques,
    nested optimizers and plain objects, up to `MAX_DEPTH` levels and `MAX_OBJECTS` objects;
    cycles are visited once. Not walked: `nn.Module`s, classes, modules, functions, methods.
    """
    walk = _Walk()
    params = list(params)
    excluded = list(params)
    try:  # the optimizer's own parameters (a frozen one the caller left out is no state)
        groups = getattr(optimizer, "param_groups", None) or []
        excluded += [p for g in groups for p in g["params"] if _is_tensor(p)]
    except Exception as exc:  # a property or __getattr__ of the user's that raises
        walk.notes.append(f"could not read param_groups ({one_line(exc)})")
    excluded += [p.grad for p in excluded if p.grad is not None]
    excluded += [g for g in grads or () if g is not None]
    walk.exclude(excluded, {id(p): i for i, p in enumerate(params)})
    try:
        walk.run(optimizer)
    except Exception as exc:  # not expected (the walk guards each read); keep what was found
        walk.notes.insert(0, f"walk stopped early ({one_line(exc)})")
    return walk.result()


class _Walk:
    """One walk of an object graph: what it excludes, what it has seen, what it found."""

    def __init__(self) -> None:
        self.param_index: dict[int, int] = {}
        self.excluded_ids: set[int] = set()
        self.excluded_storages: set[tuple] = set()
        self.seen: set[int] = set()  # ids of containers and tensors already visited
        # What was found is only totalled at the end: a nested optimizer met later in the walk
        # may still exclude a tensor already seen (its own parameters, below).
        self.storages: dict[tuple, tuple[int, bool]] = {}  # storage -> (bytes, scalar)
        self.sightings: list[tuple[int, tuple, int | None, str]] = []  # id, storage, owner, path
        self.notes: list[str] = []
        self.limited = ""

    def exclude(self, tensors: list[torch.Tensor], param_index: dict[int, int] | None = None):
        self.param_index = self.param_index if param_index is None else param_index
        for t in tensors:
            self.excluded_ids.add(id(t))
            key, _ = self._storage(t, "")
            if key is not None and key[0] != "empty":
                self.excluded_storages.add(key)

    def run(self, root: object) -> None:
        # Depth-first with an explicit stack: deep user graphs must not hit the recursion limit.
        # Children are pushed in reverse so tensors are met in attribute / insertion order.
        stack: list[tuple[object, str, int, int | None]] = [(root, "", 0, None)]
        while stack:
            obj, path, depth, owner = stack.pop()
            if _is_tensor(obj):
                self._tensor(obj, path, owner)
                continue
            if issubclass(type(obj), _OPAQUE) or id(obj) in self.seen:
                continue
            if depth >= MAX_DEPTH:
                self.limited = self.limited or f"depth limit {MAX_DEPTH} reached at {path}"
                continue
            if len(self.seen) >= MAX_OBJECTS:
                self.limited = f"stopped after {MAX_OBJECTS} objects"
                return
            self.seen.add(id(obj))
            if issubclass(type(obj), torch.optim.Optimizer):
                self._exclude_parameters_of(obj, path)
            try:
                children = list(self._children(obj, path, owner))
            except Exception as exc:  # C extensions, descriptors that raise: skip, say so
                self.notes.append(f"could not read {path or 'the optimizer'} ({one_line(exc)})")
                continue
            stack.extend((c, p, depth + 1, o) for c, p, o in reversed(children))

    def _children(self, obj: object, path: str, owner: int | None):
        kind = type(obj)
        if issubclass(kind, dict):
            for k, v in list(dict.items(obj)):
                label = self._label(k)
                key_owner = self.param_index.get(id(k)) if _is_tensor(k) else None
                yield k, f"{path}<key {label}>", owner
                yield v, f"{path}[{label}]", owner if key_owner is None else key_owner
        elif issubclass(kind, (list, tuple, collections.deque)):
            base = next(b for b in (list, tuple, collections.deque) if issubclass(kind, b))
            for i, v in enumerate(list(base.__iter__(obj))):
                yield v, f"{path}[{i}]", owner
        elif issubclass(kind, (set, frozenset)):
            base = set if issubclass(kind, set) else frozenset
            for v in list(base.__iter__(obj)):
                yield v, f"{path}<item>", owner
        else:
            # object.__getattribute__ bypasses a class's own __getattribute__/__getattr__; a
            # C type without __dict__ raises AttributeError here, which means nothing to walk.
            try:
                attrs = object.__getattribute__(obj, "__dict__")
            except AttributeError:
                attrs = {}
            except Exception as exc:  # a `__dict__` property that raises: still read the slots
                self.notes.append(f"could not read {path or 'the optimizer'} ({one_line(exc)})")
                attrs = {}
            if isinstance(attrs, dict):
                for name, v in list(dict.items(attrs)):
                    yield v, f"{path}.{name}", owner
            for name in _slot_names(kind):
                try:
                    v = object.__getattribute__(obj, name)
                except AttributeError:  # an unset slot
                    continue
                yield v, f"{path}.{name}", owner

    def _exclude_parameters_of(self, optimizer: object, path: str) -> None:
        """An optimizer's parameters and their gradients are not state (module docstring)."""
        try:
            groups = object.__getattribute__(optimizer, "__dict__").get("param_groups") or []
            params = [p for g in list(groups) for p in list(dict.get(g, "params", ()))]
            params = [p for p in params if _is_tensor(p)]
            self.exclude(params + [p.grad for p in params if p.grad is not None])
        except Exception as exc:
            self.notes.append(
                f"could not read {path or 'the optimizer'}'s param_groups ({one_line(exc)})"
            )

    def _tensor(self, t: torch.Tensor, path: str, owner: int | None) -> None:
        if id(t) in self.excluded_ids:
            return
        key, nbytes = self._storage(t, path)
        if key is None or key in self.excluded_storages:
            return
        # One element is a scalar (module docstring); a storage is counted once, at full size.
        self.storages.setdefault(key, (nbytes, nbytes <= t.element_size()))
        self.sightings.append((id(t), key, owner, path or "<the optimizer>"))
        self.seen.add(id(t))

    def _storage(self, t: torch.Tensor, path: str) -> tuple[tuple | None, int]:
        """(storage key, storage bytes); (None, 0) when it cannot be measured (noted)."""
        try:
            local = getattr(t, "_local_tensor", None)
            if _is_tensor(local):  # a DTensor (FSDP2's state): its memory is this rank's shard
                t = local
            if t.layout != torch.strided:
                raise TypeError(f"layout {t.layout} is not measured")
            storage = t.untyped_storage()
            nbytes, ptr = storage.nbytes(), storage.data_ptr()
            if nbytes == 0 or ptr == 0:  # empty (or meta): no memory to share or count
                return ("empty", id(t)), 0
            return (storage.device.type, storage.device.index, ptr), nbytes
        except Exception as exc:
            if path:
                self.notes.append(f"could not measure the tensor at {path} ({one_line(exc)})")
            return None, 0

    def _label(self, key: object) -> str:
        if _is_tensor(key):
            index = self.param_index.get(id(key))
            return "tensor" if index is None else f"param {index}"
        if issubclass(type(key), (str, int, float, bool)):
            return repr(key)[:40]
        return type(key).__name__

    def result(self) -> StateBytes:
        notes = self.notes[:_NOTES]
        if len(self.notes) > _NOTES:
            notes.append(f"and {len(self.notes) - _NOTES} more")
        if self.limited:
            notes.insert(0, self.limited)
        live = [
            (tid, key, owner, path)
            for tid, key, owner, path in self.sightings
            if tid not in self.excluded_ids and key not in self.excluded_storages
        ]
        tensors, paths = set(), []
        for tid, _, _, path in live:
            if tid not in tensors and len(paths) < _PATH_EXAMPLES:
                paths.append(path)
            tensors.add(tid)
        counted = [self.storages[key] for key in {key for _, key, _, _ in live}]
        found = {owner for _, _, owner, _ in live if owner is not None}
        owners = tuple(sorted(found)) if found or not tensors else None
        return StateBytes(
            sum(n for n, _ in counted),
            len(tensors),
            owners,
            "; ".join(notes),
            tuple(paths),
            sum(n for n, scalar in counted if scalar),
            *self._copies(live),
        )

    def _copies(self, live: list) -> tuple[tuple[str, ...], int]:
        """`StateBytes.copy` and `copy_bytes`: one parameter's state of one name found in
        several storages of more than one element."""
        first: dict[tuple, tuple] = {}
        extra: set[tuple] = set()
        paths: tuple[str, ...] = ()
        for _, key, owner, path in live:
            if owner is None or self.storages[key][1]:  # whose it is unknown, or a scalar
                continue
            at = path.find(f"[param {owner}]")
            name = (owner, path[at + len(f"[param {owner}]") :] if at >= 0 else path)
            seen = first.setdefault(name, (key, path))
            if seen[0] != key and key not in extra:
                extra.add(key)
                paths = paths or (seen[1], path)
        return paths, sum(self.storages[key][0] for key in extra)


def _is_tensor(obj: object) -> bool:
    # type(), not isinstance(): isinstance consults obj.__class__, which user code can override.
    return issubclass(type(obj), torch.Tensor)


def _slot_names(kind: type) -> list[str]:
    names: list[str] = []
    for klass in kind.__mro__:
        slots = klass.__dict__.get("__slots__", ())
        slots = [slots] if isinstance(slots, str) else list(slots)
        names += [s for s in slots if s not in ("__dict__", "__weakref__")]
    return names
