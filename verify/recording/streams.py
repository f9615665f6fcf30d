"""Two captures of one step (`capture.py`), op by op: the first point where they part, and why
the drill-down stops there (docs/compare.md, "The drill-down").

The ops are matched by what ran where (the op, its phase and its module), as the longest
common run of the two streams (`difflib`), so that an op more in one run does not shift
every op after it. In the streams' order, the first point that is not alike is where they
part, and says why:

- `OTHER_OPS`, `ONLY_ONE`: the two ran other ops there (other code: a refactor, a fused
  kernel, a branch one rank takes), or one ran an op the other did not;
- `OTHER_INPUTS`: the op was given other inputs, while every op before it gave the same outputs:
  the difference entered where no op the dispatcher ran made it (the batch, a parameter set
  outside the step, a kernel of a C++ extension), after the last op seen, which the report
  names; or the script passed the op another Python value (`passed_value`);
- `WRITTEN_BELOW`: the same inputs, other outputs, but an input is memory `empty` returned
  that no op the dispatcher saw wrote: a kernel below it filled it;
- `RANDOM`: the same inputs, other outputs, from an op that draws from a random generator:
  the generators' states differ;
- `NONDETERMINISTIC`: the same inputs, other outputs, from an op PyTorch documents as
  non-deterministic on this device (`torch.use_deterministic_algorithms`);
- `DIFFERS`: the same inputs, other outputs, from a deterministic op: the root cause (a
  kernel that changed, another thread count, another dtype).

`UNSEEN` when every op matched: the difference was made below the dispatcher, after the
last op seen.

Two ranks of one run (`first_divergence`) are searched for what replicas must do alike
only: their forward and backward compute from each rank's own batch, so an op counts when
both ranks ran it from the same inputs; only what follows the step's last collective before
the optimizer's step; and when their gradients differ in a step that ran no collective,
that first (`NO_SYNC`), with where else they part beside it. Pure logic over the records:
tested on hand-made captures in milliseconds.
"""

from __future__ import annotations

import difflib
import json
import math
import re
from collections import Counter
from dataclasses import dataclass

_TENSOR = re.compile(r"param |unwritten |\w+ \[")  # how `capture.py` describes a tensor argument
OPTIMIZER = "optimizer"  # `capture.OPTIMIZER` (this module reads records, not torch)
OTHER_OPS, ONLY_ONE, OTHER_INPUTS = "other ops", "only one", "inputs"
RANDOM, NONDETERMINISTIC, DIFFERS, UNSEEN = "random", "nondeterministic", "differs", "unseen"
NO_SYNC = "no collective"  # two ranks whose gradients differ, in a step that ran no collective
WRITTEN_BELOW = "written below"  # the same inputs but memory `empty` gave, written unseen

# ops that draw from a random generator (their base names)
_RANDOM = frozenset({"bernoulli", "native_dropout", "_fused_dropout", "rand", "randn",
                     "randint", "randperm", "rand_like", "randn_like", "randint_like", "normal",
                     "uniform", "exponential", "geometric", "log_normal", "cauchy", "random",
                     "multinomial", "rrelu_with_noise"})  # fmt: skip
# ops torch.use_deterministic_algorithms names as non-deterministic on CUDA (their base names);
# on the CPU PyTorch documents none
_NONDETERMINISTIC_CUDA = frozenset({
    "index_add", "scatter_add", "scatter_reduce", "index_put", "put", "index_copy",
    "embedding_dense_backward", "_embedding_bag_backward", "_embedding_bag_dense_backward",
    "adaptive_avg_pool2d_backward", "adaptive_avg_pool3d_backward",
    "adaptive_max_pool2d_backward", "max_pool3d_with_indices_backward", "avg_pool3d_backward",
    "upsample_linear1d_backward", "upsample_bilinear2d_backward", "upsample_bicubic2d_backward",
    "upsample_trilinear3d_backward", "grid_sampler_2d_backward", "grid_sampler_3d_backward",
    "nll_loss2d_forward", "ctc_loss_backward", "histc", "bincount", "kthvalue", "median",
    "cumsum", "_unsafe_index_put",
})  # fmt: skip


@dataclass(frozen=True)
class Op:
    """One op of a capture (`capture.OpRecord`, as read back)."""

    index: int  # its place in its capture
    phase: str
    module: str
    op: str
    line: str
    inputs: tuple[int, ...]
    args: tuple[str, ...]
    outputs: tuple[int, ...]
    shape: str
    total: float | None = None
    norm: float | None = None

    def arg(self, i: int) -> str:
        """What argument `i` is (`capture.py`'s description), or that there is none."""
        return self.args[i] if 0 <= i < len(self.args) else "no such argument"

    @property
    def base(self) -> str:
        """ "aten.native_dropout.default" -> "native_dropout"; an in-place op's `_` dropped."""
        parts = self.op.split(".")
        return (parts[1] if len(parts) > 1 else parts[0]).rstrip("_")


@dataclass(frozen=True)
class Part:
    """Where two captures first part: the op of the first (`a`) and its match (`b`, None when
    the second ran none), why (module docstring), and the op before it in the first."""

    why: str
    a: Op | None
    b: Op | None
    before: Op | None  # the last op seen alike before it
    argument: int | None = None  # OTHER_INPUTS: the first argument that differs
    compared: int = 0  # ops compared alike before it
    also: Part | None = None  # NO_SYNC: where the ranks part besides, if anywhere

    @property
    def passed_value(self) -> bool:
        """OTHER_INPUTS: the argument that differs is a Python value the script passed (a
        scale, an lr), not a tensor."""
        return self.argument is not None and not _TENSOR.match(self.a.arg(self.argument))

    @property
    def gap(self) -> float | None:
        """A lower bound on the relative L2 difference of the two first floating outputs."""
        a, b = self.a, self.b
        if a is None or b is None or a.norm is None or b.norm is None or a.shape != b.shape:
            return None
        scale = max(a.norm, b.norm)
        if scale == 0:
            return None
        n = max(_numel(a.shape), 1)
        return max(abs(a.norm - b.norm), abs(a.total - b.total) / math.sqrt(n)) / scale


def ops_of(records: list[dict]) -> list[Op]:
    """A capture's `ops` (`capture.Capture.write`), as `Op`s."""
    fields = ("phase", "module", "op", "line", "shape", "total", "norm")
    return [
        Op(
            i,
            **{f: r.get(f) for f in fields},
            inputs=tuple(r["inputs"]),
            args=tuple(r["args"]),
            outputs=tuple(r["outputs"]),
        )  # fmt: skip
        for i, r in enumerate(records)
    ]


def first_part(a: list[Op], b: list[Op], device: str = "cpu") -> Part | None:
    """Where the captures `a` and `b` of one step first part (module docstring), or None when
    every op matched and neither ran one the other did not."""
    where = difflib.SequenceMatcher(None, [_at(x) for x in a], [_at(y) for y in b], autojunk=False)
    before, compared = None, 0
    for tag, i1, i2, j1, j2 in where.get_opcodes():
        if tag != "equal":
            x, y = (a[i1] if i1 < i2 else None), (b[j1] if j1 < j2 else None)
            why = OTHER_OPS if x is not None and y is not None else ONLY_ONE
            return Part(why, x, y, before, compared=compared)
        for x, y in zip(a[i1:i2], b[j1:j2]):
            if x.inputs != y.inputs:
                return Part(OTHER_INPUTS, x, y, before, argument=_first_apart(x, y),
                            compared=compared)  # fmt: skip
            if x.outputs != y.outputs:
                return Part(_why(x, device), x, y, before, compared=compared)
            before, compared = x, compared + 1
    return None


def first_divergence(a: list[Op], b: list[Op], synced: bool, device: str = "cpu") -> Part | None:
    """Where two ranks' captures of one step first part, counting only what replicas must do
    alike: an op both ranks ran from the same inputs (each rank's own batch makes the rest
    differ by design) that gave other outputs; an op one rank ran alone, or another op, in the
    optimizer's step or writing a parameter (elsewhere one rank's logging or evaluation runs
    ops alone). `synced`: the ranks' gradients agreed, so a collective made them so: only
    what follows the step's last collective before the optimizer's step is searched."""
    starts = [_after_sync(ops) for ops in (a, b)]
    if not synced and starts == [0, 0]:  # the gradients differ and no collective ran
        found = first_divergence(a, b, True, device)  # (what else parts, said beside it)
        return Part(NO_SYNC, a[0] if a else None, b[0] if b else None, None, also=found)
    a, b = (ops[start:] for ops, start in zip((a, b), starts))
    where = difflib.SequenceMatcher(None, [_at(x) for x in a], [_at(y) for y in b], autojunk=False)
    before = None
    for tag, i1, i2, j1, j2 in where.get_opcodes():
        if tag != "equal":
            alone = [(x, None) for x in a[i1:i2]] + [(None, y) for y in b[j1:j2]]
            hit = next(((x, y) for x, y in alone if _must_match(x or y)), None)
            if hit is not None:
                return Part(ONLY_ONE, *hit, before)
            continue
        for x, y in zip(a[i1:i2], b[j1:j2]):
            if x.inputs == y.inputs and x.outputs != y.outputs:
                return Part(_why(x, device), x, y, before)
            if x.inputs == y.inputs:
                before = x
    return None


def _first_apart(x: Op, y: Op) -> int:
    """The first argument of two matched ops that differs (a count that differs: the first
    argument one has and the other has not)."""
    apart = (i for i, (p, q) in enumerate(zip(x.inputs, y.inputs)) if p != q)
    return next(apart, min(len(x.inputs), len(y.inputs)))


def _after_sync(ops: list[Op]) -> int:
    """The index after the last collective that comes before the optimizer's step (0: none)."""
    end = next((i for i, o in enumerate(ops) if o.phase == OPTIMIZER), len(ops))
    synced = [i for i, o in enumerate(ops[:end]) if o.op.startswith("c10d.")]
    return synced[-1] + 1 if synced else 0


def _must_match(op: Op) -> bool:
    in_place = op.op.split(".")[1].endswith("_")
    return op.phase == OPTIMIZER or (in_place and bool(op.args) and op.args[0].startswith("param "))


def _why(op: Op, device: str) -> str:
    if op.base in _RANDOM:
        return RANDOM
    if any(a.startswith("unwritten ") for a in op.args):  # filled where no op was seen
        return WRITTEN_BELOW
    if device == "cuda" and op.base in _NONDETERMINISTIC_CUDA:
        return NONDETERMINISTIC
    return DIFFERS


def boundary(a: dict, b: dict) -> dict | None:
    """The module boundary where captures `a` and `b` (`capture.Capture.write`'s) first part:
    the first module call to return, in A's order (matched by module and its n-th call), whose
    output differs while its inputs matched (`how`: "forward": an inner module's before the
    model's around it), else the first module whose output's gradient differs, in the order
    the backward reached them ("gradient"); None if neither."""
    theirs = {key: c for key, c in _numbered(b["calls"])}
    parted = [c for key, c in _numbered(a["calls"]) if (d := theirs.get(key)) is not None
              and c["inputs"] == d["inputs"] and c["outputs"] != d["outputs"]]  # fmt: skip
    if parted:
        return {**min(parted, key=lambda c: c.get("ended", -1)), "how": "forward"}
    kinds = {c["module"]: c for c in a["calls"]}
    grads = {key: g for key, g in _numbered(b.get("grads", []))}
    for key, g in _numbered(a.get("grads", [])):
        h = grads.get(key)
        if h is not None and g["gradient"] != h["gradient"]:
            call = kinds.get(g["module"], {"module": g["module"], "kind": "", "line": ""})
            return {**call, "how": "gradient"}
    return None


def _numbered(records: list[dict]):
    """(module, the n-th record of that module), record: in order."""
    seen: Counter = Counter()
    for r in records:
        yield (r["module"], seen[r["module"]]), r
        seen[r["module"]] += 1


def _at(op: Op) -> tuple[str, str, str]:
    return op.phase, op.module, op.op


def _numel(shape: str) -> int:
    dims = json.loads(shape.split(" ", 1)[1]) if " " in shape else []
    return math.prod(dims)
