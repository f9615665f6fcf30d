"""The one finding type of every check, the script audit's included: what was measured, typed.

A `Finding` carries its `kind` (`verify/hints/kinds.py`), where it showed (the step and the
phase, every later step it showed at again, and `where`: the line of the user's code for a
class's check, the audit point for a script's), the tensor or setting, the ranks, and what
was measured as `numbers` (JSON values). Its hint is chosen from the kind, the phase and the
numbers, never from the message (`verify/hints/table.py`, `script_audit.py`), and stored on
it, so the text reports and `--json` say the same.

The script audit (`verify/script_audit/`) groups the tensors that newly differ at one audit
point into one finding; its numbers hold the optimizer, how many tensors differ, the first
few of them measured (`TensorDiff`, as dicts) and the index of the earlier finding this one
follows from (`echo_of`). The properties below read them under the names the script audit's
report has always used. A finding of kind "note" (buffers kept per rank by design) is not a
fault; every other kind is.

Imports nothing: a script's rank builds these.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

NOTE = "note"  # the one kind that is not a fault (`kinds.NOTE`)
LAYOUT = "layout"  # a script's ranks audit different sets of tensors (`kinds.AUDIT_LAYOUT`)


@dataclass(frozen=True)
class TensorDiff:
    """One tensor or setting that is not bitwise identical on every rank, as measured: the one
    measured difference of every audit (the class checks' at a checkpoint, `at`; the script
    audit's at an audit point). Its numbers come from `measure.py`.

    `how`: "values" (same dtype and shape, different values), "missing" (None on some ranks),
    "shape" (dtype or shape differ) or "absent" (held by some ranks only: optimizer state),
    with `detail` saying which; `moved`: the fingerprints differed but the copies gathered
    right after are equal on every rank, so something (a collective) still wrote them."""

    name: str
    ranks: tuple[int, ...]  # ranks whose value differs from the reference rank's
    reference_rank: int  # the rank holding the value most ranks hold (the lowest on a tie)
    max_abs_diff: float | None = None  # largest |difference| on any rank, vs the reference
    differing: int | None = None  # elements that differ on at least one rank
    numel: int | None = None
    first_index: tuple[int, ...] | None = None  # first differing element
    values: tuple[str, ...] = ()  # a setting's value on each rank ("rank 0: 0.001")
    scale: float | None = None  # the differing ranks' values are scale x the reference's
    how: str = "values"
    detail: str = ""  # e.g. "the tensor is None on ranks [1]"
    moved: bool = False
    at: str = ""  # the class checks' checkpoint ("step 2 gradients")

    def describe(self) -> str:
        """The script audit's words (its report and hints)."""
        if not self.ranks:  # not described: beyond the detail gathered at its audit point
            return self.name
        s = "s" if len(self.ranks) > 1 else ""
        head = f"{self.name} on rank{s} {rank_list(self.ranks)} vs rank {self.reference_rank}"
        if self.values:
            return f"{head}: {', '.join(self.values)}"
        if self.differing is None:
            return head
        where = "" if self.first_index is None else f", first at {list(self.first_index)}"
        return (f"{head}: max |diff| {self.max_abs_diff:.3g}, {self.differing}/{self.numel} "
                f"elements differ{where}")  # fmt: skip

    def line(self) -> str:
        """The class checks' words: the checkpoint, the tensor, the ranks, how it differs."""
        s = "s" if len(self.ranks) > 1 else ""
        ranks = ", ".join(map(str, self.ranks))
        head = f"{self.at}: {self.name} differs on rank{s} {ranks} (vs rank {self.reference_rank})"
        if self.detail:
            return f"{head}: {self.detail}"
        if self.differing is None:
            return head
        return (f"{head}: max |diff| {self.max_abs_diff:.3g}, {self.differing}/{self.numel} "
                f"elements differ, first at index {list(self.first_index)}")  # fmt: skip

    def as_checkpoint_dict(self) -> dict:
        """The class checks' JSON of it (`mismatches`), under the names it has always had."""
        return {
            "checkpoint": self.at, "tensor": self.name, "ranks": self.ranks,
            "reference_rank": self.reference_rank, "max_abs_diff": self.max_abs_diff,
            "num_different": self.differing, "numel": self.numel,
            "first_index": self.first_index, "detail": self.detail, "kind": self.how, "scale": self.scale, "moved": self.moved,
        }  # fmt: skip

    @classmethod
    def from_dict(cls, d: dict) -> TensorDiff:
        first = d.get("first_index")
        return cls(**{**d, "ranks": tuple(d["ranks"]), "values": tuple(d.get("values", ())),
                      "first_index": None if first is None else tuple(first)})  # fmt: skip


@dataclass(frozen=True)
class Finding:
    """One distinct finding (module docstring).

    Attributes:
        check: "consistency", "equivalence", "shard", "sanitize", "run" (a rank that raised)
            or "audit" (a script's replica audit).
        phase: where in the step it showed: one of `verdict.PHASES` for a class's check, one
            of `hints/phases.py`'s labels for a script's.
        step: the first step it showed at (0: construction; a script's first optimizer step).
        message: one line, self-contained ("step 1 gradients: grad:fc1.weight differs ...").
        tensor: the tensor's (or setting's) name, when it is about one: the first of several.
        ranks: the ranks that differ or failed.
        steps: every step it showed at (the first included).
        where: `path:line (function)` in the user's code, when known; for a script's audit,
            the audit point ("gradients before step 2 (SGD)").
        kind: what was measured, a name from `verify/hints/kinds.py` (the hint table's key).
        numbers: the measured numbers the hint reads (a scale, steps, ranks; JSON values).
        hint: the usual cause and its fix, chosen from kind, phase and numbers.
    """

    check: str
    phase: str
    step: int
    message: str
    tensor: str | None = None
    ranks: tuple[int, ...] = ()
    steps: tuple[int, ...] = ()
    where: str | None = None
    kind: str = ""
    numbers: dict = field(default_factory=dict, hash=False)
    hint: str | None = None

    def describe(self) -> str:
        later = self.seen_at
        if not later:
            return self.message
        shown = ", ".join(map(str, later[:6])) + (", ..." if len(later) > 6 else "")
        return f"{self.message} [again at step{'s' if len(later) > 1 else ''} {shown}]"

    @property
    def seen_at(self) -> tuple[int, ...]:
        """The later steps it showed at again."""
        return tuple(s for s in self.steps if s != self.step)

    @property
    def fault(self) -> bool:
        return self.kind != NOTE

    # --- the script audit's names for its numbers (module docstring) ------------------------
    @property
    def tensors(self) -> tuple[TensorDiff, ...]:
        return tuple(TensorDiff.from_dict(d) for d in self.numbers.get("tensors", ()))

    @property
    def count(self) -> int:
        return self.numbers.get("count", 0)

    @property
    def optimizer(self) -> str:
        return self.numbers.get("optimizer", "")

    @property
    def echo_of(self) -> int | None:
        return self.numbers.get("echo_of")

    @property
    def detail(self) -> str:
        """What differs between the ranks' audited sets (a "layout" finding's message)."""
        return self.message if self.kind == LAYOUT else ""


_SCRIPT_KEYS = ("name", "ranks", "reference_rank", "max_abs_diff", "differing", "numel",
                "first_index", "values", "scale")  # fmt: skip


def diff_numbers(diffs: tuple[TensorDiff, ...]) -> list[dict]:
    """`diffs` as JSON values, for a script audit finding's numbers (the script audit's keys;
    the fields only a class's check fills are left out)."""
    return [{k: v for k, v in asdict(d).items() if k in _SCRIPT_KEYS} for d in diffs]


def rank_list(ranks: tuple[int, ...] | list[int]) -> str:
    """`0, 1, 2`: the ranks named, the first 8 of them and how many more."""
    if len(ranks) > 8:
        return ", ".join(map(str, ranks[:8])) + f" and {len(ranks) - 8} more"
    return ", ".join(map(str, ranks))
