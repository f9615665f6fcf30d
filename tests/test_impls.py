"""Every implementation x every hard-case workload x world sizes 1-4, against the references.

Each world size is one launch whose ranks run every cell (spawning per cell would cost ~2 s a
cell). Within a cell the ranks train 3 AdamW steps and check, after every step:

- replicas are bitwise identical (the audit), gradients included;
- which parameters have no gradient (None) is exactly what PyTorch DDP leaves None
  (unused on every rank: untouched);
- the parameters match PyTorch DDP run in the same process from the same initial weights.

Tolerance against PyTorch DDP, and why it is not zero: both average the same per-rank
gradients, but bucket boundaries differ, and for 3+ ranks gloo's ring all-reduce adds the
ranks' values in an order that depends on an element's offset in the buffer, so averaged
gradients may differ in the last bit. These comparisons train with SGD + momentum, whose update
is proportional to the gradient, so a last-bit gradient difference stays a last-bit parameter
difference: rtol 1e-5 / atol 1e-6 leaves ~10x headroom over 3 steps. (AdamW would not do here:
it divides by sqrt(v), so a gradient that is zero up to rounding, like an attention key bias,
turns its rounding noise into full-size updates of random sign.) bfloat16 parameters round
each update to 8 bits of mantissa, so one differing rounding is a bf16 ULP (2**-8 relative):
rtol 1.6e-2 / atol 1e-3 there.

ZeRO-1 is compared with bucketed DDP + plain AdamW, and `torch-zero` with `torch-ddp` + plain
AdamW: identical gradients and the same per-parameter AdamW arithmetic, so *bitwise* equal.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from impls.registry import REGISTRY, resolve
from verify.checks.audit import ModelAudit
from verify.launching import launch
from verify.training.workloads import HARD_CASES, Batch, get_workload

# The built-in DDP wrappers, read from the registry (as the CLI's --impl list is).
DDP_VARIANTS = tuple(n for n, i in REGISTRY.items() if i.kind == "builtin" and not i.sharded)
SMALL_BUCKET_MB = 0.001  # ~1 KB: several multi-parameter buckets even in the small models
STEPS = 3


def tolerance(model_dtypes: set[torch.dtype]) -> dict:
    # A model with any bf16 layer gets bf16 tolerance for every parameter: a bf16 rounding
    # that differs in one layer changes the activations and gradients of every other layer at
    # bf16 precision from the next step on.
    if model_dtypes & {torch.bfloat16, torch.float16}:
        return {"rtol": 1.6e-2, "atol": 1e-3}
    return {"rtol": 1e-5, "atol": 1e-6}


def train(
    ctx, impl_name, workload_name, *, bucket_mb=SMALL_BUCKET_MB, set_to_none=True, adamw=False
):
    """Train one cell; return final params, per-step None-grad sets, and audit problems."""
    impl = resolve(impl_name)
    workload = get_workload(workload_name)
    torch.manual_seed(1000 + ctx.rank)  # different per rank: construction must broadcast
    model = workload.build()
    wrapped = impl.wrap(
        model, bucket_size_mb=bucket_mb, find_unused_parameters=workload.has_unused_parameters
    )
    if adamw:
        optimizer = impl.make_optimizer(workload.param_groups(model), torch.optim.AdamW)
    else:
        groups = workload.param_groups(model, lr=0.05, weight_decay=1e-2)
        optimizer = impl.make_optimizer(groups, torch.optim.SGD, momentum=0.9)
    auditor = ModelAudit(model, None if impl.sharded else optimizer)
    finish = getattr(wrapped, "finish_gradient_synchronization", lambda: None)
    problems, none_grads = [], []
    _, found = auditor.audit("construction", auditor.state_tensors())
    problems += [m.describe() for m in found]
    for step in range(1, STEPS + 1):
        optimizer.zero_grad(set_to_none=set_to_none)
        batch = workload.batch(step, ctx.world_size).shard(ctx.rank, ctx.world_size)
        workload.loss(wrapped, batch).backward()
        finish()
        none_grads.append(
            {n for n, p in model.named_parameters() if p.requires_grad and p.grad is None}
        )
        _, found = auditor.audit(f"step {step} grads", auditor.grad_tensors())
        problems += [m.describe() for m in found]
        optimizer.step()
        _, found = auditor.audit(f"step {step}", auditor.state_tensors())
        problems += [m.describe() for m in found]
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    return params, none_grads, problems


def compare(name, got, reference, *, exact=False) -> list[str]:
    """Problems of cell `name` against a reference run (empty when they agree)."""
    params, none_grads, problems = got
    ref_params, ref_none, _ = reference
    out = [f"{name}: {p}" for p in problems]
    for step, (mine, theirs) in enumerate(zip(none_grads, ref_none), 1):
        if mine != theirs:
            out.append(
                f"{name}: step {step}: grad None for {sorted(mine)}, reference {sorted(theirs)}"
            )
    dtypes = {p.dtype for p in params.values()}
    for n, p in params.items():
        q = ref_params[n]
        if exact:
            if not torch.equal(p, q):
                out.append(f"{name}: {n} not bitwise equal to the reference")
        elif not torch.allclose(p.float(), q.float(), **tolerance(dtypes)):
            diff = (p.double() - q.double()).abs().max().item()
            out.append(f"{name}: {n} differs from the reference by {diff:.3g}")
    return out


def rank_all_cells(ctx) -> list[str]:
    problems = []
    for wl in HARD_CASES:
        reference = train(ctx, "torch-ddp", wl)
        trained = {impl: train(ctx, impl, wl) for impl in DDP_VARIANTS}
        for impl, got in trained.items():
            problems += compare(f"{impl}/{wl}", got, reference)
        # ZeRO-1 against the same DDP with the unsharded optimizer: bitwise.
        problems += compare(f"zero1/{wl}", train(ctx, "zero1", wl), trained["bucketed"], exact=True)
        if wl != "mixed":  # ZeroRedundancyOptimizer rejects models with several dtypes
            torch_zero = train(ctx, "torch-zero", wl)
            problems += compare(f"torch-zero/{wl}", torch_zero, reference, exact=True)
    return problems


def assert_no_problems(run):
    assert run.ok, run.summary()
    problems = run.values[0]
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_every_impl_on_every_hard_case_matches_the_references(world_size):
    assert_no_problems(launch(rank_all_cells, world_size=world_size, timeout_s=240))


def rank_bucket_sizes(ctx) -> list[str]:
    """One bucket, one bucket per parameter, several multi-parameter buckets."""
    problems = []
    reference = train(ctx, "torch-ddp", "transformer", bucket_mb=25)
    for mb in (25, 1e-9, 0.05):
        got = train(ctx, "bucketed", "transformer", bucket_mb=mb)
        problems += compare(f"bucketed/{mb}MB", got, reference)
    return problems


def test_bucket_sizes_from_one_bucket_to_one_per_parameter():
    assert_no_problems(launch(rank_bucket_sizes, world_size=3, timeout_s=240))


def rank_zero_grad_keep(ctx) -> list[str]:
    """zero_grad(set_to_none=False): unused parameters carry zero gradients, not None."""
    problems = []
    for wl in ("unused", "mlp"):
        reference = train(ctx, "torch-ddp", wl, set_to_none=False)
        for impl in DDP_VARIANTS:
            got = train(ctx, impl, wl, set_to_none=False)
            problems += compare(f"{impl}/{wl}/set_to_none=False", got, reference)
    return problems


def test_zero_grad_set_to_none_false():
    assert_no_problems(launch(rank_zero_grad_keep, world_size=2, timeout_s=240))


class _CountingAllReduce:
    """Counts all-reduces issued through torch.distributed (wraps the real collective)."""

    def __init__(self):
        self.calls = 0
        self.real = dist.all_reduce

    def __call__(self, *args, **kwargs):
        self.calls += 1
        return self.real(*args, **kwargs)


def accumulate(ctx, impl_name, workload, micro_batches):
    """Backward over `micro_batches`, all but the last under no_sync(); returns the synced
    gradients and how many all-reduces were issued inside no_sync()."""
    impl = resolve(impl_name)
    torch.manual_seed(ctx.rank)
    model = workload.build()
    wrapped = impl.wrap(model, bucket_size_mb=SMALL_BUCKET_MB, find_unused_parameters=True)
    finish = getattr(wrapped, "finish_gradient_synchronization", lambda: None)
    counter = _CountingAllReduce()
    dist.all_reduce = counter
    try:
        with wrapped.no_sync():
            for batch in micro_batches[:-1]:
                (workload.loss(wrapped, batch) / len(micro_batches)).backward()
                finish()
        inside = counter.calls
        (workload.loss(wrapped, micro_batches[-1]) / len(micro_batches)).backward()
        finish()
    finally:
        dist.all_reduce = counter.real
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return grads, inside


def compare_grads(name, grads, reference) -> list[str]:
    if grads.keys() != reference.keys():
        return [f"{name}: gradients present for {sorted(grads)}, reference {sorted(reference)}"]
    # Same values summed in a different order (accumulation vs one batch): float32 rounding.
    return [
        f"{name}: gradient of {n} differs by {(g - reference[n]).abs().max():.3g}"
        for n, g in grads.items()
        if not torch.allclose(g, reference[n], rtol=1e-5, atol=1e-7)
    ]


def rank_no_sync(ctx) -> list[str]:
    problems = []
    ws = ctx.world_size
    for wl in ("mlp", "unused"):
        workload = get_workload(wl, local_batch=4)
        # Micro-batches of different steps: in `unused`, the first takes the `sometimes`
        # branch and the second does not, so a gradient exists only from the window.
        micro = [workload.batch(s, ws).shard(ctx.rank, ws) for s in (1, 2)]
        reference, _ = accumulate(ctx, "torch-ddp", workload, micro)
        for impl in DDP_VARIANTS:
            grads, inside = accumulate(ctx, impl, workload, micro)
            if ws > 1 and inside:
                problems.append(f"{impl}/{wl}: {inside} all-reduces inside no_sync()")
            problems += compare_grads(f"{impl}/{wl}", grads, reference)
        if wl == "mlp":
            # One synchronized backward over both micro-batches together.
            whole = Batch(
                torch.cat([b.inputs for b in micro]), torch.cat([b.targets for b in micro])
            )
            one_step, _ = accumulate(ctx, "bucketed", workload, [whole])
            problems += compare_grads("accumulated vs one step", reference, one_step)
    return problems


def test_no_sync_communicates_only_on_the_last_micro_step():
    assert_no_problems(launch(rank_no_sync, world_size=2, timeout_s=240))
