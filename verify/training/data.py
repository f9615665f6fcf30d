"""What every workload is: a model builder, a seeded global batch per step, a loss, and
parameter groups (the conventions are in `workloads.py`)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class Batch:
    """A batch: positional inputs, targets, and keyword inputs (tensors are split by rows)."""

    inputs: torch.Tensor
    targets: torch.Tensor
    kwargs: dict = field(default_factory=dict)

    def shard(self, rank: int, world_size: int) -> Batch:
        rows = self.inputs.shape[0]
        assert rows % world_size == 0, "global batch must split evenly"
        size = rows // world_size
        sl = slice(rank * size, (rank + 1) * size)
        kwargs = {k: v[sl] if isinstance(v, torch.Tensor) else v for k, v in self.kwargs.items()}
        return Batch(self.inputs[sl], self.targets[sl], kwargs)

    def to(self, device: torch.device) -> Batch:
        kwargs = {
            k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in self.kwargs.items()
        }
        return Batch(self.inputs.to(device), self.targets.to(device), kwargs)


class Workload:
    """Base workload: an MLP regression on seeded Gaussian data."""

    name = "mlp"
    summary = "MLP with LayerNorm; the plain case"
    #: hint for wrappers that must be told (PyTorch DDP's find_unused_parameters)
    has_unused_parameters = False
    #: hint for wrappers that compute in a narrower dtype than the parameters' (FSDP2's
    #: MixedPrecisionPolicy param_dtype); None: the parameters' own
    compute_dtype: torch.dtype | None = None
    d_in, d_hidden, d_out = 16, 32, 4

    def __init__(self, *, local_batch: int = 8, seed: int = 0) -> None:
        self.local_batch = local_batch
        self.seed = seed

    def build(self) -> nn.Module:
        return MLP(self.d_in, self.d_hidden, self.d_out)

    def _generator(self, step: int) -> torch.Generator:
        return torch.Generator().manual_seed(1_000_003 * self.seed + step)

    def batch(self, step: int, world_size: int) -> Batch:
        g = self._generator(step)
        rows = self.local_batch * world_size
        return Batch(
            torch.randn(rows, self.d_in, generator=g), torch.randn(rows, self.d_out, generator=g)
        )

    def loss(self, model: nn.Module, batch: Batch) -> torch.Tensor:
        out = model(batch.inputs, **batch.kwargs)
        return F.mse_loss(out.float(), batch.targets.float())

    def param_groups(
        self, module: nn.Module, lr: float = 1e-3, weight_decay: float = 0.1
    ) -> list[dict]:
        params = [p for p in module.parameters() if p.requires_grad]
        decay = [p for p in params if p.dim() >= 2]
        no_decay = [p for p in params if p.dim() < 2]
        groups = [{"params": decay, "lr": lr, "weight_decay": weight_decay}]
        if no_decay:
            groups.append({"params": no_decay, "lr": lr * 0.5, "weight_decay": 0.0})
        return groups

    def describe(self) -> str:
        return f"{self.name}: {self.summary}"


class MLP(nn.Module):
    def __init__(self, d_in: int, d_hidden: int, d_out: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(d_in, d_hidden)
        self.norm = nn.LayerNorm(d_hidden)
        self.fc2 = nn.Linear(d_hidden, d_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.norm(self.fc1(x))))


def token_loss(model: nn.Module, batch: Batch) -> torch.Tensor:
    """Next-token cross-entropy, in float32 whatever the model's dtype."""
    logits = model(batch.inputs)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), batch.targets.reshape(-1))
