"""`bucketed` keeps gradients in its buckets: after a synchronization each `.grad` is a view of
a bucket buffer, and however a training loop treats `.grad` between steps the gradients are
PyTorch DDP's.

Each cell trains `bucketed` and `torch-ddp` (`find_unused_parameters=True`, gradients copied
into its buckets and back) in the same process from the same initial weights, three SGD steps,
and compares every gradient after every synchronization. The loops: `zero_grad()` (fresh
gradients from autograd every step: each is divided into its view and replaced by it),
`zero_grad(set_to_none=False)` (gradients accumulate in the views, divided in place), and no
`zero_grad()` at all (last step's averages stay in the views and this step's gradients add to
them; a parameter no rank uses keeps its old values), each with two micro-batches under
`no_sync()` per step, on every hard-case workload (frozen and tied parameters, parameters
unused on some ranks and on all, mixed dtypes).

Without `zero_grad()` the reference is `overlap` (each gradient reduced in place, no buckets):
PyTorch DDP there all-reduces the old gradient a rank did not add to this step, where the
built-ins count a parameter a rank did not use as a zero gradient (`impls/base.py`'s contract).

A `.grad` that is a view of a bucket in flight is memory in flight: the race sanitizer sees an
optimizer that reads it before the bucket's all-reduce completes (a fresh racy wrapper here).

Exact comparison, and why it holds: on 2 ranks both divide each gradient by 2 (exact, a power
of two) before a sum of two values, which does not depend on the order gloo adds them in, and
both accumulate micro-batches and steps in `.grad` the same way (autograd's in-place add).
"""

from __future__ import annotations

import torch

from impls.bucketed import BucketedDDP
from impls.registry import resolve
from verify.launching import launch
from verify.sanitize import READ_WHILE_IN_FLIGHT, Sanitizer
from verify.training.workloads import HARD_CASES, get_workload

SMALL_BUCKET_MB = 0.001  # several multi-parameter buckets even in the small models
LOOPS = ("set_to_none", "zero", "no_zero_grad")


def train(ctx, impl_name: str, workload_name: str, loop: str):
    """Three steps of two micro-batches; returns the model, the wrapper and, per step, every
    trainable parameter's gradient (None where it has none) after the synchronization."""
    impl, workload = resolve(impl_name), get_workload(workload_name)
    torch.manual_seed(1000 + ctx.rank)  # different per rank: construction broadcasts
    model = workload.build()
    wrapped = impl.wrap(model, bucket_size_mb=SMALL_BUCKET_MB, find_unused_parameters=True)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    finish = getattr(wrapped, "finish_gradient_synchronization", lambda: None)
    grads = []
    for step in range(1, 4):
        if loop != "no_zero_grad":
            optimizer.zero_grad(set_to_none=loop == "set_to_none")
        for micro in range(2):
            # Same parity within a step: `unused` skips its `sometimes` branch in even ones.
            batch = workload.batch(step + 10 * micro, ctx.world_size)
            batch = batch.shard(ctx.rank, ctx.world_size)
            if micro == 0:
                with wrapped.no_sync():
                    (workload.loss(wrapped, batch) / 2).backward()
            else:
                (workload.loss(wrapped, batch) / 2).backward()
        finish()
        grads.append(
            {
                n: None if p.grad is None else p.grad.clone()
                for n, p in model.named_parameters()
                if p.requires_grad
            }
        )
        optimizer.step()
    return model, wrapped, grads


def outside_buckets(model, wrapped) -> list[str]:
    """Parameters whose `.grad` is not exactly their view of a bucket buffer."""
    views = {id(p): v for b in wrapped.buckets for p, v in zip(b.params, b.views, strict=True)}
    return [
        n
        for n, p in model.named_parameters()
        if p.grad is not None and p.grad is not views.get(id(p))
    ]


def rank_cells(ctx) -> list[str]:
    problems = []
    for workload in HARD_CASES:
        for loop in LOOPS:
            name = f"{workload}/{loop}"
            reference_impl = "overlap" if loop == "no_zero_grad" else "torch-ddp"
            _, _, reference = train(ctx, reference_impl, workload, loop)
            model, wrapped, got = train(ctx, "bucketed", workload, loop)
            for step, (mine, theirs) in enumerate(zip(got, reference, strict=True), 1):
                for n, g in mine.items():
                    ref = theirs[n]
                    if (g is None) != (ref is None):
                        problems.append(
                            f"{name} step {step}: {n}.grad {g is None=} vs {reference_impl}'s"
                        )
                    elif g is not None and not torch.equal(g, ref):
                        diff = (g.double() - ref.double()).abs().max().item()
                        problems.append(f"{name} step {step}: {n}.grad differs by {diff:.3g}")
            if loop != "no_zero_grad":  # there, an old gradient of an unused one is kept
                problems += [
                    f"{name}: {n}.grad is not a bucket view"
                    for n in outside_buckets(model, wrapped)
                ]
    return problems


def test_gradients_are_ddps_whatever_the_loop_does_with_grad():
    run = launch(rank_cells, world_size=2, timeout_s=240)
    assert run.ok, run.summary()
    assert not run.values[0], "\n".join(run.values[0])


class StepsOnBucketsInFlight(BucketedDDP):
    """Returns from the synchronization with its buckets still on the wire, and waits for them
    only after `optimizer.step()`: the step reads `.grad`, views of buffers in flight."""

    def _finish_synchronization(self) -> None:
        self._launch_ready_units(force=True)
        used = self._globally_used()
        for unit, _, bucket in self._in_flight:
            bucket.attach([used[i] for i in self.units[unit]])  # no wait: the race
        self.landing = [bucket for _, _, bucket in self._in_flight]
        self._reset()

    def land(self) -> None:
        for bucket in self.landing:
            bucket.wait()


def rank_race(ctx):
    """(findings, parameters) of two sanitized SGD steps of `StepsOnBucketsInFlight`."""
    workload = get_workload("mlp")
    torch.manual_seed(0)
    model = workload.build()
    wrapped = StepsOnBucketsInFlight(model, bucket_size_mb=SMALL_BUCKET_MB)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with Sanitizer(rank=ctx.rank) as san:
        for step in range(2):
            san.set_step(step)
            san.name_tensors(model.named_parameters())
            optimizer.zero_grad()
            batch = workload.batch(step, ctx.world_size).shard(ctx.rank, ctx.world_size)
            workload.loss(wrapped, batch).backward()
            wrapped.finish_gradient_synchronization()
            optimizer.step()
            wrapped.land()
            san.end_step()
    return san.findings, [p.detach().clone() for p in model.parameters()]


def test_the_sanitizer_sees_a_read_of_a_gradient_view_in_flight():
    run = launch(rank_race, world_size=2, timeout_s=120)
    assert run.ok, run.summary()
    for findings, _ in run.values:
        assert findings and all(f.kind == READ_WHILE_IN_FLIGHT for f in findings), findings
        assert {f.tensor for f in findings} >= {"fc1.weight.grad", "fc2.bias.grad"}
        assert all(f.op in ("add_", "_foreach_add_") for f in findings)  # SGD reads .grad
    # Adversarial completion: each rank stepped with its own gradient, on every run.
    mine, theirs = (params for _, params in run.values)
    assert not all(torch.equal(a, b) for a, b in zip(mine, theirs, strict=True))
