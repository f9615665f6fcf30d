"""The replica audit of scripts written with PyTorch Lightning, HF accelerate, and a closure
optimizer (`audit --nproc 2 -- script.py`), idle and with every core busy.

Lightning's `Trainer(accelerator="cpu", strategy="ddp", devices=2)` and accelerate's
`Accelerator(cpu=True)` join the world the tool starts (its ranks carry torchrun's variables:
LOCAL_RANK tells Lightning not to start ranks of its own) rather than launching their own.
The audit reads each step's gradients where they are final (`verify/script_audit/closures.py`):
under Lightning's automatic optimization, and for `LBFGS`, the forward and the backward run
inside `optimizer.step(closure)`, after the step's pre-hook.

- tests/fixtures/frameworks/lightning_regressor.py, clean (BatchNorm, dropout, a torchmetrics
  metric, `self.log(sync_dist=True)`, a CSV logger, clipping, a step-wise schedule,
  `accumulate_grad_batches=2`): a pass. Before closures.py it was two false alarms:
  "gradients before step 0" (the pre-hook saw the first micro-batch's unsynchronized
  gradients) and "buffers after DDP's broadcast, before step 1" (the snapshot was taken at
  the syncing micro-batch's forward, where DDP does not broadcast after a no_sync() one);
- the same, one batch a step, with per-rank gradient noise added in
  `on_before_optimizer_step`: first at "gradients
  before step 0", the parameters after it an echo, names as the LightningModule spells them
  (`net.0.weight`, no `module.`). Before: first at "parameters after step 0", with the hint
  of an update that ran differently, and the gradients a step late;
- the same with a clamp of the weights under `if self.trainer.is_global_zero:` in
  `on_train_batch_end`: first at "parameters before step 0" (the hook ran after the first
  micro-batch, before the first step), `net.0.weight` alone;
- tests/fixtures/frameworks/lightning_gan.py (manual optimization, two optimizers, BatchNorm):
  a pass with a note on the BatchNorm's running statistics, kept per rank (Lightning runs the
  forward with DDP's `require_backward_grad_sync` off, and DDP then skips its broadcast of the
  buffers). Before, the snapshot "after DDP's broadcast" was taken at a forward that did not
  broadcast: a false alarm at "buffers after DDP's broadcast, before step 0";
- tests/fixtures/frameworks/accelerate_finetune.py, clean (`accumulate()`, clipping on the
  syncing micro-step, a prepared scheduler, `gather_for_metrics`): a pass, 4 steps audited of
  the 8 micro-steps (accelerate's optimizer steps on the syncing ones only); resumed from a
  checkpoint on the main process after `prepare()`: first at "parameters before step 0",
  named without accelerate's DDP wrapper (`0.weight`), the hint naming a load after the
  wrap (before, it named only a missing broadcast or per-rank seeds);
- tests/fixtures/frameworks/lbfgs_ddp.py (full-batch L-BFGS under DDP), clean: a pass; its
  closure calling `model.module` (no all-reduce): first at "gradients before step 0" (before:
  "parameters after step 0").

And, in two ranks without a script (cheap): a closure is audited at its return and passes its
value through; an optimizer that never calls its closure is audited at its post-hook.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from torch import nn

from tests.consoles import Ran, run_main
from tests.processes import still_running
from verify.launching import RankContext, launch
from verify.script_audit import AuditSettings, StepHooks

pytest.importorskip("pytorch_lightning", reason="needs the dev extra (pytorch-lightning)")
pytest.importorskip("accelerate", reason="needs the dev extra (accelerate)")

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = ROOT / "tests" / "fixtures" / "frameworks"
LIGHTNING, ACCELERATE, LBFGS = "lightning_regressor.py", "accelerate_finetune.py", "lbfgs_ddp.py"
GAN = "lightning_gan.py"

CASES = {  # name -> (script, its mode, takes an output folder)
    "lit-clean": (LIGHTNING, "clean", True),
    "lit-noise": (LIGHTNING, "noise", True),
    "lit-rank0": (LIGHTNING, "rank0-clamp", True),
    "lit-gan": (GAN, None, False),
    "acc-clean": (ACCELERATE, "clean", True),
    "acc-resume": (ACCELERATE, "resume-on-main", True),
    "lbfgs-clean": (LBFGS, "clean", False),
    "lbfgs-inner": (LBFGS, "inner-module", False),
}
# Where a verdict changed (closures.py, broadcasts_now): the cases the busy run takes too.
TIMING = ("lit-clean", "lit-noise", "lit-gan", "lbfgs-inner")
PASS = "replicas bitwise identical at every audited step"
# Under the hog window's load, two cases at a time: the window's other jobs time hang
# detection, and a dozen interpreters importing Lightning at once would starve them beyond
# what "every core busy" means (tests/test_load.py, WORKERS).
LOADED_AT_ONCE = 2


def run_cli(out: Path, name: str) -> Ran:
    """`python -m verify audit --nproc 2 -- SCRIPT ...` as `main()` in this process
    (tests/consoles.py: the ranks are the same fresh interpreters, no parent interpreter is
    started); the scripts write only into the folder they are given (Lightning's logger and
    checkpoints off, or there)."""
    script, mode, folder = CASES[name]
    work = out / name
    work.mkdir(parents=True)
    args = ([str(work)] if folder else []) + ([mode] if mode else [])
    return run_main(
        "audit", "--nproc", "2", "--out", str(work), "--", str(FIXTURES / script), *args
    )


def run_all(out: Path, names, at_once: int | None = None) -> dict[str, Ran]:
    with ThreadPoolExecutor(max_workers=at_once or len(names)) as pool:
        jobs = {name: pool.submit(run_cli, out, name) for name in names}
        return {name: job.result() for name, job in jobs.items()}


def problems(done: dict[str, Ran]) -> list[str]:
    """What is wrong with each case's exit code and output (empty: all right)."""
    found = []

    def want(name: str, ok: bool, what: str) -> None:
        if not ok:
            p = done[name]
            found.append(f"{name}: {what} (exit {p.returncode})\n{p.stdout[-3000:]}\n{p.stderr}")

    def verdict(name: str, code: int, first: str | None, steps: str) -> None:
        if name not in done:
            return
        out = done[name].stdout
        want(name, done[name].returncode == code, f"exit {code}")
        want(name, steps in out, f"'{steps}'")
        if first is None:
            want(name, PASS in out and "DIVERGENCE" not in out, "a pass")
        else:
            want(name, f"REPLICAS DIVERGED: first at {first}" in out, f"first at {first}")
        # Names as the user's model spells them, never a wrapper's prefix
        ours = [ln for ln in out.split("\naudited:")[0].splitlines() if not ln.startswith("[")]
        want(name, not any("module." in ln for ln in ours), "no wrapper prefix in a name")

    def lines_of(name: str, start: str) -> list[str]:
        out = done[name].stdout if name in done else ""
        after = out.split(start, 1)[1] if start in out else ""
        return after.split("\nREPLICAS DIVERGED")[0].splitlines()

    verdict("lit-clean", 0, None, "the script took AdamW 3 steps")
    verdict("lit-noise", 1, "gradients before step 0 (AdamW)", "AdamW 3 steps")
    verdict("lit-rank0", 1, "parameters before step 0 (the first audited) (AdamW)", "3 steps")
    verdict("lit-gan", 0, None, "the script took Adam 4 steps, Adam #2 2 steps")
    if "lit-gan" in done:
        want("lit-gan", "note: buffers before step 0 (Adam #2): 2 tensors differ across ranks "
             "(discriminator.1.running_mean, discriminator.1.running_var)"
             in done["lit-gan"].stdout, "the BatchNorm's statistics noted")  # fmt: skip
    verdict("acc-clean", 0, None, "the script took AdamW 4 steps")
    verdict("acc-resume", 1, "parameters before step 0 (the first audited) (AdamW)", "4 steps")
    verdict("lbfgs-clean", 0, None, "the script took LBFGS 3 steps")
    verdict("lbfgs-inner", 1, "gradients before step 0 (LBFGS)", "LBFGS 3 steps")
    for name in done:
        if name.startswith("lit-"):  # Lightning joined the tool's world: one of two, no more
            out = done[name].stdout + done[name].stderr
            want(name, "[rank 1] Initializing distributed: GLOBAL_RANK: 1, MEMBER: 2/2" in out,
                 "Lightning's rank 1 in the tool's world of 2")  # fmt: skip
    if "lit-noise" in done:
        first = lines_of("lit-noise", "FIRST DIVERGENCE: gradients before step 0 (AdamW)")
        want("lit-noise", any(ln.strip().startswith("net.0.weight on rank 1") for ln in first),
             "net.0.weight named")  # fmt: skip
        want("lit-noise", "parameters after step 0 (AdamW)" in "\n".join(first), "an echo")
        want("lit-noise", "ANOTHER DIVERGENCE" not in done["lit-noise"].stdout, "one finding")
    if "lit-rank0" in done:
        first = lines_of("lit-rank0", "FIRST DIVERGENCE: parameters before step 0")
        want("lit-rank0", "1 tensor differs" in done["lit-rank0"].stdout, "one tensor")
        want("lit-rank0", any(ln.strip().startswith("net.0.weight on rank 1") for ln in first),
             "net.0.weight named")  # fmt: skip
    if "acc-resume" in done:
        first = lines_of("acc-resume", "FIRST DIVERGENCE: parameters before step 0")
        want("acc-resume", any(ln.strip().startswith("0.weight on rank 1") for ln in first),
             "0.weight named")  # fmt: skip
        want("acc-resume", "changed them on some ranks after the wrap (a checkpoint loaded"
             in done["acc-resume"].stdout, "the hint names a load after the wrap")  # fmt: skip
    if "lbfgs-inner" in done:
        first = lines_of("lbfgs-inner", "FIRST DIVERGENCE: gradients before step 0 (LBFGS)")
        want("lbfgs-inner", "parameters after step 0 (LBFGS)" in "\n".join(first), "an echo")
    return found


def test_lightning_accelerate_and_closure_scripts(tmp_path):
    """The cases the hog window does not run (`TIMING`: `test_the_timing_cases`)."""
    done = run_all(tmp_path, [name for name in CASES if name not in TIMING])
    assert not problems(done), "\n\n".join(problems(done))


@pytest.mark.under_load
def test_the_timing_cases(tmp_path):
    found = loaded_problems(tmp_path, at_once=None)
    assert not found, "\n\n".join(found)


def loaded_problems(out: Path, at_once: int | None = LOADED_AT_ONCE) -> list[str]:
    """The cases whose verdict hangs on timing (`TIMING`), for the hog window of
    tests/test_load.py: what is wrong with them, and any rank left running."""
    done = run_all(out, TIMING, at_once=at_once)
    left = still_running(out)
    return problems(done) + ([f"ranks left running: {left}"] if left else [])


# ------------------------------------------------------------ the closure's timing, in-process


class _IgnoresClosure(torch.optim.SGD):
    """A custom optimizer that takes a closure and never calls it."""

    def step(self, closure=None):
        return super().step()


def _closure_points_on_rank(ctx: RankContext) -> tuple:
    auditor = StepHooks(AuditSettings())
    auditor.install()
    try:
        torch.manual_seed(0)
        model = nn.Linear(3, 2)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)

        def closure():  # the gradients exist only once the closure ran, one rank's apart
            opt.zero_grad()
            model(torch.ones(1, 3)).sum().backward()
            model.bias.grad += ctx.rank
            return 7.0

        returned = opt.step(closure)
        first = [(f.phase, f.step, f.tensor) for f in auditor.book.findings]
        other = _IgnoresClosure(nn.Linear(2, 2).parameters(), lr=0.1)
        for p in other.param_groups[0]["params"]:
            p.grad = torch.ones_like(p)
        before = auditor.audits
        other.step(lambda: 1 / 0)
        return returned, first, auditor.audits - before, len(auditor.book.findings)
    finally:
        auditor.remove()


def test_a_closure_is_audited_when_it_returns():
    """The rank-1 gradient written inside the closure is the first finding ("gradients before
    step 0", where the pre-hook saw no gradient at all); the closure's value comes back from
    `step`; an optimizer that ignores its closure still gets its before point (3 audit points:
    before, after, the state at the first step), and nothing new is found there."""
    run = launch(_closure_points_on_rank, world_size=2, timeout_s=120)
    assert run.ok, run.summary()
    returned, first, points, findings = run.values[0]
    assert returned == 7.0
    assert first[0] == ("gradients before step {step}", 0, "bias"), first
    assert points == 3 and findings == len(first), (points, findings, first)
