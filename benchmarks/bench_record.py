"""`python benchmarks/record_cost.py`: what `audit --record` adds to an audited training step,
and how large a recording grows.

In one launch, on the script audit's benchmark (`bench_script_audit.py`: the one trainer's
transformer, ~50M parameters by default, AdamW, the audit installed as in a script's rank),
two arms take turns every round, the order rotating (the skeleton of `costs.py`):

- audited: one training step under `audit --nproc`'s step hooks;
- recorded, without the batch: the same step with the recorder on as well
  (`verify/recording/recorder.py`: the ranks share the sketching of the gradients, the
  parameters and, at the audit's state points, the optimizer state, `shares.py`; rank 0
  gathers the sketches and keeps the rows; every rank adds its loss to one all-gather), but
  not the batch's forward hooks;
- recorded: the same, the batch too (`batch.py`: global forward hooks around every module
  call, and at the outermost one the fingerprints of its inputs' samples, which ride in the
  same all-gather).

The ratios recorded / audited (goal at most 1.02) and recorded / recorded without the batch
(goal at most 1.005) are paired per round, in wall time and in rank 0's CPU time (which the
load of other processes on a shared machine distorts far less). The recording of the
recorded rounds is then written and measured on disk: bytes per row, rows per step, and the
size projected for a 100M-parameter model of the same family over 1,000 steps (its tensors
counted on the meta device; goal at most 100 MB).
"""

from __future__ import annotations

import functools
import os
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass
from typing import ClassVar

import torch

from benchmarks.bench_audit import AuditBenchOptions
from benchmarks.costs import goal_bar, run_cost, take_turns
from verify.launching import RankContext
from verify.perf.base import Measured, next_step, parameters
from verify.perf.timing import timed
from verify.recording.recorder import Recorder
from verify.replica_audit.group import gather_ints
from verify.script_audit import AuditSettings, StepHooks
from verify.script_audit.report import STATE_EVERY
from verify.training.trainer import Trainer

GOAL = 1.02
BATCH_GOAL = 1.005  # what recording the batch may add to a recorded step
GOAL_MB = 100.0
PROJECTED_PARAMS_M, PROJECTED_STEPS = 100.0, 1000


@dataclass(frozen=True, kw_only=True)
class RecordBenchOptions(AuditBenchOptions):
    """The script audit benchmark's knobs (model size, batch, rounds)."""

    command: ClassVar[str] = "bench-record"


@dataclass(frozen=True)
class RecordBenchResult(Measured):
    options: RecordBenchOptions
    verdict: str
    parameters: int = 0
    audited_s: tuple[float, ...] = ()
    recorded_s: tuple[float, ...] = ()
    unbatched_s: tuple[float, ...] = ()  # recorded, without the batch
    unbatched_cpu_s: tuple[float, ...] = ()
    rows: int = 0
    recorded_steps: int = 0
    bytes_on_disk: int = 0
    projected_tensors: int = 0  # parameter tensors of the 100M model
    projected_bytes: float = 0.0
    # rank 0's time inside the recorder a recorded step, in all (its collectives' waits
    # included), and of it: the fingerprints (the audit's own work, which its comparison
    # then reuses rather than computing again) and the sketching of its share
    recorder_s_per_step: float = 0.0
    fingerprint_s_per_step: float = 0.0
    sketch_s_per_step: float = 0.0
    sketched_share: float = 0.0  # rank 0's share of the elements sketched
    # rank 0's time inside the batch's hooks at the outermost module call and in its take,
    # a recorded step (not the nesting count at every other module call, nor its words in
    # the all-gather: those are in the step's ratio)
    batch_s_per_step: float = 0.0
    # CPU time of rank 0's process a step, per arm (the load of other processes on the
    # machine stretches wall times; CPU time far less)
    audited_cpu_s: tuple[float, ...] = ()
    recorded_cpu_s: tuple[float, ...] = ()
    # rank 0's median time inside the audit's hooks a step, per arm (the recorder's included
    # in the recorded arm): what the step grows by beyond them is spent outside the hooks
    audited_hooks_s: float = 0.0
    recorded_hooks_s: float = 0.0
    machine: str = ""
    torch_version: str = ""
    failure: str | None = None

    def bars(self):
        return [
            goal_bar("recorded / audited step", self.recorded_s, self.audited_s, GOAL),
            goal_bar("the same, CPU time of rank 0", self.recorded_cpu_s, self.audited_cpu_s, GOAL),
            goal_bar("recorded / recorded without the batch", self.recorded_s, self.unbatched_s,
                     BATCH_GOAL),
            goal_bar("the same, CPU time of rank 0", self.recorded_cpu_s, self.unbatched_cpu_s,
                     BATCH_GOAL),
        ]  # fmt: skip

    @property
    def bytes_per_row(self) -> float:
        return self.bytes_on_disk / max(self.rows, 1)

    def to_dict(self) -> dict:
        d = {**asdict(self), "ok": self.ok}
        if self.ok:
            d["bars"] = [{"what": w, **r.to_dict(), "goal": g, "decision": dec}
                         for w, r, g, dec in self.bars()]  # fmt: skip
        return d


def run_record_bench(options: RecordBenchOptions) -> RecordBenchResult:
    return run_cost(options, record_bench_on_rank, RecordBenchResult)


def record_bench_on_rank(ctx: RankContext, options: RecordBenchOptions) -> dict:
    """The two arms (module docstring), after a warm-up step of each."""
    folder = tempfile.mkdtemp(prefix="bench-record-")
    auditor = StepHooks(AuditSettings(every=1, path=None))
    recorder = Recorder(os.path.join(folder, "recording"))
    auditor.install()  # before the model exists, as in a script's rank
    recorder.install()
    try:
        trainer = Trainer(ctx, options.train_spec())
        auditor.recorder = recorder
        trainer.step(1)  # warm-up: state allocated, the side group made, both arms' paths
        auditor.recorder = None
        trainer.step(2)

        cpu: dict[str, list[float]] = {"audited": [], "unbatched": [], "recorded": []}
        hooks: dict[str, list[float]] = {k: [] for k in cpu}  # time inside the audit's hooks

        def step(arm: str) -> float:
            auditor.recorder = recorder if arm != "audited" else None
            (recorder.batches.install if arm == "recorded" else recorder.batches.remove)()
            start, inside = time.process_time(), auditor.seconds
            wall = timed(lambda: next_step(trainer), ctx.device)
            cpu[arm].append(time.process_time() - start)
            hooks[arm].append(auditor.seconds - inside)
            return wall

        arms = {arm: functools.partial(step, arm) for arm in cpu}
        warm = (recorder.seconds, recorder.fingerprint_seconds, recorder.sketch_seconds)
        warm_batch = recorder.batches.seconds
        samples = take_turns(ctx, arms, options.repeats, "bench-record")
        inside, prints, sketching = (
            (now - before) / (2 * options.repeats)  # two recorded arms a round
            for now, before in zip(
                (recorder.seconds, recorder.fingerprint_seconds, recorder.sketch_seconds), warm
            )
        )
        batch_s = (recorder.batches.seconds - warm_batch) / options.repeats  # (one arm)
        sketched = _share(auditor.group, recorder.sketched)
        rows = len(recorder.tensor_rows) + len(recorder.value_rows) + len(recorder.batch_rows)
        recorder.finish()  # rank 0 writes
        on_disk = sum(os.path.getsize(os.path.join(recorder.folder, f))
                      for f in os.listdir(recorder.folder)) if ctx.rank == 0 else 0  # fmt: skip
        steps = len(recorder.micro_steps)
    finally:
        recorder.remove()
        auditor.remove()
    tensors, per_step = _projected_rows(rows, steps, trainer)
    return {
        "parameters": parameters(trainer.model),
        "audited_s": tuple(samples["audited"]),
        "recorded_s": tuple(samples["recorded"]),
        "unbatched_s": tuple(samples["unbatched"]),
        "unbatched_cpu_s": tuple(cpu["unbatched"]),
        "rows": rows,
        "recorded_steps": steps,
        "bytes_on_disk": on_disk,
        "projected_tensors": tensors,
        "recorder_s_per_step": inside,
        "fingerprint_s_per_step": prints,
        "sketch_s_per_step": sketching,
        "sketched_share": sketched,
        "batch_s_per_step": batch_s,
        "audited_cpu_s": tuple(cpu["audited"]),
        "audited_hooks_s": statistics.median(hooks["audited"]),
        "recorded_hooks_s": statistics.median(hooks["recorded"]),
        "recorded_cpu_s": tuple(cpu["recorded"]),
        "projected_bytes": per_step * PROJECTED_STEPS * on_disk / max(rows, 1),
    }


def _share(group, mine: int) -> float:
    """Rank 0's share of the elements the ranks sketched, over the audit's own group (a
    collective: every rank calls it)."""
    if not group.ready():
        return 1.0
    every = [row[0] for row in gather_ints(group, [mine])]
    return every[0] / max(sum(every), 1)


def _projected_rows(rows: int, steps: int, trainer: Trainer) -> tuple[int, float]:
    """(parameter tensors of the 100M model, rows a step of it records): the rows of a step
    here, scaled by its tensors over this model's (settings and loss do not scale: counted
    once), with the state's rows spread over STATE_EVERY steps as recorded."""
    from verify.training.language import GPT, GPTConfig

    with torch.device("meta"):
        big = len(list(GPT(GPTConfig.with_params(PROJECTED_PARAMS_M)).parameters()))
    here = len(list(trainer.model.parameters()))
    # here: per step 2 rows per tensor (gradients, parameters after), state 3 rows per tensor
    # (AdamW: step, exp_avg, exp_avg_sq) every STATE_EVERY steps, and the first step's
    # parameters; project the same shape
    per_step = big * (2 + 3 / STATE_EVERY) + (rows / max(steps, 1) - here * 2)
    return big, max(per_step, big * 2)
