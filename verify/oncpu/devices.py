"""CUDA devices mapped to the CPU: where a script names a CUDA device for a tensor, the tensor
is made or kept on the CPU.

A device is named in few places, and only those are replaced (the rest of torch runs as it
is, so the ops of a step cost what they cost on a CPU run): `Tensor.to`, `Tensor.cuda`, the
`new_*` methods and the factory functions (`torch.zeros(..., device="cuda")`, which the
modules' `device=` keyword reaches too), `Module.to` / `Module.cuda`, a default device
(`torch.set_default_device("cuda")`, `with torch.device("cuda"):`), and a
`torch.Generator(device="cuda:N")`, which becomes a CPU generator, and `torch.load`'s
`map_location`. `pin_memory()` returns
the tensor (pinned memory is for copies to a GPU); `non_blocking=True` is what a copy on one
device already is.

A tensor's own `.device` says cpu: a script that branches on it takes its CPU branch.
"""

from __future__ import annotations

import torch

from verify.oncpu.ledger import Ledger
from verify.patching import Patches

# torch's functions that make a tensor and take `device=`.
FACTORIES = (
    "arange", "as_tensor", "asarray", "bartlett_window", "blackman_window", "empty",
    "empty_like", "empty_permuted", "empty_strided", "eye", "full", "full_like",
    "hamming_window", "hann_window", "kaiser_window", "linspace", "logspace", "normal", "ones",
    "ones_like", "rand", "rand_like", "randint", "randint_like", "randn", "randn_like",
    "randperm", "range", "scalar_tensor", "sparse_coo_tensor", "tensor", "tril_indices",
    "triu_indices", "zeros", "zeros_like",
)  # fmt: skip
NEW_METHODS = ("new_empty", "new_full", "new_ones", "new_tensor", "new_zeros")
CPU = torch.device("cpu")


def is_cuda(spec) -> bool:
    """Whether `spec` names a CUDA device: "cuda", "cuda:1", torch.device("cuda", 1)."""
    kind = type(spec)
    if kind is str:
        return spec.startswith("cuda")
    return kind is torch.device and spec.type == "cuda"


def install(ledger: Ledger, patches: Patches) -> None:
    """Map every place a script names a CUDA device (module docstring)."""
    _tensor_methods(ledger, patches)
    for name in FACTORIES:
        if hasattr(torch, name):
            patches.apply(torch, name, _factory(getattr(torch, name), f"torch.{name}", ledger))
    for name in NEW_METHODS:
        patches.apply(torch.Tensor, name, _factory(getattr(torch.Tensor, name), name, ledger))
    _modules(ledger, patches)
    _default_device(ledger, patches)
    _load(ledger, patches)
    patches.apply(torch, "Generator", _generator(ledger))


def _tensor_methods(ledger: Ledger, patches: Patches) -> None:
    to = torch.Tensor.to

    def to_cpu(self, *args, **kwargs):
        if args:
            first = args[0]
            # an int is a CUDA ordinal: `x.to(0)` is `x.to("cuda:0")`
            if is_cuda(first) or (type(first) is int):
                ledger.mapped("Tensor.to(cuda)", "cpu")
                args = (CPU, *args[1:])
        if kwargs and is_cuda(kwargs.get("device")):
            ledger.mapped("Tensor.to(device=cuda)", "cpu")
            kwargs["device"] = CPU
        return to(self, *args, **kwargs)

    def cuda(self, device=None, non_blocking=False, memory_format=torch.preserve_format):
        ledger.mapped("Tensor.cuda()", "cpu")
        return to(self, CPU, non_blocking=non_blocking, memory_format=memory_format)

    def pin_memory(self, device=None):
        ledger.mapped("Tensor.pin_memory()", "the tensor itself")
        return self

    def record_stream(self, stream):
        ledger.mapped("Tensor.record_stream()", "no-op")

    patches.apply(torch.Tensor, "to", to_cpu)
    patches.apply(torch.Tensor, "cuda", cuda)
    patches.apply(torch.Tensor, "pin_memory", pin_memory)
    patches.apply(torch.Tensor, "record_stream", record_stream)


def _factory(original, name: str, ledger: Ledger):
    def factory(*args, **kwargs):
        if kwargs and is_cuda(kwargs.get("device")):
            ledger.mapped(f"{name}(device=cuda)", "cpu")
            kwargs["device"] = CPU
        return original(*args, **kwargs)

    factory.__name__ = factory.__qualname__ = original.__name__
    factory.__doc__ = original.__doc__
    # TorchScript knows torch's functions by identity: a scripted function that calls
    # torch.zeros (torch.distributed.optim has some) must see the builtin, not compile this.
    from torch.jit import _builtins

    op = _builtins._find_builtin(original)
    if op is not None:
        _builtins._register_builtin(factory, op)
    return factory


def _load(ledger: Ledger, patches: Patches) -> None:
    """`torch.load(path, map_location="cuda:N")` (a snapshot loaded onto this rank's GPU)
    loads onto the CPU; a dict of locations has its CUDA targets mapped."""
    load = torch.load

    def load_on_cpu(*args, **kwargs):
        where = kwargs.get("map_location")
        if is_cuda(where) or type(where) is int:
            ledger.mapped("torch.load(map_location=cuda)", "cpu")
            kwargs["map_location"] = CPU
        elif isinstance(where, dict) and any(is_cuda(v) for v in where.values()):
            ledger.mapped("torch.load(map_location={...: cuda})", "cpu")
            kwargs["map_location"] = {k: "cpu" if is_cuda(v) else v for k, v in where.items()}
        return load(*args, **kwargs)

    load_on_cpu.__doc__ = load.__doc__
    patches.apply(torch, "load", load_on_cpu)


def _modules(ledger: Ledger, patches: Patches) -> None:
    from torch import nn

    module_to, module_cuda = nn.Module.to, nn.Module.cuda

    def to(self, *args, **kwargs):
        # an int is a CUDA ordinal (`model.to(rank)`, as pytorch/examples' mp.spawn scripts
        # write it), which torch's own parsing refuses on a machine without one
        if args and type(args[0]) is int:
            args = (f"cuda:{args[0]}", *args[1:])
        if type(kwargs.get("device")) is int:
            kwargs["device"] = f"cuda:{kwargs['device']}"
        device = torch._C._nn._parse_to(*args, **kwargs)[0]
        if device is None or device.type != "cuda":
            return module_to(self, *args, **kwargs)
        ledger.mapped("Module.to(cuda)", "cpu")
        with ledger.quiet():  # its tensors are this one call
            return module_to(self, *args, **kwargs)

    def cuda(self, device=None):
        ledger.mapped("Module.cuda()", "cpu")
        with ledger.quiet():
            return module_cuda(self, device)

    patches.apply(nn.Module, "to", to)
    patches.apply(nn.Module, "cuda", cuda)


def _default_device(ledger: Ledger, patches: Patches) -> None:
    """`torch.set_default_device("cuda")` and `with torch.device("cuda"):` both make a
    DeviceContext (torch/utils/_device.py): a CUDA one becomes a CPU one."""
    from torch.utils import _device

    init = _device.DeviceContext.__init__

    def __init__(self, device):
        if is_cuda(device) or type(device) is int:
            ledger.mapped("default device cuda", "cpu")
            device = CPU
        init(self, device)

    patches.apply(_device.DeviceContext, "__init__", __init__)


def _generator(ledger: Ledger):
    """torch.Generator, a CPU one where a CUDA one is asked for; `isinstance(g,
    torch.Generator)` holds for every generator, torch's own included."""
    base = torch._C.Generator

    class Meta(type(base)):
        def __instancecheck__(cls, obj) -> bool:
            return isinstance(obj, base)

        def __subclasscheck__(cls, sub) -> bool:
            return issubclass(sub, base)

    class Generator(base, metaclass=Meta):
        __doc__ = base.__doc__

        def __new__(cls, device="cpu"):
            if is_cuda(device) or type(device) is int:
                ledger.mapped("torch.Generator(device=cuda)", "a CPU generator")
                device = "cpu"
            return base.__new__(cls, device)

    return Generator
