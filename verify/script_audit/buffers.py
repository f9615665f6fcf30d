"""The buffers of a DDP-wrapped model as DDP broadcast them at a forward.

DDP broadcasts rank 0's buffers at the start of a forward (when it syncs buffers and does at
this forward: `naming.broadcasts_now`); the model's forward then updates them (BatchNorm's
running statistics), differently on every rank. So the buffers every rank should hold alike
are the ones seen inside DDP's forward, before the model's: fingerprinted there, kept until
the next audit point ("buffers after DDP's broadcast"). A model whose wrapper did not
broadcast since the last audit point (Lightning's manual optimization, a `no_sync()`
micro-step) holds its own buffers: they are compared as they are, a note when they differ.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable

from torch import nn

from verify.replica_audit.compare import Entry
from verify.replica_audit.fingerprint import fingerprints
from verify.script_audit import report
from verify.script_audit.collect import Collector
from verify.script_audit.naming import broadcasts_now, strip, syncs_buffers


class BroadcastBuffers:
    """Snapshots of the broadcast buffers, one per DDP wrapper, until the audit takes them."""

    def __init__(self, guard: Callable) -> None:
        self.guard = guard  # runs a snapshot so that its failure stops the audit, not the script
        self.snapshots: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # DDP -> entries
        # DDPs that ran a forward without broadcasting since their last audit, and no
        # snapshot: their buffers are this rank's own at the step
        self.unbroadcast: weakref.WeakSet = weakref.WeakSet()
        self._inside: set[int] = set()  # the DDPs whose forward is running
        self.active = lambda: True  # False once the audit stopped

    def on_wrap(self, wrapper: nn.Module, model: nn.Module) -> None:
        """A module took another as `module`: if it is DDP, fingerprint the buffers inside its
        forward, after its broadcast and before the model's forward updates them."""
        from torch.nn.parallel import DistributedDataParallel

        if not isinstance(wrapper, DistributedDataParallel):
            return
        inside, key = self._inside, id(wrapper)
        wrapper.register_forward_pre_hook(lambda m, args: inside.add(key))
        wrapper.register_forward_hook(lambda m, args, out: inside.discard(key))
        ref = weakref.ref(wrapper)

        def snapshot(module, args):
            ddp = ref()
            if ddp is None or key not in inside or ddp in self.snapshots or not syncs_buffers(ddp):
                return
            if not broadcasts_now(ddp):  # DDP skipped its broadcast: nothing synced to compare
                self.unbroadcast.add(ddp)
                return
            if self.active():
                self.guard(self._fingerprint, ddp)

        model.register_forward_pre_hook(snapshot)

    def _fingerprint(self, ddp: nn.Module) -> None:
        named = [(strip(ddp, n), b) for n, b in ddp.named_buffers()]
        prints = fingerprints([b for _, b in named])
        self.snapshots[ddp] = [
            Entry(report.BUFFERS_SYNCED, n, fingerprint=fp, key_extra=f"{b.dtype}|{tuple(b.shape)}")
            for (n, b), fp in zip(named, prints)
        ]

    def entries(self, root: nn.Module, collect: Collector) -> list[Entry]:
        """The buffers of `root` (a model the optimizer steps) at a "before step" point: the
        broadcast snapshot, or, where no wrapper synchronized them since the last audit, this
        rank's own (a note when they differ)."""
        unbroadcast = root in self.unbroadcast
        self.unbroadcast.discard(root)
        if syncs_buffers(root) and (root in self.snapshots or not unbroadcast):
            return self.snapshots.pop(root, [])
        return collect.buffers([root], report.BUFFERS_LOCAL)
