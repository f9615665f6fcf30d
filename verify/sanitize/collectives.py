"""What each collective does to the tensors it is given, and adversarial completion.

`ROLES` says, per collective, which arguments it reads and which it writes. An async
collective holds them from issue to completion (`Work.wait()`, or its future completing):
memory it only reads must not be written meanwhile; memory it writes must not be read or
written. Rooted ops depend on the rank: `broadcast` reads on its source and writes elsewhere;
`reduce` writes on its destination and only reads elsewhere (whatever the backend leaves in a
non-destination buffer is unspecified, and adversarial completion leaves it untouched).

Adversarial completion (`Call.substitute`) gives the real collective private clones of the
user's tensors: it reads the values they had at issue, and nothing lands in the user's tensors
until completion copies the private results back (`Flight.copies`). A race therefore changes
the numbers the same way on every run.
"""

from __future__ import annotations

import inspect
import threading
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from verify.sanitize.access import storage_key
from verify.sanitize.findings import CollectiveRef

READ, WRITE, READ_ON_SRC, WRITE_ON_DST = "read", "write", "read on src", "write on dst"

ROLES: dict[str, dict[str, str]] = {
    "all_reduce": {"tensor": WRITE},
    "all_reduce_coalesced": {"tensors": WRITE},
    "broadcast": {"tensor": READ_ON_SRC},
    "reduce": {"tensor": WRITE_ON_DST},
    "all_gather": {"tensor_list": WRITE, "tensor": READ},
    "all_gather_into_tensor": {"output_tensor": WRITE, "input_tensor": READ},
    "_all_gather_base": {"output_tensor": WRITE, "input_tensor": READ},
    "gather": {"tensor": READ, "gather_list": WRITE},  # the list is None off the destination
    "scatter": {"tensor": WRITE, "scatter_list": READ},  # the list is None off the source
    "reduce_scatter": {"output": WRITE, "input_list": READ},
    "reduce_scatter_tensor": {"output": WRITE, "input": READ},
    "_reduce_scatter_base": {"output": WRITE, "input": READ},
    "all_to_all": {"output_tensor_list": WRITE, "input_tensor_list": READ},
    "all_to_all_single": {"output": WRITE, "input": READ},
    "isend": {"tensor": READ},
    "irecv": {"tensor": WRITE},
    "send": {"tensor": READ},
    "recv": {"tensor": WRITE},
    "batch_isend_irecv": {"p2p_op_list": "isend: read, irecv: write"},
}
# Numbered like the others (so sequence numbers match across ranks) but never tracked.
COUNTED_ONLY = (
    "barrier", "monitored_barrier", "all_gather_object", "broadcast_object_list",
    "gather_object", "scatter_object_list",
)  # fmt: skip
ALWAYS_ASYNC = frozenset({"isend", "irecv", "batch_isend_irecv"})
P2P = frozenset({"isend", "irecv", "send", "recv", "batch_isend_irecv"})
_PEER = {"isend": "dst", "send": "dst", "irecv": "src", "recv": "src"}


class Part:
    """One tensor a call hands to the backend: the user's, and the private stand-in."""

    __slots__ = ("index", "user", "written", "private")

    def __init__(self, index: int, user: torch.Tensor, written: bool) -> None:
        self.index = index  # which P2POp of a batch (0 for other ops)
        self.user = user
        self.written = written
        self.private: torch.Tensor | None = None


class Call:
    """One collective call with its arguments bound by name (raises TypeError on bad ones)."""

    def __init__(self, name: str, sig: inspect.Signature, args: tuple, kwargs: dict) -> None:
        self.name = name
        self._params = sig.parameters
        self.bound = sig.bind(*args, **kwargs)

    def get(self, key: str):
        if key in self.bound.arguments:
            return self.bound.arguments[key]
        param = self._params.get(key)
        return None if param is None or param.default is param.empty else param.default

    @property
    def is_async(self) -> bool:
        return self.name in ALWAYS_ASYNC or bool(self.get("async_op"))

    def group(self):
        if self.name == "batch_isend_irecv":
            ops = self.get("p2p_op_list")
            return ops[0].group if ops else None
        return self.get("group")

    def peer(self) -> int | None:
        """Global rank of the other side of a point-to-point op, or a rooted op's root."""
        key = _PEER.get(self.name) or ("src" if "src" in self._params else None)
        key = key or ("dst" if "dst" in self._params else None)
        if key is None:
            return None
        value = self.get(key)
        local = self.get("group_" + key)
        if value is None and local is not None:
            value = dist.get_global_rank(self.group() or dist.group.WORLD, local)
        return value

    def parts(self) -> list[Part]:
        """The tensors this call hands over, with whether the collective writes them."""
        if self.name == "batch_isend_irecv":
            ops = self.get("p2p_op_list") or []
            return [Part(i, op.tensor, _p2p_name(op) == "irecv") for i, op in enumerate(ops)]
        out = []
        for arg, role in ROLES[self.name].items():
            written = role == WRITE
            if role in (READ_ON_SRC, WRITE_ON_DST):
                root = self.peer()
                at_root = root is None or root == dist.get_rank()
                written = not at_root if role == READ_ON_SRC else at_root
            value = self.get(arg)
            tensors = value if isinstance(value, (list, tuple)) else [value]
            out += [Part(0, t, written) for t in tensors if isinstance(t, torch.Tensor)]
        return out

    def substitute(self, parts: list[Part]) -> None:
        """Hand the backend private clones of `parts` (adversarial completion)."""
        clones: dict[int, torch.Tensor] = {}
        for part in parts:  # a tensor passed twice (input and output) gets one clone
            if id(part.user) not in clones:
                clones[id(part.user)] = part.user.clone()
            part.private = clones[id(part.user)]
        if self.name == "batch_isend_irecv":
            ops = []
            for op, part in zip(self.get("p2p_op_list"), parts):
                # P2POp.__new__ re-checks `op` against the module's isend/irecv, which may be
                # wrapped by now: copy the instance instead of constructing one.
                clone = object.__new__(type(op))
                clone.__dict__.update(op.__dict__, tensor=part.private)
                ops.append(clone)
            self.bound.arguments["p2p_op_list"] = ops
            return
        swap = {id(p.user): p.private for p in parts}
        for arg in ROLES[self.name]:
            value = self.bound.arguments.get(arg)
            if isinstance(value, torch.Tensor):
                self.bound.arguments[arg] = swap.get(id(value), value)
            elif isinstance(value, (list, tuple)):
                self.bound.arguments[arg] = [swap.get(id(t), t) for t in value]

    def invoke(self, fn):
        return fn(*self.bound.args, **self.bound.kwargs)


class Numbering:
    """Per-group sequence numbers, as the collective tracer assigns them: collectives per
    group, point-to-point ops per (group, peer), from 1 (here: from install)."""

    def __init__(self) -> None:
        self._seq: dict[object, int] = {}
        self._names: dict[int, str] = {}

    def next(self, call: Call) -> CollectiveRef:
        group = call.group()
        name = self._names.get(id(group))
        if name is None:
            world = group is None or group is dist.group.WORLD
            ranks = "" if world else str(dist.get_process_group_ranks(group)).replace(" ", "")
            name = self._names[id(group)] = "world" if world else "pg" + ranks
        key = (name, call.peer()) if call.name in P2P else name
        self._seq[key] = seq = self._seq.get(key, 0) + 1
        return CollectiveRef(call.name, seq, name)


def _p2p_name(op) -> str:
    return getattr(op.op, "__name__", "")


@dataclass(eq=False)
class Flight:
    """An issued async collective (or one op of a batch) until it completes."""

    collective: CollectiveRef
    issued_at: str
    step: int
    parts: list[Part]
    works: list  # referenced here so that no other object takes their id() while tracked
    unfinished: set[int] = field(init=False)  # id() of works neither waited on nor completed
    claimed: bool = False  # one thread is completing it (or end_step dropped it)
    landed: threading.Event = field(default_factory=threading.Event)  # results copied back

    def __post_init__(self) -> None:
        self.unfinished = {id(w) for w in self.works}

    def main_tensor(self) -> torch.Tensor | None:
        """The tensor to name in a report: the first one the collective writes, if any."""
        written = [p.user for p in self.parts if p.written]
        return (written or [p.user for p in self.parts] or [None])[0]

    def copies(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(user tensor, private result) pairs to write at completion."""
        return [(p.user, p.private) for p in self.parts if p.written and p.private is not None]

    def translate(self, value):
        """A future's value with private tensors (and views of them) replaced by the user's."""
        if isinstance(value, (list, tuple)):
            return type(value)(self.translate(v) for v in value)
        if not isinstance(value, torch.Tensor):
            return value
        for p in self.parts:
            private, user = p.private, p.user
            if private is None:
                continue
            if value is private:
                return user
            same_layout = private.stride() == user.stride() and private.dtype == user.dtype
            if same_layout and storage_key(value) == storage_key(private):
                offset = user.storage_offset() + value.storage_offset() - private.storage_offset()
                return user.as_strided(value.size(), value.stride(), offset)
        return value
