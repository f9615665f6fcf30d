"""A DDP class as a course assignment writes it (the interface `python -m verify` expects).

`StudentDDP(module)` broadcasts parameters and buffers from rank 0, launches an async
all-reduce of each gradient from a post-accumulate-grad hook, and waits for them all in
`finish_gradient_synchronization()`. It is correct when every rank computes gradients for the
same parameters in the same order; see docs/verify-your-own-ddp.md for what happens when
they don't.

Try it:
    python -m verify consistency --impl docs/examples/student_ddp.py:StudentDDP
    python -m verify consistency --impl docs/examples/student_ddp.py:StudentDDP --workload unused
"""

import torch.distributed as dist
from torch import nn


class StudentDDP(nn.Module):
    def __init__(self, module: nn.Module):
        super().__init__()
        self.module = module
        self.handles = []
        for tensor in [*module.parameters(), *module.buffers()]:
            dist.broadcast(tensor.data, src=0)
        for param in module.parameters():
            if param.requires_grad:
                param.register_post_accumulate_grad_hook(self._all_reduce_grad)

    def _all_reduce_grad(self, param):
        # Launched in the order gradients arrive: fine only if every rank sees the same graph.
        param.grad.div_(dist.get_world_size())
        self.handles.append(dist.all_reduce(param.grad, async_op=True))

    def forward(self, *inputs, **kwargs):
        return self.module(*inputs, **kwargs)

    def finish_gradient_synchronization(self):
        for handle in self.handles:
            handle.wait()
        self.handles.clear()
