"""ZeRO-3 (`impls.zero3`) on the cases parameter sharding makes hard, on real gloo ranks.

One launch of 3 ranks trains a model built for the hard cases against the same model in one
process on the global batch: a layer with fewer rows than ranks (2 rows on 3 ranks: a rank
holds only padding), row counts no world size divides (5, 7), a frozen layer (left whole),
weights tied across two blocks (moved to the root's unit), and a ModuleList of blocks (a unit
each). SGD with momentum keeps a last-bit gradient difference a last-bit parameter
difference, so 3 steps stay within rtol 1e-5 / atol 1e-6 (the reduce-scatter adds the ranks'
values in another order than one process's backward does). Between steps each rank must hold
only its rows (1/N plus padding), and the full buffers must be freed. The same launch watches
the schedule from hooks that run after the wrapper's: in forward, the next block's gather is in
flight when a block starts; in backward, a block's gather is in flight while the block after it
completes its gradients; every unit's reduce-scatter is launched before `backward()` returns;
and no more than the root's unit and 2 others hold their full parameters at once. The refusals
are one line each: a 0-dim parameter, a unit mixing dtypes, parameters unused on some ranks.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from impls.zero3 import Zero3DDP, plan_units, shard_rows
from verify.launching import launch


class Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.fc = nn.Linear(d, d)

    def forward(self, x):
        return torch.tanh(self.fc(x))


class HardCases(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(4, 7)  # 7 rows: no world size here divides it
        self.blocks = nn.ModuleList([Block(7), Block(7)])
        self.frozen = nn.Linear(7, 5).requires_grad_(False)
        self.narrow = nn.Linear(5, 2)  # 2 rows on 3 ranks
        self.head = nn.Linear(7, 4, bias=False)
        self.unembed = nn.Linear(7, 4, bias=False)
        self.unembed.weight = self.head.weight  # tied across two blocks: the root's unit

    def forward(self, x):
        h = self.embed(x)
        for block in self.blocks:
            h = block(h)
        side = self.narrow(self.frozen(h)).sum(-1, keepdim=True)
        return self.head(h) + self.unembed(h.flip(-1)) + side


def test_rows_are_rounded_up_and_units_follow_blocks():
    assert [shard_rows(r, 3) for r in (1, 2, 3, 7)] == [1, 1, 1, 3]
    model = HardCases()
    units = plan_units(model)
    blocks = [b for b, _ in units]
    assert blocks[:4] == [model.embed, *model.blocks, model.narrow]  # frozen: nothing to shard
    root = units[-1]
    assert root[0] is None and len(root[1]) == 1 and root[1][0] is model.head.weight


def rank_hard_cases(ctx) -> list[str]:
    torch.manual_seed(0)
    model = HardCases()
    reference = copy.deepcopy(model)
    wrapped = Zero3DDP(model)
    problems = watch_overlap(wrapped, [model.embed, *model.blocks, model.narrow])
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    ref_optimizer = torch.optim.SGD(
        [p for p in reference.parameters() if p.requires_grad], lr=0.1, momentum=0.9
    )
    whole = sum(p.numel() for p in reference.parameters() if p.requires_grad)
    for step in range(3):
        torch.manual_seed(100 + step)
        batch = torch.randn(6, 4)
        shard = batch.chunk(ctx.world_size)[ctx.rank]
        optimizer.zero_grad()
        wrapped(shard).pow(2).mean().backward()
        if not_launched := [i for i, u in enumerate(wrapped.units) if u.used is None]:
            problems.append(f"step {step}: units {not_launched} not reduce-scattered in backward")
        wrapped.finish_gradient_synchronization()
        optimizer.step()
        ref_optimizer.zero_grad()
        reference(batch).pow(2).mean().backward()
        ref_optimizer.step()
        held = sum(p.numel() for p in model.parameters() if p.requires_grad)
        if held > whole / ctx.world_size + 5 * 7:  # 1/N plus at most a row of padding each
            problems.append(f"step {step}: holds {held} of {whole} elements")
        if any(u.full.untyped_storage().nbytes() for u in wrapped.units):
            problems.append(f"step {step}: a unit's full buffer was not freed")
    full = wrapped.full_parameters()
    for name, p in reference.named_parameters():
        if not torch.allclose(full[name], p, rtol=1e-5, atol=1e-6):
            diff = (full[name] - p).abs().max().item()
            problems.append(f"{name} differs from one process by {diff:.3g}")
    return problems + refusals()


def watch_overlap(wrapped: Zero3DDP, blocks: list[nn.Module]) -> list[str]:
    """Hooks, registered after the wrapper's so they see what it did, that note where the
    schedule is not overlapped (`blocks` in forward order, a unit each; the root's unit last)."""
    problems: list[str] = []
    units, root = wrapped.units[: len(blocks)], wrapped.root_unit

    def held(where: str) -> None:  # the root's unit and at most 2 others hold full parameters
        live = [u for u in units if u.gathered or u.gathering is not None]
        if len(live) > 2:
            problems.append(f"{where}: {len(live)} units besides the root's gathered at once")

    def before_forward(i: int) -> None:
        if i + 1 < len(units) and units[i + 1].gathering is None:
            problems.append(f"forward of unit {i}: unit {i + 1}'s gather not in flight")
        held(f"forward of unit {i}")

    def gradient(i: int) -> None:  # unit 0's parameters are not saved (its input needs none)
        if i >= 2 and units[i - 1].gathering is None and not units[i - 1].gathered:
            problems.append(f"backward of unit {i}: unit {i - 1}'s gather not in flight")
        held(f"backward of unit {i}")

    for i, (block, unit) in enumerate(zip(blocks, units)):
        block.register_forward_pre_hook(lambda m, args, i=i: before_forward(i))
        for leaf in unit.leaves:
            leaf.register_post_accumulate_grad_hook(lambda t, i=i: gradient(i))
    assert root is not None and root not in units
    return problems


def refusals() -> list[str]:
    said = []
    scalar = nn.Module()
    scalar.scale = nn.Parameter(torch.ones(()))
    mixed = nn.Module()
    mixed.a = nn.Parameter(torch.ones(2))
    mixed.b = nn.Parameter(torch.ones(2, dtype=torch.float64))
    for module, kwargs in [
        (scalar, {}),
        (mixed, {}),
        (nn.Linear(2, 2), {"find_unused_parameters": True}),
    ]:
        try:
            Zero3DDP(module, **kwargs)
            said.append(f"{type(module).__name__}: not refused")
        except ValueError as exc:
            said.append(str(exc))
    expected = ("scale is 0-dim", "mixes dtypes", "unused on some ranks")
    return [f"refusal {s!r} does not say {e!r}" for s, e in zip(said, expected) if e not in s]


def test_zero3_matches_one_process_on_the_hard_cases():
    run = launch(rank_hard_cases, world_size=3, timeout_s=240)
    assert run.ok, run.summary()
    problems = sorted({p for rank in run.values for p in rank})
    assert not problems, "\n".join(problems)
