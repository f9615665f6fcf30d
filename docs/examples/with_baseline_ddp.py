"""A student's file that keeps PyTorch's DDP beside their own class, as the baseline they
compare against.

Only the class the file defines is checked:
    python -m verify consistency --impl docs/examples/with_baseline_ddp.py:MyDDP
`...:DDP` names PyTorch's class, which the file imports, and is refused in one line
(docs/verify-your-own-ddp.md).
"""

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP


class MyDDP(nn.Module):
    """Broadcast from rank 0 at construction; average every gradient after backward."""

    def __init__(self, module: nn.Module):
        super().__init__()
        self.module = module
        for t in [*module.parameters(), *module.buffers()]:
            dist.broadcast(t.data, src=0)

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def finish_gradient_synchronization(self):
        for p in self.module.parameters():
            if p.requires_grad:
                if p.grad is None:  # unused on this rank: a zero gradient, as DDP counts it
                    p.grad = torch.zeros_like(p)
                dist.all_reduce(p.grad)
                p.grad /= dist.get_world_size()


def baseline(module: nn.Module) -> nn.Module:
    """PyTorch's DDP over the same module, to compare losses with."""
    return DDP(module)
