"""The rows of the certification matrix: training situations a data-parallel implementation
must get right, each a plain baseline changed by one knob.

A `Behaviour` is data (torchtitan's `OverrideDefinitions` idea): a key, a title, and the knobs
it changes from the baseline (the MLP at world size 2 with 25 MB buckets, AdamW over two
parameter groups). One knob a row (the sharded optimizer's round trip is a resume, so it
runs under the LR scheduler, as a resumed run does): a class that fails a row fails it for that knob, not
because it lacks some other capability (the keep-grads and bucket rows train the plain MLP,
not the model with unused parameters). `spec()` turns a row into the `TrainSpec` the trainer
runs.
"""

from __future__ import annotations

from dataclasses import dataclass

from impls.registry import DEFAULT_BUCKET_MB
from verify.training.trainer import TRAIN_DEFAULTS, TrainSpec, spec_from
from verify.training.workloads import get_workload

SMALLEST_PARAMETER = -1.0  # bucket_mb sentinel: the bytes of the model's smallest parameter


@dataclass(frozen=True, kw_only=True)
class Behaviour:
    """A row of the certification matrix: one training situation.

    Attributes:
        key: short name (`--rows`, and `shows_on` of the faulty catalogue).
        title: what the row says in the table.
        world_size, workload, steps: as in the checks' options.
        bucket_mb: None runs the default bucket size and claims nothing about buckets; a
            value makes the row a bucket-size behaviour, claimed only by wrappers that take a
            bucket size (`bucket_size_mb` or PyTorch's `bucket_cap_mb`);
            SMALLEST_PARAMETER: the size of the model's smallest parameter (a bucket per
            parameter, in a size any class accepts).
        accumulate: micro-batches per step, all but the last under `no_sync()` (claimed only
            by wrappers that have `no_sync()`).
        set_to_none, scheduler, round_trip: as in `EquivalenceOptions`.
        round_trip_model: the round trip saves and loads the model too, into a fresh wrapper
            (`training/model_state.py`); implies `round_trip`.
        add_param_group: build the optimizer over the first group and add the others.
        sharded_only: a behaviour of the sharded optimizer: n/a for DDP wrappers.
    """

    key: str
    title: str
    world_size: int = 2
    workload: str = TRAIN_DEFAULTS.workload
    steps: int = TRAIN_DEFAULTS.steps
    bucket_mb: float | None = None
    accumulate: int = TRAIN_DEFAULTS.accumulate
    set_to_none: bool = TRAIN_DEFAULTS.set_to_none
    scheduler: bool = TRAIN_DEFAULTS.scheduler
    round_trip: bool = False
    round_trip_model: bool = False
    add_param_group: bool = False
    sharded_only: bool = False

    def __post_init__(self) -> None:
        if self.round_trip_model and not self.round_trip:
            raise ValueError(f"{self.key}: round_trip_model needs round_trip")
        if self.round_trip and self.steps < 2:
            raise ValueError(f"{self.key}: a state_dict round trip needs steps >= 2")
        get_workload(self.workload)

    def spec(self, impl: str, *, same_init: bool = False) -> TrainSpec:
        """What the trainer runs for `impl` under this behaviour."""
        bucket = self.bucket_mb if self.bucket_mb is not None else DEFAULT_BUCKET_MB
        if bucket == SMALLEST_PARAMETER:
            bucket = smallest_parameter_mb(self.workload)
        return spec_from(
            self,
            impl=impl,
            bucket_mb=bucket,
            round_trip_step=self.steps // 2 if self.round_trip else None,
            same_init=same_init,
        )


def smallest_parameter_mb(workload: str) -> float:
    """The bytes of the workload's smallest trainable parameter, in MB: buckets of that size
    hold one parameter each (a class that validates its size accepts it; 1e-9 MB, a 0-byte
    bucket, it would rightly refuse)."""
    model = get_workload(workload).build()
    sizes = [p.numel() * p.element_size() for p in model.parameters() if p.requires_grad]
    return min(sizes) / 2**20


# fmt: off
BEHAVIOURS: tuple[Behaviour, ...] = (
    Behaviour(key="world-1", title="world size 1", world_size=1),
    Behaviour(key="world-2", title="world size 2", world_size=2),
    Behaviour(key="world-3", title="world size 3", world_size=3),
    Behaviour(key="world-4", title="world size 4", world_size=4),
    Behaviour(key="frozen", title="frozen parameters", workload="frozen"),
    Behaviour(key="tied", title="tied weights", workload="tied"),
    Behaviour(key="unused-everywhere", title="parameters unused on all ranks / in some steps",
              workload="unused"),
    Behaviour(key="used-on-one-rank", title="a parameter used on one rank only (3 ranks)",
              workload="unused", world_size=3),
    Behaviour(key="buffers", title="buffers", workload="buffers"),
    Behaviour(key="mixed", title="float32, bfloat16 and float64 layers", workload="mixed"),
    Behaviour(key="no-sync", title="no_sync() accumulation (2 micro-batches)", accumulate=2),
    Behaviour(key="no-sync-unused", title="no_sync() with a branch used in one micro-batch",
              workload="unused", accumulate=2),
    Behaviour(key="keep-grads", title="zero_grad(set_to_none=False)", set_to_none=False),
    Behaviour(key="one-bucket", title="one bucket (25 MB)", bucket_mb=25.0),
    Behaviour(key="bucket-per-param",
              title="one bucket per parameter (the smallest parameter's size)",
              bucket_mb=SMALLEST_PARAMETER),
    # On the routed model: buckets that mix used and unused parameters, and (at 4.5 KB) a
    # bucket whose members' gradients do not arrive in reverse registration order.
    Behaviour(key="several-buckets", title="several multi-parameter buckets (4.5 KB)",
              workload="unused", bucket_mb=0.0045),
    Behaviour(key="bf16", title="a bf16 model", workload="bf16"),
    Behaviour(key="bf16-compute",
              title="mixed precision: fp32 parameters, bf16 compute, fp32 reduction",
              workload="bf16-compute"),
    Behaviour(key="odd-sizes",
              title="parameters of 7, 3, 5 and 1 rows over 4 ranks (uneven shards, padding)",
              workload="odd", world_size=4),
    Behaviour(key="model-round-trip",
              title="model and optimizer state_dict round trip into a fresh wrapper",
              round_trip=True, round_trip_model=True),
    # The sharded optimizer's own behaviours (every row above already has two groups).
    Behaviour(key="param-groups", title="parameter groups over 3 ranks (lr, decay)",
              world_size=3, sharded_only=True),
    Behaviour(key="add-param-group", title="add_param_group after construction",
              add_param_group=True, sharded_only=True),
    Behaviour(key="scheduler", title="an LR scheduler (StepLR)", scheduler=True, sharded_only=True),
    # A resume: the round trip under the scheduler, whose later lr must reach the reloaded
    # optimizer (a class that rebuilds its groups on load loses it; one knob, "a resume").
    Behaviour(key="round-trip", title="optimizer state_dict round trip",
              round_trip=True, scheduler=True, sharded_only=True),
    Behaviour(key="more-ranks-than-params", title="more ranks than parameters (3 tensors, 4 ranks)",
              workload="tied", world_size=4, sharded_only=True),
)
BEHAVIOUR = {b.key: b for b in BEHAVIOURS}
