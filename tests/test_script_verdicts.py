"""Every verdict of `audit --nproc N -- train.py` (and `hang`) right on scripts people write,
idle and with every core busy:

- a DDP loop that hangs after five steps (tests/fixtures/audit_stuck.py): the HANG is the
  verdict, and the summary counts the five steps taken and audited, not zero;
- the console shows the script's own output, never c10d's INFO log (reducer.cpp, "DDP
  Initialized with:" and its lines), which stays in each rank's stderr file;
- a script that takes no optimizer step (shaped like pytorch/examples' FSDP2 example on a
  machine without GPUs: audit_fsdp_example.py) is "nothing audited", exit 2, never a pass;
- a Muon-style optimizer that keeps each matrix's momentum on its owner rank only
  (audit_muon.py, as modded-nanogpt does) passes, with a note counting its sharded state; the
  same optimizer with an owner test written for two GPUs, run on three ranks, has ranks 0
  and 2 both holding (and both applying) the even matrices' momentum: a fault, named;
- a script with its device and backend hard-coded for GPUs (audit_needs_cuda.py) is a usage
  error on a machine without CUDA: exit 2, one line with the call and its file:line, no
  traceback on the console;
- a script whose ranks meet at a tcp:// address of its own (audit_tcp_init.py, written for a
  launch of its own) never meets under torchrun or the tool: a HANG that says the ranks never
  met in init_process_group and where torchrun's ranks meet, not a collective (its ranks
  count as starting for the first minute, so this case takes one);
- an optimizer built over a set of parameter names (audit_set_order.py: each rank prints its
  own order, and they differ) passes: the same parameters are the same entries in whatever
  order a rank lists them; where that order packs a flat buffer that is all-reduced, the
  gradients differ, and the FAULT names them;
- a model whose loss trains nothing (audit_one_class.py: a cross-entropy over one logit, its
  gradients exactly zero) passes, with the note "nothing trained" beside the verdict; a run
  that trains (Muon's) has no such note.

Each case is the real command line. The two usage errors (their one line on stderr, and no
traceback from a real interpreter on its way out) run as `python -m verify` in a process of
its own; the others as `main()` in a thread of the test's process, each
with a console of its own (tests/consoles.py): the ranks are the same fresh interpreters, only
the tool's own interpreter and its torch import (~2 s of CPU a case) are saved. Under CPU hogs,
with the rest of the load test's verdicts: tests/test_load.py.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from tests.consoles import Ran, run_main
from verify.launching import launch
from verify.replica_audit.compare import Entry
from verify.script_audit import owners, report
from verify.script_audit.side_group import SideGroup

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = ROOT / "tests" / "fixtures"
NOISE = ("reducer.cpp", "DDP Initialized with", "broadcast_buffers:", "bucket_cap_bytes:")

CASES = {  # name -> (command, nproc, script and its arguments)
    "hang": ("audit", 2, ("audit_stuck.py",)),
    "no-step": ("audit", 2, ("audit_fsdp_example.py",)),
    "no-step-after-init": ("audit", 2, ("audit_fsdp_example.py", "after-init")),
    "muon": ("audit", 2, ("audit_muon.py", "owner")),
    "muon-two-gpus": ("audit", 3, ("audit_muon.py", "two-gpus")),
    "cuda-set-device": ("audit", 2, ("audit_needs_cuda.py", "set-device")),
    "cuda-nccl": ("hang", 2, ("audit_needs_cuda.py", "nccl")),
    "never-met": ("hang", 2, ("audit_tcp_init.py",)),
    "set-order": ("audit", 2, ("audit_set_order.py", "ddp")),
    "set-order-flat": ("audit", 2, ("audit_set_order.py", "flat")),
    "one-class": ("audit", 2, ("audit_one_class.py",)),
}
IN_A_PROCESS = ("cuda-set-device", "cuda-nccl")  # a real interpreter's console: no traceback


def run_cli(out: Path, name: str) -> subprocess.CompletedProcess | Ran:
    command, nproc, script = CASES[name]
    args = [command, "--nproc", str(nproc), "--out", str(out / name), "--stall-timeout", "5",
            "--", str(FIXTURES / script[0]), *script[1:]]  # fmt: skip
    if name not in IN_A_PROCESS:
        return run_main(*args)
    # the CUDA script where there is no GPU, on a machine with GPUs too (on one GPU, two
    # ranks of it are the other usage error: tests/test_gpu_paths.py)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "CUDA_VISIBLE_DEVICES": ""}
    argv = [sys.executable, "-m", "verify", *args]
    return subprocess.run(argv, env=env, capture_output=True, text=True, timeout=600, cwd=ROOT)


def run_all(out: Path) -> dict[str, subprocess.CompletedProcess | Ran]:
    """Every case at once (the idle test, and the load test under its hogs)."""
    with ThreadPoolExecutor(max_workers=len(CASES)) as pool:
        jobs = {name: pool.submit(run_cli, out, name) for name in CASES}
        return {name: job.result() for name, job in jobs.items()}


def problems(done: dict[str, subprocess.CompletedProcess | Ran]) -> list[str]:
    """What is wrong with each case's exit code and output (empty: all right). Shared by the
    idle test and the one under load."""
    found = []

    def want(name: str, ok: bool, what: str) -> None:
        if not ok:
            p = done[name]
            found.append(f"{name}: {what} (exit {p.returncode})\n{p.stdout[-3000:]}\n{p.stderr}")

    hang = done["hang"].stdout
    want("hang", done["hang"].returncode == 1, "exit 1")
    want("hang", "\nHANG: " in hang, "a HANG")
    want("hang", "audited: 5 steps" in hang and "SGD 5 steps" in hang, "five steps audited")
    want("hang", "verdict: fault" not in hang, "no stray verdict line")
    for name, p in done.items():
        want(name, not any(n in p.stdout for n in NOISE), "no c10d INFO log on the console")
    for name in ("no-step", "no-step-after-init"):
        want(name, done[name].returncode == 2, "exit 2")
        want(name, "NOTHING AUDITED" in done[name].stdout, "NOTHING AUDITED")
    muon = done["muon"].stdout
    want("muon", done["muon"].returncode == 0, "exit 0")
    want("muon", "replicas bitwise identical at every audited step" in muon, "a pass")
    want("muon", "optimizer state sharded by design" in muon and "Muon #3 12" in muon, "a note")
    bug = done["muon-two-gpus"].stdout
    want("muon-two-gpus", done["muon-two-gpus"].returncode == 1, "exit 1")
    want("muon-two-gpus", "REPLICAS DIVERGED: first at the tensors audited at step 0 (Muon #3)"
         in bug, "the fault at Muon's first step")  # fmt: skip
    want("muon-two-gpus", "h.0.c_q.weight's state (momentum_buffer) is held by ranks 0, 2: "
         "rank 1 holds none of it" in bug, "the holders named")  # fmt: skip
    for name, line in (("cuda-set-device", "audit_needs_cuda.py:21: `torch.cuda.set_device"),
                       ("cuda-nccl", 'audit_needs_cuda.py:24: `dist.init_process_group(backend="nccl")`')):  # fmt: skip
        p = done[name]
        want(name, p.returncode == 2, "exit 2")
        want(name, p.stderr.count("\n") == 1 and line in p.stderr, "one line naming the call")
        want(name, "Traceback" not in p.stdout + p.stderr, "no traceback on the console")
    want("cuda-nccl", "--backend gloo does not change" in done["cuda-nccl"].stderr, "--backend")
    met = done["never-met"]
    want("never-met", met.returncode == 1, "exit 1")
    want("never-met", "HANG: the ranks never met: every rank is still inside init_process_group"
         in met.stdout and "audit_tcp_init.py:15" in met.stdout, "the meeting that never was")  # fmt: skip
    want("never-met", "init_method='env://'" in met.stdout, "where torchrun's ranks meet")
    found += _set_order_problems(done)
    one = done["one-class"]
    want("one-class", one.returncode == 0, "exit 0: the verdict stands")
    want("one-class", "note: nothing trained: the loss's gradients were exactly zero at every "
         "audited step and no parameter changed" in one.stdout, "the note")  # fmt: skip
    want("one-class", "bitwise identical at every audited step, but nothing trained" in one.stdout,
         "said beside the verdict")  # fmt: skip
    want("muon", "nothing trained" not in muon, "no note on a run that trains")
    return found


def _set_order_problems(done: dict) -> list[str]:
    """An optimizer over a set of parameters (audit_set_order.py): its ranks list them in
    different orders (each rank prints its own), and the run passes; where the order packs a
    flat buffer that is all-reduced, the gradients differ: a FAULT naming them."""
    found = []
    for name in ("set-order", "set-order-flat"):
        p = done[name]
        orders = {line.split(" order: ")[1] for line in p.stdout.splitlines() if " order: " in line}
        if len(orders) != 2 and os.environ.get("PYTHONHASHSEED", "random") == "random":
            found.append(f"{name}: the ranks' orders do not differ: {orders}\n{p.stdout[-2000:]}")
    ok, flat = done["set-order"], done["set-order-flat"]
    if ok.returncode != 0 or "replicas bitwise identical at every audited step" not in ok.stdout:
        found.append(f"set-order: not a pass (exit {ok.returncode})\n{ok.stdout[-3000:]}")
    # How many differ depends on the two orders (a parameter packed at the same offset on
    # both ranks is averaged right): at least one, each named with the rank that differs.
    head = "FIRST DIVERGENCE: gradients before step 0 (Lion): "
    named = re.search(r"\n  [\w.]+ on rank 1 vs rank 0: max \|diff\| ", flat.stdout)
    if flat.returncode != 1 or head not in flat.stdout or not named:
        found.append(f"set-order-flat: not the gradients named (exit {flat.returncode})\n"
                     f"{flat.stdout[-3000:]}")  # fmt: skip
    return found


def launcher_problems(out: Path) -> list[str]:
    """The set-ordered optimizer as its owner launches it, `audit -- torchrun ...`: each rank
    a fresh interpreter with its own hash seed, the orders apart, and a pass. What is wrong
    (none); the hog window's `set-order-torchrun` job too (tests/test_load.py)."""
    out.mkdir(parents=True, exist_ok=True)
    command = ["torchrun", "--standalone", "--nproc-per-node", "2",
               str(FIXTURES / "audit_set_order.py"), "ddp", str(out)]  # fmt: skip
    ran = run_main("audit", "--out", str(out), "--stall-timeout", "5", "--", *command)
    orders = {p.read_text() for p in out.glob("order.*")}
    found = []
    if len(orders) != 2 and os.environ.get("PYTHONHASHSEED", "random") == "random":
        found.append(f"torchrun: the ranks' orders do not differ: {orders}")
    if ran.returncode != 0 or "replicas bitwise identical at every audited step" not in ran.stdout:
        found.append(f"torchrun: not a pass (exit {ran.returncode})\n{ran.stdout[-3000:]}")
    return found


@pytest.mark.under_load
def test_a_set_ordered_optimizer_under_torchrun_passes(tmp_path):
    problems = launcher_problems(tmp_path)
    assert not problems, "\n".join(problems)


def log_problems(out: Path) -> list[str]:
    """c10d's INFO log, kept off the console, is not lost: it is in the rank's stderr file
    (of the cases `run_all` ran into `out`)."""
    stderr = next((out / "muon").glob("audit_*/rank0.stderr")).read_text()
    if "DDP Initialized with" in stderr and "broadcast_buffers: 1" in stderr:
        return []
    return [f"muon: c10d's INFO log is not in rank 0's stderr file:\n{stderr[-2000:]}"]


@pytest.mark.under_load
def test_script_verdicts(tmp_path):
    done = run_all(tmp_path)
    found = problems(done) + log_problems(tmp_path)
    assert not found, "\n\n".join(found)


# ------------------------------------------------------------ who holds the optimizer state


def _state(name: str, keys: list[str]) -> list[Entry]:
    return [Entry(report.STATE, f"{name} {k}", tensor=torch.ones(2)) for k in keys]


def _split_on_rank(ctx) -> tuple:
    """Four layouts of the state of three parameters, and the collectives each one costs."""
    group, r, n = SideGroup(), ctx.rank, ctx.world_size
    assert group.ready()
    calls: list[tuple[str, int]] = []
    for method in ("max", "sum", "gather_tensor", "broadcast"):
        original = getattr(group, method)

        def counted(values, *args, _original=original, _method=method):
            calls.append((_method, len(values)))
            return _original(values, *args)

        setattr(group, method, counted)
    names = ["a", "b", "c"]
    results = {}
    layouts = {
        # every rank its own parameter's momentum (owner = i % n), and "c"'s Adam state on all
        "owned": [_state("a", ["m"] if r == 0 else []), _state("b", ["m"] if r == 1 % n else []),
                  _state("c", ["exp_avg", "exp_avg_sq", "step"])],
        # the last rank lost a sibling: "c"'s exp_avg_sq
        "sibling": [[], [], _state("c", ["exp_avg", "step"] if r == n - 1 else
                                   ["exp_avg", "exp_avg_sq", "step"])],
        # "a" held by every rank but the last (an owner test that several ranks pass)
        "several": [_state("a", [] if r == n - 1 else ["m"]), [], []],
    }  # fmt: skip
    for name, per_param in layouts.items():
        calls.clear()
        held = owners.split(group, names, per_param)
        results[name] = (len(held.replicated), held.sharded, held.problem, list(calls))
    return results


@pytest.mark.parametrize("world", [2, 3])
def test_who_holds_the_state_is_decided_in_one_reduction_of_the_parameters_size(world):
    """Owned state (each parameter's on one rank) is counted, replicated state compared, and
    the same single all-reduce of 7 words per parameter decides it at 2 ranks and at 3: no
    gather unless something is wrong. A rank that lacks one entry its siblings have, and
    state held by several ranks but not all, are faults that name the ranks."""
    run = launch(_split_on_rank, world_size=world, timeout_s=120)
    assert run.ok, run.summary()
    got = run.values[0]
    assert all(v == got for v in run.values), run.values  # every rank decides alike
    replicated, sharded, problem, calls = got["owned"]
    assert (replicated, sharded, problem) == (3, 2, ""), got["owned"]
    assert calls == [("max", 7 * 3)], calls
    replicated, _, problem, _ = got["sibling"]
    assert replicated == 0 and f"rank {world - 1} lacks exp_avg_sq" in problem, problem
    assert "c's state (exp_avg, exp_avg_sq, step)" in problem, problem
    _, sharded, problem, _ = got["several"]
    if world == 2:  # all but the last is one rank: owned
        assert sharded == 1 and not problem, got["several"]
    else:
        held_by = ", ".join(map(str, range(world - 1)))
        assert f"a's state (m) is held by ranks {held_by}: rank {world - 1} holds none" in problem
