"""`audit --record DIR`, `audit --against DIR` and `compare DIR_A DIR_B`: two runs of a script
compared step by step (verify/recording/, docs/compare.md).

The comparison (departure, alignment, the printed report, bad input) is tested in-process on
recordings checked in under tests/fixtures/compare/recordings/: real runs of the scripts in
tests/fixtures/compare/ (a token-normalized LM with accumulation, a resumable AdamW +
schedule loop, a GAN with two optimizers) and of a student's first accumulation loop, right
and wrong (written here), each recorded or run against its recording by
tests/fixtures/compare/make_recordings.py (how to regenerate them: recordings/README.md).

End to end, once per form (`runs`): a real `audit --record` of the resumable loop on two
ranks, a real `audit --against` of its resume, and a real `compare` of the two folders.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import torch

from tests import thread_world
from verify.checks.compare import verdict_of
from verify.checks.script_audit import AuditOptions, check_audit
from verify.cli import main
from verify.recording import store
from verify.recording.departure import compare_recordings
from verify.recording.sketch import BLOCKS, COLUMNS, gaps, sketch

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = ROOT / "tests" / "fixtures" / "compare"
TOKENS = str(FIXTURES / "train_tokens.py")
RESUME = str(FIXTURES / "train_resume.py")
GAN = str(FIXTURES / "two_optimizers.py")
RECORDINGS = FIXTURES / "recordings"  # checked in: recordings/README.md

# A student's first gradient accumulation, written fresh: one flag divides the loss by the
# accumulation steps, as the course notes say; the other forgets to.
STUDENT = """
import os, sys
import torch, torch.nn as nn
import torch.distributed as dist

accum = int(sys.argv[1])
forgot_to_divide = len(sys.argv) > 2
world = int(os.environ["WORLD_SIZE"])
if world > 1:
    dist.init_process_group("gloo")
rank = int(os.environ["RANK"])

torch.manual_seed(42)
model = nn.Sequential(nn.Linear(3, 8), nn.Tanh(), nn.Linear(8, 2))
if world > 1:
    model = nn.parallel.DistributedDataParallel(model)
opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
X = torch.linspace(-1, 1, 24 * 3).reshape(24, 3)
Y = torch.stack([X.sum(1), X[:, 0] * X[:, 1]], dim=1)

for epoch in range(3):
    batch_x = X[rank::world]          # my share of the 24 samples
    batch_y = Y[rank::world]
    chunk = len(batch_x) // accum
    opt.zero_grad()
    for i in range(accum):
        out = model(batch_x[i * chunk:(i + 1) * chunk])
        loss = ((out - batch_y[i * chunk:(i + 1) * chunk]) ** 2).mean()
        if not forgot_to_divide:
            loss = loss / accum
        loss.backward()
    opt.step()
"""


def audit(script, *args, nproc: int, out: str, **flags):
    return check_audit(AuditOptions(script=(script, *args), nproc=nproc, out=out,
                                    console="none", **flags))  # fmt: skip


def recorded(name: str) -> str:
    """The folder of a checked-in recording (`make_recordings.py` names them): "tokens" (1
    rank x 4 micro-steps), "split" (2 x 2, against it) and "bug" (2 x 2, the loss a mean per
    micro-batch); "full" (2 ranks, 6 steps, saved at 3), "resume" (its resume) and
    "no_sched" (resumed from a checkpoint without the scheduler); "student" (1 rank),
    "student_ok" and "student_bug" (2 x 2, the loss divided, or not); "gan" (two
    optimizers)."""
    return str(RECORDINGS / name)


def compared(a: str, b: str, align_step: int | None = None):
    """The comparison of checked-in recording `b` (this run) against `a` (the recording), as
    `audit --against` and `compare` compute it; in-process."""
    return compare_recordings(store.read(recorded(a)), store.read(recorded(b)), align_step)


# The tests that read `runs` go to one xdist worker (pyproject's `--dist loadgroup`): a
# fixture is set up once per worker that runs one of its tests. Session-scoped, as a module's
# fixture is torn down whenever the worker's next test is of another module.
RUNS_ON_ONE_WORKER = pytest.mark.xdist_group("compare-runs")


@pytest.fixture(scope="session")
def runs(tmp_path_factory):
    """The module's end-to-end runs: a recording of 6 steps on 2 ranks that saves a checkpoint
    after step 3 (`full`), then its resume from that checkpoint against it (`resume`)."""
    base = tmp_path_factory.mktemp("compare")
    out, rec, ck = str(base / "runs"), base / "rec", str(base / "ck.pt")
    full = audit(RESUME, "--steps", "6", "--save-at", "3", "--checkpoint", ck, nproc=2,
                 out=out, record=str(rec / "full"))  # fmt: skip
    resume = audit(RESUME, "--steps", "6", "--resume", ck, nproc=2, out=out,
                   against=str(rec / "full"))  # fmt: skip
    return {"dir": rec, "full": full, "resume": resume}


def cli(*argv: str) -> tuple[int, str, str]:
    stdout, stderr = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
        code = main(list(argv))
    return code, stdout.getvalue(), stderr.getvalue()


# --- end to end: one real run of each form ---------------------------------------------------


@RUNS_ON_ONE_WORKER
def test_a_recording_is_a_manifest_and_arrays_written_by_rank_0(runs):
    folder = runs["dir"] / "full"
    assert sorted(os.listdir(folder)) == ["batches.npz", "manifest.json", "tensors.npz",
                                          "values.npz"]  # fmt: skip
    manifest = json.loads((folder / "manifest.json").read_text())
    assert (manifest["format"], manifest["version"]) == (store.FORMAT, store.VERSION)
    assert manifest["world_size"] == 2 and manifest["micro_steps"] == [1] * 6
    rec = store.read(str(folder))
    assert rec.steps == 6 and rec.optimizers == ["AdamW"]
    assert rec.tensors["blocks"].shape[1:] == (BLOCKS, COLUMNS)
    assert sorted(set(rec.batches["step"].tolist())) == list(range(6))  # a batch every step
    assert runs["full"].verdict == "pass"


@RUNS_ON_ONE_WORKER
def test_a_correct_resume_is_aligned_from_its_parameters_and_agrees_bitwise(runs):
    """Real ranks on both sides: the resume's parameters before its first step are, bitwise,
    the full run's after step 2, and every compared step is bitwise equal."""
    from verify.cli.text_compare import audit as text

    c = runs["resume"].comparison
    assert runs["resume"].verdict == "pass", c.first
    assert c.bitwise and c.offset == 3 and c.steps_a == (3, 5) and c.steps_b == (0, 2)
    assert "equal, bitwise, the recording's after step 2" in c.alignment
    assert any(line.startswith("AGREE bitwise") for line in text(runs["resume"]).splitlines())


@RUNS_ON_ONE_WORKER
def test_compare_offline_gives_the_same_verdicts(runs):
    """`compare` on the two real folders: the verdict `--against` gave, exit 0; and its
    `--json`, the verdict and the comparison's keys."""
    full, resumed = str(runs["dir"] / "full"), runs["resume"].recording
    code, out, _ = cli("compare", full, resumed)
    assert code == 0 and "AGREE bitwise" in out and "recording's step 3" in out
    code, out, _ = cli("compare", full, resumed, "--json")
    doc = json.loads(out)
    assert code == 0 and (doc["check"], doc["verdict"], doc["passed"]) == ("compare", "pass", True)
    assert doc["comparison"]["offset"] == 3 and doc["comparison"]["first"] is None


# --- in-process, on the checked-in recordings ------------------------------------------------


def test_one_rank_against_two_at_the_same_global_batch_agrees_within_tolerance():
    """1 rank x 4 micro-steps against 2 ranks x 2: the gradients are summed in another order,
    so not bitwise; within eps (tolerance.py) at every step, the loss too. The two ranks'
    micro-batches, put together, are the one rank's global batch at every step."""
    c = compared("tokens", "split")
    assert verdict_of(c) == "pass", c
    assert not c.bitwise and "world size 1 vs 2" in c.mode_reason
    assert "micro-steps per step 4 vs 2" in c.mode_reason
    assert c.compared_steps == 4 and c.offset == 0
    assert c.batches.steps == 4 and c.batches.first is None, c.batches


def test_the_accumulation_normalization_bug_departs_at_step_0_at_the_loss():
    c = compared("tokens", "bug")
    assert verdict_of(c) == "fault"
    assert (c.first.step, c.first.name) == (0, "loss"), c.first
    assert "tolerance" in c.first.what
    assert c.departing_steps == c.compared_steps == 4


def test_a_resume_is_aligned_from_its_parameters_and_agrees_bitwise_in_process():
    """The same as the real runs above, on the checked-in pair: what `compare` computes from
    the folders alone."""
    c = compared("full", "resume")
    assert verdict_of(c) == "pass", c.first
    assert c.bitwise and c.offset == 3 and c.steps_a == (3, 5) and c.steps_b == (0, 2)
    assert "equal, bitwise, the recording's after step 2" in c.alignment


class _Parameters:
    """A recording's parameters as `align` reads them: one hash a step, the same name."""

    def __init__(self, start: int, after: list[int]) -> None:
        self._start, self._after = start, after

    def steps(self) -> int:
        return len(self._after)

    def start(self, optimizer: int) -> dict:
        return {"w": store_row(self._start)}

    def after(self, optimizer: int, step: int) -> dict:
        return {"w": store_row(self._after[step])}


def store_row(value: int):
    from verify.recording.table import Row

    return Row("w", "float32", (2,), value)


def test_an_alignment_that_several_steps_fit_says_it_is_ambiguous():
    """Parameters that never changed (a run that trains nothing) fit a resume at every step:
    the alignment taken is the first (from step 0), and it says that it is ambiguous and which
    offsets fit; a run that trains fits one offset, and says nothing more."""
    from verify.recording.align import align

    still = align(_Parameters(7, [7, 7, 7]), _Parameters(7, [7, 7]))
    assert still.offset == 0 and still.how.startswith("from step 0: both runs start")
    assert "ambiguous: 6 offsets fit equally (0, 1, 2, 3, -1, -2)" in still.how, still.how
    trains = align(_Parameters(1, [2, 3, 4]), _Parameters(3, [4]))
    assert trains.offset == 2 and "ambiguous" not in trains.how, trains.how


def test_a_checkpoint_without_the_scheduler_departs_at_the_first_lr_the_scheduler_sets():
    """The first resumed step (3) runs with the lr saved in the optimizer's state_dict, which
    is right; the restarted scheduler then sets 1/(1+1) instead of 1/(1+4) of the base lr:
    the departure is the lr before step 4, this run's step 1."""
    c = compared("full", "no_sched")
    assert verdict_of(c) == "fault"
    assert c.offset == 3 and (c.first.step, c.first.step_b) == (4, 1)
    assert c.first.name == "param_groups[0].lr" and c.first.phase.startswith("optimizer settings")
    assert "0.002 in the recording, 0.005 in this run" in c.first.what


def test_a_students_accumulation_is_judged_right_and_wrong():
    """Fresh code: 2 ranks x 2 micro-steps against 1 rank x 1; dividing by the accumulation
    steps agrees within tolerance, forgetting to departs at step 0 (the loss, twice as big)."""
    right = compared("student", "student_ok")
    assert verdict_of(right) == "pass", right.first
    bad = compared("student", "student_bug")
    assert verdict_of(bad) == "fault"
    assert (bad.first.step, bad.first.name) == (0, "loss")


def test_compare_says_the_departure_and_a_given_alignment_exit_1():
    code, out, _ = cli("compare", recorded("full"), recorded("no_sched"))
    assert code == 1
    assert "FIRST DEPARTURE: step 4 (this run's step 1), optimizer settings before step 4" in out
    code, out, _ = cli("compare", recorded("full"), recorded("resume"), "--align-step", "2")
    assert code == 1 and "by --align-step 2" in out


def test_the_audit_report_names_the_first_departure():
    """`audit --against`'s report of a run whose replicas agree (2 ranks, 4 steps audited) and
    whose loss departs from the recording's (the normalization bug)."""
    from verify.cli.text_compare import audit as text

    result = _recorded_audit(_stored_audit(4, 8, 4, diverged=False), compared("tokens", "bug"), 2)
    assert result.verdict == "fault"
    lines = text(result).splitlines()
    first = next(line for line in lines if line.startswith("FIRST DEPARTURE"))
    assert first.startswith("FIRST DEPARTURE: step 0, loss of step 0, AdamW: loss: ")
    assert any(line.startswith("  then gradients before step 0") for line in lines)
    assert any(line.startswith("DEPART: ") for line in lines)


def test_a_recording_on_one_rank_is_a_pass():
    """`audit --record` on one rank audits nothing across ranks (no replicas): its steps
    recorded make it a pass (exit 0), said in a RECORDED line."""
    from verify.checks.compare import RecordedAudit
    from verify.cli.text_compare import audit as text

    own = _recorded_audit(_stored_audit(0, 0, 4, diverged=False), None, 1).audit_result
    result = RecordedAudit(own, recorded("tokens"), None)
    assert own.verdict == "nothing audited" and result.verdict == "pass"
    assert f"RECORDED: 4 optimizer steps into {recorded('tokens')}" in text(result)


@pytest.mark.parametrize("case", ["missing", "not a recording", "other version"])
def test_against_or_compare_a_folder_that_is_no_recording_is_one_line_exit_2(tmp_path, case):
    folder = tmp_path / "rec"
    if case != "missing":
        folder.mkdir()
        (folder / "notes.txt").write_text("hello")
    if case == "other version":
        (folder / "manifest.json").write_text(json.dumps({"format": store.FORMAT, "version": 99}))
    for argv in (
        ("audit", "--nproc", "1", "--against", str(folder), "--", TOKENS),  # refused unrun
        ("compare", recorded("tokens"), str(folder)),
    ):
        code, out, err = cli(*argv)
        assert code == 2 and out == "", (argv, out)
        assert len(err.strip().splitlines()) == 1 and str(folder) in err, err
        assert "Traceback" not in err


def test_recordings_of_different_models_or_optimizers_are_exit_2():
    code, _, err = cli("compare", recorded("tokens"), recorded("full"))
    assert code == 2 and len(err.strip().splitlines()) == 1
    assert "different models: AdamW's parameter 0 is 0.weight [32, 16] in the recording, " \
           "0.weight [32, 10] in this run" in err  # fmt: skip
    code, _, err = cli("compare", recorded("tokens"), recorded("gan"))
    assert code == 2 and "different numbers of optimizers: 1 in the recording" in err


def test_record_refuses_a_folder_holding_a_recording(tmp_path):
    """Refused before the script starts (a copy: the checked-in folder is never a target)."""
    folder = shutil.copytree(recorded("tokens"), tmp_path / "t")
    code, _, err = cli("audit", "--nproc", "1", "--record", str(folder), "--", TOKENS)
    assert code == 2 and "already holds a recording" in err
    assert sorted(os.listdir(folder)) == sorted(os.listdir(recorded("tokens")))


def test_a_sketch_is_the_same_size_for_any_tensor_and_finds_the_changed_block():
    for n in (1, 7, 16, 1000, 1 << 20):
        assert sketch(torch.randn(n)).shape == (BLOCKS, COLUMNS)
    a = torch.randn(64, 50)
    b = a.clone()
    b[40:44] *= 1.01  # rows 40..43: elements 2000..2199, in block 11 of 16 (200 a block)
    g = gaps(sketch(a), sketch(b), a.numel())
    assert int(np.argmax(g)) == 10 and g.max() > 1e-3
    assert gaps(sketch(a), sketch(a.clone()), a.numel()).max() == 0


def verdict_problems(base: Path) -> list[str]:
    """A student's loop recorded on one rank, then run on two ranks x 2 micro-steps, right
    and wrong; and a resume against a full run, bitwise: what is wrong with their verdicts
    (empty: none). For the load test (tests/test_load.py). Not run idle a second time: the
    checked-in recordings of the same student's loop, right and wrong, give the same verdicts
    in-process, and the module's runs (`runs`) a resume of the same script, end to end (saved
    at step 3 of 6 there, 2 of 4 here)."""
    out, student = str(base / "runs"), base / "student.py"
    student.write_text(STUDENT)
    ck = str(base / "ck.pt")
    with ThreadPoolExecutor(2) as pool:
        first = [
            pool.submit(audit, str(student), "1", nproc=1, out=out, record=str(base / "s")),
            pool.submit(audit, RESUME, "--steps", "4", "--save-at", "2", "--checkpoint", ck,
                        nproc=2, out=out, record=str(base / "full")),
        ]  # fmt: skip
        problems = [f"recording: {r.verdict}" for r in (f.result() for f in first)
                    if r.verdict != "pass"]  # fmt: skip
        runs = {
            "right": pool.submit(audit, str(student), "2", nproc=2, out=out,
                                 against=str(base / "s")),
            "wrong": pool.submit(audit, str(student), "2", "x", nproc=2, out=out,
                                 against=str(base / "s")),
            "resume": pool.submit(audit, RESUME, "--steps", "4", "--resume", ck, nproc=2,
                                  out=out, against=str(base / "full")),
        }  # fmt: skip
        got = {k: f.result() for k, f in runs.items()}
    expected = {"right": "pass", "wrong": "fault", "resume": "pass"}
    for k, want in expected.items():
        c = got[k].comparison
        if got[k].verdict != want:
            problems.append(f"{k}: {got[k].verdict}, first departure {c and c.first}")
    c = got["wrong"].comparison
    if c is not None and c.first is not None and (c.first.step, c.first.name) != (0, "loss"):
        problems.append(f"wrong: departs first at {c.first}")
    c = got["resume"].comparison
    if c is not None and not (c.bitwise and c.offset == 2):
        problems.append(f"resume: bitwise {c.bitwise}, offset {c.offset}")
    return problems


def test_the_cost_benchmark_runs_tiny_and_projects_the_size(capsys):
    """`python benchmarks/record_cost.py` (not timed here: the numbers are the maintainer's,
    docs/compare.md): on a tiny model it pairs the three arms (audited, recorded without the
    batch, recorded), writes a recording and projects its size for 100M parameters x 1,000
    steps."""
    from benchmarks import record_cost

    argv = ["--device", "cpu", "--model-size", "0.5", "--repeats", "2", "--json"]
    assert record_cost.main(argv) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["verdict"] == "pass" and len(doc["recorded_s"]) == len(doc["audited_s"]) == 2
    assert len(doc["unbatched_s"]) == len(doc["unbatched_cpu_s"]) == 2
    wall, cpu, batch_wall, batch_cpu = doc["bars"]
    assert wall["what"] == "recorded / audited step" and "CPU time" in cpu["what"]
    assert batch_wall["what"] == "recorded / recorded without the batch"
    for bar, goal in ((wall, 1.02), (cpu, 1.02), (batch_wall, 1.005), (batch_cpu, 1.005)):
        assert bar["low"] <= bar["value"] <= bar["high"] and bar["goal"] == goal
    assert doc["rows"] > 0 and doc["bytes_on_disk"] > 0
    assert doc["projected_tensors"] > 0 and 0 < doc["projected_bytes"] < 100e6


def _shared_sketches_on_rank(group, same: bool) -> list:
    """Three gradients on each rank, the same names everywhere (`same`) or one named per
    rank: the owner's sketches, for the test to check against sketches of its own tensors."""
    from verify.replica_audit.compare import Entry
    from verify.script_audit.report import GRADS

    names = ["a", "b", "c" if same else f"rank{group.rank}"]
    tensors = [torch.arange(12.0) * (i + 1) + group.rank for i in range(3)]
    entries = [Entry(GRADS, n, t) for n, t in zip(names, tensors)]
    recorder, layout = _recorded_point(group, entries)
    got = np.stack(recorder.blocks).tolist() if recorder.owner else None
    return [got, [t.tolist() for t in tensors], layout]


def _recorded_point(group, entries):
    """One audit point after a step, as the script audit takes it: the recorder's first half,
    the audit's comparison (which says whether the ranks hold the same entries), the
    recorder's second half; (the recorder, whether the comparison found different entries).
    Only the owner, rank 0, keeps rows."""
    from verify.recording.recorder import Recorder
    from verify.replica_audit.compare import compare

    recorder = Recorder(folder="unused")
    recorder.add(group, (), 0, "SGD", 0, 1, entries)  # point 1: after the step, no loss
    outcome = compare(group, entries, (0, 0, 1))
    recorder.settle(group, agreed=not outcome.layout)
    return recorder, bool(outcome.layout)


@pytest.mark.parametrize("same", [True, False])
def test_the_ranks_share_the_sketching_and_file_each_under_its_tensor(same):
    """At 2 ranks with the same entries each rank sketches its share (`shares.plan`) and the
    owner gets every tensor's sketch of its own (the ranks' tensors are alike in a real run;
    here they differ by rank, so a block filed under the wrong rank's tensor shows); with
    different entries (a layout the audit reports) the owner sketches its own, alone. Two
    ranks in threads (tests/thread_world.py): the recorder's and the comparison's logic, over
    a group that holds them to the collectives' contract."""
    from verify.recording import shares

    (owner, mine, layout), (other, _, _) = thread_world.run(_shared_sketches_on_rank, 2, same)
    assert other is None and layout == (not same)
    per_rank = [[torch.tensor(t) + r for t in mine] for r in range(2)]  # the `+ group.rank`
    expected = np.stack([sketch(t) for t in per_rank[0]])
    if same:
        plan = shares.plan([t.numel() for t in per_rank[0]], 2)
        assert plan[0] and plan[1]  # both ranks took part
        for i, first, end in plan[1]:
            expected[i, first:end] = sketch(per_rank[1][i])[first:end]
    assert np.array_equal(np.array(owner), expected), (owner, expected)


# An uneven model written fresh (an embedding far larger than the rest, odd sizes, a step
# counter, a complex tensor, many small ones): by turn, rank 0 would sketch 3.5x rank 1.
def _uneven(seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    sizes = [(3001, 128), (128, 384), (384,), (384, 128), (128,), (7,), (5, 5), (128, 50)]
    out = [torch.randn(s, generator=g) for s in sizes]
    out += [torch.tensor(11), torch.randn(65, dtype=torch.complex64, generator=g)]
    return out + [torch.randn(1000 + 37 * k, generator=g) for k in range(12)]


def test_the_shares_are_balanced_and_their_blocks_are_the_sketch_bit_for_bit():
    """`shares.plan` gives every rank a weight within one block (plus a tensor's fixed cost)
    of an equal share, covers every block once, and the rows the ranks compute put together
    are `sketch`'s own bits, on one thread and on two (a block reduced alone on two threads
    rounds differently; `block_rows` never does that to a full block)."""
    from verify.recording import shares
    from verify.recording.sketch import block_counts, blocks_used, sketched_numel

    tensors = _uneven(0)
    numels = [sketched_numel(t) for t in tensors]
    alone = np.stack([sketch(t) for t in tensors])
    threads = torch.get_num_threads()
    try:
        for size in (2, 3, 5, 8):
            plan = shares.plan(numels, size)
            covered = sorted((i, b) for share in plan for i, f, e in share for b in range(f, e))
            assert covered == [(i, b) for i, n in enumerate(numels) for b in range(blocks_used(n))]
            weights = [shares.weight(share, numels) for share in plan]
            slack = max(block_counts(n)[0] for n in numels) + shares.OVERHEAD
            assert max(weights) - sum(weights) / size <= slack, (size, weights)
            for n_threads in (1, 2):
                torch.set_num_threads(n_threads)
                capacity = max(map(shares.rows, plan))
                tables = [shares.Part(tensors, share, capacity).table for share in plan]
                assert np.array_equal(shares.assemble(plan, tables, len(tensors)), alone)
    finally:
        torch.set_num_threads(threads)


def test_the_benchmark_transformers_gradients_are_shared_evenly_by_elements():
    """The script audit benchmark's 53.5M-parameter transformer (`record_cost.py`): its 100
    tensors by turn gave rank 0 61% of the elements at 2 ranks; the plan gives each rank
    within 2% of an equal share of them at 2 ranks, and at 4 and 8 a weight (elements and a
    fixed cost a tensor) within a block of the largest tensor (1/16 of its 5.77M elements)
    of an equal share."""
    from verify.recording import shares
    from verify.training.language import GPT, GPTConfig

    with torch.device("meta"):
        numels = [p.numel() for p in GPT(GPTConfig.with_params(50.0)).parameters()]
    assert sum(numels[0::2]) / sum(numels) > 0.6  # by turn
    for size in (2, 4, 8):
        plan = shares.plan(numels, size)
        done = [shares.elements(share, numels) for share in plan]
        weights = [shares.weight(share, numels) for share in plan]
        assert sum(done) == sum(numels) and min(done) > 0
        assert max(weights) - sum(weights) / size <= max(numels) / 16 + shares.OVERHEAD, weights
        assert size > 2 or max(done) / (sum(numels) / size) < 1.02, done


def _uneven_recorded_on_rank(group) -> list:
    """The uneven list as one audit point's gradients on every rank (alike, as replicas
    are): the owner's sketches and fingerprints, and the elements each rank sketched."""
    from verify.replica_audit.compare import Entry
    from verify.script_audit.report import GRADS

    entries = [Entry(GRADS, f"t{i}", t) for i, t in enumerate(_uneven(1))]
    recorder, layout = _recorded_point(group, entries)
    assert not layout  # the same entries on every rank: the shares are put together
    prints = [e.fingerprint for e in entries]  # the recorder's, which the comparison reused
    got = np.stack(recorder.blocks).tolist() if recorder.owner else None
    return [got, prints, recorder.sketched]


def test_two_ranks_record_an_uneven_model_as_one_rank_alone_would_with_even_shares():
    """Two ranks in threads (tests/thread_world.py): the owner's sketches of an uneven list
    are bitwise what one rank alone computes, every rank fingerprints every tensor (the audit
    reuses them), and each rank sketched its planned share (balanced: the test above), no
    block twice. (Over gloo, the script audit's `SideGroup`: the end-to-end runs above.)"""
    from verify.recording import shares
    from verify.recording.sketch import sketched_numel
    from verify.replica_audit.fingerprint import fingerprints

    (owner, prints0, done0), (other, prints1, done1) = thread_world.run(_uneven_recorded_on_rank, 2)
    tensors = _uneven(1)
    assert other is None
    assert np.array_equal(np.array(owner, dtype=np.float32), np.stack([sketch(t) for t in tensors]))
    assert prints0 == prints1 == fingerprints(tensors)
    numels = [sketched_numel(t) for t in tensors]
    assert [done0, done1] == [shares.elements(s, numels) for s in shares.plan(numels, 2)]
    assert done0 + done1 == sum(numels) and min(done0, done1) > 0


# --- the report's printer and the departures' hints, in-process (no ranks) ----------------


def _stored_audit(audited_steps: int, audits: int, steps: int, diverged: bool) -> dict:
    """An audit report as a rank stores it (`rank0.audit.json`, read back by `from_dict`)."""
    where = "gradients before step 0 (AdamW)"
    finding = {"check": "audit", "phase": "gradients before step {step}", "step": 0,
               "message": f"{where}: 3 tensors differ", "ranks": [1], "steps": [0],
               "where": where, "kind": "divergence", "numbers": {"tensors": []},
               "hint": "gradients were not synchronized", "optimizer": "AdamW", "count": 3,
               "fault": True}  # fmt: skip
    return {"every": 1, "steps": {"AdamW": steps}, "audits": audits,
            "audited_steps": audited_steps, "tensors": 12, "seconds": 0.01,
            "findings": [finding] if diverged else [], "finished": True}  # fmt: skip


def _comparison(departs: bool, steps: int = 5):
    from verify.hints import kinds
    from verify.recording.departure import Comparison, Departure

    first = Departure(0, 0, "loss of step 0", "AdamW", "loss", "2 in the recording, 4 in "
                      "this run", kind=kinds.LOSS_DEPARTS, hint="not divided")  # fmt: skip
    return Comparison(
        bitwise=False, mode_reason="world size 1 vs 2: the summation order changed",
        alignment="from step 0: both runs start from the same parameters (bitwise)", offset=0,
        steps_a=(0, steps - 1), steps_b=(0, steps - 1), first=first if departs else None,
        departing_steps=int(departs), compared_steps=steps,
    )  # fmt: skip


def _recorded_audit(stored: dict, comparison, nproc: int):
    from verify.checks.compare import RecordedAudit
    from verify.checks.script import ScriptRun
    from verify.checks.script_audit import AuditResult
    from verify.script_audit import AuditReport
    from verify.watching.findings import Diagnosis

    run = ScriptRun(diagnosis=Diagnosis("ok", "ok"), report_dir="out/r", elapsed_s=1.0,
                    audit=AuditReport.from_dict(stored))  # fmt: skip
    options = AuditOptions(script=(TOKENS,), nproc=nproc, console="none", against="rec/good")
    return RecordedAudit(AuditResult(options, run), "out/r/recording", comparison)


@pytest.mark.parametrize("departs", [True, False])
def test_the_comparison_is_printed_when_the_runs_own_replicas_diverge(departs):
    """A buggy run against a recording of its fixed version: the audit's REPLICAS DIVERGED,
    then the whole comparison; the verdict stays the divergence's, said last."""
    from verify.cli.text_compare import audit as text

    result = _recorded_audit(_stored_audit(5, 10, 5, diverged=True), _comparison(departs), 2)
    lines = text(result).splitlines()
    assert result.verdict == "fault"
    at = lines.index("REPLICAS DIVERGED: first at gradients before step 0 (AdamW)")
    assert lines[at + 1 : at + 4] == [
        "against rec/good:",
        "aligned: from step 0: both runs start from the same parameters (bitwise)",
        "compared: within the tolerance of docs/compare.md (world size 1 vs 2: the summation "
        "order changed)",
    ]
    head = "FIRST DEPARTURE: step 0, loss of step 0" if departs else "AGREE within tolerance"
    assert any(line.startswith(head) for line in lines[at:])
    assert (
        lines[-2] == "verdict: fault: the replicas diverged (above), whatever the comparison found"
    )
    assert lines[-1] == "report: out/r"


def test_one_rank_against_a_recording_says_what_it_did_not_audited_0_steps():
    """One rank has no replicas to compare: said from the counts (no audit point, its steps
    recorded), not as "audited: 0 steps" above a comparison of 5."""
    from verify.cli.text_compare import audit as text

    out = text(_recorded_audit(_stored_audit(0, 0, 5, diverged=False), _comparison(False), 1))
    assert "audited: 0 steps" not in out and "recorded only" not in out
    assert "NOTHING AUDITED" not in out
    assert "one rank: no replicas to compare across ranks; the script took AdamW 5 steps, " \
           "each recorded" in out.splitlines()  # fmt: skip
    assert "AGREE within tolerance at every compared step (steps 0..4 of the recording, 0..4 " \
           "of this run)" in out.splitlines()  # fmt: skip


def test_one_audited_step_is_one_step():
    from verify.cli.text_audit import findings
    from verify.script_audit import AuditReport

    lines = findings(AuditReport.from_dict(_stored_audit(1, 2, 1, diverged=False)))
    assert lines[-1].startswith("audited: 1 step (2 points: before and after each;")
    assert "the script took AdamW 1 step;" in lines[-1]


def test_a_report_that_ends_before_the_script_does_says_no_more_than_it_knows():
    """Ranks whose last report came before the script's end (killed; or a full disk, while
    the training went on: "trained 8 steps" below it) say the steps up to that report, not
    that the run was stopped, nor the verdict that the audit was."""
    from verify.checks.verdict import AUDIT_STOPPED
    from verify.cli.text_audit import findings, verdict_line
    from verify.script_audit import AuditReport

    report = AuditReport.from_dict(_stored_audit(3, 7, 3, diverged=False) | {"finished": False})
    summary = findings(report)[-1]
    assert "the script took AdamW 3 steps up to its ranks' last report;" in summary, summary
    assert "stopped" not in summary, summary
    assert verdict_line(report, AUDIT_STOPPED).startswith(
        "AUDIT STOPPED (the ranks' reports end after 3 audited steps, before the script did"
    )


LOSS_2X = ("not divided by the accumulation steps", "backward() on loss / 2")
HINT_CASES = [  # (kind, numbers, what the hint says; None: no hint)
    ("the loss departs from the recording",
     {"recording": 2.0, "this_run": 4.0, "micro_steps": 2, "micro_steps_recording": 1},
     ("this run's loss is 2 x the other's", *LOSS_2X)),
    ("the loss departs from the recording",
     {"recording": 12.0, "this_run": 3.0, "micro_steps": 2, "micro_steps_recording": 4},
     ("the recording's loss is 4 x the other's", "loss / 4")),
    ("the loss departs from the recording",  # 1.5x: no accumulation explains it
     {"recording": 2.0, "this_run": 3.0, "micro_steps": 2, "micro_steps_recording": 1}, None),
    ("the loss departs from the recording",  # 2x, but one micro-step a step in each run
     {"recording": 2.0, "this_run": 4.0, "micro_steps": 1, "micro_steps_recording": 1}, None),
    ("parameters depart from the recording after a step",
     {"compared_step": 0, "offset": 3, "in_one_run": False},
     ("the optimizer state was not restored", "optimizer.load_state_dict()")),
    ("parameters depart from the recording after a step",
     {"compared_step": 2, "offset": 0, "in_one_run": False},
     ("the optimizers differ in what is not a param-group setting",)),
    ("a setting departs from the recording", {"setting": "lr", "offset": 3},
     ("the scheduler was not restored",)),
    ("a setting departs from the recording", {"setting": "lr", "offset": 0}, None),
    ("gradients depart from the recording", {"compared_step": 0, "offset": 0}, None),
]  # fmt: skip


@pytest.mark.parametrize("kind, numbers, says", HINT_CASES)
def test_a_departures_hint_is_chosen_by_its_kind_and_numbers(kind, numbers, says):
    from verify.hints.table import Situation, hint_for
    from verify.recording.departure import Departure

    d = Departure(0, 0, "phase", "AdamW", "name", "a message no rule reads", kind=kind,
                  numbers=numbers)  # fmt: skip
    hint = hint_for(d, Situation(world_size=2))
    if says is None:
        assert hint is None, hint
    else:
        assert hint is not None and all(s in hint for s in says), hint


def test_a_resume_that_loses_the_optimizer_state_gets_its_hint_from_recordings():
    """The comparison fills the numbers from the recordings themselves: a resume (aligned at
    step 3) whose first step had the recording's gradients and lr but not its parameters."""
    from verify.recording.departure import compare_recordings

    full = _tiny_recording(steps=6, moved_at=None)
    resumed = _tiny_recording(steps=3, start=3, moved_at=0)
    c = compare_recordings(full, resumed)
    assert c.offset == 3 and c.first is not None, c
    assert c.first.phase == "parameters after step 3" and c.first.numbers["compared_step"] == 0
    assert "the optimizer state was not restored" in c.first.hint


def _tiny_recording(steps: int, start: int = 0, moved_at: int | None = None):
    """A recording built in memory, as `Recorder` rows: one SGD parameter `w` whose value
    after step s is s + 1 (before the first step: `start`), its gradient 1 and its lr 0.1
    at every step; `moved_at`: this run's parameters after that step are off by 0.5."""
    from verify.hints import phases
    from verify.recording.recorder import Recorder
    from verify.replica_audit.compare import Entry

    class Alone:
        size, rank = 1, 0

        def ready(self):
            return False

    rec, group = Recorder("unused"), Alone()
    rec.tap.take = lambda: (1.0, 1)
    for s in range(steps):
        value = float(start + s + 1) + (0.5 if s == moved_at else 0.0)
        before = [Entry(phases.SETTINGS, "param_groups[0].lr", setting=0.1),
                  Entry(phases.GRADS, "w", torch.ones(4))]  # fmt: skip
        if s == 0:
            before.insert(0, Entry(phases.PARAMS_FIRST, "w", torch.full((4,), float(start))))
        for point, entries in ((0, before), (1, [Entry(phases.PARAMS_AFTER, "w",
                                                       torch.full((4,), value))])):  # fmt: skip
            rec.add(group, (), 0, "SGD", s, point, entries)
            rec.settle(group, agreed=True)
    return rec.recording()


def test_the_recording_notes_each_autocast_dtype_entered_and_only_enabled_ones():
    """What the tolerance follows (`precision.py`): the dtype of every autocast entered
    enabled, where the script enters it, or found on at a backward."""
    from verify.recording.precision import AutocastTap

    tap = AutocastTap()
    tap.install()
    try:
        with torch.autocast("cpu", dtype=torch.float16, enabled=False):
            pass
        assert tap.dtypes == set()
        with torch.amp.autocast("cpu", dtype=torch.bfloat16):
            y = torch.nn.Linear(4, 4)(torch.ones(2, 4))
            tap.seen_at_backward("cpu")
        assert y.dtype == torch.bfloat16 and tap.dtypes == {"bfloat16"}
    finally:
        tap.remove()
    with torch.autocast("cpu", dtype=torch.float16):
        pass
    assert tap.dtypes == {"bfloat16"}  # removed: no longer seen


def test_zeros_settings_are_its_local_optimizers_overlaid_with_its_own():
    """ZeroRedundancyOptimizer's group added by add_param_group holds only the keys it was
    given until its first step: the settings read are the local AdamW's, with the outer
    group's own values on top (the step copies them down), as plain AdamW's would be."""
    from verify.script_audit.collect import Collector, described
    from verify.script_audit.naming import Modules

    w, b = torch.nn.Parameter(torch.ones(2, 2)), torch.nn.Parameter(torch.ones(2))
    local = torch.optim.AdamW([{"params": [w]}, {"params": [b], "weight_decay": 0.0}], lr=1e-3)
    plain = torch.optim.AdamW([{"params": [w]}, {"params": [b], "weight_decay": 0.0}], lr=2e-3)

    from torch.distributed.optim import ZeroRedundancyOptimizer

    class Zero(ZeroRedundancyOptimizer):  # its shape before a step (no process group here)
        def __init__(self):
            self.optim = local
            self.param_groups = [dict(plain.param_groups[0]),
                                 {"params": [b], "weight_decay": 0.0, "lr": 2e-3}]  # fmt: skip
            self.state = {}

    collect = Collector(Modules())
    settings = {e.name: e.setting for e in collect.settings(Zero())}
    assert settings == {e.name: e.setting for e in collect.settings(plain)}
    assert settings["param_groups[1].lr"] == 2e-3 and "param_groups[1].amsgrad" in settings
    assert described(Zero()) == "Zero over AdamW" and described(plain) == "AdamW"


def test_two_ranks_that_audited_nothing_are_not_called_one_rank():
    """The one-rank line needs one rank: two ranks that never formed a group (nothing
    audited) keep the audit's NOTHING AUDITED line above their comparison."""
    from verify.cli.text_compare import audit as text

    out = text(_recorded_audit(_stored_audit(0, 0, 5, diverged=False), _comparison(False), 2))
    assert "one rank" not in out and "NOTHING AUDITED" in out
