"""Were the two runs given the same batches? The first step and micro-step where what the
model's forward was given differs (docs/compare.md, "The batch"), said before the first
departure: "the batches differ from step k, micro-step m" is a different finding from "the
same batches, different gradients".

Each recorded step's global batch (`batch.py`: the union of the ranks' inputs in rank order,
per micro-step) is compared, over the compared steps in order, input by input:

- the same number of micro-steps in both runs: micro-step by micro-step. The same samples in
  the same order agree; the same samples in another order (the two numbers of `batch.py`:
  only the unordered one equal) and other samples are the two ways they differ;
- other numbers of micro-steps (1 rank x 4 micro-steps against 2 x 2): the step's whole
  global batch, in any order (micro-steps and ranks split it differently, so no order is
  shared); the samples agree or not;
- an input one run has and the other lacks, or of another dtype or sample shape: the model
  is given other inputs.

A recording without batches (written before they were recorded) gives None: the comparison
then says nothing about batches, as before. What the difference does to the verdict: nothing;
the departures decide it (a batch in another order can give gradients within tolerance).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from verify.recording.store import Recording

ORDER = "order"  # the same samples in another order
SAMPLES = "samples"  # other samples
INPUTS = "inputs"  # an input one run lacks, or of another dtype or sample shape


@dataclass(frozen=True)
class BatchDifference:
    """Where the batches first differ."""

    step: int  # A's step (the recording's numbering)
    step_b: int
    micro: int | None  # None: compared as the step's whole global batch
    name: str  # the input, as the call spells it (`args[0]`, `kwargs['labels']`)
    how: str  # ORDER, SAMPLES or INPUTS
    what: str
    # each run's samples and norm of the input, and micro-steps of the step
    numbers: dict = field(default_factory=dict)


@dataclass(frozen=True)
class Batches:
    """What the comparison of the batches found, over `steps` compared steps (those both
    runs recorded batches at)."""

    steps: int
    first: BatchDifference | None = None
    dropped: tuple[int, int] = (0, 0)  # inputs beyond batch.SLOTS a step, not recorded


@dataclass(frozen=True)
class _Seen:
    micro: int
    name: str
    dtype: str
    shape: tuple
    samples: int
    ordered: int
    unordered: int
    norm: float


def compare_batches(a: Recording, b: Recording, steps_a: range, steps_b: range) -> Batches | None:
    """The batches of B against A over the compared steps (module docstring); None when
    either recording has none."""
    if a.batches is None or b.batches is None:
        return None
    by_a, by_b = _by_step(a), _by_step(b)
    compared = 0
    for sa, sb in zip(steps_a, steps_b):
        seen_a, seen_b = by_a.get(sa), by_b.get(sb)
        if not seen_a or not seen_b:
            continue
        compared += 1
        found = _differs(seen_a, seen_b, sa, sb)
        if found is not None:
            return Batches(compared, found, _dropped(a, b))
    return Batches(compared, None, _dropped(a, b))


def _dropped(a: Recording, b: Recording) -> tuple[int, int]:
    return a.meta["batches"]["dropped"], b.meta["batches"]["dropped"]


def _by_step(rec: Recording) -> dict[int, list[_Seen]]:
    t, out = rec.batches, {}
    for i in range(len(t["step"])):
        name, dtype, shape = rec.keys[int(t["key"][i])]
        seen = _Seen(int(t["micro"][i]), name, dtype, tuple(shape), int(t["samples"][i]),
                     int(t["hash"][i]), int(t["unordered"][i]), float(t["norm"][i]))  # fmt: skip
        out.setdefault(int(t["step"][i]), []).append(seen)
    return out


def _differs(seen_a: list[_Seen], seen_b: list[_Seen], sa: int, sb: int):
    """The first difference of one compared step's batches, or None."""
    micro_a = len({s.micro for s in seen_a})
    micro_b = len({s.micro for s in seen_b})
    counts = {"micro_steps_recording": micro_a, "micro_steps": micro_b}
    if micro_a == micro_b:
        groups = [(m, [s for s in seen_a if s.micro == m], [s for s in seen_b if s.micro == m])
                  for m in sorted({s.micro for s in seen_a})]  # fmt: skip
    else:
        groups = [(None, _whole(seen_a), _whole(seen_b))]
    for micro, in_a, in_b in groups:
        named_a, named_b = {s.name: s for s in in_a}, {s.name: s for s in in_b}
        for name in list(named_a) + [n for n in named_b if n not in named_a]:
            how, what, numbers = _judge(named_a.get(name), named_b.get(name), micro is not None)
            if how is not None:
                return BatchDifference(sa, sb, micro, name, how, what, numbers | counts)
    return None


def _whole(seen: list[_Seen]) -> list[_Seen]:
    """Each input's samples over all micro-steps of a step, in any order."""
    out: dict[str, _Seen] = {}
    for s in seen:
        was = out.get(s.name)
        if was is None or (was.dtype, was.shape) != (s.dtype, s.shape):
            out[s.name] = s if was is None else _Seen(0, s.name, "mixed", (), 0, 0, 0, 0.0)
            continue
        out[s.name] = _Seen(0, s.name, s.dtype, s.shape, was.samples + s.samples, 0,
                            (was.unordered + s.unordered + 2**63) % 2**64 - 2**63,
                            float(np.hypot(was.norm, s.norm)))  # fmt: skip
    return list(out.values())


def _judge(sa: _Seen | None, sb: _Seen | None, ordered: bool):
    """(how, what, numbers) of one input in both runs; how None when it agrees."""
    if sa is None or sb is None or (sa.dtype, sa.shape) != (sb.dtype, sb.shape):
        return INPUTS, f"{_layout(sa)} in the recording, {_layout(sb)} in this run", {}
    numbers = {"samples_recording": sa.samples, "samples": sb.samples,
               "norm_recording": sa.norm, "norm": sb.norm}  # fmt: skip
    same_set = sa.samples == sb.samples and sa.unordered == sb.unordered
    if same_set and (not ordered or sa.ordered == sb.ordered):
        return None, "", numbers
    if same_set:
        return ORDER, f"the same {_samples(sa.samples)} in another order", numbers
    count = (f"{sa.samples} in both runs" if sa.samples == sb.samples
             else f"{sa.samples} in the recording, {sb.samples} in this run")  # fmt: skip
    return SAMPLES, f"other samples ({count}; norm {sa.norm:.7g} vs {sb.norm:.7g})", numbers


def _layout(s: _Seen | None) -> str:
    return "absent" if s is None else f"{s.dtype} {list(s.shape)} a sample"


def _samples(n: int) -> str:
    return f"{n} sample{'s' if n != 1 else ''}"
