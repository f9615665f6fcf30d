"""The audit catches a one-ULP change to one element of any one tensor on one rank, names that
tensor and the rank, and reports the element; identical replicas pass."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from impls.registry import resolve
from verify.checks.audit import ModelAudit
from verify.launching import launch
from verify.replica_audit.compare import MOVED, Entry, describe
from verify.replica_audit.fingerprint import fingerprint
from verify.replica_audit.group import WorldGroup
from verify.training.workloads import get_workload


def test_fingerprint_sees_every_single_bit_flip_and_ignores_nothing():
    """Single process: flipping any one bit of any element, in any dtype, changes the
    fingerprint; equal tensors (including views at odd offsets) fingerprint equal."""
    gen = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.float64, torch.bfloat16, torch.float16, torch.int64):
        base = (torch.randn(7, 13, generator=gen) * 100).to(dtype)
        words = base.view(-1).view(
            {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[base.element_size()]
        )
        for index in (0, 5, 90):
            for bit in (0, 7, base.element_size() * 8 - 1):
                changed = words.clone()
                changed[index] ^= 1 << bit if bit < 63 else -(2**63)
                assert not torch.equal(
                    fingerprint(changed.view(dtype)), fingerprint(base.view(-1))
                ), (dtype, index, bit)
    flat = torch.randn(1001, generator=gen)
    view = flat[1:]  # storage offset of 4 bytes: not 8-byte aligned
    assert torch.equal(fingerprint(view), fingerprint(view.clone()))
    swapped = view.clone()
    swapped[[0, 900]] = swapped[[900, 0]]  # same values, moved to another 256-word row
    assert not torch.equal(fingerprint(swapped), fingerprint(view))
    assert fingerprint(None)[0] == -1


def test_small_tensors_see_moved_values_and_cancelling_changes():
    """Up to 64K words every word has its own weight: a permutation, two exactly cancelling
    one-ULP changes, or a bool mask with the same number of Trues moved, all change it."""
    assert not torch.equal(
        fingerprint(torch.tensor([1, 2, 3, 4])), fingerprint(torch.tensor([3, 4, 1, 2]))
    )
    assert not torch.equal(
        fingerprint(torch.tensor([True, False, True])),
        fingerprint(torch.tensor([True, True, False])),
    )
    bias = torch.randn(64, generator=torch.Generator().manual_seed(1))
    bits = bias.clone().view(torch.int32)
    bits[0] += 1  # +1 ULP
    bits[2] -= 1  # -1 ULP in the same half of the next 64-bit word: the plain sum cancels
    assert not torch.equal(fingerprint(bits.view(torch.float32)), fingerprint(bias))
    perm = torch.randperm(200, generator=torch.Generator().manual_seed(2))
    assert not torch.equal(fingerprint(perm), fingerprint(perm.flip(0)))


def rank_several_ranks_differ(ctx):
    """World 4. Tensor `a`: rank 0 alone differs (the majority, ranks 1-3, is the reference).
    Tensor `b`: ranks 1 and 2 differ from ranks 0 and 3, in different elements (the count is
    the union, 2, and the first index the smaller one). Tensor `c`: int64 values 2**60 apart by
    one (the difference is reported exactly, not rounded to zero through float64)."""
    a = torch.zeros(10)
    b = torch.zeros(3, 4)
    c = torch.full((5,), 2**60, dtype=torch.int64)
    if ctx.rank == 0:
        a[7] = 1.0
    if ctx.rank == 1:
        b[2, 1] = 0.5
    if ctx.rank == 2:
        b[1, 3] = -2.0
        c[4] += 1
    auditor = ModelAudit(torch.nn.Linear(1, 1))
    _, found = auditor.audit("x", [("a", a), ("b", b), ("c", c)])
    # The same names in another order on the odd ranks (optimizer state is in the order its
    # parameters first stepped): matched by name, and rank 3's `f` still found.
    e, f = torch.ones(2), torch.full((3,), 2.0 + (ctx.rank == 3))
    named = [("e", e), ("f", f)] if ctx.rank % 2 == 0 else [("f", f), ("e", e)]
    _, reordered = auditor.audit("y", named)
    # Tensor `d` differed by its fingerprints, but its values moved before the detail gathered
    # them (a collective still in flight): equal on every rank by then.
    moved = describe(WorldGroup(), Entry("grad", "d", torch.ones(3)), 0, (1,), [0] * 4)
    moved = replace(moved, at="x")
    # Rank 1's fingerprint differed, yet reads alike now, while rank 2 (which matched) changed
    # in between: measured on the flagged ranks only, `g` moved, rank 2's values not pinned on 1.
    g = torch.ones(3) * (2.0 if ctx.rank == 2 else 1.0)
    elsewhere = describe(WorldGroup(), Entry("grad", "g", g), 0, (1,), [0] * 4)
    return (
        [
            (m.name, m.ranks, m.reference_rank, m.differing, m.first_index, m.max_abs_diff)
            for m in found
        ]
        + [(moved.moved, moved.differing, moved.line())]
        + [[m.line() for m in reordered]]
        + [(elsewhere.moved, elsewhere.differing)]
    )


def test_mismatch_reports_with_rank_0_odd_and_several_ranks_differing():
    run = launch(rank_several_ranks_differ, world_size=4, timeout_s=240)
    assert run.ok, run.summary()
    a, b, c, d, reordered, elsewhere = run.values[0]
    assert elsewhere == (True, None), elsewhere
    assert reordered == [
        "y: f differs on rank 3 (vs rank 0): max |diff| 1, 3/3 elements differ, first at index [0]"
    ], reordered
    assert a == ("a", (0,), 1, 1, (7,), 1.0)
    assert b == ("b", (1, 2), 0, 2, (1, 3), 2.0)
    assert c == ("c", (2,), 0, 1, (4,), 1.0)
    # Not "0/3 elements differ": the values moved, a collective was in flight; --sanitize.
    assert d == (True, None, f"x: d differs on rank 1 (vs rank 0): {MOVED}"), d
    assert "--sanitize" in MOVED and "in flight" in MOVED


def next_ulp(t: torch.Tensor, index: int) -> None:
    """Move one element of `t` by one unit in the last place, in place."""
    flat = t.view(-1)
    if t.is_floating_point():
        flat[index] = torch.nextafter(flat[index], torch.tensor(float("inf"), dtype=t.dtype))
    else:
        flat[index] += 1


def rank_perturb_each_tensor(ctx, workload_name):
    """Train one step (so there are grads and AdamW state), then for every audited tensor in
    turn: perturb one element on the last rank, audit, undo."""
    workload = get_workload(workload_name)
    torch.manual_seed(0)
    model = workload.build()
    wrapped = resolve("bucketed").wrap(model, bucket_size_mb=0.05)
    optimizer = torch.optim.AdamW(workload.param_groups(model))
    batch = workload.batch(1, ctx.world_size).shard(ctx.rank, ctx.world_size)
    workload.loss(wrapped, batch).backward()
    wrapped.finish_gradient_synchronization()
    optimizer.step()
    auditor = ModelAudit(model, optimizer)
    named = auditor.grad_tensors() + auditor.state_tensors()
    _, clean = auditor.audit("clean", named)
    results = {"clean": [m.line() for m in clean], "caught": {}}
    for k, (name, tensor) in enumerate(named):
        index = (k * 7919) % tensor.numel()
        original = tensor.detach().clone()
        if ctx.rank == ctx.world_size - 1:
            next_ulp(tensor.detach(), index)
        _, found = auditor.audit(name, named)
        tensor.detach().copy_(original)
        results["caught"][name] = (
            [(m.name, m.ranks, m.differing, m.first_index, m.max_abs_diff) for m in found],
            index,
            tuple(tensor.shape),
        )
    return results


@pytest.mark.parametrize(
    "workload, kinds",
    [
        ("transformer", {"grad", "param", "optim"}),
        ("buffers", {"grad", "param", "buffer", "optim"}),
    ],
)
def test_audit_catches_one_ulp_in_any_tensor_on_one_rank_and_names_it(workload, kinds):
    run = launch(rank_perturb_each_tensor, world_size=2, args=(workload,), timeout_s=240)
    assert run.ok, run.summary()
    results = run.values[0]
    assert results["clean"] == []
    assert {name.split(":")[0] for name in results["caught"]} == kinds
    for name, (found, index, shape) in results["caught"].items():
        assert len(found) == 1, f"{name}: expected exactly one mismatch, got {found}"
        tensor, ranks, num_different, first_index, max_abs_diff = found[0]
        assert tensor == name
        assert ranks == (1,)
        assert num_different == 1
        expected = (
            tuple(int(i) for i in torch.unravel_index(torch.tensor(index), shape)) if shape else ()
        )
        assert first_index == expected
        assert max_abs_diff > 0


def untrained_problems() -> list[str]:
    """A student's DDP whose flat buffer is never filled (tests/fixtures/zeroed_grads_ddp.py)
    keeps the replicas bitwise alike while every gradient is zero: consistency passes, as it
    must (the replicas do agree), and says beside the verdict that nothing trained, in the
    JSON too; a correct class (naive) has no such note. What is wrong (none); the hog
    window's `untrained` job too (tests/test_load.py)."""
    from pathlib import Path

    from verify.checks.consistency import ConsistencyOptions, check_consistency

    fixture = Path(__file__).parent / "fixtures" / "zeroed_grads_ddp.py"
    zeroed = check_consistency(ConsistencyOptions(impl=f"{fixture}:FlatBufferDDP"))
    right = check_consistency(ConsistencyOptions(impl="naive"))
    problems = []
    if zeroed.verdict != "pass" or not zeroed.headline.endswith(
        "but nothing trained (see the note)"
    ):
        problems.append(f"zeroed: {zeroed.verdict}: {zeroed.headline}")
    said = "nothing trained: the loss's gradients were exactly zero at every audited step"
    doc = zeroed.to_dict()
    if not doc["untrained"].startswith(said) or doc["untrained"] not in doc["notes"]:
        problems.append(f"zeroed: the note: {doc['untrained']!r} {doc['notes']}")
    if right.verdict != "pass" or right.untrained or "nothing trained" in right.headline:
        problems.append(f"naive: {right.verdict}: {right.headline} {right.untrained!r}")
    return problems


@pytest.mark.under_load
def test_a_class_whose_gradients_are_all_zero_passes_with_the_note_that_nothing_trained():
    problems = untrained_problems()
    assert not problems, "\n".join(problems)
