"""The launcher form's watch (`verify/launching/command.py`) over a real run folder, in-process:
which ranks it sees join, whatever order they join in."""

from __future__ import annotations

import os

from verify import private
from verify.launching.command import _Watch


def _join(folder, rank: int, world: int) -> None:
    assert private.write(folder, f"rank{rank}.joined", f"{world} {os.getpid()}\n".encode())


def test_a_rank_other_than_0_that_joins_first_is_seen(tmp_path):
    """Rank 1 joins and dies while rank 0, slow on a loaded machine, is ended by its launcher
    before it has written its join: rank 1 is a rank of the run (where the watch had looked for
    rank 0 first, and said "nothing joined")."""
    folder = tmp_path / "run"
    private.make_dir(folder)
    watch = _Watch(str(folder), stall_timeout_s=60.0)
    watch._join()
    assert (watch.local.ranks, watch.world) == ([], 0)
    _join(folder, 1, 2)
    watch._join()
    assert (watch.local.ranks, watch.world) == ([1], 2)
    _join(folder, 0, 2)
    watch._join()
    assert (watch.local.ranks, watch.world, sorted(watch.local.pids)) == ([0, 1], 2, [0, 1])


def test_names_like_a_join_that_are_not_one_are_no_rank(tmp_path):
    folder = tmp_path / "run"
    private.make_dir(folder)
    for name in ("rank1.joined.tmp", ".rank2.joined.7.tmp", "rankx.joined", "rank3.joinedx"):
        assert private.write(folder, name, b"2 1\n")
    watch = _Watch(str(folder), stall_timeout_s=60.0)
    watch._join()
    assert watch.local.ranks == []
