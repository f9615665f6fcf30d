"""`verify.training.optim_state`: a rank's optimizer-state bytes, found wherever they live.

Single process. The expected number is always computed from the inner optimizer's own
`state` (the ground truth the class's author would point at), and must be matched exactly:
the walk has to find the state under any attribute name, and must not count the parameters,
the gradients, or the flat buffers that parameters are views of (ZeRO-1 keeps those in the
optimizer). Optimizers that need a process group get a one-rank gloo group in this process.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.optim import ZeroRedundancyOptimizer

from impls.zero import ShardedOptimizer
from verify.training.optim_state import MAX_DEPTH, StateBytes, local_state_bytes
from verify.training.plain_state import PlainState, unsharded_state
from verify.training.workloads import get_workload

sys.path.insert(0, str(Path(__file__).parent / "fixtures" / "third_party"))
import cs336_style as cs336  # noqa: E402

from tests.fixtures import sharded_styles  # noqa: E402


def inner_bytes(optimizer: torch.optim.Optimizer) -> int:
    return sum(
        v.numel() * v.element_size()
        for s in optimizer.state.values()
        for v in s.values()
        if torch.is_tensor(v)
    )


def inner_tensors(optimizer: torch.optim.Optimizer) -> int:
    return sum(torch.is_tensor(v) for s in optimizer.state.values() for v in s.values())


def trained(make, workload="mlp", steps=2):
    """A model and `make(param_groups)`'s optimizer after `steps` steps on local data."""
    wl = get_workload(workload)
    torch.manual_seed(0)
    model = wl.build()
    optimizer = make(wl.param_groups(model, lr=1e-2))
    for step in range(1, steps + 1):
        optimizer.zero_grad()
        wl.loss(model, wl.batch(step, 1)).backward()
        optimizer.step()
    return model, optimizer


@pytest.fixture
def one_rank_group(tmp_path):
    """A one-rank gloo process group in this process (ZeroRedundancyOptimizer and the
    CS336-style classes ask torch.distributed for their rank)."""
    assert not dist.is_initialized()
    dist.init_process_group(
        "gloo", init_method=f"file://{tmp_path / 'rendezvous'}", rank=0, world_size=1
    )
    try:
        yield
    finally:
        dist.destroy_process_group()


# --- plain and known optimizers --------------------------------------------------------------


def test_plain_adamw():
    model, opt = trained(lambda groups: torch.optim.AdamW(groups, lr=1e-2))
    found = local_state_bytes(opt, model.parameters())
    n = len(list(model.parameters()))
    step = 4 * n  # one float32 `step` a parameter: the scalars
    assert found == StateBytes(inner_bytes(opt), 3 * n, tuple(range(n)), "", found.paths, step)
    assert found.paths[0] == ".state[param 0]['step']"
    plain = unsharded_state(model.parameters())
    assert (found.bytes, found.scalar_bytes) == (
        sum(p.bytes for p in plain),
        sum(p.scalar_bytes for p in plain),
    )


def test_sgd_with_and_without_momentum():
    model, opt = trained(lambda groups: torch.optim.SGD(groups, lr=1e-2, momentum=0.9))
    found = local_state_bytes(opt, model.parameters())
    assert (found.bytes, found.tensors) == (inner_bytes(opt), inner_tensors(opt))
    assert found.bytes == sum(p.numel() * 4 for p in model.parameters())
    model, opt = trained(lambda groups: torch.optim.SGD(groups, lr=1e-2))
    assert local_state_bytes(opt, model.parameters()) == StateBytes(0, 0, ())


def test_sharded_optimizer_flat_buffers_are_not_state():
    model, opt = trained(lambda groups: ShardedOptimizer(groups, torch.optim.AdamW))
    params = list(model.parameters())
    flats = [flat for _, flat in opt._flat]
    # The premise: every parameter is a view into a flat buffer the optimizer holds.
    assert flats and all(
        any(p.untyped_storage().data_ptr() == f.untyped_storage().data_ptr() for f in flats)
        for p in params
    )
    found = local_state_bytes(opt, params)
    assert found.bytes == inner_bytes(opt.inner) == opt.local_state_bytes()
    assert found.tensors == inner_tensors(opt.inner)
    assert found.owners == tuple(range(len(params))) and not found.note


def test_slices_an_inner_optimizer_steps_are_not_state(one_rank_group):
    """By slices (tests/fixtures/sharded_styles.py): the inner optimizer's parameters are
    copies of this rank's slices, held in a dict the walk meets before the inner optimizer;
    like the model's parameters, they are not state. Its state is not keyed by the model's
    parameters, so whose it is stays unknown."""
    model, opt = trained(lambda groups: sharded_styles.SliceShardedAdamW(groups, torch.optim.AdamW))
    found = local_state_bytes(opt, model.parameters())
    assert list(vars(opt)).index("slices") < list(vars(opt)).index("inner")
    assert (found.bytes, found.tensors) == (inner_bytes(opt.inner), inner_tensors(opt.inner))
    assert found.scalar_bytes == 4 * len(opt.slices) and found.owners is None


@pytest.mark.parametrize("bucket_view", [False, True])
def test_zero_redundancy_optimizer(one_rank_group, bucket_view):
    def make(groups):
        params = [p for g in groups for p in g["params"]]
        return ZeroRedundancyOptimizer(
            params, optimizer_class=torch.optim.AdamW, parameters_as_bucket_view=bucket_view
        )

    model, opt = trained(make)
    assert bool(opt._buckets) == bucket_view  # parameters are views into its buckets
    found = local_state_bytes(opt, model.parameters())
    assert found.bytes == inner_bytes(opt.optim) > 0
    assert found.tensors == inner_tensors(opt.optim) and not found.note


# --- classes in the style of public solutions -------------------------------------------------


class _Shard(torch.optim.Optimizer):
    """Sharded the way course solutions shard, posing as rank 1 of 2 (no communication: this
    measures what the rank holds, not whether it trains right)."""

    inner_name = "optimizer"

    def __init__(self, params, optimizer_cls, rank=1, world_size=2, **kwargs):
        super().__init__(params, kwargs)
        everything = [p for g in self.param_groups for p in g["params"]]
        self.mine = [p for i, p in enumerate(everything) if i % world_size == rank]
        setattr(self, self.inner_name, optimizer_cls(self.mine, **kwargs))

    @property
    def inner(self):
        return getattr(self, self.inner_name)

    def step(self, closure=None):
        self.inner.step()


class DotOptimizer(_Shard):
    inner_name = "optimizer"


class LocalName(_Shard):
    """Parameters as views into a flat buffer held here (ZeRO-style), a back-reference to the
    model, a cycle, a lambda: none of it is state."""

    inner_name = "_local_optimizer"

    def __init__(self, params, optimizer_cls, model=None, **kwargs):
        super().__init__(params, optimizer_cls, **kwargs)
        everything = [p for g in self.param_groups for p in g["params"]]
        self.flat = torch.zeros(sum(p.numel() for p in everything))
        offset = 0
        for p in everything:
            self.flat[offset : offset + p.numel()].copy_(p.detach().reshape(-1))
            p.data = self.flat[offset : offset + p.numel()].view_as(p)
            offset += p.numel()
        self.model, self.me, self.hook = model, self, lambda: self.flat


class Inopt(_Shard):
    """Attribute access that raises, the way some wrappers forward to their inner object."""

    inner_name = "inopt"

    @property
    def broken(self):
        raise RuntimeError("never read me")

    def __getattr__(self, name):
        raise RuntimeError(f"no {name} here")


@pytest.mark.parametrize("cls", [DotOptimizer, LocalName, Inopt])
def test_student_style_inner_optimizer_names(cls):
    model, opt = trained(lambda groups: cls(groups, torch.optim.AdamW))
    params = list(model.parameters())
    found = local_state_bytes(opt, params)
    assert found.bytes == inner_bytes(opt.inner) > 0
    assert found.tensors == inner_tensors(opt.inner)
    owned = tuple(sorted(i for i, p in enumerate(params) if any(p is q for q in opt.mine)))
    assert found.owners == owned and 0 < len(owned) < len(params)
    assert not found.note
    assert all(path.startswith(f".{cls.inner_name}.state[param ") for path in found.paths)


@pytest.mark.parametrize(
    "cls, inner",
    [
        (cs336.ShardedOptimizerDotOptimizer, "optimizer"),
        (cs336.ShardedOptimizerLocalName, "_local_optimizer"),
        (cs336.ShardedOptimizerInopt, "inopt"),
    ],
)
def test_third_party_fixtures(one_rank_group, cls, inner):
    model, opt = trained(lambda groups: cls(groups, torch.optim.AdamW, lr=1e-2))
    found = local_state_bytes(opt, model.parameters())
    assert found.bytes == inner_bytes(getattr(opt, inner)) > 0 and not found.note


# --- layouts the walk must get right ----------------------------------------------------------


class FlatState(torch.optim.Optimizer):
    """One flat exp_avg buffer; per-parameter state entries are views into it; one global step
    counter that belongs to no parameter."""

    def __init__(self, params):
        super().__init__(params, {})
        params = [p for g in self.param_groups for p in g["params"]]
        self.buffer = torch.zeros(sum(p.numel() for p in params), dtype=torch.float64)
        self.counter = torch.zeros((), dtype=torch.int64)
        offset = 0
        for p in params:
            self.state[p]["exp_avg"] = self.buffer[offset : offset + p.numel()].view_as(p)
            offset += p.numel()


def test_views_of_one_state_buffer_count_once():
    model = nn.Linear(4, 3)
    opt = FlatState(model.parameters())
    found = local_state_bytes(opt, model.parameters())
    assert found.bytes == opt.buffer.nbytes + opt.counter.nbytes
    assert found.tensors == 4 and found.owners == (0, 1)


def test_state_not_keyed_by_parameters_has_unknown_owners():
    model = nn.Linear(4, 3)

    class Positional:
        def __init__(self, params):
            self.moments = [torch.zeros_like(p) for p in params]

    found = local_state_bytes(Positional(list(model.parameters())), model.parameters())
    assert found.bytes == (12 + 3) * 4 and found.owners is None
    assert found.paths == (".moments[0]", ".moments[1]")


def test_gradients_and_their_buffers_are_not_state():
    model = nn.Linear(4, 3)

    class HoldsGradients:
        def __init__(self):
            self.bucket = torch.zeros(15)  # .grad of every parameter is a view of it
            model.weight.grad = self.bucket[:12].view(3, 4)
            model.bias.grad = self.bucket[12:]
            self.reduce_buffer = torch.zeros(15)  # a wrapper's buffer, passed as grads=
            self.copies = [p.grad for p in model.parameters()]

    holder = HoldsGradients()
    found = local_state_bytes(holder, model.parameters(), grads=[holder.reduce_buffer])
    assert found == StateBytes(0, 0, ())


def test_never_raises_and_says_what_it_skipped():
    model = nn.Linear(4, 3)

    class Weird:
        __slots__ = ("slotted", "unset")

        @property
        def __dict__(self):
            raise RuntimeError("no dict for you")

    class Odd:
        @property
        def param_groups(self):
            raise RuntimeError("groups exploded")

    odd, weird = Odd(), Weird()
    weird.slotted = torch.ones(2)  # read through __slots__
    odd.weird = weird
    odd.sparse = torch.eye(3).to_sparse()
    odd.module = model  # modules are never walked: their tensors are the model's
    odd.gen = torch.Generator()
    deep = leaf = []
    for _ in range(MAX_DEPTH + 2):
        leaf.append([])
        leaf = leaf[0]
    leaf.append(torch.ones(1))
    odd.deep = deep
    found = local_state_bytes(odd, model.parameters())
    assert found.bytes == 8 and found.tensors == 1  # the slot's tensor only
    for part in ("depth limit", "param_groups", "no dict for you", ".sparse"):
        assert part in found.note
    for obj in (None, 42, "text", model, nn.Linear):
        assert local_state_bytes(obj, model.parameters()) == StateBytes(0, 0, ())


# --- the unsharded yardstick --------------------------------------------------------------------


def test_unsharded_state():
    assert unsharded_state([]) == []
    p32, p64 = torch.zeros(5, 3, requires_grad=True), torch.zeros(7, dtype=torch.float64)
    step = torch.zeros((), dtype=torch.float32).element_size()  # AdamW's step counter
    adamw = unsharded_state([p32, p64])
    assert adamw == [PlainState(2 * 15 * 4 + step, step, 15), PlainState(2 * 7 * 8 + step, step, 7)]
    assert [(p.vector_bytes, p.element_bytes) for p in adamw] == [(120, 8), (112, 16)]
    sgd = unsharded_state([p32, p64], torch.optim.SGD, lr=0.1, momentum=0.9)
    assert sgd == [PlainState(15 * 4, 0, 15), PlainState(7 * 8, 0, 7)]
    assert p32.grad is None  # copies were stepped, not the parameters


def test_a_second_copy_of_a_parameters_state_is_found_and_other_names_are_not():
    """`StateBytes.copy`: the wrapper's own `.state` holding a copy of what its inner optimizer
    holds (a load that copied twice) is found, with its bytes; a tensor shared by both is one
    storage, no copy; two states of one parameter whose last key agrees but whose names do
    not (Shampoo-style lists: `['Q'][0]` and `['GG'][0]`) are not a copy."""

    class Wrapper:
        def __init__(self, inner, own):
            self.inner, self.state = inner, own

    p = nn.Parameter(torch.ones(4, 3))
    inner = torch.optim.AdamW([p])
    p.grad = torch.ones_like(p)
    inner.step()
    held = inner.state[p]
    copied = local_state_bytes(Wrapper(inner, {p: {k: v.clone() for k, v in held.items()}}), [p])
    assert set(copied.copy) == {".state[param 0]['exp_avg']", ".inner.state[param 0]['exp_avg']"}
    assert copied.copy_bytes == 2 * 48  # exp_avg and exp_avg_sq; `step` is a scalar
    shared = local_state_bytes(Wrapper(inner, {p: dict(held)}), [p])
    assert shared.copy == () and shared.copy_bytes == 0
    lists = {p: {"Q": [torch.zeros(3, 3)], "GG": [torch.zeros(3, 3)]}}
    named = local_state_bytes(Wrapper(torch.optim.SGD([p]), lists), [p])
    assert named.copy == () and named.bytes == 72
