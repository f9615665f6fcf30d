"""The memory check per rung (`verify.checks.memory`), measured on real gloo ranks.

One launch of 3 ranks trains 2 AdamW steps of the MLP under each rung and measures, per rank,
the bytes of parameters, of gradients after the synchronization, and of optimizer state,
against the unsharded model. The ladder must show: `bucketed` shards nothing, `zero1` the
state, `zero2` the state and the gradients, `zero3` and PyTorch's FSDP2 all three (outside the
unit being computed: measured after the synchronization and after the step). Whole-parameter
ownership makes the ratios uneven (the MLP's largest tensor is a third of it), which is why
the check's bound is (2 - 1/N) x max(total / N, largest), not 1/N.
"""

from __future__ import annotations

from verify.checks.memory import MemoryHooks
from verify.launching import launch
from verify.training.trainer import Trainer, TrainSpec

RUNGS = ("bucketed", "zero1", "zero2", "zero3", "torch-fsdp")


def rank_memory(ctx) -> dict:
    results = {}
    for impl in RUNGS:
        hooks = MemoryHooks()
        trainer = Trainer(ctx, TrainSpec(impl=impl, steps=2, bucket_mb=0.001), (hooks,))
        trainer.run()
        results[impl] = hooks.result(trainer)
    return results


def test_each_rung_shards_what_it_promises_and_no_more():
    run = launch(rank_memory, world_size=3, timeout_s=240)
    assert run.ok, run.summary()
    got = run.values[0]
    sharded = {impl: {k.kind for k in r.kinds if max(k.ratios) < 0.99} for impl, r in got.items()}
    assert sharded == {
        "bucketed": set(),
        "zero1": {"state"},
        "zero2": {"state", "gradients"},
        "zero3": {"state", "gradients", "parameters"},
        "torch-fsdp": {"state", "gradients", "parameters"},
    }, {impl: [k.describe() for k in r.kinds] for impl, r in got.items()}
    for impl, result in got.items():
        assert result.passed, (impl, result.failures)
        for kind in result.promised:  # together, the ranks hold the model once
            k = result.of(kind)
            assert sum(k.per_rank) <= k.unsharded + 2 * k.allowance + k.padding, k.describe()
        for k in result.kinds:  # and at least once: what is there was measured (a DTensor too)
            assert sum(k.per_rank) >= k.unsharded > 0, (impl, k.describe())
