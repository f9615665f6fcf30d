"""One registry: `--impl` names to implementations, plus user classes by import path.

An `Implementation` is a recipe with two parts: how to wrap a model for data parallelism, and
(optionally) how to build a sharded optimizer. The CLI's choices, the checkers and the tests'
parametrization all read `REGISTRY`; `resolve` also accepts `package.module:Class` and
`path/to/file.py:Class`, the forms DESIGN.md promises users.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import sys
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from .bucketed import BucketedDDP
from .flat import FlatDDP
from .naive import NaiveDDP
from .overlap import OverlapDDP
from .zero import ShardedOptimizer

DEFAULT_BUCKET_MB = 25.0


class ImplError(ValueError):
    """`--impl` could not be resolved into something the tool can run (exit code 2)."""


@dataclass(frozen=True)
class Implementation:
    """A data-parallel recipe.

    `wrap(module, *, bucket_size_mb, process_group, find_unused_parameters)` returns the model
    to train. `find_unused_parameters` is a hint for wrappers that need to be told (PyTorch
    DDP); built-ins always handle unused parameters. `sharded_optimizer(params, optimizer_cls,
    *, process_group, **defaults)`, when set, replaces `optimizer_cls(params, **defaults)`.
    """

    name: str
    summary: str
    wrap: Callable[..., nn.Module]
    sharded_optimizer: Callable[..., torch.optim.Optimizer] | None = None
    source: str = "builtin"  # "builtin" | "reference" | "user" | "faulty"

    def make_optimizer(self, params, optimizer_cls, *, process_group=None, **defaults):
        if self.sharded_optimizer is None:
            return optimizer_cls(params, **defaults)
        return self.sharded_optimizer(
            params, optimizer_cls, process_group=process_group, **defaults
        )

    @property
    def sharded(self) -> bool:
        return self.sharded_optimizer is not None


def _builtin(cls, takes_bucket: bool = False):
    def wrap(module, *, bucket_size_mb=DEFAULT_BUCKET_MB, process_group=None, **_hints):
        kwargs = {"bucket_size_mb": bucket_size_mb} if takes_bucket else {}
        return cls(module, process_group=process_group, **kwargs)

    return wrap


def torch_ddp(
    module, *, bucket_size_mb=DEFAULT_BUCKET_MB, process_group=None, find_unused_parameters=False
):
    """PyTorch's DistributedDataParallel with the same bucket size: the reference."""
    device_ids = None
    if next(module.parameters()).is_cuda:
        device_ids = [next(module.parameters()).device.index]
    return nn.parallel.DistributedDataParallel(
        module,
        device_ids=device_ids,
        bucket_cap_mb=bucket_size_mb,
        process_group=process_group,
        find_unused_parameters=find_unused_parameters,
    )


def torch_zero(params, optimizer_cls, *, process_group=None, **defaults):
    """PyTorch's ZeroRedundancyOptimizer: the reference sharded optimizer."""
    from torch.distributed.optim import ZeroRedundancyOptimizer

    return ZeroRedundancyOptimizer(
        params, optimizer_class=optimizer_cls, process_group=process_group, **defaults
    )


REGISTRY: dict[str, Implementation] = {
    impl.name: impl
    for impl in [
        Implementation("naive", "one all-reduce per gradient after backward", _builtin(NaiveDDP)),
        Implementation("flat", "one all-reduce of the flattened gradients", _builtin(FlatDDP)),
        Implementation(
            "overlap", "async all-reduce per gradient from backward hooks", _builtin(OverlapDDP)
        ),
        Implementation(
            "bucketed",
            "async all-reduce of gradient buckets as each fills",
            _builtin(BucketedDDP, takes_bucket=True),
        ),
        Implementation(
            "zero1",
            "bucketed DDP + ZeRO-1 sharded optimizer state",
            _builtin(BucketedDDP, takes_bucket=True),
            ShardedOptimizer,
        ),
        Implementation(
            "torch-ddp", "PyTorch DistributedDataParallel", torch_ddp, None, "reference"
        ),
        Implementation(
            "torch-zero",
            "PyTorch ZeroRedundancyOptimizer over DistributedDataParallel",
            torch_ddp,
            torch_zero,
            "reference",
        ),
    ]
}


def register(impl: Implementation) -> Implementation:
    """Add `impl` to the registry (used by catalogues of extra implementations)."""
    if impl.name in REGISTRY:
        raise ValueError(f"implementation {impl.name!r} is already registered")
    REGISTRY[impl.name] = impl
    return impl


def resolve(spec: str) -> Implementation:
    """Turn an `--impl` value into an Implementation, or raise ImplError with one line saying
    what was wrong and what is accepted."""
    if spec.startswith("faulty:") and spec not in REGISTRY:
        from impls.faulty import FAULTS  # registers the catalogue of deliberately broken ones

        if spec not in REGISTRY:
            raise ImplError(f"unknown implementation {spec!r}; faulty ones: {', '.join(FAULTS)}")
    if spec in REGISTRY:
        return REGISTRY[spec]
    if ":" not in spec:
        raise ImplError(
            f"unknown implementation {spec!r}; choose one of {', '.join(REGISTRY)}, "
            "or give package.module:Class or path/to/file.py:Class"
        )
    return from_class(load_class(spec), name=spec)


def load_class(spec: str) -> type:
    """Import `package.module:Class` or `path/to/file.py:Class`."""
    module_part, _, class_name = spec.rpartition(":")
    if not module_part or not class_name:
        raise ImplError(f"--impl {spec!r}: expected package.module:Class or path/to/file.py:Class")
    if module_part.endswith(".py") or "/" in module_part:
        path = Path(module_part)
        if not path.is_file():
            raise ImplError(f"--impl {spec!r}: file {module_part} does not exist")
        module = _import_file(path)
    else:
        try:
            module = importlib.import_module(module_part)
        except ModuleNotFoundError as e:
            if e.name and module_part.startswith(e.name):  # the module named, not its import
                raise ImplError(f"--impl {spec!r}: module {e.name!r} not found") from None
            raise ImplError(f"--impl {spec!r}: importing {module_part} failed: {e}") from None
        except Exception as e:  # SyntaxError, ImportError, anything raised at import time
            raise ImplError(
                f"--impl {spec!r}: importing {module_part} failed: {type(e).__name__}: {e}"
            ) from None
    cls = getattr(module, class_name, None)
    if cls is None:
        available = sorted(n for n, v in vars(module).items() if inspect.isclass(v))
        raise ImplError(
            f"--impl {spec!r}: module {module_part!r} has no class {class_name!r}"
            + (f" (classes there: {', '.join(available)})" if available else "")
        )
    if not inspect.isclass(cls):
        raise ImplError(f"--impl {spec!r}: {class_name!r} is not a class")
    return cls


def _import_file(path: Path):
    # Keyed by the resolved path: two submissions both called ddp.py must not share a module.
    resolved = str(path.resolve())
    name = f"ddp_verify_user_{path.stem}_{zlib.crc32(resolved.encode()):08x}"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path.resolve())
    module = importlib.util.module_from_spec(spec)
    # The file's own directory goes on sys.path so its sibling imports work.
    sys.path.insert(0, str(path.resolve().parent))
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except Exception as e:
        del sys.modules[name]
        raise ImplError(f"--impl {path}: importing the file failed: {type(e).__name__}: {e}") from e
    return module


def from_class(cls: type, *, name: str, source: str = "user") -> Implementation:
    """Build an Implementation around a user's class, told apart by type (DESIGN.md):

    - a `torch.optim.Optimizer` subclass is a sharded optimizer, built as
      `Cls(params, optimizer_cls, **defaults)` over PyTorch DDP (the trusted reference), so a
      fault found is the optimizer's;
    - an `nn.Module` subclass is a DDP wrapper, built as `Cls(module)`, or
      `Cls(module, bucket_size_mb=...)` when its constructor takes that argument.
    """
    if issubclass(cls, torch.optim.Optimizer):

        def sharded(params, optimizer_cls, *, process_group=None, **defaults):
            return cls(params, optimizer_cls, **defaults)

        doc = (inspect.getdoc(cls) or "user sharded optimizer").splitlines()[0]
        return Implementation(name, doc, torch_ddp, sharded, source)
    if issubclass(cls, nn.Module):
        takes_bucket = "bucket_size_mb" in inspect.signature(cls.__init__).parameters

        def wrap(module, *, bucket_size_mb=DEFAULT_BUCKET_MB, process_group=None, **_hints):
            if takes_bucket:
                return cls(module, bucket_size_mb=bucket_size_mb)
            return cls(module)

        doc = (inspect.getdoc(cls) or "user DDP wrapper").splitlines()[0]
        return Implementation(name, doc, wrap, None, source)
    raise ImplError(
        f"--impl {name!r}: {cls.__name__} is neither an nn.Module DDP wrapper nor a "
        "torch.optim.Optimizer (sharded optimizer)"
    )
