"""Small deterministic models and data that exercise the hard cases of data parallelism.

Each workload is a model builder, a seeded global batch per step, a loss, and parameter groups.
Conventions every checker relies on:

- `build()` is deterministic given torch's seed. Checkers seed each rank *differently* before
  building, so a wrapper that forgets to broadcast parameters or buffers at construction is
  caught at the first audit.
- `batch(step, world_size)` returns the *global* batch of step `step` (fresh examples every
  step, the same on every rank); `Batch.shard(rank, world_size)` is rank `rank`'s contiguous
  slice. Every rank gets `local_batch` examples, and losses are means over the local batch, so
  the average of the ranks' gradients is the gradient of the global batch's mean loss.
- Per-example routing (which examples take an optional branch) travels in the batch, so a
  single process fed the global batch computes exactly what the ranks compute together.
- `param_groups()` returns two groups with different hyper-parameters (decayed weights, and
  biases/norms at a lower learning rate without decay), as real training does.
"""

from __future__ import annotations

from dataclasses import replace

import torch
import torch.nn.functional as F
from torch import nn

from verify.training.data import MLP, Batch, Workload, token_loss
from verify.training.language import GPT, GPTConfig, Markov, Transformer

__all__ = ["GPT", "HARD_CASES", "WORKLOADS", "Batch", "GPTConfig", "Workload", "get_workload"]


# --- the hard cases ------------------------------------------------------------------------


class FrozenMLP(MLP):
    """A frozen layer and a fixed non-trainable parameter: never reduced, never stepped, but
    still broadcast at construction (a replica with a different frozen weight computes different
    gradients for everything before it)."""

    def __init__(self, d_in: int, d_hidden: int, d_out: int) -> None:
        super().__init__(d_in, d_hidden, d_out)
        self.frozen = nn.Linear(d_in, d_in)
        self.frozen.requires_grad_(False)
        self.scale = nn.Parameter(torch.rand(d_hidden) + 0.5, requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.gelu(self.norm(self.fc1(torch.tanh(self.frozen(x))))) * self.scale
        return self.fc2(h)


class Frozen(Workload):
    name = "frozen"
    summary = "a frozen layer and a fixed requires_grad=False parameter"

    def build(self) -> nn.Module:
        return FrozenMLP(self.d_in, self.d_hidden, self.d_out)


class TiedLM(nn.Module):
    """Embedding and output head share one weight: one parameter, gradients from two uses."""

    def __init__(self, vocab: int, dim: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.mix = nn.Linear(dim, dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.mix(self.embed(tokens))))


class Tied(Workload):
    name = "tied"
    summary = "embedding and output head tied (one shared weight)"
    vocab, dim, seq = 32, 16, 6

    def build(self) -> nn.Module:
        return TiedLM(self.vocab, self.dim)

    def batch(self, step: int, world_size: int) -> Batch:
        g = self._generator(step)
        tokens = torch.randint(
            self.vocab, (self.local_batch * world_size, self.seq + 1), generator=g
        )
        return Batch(tokens[:, :-1], tokens[:, 1:])

    loss = staticmethod(token_loss)


class RoutedMLP(MLP):
    """Branches that are skipped: `sometimes` on every rank in even steps, `one_rank` on every
    rank but the first, and `never` in every step. Skipped means no gradient at all (the branch
    is not in the graph), the case that hangs or corrupts naive hook-driven DDP."""

    def __init__(self, d_in: int, d_hidden: int, d_out: int) -> None:
        super().__init__(d_in, d_hidden, d_out)
        self.sometimes = nn.Linear(d_hidden, d_hidden)
        self.one_rank = nn.Linear(d_hidden, d_hidden)
        self.never = nn.Linear(d_hidden, d_hidden)

    def forward(
        self, x: torch.Tensor, use_sometimes: bool = True, one_rank_mask=None
    ) -> torch.Tensor:
        h = F.gelu(self.norm(self.fc1(x)))
        if use_sometimes:
            h = h + torch.tanh(self.sometimes(h))
        if one_rank_mask is not None and bool(one_rank_mask.any()):
            extra = torch.zeros_like(h)
            extra[one_rank_mask] = torch.tanh(self.one_rank(h[one_rank_mask]))
            h = h + extra
        return self.fc2(h)


class Unused(Workload):
    name = "unused"
    summary = "parameters unused in some steps, on all ranks but one, and always"
    has_unused_parameters = True

    def build(self) -> nn.Module:
        return RoutedMLP(self.d_in, self.d_hidden, self.d_out)

    def batch(self, step: int, world_size: int) -> Batch:
        base = super().batch(step, world_size)
        mask = torch.zeros(base.inputs.shape[0], dtype=torch.bool)
        mask[: self.local_batch] = True  # only rank 0's slice takes the `one_rank` branch
        return replace(base, kwargs={"use_sometimes": step % 2 == 1, "one_rank_mask": mask})


class BufferedMLP(MLP):
    """Buffers of two dtypes: a constant random offset (differs per rank until broadcast), an
    int64 forward counter, and an EMA of a weight. All evolve identically on every rank, so
    after a correct construction broadcast they must stay bitwise equal."""

    def __init__(self, d_in: int, d_hidden: int, d_out: int) -> None:
        super().__init__(d_in, d_hidden, d_out)
        self.register_buffer("offset", torch.randn(d_hidden))
        self.register_buffer("forwards", torch.zeros((), dtype=torch.int64))
        self.register_buffer("fc1_ema", torch.zeros(d_hidden, d_in))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            with torch.no_grad():
                self.forwards += 1
                self.fc1_ema.lerp_(self.fc1.weight, 0.1)
        return self.fc2(F.gelu(self.norm(self.fc1(x) + self.offset)))


class Buffers(Workload):
    name = "buffers"
    summary = "float and int64 buffers updated in forward"

    def build(self) -> nn.Module:
        return BufferedMLP(self.d_in, self.d_hidden, self.d_out)


class MixedMLP(nn.Module):
    """Layers in float32, bfloat16 and float64: one communication buffer per dtype."""

    def __init__(self, d_in: int, d_hidden: int, d_out: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(d_in, d_hidden)
        self.fc2 = nn.Linear(d_hidden, d_hidden).to(torch.bfloat16)
        self.fc3 = nn.Linear(d_hidden, d_out).to(torch.float64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.gelu(self.fc1(x)).to(torch.bfloat16)
        h = F.gelu(self.fc2(h)).to(torch.float64)
        return self.fc3(h).float()


class Mixed(Workload):
    name = "mixed"
    summary = "float32, bfloat16 and float64 layers in one model"

    def build(self) -> nn.Module:
        return MixedMLP(self.d_in, self.d_hidden, self.d_out)


class BF16(Workload):
    name = "bf16"
    summary = "the MLP entirely in bfloat16"

    def build(self) -> nn.Module:
        return MLP(self.d_in, self.d_hidden, self.d_out).to(torch.bfloat16)

    def loss(self, model: nn.Module, batch: Batch) -> torch.Tensor:
        out = model(batch.inputs.to(torch.bfloat16))
        return F.mse_loss(out.float(), batch.targets)


class BF16Linear(nn.Linear):
    """A float32 Linear that computes in bfloat16 (weight, bias and input cast on the way in),
    as autocast or FSDP2's `param_dtype=torch.bfloat16` does: the gradient that reaches the
    float32 parameter is the bfloat16 one, widened, so every rank reduces float32 gradients."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = None if self.bias is None else self.bias.to(torch.bfloat16)
        return F.linear(x.to(torch.bfloat16), self.weight.to(torch.bfloat16), bias)


class BF16ComputeMLP(nn.Module):
    """float32 master weights, bfloat16 compute (mixed precision), one block per layer."""

    def __init__(self, d_in: int, d_hidden: int, d_out: int) -> None:
        super().__init__()
        self.fc1 = BF16Linear(d_in, d_hidden)
        self.fc2 = BF16Linear(d_hidden, d_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


class BF16Compute(Workload):
    """Mixed precision: float32 parameters and gradients, forward and backward in bfloat16.

    One process and every rank run the same bfloat16 ops on the same shard (the reference's
    g_r is rank r's, bitwise), and the gradients reduced are float32: the equivalence
    tolerance is the float32 reduction's (`tolerances.gradient_tolerance` of the gradient's
    dtype), not bfloat16's. FSDP2 is told `compute_dtype` and casts itself
    (`MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=float32)`); the model's own
    casts are then no-ops, so both sides compute the same values."""

    name = "bf16-compute"
    summary = "float32 parameters computed in bfloat16, float32 gradient reduction"
    compute_dtype = torch.bfloat16

    def build(self) -> nn.Module:
        return BF16ComputeMLP(self.d_in, self.d_hidden, self.d_out)


class OddMLP(nn.Module):
    """Parameters of 7, 3, 5 and 1 rows: no world size from 2 to 4 divides most of them, and
    at 4 ranks two have fewer rows than there are ranks (a sharded rung pads them, and some
    ranks hold nothing but padding of them)."""

    def __init__(self, d_in: int, d_out: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(d_in, 7)
        self.fc2 = nn.Linear(7, 3)
        self.gain = nn.Parameter(torch.full((1,), 1.5))
        self.head = nn.Linear(3, d_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.fc2(F.gelu(self.fc1(x)))) * self.gain)


class Odd(Workload):
    name = "odd"
    summary = "parameters of 7, 3, 5 and 1 rows (uneven shards, fewer rows than ranks)"
    d_out = 5

    def build(self) -> nn.Module:
        return OddMLP(self.d_in, self.d_out)


WORKLOADS: dict[str, type[Workload]] = {
    w.name: w
    for w in [
        Workload,
        Frozen,
        Tied,
        Unused,
        Buffers,
        Mixed,
        BF16,
        BF16Compute,
        Odd,
        Transformer,
        Markov,
    ]
}
#: the workloads every implementation must get right (the test suite runs all of them)
HARD_CASES = ("mlp", "frozen", "tied", "unused", "buffers", "mixed", "bf16-compute", "transformer")


def get_workload(name: str, **options) -> Workload:
    """Instantiate a workload by name; ValueError lists the valid names."""
    if name not in WORKLOADS:
        raise ValueError(f"unknown workload {name!r}; choose one of {', '.join(WORKLOADS)}")
    if name not in ("transformer", "markov"):
        options.pop("size_m", None)
    return WORKLOADS[name](**options)
