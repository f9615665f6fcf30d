"""The consistency check's shard layout check (verify/checks/layout.py): the shards of every
parameter disjoint, covering it exactly, each holding its rows of the full tensor.

One launch per world size (2 and 3) runs, on the odd-sizes workload (7, 3, 5 and 1 rows: rows
no world size divides, and a parameter of fewer rows than ranks), the consistency check of:

- zero3 (its `shard_rows()`) and torch-fsdp (DTensor `Shard(0)` placements) and a student's
  right sharded class: no finding (no false alarm on a correct design);
- the same layouts probed with one element of the full tensor changed: the rank that holds
  that row is named, so the check does look at zero3's and FSDP2's shards;
- three student bugs (tests/fixtures/student_fsdp.py): a declaration one row too long on
  each block (overlap), one counting floor(rows / N) rows a block (rows held by no rank), and
  shards cut before the broadcast (right rows, other values on every rank but 0).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from verify.checks.consistency import ConsistencyOptions, run_consistency_on_rank
from verify.checks.layout import Problem, layout_problems
from verify.hints.table import Situation, hint_for
from verify.launching import launch
from verify.training.sharded import full_parameters, gather_shards
from verify.training.trainer import Trainer

FIXTURE = str(Path(__file__).resolve().parent / "fixtures/student_fsdp.py")
IMPLS = ("zero3", "torch-fsdp", f"{FIXTURE}:StudentFSDP")
BUGS = ("DeclaresOverlappingRows", "DeclaresTooFewRows", "ShardsCutBeforeBroadcast")


def _spec(ctx, impl):
    options = ConsistencyOptions(impl=impl, world_size=ctx.world_size, workload="odd", steps=1)
    return options.train_spec()


def rank_layouts(ctx) -> dict:
    out = {}
    for impl in (*IMPLS, *(f"{FIXTURE}:{cls}" for cls in BUGS)):
        report = run_consistency_on_rank(ctx, _spec(ctx, impl))
        out[impl.rsplit(":", 1)[-1]] = [f.message for f in report.findings]
        out[f"{impl} hints"] = [hint_for(f, Situation(ctx.world_size)) for f in report.findings]
        out[f"{impl} notes"] = report.notes
    for impl in IMPLS[:2]:  # one element of the full tensor changed: its holder is named
        trainer = Trainer(ctx, _spec(ctx, impl))
        full = {
            n: t.detach().clone()
            for n, t in full_parameters(trainer.model, trainer.wrapped).items()
        }
        full["fc1.weight"][5, 0] += 1.0
        out[f"{impl} probed"] = layout_problems(
            trainer.model, trainer.wrapped, full, dist.group.WORLD
        )
    out["gathered apart"] = _gathers_apart(Trainer(ctx, _spec(ctx, "torch-fsdp")).model)
    return out


def _gathers_apart(model) -> list[str]:
    """The DTensors whose plain padded all-gather (`gather_shards`, what the tool uses on
    CUDA over gloo) differs from `full_tensor()`: FSDP2's parameters (rows no world size
    divides, one of fewer rows than ranks), a tensor sharded on its columns, a replicated one."""
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = next(model.parameters()).device_mesh
    full = torch.arange(35.0).reshape(5, 7)
    tensors = dict(model.named_parameters())
    tensors["columns"] = distribute_tensor(full, mesh, [Shard(1)])
    tensors["replicated"] = distribute_tensor(full, mesh, [Replicate()])
    return [n for n, t in tensors.items() if not torch.equal(gather_shards(t), t.full_tensor())]


@pytest.mark.parametrize("world_size", [2, pytest.param(3, marks=pytest.mark.under_load)])
def test_shards_are_disjoint_cover_and_hold_their_rows(world_size):
    launch_and_check(world_size)


def launch_and_check(world_size: int) -> None:
    """The launch and every assertion on it (the load test runs it under CPU hogs too)."""
    run = launch(rank_layouts, world_size=world_size, timeout_s=240)
    assert run.ok, run.summary()
    got = run.values[0]
    assert got["gathered apart"] == []
    checked = "shard layout: 7 parameters sharded by rows, checked at construction"
    for impl in IMPLS:
        name = impl.rsplit(":", 1)[-1]
        assert got[name] == [], (impl, got[name])
        assert any(n.startswith(checked) for n in got[f"{impl} notes"]), got[f"{impl} notes"]
    # fc1.weight has 7 rows: blocks of 4 at 2 ranks, 3 at 3 ranks; row 5 is rank 1's
    block = 4 if world_size == 2 else 3
    rows = f"{block}:{min(2 * block, 7)}"
    for impl in ("zero3", "torch-fsdp"):
        differs = f"rank 1's shard of fc1.weight differs from rows {rows} of the full tensor"
        assert got[f"{impl} probed"] == (7, [Problem("differs", "fc1.weight", differs, (1,))])
    head = "construction: shards of fc1.weight overlap: ranks 0 and 1 both hold rows"
    overlap = got["DeclaresOverlappingRows"]
    assert overlap[0].startswith(f"{head} {block}:{block + 1} (and "), overlap
    # the parameter of 1 row: floor(1 / N) = 0 rows a block leaves it to no rank
    uncovered = got["DeclaresTooFewRows"]
    assert uncovered[0].startswith("construction: rows 0:1 of gain held by no rank (and "), (
        uncovered
    )
    stale = got["ShardsCutBeforeBroadcast"]
    differs = (
        f"construction: rank 1's shard of fc1.weight differs from rows {rows} of the full tensor"
    )
    assert len(stale) == 1 and stale[0].startswith(f"{differs} (and "), stale  # gathers mend it
    for bug in BUGS:  # the hint is chosen by the finding's kind, not its wording
        hints = got[f"{FIXTURE}:{bug} hints"]
        assert hints[0].startswith("the shards do not partition"), hints
