"""`audit --nproc N -- train.py`: a user's script run unmodified, its replicas compared
bitwise at every optimizer step (verify/script_audit/).

The scripts are written fresh in the styles people write (tests/fixtures/audit_*.py): a
nanoGPT loop with DDP and gradient accumulation, a hand-written DDP, a BatchNorm CNN under DDP
with both `broadcast_buffers` settings, DDP with ZeroRedundancyOptimizer, FSDP2 on a CPU mesh,
a scheduler. Each rank of a script is a fresh interpreter that imports torch (seconds of CPU),
so the correct versions run back to back in one launch, the buggy ones in another
(`audit_suite.py`), and the correct ones once more without the audit, for the proof that the
audit changes nothing the script computes: three launches of two ranks, run side by side.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from tests.processes import alive, once_per_session
from verify.checks.hang import HangOptions, check_hang
from verify.checks.script_audit import AuditOptions, check_audit
from verify.checks.verdict import EXIT_CODES
from verify.cli import main
from verify.cli.text_audit import audit as audit_text
from verify.launching import RankContext, launch
from verify.replica_audit.compare import Entry, compare
from verify.replica_audit.fingerprint import fingerprints
from verify.script_audit import report
from verify.script_audit.collect import Collector
from verify.script_audit.naming import Modules
from verify.script_audit.side_group import SideGroup

ROOT = Path(__file__).resolve().parents[1]
SUITE = str(ROOT / "tests" / "fixtures" / "audit_suite.py")
SCHEDULER = str(ROOT / "tests" / "fixtures" / "audit_scheduler.py")
CORRECT = ("nanogpt:ok", "hand_ddp:ok", "batchnorm:broadcast", "batchnorm:local", "sharded:zero",
           "sharded:fsdp", "scheduler:ok", "resume:ok")  # fmt: skip
BUGGY = ("nanogpt:late-sync", "hand_ddp:no-broadcast", "hand_ddp:no-divide", "scheduler:rank0",
         "scheduler:scaler-rank0", "resume:rank0")  # fmt: skip


def buggy_problems(result) -> list[str]:
    """What is wrong with the audit of the buggy scripts (empty: each bug named at its step,
    phase and tensor, nothing else reported as a cause). Shared with the load test."""
    causes = [f for f in result.faults if f.echo_of is None]
    expected = [  # (optimizer, phase, step, a tensor named, the ranks that differ)
        ("AdamW", report.GRADS, 0, "transformer.h.0.attn.c_attn.weight", (1,)),
        ("SGD #2", report.PARAMS_FIRST, 0, "0.weight", (1,)),
        ("SGD #3", report.GRADS, 0, "2.bias", (1,)),
        ("SGD #4", report.SETTINGS, 1, "param_groups[0].lr", (1,)),
        ("SGD #5", report.SCALER, 1, "GradScaler scale", (1,)),
        # Step 3 is no state point (0, 16, ...): the parameters that differ call for the
        # state, which is reported after them.
        ("Adam #6", report.PARAMS_AFTER, 3, "0.weight", (1,)),
    ]
    problems = []
    if result.verdict != "fault" or EXIT_CODES[result.verdict] != 1:
        problems.append(f"verdict {result.verdict}")
    got = [(f.optimizer, f.phase, f.step) for f in causes]
    if got != [e[:3] for e in expected]:
        problems.append(f"causes {got}")
    for f, (_, _, _, name, ranks) in zip(causes, expected):
        names = {t.name: t for t in f.tensors}
        if name not in names and f.count <= len(f.tensors):
            problems.append(f"{f.where}: {name} not named ({sorted(names)})")
        shown = [t for t in f.tensors if t.ranks]
        if not shown or any(t.ranks != ranks or t.reference_rank != 0 for t in shown):
            problems.append(f"{f.where}: ranks {[t.ranks for t in shown]}")
    echoes = {(f.optimizer, f.phase, f.step) for f in result.faults if f.echo_of is not None}
    if ("Adam #6", report.STATE, 3) not in echoes:
        problems.append(f"the rewound state not reported after the parameters: {sorted(echoes)}")
    if not all(f.echo_of is not None for f in result.faults if f not in causes):
        problems.append("an echo without its cause")
    if [p for p in result.run.pids.values() if alive(p)]:
        problems.append("a rank left running")
    return problems


def run_buggy(out: str):
    return check_audit(AuditOptions(script=(SUITE, *BUGGY), out=out, console="none"))


@pytest.fixture
def runs(tmp_path_factory):
    """The four launches, run once per test session: the first xdist worker to get here runs
    them under a file lock and leaves the results (pickled) in the session's shared temp
    dir; the others read them."""
    return once_per_session(tmp_path_factory, "audit-runs", lambda out: _run_all(str(out)))


def _run_all(out: str) -> tuple:
    os.makedirs(out, exist_ok=True)

    def correct_cli():
        stdout, stderr = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
            code = main(["audit", "--nproc", "2", "--out", out, "--", SUITE, *CORRECT])
        return code, stdout.getvalue(), stderr.getvalue()

    def plain():
        return check_hang(HangOptions(script=(SUITE, *CORRECT), nproc=2, out=out, console="none"))

    def under_torchrun():
        env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
        env.update(PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", DDP_VERIFY_HANG_DIR=out + "/tr")
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc-per-node", "2", "-m", "verify.audit_run", "--audit-every", "2", SCHEDULER,
               "rank0"]  # fmt: skip
        return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)

    with ThreadPoolExecutor(max_workers=4) as pool:
        jobs = (pool.submit(correct_cli), pool.submit(run_buggy, out), pool.submit(plain),
                pool.submit(under_torchrun))  # fmt: skip
        return tuple(j.result() for j in jobs)


def test_each_bug_is_named_at_its_step_and_tensor(runs):
    _, buggy, _, _ = runs
    text = audit_text(buggy)
    assert not buggy_problems(buggy), "\n".join(buggy_problems(buggy)) + "\n" + text
    lr = next(f for f in buggy.faults if f.phase == report.SETTINGS).tensors[0]
    assert lr.values == ("rank 0: 0.05", "rank 1: 0.1"), lr
    assert "FIRST DIVERGENCE: gradients before step 0 (AdamW): 28 tensors differ" in text, text
    assert "optimizer settings before step 1 (SGD #4)" in text, text
    assert text.splitlines()[-2] == "REPLICAS DIVERGED: first at gradients before step 0 (AdamW)"


def test_correct_scripts_are_clean_and_buffers_kept_per_rank_are_a_note(runs):
    (code, stdout, stderr), _, _, _ = runs
    assert code == 0, stdout[-3000:] + stderr[-3000:]
    report_text = stdout[stdout.index("\naudit: ") :]
    assert "DIVERGENCE" not in report_text and "replicas bitwise identical" in report_text
    # Only the BatchNorm CNN with broadcast_buffers=False (the 4th optimizer) gets a note.
    notes = [line for line in report_text.splitlines() if line.startswith("note: buffers")]
    assert len(notes) == 1 and "(SGD #4)" in notes[0], report_text
    assert "1.running_mean, 1.running_var" in notes[0], notes
    # ZeRO's and FSDP2's shards were seen and never compared.
    assert re.search(r"; \d+ sharded tensors never compared", report_text), report_text


def test_the_audit_changes_nothing_the_script_computes(runs):
    """Every loss the scripts print (repr: every bit) is the same with and without the audit."""
    (_, stdout, _), _, plain, _ = runs
    audited_dir = Path(re.search(r"report: (\S+)", stdout).group(1))
    for r in (0, 1):
        audited = _losses(audited_dir / f"rank{r}.stdout")
        assert audited and audited == _losses(Path(plain.report_dir) / f"rank{r}.stdout")
    assert plain.verdict == "pass", plain.diagnosis.text()


def _losses(path: Path) -> list[str]:
    return [line for line in path.read_text().splitlines() if " loss " in line]


def test_under_torchrun_rank_0_prints_the_verdict_and_the_job_fails(runs):
    """`torchrun ... -m verify.audit_run --audit-every 2 train.py`: the same audit in a job the
    tool did not start (the scheduler stepped on rank 0 only after step 0, seen at the next
    audited step, 2); every rank exits 1, so torchrun does."""
    proc = runs[3]
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-3000:]
    out = proc.stdout
    assert out.count("verify.audit_run:") == 1, out  # rank 0 only
    assert "REPLICAS DIVERGED: first at optimizer settings before step 2 (SGD)" in out, out
    assert "param_groups[0].lr on rank 1 vs rank 0: rank 0: 0.025, rank 1: 0.1" in out, out
    # steps 0 and 2, before and after each, the state at 0 (the first) and 2 (parameters differ)
    assert "audited: 2 steps (6 points" in out, out


def test_fingerprints_are_exact():
    """One ULP anywhere, values moved within a small tensor, rows swapped in a large one: each
    changes the fingerprint; the same bits give the same one, wherever they sit in memory."""
    small, large = torch.randn(33), torch.randn(300, 1000)
    ulp = small.clone()
    ulp[7] = torch.nextafter(ulp[7], torch.tensor(float("inf")))
    moved = small.clone()
    moved[[3, 4]] = moved[[4, 3]]
    rows = large.clone()
    rows[[0, 1]] = rows[[1, 0]]
    one = large.clone()
    one[299, 999] = torch.nextafter(one[299, 999], torch.tensor(0.0))
    strided = large.t().contiguous().t()  # the same values, another layout in memory
    prints = fingerprints([small, ulp, moved, large, rows, one, strided, small[1:].clone()])
    assert len(set(prints[:6])) == 6 and prints[6] == prints[3], prints
    assert fingerprints([torch.zeros(3, dtype=torch.bool), torch.zeros(3)]) != [0, 0]


def test_names_come_from_the_modules():
    """A plain nn.Sequential, and the same model inside a wrapper that holds it as `module`
    (DDP's name, and a hand-written wrapper's): the names a user knows, no `module.`."""
    modules = Modules()
    modules.install()
    try:
        net = torch.nn.Sequential(torch.nn.Linear(2, 3), torch.nn.ReLU(), torch.nn.Linear(3, 1))
        assert modules.name_of(net[2].bias) == "2.bias"

        class Wrapper(torch.nn.Module):
            def __init__(self, module):
                super().__init__()
                self.module = module

        Wrapper(net)
        assert modules.name_of(net[0].weight) == "0.weight"
        assert modules.name_of(torch.nn.Parameter(torch.ones(1))) is None
    finally:
        modules.remove()


def test_an_optimizer_over_a_set_is_audited_in_the_models_order():
    """An optimizer built over a Python set lists its parameters in each process's own hash
    order; the audit lists each group's in the model's order (`Collector.params`), so the
    ranks hold the same entries in one order. The groups stay apart and in their order, and
    a parameter no module owns comes after the model's, in its group's order."""
    modules = Modules()
    modules.install()
    try:
        net = torch.nn.Sequential(
            torch.nn.Linear(2, 3), torch.nn.Linear(3, 3), torch.nn.Linear(3, 1)
        )
    finally:
        modules.remove()
    stray = torch.nn.Parameter(torch.ones(1))
    p = dict(net.named_parameters())
    opt = torch.optim.SGD([{"params": [p["2.bias"], stray, p["0.weight"], p["1.weight"]]},
                           {"params": [p["1.bias"], p["0.bias"]], "lr": 0.5}], lr=0.1)  # fmt: skip
    names = [n for n, _ in Collector(modules).params(opt)]
    assert names == ["0.weight", "1.weight", "2.bias", "param_groups[0][1]", "0.bias", "1.bias"]


def test_the_report_says_when_nothing_trained():
    """The note beside the verdict: once for the run when no optimizer trained (zero
    gradients, parameters unchanged), else named by optimizer; no note when all trained."""
    from verify.cli.text_audit import untrained, verdict_line

    steps = {"SGD": 3, "Adam #2": 3}
    stuck = report.AuditReport(steps=steps, zero_gradients=("SGD", "Adam #2"),
                               unchanged=("SGD", "Adam #2"))  # fmt: skip
    (note,) = untrained(stuck)
    assert note.startswith("nothing trained: the loss's gradients were exactly zero"), note
    line = verdict_line(stuck, "pass")
    assert (
        line
        == "replicas bitwise identical at every audited step, but nothing trained (see the note)"
    )
    some = report.AuditReport(steps=steps, unchanged=("Adam #2",))
    assert [n.split(":")[0] for n in untrained(some)] == ["nothing trained by Adam #2"]
    assert untrained(report.AuditReport(steps=steps)) == []
    again = report.AuditReport.from_dict(stuck.to_dict())
    assert again.zero_gradients == ("SGD", "Adam #2") and again.unchanged == stuck.unchanged


def _compare_on_rank(ctx: RankContext) -> tuple[str, list]:
    group = SideGroup()
    assert group.ready()
    extra = [Entry(report.STATE, "w momentum_buffer", tensor=torch.ones(2))] if ctx.rank else []
    base = [Entry(report.GRADS, "w", tensor=torch.ones(4))]
    layout = compare(group, base + extra, (0, 0, 1)).layout
    sizes: dict = {}  # the second audit point of the same kind: header and body in one round
    same = [Entry(report.GRADS, "w", tensor=torch.tensor([1.0, 2.0, 3.0]))]
    assert compare(group, same, (0, 0, 0), sizes=sizes).mismatched == []
    values = [Entry(report.GRADS, "w", tensor=torch.tensor([1.0, 2.0, 3.0 + ctx.rank]))]
    outcome = compare(group, values, (0, 1, 0), sizes=sizes)
    dist.barrier()  # the script's own group still works, its sequence untouched
    # A DTensor is compared when replicated (its local tensor is the whole), never when sharded.
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (ctx.world_size,))
    collect = Collector(Modules())
    whole = collect.replicated(distribute_tensor(torch.ones(4), mesh, [Replicate()]))
    shard = collect.replicated(distribute_tensor(torch.ones(4), mesh, [Shard(0)]))
    assert whole is not None and whole.shape == (4,) and shard is None and collect.sharded == 1
    return layout, [outcome.mismatched, outcome.diffs[0]]


def test_ranks_that_audit_different_tensors_get_a_finding_not_a_crash():
    """The tool's collectives never depend on rank-local shapes: when one rank holds an
    optimizer state entry the other lacks, the ranks agree on that first and say so. Then a
    value that differs on rank 1, found in one all-reduce once the count is agreed, and a
    replicated DTensor compared where a sharded one is skipped."""
    run = launch(_compare_on_rank, world_size=2, timeout_s=60)
    assert run.ok, run.summary()
    layout, (mismatched, diff) = run.values[0]
    assert "rank 1: has extra 1 (w momentum_buffer)" in layout, layout
    assert mismatched == [0] and diff.ranks == (1,) and diff.max_abs_diff == 1.0
    assert diff.differing == 1 and diff.first_index == (2,), diff


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["nccl", "gloo"])
def test_the_audit_of_a_cuda_script(backend, tmp_path):
    """A GradScaler, fingerprints on the GPU, two ranks: on NCCL where there are two GPUs,
    over gloo on the one there is (the script asks for gloo). Clean, the audit passes at every
    step; with one rank's weight nudged after step 2, the replicas part there."""
    if backend == "nccl" and torch.cuda.device_count() < 2:
        pytest.skip("NCCL across GPUs: needs 2 (the gloo case covers one)")
    script = str(ROOT / "tests" / "fixtures" / "audit_cuda.py")

    def audit(*args):
        options = AuditOptions(
            script=(script, backend, *args), nproc=2, backend=backend, out=str(tmp_path),
            console="none",
        )  # fmt: skip
        return check_audit(options)

    clean = audit()
    assert clean.verdict == "pass", audit_text(clean)
    assert clean.audit is not None and clean.audit.finished, audit_text(clean)
    assert clean.audit.audits >= 2 and not clean.findings, audit_text(clean)
    skewed = audit("skew")
    assert skewed.verdict == "fault" and skewed.findings, audit_text(skewed)


def _holdings_on_rank(ctx) -> list[str]:
    """Two parameters' optimizer state as LBFGS on a rank-local loss leaves it: the same
    entry names on both ranks, but `t` a number on rank 0 and a tensor on rank 1; and a
    momentum buffer rank 1 lost."""
    from verify.replica_audit.compare import Entry
    from verify.script_audit import owners
    from verify.script_audit.side_group import SideGroup

    phase = "optimizer state after step {step}"
    t = Entry(phase, "w t", setting=0.5) if ctx.rank == 0 else Entry(phase, "w t", torch.ones(()))
    lost = [] if ctx.rank == 1 else [Entry(phase, "b momentum_buffer", torch.zeros(2))]
    per_param = [
        [Entry(phase, "w d", torch.zeros(3)), t],
        [Entry(phase, "b step", setting=1.0), *lost],
    ]
    group = SideGroup()
    assert group.ready()
    return [owners.split(group, ["w", "b"], per_param).problem]


def test_state_held_differently_is_named():
    """A fault in who holds what always says what differs: the kind of an entry (a number
    on one rank, a tensor on another) as well as an entry a rank lacks."""
    run = launch(_holdings_on_rank, world_size=2, timeout_s=120)
    assert run.ok, run.summary()
    (problem,) = run.values[0]
    assert "rank 1 holds t as torch.float32 () where rank 0 holds t as a setting" in problem
    assert "rank 1 lacks momentum_buffer" in problem, problem
