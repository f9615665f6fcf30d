"""Bitwise or within a tolerance: how two recordings are compared, and why
(docs/compare.md, "Bitwise, or within what tolerance").

Two runs can be bitwise equal only when they compute every sum in the same order: the same
world size (DDP's all-reduce adds the ranks' gradients in its own order), the same
micro-steps per optimizer step (accumulation adds micro-batch gradients one by one), the same
torch build, intra-op threads and device (a CPU matmul splits its reduction by threads), and
both eager or both compiled (torch.compile fuses kernels and reorders reductions). Then any
difference at all is a departure, decided on the engine's fingerprints.

Otherwise the summation order changed, and a float result may change in its last bits at
each step. A tensor then agrees when its sketch (`sketch.gaps`: a lower bound, per block, on
the relative L2 difference) stays within

    eps(dtype, j) = C(dtype) * u(dtype) * sqrt(j + 1)

at the j-th compared step, where u is the dtype's unit roundoff (2**-24 for float32) and:

- C = 2**12 for float32 and float64: reordering a sum of n terms changes it by about
  sqrt(n) * u relative to the sum of magnitudes (random rounding errors, Higham, "Accuracy
  and Stability of Numerical Algorithms", 2nd ed., section 4.2). The reductions of a
  training step (a matmul's inner dimension, a batch's samples and tokens, the ranks and
  micro-steps) reach n ~ 2**20 on the models this runs on: sqrt(n) = 2**10, times 4 for the
  gap between the sum of magnitudes and the magnitude of the sum that cancellation brings
  in a gradient. float32: eps = 2.4e-4 at step 0.
- C = 4 for 16-bit floats: their results are computed in float32 and rounded to 16 bits, so
  a reordering shows as a rounding of the stored value: a few units of its roundoff.
- sqrt(j + 1): the runs' rounding differences of successive steps are independent and add
  up as a random walk in the parameters (an optimizer such as AdamW does not amplify a
  relative difference of its gradients in one step).

The dtype is that of the lowest precision that touched the computation (`precision`): the
tensor's own, or the dtype autocast ran the forward in, in either run (`precision.py`).
Under `torch.autocast(dtype=torch.bfloat16)` a float32 gradient is a sum of products of
bfloat16 operands, each product's output rounded to bfloat16 (C = 4, u = 2**-8, as for a
bfloat16 tensor): a reordering moves it by bfloat16's roundings, float32's tolerance would
call it a departure.

Settings (`param_groups[g].lr`, ...) and integer tensors are exact in both modes: no
summation order changes them. The loss is judged like a float tensor of the run. A
real bug is orders of magnitude beyond eps (a mis-normalized loss: 1e-2 and more at step 0;
a wrong lr: exact), so the tolerance does not hide one; a difference of the size of
rounding, after many steps, is not a bug and is not reported as one.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

UNIT_ROUNDOFF = {
    "float64": 2.0**-53, "float32": 2.0**-24, "float16": 2.0**-11, "bfloat16": 2.0**-8,
}  # fmt: skip
WIDE, NARROW = 2.0**12, 4.0  # C for 32/64-bit and for 16-bit floats (module docstring)


@dataclass(frozen=True)
class Mode:
    """How two recordings are compared: `bitwise`, or within `eps`; `reason` says why."""

    bitwise: bool
    reason: str


def mode(a: dict, b: dict, steps_a: range, steps_b: range) -> Mode:
    """Bitwise when nothing that sets the summation order differs between the two runs'
    manifests (`a`, `b`) over the compared steps (module docstring)."""
    differ = []
    if a["world_size"] != b["world_size"]:
        differ.append(f"world size {a['world_size']} vs {b['world_size']}")
    micro_a = [_at(a["micro_steps"], s) for s in steps_a]
    micro_b = [_at(b["micro_steps"], s) for s in steps_b]
    if micro_a != micro_b:
        differ.append(f"micro-steps per step {_few(micro_a)} vs {_few(micro_b)}")
    for key, what in (("torch", "torch"), ("threads", "threads per rank"), ("device", "device")):
        if a.get(key) != b.get(key):
            differ.append(f"{what} {a.get(key)} vs {b.get(key)}")
    if a.get("compiled") != b.get("compiled"):
        which = "the recording" if a.get("compiled") else "this run"
        differ.append(f"torch.compile in {which} only")
    if not differ:
        return Mode(True, "same world size, micro-steps, torch, threads and device: the "
                          "sums run in the same order")  # fmt: skip
    return Mode(False, "; ".join(differ) + ": the summation order changed")


@dataclass(frozen=True)
class Precision:
    """The dtype autocast ran in, in either run (None: no autocast, each tensor's own dtype
    sets its tolerance); `reason` says which run used it."""

    autocast: str | None
    reason: str = ""

    def of(self, dtype: str) -> str:
        """The dtype whose tolerance a float tensor of `dtype` is judged by (integers and
        text stay exact)."""
        if self.autocast is None or dtype not in UNIT_ROUNDOFF:
            return dtype
        return coarsest({dtype, self.autocast})


def precision(a: dict, b: dict) -> Precision:
    """From the two runs' manifests: the coarsest autocast dtype either entered."""
    seen_a, seen_b = set(a.get("autocast") or ()), set(b.get("autocast") or ())
    if not (seen_a | seen_b):
        return Precision(None)
    dtype = coarsest(seen_a | seen_b)
    runs = [w for w, seen in (("the recording", seen_a), ("this run", seen_b)) if seen]
    where = " and ".join(runs) if len(runs) == 1 else "both runs"
    return Precision(dtype, f"the forward ran under autocast to {dtype} in {where}: "
                            f"{dtype}'s tolerance")  # fmt: skip


def eps(dtype: str, j: int) -> float:
    """The tolerance of a tensor of `dtype` at the j-th compared step (module docstring);
    0 for integers (exact)."""
    u = UNIT_ROUNDOFF.get(dtype)
    if u is None:
        return 0.0
    return (NARROW if u > 2.0**-20 else WIDE) * u * math.sqrt(j + 1)


def coarsest(dtypes) -> str:
    """The float dtype with the largest roundoff among `dtypes` (float32 when none)."""
    floats = [d for d in dtypes if d in UNIT_ROUNDOFF]
    return max(floats, key=UNIT_ROUNDOFF.get, default="float32")


def _at(values: list, i: int):
    return values[i] if 0 <= i < len(values) else None


def _few(values: list) -> str:
    distinct = sorted({v for v in values if v is not None})
    return "/".join(str(v) for v in distinct) or "?"
