"""Recipes: how the tool builds a data-parallel model and its optimizer from one `--impl`.

An `Implementation` is a recipe with two parts: how to wrap a model for data parallelism, and
(optionally) how to build a sharded optimizer. This module holds the record, the recipes for
our own classes and PyTorch's references, and `from_class`, which turns any class (a user's,
or one of the deliberately broken ones) into a recipe by the interface
docs/verify-your-own-ddp.md promises:

- a DDP wrapper is an `nn.Module` built as `Cls(module)`, plus `bucket_size_mb=` (the course
  interface) or `bucket_cap_mb=` (PyTorch's name) when the constructor takes one;
- a sharded optimizer is a `torch.optim.Optimizer` built as `Cls(params, optimizer_cls,
  **defaults)`, run over PyTorch DDP (the trusted reference), so a fault found is its own.

`interface_problem` checks that contract against a class's signature before any rank starts.
Nothing here knows the catalogues (`impls.faulty`) or the registry: those import this.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

DEFAULT_BUCKET_MB = 25.0

#: every kind of implementation; all but "user" are registered names (`impls.registry`)
KINDS = ("builtin", "reference", "faulty", "hang", "user")

#: the keywords a DDP wrapper's bucket size goes by: the course's, then PyTorch DDP's
BUCKET_KEYWORDS = ("bucket_size_mb", "bucket_cap_mb")

GUIDE = "docs/verify-your-own-ddp.md"

# The optimizer defaults the tool passes to a sharded optimizer, in full; a given run passes
# some of them or none (hyper-parameters often travel in the parameter groups instead).
_ADAMW_DEFAULTS = {"lr": 1e-3, "weight_decay": 0.1, "betas": (0.9, 0.999), "eps": 1e-8}
_SGD_DEFAULTS = {"lr": 1e-3, "momentum": 0.9}


class ImplError(ValueError):
    """`--impl` could not be resolved into something the tool can run (exit code 2)."""


@dataclass(frozen=True)
class Implementation:
    """A data-parallel recipe.

    Attributes:
        name: the `--impl` value it answers to (a registered name, or the user's spec).
        summary: one line for listings.
        wrap: `wrap(module, *, bucket_size_mb, process_group, find_unused_parameters)` returns
            the model to train. `bucket_size_mb=None` asks for one unbounded bucket per
            (device, dtype) where the wrapper buckets. `find_unused_parameters` is a hint for
            wrappers that need to be told (PyTorch DDP); built-ins always handle unused
            parameters.
        sharded_optimizer: when set, `sharded_optimizer(params, optimizer_cls, *,
            process_group, **defaults)` replaces `optimizer_cls(params, **defaults)`.
        kind: one of KINDS.
        cls: the class `from_class` built the recipe from (user and faulty kinds), which
            `interface_problem` checks; None for recipes of our own.
        optimizer_takes_wrapper: `sharded_optimizer` also gets `wrapped=` (the model `wrap`
            returned): ZeRO-2's optimizer steps the parameters its wrapper assigned.
        shards_parameters: the model's parameters become shards (ZeRO-3, FSDP2, a user
            class with `full_parameters()`): a forward may read a parameter only inside
            the forward of the block that gathers it.
    """

    name: str
    summary: str
    wrap: Callable[..., nn.Module]
    sharded_optimizer: Callable[..., torch.optim.Optimizer] | None = None
    kind: str = "builtin"
    cls: type | None = None
    optimizer_takes_wrapper: bool = False
    shards_parameters: bool = False

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"{self.name}: kind must be one of {', '.join(KINDS)}")

    @property
    def takes_buckets(self) -> bool:
        """Whether its wrapper is given a bucket size (the keyword its constructor takes)."""
        return getattr(self.wrap, "bucket_keyword", None) is not None

    def make_optimizer(
        self, params, optimizer_cls, *, process_group=None, wrapped=None, **defaults
    ):
        if self.sharded_optimizer is None:
            return optimizer_cls(params, **defaults)
        if self.optimizer_takes_wrapper:
            defaults["wrapped"] = wrapped
        return self.sharded_optimizer(
            params, optimizer_cls, process_group=process_group, **defaults
        )

    @property
    def sharded(self) -> bool:
        return self.sharded_optimizer is not None


# --- recipes for our own classes and PyTorch's --------------------------------------------


def wrapper_recipe(cls: type) -> Callable[..., nn.Module]:
    """`wrap` for a DDP class of ours (built-ins, hang scenarios): `Cls(module,
    process_group=...)`, plus the bucket size when the constructor takes one, and the
    `find_unused_parameters` hint when it names it (ZeRO-3's refuses such a workload)."""
    keyword = takes_bucket_size(cls)
    hinted = "find_unused_parameters" in inspect.signature(cls).parameters

    def wrap(module, *, bucket_size_mb=DEFAULT_BUCKET_MB, process_group=None, **hints):
        kwargs = {keyword: bucket_size_mb} if keyword else {}
        if hinted:
            kwargs["find_unused_parameters"] = hints.get("find_unused_parameters", False)
        return cls(module, process_group=process_group, **kwargs)

    wrap.bucket_keyword = keyword  # type: ignore[attr-defined]
    return wrap


def torch_ddp(
    module,
    *,
    bucket_size_mb=DEFAULT_BUCKET_MB,
    process_group=None,
    find_unused_parameters=False,
    **_hints,
):
    """PyTorch's DistributedDataParallel with the same bucket size: the reference.

    `bucket_size_mb=None` gives PyTorch's own default (25 MB), not one unbounded bucket: DDP
    has no unbounded setting (its first bucket is capped separately).
    """
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


def torch_fsdp(
    module, *, process_group=None, find_unused_parameters=False, compute_dtype=None, **_hints
):
    """PyTorch's FSDP2: `fully_shard` on each block, then on the root (torchtitan's order).

    `compute_dtype` (a workload's hint): mixed precision, FSDP2's own way:
    `MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=float32)`: parameters
    gathered and computed in `compute_dtype`, gradients reduce-scattered in float32 into the
    float32 shards.

    A block is a child of the root, or of a child container without a forward (a
    `ModuleList` of transformer blocks). A block that shares a parameter with another block
    (tied weights) is left to the root's unit: FSDP2 refuses one parameter in two units.
    FSDP2 does not broadcast at construction; as FSDP1's `sync_module_states=True` does, the
    parameters and buffers are broadcast from rank 0 first, so ranks seeded apart agree.
    Parameters become `DTensor` shards (dim 0, padded); the checks put them together with
    `full_tensor()` (`verify/training/sharded.py`).
    """
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from .base import sync_module_states

    if find_unused_parameters:  # refused here rather than as a gloo size mismatch mid-step
        raise ValueError(
            "FSDP2 cannot train parameters unused on some ranks: a unit whose forward did not "
            "run on a rank misses its all-gather and reduce-scatter there"
        )
    group = process_group if process_group is not None else dist.group.WORLD
    sync_module_states(module, group)
    device = next(module.parameters()).device.type
    mesh = DeviceMesh.from_group(group, device)
    policy = MixedPrecisionPolicy()
    if compute_dtype is not None:
        policy = MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32)
    for block in fsdp_blocks(module):
        fully_shard(block, mesh=mesh, mp_policy=policy)
    return fully_shard(module, mesh=mesh, mp_policy=policy)


def fsdp_blocks(module: nn.Module) -> list[nn.Module]:
    """The units `torch_fsdp` shards before the root, in registration order (its docstring)."""
    candidates = []
    for child in module.children():
        if isinstance(child, (nn.ModuleList, nn.ModuleDict)):
            candidates += list(child.children())
        else:
            candidates.append(child)
    owners: dict[int, int] = {}  # id(parameter) -> how many candidates hold it
    for block in candidates:
        for p in block.parameters():
            owners[id(p)] = owners.get(id(p), 0) + 1
    return [
        b
        for b in candidates
        if any(True for _ in b.parameters()) and all(owners[id(p)] == 1 for p in b.parameters())
    ]


def plain_over_shards(params, optimizer_cls, *, process_group=None, **defaults):
    """The optimizer of FSDP2: a plain one, over parameters that are this rank's shards, so
    its state is sharded with them."""
    return optimizer_cls(params, **defaults)


# --- any class, by the promised interface -------------------------------------------------


def takes_bucket_size(cls: type) -> str | None:
    """The keyword a DDP wrapper takes its bucket size by: "bucket_size_mb" (the course's
    interface, preferred when both are there), "bucket_cap_mb" (PyTorch DDP's), or None.
    Only a named parameter counts: `**kwargs` claims nothing about buckets."""
    try:
        parameters = inspect.signature(cls).parameters
    except (TypeError, ValueError):  # no signature to read (a C extension type)
        return None
    for keyword in BUCKET_KEYWORDS:
        p = parameters.get(keyword)
        if p is not None and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY):
            return keyword
    return None


torch_ddp.bucket_keyword = "bucket_cap_mb"  # type: ignore[attr-defined]


def from_class(cls: type, *, name: str, kind: str = "user") -> Implementation:
    """Build an Implementation around a class, told apart by type (docs/verify-your-own-ddp.md):

    - a `torch.optim.Optimizer` subclass is a sharded optimizer, built as
      `Cls(params, optimizer_cls, **defaults)` over PyTorch DDP (the trusted reference), so a
      fault found is the optimizer's;
    - an `nn.Module` subclass is a DDP wrapper, built as `Cls(module)`, or with the bucket
      size as `bucket_size_mb=` or `bucket_cap_mb=` when the constructor takes one
      (`takes_bucket_size`); one with `full_parameters()` says its parameters are shards,
      and gets a plain optimizer over them (`plain_over_shards`, FSDP2's way).

    Raises ImplError for a class that is neither. The constructor's signature is not checked
    here: `interface_problem` does that.
    """
    if issubclass(cls, torch.optim.Optimizer):

        def sharded(params, optimizer_cls, *, process_group=None, **defaults):
            return cls(params, optimizer_cls, **defaults)

        doc = _summary(cls, "user sharded optimizer")
        return Implementation(name, doc, torch_ddp, sharded, kind, cls)
    if issubclass(cls, nn.Module):
        keyword = takes_bucket_size(cls)

        def wrap(module, *, bucket_size_mb=DEFAULT_BUCKET_MB, process_group=None, **_hints):
            if keyword:
                return cls(module, **{keyword: bucket_size_mb})
            return cls(module)

        wrap.bucket_keyword = keyword  # type: ignore[attr-defined]
        doc = _summary(cls, "user DDP wrapper")
        # A wrapper whose parameters are shards takes a plain optimizer over them (FSDP2's
        # way), so its state is sharded with them and the shard (memory) check applies.
        shards = hasattr(cls, "full_parameters")
        optimizer = plain_over_shards if shards else None
        return Implementation(name, doc, wrap, optimizer, kind, cls, shards_parameters=shards)
    raise ImplError(
        f"--impl {name!r}: {cls.__name__} is neither an nn.Module DDP wrapper nor a "
        "torch.optim.Optimizer (sharded optimizer)"
    )


def interface_problem(impl: Implementation) -> str | None:
    """One line saying why the tool cannot construct `impl`'s class, or None if it can.

    Binds the constructor's signature to exactly the arguments `from_class` passes, so a
    mismatch is reported before any rank starts instead of as N identical tracebacks:

    - DDP wrapper: `Cls(module)`, plus the bucket keyword when it takes one;
    - sharded optimizer: `Cls(params, optimizer_cls)` with no defaults, with all of AdamW's
      (lr, weight_decay, betas, eps) and with all of SGD's (lr, momentum): a run passes some
      subset of one of these, and a signature that binds the empty and the full set binds
      every subset.

    Recipes without a class (ours), and classes whose signature cannot be read, pass.
    """
    cls = impl.cls
    if cls is None:
        return None
    try:
        signature = inspect.signature(cls)
    except (TypeError, ValueError):
        return None  # cannot tell: construction will say
    if issubclass(cls, torch.optim.Optimizer):  # a sharded optimizer (from_class's split)
        calls = [{}, _ADAMW_DEFAULTS, _SGD_DEFAULTS]
        positional, expected = (
            ["params", "optimizer_cls"],
            (
                "a sharded optimizer as Cls(params, optimizer_cls, **defaults), defaults any of "
                "lr, weight_decay, betas, eps (AdamW) or lr, momentum (SGD)"
            ),
        )
    else:
        keyword = takes_bucket_size(cls)
        calls = [{keyword: DEFAULT_BUCKET_MB} if keyword else {}]
        positional, expected = (
            ["module"],
            (
                "a DDP wrapper as Cls(module) or Cls(module, bucket_size_mb=...) "
                "(or bucket_cap_mb=...)"
            ),
        )
    for kwargs in calls:
        try:
            signature.bind(*positional, **kwargs)
        except TypeError as e:
            shown = ", ".join([*positional, *(f"{k}=..." for k in kwargs)])
            return (
                f"--impl {impl.name!r}: {cls.__name__}({shown}) cannot be called: {e}; "
                f"the tool constructs {expected} (see {GUIDE})"
            )
    return None


def _summary(cls: type, default: str) -> str:
    """The first sentence of the class docstring's first paragraph (`list` shows it)."""
    paragraph = " ".join((inspect.getdoc(cls) or default).split("\n\n", 1)[0].split())
    sentence, dot, _ = paragraph.partition(". ")
    return sentence + ("." if dot else "")
