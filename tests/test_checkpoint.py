"""`verify.training.checkpoint.round_trip` on real gloo ranks: each checkpoint design is played
the way its users would play it, and a correct optimizer resumes exactly.

"Exactly" is bitwise: two identical models get the same synthetic gradients (the same on
every rank, as if already averaged); one optimizer goes through the round trip after step 1,
the other does not, and after two more steps the parameters must be identical. Nothing else
differs between the two runs, so any difference is state the round trip lost or changed.

One launch runs every two-rank case (spawning is the expensive part).
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.distributed.optim import ZeroRedundancyOptimizer

from impls.faulty.zero_faults import SavesOnlyItsShard
from impls.zero import ShardedOptimizer
from verify.launching import launch
from verify.training.checkpoint import CheckpointError, _decide, round_trip
from verify.training.optim_state import local_state_bytes

sys.path.insert(0, str(Path(__file__).parent / "fixtures" / "third_party"))
import cs336_style as cs336  # noqa: E402

from tests.fixtures import sharded_styles  # noqa: E402

LR = 1e-2


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.Linear(16, 4))


def groups(m: nn.Module) -> list[dict]:
    params = list(m.parameters())
    return [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.1},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0, "lr": LR / 2},
    ]


def set_grads(m: nn.Module, step: int) -> None:
    for i, p in enumerate(m.parameters()):
        g = torch.Generator().manual_seed(1000 * step + i)
        p.grad = torch.randn(p.shape, generator=g, dtype=p.dtype)


class RaisesOnLoad(torch.optim.AdamW):
    def load_state_dict(self, state_dict):
        raise ValueError("bad checkpoint\nsecond line")


class RaisesOnSave(torch.optim.AdamW):
    def state_dict(self):
        raise KeyError("exp_avg")


def adamw(g):
    return torch.optim.AdamW(g, lr=LR)


def zero(g):
    return ZeroRedundancyOptimizer(g, optimizer_class=torch.optim.AdamW, lr=LR)


def sharded(cls):
    return lambda g: cls(g, torch.optim.AdamW, lr=LR)


CASES = {
    "adamw": adamw,
    "zero1": sharded(ShardedOptimizer),
    "torch-zero": zero,
    "per-rank": sharded(cs336.ShardedOptimizerLocalName),
    "gathered-on-every-rank": sharded(cs336.ShardedOptimizerDotOptimizer),
    "saves-only-its-shard": sharded(SavesOnlyItsShard),
    "slices": sharded(sharded_styles.SliceShardedAdamW),
    "trims-its-groups": sharded(sharded_styles.TrimsItsGroups),
    "trims-its-groups-loses-state": sharded(sharded_styles.TrimsItsGroupsLosesState),
}


def resume(ctx, make, rebuild=None) -> dict:
    """Step 1, round trip (on `b` only), steps 2-3; compare with the uninterrupted `a`."""
    a, b = model(), model()
    opt_a, opt_b = make(groups(a)), make(groups(b))
    for m, opt in ((a, opt_a), (b, opt_b)):
        set_grads(m, 1)
        opt.step()
    before = local_state_bytes(opt_b, b.parameters()).bytes
    trip = round_trip(
        opt_b,
        rebuild or (lambda: make(groups(b))),
        rank=ctx.rank,
        world_size=ctx.world_size,
        device=ctx.device,
        param_numels=[p.numel() for g in groups(b) for p in g["params"]],
    )
    after = local_state_bytes(trip.optimizer, b.parameters()).bytes
    for step in (2, 3):
        for m, opt in ((a, opt_a), (b, trip.optimizer)):
            set_grads(m, step)
            opt.step()
    exact = all(torch.equal(pa, pb) for pa, pb in zip(a.parameters(), b.parameters()))
    return {"kind": trip.kind, "note": trip.note, "exact": exact, "bytes": (before, after)}


def failure(ctx, make, rebuild=None) -> tuple:
    try:
        resume(ctx, make, rebuild)
    except CheckpointError as e:
        return e.phase, str(e), type(e.__cause__).__name__
    return None


def _rebuild_fails():
    raise RuntimeError("out of memory")


def all_cases(ctx) -> dict:
    out = {name: resume(ctx, make) for name, make in CASES.items()}
    out["raises-on-load"] = failure(ctx, lambda g: RaisesOnLoad(g, lr=LR))
    out["raises-on-save"] = failure(ctx, lambda g: RaisesOnSave(g, lr=LR))
    out["rebuild-fails"] = failure(ctx, adamw, rebuild=_rebuild_fails)
    return out


@pytest.fixture(scope="module")
def ranks() -> list[dict]:
    result = launch(all_cases, world_size=2, timeout_s=60)
    assert result.ok, result.summary()
    return result.values


@pytest.mark.parametrize(
    "name, kind",
    [
        ("adamw", "full"),
        ("zero1", "full"),
        ("gathered-on-every-rank", "full"),
        ("torch-zero", "consolidated"),
        ("per-rank", "per-rank"),
        ("slices", "per-rank"),
        ("trims-its-groups", "per-rank"),
    ],
)
def test_correct_optimizers_resume_exactly(ranks, name, kind):
    for rank in ranks:
        case = rank[name]
        assert (case["kind"], case["exact"]) == (kind, True), case
        before, after = case["bytes"]
        assert before == after > 0  # the same state bytes, on every rank
    assert ranks[0][name]["note"] == ranks[1][name]["note"]  # decided alike everywhere


def test_saves_only_its_shard_still_loses_rank_1s_state(ranks):
    """Its dict lists every parameter (the global format), so it is played as a full
    checkpoint written by rank 0: rank 1 resumes with none of its shard's moments."""
    r0, r1 = (rank["saves-only-its-shard"] for rank in ranks)
    assert r0["kind"] == r1["kind"] == "full" and "differ" in r0["note"]
    assert r0["bytes"][0] == r0["bytes"][1]  # rank 0 got its own shard back
    assert r1["bytes"][0] > 0 == r1["bytes"][1]  # rank 1 lost all of it
    assert not r0["exact"] and not r1["exact"]  # and the run diverges on every rank


def test_per_rank_checkpoints_are_told_by_what_state_dict_returns(ranks):
    """tests/fixtures/sharded_styles.py: param_groups trimmed to the rank's own parameters is
    told by the count against the parameters passed (the optimizer's own groups would say
    "all of them"); slices of every parameter by state smaller than the parameter. A per-rank
    class whose load forgets the moments still diverges, played the same way."""
    r0 = ranks[0]
    assert "lists 1 of the 6 parameters passed" in r0["trims-its-groups"]["note"]
    sliced = "holds slices ('exp_avg' of parameter 0: 64 of its 128 elements)"
    assert sliced in r0["slices"]["note"]
    for rank in ranks:
        lost = rank["trims-its-groups-loses-state"]
        assert lost["kind"] == "per-rank" and not lost["exact"], lost
        assert lost["bytes"][0] > 0 == lost["bytes"][1]


def test_failures_name_the_call(ranks):
    for rank in ranks:
        assert rank["raises-on-load"] == (
            "load_state_dict",
            "load_state_dict() of rank 0's full state raised ValueError: bad checkpoint",
            "ValueError",
        )
        assert rank["raises-on-save"] == (
            "state_dict",
            "state_dict() raised KeyError: 'exp_avg'",
            "KeyError",
        )
        assert rank["rebuild-fails"] == (
            "rebuild",
            "rebuilding the optimizer raised RuntimeError: out of memory",
            "RuntimeError",
        )


def test_one_process_without_a_process_group():
    m = model()
    opt = adamw(groups(m))
    set_grads(m, 1)
    opt.step()
    trip = round_trip(
        opt,
        lambda: adamw(groups(m)),
        rank=0,
        world_size=1,
        device=torch.device("cpu"),
        param_numels=[p.numel() for g in groups(m) for p in g["params"]],
    )
    assert trip.kind == "full"
    assert (
        local_state_bytes(trip.optimizer, m.parameters()).bytes
        == local_state_bytes(opt, m.parameters()).bytes
    )
    # The loaded state is a copy: stepping the fresh optimizer leaves the old one's alone.
    old = copy.deepcopy(opt.state_dict()["state"])
    set_grads(m, 2)
    trip.optimizer.step()
    assert all(
        torch.equal(old[i]["exp_avg"], s["exp_avg"]) for i, s in opt.state_dict()["state"].items()
    )


@pytest.mark.parametrize(
    "summaries, kind, says",
    [
        ([(6, "x", None), (6, "x", None)], "full", "identical"),
        ([(6, "x", None), (6, "y", None)], "full", "at full size, but the ranks' dicts differ"),
        ([(3, "x", None), (3, "y", None)], "per-rank", "rank 0's state_dict() lists 3 of the 6"),
        ([(6, "x", None), (2, "y", None)], "per-rank", "rank 1's"),
        ([(None, "x", None), (None, "y", None)], "per-rank", "not in torch.optim's format"),
        ([(None, "x", None), (None, "x", None)], "full", "identical"),
        ([(6, "x", None), (6, "y", (2, "m", 5, 9))], "per-rank", "rank 1's holds slices ('m'"),
        # the same slices on every rank (one rank, or a replicated state): nothing to choose
        ([(6, "x", (2, "m", 5, 9)), (6, "x", (2, "m", 5, 9))], "full", "identical"),
    ],
)
def test_decide(summaries, kind, says):
    got_kind, note = _decide(summaries, 6)
    assert got_kind == kind and says in note
