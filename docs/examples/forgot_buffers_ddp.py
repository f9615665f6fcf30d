"""A DDP class that broadcasts parameters but forgets buffers at construction.

python -m verify consistency --impl docs/examples/forgot_buffers_ddp.py:ForgotBuffersDDP --workload buffers
"""

import torch.distributed as dist
from torch import nn


class ForgotBuffersDDP(nn.Module):
    def __init__(self, module: nn.Module):
        super().__init__()
        self.module = module
        for param in module.parameters():
            dist.broadcast(param.data, src=0)  # buffers are never broadcast: the bug

    def forward(self, *inputs, **kwargs):
        return self.module(*inputs, **kwargs)

    def finish_gradient_synchronization(self):
        world = dist.get_world_size()
        for param in self.module.parameters():
            if param.requires_grad and param.grad is not None:
                dist.all_reduce(param.grad)
                param.grad.div_(world)
