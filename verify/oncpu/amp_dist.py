"""Mixed precision and the process group of a CUDA script, on CPU ranks over gloo.

- `torch.autocast("cuda", dtype)` and `torch.cuda.amp.autocast(...)` run as CPU autocast in
  the same dtype (CUDA's default, float16, when none is given). On a CPU-only torch they
  would warn and run in float32, a different program from the one the owner runs.
- A GradScaler made for CUDA (`torch.amp.GradScaler("cuda")`, `torch.cuda.amp.GradScaler()`)
  is made for the CPU, where torch has the same kernels: it scales, unscales, skips a step
  on inf and moves its scale as on a GPU. (On a CPU-only torch it disables itself.)
- `init_process_group("nccl")` and `new_group(backend="nccl")` use gloo, and the GPU the
  group is bound to (`device_id=`) is dropped; `barrier(device_ids=[...])` waits for all.
- `DDP(model, device_ids=[i], output_device=i)` drops both for a module on the CPU (DDP
  refuses them there), and `init_device_mesh("cuda", ...)` makes a CPU mesh.
- `torch.distributed.ProcessGroupNCCL` (its Options) is NCCL itself: refused with its line.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from verify.oncpu.devices import is_cuda
from verify.oncpu.ledger import Ledger
from verify.patching import Patches


def install(ledger: Ledger, patches: Patches) -> None:
    _autocast(ledger, patches)
    _grad_scaler(ledger, patches)
    _groups(ledger, patches)
    _ddp(ledger, patches)


def _autocast(ledger: Ledger, patches: Patches) -> None:
    from torch.amp import autocast_mode

    init = autocast_mode.autocast.__init__

    def __init__(self, device_type, dtype=None, enabled=True, cache_enabled=None):
        if device_type == "cuda":
            dtype = torch.float16 if dtype is None else dtype  # CUDA's default
            name = str(dtype).removeprefix("torch.")
            ledger.mapped(f"autocast(cuda, {name})", f"autocast(cpu, {name})")
            device_type = "cpu"
        init(self, device_type, dtype, enabled, cache_enabled)

    patches.apply(autocast_mode.autocast, "__init__", __init__)


def _grad_scaler(ledger: Ledger, patches: Patches) -> None:
    from torch.amp import grad_scaler

    init = grad_scaler.GradScaler.__init__

    def __init__(self, device="cuda", *args, **kwargs):
        if is_cuda(device):
            ledger.mapped("GradScaler(cuda)", "GradScaler(cpu)")
            device = "cpu"
        init(self, device, *args, **kwargs)

    patches.apply(grad_scaler.GradScaler, "__init__", __init__)


def _gloo(backend, ledger: Ledger, call: str):
    """gloo for a backend that names NCCL ("nccl", "cpu:gloo,cuda:nccl")."""
    if backend is not None and "nccl" in str(backend).lower():
        ledger.mapped(f"{call}(backend={str(backend)!r})", "gloo")
        return "gloo"
    return backend


def _groups(ledger: Ledger, patches: Patches) -> None:
    """Installed over the tool's own wrappers (the tracer's, the "up" report's): they see
    the backend the ranks really use."""
    c10d = dist.distributed_c10d
    init, new_group, barrier = dist.init_process_group, dist.new_group, dist.barrier

    def init_process_group(*args, **kwargs):
        if args:
            args = (_gloo(args[0], ledger, "init_process_group"), *args[1:])
        elif "backend" in kwargs:
            kwargs["backend"] = _gloo(kwargs["backend"], ledger, "init_process_group")
        device = kwargs.get("device_id")
        if device is not None and (is_cuda(device) or type(device) is int):
            ledger.mapped("init_process_group(device_id=cuda)", "dropped")
            del kwargs["device_id"]
        return init(*args, **kwargs)

    def new_group_gloo(*args, **kwargs):
        if len(args) > 2:
            args = (*args[:2], _gloo(args[2], ledger, "new_group"), *args[3:])
        elif "backend" in kwargs:
            kwargs["backend"] = _gloo(kwargs["backend"], ledger, "new_group")
        return new_group(*args, **kwargs)

    def barrier_all(group=None, async_op=False, device_ids=None, **kwargs):
        if device_ids is not None:
            ledger.mapped("barrier(device_ids=...)", "dropped")
        return barrier(group, async_op, **kwargs)

    for owner in (dist, c10d):
        patches.apply(owner, "init_process_group", init_process_group)
        patches.apply(owner, "new_group", new_group_gloo)
        patches.apply(owner, "barrier", barrier_all)

    class ProcessGroupNCCL:
        def __init__(self, *args, **kwargs):
            ledger.refuse("torch.distributed.ProcessGroupNCCL", _NCCL)

        @staticmethod
        def Options(*args, **kwargs):  # noqa: N802 - torch's name
            ledger.refuse("torch.distributed.ProcessGroupNCCL.Options", _NCCL)

    patches.apply(dist, "ProcessGroupNCCL", ProcessGroupNCCL)
    _device_mesh(ledger, patches)


_NCCL = "it configures NCCL itself, and the rehearsal's ranks talk over gloo"


def _device_mesh(ledger: Ledger, patches: Patches) -> None:
    from torch.distributed import device_mesh

    init = device_mesh.init_device_mesh

    def init_device_mesh(device_type, *args, **kwargs):
        if device_type == "cuda":
            ledger.mapped("init_device_mesh(cuda)", "a CPU mesh")
            device_type = "cpu"
        return init(device_type, *args, **kwargs)

    patches.apply(device_mesh, "init_device_mesh", init_device_mesh)
    patches.apply(dist, "init_device_mesh", init_device_mesh)


def _ddp(ledger: Ledger, patches: Patches) -> None:
    import inspect

    from torch.nn.parallel import DistributedDataParallel

    init = DistributedDataParallel.__init__
    names = list(inspect.signature(init).parameters)[2:]  # device_ids, output_device, dim, ...

    def __init__(self, module, *args, **kwargs):
        kwargs.update(zip(names, args, strict=False))  # by name: device_ids may be dropped
        given = [kwargs.get("device_ids"), kwargs.get("output_device")]
        if any(v is not None for v in given) and all(
            p.device.type == "cpu" for p in module.parameters()
        ):
            ledger.mapped("DDP(device_ids=...)", "dropped (a CPU module)")
            kwargs.pop("device_ids", None)
            kwargs.pop("output_device", None)
        init(self, module, **kwargs)

    patches.apply(DistributedDataParallel, "__init__", __init__)
