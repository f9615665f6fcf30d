"""Single-process tests of the ZeRO-1 partitioner (`impls.sharding.partition_parameters`).

Balance is measured against `ShardPlan.bound`, a lower bound on the max load of any
whole-parameter partition; where the bound itself is not reachable (few, coarse sizes) we
compare with the exact optimum found by brute force instead.
"""

from __future__ import annotations

import itertools
import random
import time

import pytest

from impls.sharding import ShardPlan, partition_parameters


def gpt_sizes(n_layer: int, d: int, vocab: int, block: int, *, tied: bool = True) -> list[int]:
    """fp32 bytes of nanoGPT's parameters, in `model.parameters()` order."""
    numels = [vocab * d, block * d]
    for _ in range(n_layer):
        numels += [d, d, 3 * d * d, 3 * d, d * d, d, d, d, 4 * d * d, 4 * d, 4 * d * d, d]
    numels += [d, d] + ([] if tied else [vocab * d])
    return [4 * n for n in numels]


def check_consistent(plan: ShardPlan, sizes: list[int], world_size: int) -> None:
    """The plan's fields agree with each other and with the inputs."""
    assert plan.world_size == world_size
    assert len(plan.owners) == len(sizes)
    assert all(0 <= r < world_size for r in plan.owners)
    loads = [0] * world_size
    for s, r in zip(sizes, plan.owners):
        loads[r] += s
    assert list(plan.loads) == loads
    assert plan.total == sum(sizes)
    assert max(plan.loads) >= plan.bound  # it is a lower bound: no plan may beat it


def brute_force_optimum(sizes: list[int], world_size: int) -> int:
    best = sum(sizes)
    for assign in itertools.product(range(world_size), repeat=len(sizes) - 1):
        loads = [0] * world_size
        loads[0] = sizes[0]  # by symmetry the first item can go to rank 0
        for s, r in zip(sizes[1:], assign):
            loads[r] += s
        best = min(best, max(loads))
    return best


def torch_zero_greedy(groups: list[list[int]], world_size: int) -> list[list[int]]:
    """Owners chosen by ZeroRedundancyOptimizer._partition_parameters (torch 2.x), given each
    group's numels: sort a group by numel (stable), give each tensor to the rank with the
    fewest elements so far (lowest index on ties), carry the counts across groups in order.
    Returns owners[g][k] for the k-th tensor of group g."""
    counts = [0] * world_size
    owners = [[0] * len(group) for group in groups]
    for g, group in enumerate(groups):
        for k in sorted(range(len(group)), key=lambda k: -group[k]):
            r = counts.index(min(counts))
            owners[g][k] = r
            counts[r] += group[k]
    return owners


def loads_of(owners: list[list[int]], sizes: list[list[int]], world_size: int) -> list[int]:
    loads = [0] * world_size
    for group_owners, group_sizes in zip(owners, sizes):
        for r, s in zip(group_owners, group_sizes):
            loads[r] += s
    return loads


@pytest.mark.parametrize("world_size", [2, 3, 4, 8])
@pytest.mark.parametrize(
    "sizes",
    [gpt_sizes(12, 768, 50304, 1024), gpt_sizes(6, 384, 8192, 256), gpt_sizes(4, 128, 1000, 64)],
    ids=["gpt2-124M", "gpt-mini", "gpt-tiny"],
)
def test_gpt_close_to_bound(sizes, world_size):
    """Within 3% of the lower bound on GPT layouts. The gap that remains is granularity, not
    the search: block matrices come in multiples of d*d elements (gpt-mini at N=4 is 1.9%
    above the bound, and no assignment does better; a brute-force search over the d*d units
    agrees)."""
    plan = partition_parameters(sizes, world_size)
    check_consistent(plan, sizes, world_size)
    assert max(plan.loads) <= 1.03 * plan.bound


@pytest.mark.parametrize("seed", range(20))
def test_random_many_items_at_bound(seed):
    """With at least 8 items a rank, uniform and log-normal sizes end within 1% of the bound
    (measured worst over 300 seeds: 0.5%; LPT's error is at most the smallest item and local
    search removes most of it)."""
    rng = random.Random(seed)
    world_size = rng.randint(2, 8)
    n = world_size * rng.choice([8, 16, 64])
    if seed % 2:
        sizes = [rng.randint(1, 10**6) for _ in range(n)]
    else:
        sizes = [int(rng.lognormvariate(10, 2)) for _ in range(n)]
    plan = partition_parameters(sizes, world_size)
    check_consistent(plan, sizes, world_size)
    assert max(plan.loads) <= 1.01 * plan.bound


def test_small_instances_near_optimum():
    """Against the exact optimum on 300 small random instances: never above 4/3 of it (LPT's
    guarantee), optimal on the large majority, and never worse than LPT alone (local search
    only lowers the max). Measured: worst 1.037x, optimal on ~90%."""
    optimal = 0
    for seed in range(300):
        rng = random.Random(seed)
        world_size, n = rng.randint(2, 3), rng.randint(2, 8)
        sizes = [rng.randint(1, 100) for _ in range(n)]
        plan = partition_parameters(sizes, world_size)
        lpt = partition_parameters(sizes, world_size, max_rounds=0)
        check_consistent(plan, sizes, world_size)
        best = brute_force_optimum(sizes, world_size)
        assert max(plan.loads) <= max(lpt.loads)
        assert 3 * max(plan.loads) <= 4 * best
        optimal += max(plan.loads) == best
    assert optimal >= 0.8 * 300


@pytest.mark.parametrize("world_size", [3, 4])
def test_beats_torch_zero_greedy_on_grouped_gpt(world_size):
    """nanochat-style groups (block matrices, then embeddings, then an untied lm_head) make
    ZeroRedundancyOptimizer's per-group greedy spread the small tensors first and then stack
    the two 12.6 MB tables on top of the lightest ranks: 1.18x (N=3) and 1.36x (N=4) of 1/N.
    Planning all parameters at once, largest first, stays within 1% of 1/N."""
    sizes = gpt_sizes(6, 384, 8192, 256, tied=False)
    emb, head = [0, 1], [len(sizes) - 1]
    rest = [i for i in range(len(sizes)) if i not in emb + head]
    groups = [[sizes[i] for i in g] for g in (rest, emb, head)]  # fp32: numel = bytes / 4
    greedy = loads_of(torch_zero_greedy(groups, world_size), groups, world_size)
    plan = partition_parameters(sizes, world_size)
    assert max(greedy) / plan.ideal > 1.15
    assert plan.imbalance < 1.01
    assert max(plan.loads) < max(greedy)


def test_balances_bytes_not_elements():
    """Sizes are bytes: a bf16 tensor weighs half an fp32 one of the same numel. With fp32
    and bf16 tensors interleaved, an element-count greedy (ZeroRedundancyOptimizer's) gives
    one rank every fp32 tensor, 2:1 in bytes; planning on bytes splits them evenly."""
    numel = 1000
    nbytes = [4 * numel, 2 * numel] * 4
    greedy = loads_of(torch_zero_greedy([[numel] * 8], 2), [nbytes], 2)
    assert max(greedy) == 2 * min(greedy)
    plan = partition_parameters(nbytes, 2)
    assert plan.loads == (12 * numel, 12 * numel)


def test_deterministic():
    """Every rank computes the plan on its own, so equal inputs must give equal plans,
    whatever the container type and however many times it is called."""
    rng = random.Random(0)
    sizes = [rng.choice([4, 64, 4096, 4096, 65536]) for _ in range(500)]  # many ties
    plans = {partition_parameters(sizes, 5) for _ in range(3)}
    plans.add(partition_parameters(tuple(sizes), 5))
    assert len(plans) == 1


def test_more_ranks_than_parameters():
    plan = partition_parameters([5, 3], 4)
    check_consistent(plan, [5, 3], 4)
    assert plan.owners == (0, 1)
    assert plan.loads == (5, 3, 0, 0)
    assert plan.indices(2) == plan.indices(3) == ()
    assert plan.bound == 5  # the largest parameter; ceil(8 / 4) = 2 is not reachable


def test_world_size_one():
    sizes = [7, 0, 3]
    plan = partition_parameters(sizes, 1)
    check_consistent(plan, sizes, 1)
    assert plan.owners == (0, 0, 0)
    assert plan.imbalance == 1.0 and plan.indices(0) == (0, 1, 2)


def test_zero_sizes_and_empty():
    plan = partition_parameters([0, 0, 8, 0], 2)
    check_consistent(plan, [0, 0, 8, 0], 2)
    assert max(plan.loads) == 8
    empty = partition_parameters([], 3)
    assert empty.owners == () and empty.loads == (0, 0, 0)
    assert empty.bound == 0 and empty.imbalance == 1.0
    zeros = partition_parameters([0, 0], 2)
    assert zeros.imbalance == 1.0


def test_properties():
    plan = partition_parameters([6, 5, 4, 3, 2], 2)  # total 20: a perfect split exists
    assert plan.ideal == 10.0
    assert plan.bound == 10
    assert max(plan.loads) == 10 and plan.imbalance == 1.0


@pytest.mark.parametrize("world_size", [0, -1])
def test_bad_world_size(world_size):
    with pytest.raises(ValueError, match="world_size"):
        partition_parameters([1, 2], world_size)


def test_negative_size():
    with pytest.raises(ValueError, match=">= 0"):
        partition_parameters([1, -2], 2)


def test_fast_on_10k_parameters():
    """10k distinct sizes over 8 ranks plans in ~0.1 s of CPU; 2 s catches a quadratic
    regression. CPU time, not wall time: on a machine whose cores are shared by other work
    (load average 34 seen under `pytest -n auto` beside other jobs) the wall clock measured
    the queue (5.8 s), not the planner."""
    rng = random.Random(0)
    sizes = [rng.randint(1, 10**9) for _ in range(10_000)]
    start = time.process_time()
    plan = partition_parameters(sizes, 8)
    assert time.process_time() - start < 2.0
    check_consistent(plan, sizes, 8)
