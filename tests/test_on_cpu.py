"""`--on-cpu` (verify/oncpu/): a script written for CUDA, rehearsed unmodified on CPU ranks,
gets the verdict its hand-edited CPU copy gets, idle and with every core busy.

The CUDA scripts (tests/fixtures/cuda_scripts/) are written the way public ones are: a
build-nanogpt-style GPT loop (bf16 autocast, micro-steps that sync on the last one, fused
AdamW), an llm.c-style one (argparse, float16 with a GradScaler, ZeRO-1), a pytorch/examples
DDP-series one (a Trainer class, a DistributedSampler, a snapshot loaded onto "this rank's
GPU"); each clean and with a bug of its own (an off-by-one sync flag, the lr scaled on the
master only, clipping on rank 0 only). The CPU copy is made here by the hand edits the issue
counts on twelve public scripts (`cpu_copy`), so both are real scripts and both really run.

Also: the mapping report names each call with its file:line and counts; a call that cannot
be mapped (a CUDA graph, also when the script catches the refusal and goes on) is one line,
exit 2, no verdict; without `--on-cpu` the CUDA script is still the one-line usage error,
now naming `--on-cpu`; `--on-cpu` beside a GPU placement is refused before any rank starts.
Each `--nproc` verdict is the real command run as `main()` in the test's process (its ranks
are the same fresh interpreters: tests/consoles.py); a refusal's, whose "no traceback" only
a real interpreter shows, and the launcher form's cases are the real command in a process of
its own. The verdicts under CPU hogs run in the
one hog window of tests/test_load.py (`loaded_problems`, `launcher_loaded_problems`).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from tests import test_launchers
from tests.consoles import run_main
from tests.processes import free_port, still_running
from tests.torchrun_jobs import one_node

ROOT = Path(__file__).resolve().parents[1]
CUDA = ROOT / "tests" / "fixtures" / "cuda_scripts"

# The hand edits that made twelve public DDP scripts run on a CPU (issue 30), as (pattern,
# replacement) over the script's lines; a removed statement becomes `pass` (a block may hold
# nothing else) on the same line, so the copy's line numbers are the script's.
EDITS = (
    (r"""f["']cuda:\{[^}]+\}["']""", '"cpu"'),  # cuda:{LOCAL_RANK} -> cpu (5 of 5)
    (r",\s*device_ids=\[[^\]]*\]", ""),  # DDP(model, device_ids=[...]) (5/5)
    (r"^(\s*)torch\.cuda\.set_device\(.*\)$", r"\1pass"),  # (5/5)
    (r"""(["'])nccl\1""", '"gloo"'),  # (4/5)
    (r"^(\s*)assert torch\.cuda\.is_available\(\).*$", r"\1pass"),  # (3/5)
    (r"^(\s*)torch\.cuda\.synchronize\(\)$", r"\1pass"),  # bare (2/5)
)

VERDICTS = {  # name -> (script, its arguments, the exit both runs must have)
    "gpt": ("gpt_train.py", (), 0),
    "gpt-accum-bug": ("gpt_train.py", ("accum-bug",), 1),
    "llmc": ("llmc_train.py", (), 0),
    "llmc-lr-bug": ("llmc_train.py", ("--lr_bug",), 1),
    "series": ("ddp_series_train.py", ("2", "{snapshot}"), 0),
    "series-clip": ("ddp_series_train.py", ("2", "{snapshot}", "clip-on-master"), 1),
}
UNDER_LOAD = ("gpt", "gpt-accum-bug", "series-clip")


def cpu_copy(script: Path, folder: Path) -> Path:
    """The script with the issue's hand edits (`EDITS`), written into `folder`."""
    lines = script.read_text().splitlines()
    for pattern, replacement in EDITS:
        lines = [re.sub(pattern, replacement, line) for line in lines]
    copy = folder / f"cpu_{script.name}"
    copy.write_text("\n".join(lines) + "\n")
    return copy


def snapshot(path: Path) -> str:
    """A snapshot of the DDP-series model as rank 0 saved it two epochs ago, for the
    script to resume from (a fresh copy a run: the script overwrites it)."""
    torch.manual_seed(5)
    model = torch.nn.Sequential(torch.nn.Linear(20, 16), torch.nn.BatchNorm1d(16),
                                torch.nn.ReLU(), torch.nn.Linear(16, 1))  # fmt: skip
    torch.save({"MODEL_STATE": model.state_dict(), "EPOCHS_RUN": 0}, path)
    return str(path)


def run_verify(*args: str, process: bool = False, env: dict[str, str | None] | None = None):
    """`python -m verify ARGS`, as `main()` in this process (tests/consoles.py: the ranks are
    the same fresh interpreters, no parent interpreter is started), or with `process` as a
    real command, its environment this one's changed by `env` (None: unset): a one-line
    refusal's "no traceback" is a real interpreter's to show."""
    if not process:
        return run_main(*args)
    changed = {**os.environ, "PYTHONPATH": str(ROOT), **(env or {})}
    env = {k: v for k, v in changed.items() if v is not None}
    argv = [sys.executable, "-m", "verify", *args]
    return subprocess.run(argv, env=env, capture_output=True, text=True, timeout=600, cwd=ROOT)


def audit(out: Path, script: Path, *args: str, on_cpu: bool = True, command: str = "audit",
          process: bool = False):  # fmt: skip
    """`python -m verify COMMAND --nproc 2 --json [--on-cpu] -- SCRIPT ARGS` (`run_verify`)."""
    args = [command, "--nproc", "2", "--json", "--out", str(out), "--stall-timeout", "5",
            *(["--on-cpu"] if on_cpu else []), "--", str(script), *args]  # fmt: skip
    # without --on-cpu: the CUDA script where there is no GPU, on a machine with GPUs too
    return run_verify(*args, process=process, env=None if on_cpu else {"CUDA_VISIBLE_DEVICES": ""})


def run_cases(tmp: Path, names, at_once: int = 4) -> dict:
    """Each named case as the CUDA script under --on-cpu and, for a buggy one, as its CPU
    copy too: where the copy's verdict is a fault, the rehearsal must find the same one at
    the same place. A clean script's rehearsal must pass (`verdict_problems`), which its
    copy's pass would not add to."""
    jobs = {}
    with ThreadPoolExecutor(max_workers=at_once) as pool:
        for name in names:
            script, args, want = VERDICTS[name]
            for arm in ("cuda", "cpu") if want else ("cuda",):
                folder = tmp / name / arm
                folder.mkdir(parents=True)
                at = [a.format(snapshot=snapshot(folder / "snapshot.pt")) for a in args]
                path = CUDA / script if arm == "cuda" else cpu_copy(CUDA / script, folder)
                jobs[name, arm] = pool.submit(audit, folder, path, *at, on_cpu=arm == "cuda")
        return {key: job.result() for key, job in jobs.items()}


def verdict(p: subprocess.CompletedProcess) -> tuple:
    """(exit, verdict, where the first divergence is) of one run."""
    try:
        doc = json.loads(p.stdout)
    except ValueError:
        return (p.returncode, None, None)
    faults = [f for f in (doc.get("audit") or {}).get("findings", ()) if f["fault"]]
    return (p.returncode, doc["verdict"], faults[0]["where"] if faults else None)


def verdict_problems(done: dict, names) -> list[str]:
    found = []
    for name in names:
        want = VERDICTS[name][2]
        cpu = verdict(done[name, "cpu"]) if (name, "cpu") in done else (0, "pass", None)
        cuda = verdict(done[name, "cuda"])
        if cuda != cpu or cuda[0] != want:
            tail = "".join(done[name, arm].stderr[-2500:] for arm in ("cuda", "cpu")
                           if (name, arm) in done)  # fmt: skip
            found.append(f"{name}: --on-cpu {cuda}, CPU copy {cpu}, want exit {want}\n{tail}")
    return found


def line_of(script: str, text: str) -> int:
    """The line of `script` that holds `text` (the fixture's, not a number written twice)."""
    lines = (CUDA / script).read_text().splitlines()
    return next(i for i, line in enumerate(lines, 1) if text in line)


def test_cuda_scripts_get_their_cpu_copies_verdicts(tmp_path):
    """The cases the hog window does not run (`UNDER_LOAD` and the mapping report:
    `test_the_cases_under_load_and_the_mapping_report`)."""
    names = [name for name in VERDICTS if name not in UNDER_LOAD]
    problems = verdict_problems(run_cases(tmp_path, names), names)
    assert not problems, "\n\n".join(problems)
    assert not still_running(tmp_path), "a rank left running"


@pytest.mark.under_load
def test_the_cases_under_load_and_the_mapping_report(tmp_path):
    problems = loaded_problems(tmp_path, at_once=4)
    assert not problems, "\n\n".join(problems)


def mapping_problems(done: dict) -> list[str]:
    """What is wrong with the mapping report of the nanoGPT-style script (each call, its
    line, how many times on each rank; each rank's own report file), and of its CPU copy
    (none: it maps nothing)."""
    doc = json.loads(done["gpt", "cuda"].stdout)
    sites = {(m["call"], m["where"]): m["per_rank"] for m in doc["on_cpu"]["mapped"]}
    at = lambda text: f"tests/fixtures/cuda_scripts/gpt_train.py:{line_of('gpt_train.py', text)}"  # noqa: E731
    steps, micro = 4, 2  # max_steps; grad_accum_steps at 2 ranks
    expected = {
        ("torch.cuda.set_device()", at("torch.cuda.set_device(device)")): 1,
        ("init_process_group(backend='nccl')", at('backend="nccl"')): 1,
        ("DDP(device_ids=...)", at("device_ids=[ddp_local_rank]")): 1,
        ("Module.to(cuda)", at("model.to(device)")): 1,
        ("torch.Generator(device=cuda)", at("torch.Generator(device=device)")): 1,
        ("torch.cuda.is_available()", at("assert torch.cuda.is_available()")): 1,
        ("Tensor.to(cuda)", at("x, y = x.to(device), y.to(device)")): 2 * steps * micro,
        ("autocast(cuda, bfloat16)", at("torch.autocast(device_type")): steps * micro,
        ("torch.cuda.synchronize()", at("torch.cuda.synchronize()")): steps,
    }
    found = [
        f"{key}: {sites.get(key)} (want {n} on each rank; mapped: {sorted(sites)})"
        for key, n in expected.items()
        if sites.get(key) != {"0": n, "1": n}
    ]
    report_dir = Path(doc["report_dir"])
    for r in (0, 1):  # each rank's own report file
        mine = json.loads((report_dir / f"rank{r}.on_cpu.json").read_text())
        if mine["rank"] != r or mine["refused"] is not None or len(mine["mapped"]) != len(sites):
            found.append(f"rank{r}.on_cpu.json: {mine}")
    # the CPU copy maps nothing and says so by having no report
    if json.loads(done["gpt-accum-bug", "cpu"].stdout)["on_cpu"] is not None:
        found.append("the CPU copy of gpt_train.py has a mapping report")
    return found


def loaded_problems(tmp: Path, at_once: int = 2) -> list[str]:
    """`UNDER_LOAD`'s cases, each as a CUDA script under --on-cpu and as its CPU copy, and
    the mapping report (`mapping_problems`), for the hog window of tests/test_load.py: what
    is wrong, and any rank left running."""
    tmp.mkdir(parents=True, exist_ok=True)
    done = run_cases(tmp, UNDER_LOAD, at_once=at_once)
    problems = verdict_problems(done, UNDER_LOAD)
    if not problems:  # (a run that failed has no report to read)
        problems = mapping_problems(done)
    left = still_running(tmp)
    return problems + ([f"ranks left running: {left}"] if left else [])


def test_what_cannot_be_mapped_is_one_line_and_no_verdict(tmp_path):
    """A CUDA graph: exit 2 and one line naming the call and its line, whether the script dies
    of the refusal or catches it and trains on; without --on-cpu the CUDA script is the
    usage error it was, naming --on-cpu; and `hang --on-cpu` rehearses as `audit` does."""
    script = CUDA / "graphed_train.py"
    with ThreadPoolExecutor(max_workers=3) as pool:
        runs = {
            "graph": pool.submit(audit, tmp_path / "a", script, "graph", process=True),
            "fallback": pool.submit(audit, tmp_path / "b", script, "fallback", process=True),
            "plain": pool.submit(
                audit, tmp_path / "c", CUDA / "gpt_train.py", on_cpu=False, process=True
            ),
            "hang": pool.submit(
                audit,
                tmp_path / "d",
                CUDA / "ddp_series_train.py",
                "1",
                str(tmp_path / "none.pt"),
                command="hang",
            ),  # fmt: skip
        }
        done = {name: job.result() for name, job in runs.items()}
    line = line_of("graphed_train.py", "torch.cuda.CUDAGraph()")
    for name in ("graph", "fallback"):
        p = done[name]
        assert p.returncode == 2, (name, p.returncode, p.stderr[-3000:])
        said = [s for s in p.stderr.splitlines() if s.startswith("verify: error:")]
        assert len(said) == 1 and f"graphed_train.py:{line}: `torch.cuda.CUDAGraph`" in said[0]
        assert "--on-cpu cannot rehearse" in said[0] and "Traceback" not in p.stderr + p.stdout
        assert not p.stdout.strip(), "no verdict document"
    plain = done["plain"]
    assert plain.returncode == 2 and plain.stderr.count("\n") == 1, plain.stderr[-3000:]
    assert f"gpt_train.py:{line_of('gpt_train.py', 'assert torch.cuda')}: `assert torch.cuda" in (
        plain.stderr
    )
    assert "with --on-cpu" in plain.stderr and "Traceback" not in plain.stderr
    hang = done["hang"]
    doc = json.loads(hang.stdout)
    assert hang.returncode == 0 and doc["verdict"] == "pass", hang.stderr[-3000:]
    calls = {m["call"] for m in doc["on_cpu"]["mapped"]}
    assert {"torch.cuda.set_device()", "init_process_group(backend='nccl')"} <= calls, calls


@pytest.mark.parametrize(
    "argv, said",
    [
        (["hang", "--nproc", "2", "--on-cpu", "--device", "cuda"], "--device cuda runs it on GPUs"),
        (["audit", "--nproc", "2", "--on-cpu", "--backend", "nccl"], "--backend nccl needs GPUs"),
        (["hang", "--impl", "naive", "--on-cpu"], "--on-cpu applies to a script"),
    ],
)
def test_on_cpu_beside_a_gpu_placement_is_refused(argv, said):
    """In-process: refused while the arguments are read, before anything starts (the real
    interpreter's view of such a refusal is the `graph`/`plain` cases' above)."""
    script = str(CUDA / "gpt_train.py")
    tail = ["--", script] if "--impl" not in argv else []
    p = run_main(*argv, *tail)
    assert p.returncode == 2 and p.stderr.count("\n") == 1 and said in p.stderr, p.stderr


def test_each_cuda_call_has_a_cpu_stand_in():
    """The calls of the brief, one by one, in a process of their own with the rehearsal
    installed (no ranks: the calls that need a group are the verdict tests' above)."""
    probe = CUDA / "cuda_calls.py"
    code = (
        "import os, runpy, sys, verify.oncpu as o\n"
        "r = o.install(sys.argv[1], 0)\n"
        "print('GPUs hidden:', repr(os.environ['CUDA_VISIBLE_DEVICES']))\n"
        "runpy.run_path(sys.argv[2], run_name='__main__')\n"
        "r.finish()\n"
    )
    out = Path(os.environ.get("TMPDIR", "/tmp")) / f"on_cpu_calls_{os.getpid()}.json"
    # as on a GPU machine: the rehearsal hides its GPUs, so torch never reaches one
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "LOCAL_WORLD_SIZE": "4",
        "CUDA_VISIBLE_DEVICES": "0",
    }
    p = subprocess.run([sys.executable, "-c", code, str(out), str(probe)], env=env,
                       capture_output=True, text=True, timeout=120, cwd=ROOT)  # fmt: skip
    assert p.returncode == 0, p.stderr[-3000:]
    assert "all calls ran" in p.stdout and "GPUs hidden: ''" in p.stdout, p.stdout
    mapped = json.loads(out.read_text())
    out.unlink()
    calls = {m["call"] for m in mapped["mapped"]}
    assert {"Tensor.pin_memory()", "torch.cuda.Event()", "default device cuda",
            "GradScaler(cuda)", "autocast(cuda, float16)"} <= calls, calls  # fmt: skip
    assert mapped["refused"] is None


def test_a_torchrun_job_is_rehearsed_under_verify_audit_run(tmp_path):
    """`torchrun ... -m verify.audit_run --on-cpu gpt_train.py accum-bug`: the same rehearsal
    in a rank torchrun started (`script_main`), the same fault as under --nproc, and rank 0
    prints what its rank mapped."""
    node = one_node(tmp_path, "--on-cpu", str(CUDA / "gpt_train.py"), "accum-bug",
                    module="verify.audit_run")  # fmt: skip
    assert node.returncode != 0 and not node.leftover, node.stderr[-3000:]
    text = node.stdout + node.stderr
    assert "REPLICAS DIVERGED: first at" in text, text[-3000:]
    line = line_of("gpt_train.py", "torch.cuda.set_device(device)")
    assert f"gpt_train.py:{line}: torch.cuda.set_device() -> no-op (1x)" in text, text[-3000:]
    assert "on-cpu: CUDA calls mapped to the CPU on rank 0" in text


def test_torch_compile_is_left_to_torch():
    """torch.compile under the rehearsal: torch asking torch.cuda gets the CPU build's
    answers, so inductor compiles for the CPU (told it had a GPU, it failed planning for
    one)."""
    code = (
        "import runpy, sys, verify.oncpu as o\n"
        "o.install(None, 0)\n"
        "runpy.run_path(sys.argv[1], run_name='__main__')\n"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    p = subprocess.run([sys.executable, "-c", code, str(CUDA / "compiled_step.py")], env=env,
                       capture_output=True, text=True, timeout=600, cwd=ROOT)  # fmt: skip
    assert p.returncode == 0 and "compiled ok torch.bfloat16 torch" in p.stdout, p.stderr[-3000:]


def test_the_cost_benchmark_decides_against_its_goal(capsys):
    """benchmarks/on_cpu_cost.py (a maintainer's script, run through its `main`), tiny: both
    arms timed every round, the rehearsed one really mapped calls, and the paired ratio has
    an interval and one of the three decisions."""
    from benchmarks import on_cpu_cost

    assert on_cpu_cost.main(["--width", "16", "--repeats", "2", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["verdict"] == "pass" and len(doc["plain_s"]) == len(doc["on_cpu_s"]) == 2
    assert doc["sites_mapped"] >= 3  # x.to(device), the autocast, synchronize()
    bar = doc["bar"]
    assert bar["goal"] == 1.02 and bar["low"] <= bar["value"] <= bar["high"], bar
    assert bar["decision"] in ("met", "missed", "undecided")


# --on-cpu with the launcher form (`audit --on-cpu -- torchrun ...`, `-- python x.py` that
# calls mp.spawn): the rehearsal is installed at each process's import of torch
# (verify/launching/bootstrap/), its report named by the rank at init_process_group.

# Written for this test the way pytorch/examples' multigpu.py is: mp.spawn over the GPUs
# torch.cuda.device_count() finds, `model.to(rank)`, NCCL; BUG clips on rank 0 only.
SPAWN_CUDA = """
import os
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

PORT = sys.argv[1]
BUG = sys.argv[2:] == ["bug"]


def setup(rank, world_size):
    os.environ["MASTER_ADDR"] = "localhost"
    os.environ["MASTER_PORT"] = PORT
    torch.cuda.set_device(rank)
    dist.init_process_group(backend="nccl", rank=rank, world_size=world_size)


def train(rank, world_size):
    setup(rank, world_size)
    torch.manual_seed(0)
    model = DDP(nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2)).to(rank),
                device_ids=[rank])
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for epoch in range(3):
        x = torch.randn(4, 8, device=f"cuda:{rank}") + rank
        y = torch.randn(4, 2).pin_memory().to(rank, non_blocking=True)
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        if BUG and rank == 0:  # "keep the logged rank stable"
            nn.utils.clip_grad_norm_(model.parameters(), 0.01)
        opt.step()
        torch.cuda.synchronize()
    dist.destroy_process_group()


if __name__ == "__main__":
    assert torch.cuda.is_available()
    world_size = torch.cuda.device_count()
    mp.spawn(train, args=(world_size,), nprocs=world_size)
"""


def launched(out: Path, *command: str):
    """`python -m verify audit --on-cpu --json -- COMMAND` (`run_verify`): in this process (the
    launcher and its ranks are the command's fresh interpreters; the tool's is not needed),
    but where CUDA_VISIBLE_DEVICES names GPUs (a GPU runner's), in a process of its own
    without it: the rehearsed node has 2 GPUs (`script_start.rehearsed_gpus`), whatever this
    one sees."""
    args = ("audit", "--on-cpu", "--json", "--out", str(out), "--stall-timeout", "5", "--",
            *command)  # fmt: skip
    gpus = bool(os.environ.get("CUDA_VISIBLE_DEVICES"))
    return run_verify(*args, process=gpus, env={"CUDA_VISIBLE_DEVICES": None})


def launcher_on_cpu_problems(tmp: Path, at_once: int = 3) -> list[str]:
    """torchrun of the nanoGPT-style script, clean and with its sync bug, against the bug's
    verdict under `--nproc 2 --on-cpu`; a fresh mp.spawn CUDA script clean and buggy. The
    problems found (none: the verdicts of --nproc, the mapping reported per rank)."""
    gpt = str(CUDA / "gpt_train.py")
    spawn = tmp / "spawn_cuda.py"
    spawn.write_text(SPAWN_CUDA)
    torchrun = ("torchrun", "--standalone", "--nproc-per-node", "2", gpt)
    runs = {
        "torchrun-ok": lambda: launched(tmp / "t-ok", *torchrun),
        "torchrun-bug": lambda: launched(tmp / "t-bug", *torchrun, "accum-bug"),
        "nproc-bug": lambda: audit(tmp / "n-bug", CUDA / "gpt_train.py", "accum-bug"),
        "spawn-ok": lambda: launched(tmp / "s-ok", sys.executable, str(spawn), str(free_port())),
        "spawn-bug": lambda: launched(
            tmp / "s-bug", sys.executable, str(spawn), str(free_port()), "bug"
        ),
    }
    with ThreadPoolExecutor(max_workers=at_once) as pool:
        jobs = {name: pool.submit(run) for name, run in runs.items()}
        done = {name: job.result() for name, job in jobs.items()}
    got = {name: verdict(p) for name, p in done.items()}
    want = {
        "torchrun-ok": (0, "pass", None),
        "torchrun-bug": got["nproc-bug"],
        "spawn-ok": (0, "pass", None),
        "spawn-bug": (1, "fault", "gradients before step 0 (SGD)"),
    }
    problems = [
        f"{name}: {got[name]}, want {w}\n{done[name].stderr[-2500:]}"
        for name, w in want.items()
        if got[name] != w
    ]
    if got["nproc-bug"][:2] != (1, "fault"):
        problems.append(f"--nproc accum-bug: {got['nproc-bug']}")
    for name in ("torchrun-ok", "spawn-bug"):  # the mapping, each rank's own
        if got[name][1] is None:
            continue
        doc = json.loads(done[name].stdout)
        mapped = {(m["call"], m["to"]): m["per_rank"] for m in doc["on_cpu"]["mapped"]}
        if mapped.get(("init_process_group(backend='nccl')", "gloo")) != {"0": 1, "1": 1}:
            problems.append(f"{name}: mapped {sorted(mapped)}")
        for r in (0, 1):
            mine = json.loads((Path(doc["report_dir"]) / f"rank{r}.on_cpu.json").read_text())
            if mine["rank"] != r or mine["refused"] is not None:
                problems.append(f"{name}: rank{r}.on_cpu.json: {mine}")
    spawned = (
        json.loads(done["spawn-bug"].stdout)["on_cpu"]["mapped"] if got["spawn-bug"][1] else []
    )
    if "Module.to(cuda)" not in {m["call"] for m in spawned}:  # `.to(rank)`: an ordinal
        problems.append(f"spawn-bug: model.to(rank) not mapped: {spawned}")
    return problems


@pytest.mark.under_load
def test_the_launcher_form_is_rehearsed_on_cpu(tmp_path):
    """`audit --on-cpu -- torchrun ... gpt_train.py` gets the verdict of `--nproc 2
    --on-cpu`, with the mapping per rank; a CUDA script that calls mp.spawn over
    `torch.cuda.device_count()` GPUs runs on two CPU ranks, its bug named."""
    problems = launcher_on_cpu_problems(tmp_path)
    assert not problems, "\n\n".join(problems)
    assert not still_running(tmp_path), "a rank left running"


def _loaded(problems_of, tmp: Path) -> list[str]:
    """`problems_of(tmp)`, two cases at a time, and any rank left running: a job of the hog
    window of tests/test_load.py."""
    tmp.mkdir(parents=True, exist_ok=True)
    problems = problems_of(tmp, at_once=2)
    left = still_running(tmp)
    return problems + ([f"ranks left running: {left}"] if left else [])


def launcher_loaded_problems(tmp: Path) -> list[str]:
    return _loaded(launcher_on_cpu_problems, tmp)


@pytest.mark.parametrize(
    ("script", "edit", "launch", "first"),
    [  # the launchers' buggy fixtures, written for GPUs: the CPU runs' findings
        ("lightning_buggy.py", ('accelerator="cpu"', 'accelerator="gpu"'), "python",
         ("parameters after step {step}", "layer.weight", 1)),
        ("accelerate_buggy.py", ("Accelerator(cpu=True)", "Accelerator()"), "accelerate",
         ("parameters before step {step} (the first audited)", "2.bias", 0)),
    ],
)  # fmt: skip
def test_accelerate_and_lightning_are_rehearsed_on_cpu(tmp_path, script, edit, launch, first):
    source = (ROOT / test_launchers.FIXTURES / script).read_text()
    assert edit[0] in source
    cuda = tmp_path / script
    cuda.write_text(source.replace(edit[0], edit[1]))
    if launch == "python":
        command = [sys.executable, str(cuda)]
    else:
        command = [*test_launchers.accelerate(script)[:-1], str(cuda)]
    ran = launched(tmp_path / "out", *command)
    doc = json.loads(ran.stdout)
    assert (ran.returncode, doc["verdict"]) == (1, "fault"), ran.stderr[-3000:]
    found = doc["audit"]["findings"][0]
    assert (found["phase"], found["tensor"], found["step"]) == first, found
    assert found["ranks"] == [1]
    calls = {m["call"] for m in doc["on_cpu"]["mapped"]}
    assert "init_process_group(backend='nccl')" in calls, calls


# torch.accelerator, the device-generic API current scripts ask instead of torch.cuda
# (verify/oncpu/accelerator_api.py): tests/fixtures/cuda_scripts/accelerator_train.py is
# written the way pytorch/examples' distributed scripts now are. LEAVES is a script that asks
# which device it has, and leaves, as those do, when it counts too few GPUs: before any rank
# joins, so no verdict; the line says the rehearsal was on, what it mapped and what it did not.
ACCELERATOR = CUDA / "accelerator_train.py"
LEAVES = """
import sys

import torch

if torch.backends.mps.is_available():
    device = "mps"
elif torch.accelerator.is_available():
    device = torch.accelerator.current_accelerator().type
else:
    device = "cpu"
wanted = int(sys.argv[1])
if torch.accelerator.device_count() < wanted:
    print(f"Unable to locate sufficient {wanted} gpus on {device} to run this example. Exiting.")
    sys.exit(0)
"""


def test_the_left_early_clause_says_what_was_mapped_and_what_was_not():
    """In-process, the clause of the line a rehearsed script that left before joining gets
    (`oncpu/report.py`), fed sites as the ranks' files give them."""
    from verify.oncpu.report import left_early

    site = lambda call, what, line, key="to": {"call": call, key: what, "where": f"x.py:{line}"}  # noqa: E731
    cases = [
        ([], [], "--on-cpu was on, and mapped no CUDA call"),
        ([site("torch.accelerator.device_count()", "2", 9)], [],
         "--on-cpu was on: it mapped torch.accelerator.device_count() -> 2 at x.py:9"),
        ([site("torch.accelerator.is_available()", "True", 5)],
         [site("torch.backends.mps.is_available()", "False", 4, key="answer")],
         "--on-cpu was on: it mapped torch.accelerator.is_available() -> True at x.py:5; the "
         "script asked, unmapped (a CPU machine's answer): torch.backends.mps.is_available() "
         "-> False at x.py:4"),
        ([site(f"c{i}()", "0", i) for i in range(8)], [],
         "--on-cpu was on: it mapped " + ", ".join(f"c{i}() -> 0 at x.py:{i}" for i in range(6))
         + ", and 2 more"),
    ]  # fmt: skip
    for mapped, unmapped, said in cases:
        assert left_early(mapped, unmapped) == said


def accelerator_problems(tmp: Path, at_once: int = 3) -> list[str]:
    """accelerator_train.py under `audit --on-cpu --nproc 2` clean and with its no_sync bug,
    under `-- torchrun` clean; LEAVES under both forms. What is wrong (nothing: the verdicts,
    the torch.accelerator calls mapped at their lines, the line of a script that left)."""
    leaves = tmp / "leaves.py"
    leaves.write_text(LEAVES)
    torchrun = ("torchrun", "--standalone", "--nproc-per-node", "2")
    text = lambda out, *tail: run_verify("audit", "--on-cpu", "--out", str(out), "--stall-timeout",  # noqa: E731
                                         "5", *tail)  # fmt: skip
    runs = {
        "nproc-ok": lambda: audit(tmp / "n-ok", ACCELERATOR),
        "nproc-bug": lambda: audit(tmp / "n-bug", ACCELERATOR, "--bug"),
        "torchrun-ok": lambda: launched(tmp / "t-ok", *torchrun, str(ACCELERATOR)),
        "nproc-leaves": lambda: text(tmp / "n-leaves", "--nproc", "2", "--", str(leaves), "4"),
        "torchrun-leaves": lambda: text(tmp / "t-leaves", "--", *torchrun, str(leaves), "4"),
    }
    with ThreadPoolExecutor(max_workers=at_once) as pool:
        jobs = {name: pool.submit(run) for name, run in runs.items()}
        done = {name: job.result() for name, job in jobs.items()}
    problems = []
    for name in ("nproc-ok", "nproc-bug", "torchrun-ok"):
        got, want = verdict(done[name]), (1, "fault") if name == "nproc-bug" else (0, "pass")
        if got[:2] != want or (name == "nproc-bug" and "before step 0" not in str(got[2])):
            problems.append(f"{name}: {got}, want {want}\n{done[name].stderr[-2500:]}")
            continue
        mapped = {
            (m["call"], m["where"]) for m in json.loads(done[name].stdout)["on_cpu"]["mapped"]
        }
        for call, text_at in (("current_accelerator()", "current_accelerator()"),
                              ("set_device_index()", "set_device_index(local_rank)"),
                              ("synchronize()", "accelerator.synchronize()"),
                              ("max_memory_allocated()", "max_memory_allocated()")):  # fmt: skip
            at = f"tests/fixtures/cuda_scripts/accelerator_train.py:{line_of('accelerator_train.py', text_at)}"
            if (f"torch.accelerator.{call}", at) not in mapped:
                problems.append(f"{name}: torch.accelerator.{call} at {at} not in {sorted(mapped)}")
    asked = "torch.backends.mps.is_available() -> False at "
    for name, head in (
        ("nproc-leaves", "NOTHING AUDITED: "),
        ("torchrun-leaves", "verify: error: nothing joined"),
    ):
        p = done[name]
        said = [line for line in (p.stdout + p.stderr).splitlines() if line.startswith(head)]
        if p.returncode != 2 or len(said) != 1:
            problems.append(f"{name}: exit {p.returncode}, lines {said}\n{p.stderr[-2500:]}")
            continue
        for part in ("--on-cpu was on: it mapped torch.accelerator.is_available() -> True at ",
                     "torch.accelerator.device_count() -> 2 at ", asked):  # fmt: skip
            if part not in said[0]:
                problems.append(f"{name}: {part!r} not in {said[0]!r}")
    return problems


@pytest.mark.under_load
def test_a_script_that_asks_torch_accelerator_is_rehearsed(tmp_path):
    problems = accelerator_problems(tmp_path)
    assert not problems, "\n\n".join(problems)
    assert not still_running(tmp_path), "a rank left running"


def accelerator_loaded_problems(tmp: Path) -> list[str]:
    return _loaded(accelerator_problems, tmp)
