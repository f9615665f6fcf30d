"""`compare --drill`: below the first departing step, the first op where two runs part
(verify/checks/drill.py, capture.py, streams.py; docs/compare.md, "The drill-down").

The matching of two captures, the capture of one step and the early rungs run in-process, in
milliseconds; one end-to-end test re-runs a student's script (tests/fixtures/drill_train.py)
through the CLI: a dropout mask drawn otherwise is named with its module and line, and a run
that reads the clock is said not to replay.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn as nn

from verify.checks.drill import BATCH, NOT_COMPUTED, NOTHING, OP, SPLIT, Drill, drill
from verify.cli.text_compare import drill_lines
from verify.hints import kinds as k
from verify.recording import capture, store
from verify.recording.batch_departure import ORDER, BatchDifference, Batches
from verify.recording.departure import Comparison, Departure, NotComparable
from verify.recording.streams import (
    DIFFERS,
    NO_SYNC,
    ONLY_ONE,
    OTHER_INPUTS,
    OTHER_OPS,
    RANDOM,
    Op,
    boundary,
    first_divergence,
    first_part,
    ops_of,
)
from verify.script_audit.naming import Modules

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "tests", "fixtures", "drill_train.py")


def op(name, inputs=(1,), outputs=(2,), phase="forward", module="fc", line="train.py:9"):
    full = name if "." in name else f"aten.{name}.default"
    return Op(0, phase, module, full, line, tuple(inputs),
              tuple(f"float32 [{i}]" for i in inputs), tuple(outputs), "float32 [4]",
              total=1.0, norm=2.0)  # fmt: skip


@pytest.mark.parametrize(
    "a, b, why, at",
    [
        (
            [op("t"), op("addmm", outputs=(3,))],
            [op("t"), op("addmm", outputs=(4,))],
            DIFFERS,
            "addmm",
        ),
        ([op("bernoulli_", outputs=(3,))], [op("bernoulli_", outputs=(4,))], RANDOM, "bernoulli_"),
        ([op("t"), op("mm", inputs=(5,))], [op("t"), op("mm", inputs=(6,))], OTHER_INPUTS, "mm"),
        ([op("t"), op("relu")], [op("t"), op("mul"), op("relu")], ONLY_ONE, "mul"),
        ([op("t"), op("relu")], [op("t"), op("gelu")], OTHER_OPS, "relu"),
    ],
    ids=["differs", "random", "inputs", "an-op-more", "another-op"],
)
def test_two_captures_part_at_the_first_op_not_alike(a, b, why, at):
    part = first_part(a, b)
    assert part.why == why
    assert (part.a or part.b).op == f"aten.{at}.default"
    assert part.before is None or part.before.op == "aten.t.default"


def test_ops_given_other_numbers_of_arguments_part_at_the_first_one_missing():
    """An edit from cat([a, b]) to cat([a, b, c]): the first argument one has and the other
    has not, said without a traceback."""
    two = Op(0, "forward", "", "aten.cat.default", "t.py:3", (1, 2), ("float32 [2]",) * 2, (5,), "")
    three = Op(0, "forward", "", "aten.cat.default", "t.py:3", (1, 2, 3), ("float32 [2]",) * 3,
               (6,), "")  # fmt: skip
    part = first_part([two], [three])
    assert part.why == OTHER_INPUTS and part.argument == 2
    assert "argument 2: no such argument in A, float32 [2] in B" in "\n".join(
        drill_lines(Drill(OP, "", part))
    )


def test_an_op_more_in_one_module_shifts_nothing_after_it():
    """Matched as the longest common run: an op more early on names that op, not every op
    after it."""
    a = [op("t"), op("relu", module="act"), op("mm", module="head")]
    b = [op("t"), op("mul"), op("relu", module="act"), op("mm", module="head")]
    part = first_part(a, b)
    assert part.why == ONLY_ONE and part.a is None and part.b.op == "aten.mul.default"
    assert first_part(a, a) is None


class _Student(nn.Module):
    def __init__(self):
        super().__init__()
        self.hidden = nn.Linear(6, 12)
        self.drop = nn.Dropout(0.5)
        self.head = nn.Linear(12, 3)

    def forward(self, x):
        return self.head(self.drop(torch.relu(self.hidden(x))))


def _capture_a_step(tmp_path, name, seed=0, scale=1.0, train=True, poke=False):
    """One step of a fresh model captured in-process, as a re-run's rank captures it; `poke`:
    a parameter written through numpy between the backward and the step, where the
    dispatcher sees no op."""
    modules = Modules()
    modules.install()
    try:
        torch.manual_seed(0)
        model = _Student().train(train)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        memory = model.head.bias.detach().numpy()  # its memory, seen before the capture
        c = capture.Capture(str(tmp_path / name), 0, 0, modules)
        c.install()
        torch.manual_seed(seed)
        loss = model(torch.ones(4, 6)).square().mean() * scale
        loss.backward()
        if poke:
            memory[0] += 1.0
        c.optimizer_step(0, True)
        opt.step()
        c.optimizer_step(0, False)
        with pytest.raises(SystemExit):
            c.stepped(0, 0)
    finally:
        modules.remove()
    with open(tmp_path / name / "rank0.json") as f:
        return ops_of(json.load(f)["ops"])


def test_a_step_is_captured_op_by_op_and_a_mask_drawn_otherwise_is_named(tmp_path):
    a = _capture_a_step(tmp_path, "a")
    written = json.loads((tmp_path / "a" / "rank0.json").read_text())
    assert boundary(written, written) is None
    phases = {(o.phase, o.module) for o in a}
    assert {("forward", "hidden"), ("forward", "drop"), ("backward", "head")} <= phases
    assert ("optimizer", "") in phases
    assert any("param hidden.weight" in o.args for o in a)
    assert first_part(a, _capture_a_step(tmp_path, "again")) is None  # replayed: alike
    part = first_part(a, _capture_a_step(tmp_path, "seeded", seed=1))
    assert part.why == RANDOM and part.a.module == "drop" and part.a.base == "bernoulli"
    assert part.a.line.startswith("tests/test_drill.py:") or "test_drill.py" in part.a.line
    seeded = json.loads((tmp_path / "seeded" / "rank0.json").read_text())
    edge = boundary(written, seeded)  # the module boundaries first: the dropout's output
    assert edge["module"] == "drop" and edge["how"] == "forward" and edge["kind"] == "Dropout"
    part = first_part(a, _capture_a_step(tmp_path, "scaled", scale=2.0))  # the script's value
    assert part.why == OTHER_INPUTS and part.a.base == "mul" and part.a.module == ""
    assert part.a.args[part.argument] == "1.0" and part.passed_value
    assert "the script passed another value" in drill_lines(Drill(OP, "", part))[-1]


def _recording(argv, world=2, micro=(1, 1)):
    meta = {"argv": argv, "cwd": ROOT, "world_size": world, "micro_steps": list(micro),
            "device": "cpu"}  # fmt: skip
    return store.Recording(meta, [], [], ["AdamW"], path=f"/recordings/{argv[0]}")


def _departing(kind, step=2, batch_step=None):
    first = Departure(step, step, f"gradients before step {step}", "AdamW", "fc.weight",
                      "differs", kind=kind)  # fmt: skip
    seen = None
    if batch_step is not None:
        seen = BatchDifference(batch_step, batch_step, 0, "args[0]", ORDER, "...")
    return Comparison(True, "same world size", "from step 0", 0, (0, 5), (0, 5), first=first,
                      batches=Batches(6, seen))  # fmt: skip


@pytest.mark.parametrize(
    "b, comparison, rung",
    [
        (["train.py"], _departing(k.GRADIENTS_DEPART, batch_step=1), BATCH),
        (["train.py"], _departing(k.SETTING_DEPARTS), NOT_COMPUTED),
        (["train.py"], _departing(k.START_DEPARTS), NOT_COMPUTED),
        (["train.py"], None, SPLIT),  # B on 1 rank, A on 2
    ],
    ids=["batch", "setting", "start", "split"],
)
def test_the_early_rungs_stop_without_a_re_run(tmp_path, b, comparison, rung):
    a = _recording(["train.py"])
    other = _recording(b, world=1) if rung == SPLIT else _recording(b)
    d = drill(a, other, comparison or _departing(k.GRADIENTS_DEPART), str(tmp_path))
    assert d.rung == rung and not d.reruns and not os.listdir(tmp_path)
    assert drill_lines(d)[-1].startswith("DRILL: stopped at")


def test_agreeing_runs_have_nothing_to_drill_into_and_other_scripts_are_refused(tmp_path):
    agree = Comparison(True, "same world size", "from step 0", 0, (0, 5), (0, 5))
    d = drill(_recording(["train.py"]), _recording(["train.py", "--x"]), agree, str(tmp_path))
    assert d.rung == NOTHING and drill_lines(d)[0].startswith("DRILL: nothing to drill into")
    with pytest.raises(NotComparable, match="other.py.*train.py|train.py.*other.py"):
        drill(_recording(["train.py"]), _recording(["other.py"]), agree, str(tmp_path))


def test_runs_that_agree_within_the_tolerance_say_where_the_order_of_the_sums_changed(tmp_path):
    agree = Comparison(False, "world size 1 vs 2", "from step 0", 0, (0, 3), (0, 3))
    one = _recording(["train.py"], world=1, micro=(4, 4))
    d = drill(one, _recording(["train.py"]), agree, str(tmp_path))
    assert d.rung == NOTHING and "within the tolerance of a changed summation order" in d.says
    assert "all-reduce sums over 1 and 2 ranks" in d.says and "4 and 1 micro-steps" in d.says


def test_the_printer_names_the_module_the_op_and_the_line():
    a = op("bernoulli_", outputs=(3,), module="drop", line="train.py:40")
    b = op("bernoulli_", outputs=(4,), module="drop", line="train.py:40")
    call = {"module": "drop", "kind": "Dropout", "line": "train.py:40", "how": "forward"}
    lines = drill_lines(Drill(OP, "", first_part([a], [b]), call))
    assert lines[0] == (
        "  module: drop (Dropout, called at train.py:40): its output differs while its input "
        "matched"
    )
    assert lines[1].startswith(
        "  op: aten.bernoulli_.default at train.py:40 (in the forward of drop"
    )
    assert lines[-1].startswith("DRILLED TO THE OP: ") and "random generator" in lines[-1]


def _line_of(path: str, text: str) -> int:
    with open(path) as f:
        return next(n for n, line in enumerate(f, 1) if text in line)


def _verify(*argv, cwd):
    return subprocess.run([sys.executable, "-m", "verify", *argv], cwd=cwd, capture_output=True,
                          text=True, timeout=600)  # fmt: skip


def test_ranks_are_searched_only_where_replicas_must_do_alike():
    """Two ranks' forward differs by their batches (skipped); rank 0's logging runs alone
    (ignored); what follows the gradients' all-reduce must match."""
    fwd = [op("t"), op("addmm", inputs=(7,), outputs=(8,))]
    log = [op("_local_scalar_dense", module="")]
    sync = [op("c10d.allreduce_.default", inputs=(5,), outputs=(), phase="backward", module="")]
    step = [op("add_", phase="optimizer", module="", inputs=(3, 4), outputs=(5,))]
    rank1_fwd = [op("t"), op("addmm", inputs=(9,), outputs=(10,))]
    assert first_divergence(fwd + log + sync + step, rank1_fwd + sync + step, True) is None
    part = first_divergence(fwd + sync + step, rank1_fwd + sync, True)
    assert part.why == ONLY_ONE and part.a.op == "aten.add_.default" and part.b is None
    drawn = [op("bernoulli_", inputs=(1,), outputs=(2,), module="drop")]
    other = [op("bernoulli_", inputs=(1,), outputs=(3,), module="drop")]
    part = first_divergence(fwd + drawn, rank1_fwd + other, synced=False)  # no collective
    assert part.why == NO_SYNC and part.also.why == RANDOM and part.also.a.module == "drop"
    assert drill_lines(Drill(OP, "", part, sides=("rank 0", "rank 1")))[-1].startswith(
        "DRILLED TO THE STEP: nothing synchronized the ranks' gradients"
    )
    # with the gradients all-reduced, a mask drawn per rank before the sync is by design
    assert (
        first_divergence(fwd + drawn + sync + step, rank1_fwd + other + sync + step, False) is None
    )
    printed = [op("_local_scalar_dense", module="", phase="optimizer")]  # rank 0's own op
    part = first_divergence(fwd + sync + printed + step, rank1_fwd + sync, True)
    assert part.why == ONLY_ONE and part.a.op == "aten._local_scalar_dense.default"
    assert first_divergence(fwd + drawn + sync, rank1_fwd + other + sync, synced=True) is None


def drill_problems(folder: Path) -> list[str]:
    """The end-to-end runs, on scripts the tool has never been tuned to; what is wrong, as
    lines (also a job of the hog window, tests/test_load.py):

    - two runs: a dropout mask drawn from a reseeded generator (named with its module and
      line), gradients jittered from the clock (refused at the replay), a copy of a
      recording (nothing to drill into, exit 0), a recording of another script (exit 2);
    - replicas (`audit --drill`): every rank on the same batch without an all-reduce and a
      dropout seeded per rank (the step that synchronized nothing, and the mask at its
      line), and an SGD of the student's own that updates on rank 0 only (at its line)."""
    folder.mkdir(parents=True, exist_ok=True)
    problems = []

    def expect(what: str, out, code: int, *says: str, last: str | None = None) -> None:
        verdicts = [x for x in out.stdout.splitlines() if x.startswith("DRILL")]
        if out.returncode != code:
            problems.append(f"{what}: exit {out.returncode}, not {code}: {out.stderr[-2000:]}")
        elif not all(s in out.stdout for s in says):
            problems.append(f"{what}: missing {says} in:\n{out.stdout}")
        elif last is not None and not (verdicts and verdicts[-1].startswith(last)):
            problems.append(f"{what}: the drill-down's verdict is not {last!r}:\n{out.stdout}")

    for name, *flags in (("a",), ("mask", "--mask-seed", "5"), ("jitter", "--jitter")):
        _verify("audit", "--nproc", "2", "--record", name, "--", SCRIPT, *flags, cwd=folder)
    line = f"drill_train.py:{_line_of(SCRIPT, 'self.drop(')}"
    out = _verify("compare", "--drill", "a", "mask", "--out", "runs", cwd=folder)
    expect("mask", out, 1, "  module: drop (Dropout, called at ", "  op: aten.bernoulli_",
           f"{line} (in the forward of drop", "its recording reproduced bitwise",
           last="DRILLED TO THE OP: the first op whose output differs while its inputs matched "
           "draws from a random generator")  # fmt: skip
    out = _verify("compare", "--drill", "a", "jitter", "--out", "runs", cwd=folder)
    expect("jitter", out, 1, last="DRILL: stopped at the replay: the re-run of B does not "
           "reproduce its recording")  # fmt: skip
    shutil.copytree(folder / "a", folder / "same")
    out = _verify("compare", "--drill", "a", "same", cwd=folder)
    expect("same", out, 0, last="DRILL: nothing to drill into: B agrees with A bitwise")
    manifest = folder / "same" / "manifest.json"
    manifest.write_text(json.dumps({**json.loads(manifest.read_text()), "argv": ["other.py"]}))
    out = _verify("compare", "--drill", "a", "same", cwd=folder)
    if out.returncode != 2 or len(out.stderr.strip().splitlines()) != 1:
        problems.append(f"other script: exit {out.returncode}, stderr {out.stderr!r}")
    script = os.path.join(ROOT, "tests", "fixtures", "drill_replicas.py")
    mask, update = (f"drill_replicas.py:{_line_of(script, t)}" for t in ("model(x)", "p.add_("))
    cases = (
        ("--mask-per-rank", ("  step: no collective ran before the optimizer's step",
                             "  besides, op: aten.bernoulli_.float at ", mask), "DRILLED TO THE STEP: "),
        ("--rank0-update", ("  op: rank 0 ran aten.add_.Tensor at ", update), "DRILLED TO THE OP: "),
    )  # fmt: skip
    for flag, says, last in cases:
        out = _verify("audit", "--nproc", "2", "--drill", "--out", "runs", "--", script, flag,
                      cwd=folder)  # fmt: skip
        expect(flag, out, 1, *says, "its recording reproduced bitwise", last=last)
    return problems


@pytest.mark.under_load
def test_drill_names_the_op_and_its_line_and_refuses_a_run_that_does_not_replay(tmp_path):
    """Two runs and two runs' replicas drilled, end to end (`drill_problems`)."""
    problems = drill_problems(tmp_path)
    assert not problems, "\n\n".join(problems)


def test_a_model_compiled_inside_ddp_is_recorded_as_compiled():
    """DDP(torch.compile(model)) is compiled too: its recording is compared within the
    tolerance of a changed summation order, and drilled as eager ops."""
    from verify.recording.recorder import _compiled

    class Wrapper(nn.Module):  # DDP's shape: one child, `module`
        def __init__(self, inner):
            super().__init__()
            self.module = inner

    assert _compiled(Wrapper(torch.compile(_Student())))
    assert _compiled(torch.compile(_Student()))
    assert not _compiled(Wrapper(_Student())) and not _compiled(_Student())


def test_a_write_the_dispatcher_does_not_see_is_named_after_the_last_op_alike(tmp_path):
    """A parameter changed through numpy (no ATen op, as a C++ extension's own loop would):
    the first op that reads it is given other inputs, every op before it alike, and the
    report names the last op seen alike before the difference entered."""
    a = _capture_a_step(tmp_path, "plain", train=False)  # no dropout: alike but for the poke
    b = _capture_a_step(tmp_path, "poked", train=False, poke=True)
    part = first_part(a, b)
    assert part.why == OTHER_INPUTS and part.a.phase == "optimizer" and not part.passed_value
    assert part.a.args[part.argument] == "param head.bias"
    assert part.before is not None and part.before.phase in ("backward", "optimizer")
    lines = drill_lines(Drill(OP, "", part))
    assert lines[-1].startswith("DRILL: stopped at the inputs: they already differed")
    assert f"after {part.before.op} at {part.before.line}" in lines[-1]


def test_an_op_apart_within_the_tolerance_of_a_reordered_sum_ends_the_search():
    """Runs that sum in other orders (here other thread counts): the first op apart by no
    more than a reordering makes is where the op-by-op search ends, said so, not a root
    cause; one further apart is."""
    from verify.checks.drill import _reordered

    tolerant = Comparison(False, "threads per rank 2 vs 1", "from step 0", 0, (0, 3), (0, 3))
    a = op("mm", outputs=(3,))
    close = Op(0, "forward", "fc", "aten.mm.default", "train.py:9", (1,), ("float32 [1]",),
               (4,), "float32 [4]", total=1.0, norm=2.0000001)  # fmt: skip
    far = Op(0, "forward", "fc", "aten.mm.default", "train.py:9", (1,), ("float32 [1]",),
             (4,), "float32 [4]", total=1.0, norm=2.5)  # fmt: skip
    two, one = ({"world_size": 1, "threads": t} for t in (2, 1))
    says = _reordered(first_part([a], [close]), two, one, tolerant)
    assert says and "within the tolerance" in says and "over 2 and 1 threads" in says
    assert _reordered(first_part([a], [far]), two, one, tolerant) is None
    bitwise = Comparison(True, "same", "from step 0", 0, (0, 3), (0, 3))
    assert _reordered(first_part([a], [close]), two, one, bitwise) is None
    lines = drill_lines(Drill("summation order", says, first_part([a], [close])))
    assert lines[-1].startswith("DRILL: stopped at the summation order: its outputs are apart")


def test_memory_empty_returned_never_reads_as_a_difference(tmp_path):
    """A buffer from torch.empty filled half by half through views (its garbage differs
    from run to run until written): two captures of the same step are alike."""

    class Padded(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(6, 3)

        def forward(self, x):
            buf = torch.empty(4, 6)
            buf[:, :3] = x[:, :3]
            buf[:, 3:] = 0.0
            return self.fc(buf)

    def one(name):
        modules = Modules()
        modules.install()
        try:
            torch.manual_seed(0)
            model = Padded()
            garbage = torch.randn(64, 64) * (1 if name == "a" else 7)  # the allocator's memory
            del garbage
            c = capture.Capture(str(tmp_path / name), 0, 0, modules)
            c.install()
            model(torch.ones(4, 6)).sum().backward()
            with pytest.raises(SystemExit):
                c.stepped(0, 0)
        finally:
            modules.remove()
        return ops_of(json.loads((tmp_path / name / "rank0.json").read_text())["ops"])

    assert first_part(one("a"), one("b")) is None
