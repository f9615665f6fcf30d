"""The batch: what the model's forward was given, per micro-step, recorded and compared before
the first departure (verify/recording/batch.py, batch_departure.py, docs/compare.md).

In-process first: the tap on small modules (which call is the batch's, and how its inputs
are named), the ranks' batches put together, and the comparison of recordings made here by
the recorder's own calls (milliseconds). Then real runs over gloo of a fresh script written
the way a user writes one (a DataLoader over a DistributedSampler with shuffle, DDP): a
second run with another sampler epoch is given other batches from step 0, micro-step 0; the
same run again agrees, batches and all.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from verify.checks.compare import verdict_of
from verify.checks.script_audit import AuditOptions, check_audit
from verify.cli.text_compare import audit as audit_text
from verify.cli.text_compare import comparison_lines
from verify.hints.phases import GRADS, PARAMS_AFTER, PARAMS_FIRST, SETTINGS
from verify.recording import batch
from verify.recording.batch_departure import INPUTS, ORDER, SAMPLES
from verify.recording.departure import compare_recordings
from verify.recording.recorder import Recorder
from verify.replica_audit.compare import Entry

X = torch.arange(64.0).reshape(32, 2)


class Model(nn.Module):
    """A model whose forward takes a tensor, and optionally a second one by keyword."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Linear(2, 1)

    def forward(self, x, mask=None):
        mask = mask["m"] if isinstance(mask, dict) else mask
        return self.inner(x if mask is None else x * mask)


class Checkpointed(nn.Module):
    """A block under activation checkpointing (the reentrant kind), as LLM scripts wrap one."""

    def __init__(self) -> None:
        super().__init__()
        self.block = nn.Linear(2, 2)

    def forward(self, x):
        return checkpoint(self.block, x.requires_grad_(), use_reentrant=True)


# ------------------------------------------------------------ the tap


def test_the_batch_is_what_the_outermost_module_with_parameters_is_given_with_grad():
    """The wrapper's call, not the model's inside it; not a loss module's (no parameters),
    nor an evaluation under no_grad, nor a checkpointed block's forward run again in the
    backward; keyword and nested inputs named as the call spells
    them; a forward that raises leaves the nesting count where it was."""
    tap, model = batch.BatchTap(), Model()
    wrapper = nn.Sequential(model)  # (a wrapper whose forward calls the model's)
    checkpointed = Checkpointed()
    tap.install()
    try:
        loss = nn.MSELoss()(wrapper(X[:4]), torch.zeros(4, 1))
        with torch.no_grad():
            model(X)
        model(X[:2], mask={"m": torch.ones(2, 2)})
        with pytest.raises(RuntimeError):
            model(torch.ones(3, 5))
        assert tap.depth == 0
        model(X[4:6])
        checkpointed(X[6:9]).sum().backward()  # (its block's forward runs again in backward)
        inputs, dropped = tap.take()
    finally:
        tap.remove()
    assert loss.requires_grad and dropped == 0
    assert [(x.micro, x.name, x.samples, x.shape) for x in inputs] == [
        (0, "args[0]", 4, (2,)),
        (1, "args[0]", 2, (2,)),
        (1, "kwargs['mask']['m']", 2, (2,)),
        (2, "args[0]", 2, (2,)),  # (the call that raised is not a micro-step)
        (3, "args[0]", 3, (2,)),  # (nor the checkpointed block's forward in the backward)
    ]
    assert inputs[0].total == float(X[:4].sum()) and inputs[0].numel == 8


def test_inputs_beyond_the_slots_of_a_step_are_counted_not_kept():
    tap, model = batch.BatchTap(), Model()
    tap.install()
    try:
        for i in range(batch.SLOTS + 3):
            model(X[i : i + 1])
        inputs, dropped = tap.take()
    finally:
        tap.remove()
    assert len(inputs) == batch.SLOTS and dropped == 3
    assert batch.pack(inputs, dropped).numel() == batch.WORDS  # whatever the batch


def _seen(rows: torch.Tensor) -> list[batch.Input]:
    tap, model = batch.BatchTap(), Model()
    tap.install()
    try:
        model(rows)
        return tap.take()[0]
    finally:
        tap.remove()


def test_the_ranks_batches_in_rank_order_are_the_global_batch():
    """Two ranks' halves, put together in rank order, are one rank's whole batch: the same
    samples in the same order; in the other rank order, the same samples in another order."""
    whole, first, second = _seen(X[:8]), _seen(X[:4]), _seen(X[4:8])
    together, _ = batch.union(first, [batch.pack(first, 0), batch.pack(second, 0)])
    swapped, _ = batch.union(second, [batch.pack(second, 0), batch.pack(first, 0)])
    assert together[0] == replace(whole[0], square=together[0].square)  # (a sum of two sums)
    assert together[0].square == pytest.approx(whole[0].square, rel=1e-12)
    assert swapped[0].unordered == whole[0].unordered and swapped[0].ordered != whole[0].ordered
    assert (together[0].samples, together[0].numel) == (8, 16)
    assert _seen(X[1:9])[0].unordered != whole[0].unordered


def _batch_on_rank(ctx, same: bool) -> list | None:
    """Each rank's model given its 4 samples of X[:8], then the point before step 0 as the
    script audit takes it (the recorder's halves around the audit's comparison), with the
    same entries on both ranks (`same`: the batch rides in the shares' all-gather) or not
    (a layout the audit reports: it travels with the loss). The owner's batch rows."""
    from verify.replica_audit.compare import compare
    from verify.script_audit.side_group import SideGroup

    group, rec, model = SideGroup(), Recorder("unused"), Model()
    rec.batches.install()
    model(X[4 * ctx.rank : 4 * ctx.rank + 4])
    rec.batches.remove()
    name = "w" if same else f"w{ctx.rank}"
    entries = [Entry(GRADS, name, torch.ones(3))]
    rec.add(group, (), 0, "SGD", 0, 0, entries)
    outcome = compare(group, entries, (0, 0, 0))
    rec.settle(group, agreed=not outcome.layout)
    return rec.batch_rows if rec.owner else None


@pytest.mark.parametrize("same", [True, False])
def test_two_ranks_batches_reach_the_owner_as_the_global_batch_in_rank_order(same):
    from verify.launching import launch

    run = launch(_batch_on_rank, world_size=2, args=(same,), timeout_s=120)
    assert run.ok, run.summary()
    rows, other = run.values
    whole = _seen(X[:8])[0]
    assert other is None and len(rows) == 1, rows
    step, micro, _, samples, numel, ordered, unordered, total, _ = rows[0]
    assert (step, micro, samples, numel, total) == (0, 0, 8, 16, whole.total)
    assert (ordered, unordered) == (whole.ordered, whole.unordered)


# ------------------------------------------------------------ comparing recordings


class _Alone:
    rank, size = 0, 1

    def ready(self) -> bool:
        return False


def _recording(feed, steps: int = 3, moved_at: int | None = None):
    """A recording made by the recorder's own calls: at each step s, the model is given
    `feed(s)` (a list of micro-steps, each the call's (args, kwargs)), then one SGD parameter
    `w` is recorded as equal in every run (off at step `moved_at`)."""
    rec, group, model = Recorder("unused"), _Alone(), Model()
    rec.tap.take = lambda: (1.0, 1)
    rec.batches.install()
    try:
        for s in range(steps):
            for args, kwargs in feed(s):
                model(*args, **kwargs)
            before = [Entry(SETTINGS, "param_groups[0].lr", setting=0.1),
                      Entry(GRADS, "w", torch.ones(4))]  # fmt: skip
            if s == 0:
                before.insert(0, Entry(PARAMS_FIRST, "w", torch.zeros(4)))
            after = [
                Entry(PARAMS_AFTER, "w", torch.full((4,), s + (0.5 if s == moved_at else 1.0)))
            ]
            for point, entries in ((0, before), (1, after)):
                rec.add(group, (), 0, "SGD", s, point, entries)
                rec.settle(group, agreed=True)
    finally:
        rec.batches.remove()
    return rec.recording()


def _two(s: int):  # two micro-steps of 4 samples a step, in order
    return [((X[8 * s : 8 * s + 4],), {}), ((X[8 * s + 4 : 8 * s + 8],), {})]


def _lines(a, b) -> tuple[object, list[str]]:
    c = compare_recordings(a, b)
    return c, comparison_lines(c, verdict_of(c))


def test_the_same_batches_are_said_briefly_before_the_verdict():
    c, lines = _lines(_recording(_two), _recording(_two))
    assert c.batches.steps == 3 and c.batches.first is None and not c.departs
    assert "batches: the same batches at every compared step" in lines, lines
    assert lines.index("batches: the same batches at every compared step") == len(lines) - 2
    c, lines = _lines(_recording(_two), _recording(_two, moved_at=1))
    assert c.first.step == 1
    assert "batches: the same batches up to the departure (steps 0..1 of the recording)" in lines


def _shuffled_from(step: int, micro: int, order_only: bool):
    def feed(s):
        steps = _two(s)
        if s == step:
            x = steps[micro][0][0]
            other = x.flip(0) if order_only else x + 100
            steps[micro] = ((other,), {})
        return steps

    return feed


@pytest.mark.parametrize("order_only", [False, True])
def test_batches_that_differ_are_named_by_step_and_micro_step_before_the_departure(order_only):
    """Other samples, or the same in another order, at step 1 micro-step 1: the batch line
    names them, before the departure (here, the parameters after step 1); the verdict is the
    departures' (the batches alone do not decide it)."""
    c, lines = _lines(_recording(_two), _recording(_shuffled_from(1, 1, order_only), moved_at=1))
    x = c.batches.first
    assert (x.step, x.micro, x.name, x.how) == (1, 1, "args[0]", ORDER if order_only else SAMPLES)
    said = next(line for line in lines if line.startswith("batches:"))
    assert said.startswith("batches: the batches differ from step 1, micro-step 1: the data "
                           "order is not the same: args[0] holds "), said  # fmt: skip
    assert ("the same 4 samples in another order" in said) == order_only, said
    assert lines.index(said) < next(i for i, t in enumerate(lines) if t.startswith("FIRST"))
    c, lines = _lines(_recording(_two), _recording(_shuffled_from(1, 1, order_only)))
    assert not c.departs and c.batches.first.step == 1 and lines[-1].startswith("AGREE")


def test_other_micro_steps_compare_each_steps_whole_global_batch_in_any_order():
    """1 micro-step of 8 against 2 of 4 (as 1 rank x 2 micro-steps against 2 ranks x 1):
    the same samples agree; other ones are said of the step's whole global batch."""

    def one(s):
        return [((X[8 * s : 8 * s + 8].flip(0),), {})]

    c, lines = _lines(_recording(_two), _recording(one))
    assert c.batches.first is None and "batches: the same batches at every compared step" in lines

    def other(s):
        return [((X[8 * s : 8 * s + 8] + (s == 2),), {})]

    c, lines = _lines(_recording(_two), _recording(other))
    x = c.batches.first
    assert (x.step, x.micro, x.how) == (2, None, SAMPLES), x
    assert any("from step 2 (its whole global batch: 2 micro-steps in the recording, 1 in "
               "this run)" in line for line in lines), lines  # fmt: skip


def test_an_input_one_run_lacks_is_other_inputs():
    def masked(s):
        return [(args, {"mask": torch.ones(4, 2)}) for args, _ in _two(s)]

    c, lines = _lines(_recording(_two), _recording(masked))
    x = c.batches.first
    assert (x.step, x.micro, x.name, x.how) == (0, 0, "kwargs['mask']", INPUTS)
    assert ("batches: the batches differ from step 0, micro-step 0: the model is given other "
            "inputs: kwargs['mask'] is absent in the recording, float32 [2] a sample in this "
            "run") in lines, lines  # fmt: skip


def test_a_recording_without_batches_says_nothing_about_them_and_its_json_has_the_key():
    a, b = _recording(_two), _recording(_shuffled_from(0, 0, False))
    c = compare_recordings(a, b)
    doc = json.loads(json.dumps(c.to_dict()))
    assert doc["batches"]["first"]["step"] == 0 and doc["batches"]["first"]["micro"] == 0
    assert doc["batches"]["first"]["how"] == SAMPLES and doc["batches"]["steps"] == 1
    b.batches = None
    c, lines = _lines(a, b)
    assert c.batches is None and c.to_dict()["batches"] is None
    assert not any("batch" in line for line in lines), lines


# ------------------------------------------------------------ real runs

# A user's script, written fresh as one writes it: a DataLoader over a DistributedSampler
# that shuffles, DDP (docs/compare.md uses it too).
TRAIN = str(Path(__file__).resolve().parent / "fixtures" / "compare" / "train_loader.py")

RUNS_ON_ONE_WORKER = pytest.mark.xdist_group("compare-batches")


def _audit(script: str, *args: str, out: str, **flags):
    return check_audit(AuditOptions(script=(script, *args), nproc=2, out=out, console="none",
                                    **flags))  # fmt: skip


@pytest.fixture(scope="session")
def loader_runs(tmp_path_factory):
    base = tmp_path_factory.mktemp("batches")
    out, rec = str(base / "runs"), str(base / "rec")
    recorded = _audit(TRAIN, out=out, record=rec)
    with ThreadPoolExecutor(2) as pool:
        same = pool.submit(_audit, TRAIN, out=out, against=rec)
        epoch = pool.submit(_audit, TRAIN, "--epoch", "1", out=out, against=rec)
        return {"recorded": recorded, "same": same.result(), "epoch": epoch.result()}


@RUNS_ON_ONE_WORKER
def test_another_sampler_epoch_is_other_batches_from_step_0_micro_step_0(loader_runs):
    assert loader_runs["recorded"].verdict == "pass"
    r = loader_runs["epoch"]
    text = audit_text(r)
    assert r.verdict == "fault" and r.comparison.batches.first.how == SAMPLES, text
    assert ("batches: the batches differ from step 0, micro-step 0: the data order is not the "
            "same: args[0] holds other samples (16 in both runs") in text, text  # fmt: skip
    lines = text.splitlines()
    said = next(i for i, t in enumerate(lines) if t.startswith("batches:"))
    assert lines[said + 1].startswith("FIRST DEPARTURE: step 0, loss of step 0"), text


@RUNS_ON_ONE_WORKER
def test_the_same_run_again_agrees_batches_and_all(loader_runs):
    r = loader_runs["same"]
    text = audit_text(r)
    assert r.verdict == "pass" and r.comparison.batches.steps == 3, text
    assert "batches: the same batches at every compared step\nAGREE bitwise" in text, text
