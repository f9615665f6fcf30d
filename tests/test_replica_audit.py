"""The replica audit's one engine (`verify/replica_audit/`): one fingerprint and one agreement
reduction serve the class audit, the matrix's agreement, the shard-layout check and the script
audit, so a change one audit sees, the other sees too, and agreement costs the same whatever
the world size; a script's finding is the one `Finding` every check reports."""

from __future__ import annotations

import ast
import importlib
import importlib.util
from dataclasses import fields
from pathlib import Path

import pytest
import torch

from verify.checks import audit as class_audit
from verify.checks.audit import ModelAudit
from verify.checks.script_audit import AuditOptions, check_audit
from verify.launching import launch
from verify.replica_audit import compare as compare_module
from verify.replica_audit.compare import Auditor, Entry, compare
from verify.replica_audit.finding import Finding
from verify.replica_audit.fingerprint import fingerprint, fingerprint_table, fingerprints
from verify.replica_audit.group import WorldGroup, agree, min_max
from verify.script_audit import hooks as script_hooks
from verify.script_audit import report
from verify.script_audit.side_group import SideGroup


def stencil_on_rows(t: torch.Tensor) -> torch.Tensor:
    """`t` with a [+1, -2, +1] stencil added to the first word of three consecutive 256-word
    rows: every row sum changes, the total does not, and neither does a sum weighted by row
    index (1 - 4 + 3 = 0), the class audit's old blind spot on tensors above 64K words."""
    out = t.clone()
    words = out.view(-1).view(torch.int64)
    words[0] += 1
    words[256] -= 2
    words[512] += 1
    return out


def test_one_auditor_one_fingerprint_and_one_comparison_serve_every_audit():
    """A class's checkpoints and a script's audit points are compared by the engine's one
    Auditor (the only class named *Auditor in the product), over one fingerprint table (three
    values a tensor, mixed into one integer); neither audit keeps a fingerprint, a comparison
    or an auditor of its own. Each script's hooks hold their own, at the script's detail
    budget (a class's: `rank_stencil_on_one_rank`)."""
    assert class_audit.Auditor is script_hooks.Auditor is Auditor
    one, two = (script_hooks.StepHooks(report.AuditSettings()) for _ in range(2))
    assert (one.auditor.max_detail, one.auditor.per_phase) == (12, 3)
    assert one.auditor.group is one.group and one.auditor.sizes is not two.auditor.sizes
    named = [
        (path, node.name)
        for path in sorted((Path(__file__).resolve().parents[1] / "verify").rglob("*.py"))
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.ClassDef) and node.name.endswith("Auditor")
    ]
    assert [(p.name, n) for p, n in named] == [("compare.py", "Auditor")], named
    assert not hasattr(class_audit, "compare") and not hasattr(script_hooks, "compare")
    for gone in ("verify.script_audit.fingerprint", "verify.script_audit.compare"):
        with pytest.raises(ModuleNotFoundError):
            importlib.import_module(gone)
    assert not hasattr(class_audit, "compare_gathered")
    # the ranks are reached through the group interface only (a class's names too, once they
    # differ: `gather_whole_texts`), never by pickled objects of their own
    engine = [Path(class_audit.__file__), *Path(compare_module.__file__).parent.glob("*.py")]
    calls = {
        (path.name, node.attr)
        for path in engine
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Attribute) and node.attr.endswith("_object")
    }
    assert not calls, calls
    ts = [torch.randn(300, 1000), torch.arange(7), None]
    table = fingerprint_table(ts, torch.device("cpu"))
    assert [tuple(row) for row in table.tolist()] == [tuple(fingerprint(t).tolist()) for t in ts]
    assert table[2].tolist() == [-1, 0, 0]  # a tensor this rank does not hold


def test_changes_that_cancel_across_rows_of_a_large_tensor_are_caught():
    """A large tensor (150,000 words): changes to three rows that keep the total and the
    row-index-weighted sum. Each row's sum has its own odd weight, so both audits see it."""
    big = torch.randn(300, 1000, generator=torch.Generator().manual_seed(3))
    changed = stencil_on_rows(big)
    assert not torch.equal(fingerprint(changed), fingerprint(big))
    assert fingerprints([changed]) != fingerprints([big])


def rank_stencil_on_one_rank(ctx):
    """World 2. Rank 1 holds a copy of a large weight with the stencil applied (a correction
    a hand-written optimizer applied on one rank only); a second weight is the same on both
    ranks, but rank 0 holds it as a view at an odd offset of a flat buffer (the same bits,
    elsewhere in memory). The first must be named, the second never."""
    weight = torch.randn(300, 1000, generator=torch.Generator().manual_seed(4))
    if ctx.rank == 1:
        weight = stencil_on_rows(weight)
    bias = torch.randn(999, generator=torch.Generator().manual_seed(5))
    if ctx.rank == 0:
        flat = torch.cat([torch.zeros(1), bias])
        bias = flat[1:]  # 4 bytes in: not aligned to an 8-byte word
    audit = ModelAudit(torch.nn.Linear(1, 1))
    assert (audit.auditor.max_detail, audit.auditor.per_phase) == (8, 8)  # a class's budget
    _, found = audit.audit("step 1", [("w", weight), ("b", bias)])
    return [(m.name, m.ranks, m.differing) for m in found]


def stencil_problems() -> list[str]:
    """What is wrong with the class audit's verdicts on `rank_stencil_on_one_rank`: rank 1
    named for `w` in 3 elements on every rank, nothing said of `b` (also run under load,
    `tests/test_load.py`)."""
    run = launch(rank_stencil_on_one_rank, world_size=2, timeout_s=240)
    if not run.ok:
        return [run.summary()]
    # On a tie of two ranks the lower one is the reference: rank 1 differs, in 3 elements.
    want = [("w", (1,), 3)]
    return [
        f"rank {r}: {found} (want {want})" for r, found in enumerate(run.values) if found != want
    ]


@pytest.mark.under_load
def test_the_class_audit_names_a_rank_whose_rows_changed_in_a_cancelling_pattern():
    assert not stencil_problems()


def rank_measure_both_ways(ctx):
    """World 3. Rank 2's copy of `w` holds -0.0 where the others hold 0.0 and 6 where they
    hold 4; `v` differs on rank 1 by a factor of 2 (a gradient scaled on one rank). Both
    hold a NaN, bitwise alike on every rank. Measured by the class audit and by the script
    audit's audit point over its side group."""
    w = torch.tensor([0.0, float("nan"), 1.0, 6.0 if ctx.rank == 2 else 4.0])
    if ctx.rank == 2:
        w[0] = -0.0
    v = torch.tensor([1.0, -3.0, 0.5]) * (2.0 if ctx.rank == 1 else 1.0)
    _, found = ModelAudit(torch.nn.Linear(1, 1)).audit("step 1", [("w", w), ("v", v)])
    group = SideGroup()
    assert group.ready()
    entries = [Entry("gradients", "w", w), Entry("gradients", "v", v)]
    outcome = compare(group, entries, (0, 0, 0))
    return [_measured(d) for d in found], [_measured(outcome.diffs[i]) for i in (0, 1)]


def _measured(d) -> tuple:
    return (d.name, d.ranks, d.reference_rank, d.max_abs_diff, d.differing, d.first_index,
            d.scale)  # fmt: skip


def test_both_audits_measure_a_difference_alike_and_bitwise():
    """One type (`TensorDiff`) and one measure (`replica_audit/measure.py`) for both audits:
    elements compared bitwise, as the fingerprints that flagged the tensor compare them
    (-0.0 is not 0.0; a NaN with the same bits is no difference, and no infinite one), the
    largest difference over the differing elements, the one factor of a scaled copy."""
    assert importlib.util.find_spec("verify.checks.mismatch") is None
    assert not measure_problems()


def measure_problems() -> list[str]:
    """What the two audits measured of `rank_measure_both_ways` that is not what it should
    be, on every rank (also run under load, `tests/test_load.py`)."""
    run = launch(rank_measure_both_ways, world_size=3, timeout_s=240)
    if not run.ok:
        return [run.summary()]
    want = [("w", (2,), 0, 2.0, 2, (0,), None), ("v", (1,), 0, 3.0, 3, (0,), 2.0)]
    return [
        f"rank {r} {who}: {got} (want {want})"
        for r, measured in enumerate(run.values)
        for who, got in zip(("class audit", "script audit"), measured)
        if got != want
    ]


class Counting:
    """A `Group` that records the size of every reduction it passes on."""

    def __init__(self, inner) -> None:
        self.inner, self.rank, self.size, self.sent = inner, inner.rank, inner.size, []

    def all_reduce_max(self, values: torch.Tensor) -> torch.Tensor:
        self.sent.append(values.numel())
        return self.inner.all_reduce_max(values)


def rank_agree(ctx):
    """Every rank holds [7, rank == 2, -2**63]: the first and the last agree everywhere
    (the most negative int64 included: `~x` never overflows), the second only where there is
    no rank 2. Asked through the world group and through the script audit's side group."""
    values = [7, int(ctx.rank == 2), -(2**63)]
    world = Counting(WorldGroup())
    side = SideGroup()
    assert side.ready()
    low, high = min_max(torch.tensor(values), world)
    return agree(values, world), agree(values, side), low.tolist(), high.tolist(), world.sent


@pytest.mark.parametrize("world_size", [2, 4])
def test_agreement_is_one_reduction_of_fixed_size_on_either_group(world_size):
    run = launch(rank_agree, world_size=world_size, timeout_s=240)
    assert run.ok, run.summary()
    differs = world_size > 2
    for on_world, on_side, low, high, sent in run.values:
        assert on_world == on_side == [True, not differs, True]
        assert low == [7, 0, -(2**63)] and high == [7, int(differs), -(2**63)]
        assert sent == [6, 6]  # [x, ~x] of 3 values, whatever the world size


DECAY = str(Path(__file__).resolve().parent / "fixtures" / "decay_script.py")


def test_a_script_finding_is_the_one_finding_and_keeps_its_json_keys(tmp_path):
    """A student's weight decay on rank 0 only (after the step, outside the optimizer): one
    finding, the one `Finding` type (check "audit", its kind, step, phase, tensor, ranks and
    measured numbers, its hint from the table), whose JSON has the one Finding's keys and every
    key the script audit's JSON always had. The same script decaying on every rank passes."""
    buggy = check_audit(AuditOptions(script=(DECAY, "buggy"), out=str(tmp_path), console="none"))
    assert buggy.verdict == "fault", buggy.to_dict()
    first = buggy.faults[0]
    assert isinstance(first, Finding) and first.check == "audit" and first.kind == "divergence"
    # The decay runs after step 0's audit: the parameters after step 1 are the first to differ.
    assert (first.phase, first.step, first.echo_of) == (report.PARAMS_AFTER, 1, None), first
    # Two ranks, a tie: the lower rank holds the reference value, so rank 1 is named.
    assert first.tensor == "0.weight" and first.ranks == (1,) and first.seen_at == (2,)
    assert first.where == "parameters after step 1 (SGD)" and "outside the optimizer" in first.hint
    (diff,) = first.tensors
    assert diff.name == "0.weight" and diff.ranks == (1,) and diff.differing > 0
    found = buggy.to_dict()["audit"]["findings"][0]
    old = {"kind", "optimizer", "step", "phase", "tensors", "count", "detail", "echo_of",
           "seen_at", "where", "hint", "fault"}  # fmt: skip
    assert old | {f.name for f in fields(Finding)} <= set(found), sorted(found)
    assert found["tensors"][0]["name"] == "0.weight" and list(found["seen_at"]) == [2]
    assert found["numbers"]["count"] == found["count"] == 1 and found["fault"] is True
    correct = check_audit(
        AuditOptions(script=(DECAY, "correct"), out=str(tmp_path), console="none")
    )
    assert correct.verdict == "pass" and not correct.findings, correct.to_dict()


def test_a_layout_that_differs_is_always_said_how():
    """An audit point whose ranks hold different lists of keys says how each rank's differ
    from the reference rank's: which it lacks or has extra, which it holds more times, or,
    the same keys in another order, where the orders part. Never an empty parenthesis (the
    set-ordered optimizer's false alarm printed one: its lists differed in order only)."""
    ref = ["grads|a|f32|(2,)", "grads|b|f32|(3,)", "grads|c|f32|(4,)"]
    differs = compare_module._differs
    assert differs(1, 0, list(ref), ref) == ""
    order = differs(1, 0, [ref[1], ref[0], ref[2]], ref)
    assert order == "rank 1: the same 3 entries in another order (entry 0 is b where rank 0's is a)"
    assert differs(1, 0, ref[:2], ref) == "rank 1: lacks 1 (c)"
    twice = differs(2, 0, [*ref, ref[0]], ref)
    assert twice == "rank 2: a 2 times where rank 0 has it 1", twice


def test_stillness_follows_zero_gradients_and_unchanged_parameters():
    """`Stillness` (the note "nothing trained"): gradients exactly zero at every point, -0.0
    and None included, and parameters whose fingerprints never leave their first ones; one
    nonzero element, or one changed fingerprint, and it stops looking."""
    from verify.replica_audit.stillness import Stillness, nothing_trained

    still = Stillness()
    assert not still.zero_gradients and not still.unchanged  # nothing shown: no claim
    still.parameters({"w": 5, "b": 7})
    for _ in range(3):
        still.gradients([torch.zeros(3), torch.tensor([-0.0, 0.0]), None])
        still.parameters({"w": 5, "b": 7})
    assert still.zero_gradients and still.unchanged
    both = nothing_trained(still.zero_gradients, still.unchanged)
    assert both.startswith("nothing trained: the loss's gradients were exactly zero at every")
    still.gradients([torch.zeros(3), torch.tensor([0.0, 1e-30])])
    still.parameters({"w": 5, "b": 8})
    assert not still.zero_gradients and not still.unchanged
    assert nothing_trained(False, False) == ""
    assert "by SGD #2" in nothing_trained(False, True, "SGD #2")
