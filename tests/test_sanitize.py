"""The race sanitizer (`verify.sanitize`) on real gloo ranks, no mocks.

Racy student classes (`tests/fixtures/race_classes.py`) are caught on every run, with the
lines that issued and raced; under adversarial completion their numbers come out wrong the same
way every time; correct patterns and every built-in train clean, to the same bits as without
the sanitizer; install/uninstall leave `torch.distributed` exactly as found.

Two launches carry every multi-rank scenario (a launch costs ~2 s of CPU per rank); the tests
read their results. Sums are compared bitwise: with two ranks an all-reduce adds two numbers,
and a + b == b + a exactly.
"""

import contextlib
import pathlib

import pytest
import torch
import torch.distributed as dist
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel
from torch.utils._python_dispatch import _get_current_dispatch_mode

from impls.bucketed import BucketedDDP
from impls.flat import FlatDDP
from impls.naive import NaiveDDP
from impls.overlap import OverlapDDP
from impls.zero import ShardedOptimizer
from tests.fixtures import overlap_scaled
from tests.fixtures import race_classes as rc
from verify.launching import launch
from verify.sanitize import (
    NEVER_WAITED,
    READ_WHILE_IN_FLIGHT,
    WRITE_WHILE_IN_FLIGHT,
    Sanitizer,
    blind_spots,
)
from verify.sanitize.access import HeldMemory, op_plan
from verify.training.workloads import get_workload
from verify.watching import tracer

FIXTURE = pathlib.Path(rc.__file__)
GRADS = {f"{module}.{p}.grad" for module in ("fc1", "norm", "fc2") for p in ("weight", "bias")}
aten = torch.ops.aten


def _line(path: pathlib.Path, marker: str) -> int:
    lines = path.read_text().splitlines()
    return next(i for i, text in enumerate(lines, 1) if text.rstrip().endswith(marker))


def _at(site: str, path: pathlib.Path, marker: str) -> bool:
    return site.split(" (")[0].endswith(f"{path.name}:{_line(path, marker)}")


# ------------------------------------------------------------ inside the ranks


def _train(ctx, wrap, *, steps=2, san=None, optimizer=None, after_step=None, names=None,
           keep_local=False):  # fmt: skip
    """The project's loop; returns (parameters, local grads and synced grads of the last step).

    `optimizer(model)` builds the optimizer (default: SGD); `names(wrapped)` names more tensors.
    Local gradients are copied only if `keep_local`: with a variant that all-reduces them from
    inside backward, the copy would itself be a read while in flight.
    """
    workload = get_workload("mlp")
    torch.manual_seed(0)
    model = workload.build()
    wrapped = wrap(model)
    opt = optimizer(model) if optimizer else torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(steps):
        if san is not None:
            san.set_step(step)
            san.name_tensors(model.named_parameters())
            san.name_tensors(names(wrapped) if names else ())
        opt.zero_grad()
        batch = workload.batch(step, ctx.world_size).shard(ctx.rank, ctx.world_size)
        workload.loss(wrapped, batch).backward()
        local = [p.grad.clone() for p in model.parameters()] if keep_local else None
        wrapped.finish_gradient_synchronization()
        opt.step()  # STEP
        if after_step is not None:
            after_step(wrapped)
        synced = [p.grad.clone() for p in model.parameters()]  # the step left them as synced
        if san is not None:
            san.end_step()
    return [p.detach().clone() for p in model.parameters()], local, synced


def _sanitized(ctx, wrap, adversarial=True, **kwargs):
    """(findings, what `_train` returns, stats, whether the check was off at the end)."""
    with Sanitizer(rank=ctx.rank, adversarial=adversarial) as san:
        out = _train(ctx, wrap, san=san, **kwargs)
        off = _get_current_dispatch_mode() is None
    return san.findings, out, san.stats, off


def _racy_scenarios(ctx):
    out = {}
    for cls in (rc.DivideBeforeWaitDDP, rc.WaitThenDivideDDP, rc.FutureThenDDP, rc.FutureWaitDDP):
        out[cls.__name__] = _sanitized(ctx, cls, keep_local=True)
    out["check only"] = _sanitized(ctx, rc.DivideBeforeWaitDDP, adversarial=False)
    out["step before wait"] = _sanitized(
        ctx, rc.StepBeforeWaitDDP, after_step=lambda w: w.wait_for_gradients()
    )
    out["shared staging"] = _sanitized(ctx, rc.SharedStagingDDP, names=_staging)
    out["arena"] = _sanitized(ctx, rc.ArenaDDP, names=_staging)
    out["hook staging"] = _sanitized(ctx, rc.HookStagingDDP, names=_staging)
    before = []
    out["forgetful"] = _sanitized(
        ctx, rc.WaitThenDivideDDP, steps=1, optimizer=lambda model: _forgetful(model, before)
    )
    out["forgetful before"] = before
    out["other ops"] = _other_ops(ctx)
    for cls in (
        overlap_scaled.ScaleInHookDDP,
        overlap_scaled.ScaleAfterWaitDDP,
        rc.WaitThenDivideDDP,
    ):
        out[f"accumulated {cls.__name__}"] = _accumulated(ctx, cls)
    # Composition with the collective tracer, which the launcher installed at rank start.
    out["tracer under us"] = tracer.installed() and _chains_to_tracer()
    return out


def _staging(wrapped):
    return [("staging", getattr(wrapped, "staging", getattr(wrapped, "arena", None)))]


def _accumulated(ctx, wrap, steps=2):
    """Two micro-batches a step, the first under `no_sync()` when the class has one, as a
    script runs them: no `end_step()`, the optimizer's step is where a step ends. (findings,
    stats)"""
    workload = get_workload("mlp")
    torch.manual_seed(0)
    model = workload.build()
    with Sanitizer(rank=ctx.rank) as san:
        wrapped = wrap(model)
        san.name_tensors(model.named_parameters())
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for step in range(steps):
            san.set_step(step)
            opt.zero_grad()
            for micro in range(2):
                batch = workload.batch(2 * step + micro, ctx.world_size)
                skip = getattr(wrapped, "no_sync", contextlib.nullcontext)
                with skip() if micro == 0 else contextlib.nullcontext():
                    workload.loss(wrapped, batch.shard(ctx.rank, ctx.world_size)).backward()
            wrapped.finish_gradient_synchronization()
            opt.step()
    return san.findings, san.stats


def _other_ops(ctx):
    """The other tracked collectives, used correctly, then a send and receive used early."""
    rank, peer = ctx.rank, 1 - ctx.rank
    with Sanitizer(rank=rank) as san:
        gathered = torch.zeros(4)
        gathered[2 * rank : 2 * rank + 2] = rank + 1.0  # in place: the input is a chunk
        dist.all_gather_into_tensor(
            gathered, gathered[2 * rank : 2 * rank + 2], async_op=True
        ).wait()
        scattered = torch.zeros(2)
        dist.reduce_scatter_tensor(scattered, torch.arange(4.0), async_op=True).wait()
        swapped = torch.zeros(2)
        dist.all_to_all_single(swapped, torch.full((2,), float(rank)), async_op=True).wait()
        got, sent = torch.zeros(3), torch.full((3,), float(rank))
        ops = [dist.P2POp(dist.isend, sent, peer), dist.P2POp(dist.irecv, got, peer)]
        for request in dist.batch_isend_irecv(ops):
            request.wait()
        both = torch.full((2,), rank + 1.0)  # wait() and a future's callback, racing
        work = dist.all_reduce(both, async_op=True)
        chained = work.get_future().then(lambda f: f.value()[0].clone())
        work.wait()
        waited, called_back = both.clone(), chained.wait()
        clean = san.findings
        early, late = torch.zeros(3), torch.full((3,), 10.0 + rank)
        san.name_tensors([("early", early), ("late", late)])
        works = [dist.isend(late, peer), dist.irecv(early, peer)]  # ISSUE p2p
        with san.quiet():  # a tool's own look is no race
            early.clone()
        seen = early.sum().item()  # BUG: before wait()  # RACE p2p read
        late.fill_(-1.0)  # BUG: before wait()  # RACE p2p write
        for work in works:
            work.wait()
    results = (gathered, scattered, swapped, got, waited, called_back)
    return clean, results, san.findings[len(clean) :], seen, early


def _forgetful(model, before):
    before += [p.detach().clone() for p in model.parameters()]
    return rc.ForgetfulShardedSGD(model.parameters())


def _chains_to_tracer() -> bool:
    traced_wait = dist.Work.wait
    with Sanitizer(rank=0):
        return dist.Work.wait.__wrapped__ is traced_wait


BUILTINS = {
    "naive": NaiveDDP,
    "flat": FlatDDP,
    "overlap": OverlapDDP,
    **{
        f"bucketed {mb}MB": (lambda m, mb=mb: BucketedDDP(m, bucket_size_mb=mb))
        for mb in (0.0005, 0.002, 25.0)
    },  # the mlp has 2.9 kB of gradients: 4, 2 and 1 buckets
}


def _builtin_scenarios(ctx):
    groups = get_workload("mlp").param_groups
    adamw = lambda model: torch.optim.AdamW(groups(model))  # noqa: E731
    recipes = {name: (wrap, adamw) for name, wrap in BUILTINS.items()}
    recipes["zero1 over bucketed"] = (
        lambda m: BucketedDDP(m, bucket_size_mb=0.001),
        lambda model: ShardedOptimizer(groups(model), torch.optim.AdamW),
    )
    recipes["torch zero over torch ddp"] = (
        DistributedDataParallel,
        lambda model: ZeroRedundancyOptimizer(
            model.parameters(), optimizer_class=torch.optim.AdamW, lr=1e-3
        ),
    )
    out = {}
    for name, (wrap, opt) in recipes.items():
        if name.startswith("torch"):  # PyTorch DDP has no finish_gradient_synchronization
            base = wrap
            wrap = lambda m, base=base: _Finishing(base(m))  # noqa: E731
        plain = _train(ctx, wrap, steps=3, optimizer=opt)[0]
        findings, (sanitized, _, _), stats, off = _sanitized(ctx, wrap, steps=3, optimizer=opt)
        same = all(torch.equal(a, b) for a, b in zip(plain, sanitized))
        out[name] = (findings, same, stats, off)
    torch.manual_seed(0)
    out["blind spots"] = (
        blind_spots(DistributedDataParallel(get_workload("mlp").build())),
        blind_spots(BucketedDDP(get_workload("mlp").build())),
    )
    return out


class _Finishing(torch.nn.Module):
    """PyTorch DDP in the project's loop: it synchronizes inside backward."""

    def __init__(self, ddp):
        super().__init__()
        self.ddp = ddp

    def forward(self, *args, **kwargs):
        return self.ddp(*args, **kwargs)

    def finish_gradient_synchronization(self):
        pass


@pytest.fixture(scope="module")
def racy():
    result = launch(_racy_scenarios, world_size=2, timeout_s=60)
    assert result.ok, result.summary()
    return result.values


@pytest.fixture(scope="module")
def builtins():
    result = launch(_builtin_scenarios, world_size=2, timeout_s=90)
    assert result.ok, result.summary()
    return result.values


# ------------------------------------------------------------ racy classes are caught


def test_divide_before_wait_is_found_and_sums_undivided(racy):
    for rank, values in enumerate(racy):
        for scenario in ("DivideBeforeWaitDDP", "check only"):
            findings = values[scenario][0]
            assert {f.tensor for f in findings} == GRADS
            f = next(f for f in findings if f.tensor == "fc1.weight.grad")
            expected = (WRITE_WHILE_IN_FLIGHT, "div_", rank, 0, 2)  # first at step 0, then 1
            assert (f.kind, f.op, f.rank, f.step, f.count) == expected
            assert (f.collective.op, f.collective.group) == ("all_reduce", "world")
            assert _at(f.issued_at, FIXTURE, "# ISSUE divide"), f.issued_at
            assert _at(f.accessed_at, FIXTURE, "# RACE divide"), f.accessed_at
            assert f.message.startswith("`div_` wrote fc1.weight.grad at "), f.message
    # Adversarial completion: the division lands on the user's tensor, the sum overwrites it.
    locals_ = [values["DivideBeforeWaitDDP"][1][1] for values in racy]
    for values in racy:
        synced = values["DivideBeforeWaitDDP"][1][2]
        for i, grad in enumerate(synced):
            assert torch.equal(grad, locals_[0][i] + locals_[1][i])


def test_step_before_wait_is_found_and_replicas_diverge(racy):
    for values in racy:
        findings = values["step before wait"][0]
        assert findings and all(f.kind == READ_WHILE_IN_FLIGHT for f in findings)
        assert {f.tensor for f in findings} >= {"fc1.weight.grad", "fc2.bias.grad"}
        for f in findings:
            assert f.op in ("add_", "_foreach_add_"), f.op  # SGD's update reads the gradient
            assert _at(f.accessed_at, pathlib.Path(__file__), "# STEP"), f.accessed_at
            assert _at(f.issued_at, FIXTURE, "# ISSUE step"), f.issued_at
    # Each rank stepped with its own local gradient: the replicas differ on every run.
    params = [values["step before wait"][1][0] for values in racy]
    assert not all(torch.equal(a, b) for a, b in zip(*params))


def test_shared_staging_buffer_is_found_but_disjoint_views_are_not(racy):
    for values in racy:
        findings = values["shared staging"][0]
        copy = [f for f in findings if f.op == "copy_" and f.kind == WRITE_WHILE_IN_FLIGHT]
        assert copy, [f.message for f in findings]
        assert all(f.tensor == "part of staging" for f in copy), [f.tensor for f in copy]
        assert all(_at(f.accessed_at, FIXTURE, "# RACE staging") for f in copy)
        assert all(_at(f.issued_at, FIXTURE, "# ISSUE staging") for f in copy)
        # Views of one arena at disjoint offsets: the same storage, never the same bytes.
        assert values["arena"][0] == ()


def test_race_inside_backward_is_found_from_the_first_step(racy):
    """Autograd runs each node with the thread state captured at backward's start: only a
    check armed before backward sees what a later gradient hook does."""
    for values in racy:
        findings, _, stats, _ = values["hook staging"]
        hook = [f for f in findings if _at(f.accessed_at or "", FIXTURE, "# RACE hook")]
        assert hook and hook[0].step == 0 and hook[0].op == "copy_", [f.message for f in findings]
        assert hook[0].tensor == "part of staging"
        assert stats.armed_backwards == 2  # the first, and every one after that issues inside


def test_a_race_after_a_no_sync_micro_batch_is_found_in_the_first_step(racy):
    """A micro-batch under `no_sync()` issues nothing: every backward of the first step is
    checked from its start, so the synchronizing one, whose hook scales the gradient right
    after launching its all-reduce, is seen at step 0 (it used to be left unarmed for good).
    A class that issues nothing inside backward is checked through the first step only."""
    fixture = pathlib.Path(overlap_scaled.__file__)
    for values in racy:
        findings, stats = values["accumulated ScaleInHookDDP"]
        scaled = [f for f in findings if f.kind == WRITE_WHILE_IN_FLIGHT and f.op == "mul_"]
        assert {f.tensor for f in scaled} == GRADS, [f.message for f in findings]
        assert all(
            f.step == 0 and _at(f.accessed_at, fixture, "# BUG: the all-reduce still owns the grad")
            for f in scaled
        )
        assert stats.armed_backwards == 4, stats
        findings, stats = values["accumulated ScaleAfterWaitDDP"]
        assert findings == () and stats.armed_backwards == 4, [f.message for f in findings]
        findings, stats = values["accumulated WaitThenDivideDDP"]
        assert findings == () and stats.armed_backwards == 2, stats


def test_other_collectives_are_tracked(racy):
    """Correct uses are clean and exact; a receive buffer read early reads what was there
    before, a send buffer overwritten early still sends its value at issue."""
    me = pathlib.Path(__file__)
    for rank, values in enumerate(racy):
        clean, results, early_findings, seen, received = values["other ops"]
        assert clean == ()
        gathered, scattered, swapped, got, waited, called_back = results
        assert gathered.tolist() == [1.0, 1.0, 2.0, 2.0]
        assert scattered.tolist() == ([0.0, 2.0] if rank == 0 else [4.0, 6.0])
        assert swapped.tolist() == [0.0, 1.0]
        assert got.tolist() == [1.0 - rank] * 3
        assert waited.tolist() == called_back.tolist() == [3.0, 3.0]
        kinds = {(f.kind, f.op, f.tensor, f.collective.op) for f in early_findings}
        assert kinds == {
            (READ_WHILE_IN_FLIGHT, "sum", "early", "irecv"),
            (WRITE_WHILE_IN_FLIGHT, "fill_", "late", "isend"),
        }
        for f in early_findings:
            assert _at(f.issued_at, me, "# ISSUE p2p")
            assert _at(
                f.accessed_at, me, "# RACE p2p read" if f.op == "sum" else "# RACE p2p write"
            )
        assert seen == 0.0 and received.tolist() == [11.0 - rank] * 3


def test_unwaited_broadcast_is_found_and_never_lands(racy):
    for rank, values in enumerate(racy):
        findings, (after, _, _), _, _ = values["forgetful"]
        assert len(findings) == 6
        assert all(f.kind == NEVER_WAITED and f.op == "broadcast" for f in findings)
        assert all(_at(f.issued_at, FIXTURE, "# ISSUE forget") for f in findings)
        assert findings[0].tensor == "fc1.weight" and findings[0].accessed_at is None
        before = values["forgetful before"]
        for i, (old, new) in enumerate(zip(before, after)):
            owned = i % 2 == rank
            assert torch.equal(old, new) != owned, (rank, i)  # others' updates never arrive


# ------------------------------------------------------------ correct code is clean


@pytest.mark.parametrize("scenario", ["WaitThenDivideDDP", "FutureThenDDP", "FutureWaitDDP"])
def test_correct_patterns_are_clean_and_average(racy, scenario):
    locals_ = [values[scenario][1][1] for values in racy]
    for values in racy:
        findings, (_, _, synced), _, off = values[scenario]
        assert off
        assert findings == ()
        for i, grad in enumerate(synced):  # .then() callbacks see the user's tensors, written
            assert torch.equal(grad, (locals_[0][i] + locals_[1][i]) / 2)


@pytest.mark.parametrize("name", [*BUILTINS, "zero1 over bucketed", "torch zero over torch ddp"])
def test_builtins_are_clean_and_unchanged(builtins, name):
    for values in builtins:
        findings, same, stats, off = values[name]
        assert findings == (), [f.message for f in findings]
        assert same, "adversarial completion changed the result of correct code"
        assert off, "the access check is still on after the last step"
        # Backward is armed at first, and afterwards only if collectives are issued inside it.
        in_backward = name.startswith(("overlap", "bucketed", "zero1"))
        assert stats.armed_backwards == (3 if in_backward else 1), stats


def test_blind_spots_name_ddp_reducer(builtins):
    ddp, ours = builtins[0]["blind spots"]
    assert len(ddp) == 1 and "reducer" in ddp[0]
    assert ours == []


# ------------------------------------------------------------ install and uninstall


def _surface() -> dict:
    owners = [dist, dist.distributed_c10d, dist.Work, torch.autograd, torch.autograd.graph]
    return {(id(o), k): v for o in owners for k, v in vars(o).items() if callable(v)}


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(a[k] is b[k] for k in a)


def test_install_uninstall_restores_exactly(tmp_path):
    """In this process (no process group needed to patch): alone, and over the tracer."""
    pristine = _surface()
    san = Sanitizer(rank=0)
    san.install()
    installed = _surface()
    san.install()  # idempotent
    assert not _same(pristine, installed) and _same(installed, _surface())
    san.uninstall()
    assert _same(pristine, _surface())
    tracer.install(str(tmp_path / "trace"), rank=0)
    try:
        traced = _surface()
        with Sanitizer(rank=0):
            assert dist.all_reduce.__wrapped__ is traced[(id(dist), "all_reduce")]
        assert _same(traced, _surface())
    finally:
        tracer.uninstall()
    assert _same(pristine, _surface())


def test_installed_over_the_launchers_tracer(racy):
    assert all(values["tracer under us"] for values in racy)


# ------------------------------------------------------------ the pieces, in one process


def test_op_plans_come_from_schemas():
    assert op_plan(aten.div_.Tensor) == ((0, "self", True), (1, "other", False))
    assert op_plan(aten.add.out)[-1] == (-1, "out", True)
    assert op_plan(aten._foreach_add_.List)[0] == (0, "self", True)
    for view in (aten.view.default, aten.t.default, aten.detach.default, aten._unsafe_view.default):
        assert op_plan(view) is None
    assert op_plan(aten.zeros_like.default) is None


def test_held_memory_overlap_and_roles():
    buffer = torch.zeros(100)
    sent, written, elsewhere = object(), object(), buffer[60:]
    held = HeldMemory()
    held.hold(buffer[:20], False, sent)  # a send: only read
    held.hold(buffer[30:50], True, written)  # a receive: written
    assert held.conflicts(buffer[10:15], write=False) == []
    assert [h.flight for h in held.conflicts(buffer[10:15], write=True)] == [sent]
    assert [h.flight for h in held.conflicts(buffer[45:55], write=False)] == [written]
    assert held.conflicts(elsewhere, write=True) == []
    assert held.conflicts(torch.zeros(100), write=True) == []  # another storage
    held.release(written)
    assert held.conflicts(buffer, write=True)[0].flight is sent and len(held.by_storage) == 1
