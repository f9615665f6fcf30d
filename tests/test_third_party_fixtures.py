"""The third-party-style classes in `tests/fixtures/third_party/` do what their docstrings say.

Later tests run these classes through the tool and expect its verdicts to match the
docstrings, so the docstrings must be right. This file checks them directly, without the
tool's checkers, on two real gloo ranks (one launch for everything):

- DDP wrappers: after `finish_gradient_synchronization()` every gradient must equal
  `(g0 + g1) / 2` of the two ranks' local gradients, computed on a plain copy of the model and
  all-gathered. Bitwise: with two ranks the all-reduce's sum is one commutative addition, and
  halving is exact, so the wrapper and the expectation round identically.
- Sharded optimizers, over PyTorch DDP: parameters bitwise equal to a plain AdamW on a copy fed
  the same averaged gradients, after every step (same per-parameter AdamW arithmetic on the
  same inputs; CPU AdamW takes the single-tensor path in both).
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

from verify.launching import launch
from verify.training.workloads import get_workload

sys.path.insert(0, str(Path(__file__).parent / "fixtures" / "third_party"))
import cs336_style as cs336  # noqa: E402
import picotron_style as picotron  # noqa: E402

TINY_BUCKET_MB = 0.001  # ~1 KiB: several buckets on the MLP, one per layer or less


# --- DDP wrappers ----------------------------------------------------------------------------


def _ddp_case(ctx, cls, workload: str, seed_alike: bool) -> dict:
    """Two SGD steps through the wrapper; per step and parameter, how far the synchronized
    gradient is from the average of the ranks' local ones."""
    wl = get_workload(workload)
    torch.manual_seed(0 if seed_alike else 100 + ctx.rank)
    model = wl.build()
    wrapped = (
        cls(model, bucket_size_mb=TINY_BUCKET_MB) if cls.__name__.startswith("DDPB") else cls(model)
    )
    plain = wl.build()
    start_equal = _replicas_equal(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    steps = []
    for step in (1, 2):
        shard = wl.batch(step, ctx.world_size).shard(ctx.rank, ctx.world_size)
        plain.load_state_dict(model.state_dict())
        plain.zero_grad()
        wl.loss(plain, shard).backward()
        local = {n: p.grad for n, p in plain.named_parameters() if p.grad is not None}
        every: list = [None] * ctx.world_size
        dist.all_gather_object(every, local)
        optimizer.zero_grad()
        wl.loss(wrapped, shard).backward()
        finish = getattr(wrapped, "finish_gradient_synchronization", None)
        if finish is not None:
            finish()
        errors = {}
        for name, p in model.named_parameters():
            present = [g[name] for g in every if name in g]
            if not present:  # no rank produced it: the wrapper must leave .grad alone (None)
                errors[name] = (str(p.dtype), 0.0 if p.grad is None else float("inf"))
                continue
            g0, g1 = (g.get(name, torch.zeros_like(present[0])) for g in every)
            expected = ((g0 + g1) / 2).double()
            diff = float("inf") if p.grad is None else (p.grad.double() - expected).abs().max()
            errors[name] = (str(p.dtype), float(diff) / max(expected.abs().max().item(), 1e-30))
        optimizer.step()
        steps.append({"errors": errors, "replicas_equal": _replicas_equal(model)})
    return {"start_equal": start_equal, "steps": steps}


def _replicas_equal(model: nn.Module) -> bool:
    flat = torch.cat([p.detach().double().reshape(-1) for p in model.parameters()])
    every = [torch.empty_like(flat) for _ in range(dist.get_world_size())]
    dist.all_gather(every, flat)
    return all(torch.equal(every[0], t) for t in every)


# --- sharded optimizers ----------------------------------------------------------------------


def _sharded_case(ctx, cls, scheduler: bool) -> dict:
    """Three AdamW steps over PyTorch DDP against a plain AdamW fed the same gradients."""
    wl = get_workload("mlp")
    torch.manual_seed(0)
    model = wl.build()
    reference = copy.deepcopy(model)
    ddp = nn.parallel.DistributedDataParallel(model)
    opt = cls(wl.param_groups(model, lr=1e-2), torch.optim.AdamW, lr=1e-2, weight_decay=0.1)
    ref = torch.optim.AdamW(wl.param_groups(reference, lr=1e-2), lr=1e-2, weight_decay=0.1)
    scheds = (
        [torch.optim.lr_scheduler.StepLR(o, 1, gamma=0.5) for o in (opt, ref)] if scheduler else []
    )
    equal = []
    for step in (1, 2, 3):
        opt.zero_grad()
        wl.loss(ddp, wl.batch(step, ctx.world_size).shard(ctx.rank, ctx.world_size)).backward()
        for p, r in zip(model.parameters(), reference.parameters()):
            r.grad = p.grad.clone()
        opt.step()
        ref.step()
        for s in scheds:
            s.step()
        equal.append(
            all(torch.equal(p, r) for p, r in zip(model.parameters(), reference.parameters()))
        )
    return {"equal_to_plain": equal, "replicas_equal": _replicas_equal(model)}


DDP_CASES = {
    "DDPIndividualParameters": (cs336.DDPIndividualParameters, "mlp", False),
    "DDPBucketed": (cs336.DDPBucketed, "mlp", False),
    "DDPBucketed/mixed": (cs336.DDPBucketed, "mixed", False),
    "DDPBucketed/unused": (cs336.DDPBucketed, "unused", False),
    "DDPBucketedFloat32Buffer": (cs336.DDPBucketedFloat32Buffer, "mlp", False),
    "DDPBucketedFloat32Buffer/mixed": (cs336.DDPBucketedFloat32Buffer, "mixed", False),
    "DataParallelNaive/same-seed": (picotron.DataParallelNaive, "mlp", True),
    "DataParallelNaive/own-seed": (picotron.DataParallelNaive, "mlp", False),
    "DataParallelNaiveReducesParam": (picotron.DataParallelNaiveReducesParam, "mlp", True),
}
SHARDED_CASES = {
    "ShardedOptimizerDotOptimizer": (cs336.ShardedOptimizerDotOptimizer, True),
    "ShardedOptimizerLocalName": (cs336.ShardedOptimizerLocalName, True),
    "ShardedOptimizerInopt": (cs336.ShardedOptimizerInopt, False),
    "ShardedOptimizerInopt/scheduler": (cs336.ShardedOptimizerInopt, True),
}


def _all_cases(ctx) -> dict:
    out = {name: _ddp_case(ctx, *args) for name, args in DDP_CASES.items()}
    out.update({name: _sharded_case(ctx, *args) for name, args in SHARDED_CASES.items()})
    return out


@pytest.fixture(scope="module")
def results() -> dict:
    result = launch(_all_cases, world_size=2, timeout_s=90)
    assert result.ok, result.summary()
    return result.values[0]


def _worst(case: dict, dtype: str | None = None) -> float:
    return max(
        err
        for step in case["steps"]
        for dt, err in step["errors"].values()
        if dtype is None or dt == dtype
    )


@pytest.mark.parametrize(
    "name",
    [
        "DDPIndividualParameters",
        "DDPBucketed",
        "DDPBucketed/mixed",
        "DDPBucketed/unused",
        "DDPBucketedFloat32Buffer",
        "DataParallelNaive/same-seed",
    ],
)
def test_correct_wrappers_average_gradients_exactly(results, name):
    case = results[name]
    assert case["start_equal"]
    assert _worst(case) == 0.0, case["steps"]
    assert all(step["replicas_equal"] for step in case["steps"])


def test_float32_buffer_loses_float64_precision_only(results):
    """On `mixed`, the float32 and bfloat16 layers stay bitwise right; the float64 layer is
    off by float32 rounding: far above float64's eps (2e-16), at most a few float32 ulps."""
    case = results["DDPBucketedFloat32Buffer/mixed"]
    assert _worst(case, "torch.float32") == 0.0
    assert _worst(case, "torch.bfloat16") == 0.0
    assert 1e-12 < _worst(case, "torch.float64") < 1e-6


def test_naive_is_correct_only_under_identical_seeding(results):
    case = results["DataParallelNaive/own-seed"]
    assert not case["start_equal"]  # no broadcast at construction
    assert not any(step["replicas_equal"] for step in case["steps"])


def test_reduces_param_never_averages_gradients(results):
    case = results["DataParallelNaiveReducesParam"]
    assert case["start_equal"]
    first = case["steps"][0]
    assert all(err > 1e-3 for _, err in first["errors"].values())  # local gradients, not averages
    assert not first["replicas_equal"]  # each rank stepped with its own gradient


@pytest.mark.parametrize(
    "name", ["ShardedOptimizerDotOptimizer", "ShardedOptimizerLocalName", "ShardedOptimizerInopt"]
)
def test_sharded_optimizers_match_plain_adamw_without_a_scheduler(results, name):
    case = results[name]
    assert case["equal_to_plain"] == [True, True, True]
    assert case["replicas_equal"]


def test_inopt_ignores_the_scheduler(results):
    case = results["ShardedOptimizerInopt/scheduler"]
    assert case["equal_to_plain"][0]  # step 1 runs at the initial lr on both
    assert not case["equal_to_plain"][1]  # step 2: the scheduler halved the lr, the shard missed it
    assert case["replicas_equal"]  # the ranks agree: only equivalence can see it
