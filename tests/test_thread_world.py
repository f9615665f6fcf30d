"""The in-process world of tests/thread_world.py keeps the `Group` contract as gloo does: a
mismatched collective or a rank that raises ends every rank, never a hang."""

from __future__ import annotations

import pytest
import torch

from tests import thread_world


def _collectives(group) -> list:
    mine = torch.tensor([group.rank, -group.rank], dtype=torch.int64)
    return [group.all_reduce_max(mine.clone()).tolist(),
            [t.tolist() for t in group.gather_tensor(mine)],
            group.broadcast(mine, src=1).tolist()]  # fmt: skip


def test_three_ranks_in_threads_meet_at_each_collective():
    values = thread_world.run(_collectives, 3)
    assert values == [[[2, 0], [[0, 0], [1, -1], [2, -2]], [1, -1]]] * 3


def _mismatched(group):
    return group.gather_tensor(torch.zeros(group.rank + 1))


def _raises_on_rank_1(group):
    if group.rank == 1:
        raise RuntimeError("rank 1 failed")
    return group.gather_tensor(torch.zeros(1))


@pytest.mark.parametrize("fn, says", [(_mismatched, "do not match"),
                                      (_raises_on_rank_1, "rank 1 failed")])  # fmt: skip
def test_a_mismatch_or_a_rank_that_raises_ends_every_rank(fn, says):
    with pytest.raises((AssertionError, RuntimeError), match=says):
        thread_world.run(fn, 2, timeout_s=10)
