"""The language-model workloads: a nanoGPT-shaped decoder (`transformer`, any size) and a
learnable Markov-chain language for end-to-end training (`markov`)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from verify.training.data import Batch, Workload, token_loss

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


def parameters_m(size_m: float | None) -> float:
    """The transformer's real size in millions of parameters for `--model-size size_m` (the
    width is rounded to a multiple of 64, so 2 gives 2.7M): what every label prints. Counted
    on the meta device: nothing is allocated."""
    cfg = GPTConfig() if size_m is None else GPTConfig.with_params(size_m)
    with torch.device("meta"):
        return sum(p.numel() for p in GPT(cfg).parameters()) / 1e6


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

    loss = staticmethod(token_loss)


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
