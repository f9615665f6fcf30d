"""Bucket planning is a pure function: single-process tests."""

from __future__ import annotations

import pytest
import torch

from impls.planning import MB, ParamInfo, plan_buckets

F32 = ("cpu", torch.float32)
BF16 = ("cpu", torch.bfloat16)


def sizes(plan, params):
    return [sum(params[i].nbytes for i in bucket) for bucket in plan]


def test_buckets_follow_reverse_registration_order_and_respect_the_cap():
    params = [ParamInfo(400_000, F32) for _ in range(10)]
    plan = plan_buckets(params, bucket_size_mb=1.0)
    assert sorted(i for b in plan for i in b) == list(range(10))
    assert [i for b in plan for i in b] == list(reversed(range(10)))
    assert all(s <= 1.0 * MB for s in sizes(plan, params))
    assert [len(b) for b in plan] == [2, 2, 2, 2, 2]


def test_a_parameter_larger_than_the_cap_gets_its_own_bucket():
    params = [ParamInfo(100, F32), ParamInfo(5 * MB, F32), ParamInfo(100, F32)]
    plan = plan_buckets(params, bucket_size_mb=1.0)
    assert [2] in plan and [1] in plan and [0] in plan


def test_one_bucket_and_one_bucket_per_parameter():
    params = [ParamInfo(1000 * (i + 1), F32) for i in range(6)]
    assert plan_buckets(params, bucket_size_mb=100) == [[5, 4, 3, 2, 1, 0]]
    assert plan_buckets(params, bucket_size_mb=1e-9) == [[i] for i in reversed(range(6))]


def test_dtypes_never_share_a_bucket_and_buckets_are_ordered_by_readiness():
    params = [ParamInfo(100, F32), ParamInfo(100, BF16), ParamInfo(100, F32), ParamInfo(100, BF16)]
    plan = plan_buckets(params, bucket_size_mb=1.0)
    assert len(plan) == 2
    for bucket in plan:
        assert len({params[i].group for i in bucket}) == 1
    # The f32 bucket's last member (index 0) comes after the bf16 bucket's last (index 1).
    assert plan == [[3, 1], [2, 0]]


@pytest.mark.parametrize("bad", [0, -1.0])
def test_bucket_size_must_be_positive(bad):
    with pytest.raises(ValueError, match="bucket_size_mb must be > 0"):
        plan_buckets([ParamInfo(1, F32)], bad)
