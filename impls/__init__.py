"""From-scratch data-parallel implementations: a ladder of DDP variants and a ZeRO-1 optimizer.

    naive -> flat -> overlap -> bucketed      (DDP wrappers, `impls.<name>`)
    zero1                                     (sharded optimizer, `impls.zero`)

`impls.registry.REGISTRY` maps `--impl` names to recipes (`impls.recipes`): the ones above,
PyTorch's references, and the deliberately broken ones of `impls.faulty`. Nothing here
depends on `verify`.
"""

from .bucketed import BucketedDDP
from .flat import FlatDDP
from .naive import NaiveDDP
from .overlap import OverlapDDP

__all__ = ["NaiveDDP", "FlatDDP", "OverlapDDP", "BucketedDDP"]
