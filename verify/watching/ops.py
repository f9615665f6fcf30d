"""The collectives the tracer wraps, and what it records of each: the tensor argument whose
shape is recorded, the peer argument, whether it is point-to-point; which of them may see
different shapes on different ranks, and which have a root (read by the diagnosis)."""

from __future__ import annotations

# op -> (tensor argument whose shape is recorded, peer argument, is point-to-point)
OPS: dict[str, tuple[str | None, str | None, bool]] = {
    "all_reduce": ("tensor", None, False),
    "all_reduce_coalesced": (None, None, False),
    "reduce": ("tensor", "dst", False),
    "broadcast": ("tensor", "src", False),
    "all_gather": ("tensor", None, False),
    "all_gather_into_tensor": ("input_tensor", None, False),
    "_all_gather_base": ("input_tensor", None, False),
    "reduce_scatter": ("output", None, False),
    "reduce_scatter_tensor": ("input", None, False),
    "_reduce_scatter_base": ("input", None, False),
    "all_to_all": (None, None, False),
    "all_to_all_single": ("input", None, False),
    "gather": ("tensor", "dst", False),
    "scatter": ("tensor", "src", False),
    "barrier": (None, None, False),
    "monitored_barrier": (None, None, False),
    "all_gather_object": (None, None, False),
    "broadcast_object_list": (None, "src", False),
    "gather_object": (None, "dst", False),
    "scatter_object_list": (None, "src", False),
    "send": ("tensor", "dst", True),
    "recv": ("tensor", "src", True),
    "isend": ("tensor", "dst", True),
    "irecv": ("tensor", "src", True),
    "batch_isend_irecv": (None, None, True),
}
# Ops whose tensors may legitimately differ in size across ranks: their shapes are not compared.
UNEVEN_OPS = frozenset(
    {"all_to_all", "all_to_all_single", "gather", "scatter", "all_reduce_coalesced"}
) | {op for op in OPS if op.endswith(("_object", "_object_list"))}
ROOTED_OPS = frozenset(op for op, (_, peer, p2p) in OPS.items() if peer and not p2p)
