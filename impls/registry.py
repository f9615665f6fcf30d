"""One registry: `--impl` names to implementations, built once from closed lists.

`REGISTRY` is a read-only mapping, filled here at import and nowhere else, in this order:

    builtin     naive, flat, overlap, bucketed, zero1..zero3 (our ladder, `impls/*.py`)
    reference   torch-ddp, torch-zero, torch-fsdp             (PyTorch's own)
    faulty      faulty:<name>  (`impls.faulty.FAULTS`, built as a user's class would be)
    hang        hang:<name>    (`impls.faulty.hang_scenarios.SCENARIOS`)

`resolve` also accepts the user forms docs/verify-your-own-ddp.md promises,
`package.module:Class` and `path/to/file.py:Class` (kind "user"), and checks their constructor
against the interface the tool will call before any rank starts.

Imports run one way: registry -> catalogues (`impls.faulty`) -> variants and recipes
(`impls.recipes`, which knows no catalogue), so importing any of them first is safe.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable, Mapping
from dataclasses import replace
from types import MappingProxyType

from .bucketed import BucketedDDP
from .faulty import FAULTS
from .faulty.hang_scenarios import SCENARIOS
from .flat import FlatDDP
from .loading import load_class, name_the_class
from .naive import NaiveDDP
from .overlap import OverlapDDP
from .recipes import (
    DEFAULT_BUCKET_MB,
    KINDS,
    Implementation,
    ImplError,
    from_class,
    interface_problem,
    plain_over_shards,
    takes_bucket_size,
    torch_ddp,
    torch_fsdp,
    torch_zero,
    wrapper_recipe,
)
from .zero import ShardedOptimizer
from .zero2 import Zero2DDP, zero2_optimizer
from .zero3 import zero3_wrap

__all__ = [
    "DEFAULT_BUCKET_MB",
    "KINDS",
    "REGISTERED_KINDS",
    "REGISTRY",
    "ImplError",
    "Implementation",
    "from_class",
    "interface_problem",
    "load_class",
    "names",
    "resolve",
    "takes_bucket_size",
]

#: the kinds that have registered names (a "user" class is named by its import path)
REGISTERED_KINDS = tuple(k for k in KINDS if k != "user")


def _build() -> Mapping[str, Implementation]:
    """The registry, kind after kind (module docstring); a name listed twice is a bug here."""
    table: dict[str, Implementation] = {}
    for impl in [*_builtin(), *_references(), *_catalogues()]:
        assert impl.name not in table, f"{impl.name} is listed twice"
        table[impl.name] = impl
    return MappingProxyType(table)


def _builtin() -> list[Implementation]:
    """Our ladder, each rung adding one idea to the one before."""
    return [
        Implementation(
            "naive", "one all-reduce per gradient after backward", wrapper_recipe(NaiveDDP)
        ),
        Implementation(
            "flat", "one all-reduce of the flattened gradients", wrapper_recipe(FlatDDP)
        ),
        Implementation(
            "overlap",
            "async all-reduce per gradient from backward hooks",
            wrapper_recipe(OverlapDDP),
        ),
        Implementation(
            "bucketed",
            "async all-reduce of gradient buckets as each fills",
            wrapper_recipe(BucketedDDP),
        ),
        Implementation(
            "zero1",
            "bucketed DDP + ZeRO-1 sharded optimizer state",
            wrapper_recipe(BucketedDDP),
            ShardedOptimizer,
        ),
        Implementation(
            "zero2",
            "zero1 + gradients reduce-scattered to their owner rank",
            wrapper_recipe(Zero2DDP),
            zero2_optimizer,
            optimizer_takes_wrapper=True,
        ),
        Implementation(
            "zero3",
            "parameters sharded by rows, gathered per block (the next prefetched); "
            "gradients reduce-scattered per block during backward",
            zero3_wrap,
            plain_over_shards,
            shards_parameters=True,
        ),
    ]


def _references() -> list[Implementation]:
    """PyTorch's own, what the ladder is measured against."""
    return [
        Implementation("torch-ddp", "PyTorch DistributedDataParallel", torch_ddp, kind="reference"),
        Implementation(
            "torch-zero",
            "PyTorch ZeroRedundancyOptimizer over DistributedDataParallel",
            torch_ddp,
            torch_zero,
            kind="reference",
        ),
        Implementation(
            "torch-fsdp",
            "PyTorch FSDP2 fully_shard per block and at the root",
            torch_fsdp,
            plain_over_shards,
            kind="reference",
            shards_parameters=True,
        ),
    ]


def _catalogues() -> list[Implementation]:
    """The broken ones, built to fail: the faults, then the hangs, in catalogue order."""
    return [
        *(_faulty(f.cls, f.name) for f in FAULTS.values()),
        *(
            Implementation(name, summary, wrapper_recipe(cls), kind="hang")
            for name, (cls, summary, _verdict) in SCENARIOS.items()
        ),
    ]


def _faulty(cls: type, name: str) -> Implementation:
    """A faulty class built as a user's would be, except a broken ZeRO-2 wrapper: it keeps
    only the gradients it owns, so it is paired with ZeRO-2's optimizer (stepping the owned
    parameters), as `zero2` is; a plain optimizer would make every one of them look wrong."""
    impl = from_class(cls, name=name, kind="faulty")
    if issubclass(cls, Zero2DDP):
        impl = replace(impl, sharded_optimizer=zero2_optimizer, optimizer_takes_wrapper=True)
    return impl


REGISTRY: Mapping[str, Implementation] = _build()

# Name prefixes that belong to a registered catalogue: "faulty:nope" is an unknown name, not a
# class `nope` in a module `faulty`.
_CATALOGUE_PREFIXES = {name.split(":", 1)[0] for name in REGISTRY if ":" in name}


def names(kinds: Iterable[str] | None = None) -> list[str]:
    """The registered names of these kinds (all when None), in registry order: for the CLI's
    help, its `list`, and the one-line message of an unknown name."""
    accepted = _kinds(kinds)
    return [name for name, impl in REGISTRY.items() if impl.kind in accepted]


def resolve(
    spec: str,
    *,
    kinds: Iterable[str] | None = None,
    command: str | None = None,
) -> Implementation:
    """Turn an `--impl` value into an Implementation, or raise ImplError with one line.

    Args:
        spec: a registered name, `package.module:Class`, or `path/to/file.py:Class`.
        kinds: the registered kinds the caller's command can run (default: all). A registered
            name of another kind is refused like an unknown one, and the message lists exactly
            the names the command accepts. User classes are always accepted.
        command: the command's name, for the message ("... for consistency; ...").

    Raises:
        ImplError (a ValueError): an unknown or refused name, a user class that cannot be
            imported, is neither a DDP wrapper nor an optimizer, or whose constructor does
            not take the arguments the tool passes (`interface_problem`).
    """
    accepted = _kinds(kinds)
    impl = REGISTRY.get(spec)
    if impl is not None and impl.kind in accepted:
        return impl
    if impl is None and ":" not in spec and (spec.endswith(".py") or "/" in spec):
        raise ImplError(name_the_class(spec))  # a file, its class forgotten
    if impl is not None or ":" not in spec or spec.split(":", 1)[0] in _CATALOGUE_PREFIXES:
        where = f" for {command}" if command else ""
        close = difflib.get_close_matches(spec, names(accepted), n=3, cutoff=0.75)
        guess = f" (did you mean {' or '.join(close)}?)" if close and impl is None else ""
        raise ImplError(
            f"unknown implementation {spec!r}{where}{guess}; choose one of "
            f"{', '.join(names(accepted))}, or give package.module:Class or path/to/file.py:Class"
        )
    impl = from_class(load_class(spec), name=spec)
    problem = interface_problem(impl)
    if problem:
        raise ImplError(problem)
    return impl


def _kinds(kinds: Iterable[str] | None) -> frozenset[str]:
    if kinds is None:
        return frozenset(REGISTERED_KINDS)
    chosen = frozenset(kinds)
    unknown = chosen - set(KINDS)
    if unknown:
        raise ValueError(f"unknown kinds {sorted(unknown)}; kinds are {', '.join(KINDS)}")
    return chosen
