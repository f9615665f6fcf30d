"""Pytest helpers: a multi-process test that would hang fails within its stall timeout, with
the diagnosis (culprit rank, collective, call site) as its failure message.

    from verify.testing import launch_or_fail

    def test_my_ddp():
        result = launch_or_fail(my_rank_fn, world_size=2)   # a hang fails the test in ~10 s
        assert result.ok, result.summary()

`launch()` itself already watches for stalls (`DEFAULT_STALL_TIMEOUT_S`), so every test of this
project that goes through the launcher ends within a minute of a hang; the helper makes it
shorter, turns a hang or a desync into a test failure that reads like a bug report, and keeps
the result for further assertions otherwise.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from verify.launching import LaunchResult, launch

TEST_STALL_TIMEOUT_S = 10.0  # a test's ranks that make no progress for this long are hung


def launch_or_fail(
    fn: Callable[..., Any],
    *,
    world_size: int,
    args: tuple = (),
    stall_timeout_s: float = TEST_STALL_TIMEOUT_S,
    timeout_s: float = 120.0,
    allow_desync: bool = False,
    **kwargs,
) -> LaunchResult:
    """`launch()` for tests: fail the calling test on a hang (or a desync, unless allowed).

    Crashed or raising ranks are not failures here: they come back in the result, so a test
    can assert on them (`result.ok`, `result.summary()`).
    """
    result = launch(
        fn,
        world_size=world_size,
        args=args,
        stall_timeout_s=stall_timeout_s,
        timeout_s=timeout_s,
        **kwargs,
    )
    assert_no_hang(result)
    if not allow_desync:
        assert_no_desync(result)
    return result


def assert_no_hang(result: LaunchResult) -> None:
    if result.stalled or result.timed_out:
        pytest.fail(f"the ranks hung:\n{result.summary()}", pytrace=False)


def assert_no_desync(result: LaunchResult) -> None:
    diag = result.diagnosis
    if diag is not None and diag.verdict == "desync":
        pytest.fail(f"the ranks' collectives disagreed:\n{diag.text()}", pytrace=False)
