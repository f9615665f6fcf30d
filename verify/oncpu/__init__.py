"""`--on-cpu`: rehearse a script written for CUDA on CPU ranks over gloo, unmodified.

Nearly every public DDP script is written for GPUs: `device = f"cuda:{local_rank}"`,
`torch.cuda.set_device`, `init_process_group("nccl")`, `DDP(model, device_ids=[...])`,
autocast to cuda, a GradScaler. A rehearsal runs it as it is, on a machine without GPUs
(where there are some, they are hidden from the rank: the same run on any machine), by
replacing those calls in the rank before the script's first line (`rank_script.py`, when
the rank's job says `on_cpu`: the same set-up for the tool's own ranks, a torchrun rank and a
launcher's), in this order:

1. devices (`devices.py`): a CUDA device named for a tensor, a module, a default device or a
   generator is the CPU;
2. `torch.cuda` (`cuda_api.py`) and `torch.accelerator` (`accelerator_api.py`), over one
   rehearsed node: questions answered as a GPU node would, ordering calls (set_device,
   synchronize, streams, events) no-ops, the CUDA generator the CPU one; a device question
   left unmapped is counted where the script asks it (`standins.py`);
3. mixed precision and the process group (`amp_dist.py`): CPU autocast in the same dtype, a
   GradScaler for the CPU, gloo for nccl, DDP's `device_ids` dropped for a CPU module.

`torch.compile`, the ops themselves and everything else stay torch's own: a rehearsal changes
where tensors live and what carries the collectives, never what a step computes on a rank, so
the replicas agree or part as they would on GPUs (the tests compare each CUDA script's
verdict with its hand-edited CPU copy's). Every mapping is counted at the user's line
(`ledger.py`), into the rank's `rank<r>.on_cpu.json`; a call it cannot map is one line with
its file:line and no verdict (`unmappable.py`, exit 2).
"""

from __future__ import annotations

from verify.oncpu.ledger import Ledger
from verify.oncpu.report import REPORT_SUFFIX
from verify.oncpu.unmappable import CannotMap, UnmappableCall, classify
from verify.patching import Patches


class Rehearsal:
    """The replaced calls of one rank and what they mapped."""

    def __init__(self, ledger: Ledger, patches: Patches) -> None:
        self.ledger, self.patches = ledger, patches

    def finish(self, exc: BaseException | None = None) -> CannotMap | None:
        """Write the rank's report; with the script's raise, the call it could not map when
        that is what the raise was (else None: the script's own crash)."""
        refused = None if exc is None else classify(exc)
        if refused is not None:
            self.ledger.note_refused(refused)
        self.ledger.save()
        return refused

    def remove(self) -> None:
        self.patches.restore()


def install(report_path: str | None, rank: int) -> Rehearsal:
    """Map a CUDA script's calls to the CPU in this process (module docstring), counting them
    into `report_path` (None: in memory only)."""
    import os

    from verify.oncpu import accelerator_api, amp_dist, cuda_api, devices, standins

    # A rehearsal runs on the CPU on any machine: a GPU machine's devices are hidden from
    # torch (read at CUDA's first use, which comes later), so torch answers itself as a
    # CPU-only machine would and a GPU is never touched (a library asking torch.cuda beside
    # the patches, or a rank's set_device(1) on a one-GPU machine, would reach a real one).
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
    ledger, patches = Ledger(report_path, rank), Patches()
    devices.install(ledger, patches)
    node = cuda_api.install(ledger, patches)
    accelerator_api.install(ledger, patches, node)
    amp_dist.install(ledger, patches)
    standins.count_every_unmapped(ledger, patches)
    ledger.save()
    return Rehearsal(ledger, patches)


__all__ = ["CannotMap", "Rehearsal", "UnmappableCall", "install", "REPORT_SUFFIX"]
