"""The interfaces a user's class may have: a bucket size by
`bucket_size_mb` or `bucket_cap_mb` (or none, `None` meaning one unbounded bucket), a file
that imports its own package, and a constructor checked against what the tool will pass,
refused in one line before any rank starts.

Single-process and fast, except one spawned gloo run of `bucket_size_mb=None` and one CLI run
of a class that imports its own package: the ranks import it again, by the same route, so only
a real run shows that the route works.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.optim import ZeroRedundancyOptimizer

from impls.planning import ParamInfo, plan_buckets
from impls.registry import (
    Implementation,
    ImplError,
    from_class,
    interface_problem,
    resolve,
    takes_bucket_size,
)
from verify.checks import cells
from verify.cli import main
from verify.launching import launch

ROOT = Path(__file__).resolve().parent.parent

# --- bucket sizes --------------------------------------------------------------------------


class _SizeMB(nn.Module):
    def __init__(self, module, bucket_size_mb=25.0):
        super().__init__()
        self.got = bucket_size_mb


class _CapMB(nn.Module):
    def __init__(self, module, *, bucket_cap_mb=25.0):
        super().__init__()
        self.got = bucket_cap_mb


class _Both(nn.Module):
    def __init__(self, module, bucket_cap_mb=1.0, bucket_size_mb=2.0):
        super().__init__()
        self.got = (bucket_cap_mb, bucket_size_mb)


class _Kwargs(nn.Module):
    def __init__(self, module, **kwargs):
        super().__init__()
        self.got = kwargs


def test_takes_bucket_size_names_the_keyword():
    assert takes_bucket_size(_SizeMB) == "bucket_size_mb"
    assert takes_bucket_size(_CapMB) == "bucket_cap_mb"
    assert takes_bucket_size(_Both) == "bucket_size_mb"  # the course's name wins
    assert takes_bucket_size(_Kwargs) is None  # **kwargs claims nothing about buckets
    assert takes_bucket_size(nn.parallel.DistributedDataParallel) == "bucket_cap_mb"
    assert cells.takes_bucket_size(nn.parallel.DistributedDataParallel)
    assert cells.takes_bucket_size(_CapMB) and not cells.takes_bucket_size(_Kwargs)


def test_a_bucket_cap_mb_class_gets_the_bucket_size():
    model = nn.Linear(2, 2)
    assert from_class(_CapMB, name="cap").wrap(model, bucket_size_mb=0.75).got == 0.75
    assert from_class(_SizeMB, name="size").wrap(model, bucket_size_mb=0.75).got == 0.75
    assert from_class(_Both, name="both").wrap(model, bucket_size_mb=0.75).got == (1.0, 0.75)
    assert from_class(_Kwargs, name="kw").wrap(model, bucket_size_mb=0.75).got == {}


def test_no_bucket_cap_plans_one_bucket_per_device_and_dtype():
    f32, bf16 = ("cpu", torch.float32), ("cpu", torch.bfloat16)
    params = [ParamInfo(3 << 20, f32), ParamInfo(100, bf16), ParamInfo(5 << 20, f32)]
    params += [ParamInfo(7, bf16)]
    plan = plan_buckets(params, None)
    assert sorted(sorted(b) for b in plan) == [[0, 2], [1, 3]]
    assert plan_buckets(params[:1], None) == [[0]] and plan_buckets([], None) == []
    with pytest.raises(ValueError, match="must be > 0 or None"):
        plan_buckets(params, 0)


def rank_unbounded_buckets(ctx) -> tuple[list[int], list[int], list[float]]:
    """Bucketed, zero1 and a bucket-taking hang scenario, all with bucket_size_mb=None."""
    from verify.training.workloads import get_workload

    counts = []
    for workload_name in ("mlp", "mixed"):
        workload = get_workload(workload_name)
        torch.manual_seed(ctx.rank)
        model = workload.build()
        wrapped = resolve("bucketed").wrap(model, bucket_size_mb=None)
        counts.append(len(wrapped.buckets))
        batch = workload.batch(1, ctx.world_size).shard(ctx.rank, ctx.world_size)
        workload.loss(wrapped, batch).backward()
        wrapped.finish_gradient_synchronization()
    zero = resolve("zero1").wrap(get_workload("mlp").build(), bucket_size_mb=None)
    hang = resolve("hang:bucket-order").wrap(get_workload("mlp").build(), bucket_size_mb=None)
    sums = [float(sum(p.grad.double().sum() for p in model.parameters() if p.grad is not None))]
    dist.barrier()
    return counts, [len(zero.buckets), len(hang.buckets) > 1], sums


def test_builtins_take_no_bucket_cap_as_one_bucket_per_dtype():
    run = launch(rank_unbounded_buckets, world_size=2, timeout_s=120)
    assert run.ok, run.summary()
    (counts, others, sums), (_, _, sums1) = run.values
    mixed_dtypes = len({p.dtype for p in _workload_params("mixed")})
    assert counts == [1, mixed_dtypes] and mixed_dtypes == 3
    assert others == [1, True]  # zero1's DDP: one bucket; the scenario keeps its small ones
    assert sums == sums1  # the one big bucket was averaged: replicas hold the same gradients


def _workload_params(name):
    from verify.training.workloads import get_workload

    return list(get_workload(name).build().parameters())


# --- user classes that live in a package ---------------------------------------------------


def _package(root: Path, name: str, style: str) -> Path:
    """root/name/{__init__,util}.py and root/name/sub/{__init__,ddp}.py, whose ddp.py imports
    the package's util absolutely or relatively; returns the path of ddp.py."""
    _write(root / name / "__init__.py", "")
    _write(root / name / "util.py", "SCALE = 1.0\n")
    _write(root / name / "sub" / "__init__.py", "")
    imports = {
        "absolute": f"from {name}.util import SCALE\n",
        "relative": "from ..util import SCALE\nfrom . import helper\n",
    }[style]
    _write(root / name / "sub" / "helper.py", "HELP = 1\n")
    body = _DDP.format(name="PkgDDP", sig="module, bucket_size_mb=25.0")
    return _write(root / name / "sub" / "ddp.py", imports + body)


@pytest.mark.parametrize("style", ["absolute", "relative"])
def test_a_user_file_that_imports_its_own_package_resolves(tmp_path, monkeypatch, style):
    monkeypatch.setattr(sys, "path", list(sys.path))  # the loader adds the package root
    name = f"regpkg_{style}_{abs(hash(str(tmp_path))) % 10**8}"
    path = _package(tmp_path, name, style)
    try:
        impl = resolve(f"{path}:PkgDDP")
        assert impl.kind == "user" and impl.cls.__module__ == f"{name}.sub.ddp"
        assert str(tmp_path) in sys.path
    finally:
        for module in [m for m in sys.modules if m == name or m.startswith(name + ".")]:
            del sys.modules[module]


def test_a_package_shadowed_by_another_of_the_same_name_is_refused(tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "path", list(sys.path))
    name = f"regpkg_twin_{abs(hash(str(tmp_path))) % 10**8}"
    first = _package(tmp_path / "a", name, "absolute")
    second = _package(tmp_path / "b", name, "absolute")
    try:
        resolve(f"{first}:PkgDDP")
        with pytest.raises(ImplError, match=f"another package named '{name}' comes first"):
            resolve(f"{second}:PkgDDP")
    finally:
        for module in [m for m in sys.modules if m == name or m.startswith(name + ".")]:
            del sys.modules[module]


def test_an_import_error_inside_a_package_is_one_line(tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "path", list(sys.path))
    name = f"regpkg_bad_{abs(hash(str(tmp_path))) % 10**8}"
    _write(tmp_path / name / "__init__.py", "")
    path = _write(tmp_path / name / "ddp.py", "from .missing import nothing\n")
    with pytest.raises(ImplError) as e:
        resolve(f"{path}:X")
    message = str(e.value)
    assert "\n" not in message
    assert f"importing it as {name}.ddp (from {tmp_path}) failed: ModuleNotFoundError" in message


def test_the_cli_trains_a_package_member_on_two_ranks(run_cli, tmp_path):
    """The ranks (forked from a zygote that never saw the package) import the class again by
    the same route: the real proof it works."""
    path = _package(tmp_path, f"regpkg_cli_{abs(hash(str(tmp_path))) % 10**8}", "relative")
    proc = run_cli("consistency", "--impl", f"{path}:PkgDDP", "--steps", "1", "--bucket-mb", "0.75")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "PASS" in proc.stdout


# --- the interface check -------------------------------------------------------------------


class _NeedsGroup(nn.Module):
    def __init__(self, module, process_group):
        super().__init__()


class _TakesOnlyParams(torch.optim.Optimizer):
    def __init__(self, params):
        super().__init__(params, {})


class _NeedsLr(torch.optim.Optimizer):
    def __init__(self, params, optimizer_cls, lr):
        super().__init__(params, {})


class _NoMomentum(torch.optim.Optimizer):
    def __init__(
        self, params, optimizer_cls, lr=1e-3, weight_decay=0.0, betas=(0.9, 0.99), eps=1e-8
    ):
        super().__init__(params, {})


class _AnyDefaults(torch.optim.Optimizer):
    def __init__(self, params, optimizer_cls, **defaults):
        super().__init__(params, {})


DDP_SAYS = (
    "the tool constructs a DDP wrapper as Cls(module) or Cls(module, bucket_size_mb=...) "
    "(or bucket_cap_mb=...) (see docs/verify-your-own-ddp.md)"
)
OPT_SAYS = "the tool constructs a sharded optimizer as Cls(params, optimizer_cls, **defaults)"


@pytest.mark.parametrize(
    "cls, message",
    [
        (
            _NeedsGroup,
            "--impl 'x.py:C': _NeedsGroup(module) cannot be called: missing a required "
            f"argument: 'process_group'; {DDP_SAYS}",
        ),
        (
            _TakesOnlyParams,
            "--impl 'x.py:C': _TakesOnlyParams(params, optimizer_cls) cannot be called: too "
            f"many positional arguments; {OPT_SAYS}",
        ),
        (
            _NeedsLr,
            "--impl 'x.py:C': _NeedsLr(params, optimizer_cls) cannot be called: missing a "
            f"required argument: 'lr'; {OPT_SAYS}",
        ),
        (
            _NoMomentum,
            "--impl 'x.py:C': _NoMomentum(params, optimizer_cls, lr=..., momentum=...) cannot "
            f"be called: got an unexpected keyword argument 'momentum'; {OPT_SAYS}",
        ),
    ],
)
def test_an_interface_mismatch_is_named_in_one_line(cls, message):
    problem = interface_problem(from_class(cls, name="x.py:C"))
    assert problem is not None and "\n" not in problem
    assert problem.startswith(message), problem


@pytest.mark.parametrize(
    "cls",
    [
        _SizeMB,
        _CapMB,
        _Kwargs,
        _AnyDefaults,
        nn.parallel.DistributedDataParallel,
        ZeroRedundancyOptimizer,
    ],
)
def test_the_promised_interfaces_pass_the_check(cls):
    assert interface_problem(from_class(cls, name="c")) is None


def test_recipes_without_a_class_are_not_checked():
    assert interface_problem(Implementation("x", "x", lambda module, **_: module)) is None


def test_the_cli_refuses_a_mismatch_before_any_rank_starts(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(sys, "path", list(sys.path))
    path = _write(tmp_path / "group_ddp.py", _DDP.format(name="GroupDDP", sig="module, group"))
    assert main(["consistency", "--impl", f"{path}:GroupDDP"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    assert "GroupDDP(module) cannot be called: missing a required argument: 'group'" in err


# --- helpers -------------------------------------------------------------------------------

# A correct flat DDP, as a user would write it; {sig} is its constructor's signature.
_DDP = """
import torch
import torch.distributed as dist
from torch import nn


class {name}(nn.Module):
    def __init__(self, {sig}):
        super().__init__()
        self.module = module
        for t in [*module.parameters(), *module.buffers()]:
            dist.broadcast(t.data, src=0)

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def finish_gradient_synchronization(self):
        for p in self.module.parameters():
            if p.requires_grad:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                dist.all_reduce(p.grad)
                p.grad /= dist.get_world_size()
"""


def _write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


# --- a class the file defines, and an import that stays the user's -------------------------

# A student's file: their class, and PyTorch's imported as the baseline they compare against.
_STUDENT = """
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP


class MyDDP(nn.Module):
    def __init__(self, module):
        super().__init__()
        self.module = module
        for p in module.parameters():
            dist.broadcast(p.data, src=0)

    def forward(self, x):
        return self.module(x)


def baseline(module):
    return DDP(module)
"""


def test_a_class_the_file_only_imports_is_refused_naming_what_it_is(tmp_path):
    path = _write(tmp_path / "student_ddp.py", _STUDENT)
    with pytest.raises(ImplError) as imported:
        resolve(f"{path}:DDP")
    assert str(imported.value) == (
        f"--impl '{path}:DDP': DDP is torch.nn.parallel.distributed.DistributedDataParallel, "
        f"imported, not defined in {path} (classes it defines: MyDDP): name a class the file "
        "defines"
    )
    with pytest.raises(ImplError, match=r"has no class 'Model' \(classes there: MyDDP\)$"):
        resolve(f"{path}:Model")
    assert resolve(f"{path}:MyDDP").cls.__name__ == "MyDDP"


def test_a_module_path_takes_its_packages_reexport_but_not_another_packages(tmp_path, monkeypatch):
    """A package's `__init__` re-exporting its own class is how packages are written, so
    `pkg:MyDDP` is accepted; `pkg:DDP`, torch's class imported there, is named by its home."""
    monkeypatch.syspath_prepend(str(tmp_path))
    name = f"reexport_{abs(hash(str(tmp_path))) % 10**8}"
    _write(tmp_path / name / "ddp.py", _STUDENT)
    _write(tmp_path / name / "__init__.py", "from .ddp import DDP, MyDDP\n")
    try:
        assert resolve(f"{name}:MyDDP").cls.__module__ == f"{name}.ddp"
        with pytest.raises(ImplError) as other:
            resolve(f"{name}:DDP")
        assert str(other.value) == (
            f"--impl '{name}:DDP': DDP is torch.nn.parallel.distributed.DistributedDataParallel,"
            f" imported from another package, not {name}'s: name it as "
            f"torch.nn.parallel.distributed:DistributedDataParallel, or one of {name}'s (MyDDP)"
        )
    finally:
        for module in [m for m in sys.modules if m == name or m.startswith(name + ".")]:
            del sys.modules[module]


def test_the_cli_refuses_an_imported_class_in_one_line(run_cli, tmp_path):
    path = _write(tmp_path / "student_ddp.py", _STUDENT)
    ran = run_cli("consistency", "--impl", f"{path}:DDP")
    assert ran.returncode == 2 and ran.stdout == ""
    assert ran.stderr.strip().splitlines() == [
        f"verify: error: --impl '{path}:DDP': DDP is torch.nn.parallel.distributed."
        f"DistributedDataParallel, imported, not defined in {path} (classes it defines: MyDDP):"
        " name a class the file defines"
    ]


def test_an_exit_at_import_is_one_line_exit_2(run_cli, tmp_path):
    path = _write(tmp_path / "quits.py", "import sys\n\nsys.exit(3)\n")
    ran = run_cli("consistency", "--impl", f"{path}:MyDDP")  # raised SystemExit(3) here
    assert ran.returncode == 2
    assert ran.stderr.strip().splitlines() == [
        f"verify: error: --impl {path}: importing the file failed: it called sys.exit(3) (a "
        "class's file must not exit when imported)"
    ]


def test_a_print_at_import_goes_to_stderr_and_stdout_stays_the_reports(tmp_path, capfd):
    path = _write(
        tmp_path / "chatty.py",
        "import os\n\nprint('loading my DDP')\nos.write(1, b'from C, say\\n')\n" + _STUDENT,
    )
    assert resolve(f"{path}:MyDDP").cls.__name__ == "MyDDP"
    out, err = capfd.readouterr()
    assert out == ""  # --json's one document is all stdout holds
    assert "loading my DDP\n" in err and "from C, say\n" in err


def test_a_fork_at_import_ends_the_child_at_once(tmp_path, capfd):
    """The child would go on as a copy of the tool (here it leaves a mark, then leaves: the
    test's process must not be copied on). It is ended before its next line, and the tool
    says so."""
    mark = tmp_path / "the child ran"
    forks = f"import os\n\nCHILD = os.fork()\nif CHILD == 0:\n    open({str(mark)!r}, 'w')\n"
    forks += "    os._exit(0)\n"
    path = _write(tmp_path / "forks.py", forks + _STUDENT)
    impl = resolve(f"{path}:MyDDP")
    _, status = os.waitpid(sys.modules[impl.cls.__module__].CHILD, 0)
    assert not mark.exists() and os.waitstatus_to_exitcode(status) != 0
    assert f"verify: note: importing {path} forked 1 process(es): ended at once" in (
        capfd.readouterr().err
    )


def test_a_thread_started_at_import_does_not_hold_the_tools_exit(tmp_path):
    """A non-daemon thread that never ends, started by the file: the tool refuses the class
    (no DDP there) and exits 2 all the same, with a note (Python would have joined it)."""
    path = _write(
        tmp_path / "threads.py",
        "import threading\n\nthreading.Thread(target=threading.Event().wait, name='prefetch')"
        ".start()\n\n\nclass Helper:\n    pass\n",
    )
    tool = subprocess.Popen(
        [sys.executable, "-m", "verify", "consistency", "--impl", f"{path}:Helper"],
        cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        _, err = tool.communicate(timeout=300)  # without the fix: held for ever
    finally:
        tool.kill()
    assert tool.returncode == 2, err
    assert "neither an nn.Module DDP wrapper" in err
    assert f"verify: note: not waiting for thread 'prefetch', which importing {path}" in err
