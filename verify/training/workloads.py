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

import math
from dataclasses import dataclass, field, replace

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

    def loss(self, model: nn.Module, batch: Batch) -> torch.Tensor:
        logits = model(batch.inputs)
        return F.cross_entropy(
            logits.reshape(-1, logits.shape[-1]).float(), batch.targets.reshape(-1)
        )


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


# --- a small GPT ---------------------------------------------------------------------------


@dataclass(frozen=True)
class GPTConfig:
    vocab_size: int = 256
    block_size: int = 32
    n_layer: int = 2
    n_head: int = 2
    n_embd: int = 64

    @classmethod
    def with_params(cls, millions: float) -> GPTConfig:
        """A config of roughly `millions` M parameters (8 layers, 8k vocabulary, 64-wide
        heads): solves 12 * n_layer * d^2 + vocab * d = N for the width d."""
        vocab, layers = 8192, 8
        n = millions * 1e6
        d = (-vocab + math.sqrt(vocab**2 + 4 * 12 * layers * n)) / (2 * 12 * layers)
        d = max(64, int(round(d / 64)) * 64)
        return cls(vocab_size=vocab, block_size=128, n_layer=layers, n_head=d // 64, n_embd=d)


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.n_head = cfg.n_head
        self.ln_1 = nn.LayerNorm(cfg.n_embd)
        self.qkv = nn.Linear(cfg.n_embd, 3 * cfg.n_embd)
        self.proj = nn.Linear(cfg.n_embd, cfg.n_embd)
        self.ln_2 = nn.LayerNorm(cfg.n_embd)
        self.fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd)
        self.fc_proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln_1(x)).split(c, dim=2)
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, c))
        return x + self.fc_proj(F.gelu(self.fc(self.ln_2(x))))


class GPT(nn.Module):
    """nanoGPT-shaped decoder: token and position embeddings, pre-norm blocks, tied head."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.wpe = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))


class Transformer(Workload):
    name = "transformer"
    summary = "a GPT-style decoder (tied embeddings); --model-size sets millions of parameters"

    def __init__(self, *, local_batch: int = 4, seed: int = 0, size_m: float | None = None) -> None:
        super().__init__(local_batch=local_batch, seed=seed)
        self.cfg = GPTConfig() if size_m is None else GPTConfig.with_params(size_m)

    def build(self) -> nn.Module:
        return GPT(self.cfg)

    def batch(self, step: int, world_size: int) -> Batch:
        g = self._generator(step)
        shape = (self.local_batch * world_size, self.cfg.block_size + 1)
        tokens = torch.randint(self.cfg.vocab_size, shape, generator=g)
        return Batch(tokens[:, :-1], tokens[:, 1:])

    loss = Tied.loss


class Markov(Transformer):
    """A language the GPT can learn (`python -m verify train`): sequences walked through a
    fixed random Markov chain in which every token has `branching` possible successors, so
    the loss falls from ln(vocab) towards ln(branching). The global batch of a step is what
    the ranks' `DistributedSampler`s yield at that step (one shuffled permutation of the
    examples per epoch, rank r taking every N-th index from r), in rank order: `shard(r)` is
    rank r's own batch, and one process reading N x the local batch sees the same examples."""

    name = "markov"
    summary = "a GPT (GPT-2 initialization) on a learnable Markov-chain language"
    branching, examples = 4, 8192

    def __init__(self, *, local_batch: int = 8, seed: int = 0, size_m: float | None = None) -> None:
        super().__init__(local_batch=local_batch, seed=seed, size_m=size_m)
        vocab, seq = self.cfg.vocab_size, self.cfg.block_size
        g = torch.Generator().manual_seed(seed)
        successors = torch.randint(vocab, (vocab, self.branching), generator=g)
        choice = torch.randint(self.branching, (self.examples, seq), generator=g)
        self.tokens = torch.empty(self.examples, seq + 1, dtype=torch.long)
        self.tokens[:, 0] = torch.randint(vocab, (self.examples,), generator=g)
        for t in range(seq):
            self.tokens[:, t + 1] = successors[self.tokens[:, t], choice[:, t]]

    def build(self) -> nn.Module:
        model = GPT(self.cfg)
        for module in model.modules():  # GPT-2's initialization: the loss starts near ln(vocab)
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, std=0.02)
                if getattr(module, "bias", None) is not None:
                    nn.init.zeros_(module.bias)
        return model

    def batch(self, step: int, world_size: int) -> Batch:
        from torch.utils.data import DistributedSampler

        per_epoch = self.examples // world_size // self.local_batch
        if per_epoch < 1:
            raise ValueError(f"{self.examples} examples cannot fill one global batch")
        epoch, k = divmod(step - 1, per_epoch)
        rows = []
        for rank in range(world_size):
            sampler = DistributedSampler(range(self.examples), num_replicas=world_size,
                                         rank=rank, seed=self.seed, drop_last=True)  # fmt: skip
            sampler.set_epoch(epoch)  # a new shuffle each epoch, the same on every rank
            rows += list(sampler)[k * self.local_batch : (k + 1) * self.local_batch]
        tokens = self.tokens[rows]
        return Batch(tokens[:, :-1], tokens[:, 1:])

    def param_groups(self, module: nn.Module, lr: float = 1e-3, weight_decay: float = 0.1):
        """Weights decayed, biases and norms not, both at `lr` (as GPT-2 trains)."""
        groups = super().param_groups(module, lr=lr, weight_decay=weight_decay)
        for group in groups:
            group["lr"] = lr
        return groups


WORKLOADS: dict[str, type[Workload]] = {
    w.name: w for w in [Workload, Frozen, Tied, Unused, Buffers, Mixed, BF16, Transformer, Markov]
}
#: the workloads every implementation must get right (the test suite runs all of them)
HARD_CASES = ("mlp", "frozen", "tied", "unused", "buffers", "mixed", "transformer")


def get_workload(name: str, **options) -> Workload:
    """Instantiate a workload by name; ValueError lists the valid names."""
    if name not in WORKLOADS:
        raise ValueError(f"unknown workload {name!r}; choose one of {', '.join(WORKLOADS)}")
    if name not in ("transformer", "markov"):
        options.pop("size_m", None)
    return WORKLOADS[name](**options)
